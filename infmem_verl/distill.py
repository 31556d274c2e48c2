"""Distill teacher trajectories through our protocol into verl SFT data (the SFT warm-up, spec §5.1).

    python -m infmem_verl.distill --endpoint http://teacher:8000 --recipe infmem_4b \\
        --data data/hotpotqa_train_32k.parquet --out data/sft/qwen3_4b
    python -m infmem_verl.distill --recipe smoke --keep all --drop-flags none --out outputs/sft_smoke
    python -m infmem_verl.distill --recipe demo --teacher oracle --samples 64 --out outputs/sft_oracle

A teacher behind an OpenAI-compatible server (the reference: Qwen3-32B on vLLM), or without
``--endpoint`` an in-process model (the tiny random Qwen3 by default), runs the agent core's loop
over a training parquet (``data_prep``'s format; without ``--data``, the synthetic two-hop set).
The protocol is the RL recipe's: ``--recipe`` composes the top-level ``conf/`` exactly as
``python -m infmem_verl.main +recipe=...`` does and takes its ``infmem.agent`` settings (budgets,
thinking, stop rule, top-k range), so the student is taught the prompts it will meet in RL.
``--set`` adds Hydra overrides to that composition. Only decoding is the teacher's own
(``--temperature 0.7 --top-p 0.95``, the reference's). ``--teacher oracle`` replaces the model
by the scripted teacher of the synthetic set (:func:`~infmem_verl.policy.scripted.oracle_policy`:
it knows where the two facts are), which is how the demo recipe's warm-up gets a student that
follows the protocol without any model download.

Output, in ``--out``:

* ``results.jsonl``: one record per sample, appended as it finishes; a killed run started again
  skips every finished sample (samples that failed because of the server are retried);
  ``manifest.json`` pins the protocol;
* ``turns.jsonl``: for each kept trajectory, every call's prompt ids (built by the agent core's
  one prompt builder), response ids and response mask (:class:`~infmem_verl.sft.records.TurnStore`);
* ``sft_train.parquet`` (and ``sft_val.parquet`` with ``--val-fraction``): one verl SFT sample
  per LLM call, loss on the teacher's generated tokens only (never the prompt, the document
  chunk, or a closing tag the loop injected), except a response whose thinking ``--shorten-over``
  rewrote: that response is trained whole, its closing tag too; rebuilt from the records on every
  run, or alone with ``--sft-only``;
* ``report.json``: keep rate, drop and failure reasons, samples per call kind.

Filtering: ``--keep correct`` (default) keeps trajectories whose answer scores at least
``--min-score`` under ``--metric`` (default: normalized exact match against every gold = 1, as
the reference); ``--keep all`` keeps every finished trajectory. Independently, a trajectory with a
turn carrying one of ``--drop-flags`` (malformed action, thinking never closed, output cut by its
budget, memory not usable, no answer; ``none`` for no flag filter) or an aborted generation is
dropped with that reason: its later calls were made on a fallback.

Options the reference used, each off unless asked for:

* ``--decomposition FILE``: privileged information. For questions whose id is in FILE (MuSiQue's
  official JSON lines, ``question_decomposition``), the teacher sees the gold decomposition
  (sub-questions and answers) in a system message before every prompt, told to use it silently.
  The SFT samples keep the student's prompt without it (spec §8.2 item 9: report it, or ablate);
* ``--shorten-over N``: rewrite thinking longer than N tokens, or closed by the loop, to about
  ``--shorten-ratio`` of its length (:mod:`infmem_verl.sft.shorten`);
* ``--answer-copies K|reference``: write each answer sample K times (``reference``:
  ``1 + floor((calls - 1) / 2)``), up-weighting the one call that is scored.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import sys
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Sequence

import numpy as np

from data_prep.io import DataError, atomic_outputs, iter_json_records
from data_prep.training import training_rows, training_sample
from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.loops import AgentLoop, build_agent
from infmem_verl.agent import trajectory as trajectory_flags
from infmem_verl.agent.policy import Generation, Policy, SamplingParams
from infmem_verl.agent.trajectory import (
    FLAG_INVALID_ACTION,
    FLAG_MEMORY_KEPT,
    FLAG_MEMORY_TRUNCATED,
    FLAG_NO_ANSWER,
    FLAG_OUTPUT_TRUNCATED,
    FLAG_THINK_UNCLOSED,
    Trajectory,
)
from infmem_verl.cli import entry_point
from infmem_verl.data.identity import IdLedger
from infmem_verl.data.sample import QASample
from infmem_verl.eval import comma_list
from infmem_verl.evaluation.data import CellSource, LoadFailure, distinct, synthetic_sources
from infmem_verl.evaluation.runner import Runner
from infmem_verl.evaluation.store import CELL, MANIFEST, RETRY_POLICIES, ResultStore, RetryPolicy, check_retry_policy
from infmem_verl.policy.source import ModelSource, OpenedModel, add_model_options, model_source, open_model
from infmem_verl.reward.metrics import ANSWER_METRICS, score_answer
from infmem_verl.sft.records import RecordError, TurnRecord, TurnStore, read_turns
from infmem_verl.sft.samples import AnswerCopies, SFTWriter, TokenizerStamp, answer_copy_count, sft_paths, split_of, trajectory_samples
from infmem_verl.sft.shorten import ShortenConfig, ThinkingShortener

DEFAULT_DROP_FLAGS = (
    FLAG_INVALID_ACTION,
    FLAG_THINK_UNCLOSED,
    FLAG_MEMORY_KEPT,
    FLAG_MEMORY_TRUNCATED,
    FLAG_OUTPUT_TRUNCATED,
    FLAG_NO_ANSWER,
)
# The teacher's defaults: many samples in flight, for a server fleet.
TEACHER = ModelSource(concurrency=64)
REPORT = "report.json"
UNREADABLE_ROW = "unreadable training row"
# Every turn flag the agent core sets (the FLAG_* constants of agent.trajectory).
KNOWN_FLAGS = frozenset(value for name, value in vars(trajectory_flags).items() if name.startswith("FLAG_"))


@dataclass
class DistillConfig:
    """What one ``python -m infmem_verl.distill`` run does (see ``--help`` for each field)."""

    out: Path
    data: Path | None = None  # None: the synthetic set
    recipe: str = "infmem_4b"
    overrides: list[str] = field(default_factory=list)
    samples: int | None = None  # None: every row (synthetic: 4)
    synthetic_length: str = "4k"
    source: ModelSource = TEACHER  # the teacher
    teacher: Literal["model", "oracle"] = "model"  # oracle: the synthetic set's scripted teacher
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    keep: Literal["correct", "all"] = "correct"
    metric: str = "em"
    min_score: float = 1.0
    drop_flags: tuple[str, ...] = DEFAULT_DROP_FLAGS
    decomposition: Path | None = None
    shorten: ShortenConfig = field(default_factory=ShortenConfig)
    answer_copies: AnswerCopies = 1
    max_length: int | None = None
    val_fraction: float = 0.0
    retry_failed: RetryPolicy = "transient"
    run_teacher: bool = True  # False: --sft-only
    progress: bool = True

    def validate(self) -> DistillConfig:
        if self.teacher not in ("model", "oracle"):
            raise ConfigError(f"teacher: expected model or oracle, got {self.teacher!r}")
        if self.teacher == "oracle" and (self.data is not None or self.source.endpoints):
            raise ConfigError("teacher: oracle scripts the synthetic set only; drop --data and --endpoint")
        if self.keep not in ("correct", "all"):
            raise ConfigError(f"keep: expected correct or all, got {self.keep!r}")
        if self.metric not in ANSWER_METRICS:
            raise ConfigError(f"metric: expected one of {list(ANSWER_METRICS)}, got {self.metric!r}")
        if not 0 <= self.min_score <= 1:
            raise ConfigError(f"min_score: expected a number in [0, 1], got {self.min_score!r}")
        self.source.validate()
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"samples: expected an integer >= 1, got {self.samples!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"max_length: expected an integer >= 2, got {self.max_length!r}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"val_fraction: expected a number in [0, 1), got {self.val_fraction!r}")
        unknown = sorted(set(self.drop_flags) - KNOWN_FLAGS)
        if unknown:
            raise ConfigError(f"drop_flags: unknown flag {unknown[0]!r}; expected some of {sorted(KNOWN_FLAGS)} or none")
        check_retry_policy(self.retry_failed)
        for name, path in (("data", self.data), ("decomposition", self.decomposition)):
            if self.run_teacher and path is not None and not Path(path).is_file():
                raise ConfigError(f"{name}: {path} not found")
        try:
            answer_copy_count(self.answer_copies, 1)
            self.shorten.validate()
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return self


# ------------------------------------------------------------------------------------ protocol


def recipe_agent(recipe: str, overrides: Sequence[str]) -> tuple[str, AgentConfig]:
    """The agent name and settings of RL recipe ``recipe``, composed as the trainer composes it."""
    from hydra import compose, initialize_config_dir
    from infmem_verl import conf_dir
    from hydra.errors import HydraException

    from infmem_verl.settings import agent_settings

    try:
        with initialize_config_dir(str(conf_dir()), version_base=None):
            config = compose("infmem_trainer", overrides=[f"+recipe={recipe}", *overrides])
    except HydraException as err:
        raise ConfigError(f"recipe: cannot compose +recipe={recipe} with {list(overrides)}: {err}") from None
    loop = config.actor_rollout_ref.rollout.agent.default_agent_loop
    return loop.removesuffix("_agent"), agent_settings(config)


def teacher_agent_config(cfg: DistillConfig, agent_cfg: AgentConfig) -> AgentConfig:
    """The recipe's agent settings with the teacher's decoding; token ids always recorded."""
    return dataclasses.replace(agent_cfg, temperature=cfg.temperature, top_p=cfg.top_p, top_k=-1, record_token_ids=True).validate()


def protocol(cfg: DistillConfig, agent: str, agent_cfg: AgentConfig, model: str, stamp: TokenizerStamp) -> dict[str, Any]:
    """Everything that decides what a record holds; a resume with anything else is refused."""
    return {
        "agent": agent,
        "agent_config": dataclasses.asdict(agent_cfg),
        "recipe": cfg.recipe,
        "overrides": list(cfg.overrides),
        "teacher": model,
        "tokenizer": stamp.to_json(),
        "keep": cfg.keep,
        "metric": cfg.metric,
        "min_score": cfg.min_score,
        "drop_flags": sorted(cfg.drop_flags),
        "privileged_decomposition": cfg.decomposition.name if cfg.decomposition else None,
        "shorten": dataclasses.asdict(cfg.shorten),
    }


# ----------------------------------------------------------------------- privileged information


def decomposition_hint(steps: object, where: str) -> str:
    """The privileged system message for one MuSiQue ``question_decomposition``."""
    if not isinstance(steps, list) or not steps:
        raise DataError(f"{where}: question_decomposition: expected a non-empty list of steps")
    lines = []
    for number, step in enumerate(steps, start=1):
        if not isinstance(step, dict) or not isinstance(step.get("question"), str) or not isinstance(step.get("answer"), str):
            raise DataError(f"{where}: question_decomposition[{number - 1}]: expected string 'question' and 'answer'")
        lines.append(f"{number}. {step['question'].strip()} -> {step['answer'].strip()}")
    return (
        "Private guidance for the question you will work on. Never mention, quote or refer to it; "
        "use it only to decide what to search for and what to keep. The question resolves in these "
        "steps (#k stands for the answer of step k):\n" + "\n".join(lines)
    )


def load_decompositions(path: Path) -> dict[str, str]:
    """Question id -> privileged hint, for every record of ``path`` with a decomposition."""
    hints = {}
    for record in iter_json_records(path):
        value = record.value
        if isinstance(value, dict) and "question_decomposition" in value and isinstance(value.get("id"), str):
            hints[value["id"]] = decomposition_hint(value["question_decomposition"], f"{path}:{record.line}")
    return hints


class HintedPolicy:
    """Shows the teacher a system message before every prompt it is sent.

    The agent core records the prompt it built (the student's), not what the teacher saw, so the
    privileged message never reaches an SFT sample.
    """

    def __init__(self, inner: Policy, prefix_ids: np.ndarray):
        self.inner = inner
        self.prefix_ids = prefix_ids

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        return await self.inner.generate(np.concatenate([self.prefix_ids, np.asarray(prompt_ids, dtype=np.int32)]), params)


# ------------------------------------------------------------------------------------ teacher


@dataclass
class DistillOutcome:
    """One teacher trajectory and what distillation decided about it."""

    trajectory: Trajectory
    scores: dict[str, float]
    drop: tuple[str, str] | None  # (reason category, detail); None when kept
    turns: list[TurnRecord]  # kept trajectories only
    privileged: bool
    shortened: int = 0
    shorten_skipped: dict[str, int] = field(default_factory=dict)

    def record_fields(self, sample: QASample) -> dict[str, Any]:
        summary = self.trajectory.summary()
        fields: dict[str, Any] = {
            "status": "ok",
            "kept": self.drop is None,
            "drop_reason": self.drop[0] if self.drop else None,
            "drop_detail": self.drop[1] if self.drop else None,
            "source": sample.source,
            "question": sample.question,
            "answers": list(sample.answers),
            "prediction": self.trajectory.prediction,
            **self.scores,
            "num_turns": len(self.trajectory.turns),
            "llm_calls": summary.llm_calls,
            "chunks_read": summary.chunks_read,
            "num_chunks": summary.num_chunks,
            "stop_step": summary.stop_step,
            "invalid_turns": summary.invalid_turns,
            "privileged": self.privileged,
            "shortened_turns": self.shortened,
            "shorten_skipped": self.shorten_skipped,
        }
        return fields


class Teacher:
    """Runs the agent with the teacher on one sample and decides whether to keep it."""

    def __init__(self, agent: AgentLoop, cfg: DistillConfig, hints: Mapping[str, str], shortener: ThinkingShortener | None):
        self.agent = agent
        self.cfg = cfg
        self.hints = hints
        self.shortener = shortener

    async def run(self, policy: Policy, sample: QASample) -> DistillOutcome:
        hint = self.hints.get(sample.id)
        teacher = HintedPolicy(policy, self._system_ids(hint)) if hint else policy
        trajectory = await self.agent.run(teacher, sample.question, sample.context)
        scores = score_answer(trajectory.prediction, sample.answers)
        drop = self.drop_reason(trajectory, scores)
        outcome = DistillOutcome(trajectory, scores, drop, [], privileged=hint is not None)
        if drop is None:
            outcome.turns = [TurnRecord.from_turn(turn) for turn in trajectory.turns]
            await self._shorten(policy, outcome)
        return outcome

    def drop_reason(self, trajectory: Trajectory, scores: Mapping[str, float]) -> tuple[str, str] | None:
        """Why a trajectory is not kept: an aborted call, a flagged turn, a wrong answer."""
        for index, turn in enumerate(trajectory.turns):
            if turn.finish_reason == "abort":
                return "aborted", f"turn {index} ({turn.kind}): the server aborted the generation"
            flagged = [flag for flag in turn.flags if flag in self.cfg.drop_flags]
            if flagged:
                return f"flag:{flagged[0]}", f"turn {index} ({turn.kind}): {turn.reason or flagged[0]}"
        score = scores[self.cfg.metric]
        if self.cfg.keep == "correct" and score < self.cfg.min_score:
            return "wrong_answer", f"{self.cfg.metric}={score:.3f} < {self.cfg.min_score} (prediction {trajectory.prediction!r})"
        return None

    async def _shorten(self, policy: Policy, outcome: DistillOutcome) -> None:
        if self.shortener is None:
            return
        for turn in outcome.turns:
            if self.shortener.wants(turn):
                result = await self.shortener.shorten(policy, turn)
                if result.shortened:
                    outcome.shortened += 1
                else:
                    outcome.shorten_skipped[result.reason] = outcome.shorten_skipped.get(result.reason, 0) + 1

    def _system_ids(self, hint: str) -> np.ndarray:
        tokenizer = self.agent.tokenizer
        text = tokenizer.apply_chat_template([{"role": "system", "content": hint}], tokenize=False)
        return self.agent.builder.encode(text)


class DistillRunner(Runner):
    """The evaluation runner (resumable store, concurrency, failures recorded) with distillation
    records instead of evaluation scores; a kept trajectory's token ids go to ``turns``."""

    def __init__(self, *args: Any, turns: TurnStore, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.turns = turns

    def record_fields(self, outcome: DistillOutcome, sample: QASample) -> dict[str, Any]:
        fields = outcome.record_fields(sample)
        if outcome.drop is None:
            ref = uuid.uuid4().hex
            self.turns.append(ref, sample.id, outcome.turns)  # before the record (see TurnStore)
            fields["turns_ref"] = ref
        return fields


# ------------------------------------------------------------------------------------ sources


def training_source(path: Path, limit: int | None) -> CellSource:
    """The samples of a training parquet; a row that cannot become a sample, or whose id an
    earlier row has, is a LoadFailure."""

    def items() -> Iterator[QASample | LoadFailure]:
        if not path.is_file():
            raise DataError(f"{path}: training file not found")
        ids = IdLedger()
        for where, row in itertools.islice(training_rows(path), limit):
            try:
                item: QASample | LoadFailure = training_sample(row, where)
            except (ValueError, KeyError, TypeError, OSError) as err:
                item = LoadFailure(_row_id(row, where), f"{UNREADABLE_ROW}: {where}: {type(err).__name__}: {err}")
            yield distinct(ids, item, where, where)

    return CellSource(path.stem, "train", items)


def _row_id(row: Mapping[str, Any], where: str) -> str:
    info = row.get("extra_info")
    rid = info.get("id") if isinstance(info, Mapping) else None
    return rid if isinstance(rid, str) and rid.strip() else where


# --------------------------------------------------------------------------------- SFT build


@dataclass
class SFTBuild:
    """What the SFT files received: samples per split and kind, and what was left out."""

    samples: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, int] = field(default_factory=dict)
    trajectories: int = 0
    too_long: int = 0
    broken: list[str] = field(default_factory=list)  # kept records that could not give samples
    files: dict[str, str] = field(default_factory=dict)


def build_sft(
    records: Sequence[Mapping[str, Any]], turns: TurnStore, cfg: DistillConfig, agent: str, tokenizer: Any, thinking: bool
) -> SFTBuild:
    """Write the SFT parquet(s) from the kept records' turns, all or nothing (module docstring).

    ``turns`` is streamed: only the latest records (light, without token ids) are in memory.
    Trajectories are written in sample order (``sample_id``, then repeat), not in the order the
    teacher's concurrent rollouts finished and stored them, so one distillation gives one SFT
    file whatever its timing (SFT shuffles it with its own seed).
    """
    paths = sft_paths(cfg.out)
    splits = ["train", "val"] if cfg.val_fraction > 0 else ["train"]
    build = SFTBuild(samples={split: 0 for split in splits})
    kinds: Counter[str] = Counter()
    kept = [r for r in records if r.get("status") == "ok" and r.get("kept")]
    wanted = {r["turns_ref"]: r for r in kept if isinstance(r.get("turns_ref"), str)}
    build.broken += [f"sample {r['sample_id']!r}: missing turns (no turns_ref)" for r in kept if not isinstance(r.get("turns_ref"), str)]
    with atomic_outputs([paths[split] for split in splits]) as temps:
        writers = {split: SFTWriter(temps[paths[split]], tokenizer, thinking) for split in splits}
        try:
            # Lines of superseded or unfinished runs are not referenced by a latest record.
            located = turns.locate(wanted)
            for ref in sorted(located, key=lambda ref: (wanted[ref]["sample_id"], wanted[ref].get("repeat", 0))):
                record = wanted.pop(ref)
                where, offset = located[ref]
                entry = turns.read_at(where, offset)
                try:
                    trajectory = read_turns(entry, record.get("num_turns"), agent, f"sample {record['sample_id']!r} ({where})")
                except RecordError as err:
                    build.broken.append(str(err))
                    continue
                split = split_of(record["sample_id"], cfg.val_fraction)
                build.trajectories += 1
                for sample in trajectory_samples(trajectory, cfg.answer_copies):
                    if cfg.max_length is not None and len(sample.input_ids) > cfg.max_length:
                        build.too_long += 1
                        continue
                    writers[split].write(sample, record["sample_id"], record.get("source") or "")
                    build.samples[split] += 1
                    kinds[sample.kind] += 1
        finally:
            for writer in writers.values():
                writer.close()
    build.broken += [f"sample {r['sample_id']!r}: missing turns (none stored in {turns.path.name})" for r in wanted.values()]
    for split, path in paths.items():
        if build.samples.get(split):
            build.files[split] = str(path)
        else:
            path.unlink(missing_ok=True)  # an empty or stale split would only mislead a recipe
    build.by_kind = dict(kinds)
    return build


# ------------------------------------------------------------------------------------ report


@dataclass
class DistillReport:
    """Keep rate and reasons over every sample of the output folder, and the SFT build."""

    samples: int
    finished: int
    kept: int
    dropped: dict[str, int]
    failed: dict[str, int]
    transient_failures: int
    privileged: int
    shortened_turns: int
    sft: SFTBuild

    @property
    def keep_rate(self) -> float:
        return self.kept / self.finished if self.finished else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "keep_rate": self.keep_rate}

    def lines(self) -> list[str]:
        out = [
            f"samples {self.samples}: finished {self.finished}, kept {self.kept} "
            f"(keep rate {self.keep_rate:.1%}), failed {sum(self.failed.values())} "
            f"({self.transient_failures} transient, retried on resume)",
        ]
        out += [f"  dropped {count:>6}  {reason}" for reason, count in sorted(self.dropped.items(), key=lambda kv: -kv[1])]
        out += [f"  failed  {count:>6}  {reason}" for reason, count in sorted(self.failed.items(), key=lambda kv: -kv[1])]
        sft = self.sft
        out.append(
            f"SFT samples {sft.samples} by kind {sft.by_kind} from {sft.trajectories} trajectories; "
            f"{sft.too_long} over --max-length left out; {len(sft.broken)} records with missing turns"
        )
        out += [f"  broken  {reason}" for reason in sft.broken[:10]]
        return out


def summarize(records: Sequence[Mapping[str, Any]], build: SFTBuild) -> DistillReport:
    """The report of the latest record of every sample (a file that could not be read to its
    end counts as a failure; the record saying it was read again later is no sample)."""
    records = [r for r in records if not (r.get("sample_id") == CELL and r.get("status") == "ok")]
    dropped: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    finished = kept = transient = privileged = shortened = 0
    for record in records:
        if record.get("status") == "ok":
            finished += 1
            kept += bool(record.get("kept"))
            privileged += bool(record.get("privileged"))
            shortened += int(record.get("shortened_turns") or 0)
            if not record.get("kept"):
                dropped[record.get("drop_reason") or "unknown"] += 1
        else:
            failed[_failure_kind(record)] += 1
            transient += bool(record.get("transient"))
    return DistillReport(len(records), finished, kept, dict(dropped), dict(failed), transient, privileged, shortened, build)


def _failure_kind(record: Mapping[str, Any]) -> str:
    """A failed record's reason without its per-sample details, so that counts group."""
    if record.get("error_kind"):  # the teacher's PolicyError (see Runner._sample)
        return f"teacher {record['error_kind']}"
    reason = str(record.get("reason", ""))
    if reason.startswith(UNREADABLE_ROW):
        return UNREADABLE_ROW
    return reason[:80]


# ------------------------------------------------------------------------------------ run


def _source(cfg: DistillConfig, tokenizer: Any) -> CellSource:
    if cfg.data is not None:
        return training_source(cfg.data, cfg.samples)
    return synthetic_sources([cfg.synthetic_length], cfg.samples or 4, tokenizer, cfg.seed)[0]


async def run_teacher(cfg: DistillConfig, teacher: OpenedModel | None = None) -> tuple[ResultStore, TurnStore, str, AgentConfig, Any]:
    """Run (or resume) the teacher over the data; returns the store and what the SFT build needs.

    ``teacher``: a ready teacher (tests, scripted teachers); by default the model ``cfg`` names
    (:func:`~infmem_verl.policy.source.open_model`), closed at the end.
    """
    agent_name, recipe_cfg = recipe_agent(cfg.recipe, cfg.overrides)
    agent_cfg = teacher_agent_config(cfg, recipe_cfg)
    hints = load_decompositions(cfg.decomposition) if cfg.decomposition else {}
    source = None
    if teacher is None and cfg.teacher == "oracle":
        teacher, source = _oracle(cfg)
        owned = False
    else:
        owned = teacher is None
    model = teacher or await open_model(cfg.source, "distill", cfg.seed)
    try:
        store = ResultStore(cfg.out, protocol(cfg, agent_name, agent_cfg, model.name, TokenizerStamp.of(model.tokenizer)))
        turns = TurnStore(cfg.out)
        agent = build_agent(agent_name, agent_cfg, model.tokenizer)
        shortener = ThinkingShortener(model.tokenizer, cfg.shorten) if cfg.shorten.enabled else None
        method = Teacher(agent, cfg, hints, shortener)
        runner = DistillRunner(model.policy, {agent_name: method}, store, cfg.source.concurrency, cfg.retry_failed, cfg.progress, turns=turns)
        counts = await runner.run([source or _source(cfg, model.tokenizer)])
        print(f"[distill] this run: {counts.read} records read, {counts.ran} samples run ({counts.failed} failed), {counts.skipped} already done")
    finally:
        if owned:
            await model.close()
    return store, turns, agent_name, agent_cfg, model.tokenizer


def _oracle(cfg: DistillConfig) -> tuple[OpenedModel, CellSource]:
    """The scripted teacher of the synthetic set and the samples it knows (built once)."""
    from infmem_verl.assets import load_tokenizer
    from infmem_verl.policy.scripted import oracle_policy

    tokenizer = load_tokenizer(str(cfg.source.tokenizer) if cfg.source.tokenizer else None)
    source = _source(cfg, tokenizer)
    samples = [item for item in source.items() if isinstance(item, QASample)]
    known = CellSource(source.dataset, source.length, lambda: iter(samples))
    return OpenedModel(oracle_policy(tokenizer, samples), tokenizer, "scripted-oracle"), known


def saved_run(cfg: DistillConfig) -> tuple[ResultStore, TurnStore, str, AgentConfig, Any]:
    """The store of an earlier run, for ``--sft-only``; the tokenizer must be the one it used."""
    from infmem_verl.agent.config import agent_config
    from infmem_verl.assets import load_tokenizer

    manifest = cfg.out / MANIFEST
    if not manifest.is_file():
        raise ConfigError(f"out: {cfg.out} holds no distillation run (no {MANIFEST}); run without --sft-only first")
    saved = json.loads(manifest.read_text(encoding="utf-8"))
    tokenizer = load_tokenizer(str(cfg.source.tokenizer) if cfg.source.tokenizer else None)
    stamp = TokenizerStamp.from_json(saved["tokenizer"])
    differ = TokenizerStamp.of(tokenizer).differences(stamp)
    if differ:
        raise ConfigError(
            f"tokenizer: not the one {cfg.out} was distilled with ({stamp.name}; {' and '.join(differ)} differ); pass --tokenizer"
        )
    return ResultStore(cfg.out, saved), TurnStore(cfg.out), saved["agent"], agent_config(saved["agent_config"]), tokenizer


async def distill(cfg: DistillConfig, teacher: OpenedModel | None = None) -> DistillReport:
    """Run the teacher (unless ``run_teacher`` is off), build the SFT files, write the report."""
    cfg.validate()
    store, turns, agent, agent_cfg, tokenizer = await run_teacher(cfg, teacher) if cfg.run_teacher else saved_run(cfg)
    records = store.latest()
    build = build_sft(records, turns, cfg, agent, tokenizer, agent_cfg.thinking)
    report = summarize(records, build)
    (cfg.out / REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    for line in report.lines():
        print(f"[distill] {line}")
    return report


# ------------------------------------------------------------------------------------ CLI


def parse_args(argv: Sequence[str] | None = None) -> DistillConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="output folder (records, SFT parquet, report)")
    parser.add_argument("--data", type=Path, help="training parquet (data_prep format); default: the synthetic set")
    parser.add_argument("--recipe", default="infmem_4b", help="RL recipe whose infmem.agent protocol the teacher runs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="Hydra override of that composition (repeatable)")
    parser.add_argument("--samples", type=int, help="first N rows only (synthetic: N samples, default 4)")
    parser.add_argument("--synthetic-length", default="4k", help="document length of the synthetic set")
    add_model_options(parser, "teacher", TEACHER)
    parser.add_argument("--teacher", choices=("model", "oracle"), default="model", help="oracle: the synthetic set's scripted teacher instead of a model")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", choices=("correct", "all"), default="correct")
    parser.add_argument("--metric", choices=ANSWER_METRICS, default="em", help="answer score --keep correct uses")
    parser.add_argument("--min-score", type=float, default=1.0)
    parser.add_argument("--drop-flags", default=",".join(DEFAULT_DROP_FLAGS), help="turn flags that drop a trajectory; 'none' for none")
    parser.add_argument("--decomposition", type=Path, help="MuSiQue file with question_decomposition: privileged teacher hints")
    parser.add_argument("--shorten-over", type=int, help="rewrite thinking longer than this many tokens (off by default)")
    parser.add_argument("--shorten-ratio", type=float, default=0.33)
    parser.add_argument("--shorten-kinds", default="write,answer", help="calls whose thinking is rewritten")
    parser.add_argument("--answer-copies", default="1", help="copies of each answer sample, or 'reference'")
    parser.add_argument("--max-length", type=int, help="leave out SFT samples longer than this (the recipe's data.max_length)")
    parser.add_argument("--val-fraction", type=float, default=0.0, help="trajectories written to sft_val.parquet (reference: 0.1)")
    parser.add_argument("--retry-failed", default="transient", choices=RETRY_POLICIES)
    parser.add_argument("--sft-only", action="store_true", help="rebuild the SFT files from the records, no teacher")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    flags = () if args.drop_flags.strip() == "none" else tuple(comma_list(args.drop_flags))
    copies = args.answer_copies if args.answer_copies == "reference" else _int(args.answer_copies, "--answer-copies")
    return DistillConfig(
        out=args.out,
        data=args.data,
        recipe=args.recipe,
        overrides=args.overrides,
        samples=args.samples,
        synthetic_length=args.synthetic_length,
        source=model_source(args),
        teacher=args.teacher,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        keep=args.keep,
        metric=args.metric,
        min_score=args.min_score,
        drop_flags=flags,
        decomposition=args.decomposition,
        shorten=ShortenConfig(
            over_tokens=args.shorten_over,
            ratio=args.shorten_ratio,
            kinds=tuple(comma_list(args.shorten_kinds)),
        ),
        answer_copies=copies,
        max_length=args.max_length,
        val_fraction=args.val_fraction,
        retry_failed=args.retry_failed,
        run_teacher=not args.sft_only,
        progress=not args.no_progress,
    ).validate()


def _int(text: str, option: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{option}: expected an integer or 'reference', got {text!r}") from None


@entry_point("distill", (RecordError,))
def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(distill(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
