"""The warm-up of self-contained runs: a tiny Qwen3 that follows the protocol, built once and cached.

GRPO from a random model learns nothing in a smoke run: it never emits a parsable action or
closes its thinking, so every trajectory scores the same and every advantage is zero. With
``infmem.bootstrap.model: warm_qwen3`` (the demo recipe, ``make demo``) the null model path of a
bootstrapping recipe becomes a model warmed up the way the paper's recipe warms up its backbone,
in miniature:

0. **curriculum** (``answer_steps``, ``memagent_steps``, ``infmem_steps``; the demo recipe's
   warm-up) - the stages of :mod:`infmem_verl.sft.curriculum`, each an SFT parquet of the oracle's
   calls made without the loop and trained by the same SFT command in segments of at most
   ``segment_steps`` (each a new seed, warm-up and cosine); a segment already trained is kept
   when a build is resumed. With an InfMem stage and no ``sft_steps`` one student serves both
   agents (:func:`built_for`): the cache key names both, and step 3 checks both;
1. **distil** (with ``sft_steps``) - the synthetic set's oracle (:func:`~infmem_verl.policy.scripted.oracle_policy`,
   which knows where the two facts are) runs the recipe's agent protocol, through
   ``python -m infmem_verl.distill --teacher oracle`` (every finished trajectory kept);
2. **SFT** (with ``sft_steps``) - the tiny Qwen3 (:func:`~infmem_verl.assets.tiny_qwen3_dir`, or
   the curriculum's; over Qwen3's vocabulary or, with ``vocab_size``, that of
   :mod:`infmem_verl.small_vocab`, which carries Qwen3's special tokens and chat template, so the
   protocol is the same) is fine-tuned on those calls through
   ``python -m infmem_verl.sft +recipe=sft_warmup`` (the CPU loop); with ``lm_steps`` it first
   trains that many steps on every token of the same sequences (a stand-in for the pretraining a
   real backbone brings: the prompts repeat the question's names in the search history and the
   memory, which is copying, and the responses are trained there too);
3. **check** - the trained model runs the recipe's agent on held-out synthetic documents (another
   seed), sampled at the warm-up's own ``check_temperature`` / ``check_top_p`` (Qwen3's
   thinking-mode 0.6 / 0.95), not at the launching run's, so the cached model and its report
   are the same whichever run built them. It measures the share of PreThink turns whose action
   parsed and of Writes that closed their thinking within the memory cap (the protocol reward's
   definitions), retrieval, early stopping and accuracy. A model under ``min_valid`` on either
   rate is refused, so a run never starts RL from a model that cannot follow the protocol.

Everything lives in ``<cache>/warm-qwen3-<key>/`` (``INFMEM_CACHE``, default
``~/.cache/infmem_verl``): ``model/`` (the Hugging Face folder RL starts from), ``warmup.json``
(settings, SFT losses, held-out figures; the run summary plots the losses) and ``work/`` (the
distillation records, LM and SFT checkpoints and the commands' logs). ``key`` hashes the warm-up
settings and the agent protocol, so a change of either builds a new model and a finished one is
reused as it is. Both commands are resumable; the model folder appears only when all is done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence, get_args

from omegaconf import DictConfig, OmegaConf

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.data.synthetic import NameStyle
from infmem_verl.settings import agent_settings, read_settings
from infmem_verl.warmup_report import REPORT, HeldOut, WarmupReport

WARMUP_KEY = "infmem.warmup"
# Held-out documents come from another seed than the distilled ones, so none was seen in SFT.
HELDOUT_SEED_OFFSET = 1000


class WarmupError(RuntimeError):
    """A warm-up stage failed, or the warmed model is below its protocol threshold."""


@dataclass(frozen=True)
class WarmupSettings:
    """``infmem.warmup``: the student, its data and its training (defaults: the demo recipe's)."""

    hidden_size: int = 128  # of the tiny Qwen3 student
    layers: int = 2
    # Tokens of the student's vocabulary: 0 for Qwen3's own (151,936 rows, whose output layer is
    # ~97% of a hidden-128 student's compute wherever logits are taken), or a small BPE of this
    # many tokens with Qwen3's special tokens and chat template (infmem_verl/small_vocab.py). The
    # demo recipe and the suite's checked warm-up use 4,096; their students pass min_valid
    # (docs/experiments/2026-12-06-demo-curriculum.md, 2026-12-06-suite-students.md).
    vocab_size: int = 0
    # The curriculum (infmem_verl/sft/curriculum.py): steps of each stage of fresh oracle calls,
    # run in this order before the distilled SFT (0: the stage is skipped). What makes the student
    # copy facts with role names (infmem.bootstrap.names). With infmem_steps and no sft_steps the
    # student serves both agents (built_for).
    answer_steps: int = 0
    memagent_steps: int = 0
    infmem_steps: int = 0
    answers_per_batch: int = 8  # answer calls added to each batch of the memagent and infmem stages
    # A stage runs in segments of at most this many steps, each over calls of a new seed with its
    # own warm-up and cosine: the staged schedule taught all three kinds of name where one
    # 3,000-step cosine stopped at two (docs/experiments/2026-12-06-copying-names.md).
    segment_steps: int = 800
    # The answer stage's gate (0: none): after each of its segments the student answers held-out
    # answer calls of each kind of question (two-hop, bridge, entity); the stage ends once every
    # kind is answered exactly this often (answer_steps is then the most it runs), and a build
    # that does not get there stops with WarmupError before the longer stages. The copy forms one
    # kind at a time, at a step that varies between machines: the build that formed all three on
    # one CPU formed one on another (docs/experiments/2026-12-06-copy-onset.md).
    answer_copy_min: float = 0.0
    # The MemAgent stage's gate (0: none), its Writes' copy: after each of its segments the student
    # runs MemAgent on the held-out documents, and the stage ends once the last memory holds the
    # answer for this share of them (memagent_steps is then the most it runs); a build that does
    # not get there stops with WarmupError before the InfMem stage. On the EPYC the Writes copied
    # nothing after 800 steps and 9-80% after 1,400 (three builds); on the Xeon 400 sufficed.
    memory_copy_min: float = 0.0
    # The names of the answer calls' chains, in every stage ("": the documents' own,
    # infmem.bootstrap.names). With role names each kind of question is its own copy, learnt one
    # at a time or not at all; names drawn from one list for every role make the student learn one
    # copy for all three (the EPYC: all three kinds at 84-94% after two segments, where role names
    # gave one kind in three builds), and it serves the role-named documents.
    answer_names: str = ""
    model_seed: int = 0  # the student's random initialisation
    distill_samples: int = 128  # oracle trajectories (each gives about five SFT samples)
    doc_tokens: int = 1024  # synthetic document length, distilled and held out
    # Steps on every token of the distilled sequences before the SFT proper (0: none): the
    # random student's pretraining, in miniature.
    lm_steps: int = 0
    sft_steps: int = 300  # on the distilled calls (0: no distillation, the curriculum alone)
    batch_size: int = 8  # calls a step: the distilled SFT's and the answer stage's (the others add answers_per_batch)
    lr: float = 1.0e-2  # a random tiny model: 2e-3 left its format tokens unsure after 100 steps
    heldout_samples: int = 16
    min_valid: float = 0.9  # least share of valid PreThink actions and of valid Writes
    # Least held-out accuracy (sub-EM) of every agent the student is built for: under it the
    # outcome and early-stop rewards cannot move in RL, so the build stops with WarmupError. Left
    # out of the cache key: a refused build rerun with a lower bar only checks again.
    min_accuracy: float = 0.0
    check_temperature: float = 0.6  # the held-out check's sampling
    check_top_p: float = 0.95
    seed: int = 100  # of the distilled documents (held-out ones: seed + 1000)

    def validate(self, path: str) -> WarmupSettings:
        for name in ("hidden_size", "layers", "distill_samples", "batch_size", "heldout_samples", "segment_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        for name in ("lm_steps", "sft_steps", "answer_steps", "memagent_steps", "infmem_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{path}.{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if not self.sft_steps and not self.curriculum_steps:
            raise ConfigError(f"{path}: no training; set sft_steps or the curriculum's answer_steps / memagent_steps / infmem_steps")
        if self.lm_steps and not self.sft_steps:
            raise ConfigError(f"{path}.lm_steps: trains on the distilled calls, which sft_steps=0 leaves out")
        if self.answers_per_batch < 0:
            raise ConfigError(f"{path}.answers_per_batch: expected an integer >= 0, got {self.answers_per_batch!r}")
        if self.doc_tokens < 512:
            raise ConfigError(f"{path}.doc_tokens: expected an integer >= 512, got {self.doc_tokens!r}")
        if not self.lr > 0:
            raise ConfigError(f"{path}.lr: expected a number > 0, got {self.lr!r}")
        for name in ("answer_copy_min", "memory_copy_min", "min_accuracy", "min_valid"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{path}.{name}: expected a number in [0, 1], got {getattr(self, name)!r}")
        styles = get_args(NameStyle)
        if self.answer_names not in ("", *styles):
            expected = ", ".join(repr(style) for style in styles[:-1]) + f" or {styles[-1]!r}"
            raise ConfigError(f"{path}.answer_names: expected '' (the documents' names), {expected}, got {self.answer_names!r}")
        if not self.check_temperature >= 0:
            raise ConfigError(f"{path}.check_temperature: expected a number >= 0, got {self.check_temperature!r}")
        if not 0 < self.check_top_p <= 1:
            raise ConfigError(f"{path}.check_top_p: expected a number in (0, 1], got {self.check_top_p!r}")
        if self.vocab_size and self.vocab_size < 1024:
            raise ConfigError(f"{path}.vocab_size: expected 0 (Qwen3's vocabulary) or an integer >= 1024, got {self.vocab_size!r}")
        if self.hidden_size % 32:
            raise ConfigError(f"{path}.hidden_size: expected a multiple of 32 (head_dim), got {self.hidden_size!r}")
        return self

    @property
    def curriculum_steps(self) -> int:
        return self.answer_steps + self.memagent_steps + self.infmem_steps


def warmup_settings(config: DictConfig) -> WarmupSettings:
    return read_settings(WarmupSettings, config, WARMUP_KEY, required=False)


def warm_qwen3_dir(
    config: DictConfig, recipe: str, overrides: Sequence[str] = (), cache_dir: Path | None = None, say: Callable[[str], None] = print
) -> Path:
    """The warmed model folder for ``config`` (built when absent; see the module docstring).

    ``recipe`` and ``overrides`` compose the same agent protocol in the distillation command as
    in ``config`` (the launcher passes its own command line).
    """
    from infmem_verl.agent.offline_cache import cache_root
    from infmem_verl.assets import tiny_qwen3_dir

    settings = warmup_settings(config)
    agent_name = config.actor_rollout_ref.rollout.agent.default_agent_loop.removesuffix("_agent")
    agent_cfg = agent_settings(config)
    # The documents' names (infmem.bootstrap.names, validated by the bootstrap that calls this).
    names = str(OmegaConf.select(config, "infmem.bootstrap.names", default="syllables"))
    if settings.sft_steps and names != "syllables":
        raise ConfigError(
            f"{WARMUP_KEY}.sft_steps: the distillation's documents have syllable names, the run's {names!r} "
            "(infmem.bootstrap.names); set sft_steps=0 to warm up on the curriculum alone"
        )
    agents = built_for(settings, agent_name)
    key = protocol_key(settings, "+".join(agents), agent_cfg, names)
    root = (cache_dir or cache_root()) / f"warm-qwen3-{key}"
    model = root / "model"
    if (model / "config.json").is_file() and (root / REPORT).is_file():
        return model
    work = root / "work"
    work.mkdir(parents=True, exist_ok=True)
    report = WarmupReport(dataclasses.asdict(settings), key)
    say(f"warm-up: building the warmed tiny Qwen3 once (cached in {root}; logs in {work})")

    checkpoint = tiny_qwen3_dir(
        hidden_size=settings.hidden_size, tokenizer_dir=student_tokenizer_dir(settings), layers=settings.layers, seed=settings.model_seed
    )
    if settings.curriculum_steps:
        started = time.perf_counter()
        checkpoint = _curriculum(settings, agent_cfg, names, checkpoint, work, report, say)
        report.seconds["curriculum"] = time.perf_counter() - started
    if settings.sft_steps:
        started = time.perf_counter()
        _distill(settings, recipe, overrides, work)
        report.seconds["distill"] = time.perf_counter() - started

        started = time.perf_counter()
        checkpoint, report.lm_losses, losses = _sft(settings, checkpoint, work)
        report.sft_losses += losses
        report.stages["sft"] = len(losses)
        report.seconds["sft"] = time.perf_counter() - started

    started = time.perf_counter()
    for agent in agents:
        report.agents[agent] = heldout = heldout_check(checkpoint, agent, check_sampling(settings, agent_cfg), settings, names)
        say(f"warm-up: {agent}: {heldout.line()}")
        if min(heldout.prethink_valid, heldout.write_valid) < settings.min_valid:  # NaN (MemAgent's PreThinks) never is
            raise WarmupError(
                f"{WARMUP_KEY}: the warmed model follows the protocol on fewer than min_valid={settings.min_valid:.0%} "
                f"of held-out {agent} turns ({heldout.line()}); raise the steps, distill_samples or hidden_size"
            )
        if heldout.sub_em < settings.min_accuracy:
            raise WarmupError(
                f"{WARMUP_KEY}: the warmed model answers {heldout.sub_em:.0%} of held-out {agent} questions, under "
                f"min_accuracy={settings.min_accuracy:.0%} ({heldout.line()}), so RL's outcome and early-stop rewards "
                "cannot move; 'answer in memory' says whether its Writes copy the facts (docs/experiments/"
                f"2026-12-06-copy-onset.md). {WARMUP_KEY}.min_accuracy=0 runs RL from it anyway (the curriculum's finished segments are reused)"
            )
    report.heldout = report.agents[agent_name]
    report.seconds["check"] = time.perf_counter() - started
    tmp = root / f"model.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp)
    tmp.rename(model)
    (root / REPORT).write_text(json.dumps(report.to_json(), indent=2) + "\n", encoding="utf-8")
    return model


def built_for(settings: WarmupSettings, agent: str) -> tuple[str, ...]:
    """The agents the warmed student is built and checked for: both when the curriculum's InfMem
    stage is its last training (its batches keep MemAgent's Writes, so a MemAgent run and an InfMem
    run share one student and one cache entry), else the run's own."""
    if settings.infmem_steps and not settings.sft_steps:
        return ("infmem", "memagent")
    return (agent,)


def _keyed(settings: WarmupSettings) -> dict:
    """The settings that decide the model (a refusal's bar does not)."""
    fields = dataclasses.asdict(settings)
    del fields["min_accuracy"]
    return fields


def launch_command(config: DictConfig) -> tuple[str, list[str]]:
    """The recipe and the other command-line overrides of this launch (Hydra's), for the
    distillation command to compose the same protocol; outside a Hydra app, ``recipe_name``."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return str(config.recipe_name), []
    recipe, others = str(config.recipe_name), []
    for override in HydraConfig.get().overrides.task:
        if override.startswith("+recipe="):
            recipe = override.removeprefix("+recipe=")
        else:
            others.append(override)
    return recipe, others


def protocol_key(settings: WarmupSettings, agent: str, agent_cfg: AgentConfig, names: str = "syllables") -> str:
    """A short hash of everything that decides the warmed model and its check (the run's sampling
    excluded: it changes neither what is distilled nor how the check samples)."""
    protocol = dataclasses.asdict(dataclasses.replace(agent_cfg, temperature=1.0, top_p=1.0, top_k=-1))
    fields = {"settings": _keyed(settings), "agent": agent, "protocol": protocol}
    if names != "syllables":  # keys of the warm-ups built before documents had other names stay as they were
        fields["names"] = names
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------------ stages


def _distill(settings: WarmupSettings, recipe: str, overrides: Sequence[str], work: Path) -> None:
    out = work / "distill"
    command = [
        "-m", "infmem_verl.distill", "--recipe", recipe, "--teacher", "oracle",
        "--samples", str(settings.distill_samples), "--synthetic-length", str(settings.doc_tokens),
        "--seed", str(settings.seed), "--keep", "all", "--drop-flags", "none", "--no-progress", "--out", str(out),
    ]  # fmt: skip
    tokenizer = student_tokenizer_dir(settings)
    if tokenizer is not None:  # the SFT samples are token ids: the student's own
        command += ["--tokenizer", str(tokenizer)]
    for override in overrides:
        command += ["--set", override]
    progress = _LineCount(out / "results.jsonl")
    _run("distil", command, work / "distill.log", settings.distill_samples, progress)


def _curriculum(
    settings: WarmupSettings, agent_cfg: AgentConfig, names: str, student: Path, work: Path, report: WarmupReport, say: Callable[[str], None]
) -> Path:
    """``student`` after each stage of the curriculum with steps, in turn, each stage's losses
    appended to the report's."""
    from infmem_verl.assets import load_tokenizer
    from infmem_verl.sft.curriculum import STAGES, write_stage

    tokenizer = load_tokenizer(str(student))
    for stage in STAGES:
        total = getattr(settings, f"{stage}_steps")
        answers = 0 if stage == "answer" else settings.answers_per_batch
        batch = settings.batch_size + answers
        gate, what = GATES.get(stage, ("", ""))
        bar = getattr(settings, gate) if gate else 0.0
        for segment, start in enumerate(range(0, total, settings.segment_steps)):
            steps = min(settings.segment_steps, total - start)
            name = f"{stage}{segment + 1}"
            data = work / f"{name}.parquet"
            if not data.is_file():  # calls of a new seed per segment (each seed uses two: trajectories, answer calls)
                write_stage(data, stage, steps, batch, tokenizer, agent_cfg, names, settings.seed + 2 * segment, answers, settings.answer_names or names)
            student, losses = _finished(work / name, steps) or _train(name, student, data, work / name, steps, settings, batch)
            report.sft_losses += losses
            report.stages[name] = len(losses)
            if bar:
                report.copied[name] = _copies(stage, student, tokenizer, agent_cfg, names, settings, name, say)
                if min(report.copied[name].values()) >= bar:
                    break  # the stage's copy has formed: its work is done
        if total and bar and min(report.copied[name].values()) < bar:
            raise WarmupError(
                f"{WARMUP_KEY}: after {start + steps} {stage} steps, {what}: {_kinds_line(report.copied[name])}, under "
                f"{gate}={bar:.0%}, so the student would answer few questions; when the copy forms varies between "
                f"builds and machines (docs/experiments/2026-12-06-copy-onset.md): raise {WARMUP_KEY}.{stage}_steps, or set "
                f"{WARMUP_KEY}.model_seed to another value to build from another initialisation"
            )
    return student


# The stages with a gate: its setting and what it measures. After each segment the student's copy is
# measured (_copies) and the stage ends once every figure reaches the bar; a stage that ends under
# it stops the build before the longer stages that would start from it.
GATES = {
    "answer": ("answer_copy_min", "held-out answer calls answered exactly"),
    "memagent": ("memory_copy_min", "held-out MemAgent runs whose last memory holds the answer"),
}


def _copies(stage: str, student: Path, tokenizer, agent_cfg: AgentConfig, names: str, settings: WarmupSettings,
            name: str, say: Callable[[str], None]) -> dict[str, float]:  # fmt: skip
    """What the student after segment ``name`` copies (said on the console): after an answer
    segment, each kind of held-out answer call answered exactly; after a MemAgent segment, the
    held-out documents whose last MemAgent memory holds the answer."""
    if stage == "answer":
        from infmem_verl.cpu.engine import load_model
        from infmem_verl.sft.curriculum import copied_kinds

        kinds = copied_kinds(load_model(str(student)), tokenizer, agent_cfg, names, settings.seed + HELDOUT_SEED_OFFSET)
        say(f"warm-up: {name}: {GATES[stage][1]}: {_kinds_line(kinds)}")
        return kinds
    heldout = heldout_check(student, stage, check_sampling(settings, agent_cfg), settings, names)
    say(f"warm-up: {name}: {stage} {heldout.line()}")
    return {"answer in memory": heldout.answer_in_memory}


def _kinds_line(kinds: dict[str, float]) -> str:
    return ", ".join(f"{kind} {share:.0%}" for kind, share in kinds.items())


def _finished(out: Path, steps: int) -> tuple[Path, list[float]] | None:
    """The checkpoint and losses of a segment an interrupted build already trained (None if not):
    a rebuild resumes at the first unfinished segment."""
    from infmem_verl.sft.cpu import LOSS_LOG

    checkpoint = out / f"global_step_{steps}" / "huggingface"
    if not (checkpoint / "config.json").is_file() or not (out / LOSS_LOG).is_file():
        return None
    losses = _losses(out / LOSS_LOG)
    return (checkpoint, losses) if len(losses) == steps else None


def _sft(settings: WarmupSettings, student: Path, work: Path) -> tuple[Path, list[float], list[float]]:
    """``student`` after ``lm_steps`` on every token of the distilled sequences, then
    ``sft_steps`` on the calls' responses; with both stages' losses."""
    data = work / "distill" / "sft_train.parquet"
    lm_losses: list[float] = []
    if settings.lm_steps:
        student, lm_losses = _train("LM", student, _every_token(data), work / "lm", settings.lm_steps, settings)
    checkpoint, losses = _train("SFT", student, data, work / "sft", settings.sft_steps, settings)
    return checkpoint, lm_losses, losses


def _every_token(data: Path) -> Path:
    """``data`` with every token trained: the prompts' text too, where the student sees the
    question's names again in its search history and memory and the retrieved passages overlap
    the chunk - copying that the responses alone show a few dozen tokens of per call."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(data)
    lengths = table.column("input_ids").combine_chunks().value_lengths().to_numpy()
    ones = pa.array([[1] * int(n) for n in lengths], type=table.schema.field("loss_mask").type)
    table = table.set_column(table.schema.get_field_index("num_trained"), "num_trained", table.column("num_tokens"))
    out = data.with_name("lm_train.parquet")
    pq.write_table(table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", ones), out.with_suffix(".tmp"))
    out.with_suffix(".tmp").rename(out)
    return out


def _train(stage: str, student: Path, data: Path, out: Path, steps: int, settings: WarmupSettings, batch: int = 0) -> tuple[Path, list[float]]:
    from infmem_verl.sft.cpu import LOSS_LOG

    losses_file = out / LOSS_LOG
    losses_file.unlink(missing_ok=True)  # a rerun trains from the start: its curve alone is kept
    command = [
        "-m", "infmem_verl.sft", "+recipe=sft_warmup", f"model.path={student}",
        f"data.train_files={data}", f"trainer.default_local_dir={out}",
        f"trainer.total_training_steps={steps}", f"data.train_batch_size={batch or settings.batch_size}", f"data.micro_batch_size_per_gpu={batch or settings.batch_size}",
        f"optim.lr={settings.lr}",
        f"hydra.run.dir={out}",  # Hydra's record of the command beside its output, not in the caller's folder
    ]  # fmt: skip
    _run(stage, command, out.parent / f"{out.name}.log", steps, _LineCount(losses_file))
    return out / f"global_step_{steps}" / "huggingface", _losses(losses_file)


def _losses(path: Path) -> list[float]:
    """The per-step losses the SFT command appended to ``path``."""
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if line.strip()]


def student_tokenizer_dir(settings: WarmupSettings) -> Path | None:
    """The student's tokenizer folder; None for Qwen3's own."""
    if not settings.vocab_size:
        return None
    from infmem_verl.small_vocab import small_vocab_dir

    return small_vocab_dir(settings.vocab_size)


def check_sampling(settings: WarmupSettings, agent_cfg: AgentConfig) -> AgentConfig:
    """The agent as the held-out check runs it: the warm-up's sampling, whatever the launching
    run samples at (the cache key leaves sampling out, so a run at temperature 1 reuses the model
    a run at 0.6 built, and the first build must not be refused for the launch's sampling)."""
    return dataclasses.replace(
        agent_cfg, temperature=settings.check_temperature, top_p=settings.check_top_p, top_k=-1, record_token_ids=False
    )


def heldout_check(model_dir: Path, agent_name: str, agent_cfg: AgentConfig, settings: WarmupSettings, names: str = "syllables") -> HeldOut:
    """Run the agent with the model at ``model_dir`` on held-out synthetic documents (their
    names made as ``names`` says, :data:`infmem_verl.data.synthetic.NameStyle`)."""
    from infmem_verl.agent.loops import build_agent
    from infmem_verl.data.synthetic import make_dataset
    from infmem_verl.policy.transformers import TransformersPolicy
    from infmem_verl.reward.components import TrajectoryRecord, action_failed, answer_in_memory, early_stop, memory_failed, outcome
    from infmem_verl.agent.facts import turn_facts

    policy = TransformersPolicy.from_pretrained(model_dir, seed=settings.seed, max_batch=settings.heldout_samples)
    agent = build_agent(agent_name, agent_cfg, policy.tokenizer)
    samples = make_dataset(settings.heldout_samples, settings.doc_tokens, policy.tokenizer, seed=settings.seed + HELDOUT_SEED_OFFSET, names=names)
    bar = _Bar("check", len(samples))

    async def one(sample):
        trajectory = await agent.run(policy, sample.question, sample.context)
        bar.advance()
        turns = [turn_facts(trajectory, i, turn) for i, turn in enumerate(trajectory.turns)]
        return trajectory, TrajectoryRecord(turns, list(sample.answers))

    async def run_all():
        async with policy:
            return await asyncio.gather(*(one(s) for s in samples))

    runs = asyncio.run(run_all())
    bar.close()
    turns = [t for _, record in runs for t in record.turns]
    prethinks = [t for t in turns if t.turn_kind == "prethink"]
    writes = [t for t in turns if t.turn_kind == "write"]
    summaries = [trajectory.summary() for trajectory, _ in runs]

    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values) if values else float("nan")

    return HeldOut(
        samples=len(samples),
        prethink_valid=mean(not action_failed(t) for t in prethinks),
        write_valid=mean(not memory_failed(t) for t in writes),
        retrieval_calls=mean(s.retrieval_calls for s in summaries),
        chunks_read=mean(s.chunks_read for s in summaries),
        stopped_early=mean(s.stopped_early for s in summaries),
        early_stop=mean(early_stop(record) for _, record in runs),
        accuracy=mean(outcome(record) for _, record in runs),
        sub_em=mean(outcome(record, "sub_em") for _, record in runs),
        answer_in_memory=mean(bool(r.writes) and answer_in_memory(r.writes[-1].memory_text, r.golds) for _, r in runs),
    )


# ------------------------------------------------------------------------------- subprocesses


class _LineCount:
    """Progress of a command read off the lines of the file it appends to as it goes."""

    def __init__(self, path: Path):
        self.path = path

    def __call__(self) -> int:
        try:
            with self.path.open("rb") as file:
                return sum(1 for line in file if line.strip())
        except FileNotFoundError:
            return 0


def _run(stage: str, module_args: list[str], log: Path, total: int, progress: Callable[[], int]) -> None:
    """Run ``python <module_args>`` with its output in ``log``, a progress bar on the console;
    a failure raises :class:`WarmupError` with the end of the log."""
    bar = _Bar(stage, total)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, *module_args], stdout=out, stderr=subprocess.STDOUT, env=env)
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(1.0):
                bar.update(progress())

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            code = process.wait()
        except BaseException:
            process.kill()
            raise
        finally:
            stop.set()
            watcher.join()
    bar.update(progress())
    bar.close()
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise WarmupError(f"warm-up {stage} failed (exit {code}); the end of {log}:\n{tail}")


class _Bar:
    """A tqdm bar on the console for one warm-up stage."""

    def __init__(self, stage: str, total: int):
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=f"[infmem] warm-up {stage}", unit="", leave=True, dynamic_ncols=True)
        self._lock = threading.Lock()

    def update(self, done: int) -> None:
        with self._lock:
            self._bar.update(max(0, min(done, self._bar.total) - self._bar.n))

    def advance(self) -> None:
        with self._lock:
            self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
