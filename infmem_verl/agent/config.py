"""Configuration records of the agent core.

Plain dataclasses, so the core needs neither Hydra nor verl; :func:`from_mapping` builds them
from a Hydra/OmegaConf dict and names the offending field when a key is unknown or a value is
out of range.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, TypeVar

from .errors import ConfigError
from .templates import load_templates

T = TypeVar("T")


def _check(cond: bool, field_path: str, expected: str, got: Any) -> None:
    if not cond:
        raise ConfigError(f"{field_path}: expected {expected}, got {got!r}")


@dataclass
class DocumentConfig:
    """How a document is cut: reading chunks, and retrieval units inside them."""

    # Tokens of document text a Write reads at once (the reference's 5000).
    chunk_tokens: int = 5000
    # Units of at most 250 tokens aligned to the document's paragraphs (blank-line separated:
    # the "Document i" blocks of the training data), long paragraphs split into overlapping
    # windows. On real, human-written queries at 1M tokens (``python -m bench.retrieval --sets
    # real``, recall@4): descriptions fixed 500/100 windows 0.69-0.73, paragraphs with short
    # neighbours merged up to 250 tokens 0.76-0.81, every paragraph a unit of its own 0.81-0.85;
    # BoolQ 0.90 / 0.91 / 0.93, FanOutQA 0.73 / 0.75 / 0.75 (fixed / merged / own unit). The
    # reference used fixed 500-token windows.
    unit_tokens: int = 250
    # Tokens a window shares with the previous one where a long paragraph (or a fixed cut) is windowed.
    unit_overlap: int = 50
    # Cut units at paragraph starts (true) or as fixed windows of unit_tokens inside each chunk (false).
    paragraph_units: bool = True
    # With paragraph units: merge consecutive short paragraphs into one unit up to
    # ``unit_tokens`` (true), or keep every paragraph a unit of its own (false, the default: one
    # article per unit, so a short article's words are not diluted by its neighbours').
    merge_paragraphs: bool = False

    def validate(self, path: str = "document") -> None:
        _check(self.chunk_tokens >= 16, f"{path}.chunk_tokens", "an integer >= 16", self.chunk_tokens)
        _check(
            0 < self.unit_tokens <= self.chunk_tokens,
            f"{path}.unit_tokens",
            f"an integer in [1, chunk_tokens={self.chunk_tokens}]",
            self.unit_tokens,
        )
        _check(
            0 <= self.unit_overlap < self.unit_tokens,
            f"{path}.unit_overlap",
            f"an integer in [0, unit_tokens={self.unit_tokens})",
            self.unit_overlap,
        )


@dataclass
class RetrievalConfig:
    """BM25 over the retrieval units of the document being read."""

    # "sparse": scipy sparse-matrix BM25 (default, fast); "rank_bm25": the reference's library.
    backend: Literal["sparse", "rank_bm25"] = "sparse"
    # "document": every unit of the document, read or not (the reference's default);
    # "read_prefix": only units of chunks read so far, the current chunk included.
    scope: Literal["document", "read_prefix"] = "document"
    # Drop units that overlap the chunk being written (the writer sees that text anyway).
    exclude_current_chunk: bool = False
    # How text becomes terms: "words" (lowercased word tokens, punctuation split off; stemming and
    # stopwords below) or "whitespace" (the paper-era reference: lower().split(), punctuation
    # glued to words, no stemming or stopwords).
    analyzer: Literal["words", "whitespace"] = "words"
    # The controller's top_k range (a value outside it is clamped and flagged) and the top_k of a
    # retrieve call that gives none.
    top_k_min: int = 1
    top_k_max: int = 8
    top_k_default: int = 4
    # Chosen on the real-query benchmark (recall@4 at 1M, one paragraph per unit: k1 1.2 / b 0.75
    # 0.807, these 0.813; with merged units 0.753 / 0.760): a short unit matching a short query
    # should not be discounted much for its length. Stemming and stopwords kept: without both,
    # recall@4 rose at 1M (+0.02 and +0.013 on two draws) but fell at 128K (0.00 and -0.03) and
    # on the templated "hard" questions at 1M (0.983 against 1.000).
    k1: float = 0.9
    # BM25's length normalisation (0: none, 1: full).
    b: float = 0.4
    # Snowball stemming of the words analyzer's terms.
    stem: bool = True
    # Drop English stopwords from the words analyzer's terms.
    stopwords: bool = True
    # Sparse backend: a unit's score adds this times the BM25 score of the query's adjacent term
    # pairs it holds (0: words alone). Chosen on the real-query benchmark at 1M tokens, recall@4
    # on two draws: 0.813 / 0.850 without pairs, 0.840 / 0.873 at 0.25, 0.853 / 0.860 at 0.5,
    # 0.833 / 0.853 at 1, 0.800 / 0.823 at 2 (128K: 0.900 / 0.915 -> 0.900 / 0.930 at 0.25).
    bigram_weight: float = 0.25
    # Sparse backend: a unit's score adds this times the BM25 score of its heading (the title
    # line over the paragraph it starts in, ``document.paragraph_heading``), with the body's idf,
    # so "What is the population of Italy?" prefers the article titled Italy over the many cities
    # whose text names Italy; every window of a long article carries its title. 0: headings
    # unscored. Recall@4 at 1M on two draws (150 / 300 queries a set), FanOutQA / BoolQ /
    # descriptions: 0 .740 .940 .840 / .700 .957 .863; 0.5 .860 .940 .820 / .863 .957 .847;
    # 0.75 .900 .933 .807 / .900 .953 .847; 1 .913 .933 .793 / .923 .950 .823: a description
    # naming another article ("Capital of Iraq" for Baghdad) loses to that article's title.
    heading_weight: float = 0.75
    # Optional second stage: rerank BM25's best ``rerank_candidates`` units with embeddings.
    # ``fusion``: "rrf" (reciprocal rank fusion of the BM25 and embedding rankings), "score"
    # (``(1 - fusion_weight) * BM25 + fusion_weight * cosine``, each min-max scaled over the
    # candidates) or "dense" (cosine alone). The fusion below is the stage's measured best
    # (``python -m bench.retrieval --sets boolq,fanoutqa --dense-models minilm``): score fusion w
    # 0.7 over BM25 with headings; with every window of the top 50 (float32 MiniLM) it reached
    # recall@4 at 1M BoolQ .987 / .987 and FanOutQA .960 / .953 (two draws, 150 / 300 queries;
    # BM25 alone .933 / .953, .900 / .900), the descriptions .825 / .860 (40 / 300 queries; BM25
    # .800 / .847). Candidates are embedded at query time, once per unit and document (the n
    # rollouts share them; a query whose candidates are embedded costs ~7 ms); how many and how
    # much of each MiniLM reads, with what a query with new candidates costs, is set below.
    # ``rerank``: true, false, or "auto" (the default): on for documents of more than
    # ``rerank_auto_tokens`` tokens, off up to there. The length is where BM25 with headings
    # alone stops reaching recall@4 .95 on both real-question sets (BoolQ / FanOutQA, ``python -m
    # bench.retrieval --sets boolq,fanoutqa --curve 128K,256K,512K``): 32K .975 / .963, 128K
    # .99 / .98, 256K .980 / .927, 512K - / .940, 1M .933-.953 / .900 (150 queries a set and
    # length): FanOutQA falls below between 128K and 256K, so past 128K tokens the stage is on.
    # The RL recipes' 32K documents keep BM25 alone (MiniLM adds nothing there).
    # The static embedder gains +.006 to +.013 at 1M and keeps ~3x the document's text in vectors.
    rerank: bool | Literal["auto"] = "auto"
    # Under rerank="auto", documents of more tokens than this get the dense stage (see above).
    rerank_auto_tokens: int = 131_072
    # The embedder of the second stage: "minilm" (the full model over the candidates, at query
    # time, agent/rerank.py) or "static" (MiniLM's word-piece vectors distilled once and cached,
    # agent/static_embed.py: the whole document embedded in one pass, ~4 s of CPU per 1M tokens,
    # then under 1 ms per query).
    rerank_model: Literal["static", "minilm"] = "minilm"
    # How many of BM25's best units the second stage reranks. A query with new candidates costs
    # MiniLM time linear in the word pieces it reads of them (``rerank_windows`` windows of
    # ``rerank_window_tokens`` pieces each). The defaults, the top 30 and each one's first 64
    # pieces, were chosen on ``python -m bench.rerank_cost``
    # (1M tokens, 150 queries a set, seed 1234, bfloat16 MiniLM), recall@4 BoolQ / FanOutQA and
    # CPU seconds per cold query (one thread): top 50, every 128-piece window (the earlier
    # default) .987 / .947, 1.41-1.48 s; top 50, first 128 pieces .987 / .960, 0.99-1.13 s; top
    # 50, first 64 .987 / .953, 0.56-0.63 s; top 30, first 64 .987 / .953, 0.33-0.34 s; top 20,
    # first 64 .987 / .920, 0.23 s; top 20, every window .987 / .907, 0.63-0.69 s. A paragraph
    # names its subject first, so its start carries most of what a question matches.
    rerank_candidates: int = 30
    # The length of MiniLM's windows over a candidate, in word pieces (special tokens included;
    # MiniLM was trained on 128).
    rerank_window_tokens: int = 64
    # How many of each candidate's first windows MiniLM reads (0: all, overlapping by a quarter
    # of their length up to 32 pieces).
    rerank_windows: int = 1
    # torch threads of MiniLM's passes, set on the thread that runs them (torch's OpenMP thread
    # counts are per thread) and restored after. One: where a server or trainer shares the cores
    # a second thread spins waiting for a core: a cold query took 1.5 s instead of 0.1-0.2
    # (docs/experiments/2026-12-06-rollout-1m.md).
    rerank_threads: int = 1
    # Compile MiniLM with torch.compile (inductor, weights frozen into the graph) on its first
    # pass in a process: that pass takes ~26-36 CPU-s more (7-8 with inductor's on-disk cache from
    # an earlier process), every later one 0.67-0.78x the eager bfloat16 pass at the default's
    # shapes (one thread, interleaved; a cold query 0.79-0.86x, bench.rerank_cost, 2026-12-06
    # evening; similarities within 2.1e-3 of the eager model's). It pays for itself after ~1,000
    # cold queries, a few 1M-token documents. Where compiling fails (no C++ compiler, say) the
    # stage warns once and runs eagerly.
    rerank_compile: bool = True
    # How the second stage fuses BM25 and embeddings: "rrf", "score" (weighted, min-max scaled) or "dense".
    fusion: Literal["rrf", "score", "dense"] = "score"
    # The cosine's weight in score fusion (the BM25 score gets 1 - fusion_weight).
    fusion_weight: float = 0.7
    # How many prepared documents (tokens, units, index) stay cached; the n rollouts of a
    # document share one entry.
    cache_size: int = 16
    # Upper bound on retrieved evidence tokens in one Write prompt.
    evidence_tokens: int = 2500

    def rerank_enabled(self, num_tokens: int | None) -> bool:
        """Whether a document of ``num_tokens`` tokens gets the dense stage (``rerank="auto"``:
        past ``rerank_auto_tokens``; an unknown length counts as short)."""
        if self.rerank == "auto":
            return num_tokens is not None and num_tokens > self.rerank_auto_tokens
        return bool(self.rerank)

    def validate(self, path: str = "retrieval") -> None:
        _check(self.backend in ("sparse", "rank_bm25"), f"{path}.backend", "'sparse' or 'rank_bm25'", self.backend)
        _check(self.scope in ("document", "read_prefix"), f"{path}.scope", "'document' or 'read_prefix'", self.scope)
        _check(self.analyzer in ("words", "whitespace"), f"{path}.analyzer", "'words' or 'whitespace'", self.analyzer)
        _check(self.top_k_min >= 1, f"{path}.top_k_min", "an integer >= 1", self.top_k_min)
        _check(self.top_k_max >= self.top_k_min, f"{path}.top_k_max", f">= top_k_min={self.top_k_min}", self.top_k_max)
        _check(
            self.top_k_min <= self.top_k_default <= self.top_k_max,
            f"{path}.top_k_default",
            f"an integer in [{self.top_k_min}, {self.top_k_max}]",
            self.top_k_default,
        )
        _check(self.k1 >= 0, f"{path}.k1", "a number >= 0", self.k1)
        _check(0 <= self.b <= 1, f"{path}.b", "a number in [0, 1]", self.b)
        for name, scores in (("bigram_weight", "term pairs"), ("heading_weight", "headings")):
            weight = getattr(self, name)
            _check(weight >= 0, f"{path}.{name}", "a number >= 0", weight)
            _check(
                self.backend == "sparse" or weight == 0,
                f"{path}.{name}",
                f"0 with backend 'rank_bm25' (only the sparse backend scores {scores})",
                weight,
            )
        _check(
            self.rerank in ("auto", True, False) and (isinstance(self.rerank, bool) or self.rerank == "auto"),
            f"{path}.rerank",
            "true, false or 'auto'",
            self.rerank,
        )
        _check(self.rerank_auto_tokens >= 0, f"{path}.rerank_auto_tokens", "an integer >= 0", self.rerank_auto_tokens)
        _check(self.rerank_model in ("static", "minilm"), f"{path}.rerank_model", "'static' or 'minilm'", self.rerank_model)
        _check(self.rerank_candidates >= 1, f"{path}.rerank_candidates", "an integer >= 1", self.rerank_candidates)
        _check(
            16 <= self.rerank_window_tokens <= 512,
            f"{path}.rerank_window_tokens",
            "an integer in [16, 512] (MiniLM reads at most 512 positions)",
            self.rerank_window_tokens,
        )
        _check(self.rerank_windows >= 0, f"{path}.rerank_windows", "an integer >= 0 (0: every window)", self.rerank_windows)
        _check(self.rerank_threads >= 1, f"{path}.rerank_threads", "an integer >= 1", self.rerank_threads)
        _check(self.fusion in ("rrf", "score", "dense"), f"{path}.fusion", "'rrf', 'score' or 'dense'", self.fusion)
        _check(0 <= self.fusion_weight <= 1, f"{path}.fusion_weight", "a number in [0, 1]", self.fusion_weight)
        _check(self.cache_size >= 1, f"{path}.cache_size", "an integer >= 1", self.cache_size)
        _check(self.evidence_tokens >= 0, f"{path}.evidence_tokens", "an integer >= 0", self.evidence_tokens)


@dataclass
class ControllerConfig:
    """The PreThink controller's output grammar, and two rules of the reference's parser that a
    model trained with them may need (both off: they let text that is not an action act).

    ``grammar``: ``"tool_call"`` (ours: one Qwen3-native ``<tool_call>`` JSON call) or
    ``"qwen_agent"`` (the InfMem code's: a Qwen-Agent call ``✿FUNCTION✿: <function_name>`` then
    ``✿ARGS✿: {"query": ..., "top_k": ...}``, or the word ``STOP``; the tool description then
    comes from the PreThink template's system message, see ``prompt_templates``).
    """

    # PreThink's output grammar: "tool_call" (ours) or "qwen_agent" (the InfMem code's, for its checkpoints).
    grammar: Literal["tool_call", "qwen_agent"] = "tool_call"
    # Name of the retrieve function in the qwen_agent grammar (the one the model was trained on).
    function_name: str = "retrieve"
    # The reference's rule: the substring STOP anywhere in the response, thinking included, stops.
    stop_anywhere: bool = False
    # The reference's rule: an output with no call counts as a stop vote (restarting the count of
    # consecutive votes, as its harness did); off, it is a protocol error.
    no_call_stops: bool = False

    def validate(self, path: str = "controller") -> None:
        _check(self.grammar in ("tool_call", "qwen_agent"), f"{path}.grammar", "'tool_call' or 'qwen_agent'", self.grammar)
        _check(
            bool(re.fullmatch(r"[A-Za-z_][\w.-]*", self.function_name)),
            f"{path}.function_name",
            "a function name (letters, digits, _ . -)",
            self.function_name,
        )


@dataclass
class CallBudget:
    """Token budgets of one kind of LLM call.

    ``thinking_tokens`` is the budget of the thinking part (ignored with thinking off),
    ``output_tokens`` that of what follows ``</think>`` (the action, the memory, the answer) and
    ``prompt_tokens`` the input budget: a prompt never exceeds it.
    """

    # Input budget: a prompt never exceeds it (evidence, then chunk text are shortened).
    prompt_tokens: int
    # Budget of the thinking part (ignored with thinking off).
    thinking_tokens: int
    # Budget of what follows </think>: the action, the memory, the answer.
    output_tokens: int

    def validate(self, path: str) -> None:
        _check(self.prompt_tokens >= 64, f"{path}.prompt_tokens", "an integer >= 64", self.prompt_tokens)
        _check(self.thinking_tokens >= 0, f"{path}.thinking_tokens", "an integer >= 0", self.thinking_tokens)
        _check(self.output_tokens >= 1, f"{path}.output_tokens", "an integer >= 1", self.output_tokens)

    def response_tokens(self, thinking: bool) -> int:
        """Most tokens a call of this kind can produce, injected closing tag included."""
        return (self.thinking_tokens + _CLOSE_THINK_RESERVE if thinking else 0) + self.output_tokens


# Tokens the loop may inject to close an unfinished thinking block ("\n</think>\n\n").
_CLOSE_THINK_RESERVE = 8


@dataclass
class AgentConfig:
    """Everything that shapes a trajectory of the InfMem or MemAgent loop."""

    document: DocumentConfig = field(default_factory=DocumentConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    # Qwen3 ``enable_thinking``. Off (or a model without thinking, e.g. Qwen2.5): the whole
    # response is the action / memory / answer.
    thinking: bool = True
    # "two_stage": when thinking spends its budget without ``</think>``, the loop appends the
    # closing tag itself (masked out of training) and generates the output with its own budget.
    # "single_pass": one call of thinking + output budget; an unclosed thinking block keeps the
    # old memory and flags the turn.
    thinking_mode: Literal["two_stage", "single_pass"] = "two_stage"
    # Hard cap on memory tokens; longer memories are truncated and the turn flagged.
    memory_tokens: int = 1024
    # Stop after this many consecutive stop votes of the controller (the paper's 1-stop / 3-stop).
    stop_votes: int = 1
    # What an unparsable controller output does: "continue" reads the next chunk without
    # retrieval, "retrieve_question" retrieves with the question as query and top_k_default.
    invalid_action: Literal["continue", "retrieve_question"] = "continue"
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    # A YAML/JSON file of prompt templates replacing built-in prompts (agent/templates.py), for a
    # checkpoint trained with other prompts; None: the built-in prompts.
    prompt_templates: str | None = None
    # Final answer format: "boxed" (\boxed{...}, used everywhere by default) or "answer_is"
    # ("Therefore, the answer is ...", the reference evaluation's format).
    answer_format: Literal["boxed", "answer_is"] = "boxed"
    # Order of a Write prompt's sections: "chunk_first" (question, chunk, memory, [evidence]): the
    # n rollouts of a document share the prompt up to the end of the chunk, which vLLM's prefix
    # cache serves (measured: prefill left to compute -56% MemAgent, -53% InfMem; docs/training.md, lever e);
    # or "memory_first" (question, memory, [evidence], chunk; MemAgent's reference order, kept by
    # the evaluation protocols that reproduce the reference systems).
    write_layout: Literal["memory_first", "chunk_first"] = "chunk_first"
    prethink: CallBudget = field(default_factory=lambda: CallBudget(prompt_tokens=4096, thinking_tokens=512, output_tokens=256))
    write: CallBudget = field(default_factory=lambda: CallBudget(prompt_tokens=9216, thinking_tokens=512, output_tokens=1024))
    answer: CallBudget = field(default_factory=lambda: CallBudget(prompt_tokens=4096, thinking_tokens=512, output_tokens=256))
    # Sampling outside verl (evaluation, distillation); in RL verl's rollout.temperature / top_p /
    # top_k (val_kwargs for validation) decide.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Keep every turn's prompt and response token ids (training and SFT need them; evaluation
    # of 1M-token documents can turn this off to keep only counts).
    record_token_ids: bool = True

    def validate(self) -> "AgentConfig":
        self.document.validate("document")
        self.retrieval.validate("retrieval")
        self.controller.validate("controller")
        templates = {}
        if self.prompt_templates is not None:
            _check(isinstance(self.prompt_templates, str), "prompt_templates", "a file path or null", self.prompt_templates)
            templates = load_templates(self.prompt_templates)  # ConfigError naming the file, kind and slot
        _check(
            self.controller.grammar == "tool_call" or "prethink" in templates,
            "prompt_templates",
            "a file with a prethink template describing the qwen_agent grammar (controller.grammar=qwen_agent)",
            self.prompt_templates,
        )
        _check(
            self.thinking_mode in ("two_stage", "single_pass"),
            "thinking_mode",
            "'two_stage' or 'single_pass'",
            self.thinking_mode,
        )
        _check(self.memory_tokens >= 1, "memory_tokens", "an integer >= 1", self.memory_tokens)
        _check(self.stop_votes >= 1, "stop_votes", "an integer >= 1", self.stop_votes)
        _check(
            self.invalid_action in ("continue", "retrieve_question"),
            "invalid_action",
            "'continue' or 'retrieve_question'",
            self.invalid_action,
        )
        _check(self.answer_format in ("boxed", "answer_is"), "answer_format", "'boxed' or 'answer_is'", self.answer_format)
        _check(
            self.write_layout in ("memory_first", "chunk_first"),
            "write_layout",
            "'memory_first' or 'chunk_first'",
            self.write_layout,
        )
        for name in ("prethink", "write", "answer"):
            getattr(self, name).validate(name)
        _check(
            self.write.output_tokens >= self.memory_tokens or self.thinking_mode == "single_pass",
            "write.output_tokens",
            f">= memory_tokens={self.memory_tokens} (two-stage writes give the memory its own budget)",
            self.write.output_tokens,
        )
        min_write_prompt = self.document.chunk_tokens + self.memory_tokens + 64
        _check(
            self.write.prompt_tokens >= min_write_prompt,
            "write.prompt_tokens",
            f">= chunk_tokens + memory_tokens + 64 = {min_write_prompt}",
            self.write.prompt_tokens,
        )
        _check(self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        return self

    def max_prompt_tokens(self) -> int:
        """Largest prompt any call can build (sizes verl's ``rollout.prompt_length``)."""
        return max(self.prethink.prompt_tokens, self.write.prompt_tokens, self.answer.prompt_tokens)

    def max_response_tokens(self) -> int:
        """Largest response any call can return (sizes verl's ``rollout.response_length``)."""
        return max(b.response_tokens(self.thinking) for b in (self.prethink, self.write, self.answer))


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass ``cls`` from a (possibly nested) mapping, rejecting unknown keys by name."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    where = f"{path}." if path else ""
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}{unknown[0]}: unknown key; expected one of {sorted(fields)}")
    required = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data
    ]
    if required:
        raise ConfigError(f"{where}{required[0]}: missing; {cls.__name__} needs {required} set")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        sub = f"{where}{name}"
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{sub}: expected a mapping, got {value!r}")
            # A partial mapping overrides the field's default record key by key (a preset setting
            # only `write.output_tokens` keeps the default prompt and thinking budgets).
            factory = fields[name].default_factory
            base = dataclasses.asdict(factory()) if factory is not dataclasses.MISSING else {}
            kwargs[name] = from_mapping(hint, {**base, **value}, sub)
        else:
            kwargs[name] = _coerce(value, hint, sub)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        _check(value in allowed, path, f"one of {list(allowed)}", value)
        return value
    if hint is bool:
        _check(isinstance(value, bool), path, "true or false", value)
        return value
    if hint is str:
        _check(isinstance(value, str), path, "a string", value)
        return value
    if hint is int:
        _check(isinstance(value, int) and not isinstance(value, bool), path, "an integer", value)
        return value
    if hint is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), path, "a number", value)
        return float(value)
    if origin in (typing.Union, types.UnionType):
        return value
    return value


def agent_config(data: Mapping[str, Any] | None = None) -> AgentConfig:
    """An :class:`AgentConfig` from a mapping (Hydra node, dict), validated."""
    return from_mapping(AgentConfig, data).validate()
