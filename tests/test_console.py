"""The launcher's console mode (:mod:`infmem_verl.console`) around a real process's output: what a
child process, Python and the C level print goes to ``run.log``; the console gets one line per
step and per validation from the run's own records, then the end table with the paths.

The full run in console mode (``python -m infmem_verl.main +recipe=demo`` from the warm-up's SFT
checkpoint) is the learning run of tests/test_cpu_training_runs.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import subprocess
import sys
import warnings

from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir

from infmem_verl.console import LOG_FILE, _Follower, console_mode, silence_known_warnings, take_verbose_flag
from infmem_verl.run_record import RunRecord


def smoke_config(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=["+recipe=smoke", *overrides])


def step_metrics(reward: float, val: bool) -> dict[str, float]:
    metrics = {
        "infmem/reward": reward, "infmem/outcome": 0.0, "infmem/early_stop": reward / 2, "infmem/protocol": reward,
        "infmem/acc": 0.0, "infmem/chunks_read": 2.5, "infmem/num_chunks": 4.0, "infmem/trajectories": 4.0,
        "infmem/stopped": 0.5, "infmem/stop_step": 2.0, "infmem/llm_calls": 7.0, "actor/grad_norm": 0.5,
        "timing_s/step": 10.0, "timing_s/gen": 6.0, "timing_s/update_actor": 3.0,
    }  # fmt: skip
    if val:
        metrics |= {"val-infmem/reward": reward, "val-infmem/acc": 0.0, "val-core/synthetic/reward/mean@1": reward}
        metrics |= {"val-core/synthetic/acc/mean@1": 0.0, "timing_s/testing": 4.0}
    return metrics


def test_console_mode_shows_compact_lines_and_sends_everything_else_to_the_log(tmp_path, capfd, monkeypatch):
    monkeypatch.delenv("INFMEM_VERBOSE", raising=False)
    config = smoke_config(f"infmem.records.dir={tmp_path}", "trainer.total_training_steps=2")
    record = RunRecord(tmp_path)
    with console_mode(config):
        print("a verl metrics dump", flush=True)
        os.write(2, b"C-level stderr\n")
        subprocess.run([sys.executable, "-c", "print('(TaskRunner pid=1) a Ray worker line')"], check=True)
        record.log_step(1, step_metrics(0.5, val=False))
        record.log_step(2, step_metrics(0.75, val=True))
    console = capfd.readouterr().out.splitlines()
    log = (tmp_path / LOG_FILE).read_text()
    for text in ("a verl metrics dump", "C-level stderr", "(TaskRunner pid=1) a Ray worker line"):
        assert text in log and not any(text in line for line in console)
    assert console[0] == f"[infmem] training; verl's and Ray's full output: {tmp_path / LOG_FILE} (-v or INFMEM_VERBOSE=1 shows it here)"
    assert console[1].startswith("[infmem] step 1/2 | reward 0.500 (outcome 0.000, early_stop 0.250, protocol 0.500)")
    assert console[2].startswith("[infmem] step 2/2 | reward 0.750")
    assert console[3].startswith("[infmem] validation | reward 0.750 | acc 0.000") and console[3].endswith("(step 2)")
    table = console[4:]
    assert table[0] == "[infmem] run summary"
    assert table[2].split() == ["reward", "0.750", "0.750"]  # last training step, last validation
    assert [row.split()[0] for row in table[3:6]] == ["outcome", "early_stop", "protocol"]
    assert "RL steps 20s (generation 12s, update 6s, validation 4s)" in table[-4]
    assert table[-3].split() == ["TensorBoard", str(tmp_path)]
    assert table[-1].split() == ["full", "log", str(tmp_path / LOG_FILE)]


def test_the_console_shows_this_runs_steps_only(tmp_path):
    """A resumed run does not repeat the steps it kept; a run from the start (the trainer moves the
    earlier records aside) shows its own steps although their numbers were seen before."""
    record = RunRecord(tmp_path)
    record.log_step(1, step_metrics(0.5, val=False))
    resumed = _Follower(record, io.StringIO(), 2, ["outcome"])
    record.log_step(2, step_metrics(0.7, val=True))
    resumed.poll()
    assert [line.split(" |")[0] for line in resumed.out.getvalue().splitlines()] == ["[infmem] step 2/2", "[infmem] validation"]

    fresh = _Follower(record, io.StringIO(), 2, ["outcome"])
    moved = record.start_fresh()
    assert record.steps() == [] and len((moved / "steps.jsonl").read_text().splitlines()) == 2
    record.log_step(1, step_metrics(0.25, val=False))
    fresh.poll()
    assert fresh.out.getvalue().startswith("[infmem] step 1/2 | reward 0.250")
    assert record.start_fresh() is not None and record.start_fresh() is None  # nothing left to move


def test_verbose_flag_is_taken_off_the_command_line(monkeypatch):
    monkeypatch.delenv("INFMEM_VERBOSE", raising=False)
    argv = ["main", "+recipe=smoke", "-v"]
    assert take_verbose_flag(argv) and argv == ["main", "+recipe=smoke"]
    assert os.environ["INFMEM_VERBOSE"] == "1"


def test_known_harmless_warnings_are_silenced_where_they_are_raised():
    silence_known_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        silence_known_warnings()  # catch_warnings reset the filters
        import importlib

        import verl.workers.engine

        importlib.reload(verl.workers.engine)  # raises its "engine is not available" warnings again
    assert not [w for w in caught if "engine is not available" in str(w.message)]
    from verl.plugin.platform import platform_manager

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(platform_manager.__name__)
    logger.addHandler(handler)
    try:
        platform_manager._create_platform("nvidia")  # warns on a machine without CUDA
    finally:
        logger.removeHandler(handler)
    assert not records


def test_the_end_table_compares_the_first_and_last_validation_against_two_standard_errors():
    from infmem_verl.console import end_table

    def val(step, acc, outcome, protocol):
        values = {"reward": outcome, "acc": acc, "outcome": outcome, "protocol": protocol, "trajectories": 64.0}
        return {"step": step} | {f"val-infmem/{k}": v for k, v in values.items()}

    steps = [val(0, 0.25, 0.25, 0.98), {"step": 1, "infmem/reward": 0.3}, val(8, 0.5, 0.3, 0.83)]
    lines = end_table(steps, ["outcome", "protocol"], {"training": 1.0})
    at = lines.index("  held out, validation at step 0 -> 8 (64 trajectories; 2 SE of the last mean):")
    # 2 * sqrt(.5 * .5 / 64) = .125 < +.25; 2 * sqrt(.3 * .7 / 64) = .115 > +.05
    assert lines[at + 1].split() == ["acc", "0.250", "->", "0.500", "(+0.250;", "2", "SE", "0.125:", "above", "noise)"]
    assert lines[at + 2].split()[-2:] == ["within", "noise)"] and "0.115" in lines[at + 2]
    # A fall past two standard errors says so (a GRPO run that broke the protocol read "within").
    assert lines[at + 3].split()[-5:] == ["2", "SE", "0.094:", "below", "noise)"]  # 2 * sqrt(.83 * .17 / 64)
    assert not any("held out" in line for line in end_table(steps[:2], ["outcome"], {}))  # one validation: no comparison


def test_the_run_summary_compares_infmem_with_memagent_once_both_records_lie_side_by_side(tmp_path):
    from infmem_verl.console import agent_gap
    from infmem_verl.run_record import RunRecord

    def validate(folder: str, step: int, acc: float, trajectories: int = 128) -> None:
        RunRecord(tmp_path / folder).log_step(step, {"val-infmem/acc": acc, "val-infmem/reward": acc, "val-infmem/trajectories": trajectories})

    for folder in ("demo_infmem_agent", "demo_memagent_agent"):
        RunRecord(tmp_path / folder).write_identity(IDENTITY)
    validate("demo_infmem_agent", 0, 0.5)
    validate("demo_infmem_agent", 8, 0.6)
    assert agent_gap(tmp_path / "demo_infmem_agent") == []  # MemAgent has not run
    validate("demo_memagent_agent", 0, 0.375)
    validate("demo_memagent_agent", 8, 0.5)
    lines = agent_gap(tmp_path / "demo_memagent_agent")  # either run prints it, InfMem first
    assert lines == agent_gap(tmp_path / "demo_infmem_agent") and len(lines) == 3
    assert lines[0].startswith("  InfMem over MemAgent, held-out accuracy (128 trajectories each;")
    # 2 * sqrt((.5 * .5 + .375 * .625) / 128) = .1230 < +.125; 2 * sqrt((.6 * .4 + .5 * .5) / 128) = .1237 > +.1
    assert lines[1].split()[2:] == ["(steps", "0", "/", "0):", "0.500", "vs", "0.375", "(+0.125;", "2", "SE", "0.123:", "above", "noise)"]
    assert lines[2].split()[-6:] == ["(+0.100;", "2", "SE", "0.124:", "within", "noise)"]
    # Validations of different sizes are not the same documents; a folder named for no agent has no pair.
    validate("demo_memagent_agent", 9, 0.5, trajectories=64)
    assert agent_gap(tmp_path / "demo_infmem_agent") == []
    assert agent_gap(tmp_path / "smoke") == []


IDENTITY = {"model": "/cache/warm-qwen3-a/model", "model_files": {"model.safetensors": [10, 1]},
            "val_files": {"/data/val.parquet": "ab12"}, "val_sampling": {"temperature": 0.6, "n": 1}}  # fmt: skip


def test_runs_from_other_students_or_validations_are_not_compared_and_the_line_says_why(tmp_path):
    """The demo run with other warm-up settings trains another student, in the same records folder
    as before: MemAgent's records beside it are the earlier student's. The summary says the two
    differ instead of setting one student's accuracy against another's."""
    from infmem_verl.console import agent_gap

    infmem, memagent = RunRecord(tmp_path / "demo_infmem_agent"), RunRecord(tmp_path / "demo_memagent_agent")
    for record, acc in ((infmem, 0.625), (memagent, 0.25)):
        record.log_step(0, {"val-infmem/acc": acc, "val-infmem/reward": acc, "val-infmem/trajectories": 128})
    infmem.write_identity(IDENTITY)
    (line,) = agent_gap(infmem.directory)  # MemAgent's records were written without one
    assert line == (
        f"  InfMem over MemAgent: not compared: MemAgent's records hold no run.json (written by runs from step 0),"
        f" so whether both runs share a model and validation is unknown ({memagent.directory})"
    )
    rebuilt = {**IDENTITY, "model_files": {"model.safetensors": [10, 2]}}  # the same folder, built again
    for other, named in (
        (rebuilt, "model"),
        ({**IDENTITY, "model": "/cache/warm-qwen3-b/model"}, "model"),
        ({**IDENTITY, "val_files": {"/data/val.parquet": "cd34"}}, "validation documents"),
        ({**rebuilt, "val_sampling": {"temperature": 1.0, "n": 1}}, "model, validation sampling"),
    ):
        memagent.write_identity(other)
        assert agent_gap(infmem.directory) == [
            f"  InfMem over MemAgent: not compared: the two runs differ in {named} ({memagent.directory}: run.json);"
            " run both agents with the same settings"
        ]
        assert agent_gap(memagent.directory)[0].endswith(f"({infmem.directory}: run.json); run both agents with the same settings")
    memagent.write_identity(IDENTITY)
    assert agent_gap(infmem.directory)[1].split()[-9:] == ["0.625", "vs", "0.250", "(+0.375;", "2", "SE", "0.115:", "above", "noise)"]


def test_the_run_identity_names_the_model_files_validation_bytes_and_sampling(tmp_path):
    """``run.json`` as the trainer writes it from the run's config (the smoke recipe's, real files):
    a model rebuilt in its folder, or validation questions or their documents with other bytes,
    change it; the same bytes written again do not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from infmem_verl.data.documents import pack_documents
    from infmem_verl.run_record import identity_differences, run_identity

    model, val, store = tmp_path / "model", tmp_path / "val.parquet", tmp_path / "val_docs.parquet"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    refs = pack_documents(["The Louvre is in Paris."], store)
    pq.write_table(pa.table({"prompt": ["Where is the Louvre?"], "document_ref": refs}), val)
    config = smoke_config(f"actor_rollout_ref.model.path={model}", f"data.val_files={val}")
    identity = run_identity(config)
    assert identity["model"] == str(model) and sorted(identity["model_files"]) == ["config.json", "model.safetensors"]
    digest = {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in (val, store)}
    assert identity["val_files"] == {str(val): digest[val], str(store): digest[store]}
    assert identity["val_sampling"]["temperature"] == config.actor_rollout_ref.rollout.val_kwargs.temperature

    record = RunRecord(tmp_path / "records")
    record.write_identity(identity)
    assert record.identity() == identity  # what a later run reads back
    pack_documents(["The Louvre is in Paris."], store)  # written again, same bytes (the bootstrap does)
    assert identity_differences(run_identity(config), identity) == []
    pack_documents(["The Louvre is in Lyon."], store)  # another document under the question
    assert identity_differences(run_identity(config), identity) == ["validation documents"]
    os.utime(model / "model.safetensors", ns=(1, 1))  # the folder's student built again
    assert identity_differences(run_identity(config), identity) == ["model", "validation documents"]
    hub = smoke_config("actor_rollout_ref.model.path=Qwen/Qwen3-4B", f"data.val_files=[{val},{tmp_path}/remote.parquet]")
    assert run_identity(hub)["model_files"] == {} and run_identity(hub)["val_files"][f"{tmp_path}/remote.parquet"] == ""
    assert run_identity(smoke_config(f"actor_rollout_ref.model.path={model}", "data.val_files=null"))["val_files"] == {}
    colder = smoke_config(f"actor_rollout_ref.model.path={model}", f"data.val_files={val}", "actor_rollout_ref.rollout.val_kwargs.temperature=0.3")
    assert identity_differences(run_identity(colder), run_identity(config)) == ["validation sampling"]
    # A run from step 0 moves the earlier run's run.json aside with its steps.
    record.log_step(0, {"val-infmem/acc": 0.5})
    moved = record.start_fresh()
    assert record.identity() is None and json.loads((moved / "run.json").read_text()) == identity
