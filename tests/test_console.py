"""The launcher's console mode (:mod:`infmem_verl.console`) around a real process's output: what a
child process, Python and the C level print goes to ``run.log``; the console gets one line per
step and per validation from the run's own records, then the end table with the paths.

The full run in console mode (``python -m infmem_verl.main +recipe=demo`` from the warm-up's SFT
checkpoint) is the learning run of tests/test_cpu_training_runs.py.
"""

from __future__ import annotations

import io
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
