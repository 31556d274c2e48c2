"""Faults at a checkpoint save, survived: the CPU engine's real checkpoints, a real full-disk write
error, Ctrl-C in the middle of a save, and a damaged latest checkpoint.

The trainer's side is verl's own: it writes ``latest_checkpointed_iteration.txt`` only after the
worker's save returned, and a resume loads what :func:`verl...find_latest_ckpt_path` names. So
each fault must leave no ``global_step_N/actor`` folder that resume would take for a checkpoint,
keep the previous one whole, and resume from it must restore the same weights, optimizer and
learning-rate schedule. A damaged checkpoint is refused naming its file and the way back.
"""

from __future__ import annotations

import re
import resource
import signal

import pytest
import torch
from hydra import compose, initialize_config_dir
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.utils.config import omega_conf_to_dataclass

from infmem_verl import conf_dir
from infmem_verl.cpu.checkpoint import CheckpointFiles, load_checkpoint, save_checkpoint
from infmem_verl.cpu.engine import TorchEngine

TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def actor_config():
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=["+recipe=smoke", "actor_rollout_ref.actor.optim.lr=1e-2"])
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _step(engine: TorchEngine) -> None:
    """One real optimizer step, so the optimizer holds state a resume must restore."""
    ids = torch.arange(8).unsqueeze(0)
    engine.model(input_ids=ids).logits.float().pow(2).mean().backward()
    engine.optimizer.step()
    engine.lr_scheduler.step()
    engine.optimizer.zero_grad()


def _state(engine: TorchEngine) -> dict:
    return {"model": {k: v.clone() for k, v in engine.model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for i, s in engine.optimizer.state_dict()["state"].items()},
            "lr": engine.lr_scheduler.state_dict()["last_epoch"]}  # fmt: skip


def _same(a: dict, b: dict) -> bool:
    return (a["lr"] == b["lr"] and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and all(torch.equal(a["optim"][i][k], b["optim"][i][k]) for i in a["optim"] for k in a["optim"][i]))  # fmt: skip


class _InterruptedTokenizer:
    """A tokenizer whose save is where Ctrl-C arrives: the weights and optimizer are written by then."""

    def save_pretrained(self, folder):
        raise KeyboardInterrupt


def test_a_save_cut_by_a_full_disk_or_ctrl_c_leaves_the_previous_checkpoint_and_resume_restores_it(
    actor_config, tiny_model_dir, tokenizer, tmp_path
):
    engine = TorchEngine(str(tiny_model_dir), actor_config)
    _step(engine)
    run = tmp_path / "run"
    save_checkpoint(engine, run / "global_step_1" / "actor", tokenizer)
    (run / TRACKER).write_text("1")  # as verl's trainer does, after the worker's save returned
    saved = _state(engine)
    _step(engine)

    # The disk fills while the weights are written: the write fails with a real OS error.
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, limit[1]))
    try:
        with pytest.raises((OSError, RuntimeError)):  # torch reports it as "iostream error"
            save_checkpoint(engine, run / "global_step_2" / "actor", tokenizer)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(engine, run / "global_step_2" / "actor", _InterruptedTokenizer())
    assert sorted(p.name for p in (run / "global_step_2").iterdir()) == [], "a half-written checkpoint was left"

    latest = find_latest_ckpt_path(str(run))  # verl's resume: the tracker still names step 1
    assert latest == str(run / "global_step_1")
    resumed = TorchEngine(str(tiny_model_dir), actor_config)
    load_checkpoint(resumed, f"{latest}/actor")
    assert _same(_state(resumed), saved)

    # A later save of the same step replaces it whole.
    save_checkpoint(engine, run / "global_step_1" / "actor", tokenizer)
    load_checkpoint(resumed, run / "global_step_1" / "actor")
    assert _same(_state(resumed), _state(engine))


def test_a_damaged_latest_checkpoint_is_refused_naming_the_file_and_leaves_the_engine_as_it_was(
    actor_config, tiny_model_dir, tokenizer, tmp_path
):
    engine = TorchEngine(str(tiny_model_dir), actor_config)
    _step(engine)
    folder = tmp_path / "global_step_3" / "actor"
    save_checkpoint(engine, folder, tokenizer)
    files = CheckpointFiles(folder)
    fresh = TorchEngine(str(tiny_model_dir), actor_config)
    before = _state(fresh)
    data = files.optimizer.read_bytes()
    files.optimizer.write_bytes(data[: len(data) // 2])  # a copy cut short
    with pytest.raises(ValueError, match=rf"{files.optimizer}: cannot be read .*trainer.resume_mode=resume_path"):
        load_checkpoint(fresh, folder)
    files.optimizer.write_bytes(data)
    files.extra.unlink()  # a copy that missed a file
    with pytest.raises(FileNotFoundError, match=rf"{files.extra}: missing; the checkpoint {folder} is incomplete"):
        load_checkpoint(fresh, folder)
    assert _same(_state(fresh), before), "a refused checkpoint must not be half restored"


@pytest.mark.parametrize(
    ("tracker", "folder", "failure"),
    [
        ("", None, r"latest_checkpointed_iteration.txt: expected the number of the latest saved step, got '' \(a save cut short\?\)"),
        ("4", None, r"names step 4, but .*global_step_4 does not exist \(deleted\?\)"),
        ("4", "global_step_4", None),
    ],
)
def test_a_resume_verl_would_stop_on_or_silently_restart_is_refused_before_any_worker_starts(tracker, folder, failure, tmp_path):
    from infmem_verl.preflight import Preflight, check_resume

    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=["+recipe=smoke", "trainer.resume_mode=auto", f"trainer.default_local_dir={tmp_path}"])
    (tmp_path / TRACKER).write_text(tracker)  # verl writes it with open and write: a kill between leaves it empty
    if folder:
        (tmp_path / folder).mkdir()
    report = Preflight()
    check_resume(config, report)
    (check,) = report.checks
    if failure is None:
        assert check.ok and check.detail == f"from step 4 in {tmp_path}"
    else:
        assert not check.ok and check.key == "trainer.resume_mode" and re.search(failure, check.detail), check.detail
        assert "trainer.resume_mode=disable to start over" in check.detail
