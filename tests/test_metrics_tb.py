"""Trajectory-level metrics (infmem_verl.metrics), the run records (infmem_verl.run_record) and,
through one real run of the smoke recipe on the CPU backend: its console, Ctrl-C, TensorBoard, the
cost ledger, checkpoints, resume and export.

The metric definitions are checked on trajectories the real agent loop produces (scripted policy,
real Wikipedia text, the real Qwen3 tokenizer), after their facts made the same round trip through
a plain dict that they make through verl's ``extra_fields``: they must agree with the agent core's
own trajectory summary.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from omegaconf import OmegaConf

from infmem_verl.agent.config import agent_config
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.trajectory import FLAG_INVALID_ACTION
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.metrics import log_prob_gap, protocol_error, summarize, trajectory_values
from infmem_verl.policy.scripted import ScriptedPolicy
from infmem_verl.reward.components import MEMORY_FAILURES, TrajectoryRecord
from infmem_verl.agent.facts import TurnFacts, turn_facts
from infmem_verl.run_record import SUMMARY_PNG, RecordSettings, RunRecord, record_settings, records_dir

THINK = {"prethink": 30, "write": 40, "answer": 50}
KIND_BY_BUDGET = {v: k for k, v in THINK.items()}


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class Script:
    """Model text by call kind (told apart by thinking budget): PreThink actions in order, then stop."""

    def __init__(self, actions: list[str], answer: str = "\\boxed{Paris}"):
        self.actions = list(actions)
        self.answer = answer

    def __call__(self, prompt_ids: np.ndarray, params) -> str:
        kind = KIND_BY_BUDGET.get(params.max_tokens, "output")
        if kind == "prethink":
            return "<think>\nplan\n</think>\n\n" + (self.actions.pop(0) if self.actions else tool_call("stop"))
        if kind == "write":
            return "<think>\nnotes\n</think>\n\nThe Louvre is in Paris."
        return "<think>\nso\n</think>\n\n" + self.answer


@pytest.fixture(scope="module")
def document() -> str:
    return "\n\n".join(f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:14])


def agent_run(tokenizer, document: str, agent: str, actions: list[str], answer: str = "\\boxed{Paris}"):
    cfg = agent_config(
        {
            "document": {"chunk_tokens": 400, "unit_tokens": 100, "unit_overlap": 20},
            "memory_tokens": 70,
            **{k: {"prompt_tokens": 2048, "thinking_tokens": v, "output_tokens": 80} for k, v in THINK.items()},
        }
    )
    policy = ScriptedPolicy(tokenizer, Script(actions, answer))
    return asyncio.run(build_agent(agent, cfg, tokenizer).run(policy, "Where is the Louvre?", document))


def through_extra_fields(trajectory) -> tuple[TrajectoryRecord, list[int], list[int]]:
    """The trajectory's turn facts and token counts as verl's reward manager and TransferQueue see them."""
    facts = [TurnFacts.from_dict(turn_facts(trajectory, i, t).to_dict()) for i, t in enumerate(trajectory.turns)]
    record = TrajectoryRecord(facts, golds=[])
    return record, [len(t.prompt_ids) for t in trajectory.turns], [len(t.response_ids) for t in trajectory.turns]


def test_trajectory_values_agree_with_the_agent_cores_own_summary(tokenizer, document):
    actions = ["STOP", tool_call("retrieve", query="Louvre museum Paris", top_k=2), tool_call("stop")]
    trajectory = agent_run(tokenizer, document, "infmem", actions)
    values = trajectory_values(*through_extra_fields(trajectory))
    summary = trajectory.summary()

    assert summary.stop_step == 2 and summary.stopped_early and summary.num_chunks > 3
    assert values["chunks_read"] == summary.chunks_read == 2 and values["num_chunks"] == summary.num_chunks
    assert values["stop_step"] == 2 and values["stopped"] == values["stopped_early"] == 1.0
    assert values["read_fraction"] == pytest.approx(2 / summary.num_chunks)
    assert values["retrieval_calls"] == summary.retrieval_calls == 1
    searched = [t.retrieval_s for t in trajectory.turns if t.action is not None and t.action.kind == "retrieve"]
    assert len(searched) == 1 and values["retrieval_s"] == pytest.approx(searched[0]) and searched[0] > 0
    assert values["llm_calls"] == summary.llm_calls and values["llm_sequences"] == len(trajectory.turns) == 6
    assert values["prompt_tokens"] == summary.prompt_tokens and values["response_tokens"] == summary.response_tokens
    assert values["tokens"] == summary.prompt_tokens + summary.response_tokens
    assert values["invalid_turns"] == summary.invalid_turns == 1  # the "STOP" without a tool call
    last_write = [t for t in trajectory.turns if t.kind == "write"][-1]
    assert values["memory_tokens"] == last_write.memory_tokens > 0
    assert (values["prethink_turns"], values["write_turns"], values["answer_turns"]) == (3, 2, 1)
    assert (values["prethink_errors"], values["write_errors"], values["answer_errors"]) == (1, 0, 0)
    assert values["has_answer"] == 1.0


def test_a_memagent_run_without_an_answer_reads_everything_and_counts_the_answer_error(tokenizer, document):
    trajectory = agent_run(tokenizer, document, "memagent", [], answer="I do not know.")
    record, prompts, responses = through_extra_fields(trajectory)
    values = trajectory_values(record, prompts, responses)
    assert trajectory.stop_step is None and values["stopped"] == values["stopped_early"] == 0.0
    assert values["stop_step"] is None and values["chunks_read"] == values["num_chunks"] == trajectory.num_chunks
    assert values["prethink_turns"] == values["retrieval_calls"] == 0
    assert values["answer_errors"] == 1.0 and values["has_answer"] == 0.0 and protocol_error(record.turns[-1])


def test_summarize_averages_over_trajectories_and_pools_error_rates_per_turn(tokenizer, document):
    stopped = trajectory_values(*through_extra_fields(agent_run(tokenizer, document, "infmem", ["STOP"])))
    read_all = trajectory_values(*through_extra_fields(agent_run(tokenizer, document, "memagent", [])))
    rows = [stopped | {"reward": 1.0}, read_all | {"reward": 0.0, "extra": math.nan, "note": "text"}]
    metrics = summarize(rows)
    assert metrics["infmem/trajectories"] == 2
    assert metrics["infmem/reward"] == 0.5  # per trajectory, whatever their sequence counts
    assert metrics["infmem/chunks_read"] == (stopped["chunks_read"] + read_all["chunks_read"]) / 2
    assert metrics["infmem/stop_step"] == stopped["stop_step"]  # over the trajectories that stopped
    assert metrics["infmem/stopped"] == 0.5
    assert metrics["infmem/llm_sequences"] == (stopped["llm_sequences"] + read_all["llm_sequences"]) / 2
    assert "infmem/extra" not in metrics and "infmem/note" not in metrics  # only finite numbers count
    # Rates are per turn of that kind, pooled over the batch: only the InfMem run has PreThinks.
    assert metrics["infmem/protocol_error_rate/prethink"] == stopped["prethink_errors"] / stopped["prethink_turns"]
    assert metrics["infmem/protocol_error_rate/write"] == 0.0
    assert "infmem/prethink_errors" not in metrics
    memagent_only = summarize([read_all], prefix="val-infmem")
    assert "val-infmem/protocol_error_rate/prethink" not in memagent_only
    assert memagent_only["val-infmem/trajectories"] == 1


def test_trajectory_values_reject_misaligned_token_counts(tokenizer, document):
    record, prompts, responses = through_extra_fields(agent_run(tokenizer, document, "memagent", []))
    with pytest.raises(ValueError, match=r"expected one count per turn"):
        trajectory_values(record, prompts[:-1], responses)
    with pytest.raises(ValueError, match=r"turns: a trajectory has at least its answer turn"):
        trajectory_values(TrajectoryRecord([], golds=[]), [], [])


def test_log_prob_gap_counts_trained_tokens_only():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0, -2.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # injected and padding tokens do not count
    gap = log_prob_gap(trainer, rollout, mask)
    assert gap["infmem/log_prob_gap/max"] == pytest.approx(0.1)
    assert gap["infmem/log_prob_gap/mean"] == pytest.approx(0.1 / 3)
    assert log_prob_gap(trainer, rollout, torch.zeros_like(mask)) == {}


def test_run_record_merges_the_lines_of_a_step_and_plots_the_summary(tmp_path):
    record = RunRecord(tmp_path / "tb")
    assert record.steps() == [] and record.plot() is None
    record.log_step(1, {"infmem/reward": 0.1, "infmem/acc": torch.tensor(0.0), "note": "text", "bad": math.inf})
    record.log_step(2, {"infmem/reward": 0.2, "infmem/chunks_read": 3})
    with record.steps_file.open("a") as file:
        file.write('{"step": 2, "infmem/rew')  # killed while writing step 2
    record.log_step(2, {"infmem/reward": 0.3, "val-infmem/reward": 0.25})  # the resumed run redoes it
    record.log_step(0, {"val-infmem/reward": 0.05})  # validation before training: written first, read first
    assert record.steps() == [
        {"step": 0, "val-infmem/reward": 0.05},
        {"step": 1, "infmem/reward": 0.1, "infmem/acc": 0.0},
        {"step": 2, "infmem/reward": 0.3, "infmem/chunks_read": 3.0, "val-infmem/reward": 0.25},
    ]
    record.log_trajectories(2, [{"key": "u_0", "reward": 1.0}])
    assert record.trajectories(2) == [{"key": "u_0", "reward": 1.0}]
    path = record.plot(title="smoke")
    assert path == tmp_path / "tb" / SUMMARY_PNG and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_summary_tells_the_whole_recipe_warm_up_loss_first_then_reward_components(tmp_path):
    from PIL import Image

    record = RunRecord(tmp_path)
    for step in (1, 2):
        record.log_step(step, {"infmem/reward": 0.5 * step, "infmem/protocol": 0.4 * step, "infmem/early_stop": 0.1})
    widths = {}
    for name, kwargs in (("rl", {}), ("recipe", {"components": ["protocol", "early_stop"], "sft_losses": [11.9, 6.0, 2.5]})):
        widths[name] = Image.open(record.plot(**kwargs)).size[0]
    # One panel is 4.2 in at 110 dpi: reward, accuracy, chunks read; then + SFT loss + components.
    assert widths == {"rl": round(3 * 4.2 * 110), "recipe": round(5 * 4.2 * 110)}



def test_records_go_next_to_the_tensorboard_events_unless_configured(monkeypatch, tmp_path):
    def config(records=None):
        base = {"trainer": {"project_name": "proj", "experiment_name": "exp"}}
        return OmegaConf.create(base | ({"infmem": {"records": records}} if records is not None else {}))

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    assert records_dir(config()) == Path("tensorboard_log/proj/exp")  # where verl's logger writes
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    assert records_dir(config({"trajectories": True})) == tmp_path / "tb"
    assert records_dir(config({"dir": str(tmp_path / "mine")})) == tmp_path / "mine"
    assert record_settings(config()) == RecordSettings(dir=None, trajectories=False)


def test_the_demos_two_agents_keep_their_records_apart(monkeypatch):
    """A run's records start fresh (``RunRecord.start_fresh``): the MemAgent baseline of the demo
    must not write where the InfMem run's records are."""
    from conftest import demo_config

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    infmem, memagent = (records_dir(demo_config(*agent)) for agent in ((), ("agent=memagent",)))
    assert infmem == Path("tensorboard_log/infmem_verl/demo_infmem_agent")
    assert memagent == Path("tensorboard_log/infmem_verl/demo_memagent_agent")


@pytest.mark.parametrize(
    "records, message",
    [
        ({"dir": 5}, r"infmem\.records\.dir: expected a folder path or null, got 5"),
        ({"dir": ""}, r"infmem\.records\.dir: expected a folder path or null, got ''"),
        ({"trajectories": "yes"}, r"infmem\.records\.trajectories: expected true or false, got 'yes'"),
        ({"trajectory": True}, r"infmem\.records\.trajectory: unknown key"),
        ("yes", r"infmem\.records: expected a mapping, got 'yes'"),
    ],
)
def test_bad_records_settings_name_the_key(records, message):
    with pytest.raises(ConfigError, match=message):
        record_settings(OmegaConf.create({"infmem": {"records": records}}))

# ------------------------------------------------- a real CPU run of the smoke recipe, stopped and resumed
#
# One short run of `+recipe=smoke` on the CPU backend (verl's own trainer loop, see infmem_verl/cpu)
# serves every test below: a Ray cluster start costs a CPU training run most of its time, so the
# tests share one. It builds its own model and data, saves a checkpoint after each of its 2 steps,
# gets Ctrl-C once step 1 is saved and logged (every Ray process it started must end), then the
# same command runs again and resumes. The console, TensorBoard, the run's records and cost
# ledger, verl's own rollout dump and the checkpoints are checked against each other.

RUN_TIMEOUT_S = 900
OPTIMIZER_STEPS = 2  # the smoke recipe's infmem.train.optimizer_steps_per_rl_step
# A turn breaks the protocol when invalid or, per kind, with one of these flags (the reward's rule).
PROTOCOL_FLAGS = {"prethink": {FLAG_INVALID_ACTION}, "write": set(MEMORY_FAILURES), "answer": set()}


# Set by the stopped-and-resumed run's first process only: its checkpoint tracker file.
HOLD_AFTER_CHECKPOINT = "INFMEM_TEST_HOLD_AFTER_CHECKPOINT"


def letters(record) -> float:
    """Reward component: the share of ASCII letters in the final answer text.

    Random text scores differently per trajectory, so the reward is not the constant 0 that exact
    match gives a random model and a wrong average would show. Imported by the reward worker as
    ``test_metrics_tb.letters``. In the first process of the stopped run, scoring waits once
    checkpoint 1 exists (see :func:`_hold_once_checkpointed`).
    """
    _hold_once_checkpointed()
    text = record.solution_str
    return sum(c.isascii() and c.isalpha() for c in text) / max(len(text), 1)


def _hold_once_checkpointed() -> None:
    """Wait while the tracker named by ``HOLD_AFTER_CHECKPOINT`` exists: step 2 then cannot end.

    Step 2 of this shape lasts seconds, so on a loaded machine a Ctrl-C sent once step 1 is saved
    and logged could arrive after step 2 had ended and saved checkpoint 2, leaving the resumed
    process nothing to run. Holding step 2's scoring makes Ctrl-C land inside it.
    """
    tracker = os.environ.get(HOLD_AFTER_CHECKPOINT)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while tracker and os.path.isfile(tracker) and time.monotonic() < deadline:
        time.sleep(0.5)


@dataclass
class Run:
    """The folders of the stopped-and-resumed run, its two processes' outputs, and what Ctrl-C left."""

    root: Path
    first_output: str
    second_output: str
    actors: str  # the command lines of the first run's processes just before Ctrl-C
    survivors: list[int]  # those still alive a minute after it
    stopped: bool  # the first run ended within two minutes of Ctrl-C

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def records(self) -> RunRecord:
        return RunRecord(self.tensorboard)

    @property
    def model(self) -> Path:
        return self.root / "cache" / "tiny-qwen3-h64-s0"  # built by infmem.bootstrap


def _command(root: Path) -> list[str]:
    return [
        sys.executable, "-m", "infmem_verl.main", "+recipe=smoke",
        f"data.train_files={root}/train.parquet", f"data.val_files={root}/val.parquet",
        # Two chunks per document and small budgets: every row costs a CPU forward and backward pass.
        "infmem.bootstrap.doc_tokens=1200",
        "infmem.agent.document={chunk_tokens:600,unit_tokens:150,unit_overlap:30,paragraph_units:false}",
        "infmem.agent.memory_tokens=16",
        "infmem.agent.prethink={prompt_tokens:1024,thinking_tokens:8,output_tokens:16}",
        "infmem.agent.write={prompt_tokens:null,thinking_tokens:8,output_tokens:16}",
        "infmem.agent.answer={prompt_tokens:1024,thinking_tokens:8,output_tokens:16}",
        "+infmem.reward.components.letters={_target_:test_metrics_tb.letters,weight:1.0}",
        # One prompt x n=2 per step: the fewest forward and backward passes (the KL reference
        # pass stays: the cost ledger counts all three of verl's passes).
        "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
        "trainer.total_training_steps=2", "trainer.test_freq=2",
        "trainer.save_freq=1", "trainer.resume_mode=auto", f"trainer.default_local_dir={root}/checkpoints",
        "trainer.val_before_train=true",  # each process validates once before its first step
        f"trainer.rollout_data_dir={root}/rollouts", "trainer.logger=[console,tensorboard]",
        "infmem.records.trajectories=true",
    ]  # fmt: skip


def _environment(root: Path) -> dict[str, str]:
    tests = str(Path(__file__).parent)
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TENSORBOARD_DIR": str(root / "tensorboard"),
        "INFMEM_CACHE": str(root / "cache"),  # where the smoke recipe builds its tiny model
        "INFMEM_VERBOSE": "1",  # verl's full console: the step lines this module reads
        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
    }


def tensorboard_scalars(path: Path) -> dict[str, dict[int, float]]:
    """Every scalar of one event file: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util.tensor_util import make_ndarray

    scalars: dict[str, dict[int, float]] = {}
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            if value.metadata.plugin_data.plugin_name == "scalars":
                scalars.setdefault(value.tag, {})[event.step] = float(make_ndarray(value.tensor))
    return scalars


def _sigint_as_in_a_terminal() -> None:
    """In the child before exec: SIGINT at its default, as a terminal's Ctrl-C finds it.

    A suite started as a background job of a non-interactive shell (``cmd &``) inherits SIGINT
    ignored, and so would the run: Python keeps an ignored SIGINT, and the run would never see
    the fixture's Ctrl-C (two full suites here failed so).
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tracker(root: Path) -> Path:
    return root / "checkpoints" / "latest_checkpointed_iteration.txt"


def _step_one_is_saved_and_logged(root: Path) -> bool:
    """Checkpoint 1 complete and step 1 in the run's records: step 2 has begun (and waits).

    The wait reads nothing that arrives late (Ray's console relay, TensorBoard's flush at the
    next step); both are checked after the run ends.
    """
    tracker = _tracker(root)
    if not tracker.is_file() or tracker.read_text().strip() != "1":
        return False
    return any(r["step"] == 1 and "infmem/reward" in r for r in RunRecord(root / "tensorboard").steps())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the run and every process it started (Ray's included), when Ctrl-C did not end it."""
    tree = [process, *psutil.Process(process.pid).children(recursive=True)]
    for member in tree:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=60)
    psutil.wait_procs([p for p in tree[1:] if p.is_running()], timeout=60)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("stopped_and_resumed")
    command, env = _command(root), _environment(root)
    log = (root / "first.log").open("w")
    held = {**env, HOLD_AFTER_CHECKPOINT: str(_tracker(root))}  # step 2 waits for the Ctrl-C
    first = subprocess.Popen(
        command, cwd=root, env=held, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_sigint_as_in_a_terminal
    )  # fmt: skip
    deadline = time.monotonic() + RUN_TIMEOUT_S
    started: list[int] = []
    try:
        while not _step_one_is_saved_and_logged(root):
            assert first.poll() is None, f"the first run ended early:\n{(root / 'first.log').read_text()[-4000:]}"
            assert time.monotonic() < deadline, "step 1 was not saved and logged in time"
            time.sleep(0.5)
        started = [p.pid for p in psutil.Process(first.pid).children(recursive=True)]
        actors = " ".join(" ".join(psutil.Process(p).cmdline()) for p in started if _alive(p))
        first.send_signal(signal.SIGINT)  # Ctrl-C during step 2
        try:
            first.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pass
        stopped = first.poll() is not None
    finally:
        if first.poll() is None:
            _kill_tree(first)
        log.close()
    wait_until = time.monotonic() + 60
    while any(_alive(p) for p in started) and time.monotonic() < wait_until:
        time.sleep(1)
    survivors = [p for p in started if _alive(p)]
    second = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-4000:]
    first_output = (root / "first.log").read_text()
    return Run(root, first_output, second.stdout + second.stderr, actors, survivors, stopped)


STEP_LINE = (
    r"\[infmem\] step {step}/2 \| reward \d\.\d{{3}} \(outcome \d\.\d{{3}}, early_stop \d\.\d{{3}}, "
    r"protocol \d\.\d{{3}}, letters \d\.\d{{3}}\) \| acc \d\.\d{{3}} \| chunks read 2\.0/2\.0 \| stopped \d/2 at step \S+ \| "
    r"llm calls \d+\.\d/traj \| optimizer steps 2 \| loss \S+ \(pg \S+\) \| grad norm \S+ \| "
    r"rollout-vs-engine prob diff \S+ \| \d+\.\ds"
)


def test_the_smoke_recipe_builds_what_it_lacks_prints_its_steps_and_ctrl_c_stops_every_ray_process(run):
    first = run.first_output
    assert f"[infmem] model: tiny random Qwen3 with the real Qwen3 tokenizer at {run.model}" in first
    assert "[infmem] data.train_files: wrote 4 synthetic two-hop questions" in first
    assert "[infmem] backend: cpu (no GPU in this machine)" in first
    assert re.search(STEP_LINE.format(step=1), first) and re.search(STEP_LINE.format(step=2), run.second_output)
    assert re.search(r"\[infmem\] validation \| reward \S+ \| acc \S+ \| chunks_read 2\.000", run.second_output)
    for actor in ("TaskRunnerV1", "CPUGenerationServer", "AgentLoopWorkerTQ"):
        assert actor in run.actors
    assert "RewardLoopWorker" not in run.actors  # the agent loop scores (reward.num_workers 0)
    assert "[infmem] interrupted: stopping the Ray workers this run started" in first
    assert run.stopped and not run.survivors, f"Ray processes survived Ctrl-C: {run.survivors}"
    for step, record in ((s["step"], s) for s in run.records.steps() if s["step"] > 0):
        assert record["training/off_policy/trajectory_staleness/max"] == 0, step  # rollouts used the last update
        assert record["infmem/num_chunks"] == 2 and record["infmem/trajectories"] == 2, step
        assert record["training/rollout_probs_diff_max"] < 1e-3, step  # the engine recomputes what was sampled


def test_the_cost_ledger_counts_what_the_step_processed(run):
    for step in (1, 2):
        record = {s["step"]: s for s in run.records.steps()}[step]
        trajectories = run.records.trajectories(step)
        cost = {k.removeprefix("infmem/cost/"): v for k, v in record.items() if k.startswith("infmem/cost/")}
        turns = [turn for t in trajectories for turn in t["turns"]]
        assert cost["rows"] == len(turns) + cost["padding_rows"]
        # verl's own count of the batch's tokens (from the token tensors in TransferQueue, padding
        # rows of 128 tokens included): every pass got the whole batch.
        real_tokens = sum(t["prompt_tokens"] + t["response_tokens"] for t in turns)
        assert record["perf/total_num_tokens"] == real_tokens + 128 * cost["padding_rows"]
        passes = (cost["old_log_prob_tokens"], cost["reference_tokens"], cost["update_tokens"])
        assert passes == (record["perf/total_num_tokens"],) * 3
        assert cost["update_rows"] == cost["rows"] and cost["trainer_tokens"] == 3 * record["perf/total_num_tokens"]
        # The rollout side matches the turns the agent loops recorded.
        assert cost["llm_calls"] == sum(t["llm_calls"] for t in turns) == record["infmem/llm_calls"] * len(trajectories)
        assert cost["prefill_tokens"] == sum(t["prefill_tokens"] for t in turns) > real_tokens - cost["decode_tokens"]
        # Scored in the agent loop: no reward tensors shipped, and verl kept the loop's scores.
        assert cost["reward_bytes"] == 0 and cost["rollout_bytes"] > 0
        for t in trajectories:
            v = t["values"]
            assert v["reward"] == pytest.approx(v["outcome"] * 0.6 + v["early_stop"] * 0.6 + v["protocol"] + v["letters"])


def test_the_rollout_efficiency_is_generate_time_over_trajectory_time(run):
    """``infmem/rollout/efficiency`` of each step, from the trajectories the run recorded: the
    seconds their turns awaited generate calls over the trajectories' wall time, pooled."""
    for step in (1, 2):
        record = {s["step"]: s for s in run.records.steps()}[step]
        trajectories = run.records.trajectories(step)
        generate = [sum(turn["generate_s"] for turn in t["turns"]) for t in trajectories]
        rollout = [t["turns"][-1]["rollout_s"] for t in trajectories]
        assert all(0 < g < r for g, r in zip(generate, rollout, strict=True)), (generate, rollout)
        assert record["infmem/rollout/efficiency"] == pytest.approx(sum(generate) / sum(rollout))
        assert record["infmem/rollout_s"] == pytest.approx(sum(rollout) / len(rollout))


def test_the_stopped_run_resumes_from_its_last_checkpoint_with_its_step_count(run):
    first, second = sorted(run.tensorboard.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime)
    assert set(tensorboard_scalars(first)["infmem/reward"]) == {1}  # stopped during step 2
    assert set(tensorboard_scalars(second)["infmem/reward"]) == {2}  # resumed at step 2, not 1
    assert "[infmem] step 2/2" in run.second_output and "step 1/2" not in run.second_output
    # Step 0: the first process's validation before training; step 1 also holds the second's.
    assert [s["step"] for s in run.records.steps()] == [0, 1, 2]
    assert (run.checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # run.json: written by the first process (from step 0), kept by the resumed one.
    identity = run.records.identity()
    assert identity["model"] == str(run.model) and "config.json" in identity["model_files"]
    val = {path: hashlib.sha256(path.read_bytes()).hexdigest() for path in (run.root / "val.parquet", run.root / "val_docs.parquet")}
    assert identity["val_files"] == {str(path): digest for path, digest in val.items()}  # the questions, their documents
    assert identity["model_files"]["config.json"][1] == (run.model / "config.json").stat().st_mtime_ns
    assert run.records.run_file.stat().st_mtime_ns <= (run.root / "first.log").stat().st_mtime_ns  # not rewritten


def test_the_resumed_run_continues_the_optimizer_state_and_the_weights(run):
    from infmem_verl.cpu.engine import load_model
    from infmem_verl.cpu.server import weights_digest

    step = {n: run.checkpoints / f"global_step_{n}" / "actor" for n in (1, 2)}
    optimizer = {n: torch.load(p / "optim_world_size_1_rank_0.pt", weights_only=True) for n, p in step.items()}
    adam_steps = {n: {float(s["step"]) for s in o["state"].values()} for n, o in optimizer.items()}
    # AdamW's step count per parameter goes on from the checkpoint; a fresh optimizer would be at 2 again.
    assert adam_steps == {1: {OPTIMIZER_STEPS}, 2: {2 * OPTIMIZER_STEPS}}
    extra = {n: torch.load(p / "extra_state_world_size_1_rank_0.pt", weights_only=False) for n, p in step.items()}
    schedule = {n: e["lr_scheduler"] for n, e in extra.items()}
    assert (schedule[1]["last_epoch"], schedule[2]["last_epoch"]) == (1, 2)

    # The generation actor served the checkpoint's weights in step 2, not the initial model's.
    saved = load_model(str(run.model))
    saved.load_state_dict(torch.load(step[1] / "model_world_size_1_rank_0.pt", weights_only=True))
    served = {s["step"]: s["cpu/weights/before_rollout"] for s in run.records.steps() if s["step"] > 0}
    assert served[2] == weights_digest(saved) != served[1] == weights_digest(load_model(str(run.model)))


def test_tensorboard_holds_trajectory_level_metrics_that_match_the_runs_own_records(run):
    tensorboard: dict[str, dict[int, float]] = {}
    for path in run.tensorboard.glob("events.out.tfevents.*"):
        for tag, values in tensorboard_scalars(path).items():
            tensorboard.setdefault(tag, {}).update(values)
    names = [
        "reward", "letters", "outcome", "early_stop", "protocol", "acc", "chunks_read", "stopped",
        "stopped_early", "retrieval_calls", "memory_tokens", "llm_calls", "llm_sequences", "tokens",
        "protocol_error_rate/prethink", "protocol_error_rate/write", "protocol_error_rate/answer",
        "optimizer_steps", "clip_fraction", "log_prob_gap/mean", "step_time_s",
    ]  # fmt: skip
    for step in (1, 2):
        recorded = {s["step"]: s for s in run.records.steps()}[step]
        for name in names:
            assert tensorboard[f"infmem/{name}"][step] == pytest.approx(recorded[f"infmem/{name}"], rel=1e-6), name
        trajectories = run.records.trajectories(step)
        assert len(trajectories) == recorded["infmem/trajectories"] == 2  # 1 prompt x n=2
        # Recomputed here from the raw turns of each trajectory, then averaged over trajectories.
        turns = [t["turns"] for t in trajectories]
        expect = {
            "chunks_read": np.mean([sum(x["turn_kind"] == "write" for x in t) for t in turns]),
            "llm_calls": np.mean([sum(x["llm_calls"] for x in t) for t in turns]),
            "llm_sequences": np.mean([len(t) for t in turns]),
            "tokens": np.mean([sum(x["prompt_tokens"] + x["response_tokens"] for x in t) for t in turns]),
            "reward": np.mean([t["values"]["reward"] for t in trajectories]),
        }
        for kind in ("prethink", "write", "answer"):
            of_kind = [x for t in turns for x in t if x["turn_kind"] == kind]
            broken = [not x["valid"] or bool(set(x["flags"]) & PROTOCOL_FLAGS[kind]) for x in of_kind]
            expect[f"protocol_error_rate/{kind}"] = np.mean(broken)
        for name, value in expect.items():
            assert tensorboard[f"infmem/{name}"][step] == pytest.approx(value, rel=1e-5), name
        assert recorded["infmem/optimizer_steps"] == recorded["actor/optimizer_steps"] == OPTIMIZER_STEPS

        # verl's own dump of the step's sequences: the same trajectories, sequence counts and rewards.
        dumped = [json.loads(line) for line in (run.root / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        sessions: dict[str, list[float]] = {}
        for row in dumped:
            sessions.setdefault(row["uid"].rsplit("_", 1)[0], []).append(row["score"])
        # verl pads the batch with zero-weight rows of its own ("pad<hex>" keys, padding_utils.py).
        padding = [key for key in sessions if key not in {t["key"] for t in trajectories}]
        assert all(key.startswith("pad") and not any(sessions.pop(key)) for key in padding)
        assert sorted(sessions) == sorted(t["key"] for t in trajectories)
        assert tensorboard["infmem/llm_sequences"][step] == pytest.approx(np.mean([len(s) for s in sessions.values()]))
        final_scores = [s[-1] for s in sessions.values()]
        assert tensorboard["infmem/reward"][step] == pytest.approx(np.mean(final_scores), rel=1e-5)
        assert len({round(score, 6) for score in final_scores}) > 1  # the rewards differ: the mean means something

    # Validation: the same summary over the final sequences verl keeps, agreeing with verl's own mean@1.
    validation = {tag.split("/", 1)[1]: v[2] for tag, v in tensorboard.items() if tag.startswith("val-infmem/")}
    assert validation["trajectories"] == 2
    assert {"reward", "acc", "chunks_read", "protocol_error_rate/write"} <= set(validation)
    [verl_mean] = [v[2] for tag, v in tensorboard.items() if re.fullmatch(r"val-aux/[^/]+/chunks_read/mean@1", tag)]
    assert validation["chunks_read"] == pytest.approx(verl_mean)
    # The validations before training (steps 0 and 1, one per process) are recorded like the last one,
    # though verl hands only the last to _compute_metrics; the summary plot starts from step 0.
    recorded = {s["step"]: s for s in run.records.steps()}
    assert set(tensorboard["val-infmem/reward"]) == {0, 1, 2}
    for step in (0, 1, 2):
        assert recorded[step]["val-infmem/reward"] == pytest.approx(tensorboard["val-infmem/reward"][step], rel=1e-6)
    assert not any(name.startswith("infmem/") for name in recorded[0])  # no training at step 0
    summary = run.tensorboard / SUMMARY_PNG
    assert summary.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"run summary: {summary}" in run.second_output


def test_the_cpu_checkpoint_exports_to_a_model_with_the_trained_log_probs(run, tmp_path, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    from infmem_verl.export import export_checkpoint

    result = export_checkpoint(run.checkpoints, tmp_path / "hf")  # the run folder: its latest step
    assert result.checkpoint.global_step == 2
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    config = AutoConfig.from_pretrained(result.checkpoint.path / "huggingface")
    trained = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = torch.load(result.checkpoint.path / "model_world_size_1_rank_0.pt", weights_only=True)
    # The engine's weights at bfloat16, what verl's merger writes (buffers such as RoPE's stay float32).
    trained.load_state_dict({name: tensor.bfloat16().float() for name, tensor in weights.items()})
    ids = torch.tensor(tokenizer(wiki_paragraphs()[3]["text"])["input_ids"][:120])
    with torch.no_grad():
        ours = torch.log_softmax(exported.float()(input_ids=ids[None]).logits[0, :-1], -1)
        theirs = torch.log_softmax(trained(input_ids=ids[None]).logits[0, :-1], -1)
    assert torch.equal(ours.gather(1, ids[1:, None]), theirs.gather(1, ids[1:, None]))


def test_the_gpu_smoke_health_check_reads_a_real_runs_log_and_files(run, tmp_path):
    """recipes/gpu_smoke.sh --check-only on this run's outputs: every check passes but the one that
    wants the GPU backend (this run is the CPU backend's)."""
    from infmem_verl.export import export_checkpoint

    out = tmp_path / "gpu_smoke"
    out.mkdir()
    (out / "train.log").write_text(run.first_output + run.second_output)
    (out / "tensorboard").symlink_to(run.tensorboard)
    (out / "checkpoints").symlink_to(run.checkpoints)
    export_checkpoint(run.checkpoints, out / "hf_export")
    script = Path(__file__).parents[1] / "recipes" / "gpu_smoke.sh"
    result = subprocess.run(
        ["bash", str(script), "--check-only", "--out", str(out), "--steps", "2", "--python", sys.executable],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line for line in result.stdout.splitlines() if line.startswith("  FAIL")]
    passed = [line for line in result.stdout.splitlines() if line.startswith("  ok")]
    assert failed == ["  FAIL  backend line names stock verl on the GPU ([infmem] backend: gpu)"]
    assert len(passed) == 8, result.stdout
