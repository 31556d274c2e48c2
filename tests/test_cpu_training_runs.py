"""`python -m infmem_verl.main +recipe=smoke` for real, as `make smoke` runs it, on short documents.

Two subprocess runs of the CPU backend through verl's own trainer loop:

* the smoke recipe (InfMem, default reward) on 2400-token documents: it builds its own model and
  data, prints every per-step figure, validates once, and a Ctrl-C during the next step stops
  every Ray process it started;
* learning: MemAgent with a reward the random tiny model can move (a pluggable component, at a
  low sampling temperature, weight decay 0): the reward rises, every update changes the weights,
  and the generation actor serves exactly the last update's weights, never anything else.

Two one-step runs check the cost ledger (``infmem/cost/...``) against verl's own token count and
the trajectory records, with the levers off and with rollout log-probs as old log-probs, dropped
zero-advantage rows and no reference pass.

Per-step metrics are read from verl's own file logger (``VERL_FILE_LOGGER_PATH``).
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import psutil
import pytest

TESTS_DIR = Path(__file__).parent
RUN_TIMEOUT_S = 900


def ascii_letters(record) -> float:
    """Reward component: the fraction of the answer's characters that are ASCII letters or spaces.

    A random tiny model samples from ~150k tokens, most of them not plain ASCII words; at a low
    temperature its few likely tokens per context can be pushed towards ASCII ones in a step or
    two, so this reward moves (unlike exact match, which stays 0 and gives no gradient).
    Imported by the reward worker as ``test_cpu_training_runs.ascii_letters``.
    """
    text = record.solution_str
    return sum(c.isascii() and (c.isalpha() or c == " ") for c in text) / max(len(text), 1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cpu_runs")


def _env(workdir: Path, metrics: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "INFMEM_CACHE": str(workdir / "cache"),  # where the smoke recipe builds its tiny model
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])),
        "VERL_FILE_LOGGER_PATH": str(metrics),
        "INFMEM_VERBOSE": "1",  # verl's and Ray's full output on stdout, where these tests read it
    }


def _short_smoke(workdir: Path, name: str, doc_tokens: int) -> list[str]:
    """The smoke recipe on short documents (chunks of 800 tokens), its data under ``workdir``."""
    return [
        "+recipe=smoke",
        f"data.train_files={workdir / name}_train.parquet",
        f"data.val_files={workdir / name}_val.parquet",
        f"infmem.bootstrap.doc_tokens={doc_tokens}",
        "infmem.agent.document={chunk_tokens:800,unit_tokens:200,unit_overlap:40,paragraph_units:false}",
        "trainer.logger=[console,file]",
    ]


def _launch(workdir: Path, name: str, overrides: list[str]) -> tuple[subprocess.Popen, Path]:
    metrics = workdir / f"{name}_metrics.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "infmem_verl.main", *overrides],
        cwd=workdir,
        env=_env(workdir, metrics),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, metrics


def _lines(process: subprocess.Popen) -> queue.Queue:
    """The process's output lines, read by a thread so that waiting for one can time out."""
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _read_until(lines: queue.Queue, pattern: str, seen: list[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r}; output ends with:\n{''.join(seen[-40:])}")


def _metrics(path: Path) -> list[dict]:
    """verl's file-logger records, one per training step, in step order."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["data"] for r in sorted(records, key=lambda r: r["step"])]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


STEP_LINE = (
    r"\[infmem cpu\] step {step}/3 \| reward \d\.\d{{3}} \(outcome \d\.\d{{3}}, early_stop \d\.\d{{3}}, "
    r"protocol \d\.\d{{3}}\) \| acc \d\.\d{{3}} \| chunks read 3\.0/3\.0 \| stopped \d/4 at step \S+ \| "
    r"llm calls \d+\.\d/traj \| optimizer steps 2 \| loss \S+ \(pg \S+\) \| grad norm \S+ \| "
    r"rollout-vs-engine prob diff \S+ \| \d+\.\ds"
)


def test_smoke_recipe_trains_validates_and_stops_every_ray_process_on_ctrl_c(workdir):
    # Three steps with validation after the second: the smoke run's 2 steps + 1 validation pass,
    # then Ctrl-C while the third step is running.
    overrides = [*_short_smoke(workdir, "smoke", doc_tokens=2400), "trainer.total_training_steps=3"]
    process, metrics = _launch(workdir, "smoke", overrides)
    lines, seen = _lines(process), []
    try:
        _read_until(lines, r"\[infmem\] model: tiny random Qwen3 with the real Qwen3 tokenizer at ", seen, 300)
        _read_until(lines, r"\[infmem\] data\.train_files: wrote 4 synthetic two-hop questions", seen, 300)
        _read_until(lines, r"\[infmem\] backend: cpu \(no GPU in this machine\)", seen, 300)
        # verl validates before it computes the step's metrics: the validation line comes first.
        _read_until(lines, STEP_LINE.format(step=1), seen, RUN_TIMEOUT_S)
        _read_until(
            lines, r"\[infmem cpu\] validation \| reward \S+ \| acc \S+ \| chunks_read 3\.000", seen, RUN_TIMEOUT_S
        )
        _read_until(lines, STEP_LINE.format(step=2), seen, 300)
        started = [p.pid for p in psutil.Process(process.pid).children(recursive=True)]
        names = " ".join(" ".join(psutil.Process(p).cmdline()) for p in started if _alive(p))
        for actor in ("TaskRunnerV1", "CPUGenerationServer", "AgentLoopWorkerTQ", "RewardLoopWorker"):
            assert actor in names
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    _read_until(lines, r"\[infmem\] interrupted: stopping the Ray workers this run started", seen, 10)
    assert process.returncode != 0
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(1)
    assert not [p for p in started if _alive(p)], "Ray processes survived Ctrl-C"

    records = _metrics(metrics)
    assert len(records) == 2
    for record in records:
        assert record["training/off_policy/trajectory_staleness/max"] == 0  # rollouts used the last update
        assert record["infmem/num_chunks"] == 3 and record["infmem/trajectories"] == 4
        assert record["training/rollout_probs_diff_max"] < 1e-3  # engine recomputes what was sampled
    assert any(key.startswith("val-core/") and key.endswith("/acc/mean@1") for key in records[1])


def test_a_moveable_reward_rises_and_the_generation_actor_serves_each_update(workdir, tiny_model_dir):
    from infmem_verl.cpu.engine import load_model
    from infmem_verl.cpu.server import weights_digest

    overrides = [
        *_short_smoke(workdir, "learn", doc_tokens=1600),
        "agent=memagent",
        f"actor_rollout_ref.model.path={tiny_model_dir}",
        "infmem.bootstrap.train_samples=2",
        "reward_fn=outcome",
        "infmem.reward.components.outcome.weight=0",
        "+infmem.reward.components.ascii={_target_:test_cpu_training_runs.ascii_letters,weight:1.0}",
        "infmem.agent.memory_tokens=16",
        "infmem.agent.write={prompt_tokens:null,thinking_tokens:8,output_tokens:16}",
        "infmem.agent.answer={prompt_tokens:1024,thinking_tokens:8,output_tokens:16}",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=0.05",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.optim.weight_decay=0",
        "infmem.train.optimizer_steps_per_rl_step=1",
        "trainer.total_training_steps=5",
        "trainer.test_freq=-1",
    ]
    process, metrics = _launch(workdir, "learn", overrides)
    output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, output[-4000:]
    assert "[infmem cpu] step 5/5 | reward" in output
    records = _metrics(metrics)
    assert len(records) == 5

    rewards = [r["infmem/ascii"] for r in records]
    assert all(r["infmem/reward"] == pytest.approx(a) for r, a in zip(records, rewards, strict=True))
    # At this learning rate the policy may collapse for a step and recover (one CI run read
    # 0.39, 0.75, 0.88, 0.17, 0.97), so the four updated steps together must be well above the
    # first, which sampled the untrained model (typically ~0.4 -> ~0.9).
    assert sum(rewards[1:]) / 4 > rewards[0] + 0.2, f"reward did not rise: {rewards}"

    served = weights_digest(load_model(str(tiny_model_dir)))  # the checkpoint the run starts from
    for step, record in enumerate(records, 1):
        weights = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("cpu/weights/")}
        # The actor serves the previous update's weights for the whole rollout (validation and
        # everything else between two updates leave them alone)...
        assert weights["before_rollout"] == weights["after_rollout"] == served, f"step {step}"
        # ...the update changes them, and the sync makes the actor serve exactly the new ones.
        assert record["actor/grad_norm"] > 0 and weights["engine_after_update"] != served, f"step {step}"
        assert weights["after_sync"] == weights["engine_after_update"], f"step {step}"
        served = weights["after_sync"]
        assert record["training/off_policy/trajectory_staleness/max"] == 0
        assert record["training/rollout_probs_diff_max"] < 1e-3


# ------------------------------------------------------------------------ the cost ledger


def uneven_groups(record) -> float:
    """Reward component: 0 for every rollout of an even-indexed question (a GRPO group of zero
    advantage), a hash of the answer text otherwise (different for every rollout). Imported by the
    agent-loop workers as ``test_cpu_training_runs.uneven_groups``."""
    if int(record.extra_info["index"]) % 2 == 0:
        return 0.0
    return (zlib.crc32(record.solution_str.encode()) % 997 + 1) / 997


def _cost_run(workdir: Path, name: str, overrides: list[str]) -> tuple[dict, list[dict]]:
    """One RL step of the short smoke run; its step metrics and its trajectory records."""
    records = workdir / f"{name}_records"
    base = [
        *_short_smoke(workdir, name, doc_tokens=1600),
        f"infmem.records.dir={records}",
        "trainer.total_training_steps=1",
        "trainer.test_freq=-1",
    ]
    process, metrics = _launch(workdir, name, [*base, *overrides])
    output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, output[-4000:]
    from infmem_verl.run_record import RunRecord

    (record,) = _metrics(metrics)
    return record, RunRecord(records).trajectories(1)


def test_the_cost_ledger_counts_what_the_step_processed(workdir):
    record, trajectories = _cost_run(workdir, "cost", [])
    cost = {k.removeprefix("infmem/cost/"): v for k, v in record.items() if k.startswith("infmem/cost/")}
    turns = [turn for t in trajectories for turn in t["turns"]]
    assert cost["rows"] == len(turns) + cost["padding_rows"]
    # verl's own count of the batch's tokens (from the token tensors in TransferQueue, padding
    # rows of 128 tokens included): every pass got the whole batch.
    real_tokens = sum(t["prompt_tokens"] + t["response_tokens"] for t in turns)
    assert record["perf/total_num_tokens"] == real_tokens + 128 * cost["padding_rows"]
    assert cost["old_log_prob_tokens"] == cost["reference_tokens"] == cost["update_tokens"] == record["perf/total_num_tokens"]
    assert cost["update_rows"] == cost["rows"] and cost["trainer_tokens"] == 3 * record["perf/total_num_tokens"]
    # The rollout side matches the turns the agent loops recorded.
    assert cost["llm_calls"] == sum(t["llm_calls"] for t in turns) == record["infmem/llm_calls"] * len(trajectories)
    assert cost["prefill_tokens"] == sum(t["prefill_tokens"] for t in turns) > real_tokens - cost["decode_tokens"]
    # Scored in the agent loop: no reward tensors shipped, and verl kept the loop's scores.
    assert cost["reward_bytes"] == 0 and cost["rollout_bytes"] > 0
    assert all(t["values"]["reward"] == pytest.approx(t["values"]["outcome"] * 0.6 + t["values"]["early_stop"] * 0.6 + t["values"]["protocol"]) for t in trajectories)


def test_levers_b_c_d_cut_only_their_passes(workdir):
    record, trajectories = _cost_run(
        workdir,
        "levers",
        [
            "agent=memagent",
            "infmem.bootstrap.train_samples=2",
            "reward_fn=outcome",
            "infmem.reward.components.outcome.weight=0",
            "+infmem.reward.components.uneven={_target_:test_cpu_training_runs.uneven_groups,weight:1.0}",
            "actor_rollout_ref.rollout.n=2",
            "algorithm.rollout_correction.bypass_mode=true",  # b
            "infmem.cost.drop_zero_advantage=true",  # c
            "actor_rollout_ref.actor.kl_loss_coef=0",  # d
            "infmem.train.optimizer_steps_per_rl_step=1",
        ],
    )
    cost = {k.removeprefix("infmem/cost/"): v for k, v in record.items() if k.startswith("infmem/cost/")}
    # b and d: verl's old-log-prob and reference passes did not run (their metrics and timers are absent).
    assert cost["old_log_prob_tokens"] == cost["reference_tokens"] == 0
    assert "actor/entropy" not in record and "timing_s/ref" not in record and "infmem/log_prob_gap/mean" not in record
    # c: the even question's two trajectories (reward 0) left the update, the other two trained.
    zero = [t for t in trajectories if t["values"]["reward"] == 0]
    kept = [t for t in trajectories if t["values"]["reward"] != 0]
    assert len(zero) == len(kept) == 2
    assert cost["dropped_rows"] == sum(len(t["turns"]) for t in zero)
    # The 6 kept rows (2 Writes and the answer each) are a multiple of lcm(dp 1, n 2): no fillers.
    kept_tokens = sum(turn["prompt_tokens"] + turn["response_tokens"] for t in kept for turn in t["turns"])
    assert cost["update_rows"] == sum(len(t["turns"]) for t in kept) == 6 and cost["update_tokens"] == kept_tokens
    assert cost["rows"] == cost["update_rows"] + cost["dropped_rows"] and cost["padding_rows"] == 0
    assert record["actor/grad_norm"] > 0
