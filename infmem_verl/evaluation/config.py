"""Evaluation settings: the run's :class:`EvalConfig` and the protocol presets.

A preset fixes everything that changes what a score means (agent budgets, thinking, answer
format, decoding, retrieval top-k, the headline metric); the rest of :class:`EvalConfig` says what
to run and where. Three presets:

- ``embedded``: the no-argument run: tiny budgets and short synthetic documents for the tiny
  in-process model, so ``python -m infmem_verl.eval`` finishes in about a minute anywhere;
- ``default``: our protocol (spec §8.3): the agent core's budgets, ``\\boxed{}`` answers, greedy
  decoding; headline accuracy = whole-word gold-in-prediction against **all** golds;
- ``reference``: the papers' evaluation protocol for like-for-like comparison (spec §2.6, §6.3):
  two-stage thinking of 1024 + 1024 tokens per call, "Therefore, the answer is" answers, greedy
  decoding, top-4 retrieval over the whole document, Writes with the memory before the chunk
  (``write_layout=memory_first``); headline accuracy = two-way sub-EM against the **first** gold.

Both accuracies are computed for every sample whatever the preset; the preset only picks the one
the report leads with.

Variants (``--variant``, any number, applied in order on top of the preset and before ``--set``)
reproduce the protocols other checkpoints were trained or evaluated with: the paper-era retrieval
and the MemAgent baseline's two budget regimes, each with memory-first Writes (:data:`VARIANTS`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from infmem_verl.agent.config import AgentConfig, agent_config
from infmem_verl.agent.errors import ConfigError
from infmem_verl.policy.source import ModelSource

from .methods import METHODS
from .store import RetryPolicy, check_retry_policy

Headline = Literal["ours", "reference"]


@dataclass(frozen=True)
class Preset:
    name: str
    agent: Mapping[str, Any]  # agent_config overrides
    headline: Headline
    description: str


_GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "record_token_ids": False}

# MemAgent's reference code puts a Write's memory before its chunk (problem, memory, section), so
# the protocols that reproduce the reference keep that order over our chunk_first default.
# (InfMem's code puts the memory last, after the retrieved and the current chunk, which neither
# built-in layout is; a checkpoint's exact order comes with its prompt_templates file, which
# overrides the layout.)
_REFERENCE_LAYOUT = {"write_layout": "memory_first"}

PRESETS: dict[str, Preset] = {
    "embedded": Preset(
        "embedded",
        {
            **_GREEDY,
            "memory_tokens": 64,
            "document": {"chunk_tokens": 1000, "unit_tokens": 200, "unit_overlap": 40},
            "prethink": {"prompt_tokens": 2048, "thinking_tokens": 16, "output_tokens": 24},
            "write": {"prompt_tokens": 3072, "thinking_tokens": 16, "output_tokens": 64},
            "answer": {"prompt_tokens": 2048, "thinking_tokens": 16, "output_tokens": 16},
        },
        "ours",
        "tiny budgets for the tiny in-process model (proves the pipeline, scores nothing)",
    ),
    "default": Preset(
        "default",
        dict(_GREEDY),
        "ours",
        "our protocol: agent-core budgets, \\boxed{} answers, greedy; accuracy = whole-word gold-in-prediction over all golds",
    ),
    "reference": Preset(
        "reference",
        {
            **_GREEDY,
            **_REFERENCE_LAYOUT,
            "thinking": True,
            "thinking_mode": "two_stage",
            "answer_format": "answer_is",
            "memory_tokens": 1024,
            "document": {"chunk_tokens": 5000},
            "retrieval": {"scope": "document", "top_k_min": 4, "top_k_max": 4, "top_k_default": 4},
            "prethink": {"prompt_tokens": 4096, "thinking_tokens": 1024, "output_tokens": 1024},
            "write": {"prompt_tokens": 9216, "thinking_tokens": 1024, "output_tokens": 1024},
            "answer": {"prompt_tokens": 4096, "thinking_tokens": 1024, "output_tokens": 1024},
        },
        "reference",
        "the papers' protocol: two-stage thinking 1024+1024, 'Therefore, the answer is', greedy, top-4 BM25; "
        "accuracy = two-way sub-EM against the first gold",
    ),
}


@dataclass(frozen=True)
class Variant:
    name: str
    agent: Mapping[str, Any]  # agent_config overrides
    description: str


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant(
            "paper_retrieval",
            {
                "document": {"unit_tokens": 500, "unit_overlap": 0, "paragraph_units": False},
                "retrieval": {"backend": "rank_bm25", "analyzer": "whitespace", "k1": 1.5, "b": 0.75, "bigram_weight": 0, "heading_weight": 0, "stem": False,
                              "stopwords": False, "top_k_min": 4, "top_k_max": 4, "top_k_default": 4, "rerank": False},
            },  # fmt: skip
            "the paper-era retrieval of the reference's evaluation: BM25Okapi (k1 1.5, b 0.75) over lower().split() "
            "words, 500-token units without overlap, always the top 4",
        ),
        Variant(
            "memagent_shared",
            {
                **_REFERENCE_LAYOUT,
                "thinking": True,
                "thinking_mode": "single_pass",
                "memory_tokens": 1024,
                "write": {"thinking_tokens": 0, "output_tokens": 1024},
                "answer": {"thinking_tokens": 0, "output_tokens": 1024},
            },
            "MemAgent as its Qwen3 baseline was trained: thinking and memory (or answer) share one 1024-token response",
        ),
        Variant(
            "memagent_nothink",
            {
                **_REFERENCE_LAYOUT,
                "thinking": False,
                "memory_tokens": 1024,
                "write": {"output_tokens": 1024},
                "answer": {"output_tokens": 1024},
            },
            "MemAgent with thinking off (as InfMem's paper ran the baseline, and the Qwen2.5-Instruct MemAgent "
            "checkpoints): the whole response is the memory or the answer, 1024 tokens",
        ),
    )
}


@dataclass(frozen=True)
class DataSpec:
    """One evaluation file: the dataset it belongs to, its length label and its path."""

    dataset: str
    length: str
    path: Path


@dataclass
class EvalConfig:
    """What one ``python -m infmem_verl.eval`` run does (see ``--help`` for each field).

    Data: explicit ``data`` files, or ``datasets`` x ``lengths`` looked up in ``data_dir`` under
    the reference's file names, or (neither given) the synthetic set at ``lengths``.
    Model (``source``): ``endpoints`` (OpenAI-compatible servers) or, without them, the in-process
    transformers model at ``model_dir`` (the tiny random Qwen3 by default).
    """

    preset: str | None = None  # None: "embedded" without endpoints, "default" with them
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    data: list[DataSpec] = field(default_factory=list)
    data_dir: Path | None = None
    datasets: list[str] = field(default_factory=list)
    lengths: list[str] = field(default_factory=list)  # empty: the preset's synthetic lengths
    pools: dict[str, Path] = field(default_factory=dict)  # dataset -> official file (index contexts)
    samples: int | None = None  # per cell; None: all (synthetic: 2 per length)
    seed: int = 0
    source: ModelSource = ModelSource()
    context_window: int | None = None  # None: the server's max_model_len / the model's positions
    out: Path = Path("runs/eval")
    agent: dict[str, Any] = field(default_factory=dict)  # overrides on top of the preset
    published_backbone: str = "qwen3-4b"
    retry_failed: RetryPolicy = "transient"
    progress: bool = True
    repeats: int = 1  # samples per question and method (at a temperature > 0 they differ)
    variants: list[str] = field(default_factory=list)  # VARIANTS applied on top of the preset
    record_turns: bool = False  # write trajectories.jsonl + documents/ for the viewer

    def resolved_preset(self) -> Preset:
        name = self.preset or ("default" if self.source.endpoints else "embedded")
        if name not in PRESETS:
            raise ConfigError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
        return PRESETS[name]

    def agent_config(self) -> AgentConfig:
        """The preset's agent settings, then the variants', then ``agent`` overrides, validated."""
        settings = dict(self.resolved_preset().agent)
        for name in self.variants:
            if name not in VARIANTS:
                raise ConfigError(f"variants: unknown variant {name!r}; expected some of {sorted(VARIANTS)}")
            settings = merge(settings, VARIANTS[name].agent)
        return agent_config(merge(settings, self.agent))

    def validate(self) -> EvalConfig:
        self.resolved_preset()
        if not self.methods:
            raise ConfigError("methods: expected at least one method")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ConfigError(f"methods: unknown method {unknown[0]!r}; expected some of {list(METHODS)}")
        if self.data and (self.data_dir or self.datasets):
            raise ConfigError("data: give explicit files or data_dir with datasets, not both")
        if self.data_dir is not None and not self.datasets:
            raise ConfigError("datasets: expected at least one dataset name to look up in data_dir")
        if self.datasets and self.data_dir is None:
            raise ConfigError("data_dir: expected the folder holding the evaluation files of datasets")
        if self.data_dir is not None and not self.lengths:
            raise ConfigError("lengths: expected at least one length to look up in data_dir")
        # Named files are checked before the model loads (a typo costs seconds, not a model start);
        # a length missing from data_dir is only recorded, so a sweep over lengths goes on.
        for spec in self.data:
            if not Path(spec.path).is_file():
                raise ConfigError(f"data: {spec.dataset}:{spec.length}={spec.path}: file not found")
        for dataset, path in self.pools.items():
            if not Path(path).is_file():
                raise ConfigError(f"pool: {dataset}={path}: file not found")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise ConfigError(f"data_dir: {self.data_dir}: folder not found")
        self.source.validate()
        if self.samples is not None and (isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1):
            raise ConfigError(f"samples: expected an integer >= 1, got {self.samples!r}")
        if self.context_window is not None and self.context_window < 256:
            raise ConfigError(f"context_window: expected an integer >= 256, got {self.context_window!r}")
        check_retry_policy(self.retry_failed)
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ConfigError(f"repeats: expected an integer >= 1, got {self.repeats!r}")
        self.agent_config()
        return self


def merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in, nested mappings key by key."""
    out = copy.deepcopy(dict(base))
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
