"""Learning, for real: GRPO from the warm-up's SFT checkpoint through `python -m infmem_verl.main`
on the CPU backend (verl's own trainer loop), with a reward the model can move.

One subprocess run (a Ray cluster start costs a CPU run most of its time, so it checks everything
at once). It is the last link of the demo chain (distil -> SFT -> GRPO): ``+recipe=demo`` with
``actor_rollout_ref.model.path`` = the small warm-up's SFT output (``warm_model``, conftest.py),
as MemAgent on short documents with a pluggable reward component the model can move on one of the
two questions (at a low sampling temperature, weight decay 0, advantages normalised by their
group's spread), eight steps with three cost levers on: rollout log-probs as
old log-probs (b), rows of zero advantage dropped (c), no reference pass at KL 0 (d).

* the reward rises, every update changes the weights, and the generation actor serves exactly
  the last update's weights, never anything else;
* each lever cuts only its pass, as the cost ledger (``infmem/cost/...``) and the trajectory
  records show;
* the replay buffer hands the rollout over within its poll (0.2 s) of the slowest trajectory;
* the console is the readable one (no ``-v``): the backend line, one compact line per step and
  per validation, the end table with the paths, verl's and Ray's output in ``run.log``.

The smoke recipe's own run (Ctrl-C, checkpoints, resume, the ledger with the levers off) is
checked in tests/test_metrics_tb.py. Per-step metrics are read from verl's own file logger
(``VERL_FILE_LOGGER_PATH``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from conftest import DISTILLED_DEMO

TESTS_DIR = Path(__file__).parent
RUN_TIMEOUT_S = 1200  # a hang guard: 253 s alone, 431 s beside the other xdist worker
STEPS = 8  # how fast the reward rises varies from run to run (see the rise below)


def ascii_letters(record) -> float:
    """Reward component: the fraction of the answer's characters that are ASCII letters or spaces.

    A random tiny model samples from ~150k tokens, most of them not plain ASCII words; at a low
    temperature its few likely tokens per context can be pushed towards ASCII ones in a step or
    two, so this reward moves (unlike exact match, which stays 0 and gives no gradient).
    Imported by the reward worker as ``test_cpu_training_runs.ascii_letters``.
    """
    text = record.solution_str
    return sum(c.isascii() and (c.isalpha() or c == " ") for c in text) / max(len(text), 1)


def ascii_letters_of_odd_questions(record) -> float:
    """Reward component: :func:`ascii_letters` for odd-indexed questions, 0 for even-indexed ones.

    The even question's group always scores 0, a GRPO group of exactly zero advantage, so the
    zero-advantage lever has rows to drop in every step; the odd one's group learns. Imported by
    the agent-loop workers as ``test_cpu_training_runs.ascii_letters_of_odd_questions``.
    """
    return ascii_letters(record) if int(record.extra_info["index"]) % 2 else 0.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpu_runs")


def _env(metrics: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
        "VERL_FILE_LOGGER_PATH": str(metrics),
    }
    env.pop("INFMEM_VERBOSE", None)  # the console a person reads
    return env


def _metrics(path: Path) -> list[dict]:
    """verl's file-logger records, one per training step, in step order."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["data"] for r in sorted(records, key=lambda r: r["step"])]


def _check_console(console: str, record_dir: Path) -> None:
    """The console mode's output: what a person reads, verl's and Ray's output in the log file."""
    lines = console.splitlines()
    assert any(line.startswith("[infmem] backend: cpu") for line in lines)
    log = (record_dir / "run.log").resolve()
    assert f"[infmem] training; verl's and Ray's full output: {log} (-v or INFMEM_VERBOSE=1 shows it here)" in lines
    steps = [line.split(" |")[0] for line in lines if line.startswith("[infmem] step")]
    assert steps == [f"[infmem] step {n}/{STEPS}" for n in range(1, STEPS + 1)]
    assert sum(line.startswith("[infmem] validation") for line in lines) == 1
    table = lines[lines.index("[infmem] run summary") :]
    for label in ("reward", "accuracy", "chunks read", "stop rate", "LLM calls", "time:", "TensorBoard", "steps", "summary plot", "full log"):
        assert any(line.strip().startswith(label) for line in table), (label, table)
    assert len(lines) < 40 + STEPS, console  # not verl's metric dumps
    assert not any("engine is not available" in line or "(TaskRunner" in line for line in lines)
    text = log.read_text()
    assert "(TaskRunner" in text  # Ray's forwarded worker output went to the file
    assert "should not exceed total physical CPU cores" not in text  # TransferQueue's threads capped
    assert (record_dir / "run_summary.png").is_file()


def _zero_advantage(trajectories: list[dict]) -> list[bool]:
    """Per trajectory: its reward equals its GRPO group's mean (so its advantage is exactly 0)."""
    groups: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        groups[t["key"].rsplit("_", 1)[0]].append(t["values"]["reward"])
    return [
        abs(t["values"]["reward"] - sum(groups[g]) / len(groups[g])) < 1e-9
        for t, g in ((t, t["key"].rsplit("_", 1)[0]) for t in trajectories)
    ]


def test_grpo_from_the_sft_checkpoint_raises_a_moveable_reward_with_levers_b_c_d(workdir, warm_model):
    from infmem_verl.cpu.engine import load_model
    from infmem_verl.cpu.server import weights_digest
    from infmem_verl.run_record import RunRecord

    overrides = [
        "+recipe=demo",
        *DISTILLED_DEMO,
        "agent=memagent",  # the cheapest rows: a Write per chunk and the answer
        f"actor_rollout_ref.model.path={warm_model}",
        f"data.train_files={workdir}/learn_train.parquet",
        f"data.val_files={workdir}/learn_val.parquet",
        "infmem.bootstrap.doc_tokens=1600",
        "infmem.bootstrap.train_samples=2",
        "infmem.agent.document={chunk_tokens:800,unit_tokens:200,unit_overlap:40,paragraph_units:false}",
        "trainer.logger=[console,file]",
        "reward_fn=outcome",
        "infmem.reward.components.outcome.weight=0",
        "+infmem.reward.components.ascii={_target_:test_cpu_training_runs.ascii_letters_of_odd_questions,weight:1.0}",
        "infmem.agent.memory_tokens=16",
        "infmem.agent.write={prompt_tokens:null,thinking_tokens:8,output_tokens:16}",
        "infmem.agent.answer={prompt_tokens:1024,thinking_tokens:8,output_tokens:16}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=0.05",
        "actor_rollout_ref.rollout.top_p=1.0",  # the rule below was measured without the demo's nucleus
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "algorithm.norm_adv_by_std_in_grpo=true",  # advantages keep their scale as a group agrees
        "infmem.train.optimizer_steps_per_rl_step=1",
        "algorithm.rollout_correction.bypass_mode=true",  # b
        "infmem.cost.drop_zero_advantage=true",  # c
        "actor_rollout_ref.actor.kl_loss_coef=0",  # d
        f"trainer.total_training_steps={STEPS}",
        f"trainer.test_freq={STEPS}",  # one validation, after the last step
    ]
    metrics = workdir / "learn_metrics.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "infmem_verl.main", *overrides],
        cwd=workdir, env=_env(metrics), capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-4000:]
    records = _metrics(metrics)
    assert len(records) == STEPS
    record_dir = workdir / "tensorboard_log" / "infmem_verl" / "demo_memagent_agent"  # the demo names it per agent
    _check_console(console, record_dir)

    rewards = [r["infmem/ascii"] for r in records]  # half the odd question's mean (the even one's is 0)
    assert all(r["infmem/reward"] == pytest.approx(a) for r, a in zip(records, rewards, strict=True))
    # The first step sampled the SFT checkpoint; the ceiling is 0.5 (every odd answer all letters).
    # The last four steps' median must close a third of the gap. Measured, five 8-step runs: first
    # 0.26-0.34, last four's median 0.47-0.49 (one fell to 0.09 at step 3 and was back at 0.46 at
    # step 4); in four 5-step runs the slowest read 0.27, 0.35, 0.33, 0.36, 0.40. Without the std
    # normalisation a group's advantages shrink with its spread, Adam's steps fade after the first
    # (grad norm 0.34 -> 0.003) and a run can stall: a CI run read 0.37 -> 0.40 in 5 steps. With
    # the normalisation a run can still stall once every group agrees (temperature 0.05): a
    # 2026-12-04 suite run read 0.26, 0.20, 0.09, then 0.358 for five steps (40% of the gap
    # closed; alone the same test passed). The bar is a third of the gap, under every run measured.
    gap = 0.5 - rewards[0]
    assert statistics.median(rewards[-4:]) > rewards[0] + gap / 3, f"reward did not rise: {rewards}"

    served = weights_digest(load_model(str(warm_model)))  # the SFT checkpoint the run starts from
    run_records = RunRecord(record_dir)
    dropped_in_some_step = False
    waits = []  # per step: the rollout's time after its slowest trajectory had finished
    for step, record in enumerate(records, 1):
        weights = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("cpu/weights/")}
        trajectories = run_records.trajectories(step)
        waits.append(record["timing_s/gen"] - max(t["values"]["rollout_s"] for t in trajectories))
        zero = _zero_advantage(trajectories)
        # The actor serves the previous update's weights for the whole rollout (validation and
        # everything else between two updates leave them alone)...
        assert weights["before_rollout"] == weights["after_rollout"] == served, f"step {step}"
        # ...the update changes them (no gradient only when every group agreed), and the sync
        # makes the actor serve exactly the new ones.
        if all(zero):
            assert record["actor/grad_norm"] == 0, f"step {step}"
        else:
            assert record["actor/grad_norm"] > 0 and weights["engine_after_update"] != served, f"step {step}"
        assert weights["after_sync"] == weights["engine_after_update"], f"step {step}"
        served = weights["after_sync"]
        assert record["training/off_policy/trajectory_staleness/max"] == 0

        cost = {k.removeprefix("infmem/cost/"): v for k, v in record.items() if k.startswith("infmem/cost/")}
        # b and d: verl's old-log-prob and reference passes did not run (their metrics and timers are absent).
        assert cost["old_log_prob_tokens"] == cost["reference_tokens"] == 0, f"step {step}"
        assert "actor/entropy" not in record and "timing_s/ref" not in record and "infmem/log_prob_gap/mean" not in record
        # c: only rows without gradient left the update (trajectories at their group's mean reward,
        # verl's padding rows), every other row trained; with no gradient anywhere nothing is dropped.
        turns = [len(t["turns"]) for t in trajectories]
        assert cost["rows"] == cost["update_rows"] + cost["dropped_rows"], f"step {step}"
        assert cost["dropped_rows"] <= sum(n for n, z in zip(turns, zero) if z) + cost["padding_rows"], f"step {step}"
        assert cost["update_rows"] >= sum(n for n, z in zip(turns, zero) if not z), f"step {step}"
        if any(zero) and not all(zero):
            assert cost["dropped_rows"] > 0, f"step {step}"
            dropped_in_some_step = True
    assert dropped_in_some_step  # the even question's group, while the odd one still varies
    # The replay buffer sees the last trajectory within its poll (REPLAY_POLL_S, 0.2 s), not verl's
    # 2 s. Measured per step (2026-12-06): this run 0.20-0.55 s (mean 0.33), two demo runs 0.15-0.64 s
    # (means 0.32, 0.30); with the poll at 2 s this run read 0.92-2.06 s and failed, a demo run 0.60-
    # 2.04 s (mean 1.45), whose mean over 8 steps falls under 1 s about one run in fifteen.
    assert statistics.mean(waits) < 1.0, waits
