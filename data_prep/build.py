"""Build long-context QA sets from an official QA file: one command per job.

    python -m data_prep.build --source hotpotqa --input hotpot_train_v1.1.json --split train \\
        --tokens 32k --exclude-pool hotpot_dev_distractor_v1.json --out data/
    python -m data_prep.build --source hotpotqa --input hotpot_dev_distractor_v1.json --split dev \\
        --tokens 32k,64k,128k,256k,512k,1m --limit 128 --exclude-pool hotpot_train_v1.1.json --out data/
    python -m data_prep.build --source hotpotqa --input hotpot_dev_distractor_v1.json --split dev \\
        --num-docs 50,100,200,400,800,1600,3200,6400,12800,25600 --limit 128 --no-exclude-pool --out data/
    python -m data_prep.build --source squad --input dev-v2.0.json --split dev --tokens 512k,1m \\
        --limit 128 --no-exclude-pool --extra-pool train-v2.0.json --out data/

Every target (``--tokens`` and ``--num-docs`` values) is one output, written atomically with a
manifest of its parameters; a re-run skips outputs finished with the same parameters. The
``train`` split defaults to the verl parquet (:mod:`data_prep.training`), other splits to the
published evaluation JSON (:mod:`data_prep.published`). Other splits must say how their
distractors are held out: ``--exclude-pool`` removes every paragraph of the given files (the
training split) from the distractor pool, ``--no-exclude-pool`` keeps the reference's shared pool.
A split too small for a target (SQuAD dev holds ~0.2-0.35M tokens) either draws more distractors
from other files of the source (``--extra-pool``) or, as the reference did, takes its whole pool
(``--cap-at-pool``; the real sizes are recorded). The parquet has an ``agent_name`` column only
when ``--agent`` names a loop. See ``data_prep/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Sequence

import numpy as np

from infmem_verl.cli import exit_on_input_error, take_traceback_flag
from infmem_verl.data.sample import QASample

from .closed_book import ClosedBookSettings, keep_unanswered, load_policy
from .compose import PoolCounter, Target, compose, parse_size, render_context, sample_rng
from .io import DataError, atomic_outputs, finished, manifest_path, write_manifest
from .published import PublishedWriter
from .sources import SOURCES, SourceQuestion, SourceSet, load_extra_pool, load_pool, load_source, with_extra_pool
from .training import AGENT_LOOPS, TrainingWriter, store_path

# 2: published meta records "capped"; the parquet has no agent_name column unless asked.
FORMAT_VERSION = 2
# The reference's task names of its RULER-style files (eval_qa_{k}_{length}.json).
_TASKS = {"squad": "qa_1", "hotpotqa": "qa_2", "musique": "qa_3", "2wiki": "qa_4"}
# Above these sizes the reference stores contexts as pool indices (different_docs_eval.py, qa.py).
_INDEX_ABOVE_DOCS = 10_000
_INDEX_ABOVE_TOKENS = 2_000_000
# Invalid questions named on the console with --skip-invalid (the count is in every output's manifest).
_INVALID_SHOWN = 5

Format = Literal["parquet", "published"]


@dataclass(frozen=True)
class ClosedBookFilter:
    """The optional closed-book filter: which policy (``module:callable`` and its argument)."""

    policy: str
    argument: str | None = None
    settings: ClosedBookSettings = field(default_factory=ClosedBookSettings)


@dataclass(frozen=True)
class BuildSpec:
    """Everything that defines one build command (one output per target)."""

    source: str
    input: Path
    split: str
    targets: tuple[Target, ...]
    out_dir: Path
    format: Format | None = None  # None: parquet for the train split, published otherwise
    seed: int = 0
    limit: int | None = None
    offset: int = 0
    exclude_pools: tuple[Path, ...] = ()
    shared_pool: bool = False  # True: an evaluation split knowingly keeps the reference's pool
    # Other files of the same source whose paragraphs serve only as distractors.
    extra_pools: tuple[Path, ...] = ()
    # A pool too small for a target gives the whole pool (the reference's behaviour), not an error.
    cap_at_pool: bool = False
    index_context: Literal["auto", "always", "never"] = "auto"
    # The loop named in every parquet row; None writes no agent_name column, so the trainer's
    # configured agent runs (verl runs the loop a row names, whatever the configuration says).
    agent_name: str | None = None
    # Off by default: verl copies every column into every stored sequence, and our trainer
    # rejects an inline document; turn on for tools that read the text from the row itself.
    inline_context: bool = False
    tokenizer: str | None = None  # tokenizer folder; None: Qwen3's
    closed_book: ClosedBookFilter | None = None
    # Leave out questions that fail their checks (listed in the manifest) instead of stopping.
    skip_invalid: bool = False
    overwrite: bool = False

    @property
    def output_format(self) -> Format:
        return self.format or ("parquet" if self.split == "train" else "published")

    def validate(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"--source: expected one of {', '.join(SOURCES)}, got {self.source!r}")
        if not self.split or "/" in self.split:
            raise ValueError(f"--split: expected a split name such as train or dev, got {self.split!r}")
        if not self.targets:
            raise ValueError("--tokens / --num-docs: expected at least one target")
        if self.output_format not in ("parquet", "published"):
            raise ValueError(f"--format: expected parquet or published, got {self.format!r}")
        for name in ("seed", "offset"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"--{name}: expected an integer >= 0, got {getattr(self, name)!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"--limit: expected an integer >= 1, got {self.limit!r}")
        if self.split != "train" and not self.exclude_pools and not self.shared_pool:
            raise ValueError(
                f"--exclude-pool: split {self.split!r} is not the training split; pass the training file(s) "
                f"so its distractors are held out, or --no-exclude-pool to share the pool as the reference did"
            )
        if self.exclude_pools and self.shared_pool:
            raise ValueError("--no-exclude-pool: cannot be combined with --exclude-pool")
        if self.output_format == "parquet" and self.index_context == "always":
            raise ValueError("--index-context always: index contexts exist only in the published format")
        if self.agent_name is not None:
            if self.agent_name not in AGENT_LOOPS:
                raise ValueError(f"--agent: expected one of {', '.join(AGENT_LOOPS)}, got {self.agent_name!r}")
            if self.output_format != "parquet":
                raise ValueError("--agent: only the training parquet has an agent_name column")
        self._validate_extra_pools()

    def _validate_extra_pools(self) -> None:
        """``--extra-pool`` files: present, not the input, not held out, not behind index contexts."""
        if not self.extra_pools:
            return
        held_out = {Path(p).resolve() for p in self.exclude_pools}
        for path in self.extra_pools:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"--extra-pool {path}: file not found")
            if path.resolve() == Path(self.input).resolve():
                raise ValueError(f"--extra-pool {path}: is the --input file itself; its paragraphs are in the pool already")
            if path.resolve() in held_out:
                raise ValueError(f"--extra-pool {path}: is also an --exclude-pool file, so all its paragraphs would be held out")
        indexed = [t.label for t in self.targets if uses_indices(self, t)]
        if indexed:
            raise ValueError(
                f"--extra-pool: the index contexts of {', '.join(indexed)} would point past the split's own pool, "
                f"which the reference's loaders expand them with; add --index-context never"
            )


@dataclass
class JobResult:
    """What one target's job did."""

    path: Path
    skipped: bool
    samples: int = 0
    tokens: dict[str, float] = field(default_factory=dict)
    capped: int = 0  # samples short of the target because the pool ran out (--cap-at-pool)


def output_name(spec: BuildSpec, target: Target) -> str:
    """File name of ``target``'s output; published files use the reference's names, so its
    harness finds them (``eval_{N}.json`` for HotpotQA doc counts, ``eval_qa_{k}_{L}.json``)."""
    if spec.output_format == "parquet":
        return f"{spec.source}_{spec.split}_{target.label}.parquet"
    task = _TASKS[spec.source]
    if target.kind == "tokens":
        return f"eval_{task}_{target.value}.json"
    return f"eval_{target.value}.json" if spec.source == "hotpotqa" else f"eval_{task}_{target.label}.json"


def uses_indices(spec: BuildSpec, target: Target) -> bool:
    """Whether ``target``'s published contexts are pool indices (``auto``: the reference's rule)."""
    if spec.output_format != "published" or spec.index_context == "never":
        return False
    if spec.index_context == "always":
        return True
    limit = _INDEX_ABOVE_DOCS if target.kind == "docs" else _INDEX_ABOVE_TOKENS
    return target.value > limit


def build(spec: BuildSpec, tokenizer=None, policy=None) -> list[JobResult]:
    """Run ``spec``: every unfinished target is composed, written and committed in turn.

    ``tokenizer`` and ``policy`` (the closed-book filter's model) default to what the spec
    names. A failing target raises; outputs committed before it stay as they are.
    """
    spec.validate()
    if tokenizer is None:
        from infmem_verl.assets import load_tokenizer

        tokenizer = load_tokenizer(spec.tokenizer)
    targets = list(dict.fromkeys(spec.targets))  # a repeated target is one output
    results: dict[Target, JobResult] = {}
    pending = []
    for target in targets:
        paths = _paths(spec, target)
        params = _params(spec, target, tokenizer)
        if not spec.overwrite and finished(paths, paths[-1], params):
            results[target] = JobResult(paths[-2], skipped=True)
            print(f"skip {paths[-2]}: finished with the same parameters", file=sys.stderr)
        else:
            pending.append((target, paths, params))
    if not pending:
        return [results[target] for target in targets]
    # Extra pools are checked before the (larger) input is read: a wrong file fails in seconds.
    extra = [p for path in spec.extra_pools for p in load_extra_pool(spec.source, path)]
    data = with_extra_pool(load_source(spec.source, spec.input, skip_invalid=spec.skip_invalid), extra)
    if data.invalid:
        shown = "\n  ".join(data.invalid[:_INVALID_SHOWN])
        more = f"\n  ... and {len(data.invalid) - _INVALID_SHOWN} more" if len(data.invalid) > _INVALID_SHOWN else ""
        print(f"--skip-invalid: left out {len(data.invalid)} invalid question(s) of {spec.input}:\n  {shown}{more}", file=sys.stderr)
    questions, dropped = _select(spec, data.questions, tokenizer, policy)
    blocked = held_out_mask(data, spec.exclude_pools)
    counter = PoolCounter(data.pool, tokenizer)
    counts = {
        "skipped_unanswerable": data.skipped,
        "skipped_invalid": len(data.invalid),
        "filtered": dropped,
        "pool": {"split": len(data.pool) - data.extra, "extra": data.extra},
    }
    for target, paths, params in pending:
        started = time.perf_counter()
        samples = compose_samples(data, questions, target, counter, blocked, spec.seed, spec.split, spec.cap_at_pool)
        summary = _write(spec, target, paths, params, samples, counts)
        results[target] = JobResult(
            paths[-2], skipped=False, samples=summary["samples"], tokens=summary["tokens"], capped=summary["capped"]
        )
        capped = f"; {summary['capped']} capped at the pool, short of {target.label}" if summary["capped"] else ""
        print(
            f"wrote {summary['samples']} samples to {paths[-2]} (tokens {summary['tokens']}{capped}) "
            f"in {time.perf_counter() - started:.1f}s",
            file=sys.stderr,
        )
    return [results[target] for target in targets]


def compose_samples(
    data: SourceSet,
    questions: Iterable[SourceQuestion],
    target: Target,
    counter: PoolCounter,
    blocked: np.ndarray | None,
    seed: int,
    split: str,
    cap_at_pool: bool = False,
) -> Iterator[QASample]:
    """The composed samples of ``questions``, one at a time (a 1M-token set is never held whole).

    ``meta["num_tokens"]`` / ``["num_docs"]`` are the real sizes, ``["capped"]`` says whether the
    pool ran out first (``cap_at_pool``)."""
    for question in questions:
        rng = sample_rng(seed, data.source, split, question.id, target)
        composition = compose(question, counter, target, rng, blocked, cap_at_pool)
        yield QASample(
            id=question.id,
            question=question.question,
            answers=list(question.answers),
            context=render_context(data.pool, composition.docs),
            source=data.source,
            meta={
                "index": question.index,
                "split": split,
                "target": target.label,
                "num_tokens": composition.num_tokens,
                "num_docs": len(composition.docs),
                "capped": composition.capped,
                "gold_positions": list(composition.gold_positions),
                "gold_token_starts": list(composition.gold_token_starts),
                "seed": seed,
                "docs": list(composition.docs),
            },
        )


def held_out_mask(data: SourceSet, exclude: Sequence[Path]) -> np.ndarray | None:
    """Pool paragraphs that also occur in the ``exclude`` files (same source), or None."""
    if not exclude:
        return None
    held_out: set[str] = set()
    for path in exclude:
        held_out.update(load_pool(data.source, path))
    return np.fromiter((p in held_out for p in data.pool), dtype=bool, count=len(data.pool))


def _select(spec: BuildSpec, questions: list[SourceQuestion], tokenizer, policy) -> tuple[list[SourceQuestion], int]:
    """Questions after ``--offset``, the closed-book filter and ``--limit``; and how many the
    filter dropped."""
    questions = questions[spec.offset :]
    if spec.closed_book is None:
        return questions[: spec.limit], 0
    owned = policy is None
    if owned:
        policy = load_policy(spec.closed_book.policy, spec.closed_book.argument)

    # The filter model's own tokenizer renders its prompts when it has one (it may differ from
    # the tokenizer the contexts are counted with).
    filter_tokenizer = getattr(policy, "tokenizer", None) or tokenizer

    async def run() -> tuple[list[SourceQuestion], int]:
        try:
            return await keep_unanswered(policy, filter_tokenizer, questions, spec.closed_book.settings, spec.limit)
        finally:
            # A policy we built is closed inside the event loop its workers run on.
            if owned and hasattr(policy, "close"):
                await policy.close()

    return asyncio.run(run())


def _paths(spec: BuildSpec, target: Target) -> list[Path]:
    """Files of one output in commit order: document store (parquet only), data file, manifest."""
    main = spec.out_dir / output_name(spec, target)
    store = [store_path(main)] if spec.output_format == "parquet" else []
    return [*store, main, manifest_path(main)]


def _params(spec: BuildSpec, target: Target, tokenizer) -> dict[str, Any]:
    """The parameters that define an output's content (compared on re-runs)."""
    params: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "source": spec.source,
        "input": _file_identity(spec.input),
        "split": spec.split,
        "target": {"kind": target.kind, "value": target.value},
        "format": spec.output_format,
        "seed": spec.seed,
        "limit": spec.limit,
        "offset": spec.offset,
        "exclude_pools": [_file_identity(p) for p in spec.exclude_pools],
        "extra_pools": [_file_identity(p) for p in spec.extra_pools],
        "cap_at_pool": spec.cap_at_pool,
        "tokenizer": {"name": str(getattr(tokenizer, "name_or_path", "")), "vocab": len(tokenizer)},
        "closed_book": None if spec.closed_book is None else asdict(spec.closed_book),
        "skip_invalid": spec.skip_invalid,
    }
    if spec.output_format == "parquet":
        params |= {"agent_name": spec.agent_name, "inline_context": spec.inline_context}
    else:
        params["index_context"] = uses_indices(spec, target)
    return params


def _file_identity(path: Path) -> dict[str, Any]:
    """A cheap identity of an input file: its absolute path and size (hashing 500 MB is not)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: input file not found")
    return {"path": str(path.resolve()), "bytes": path.stat().st_size}


def _write(
    spec: BuildSpec,
    target: Target,
    paths: list[Path],
    params: dict[str, Any],
    samples: Iterable[QASample],
    counts: dict[str, int],
) -> dict[str, Any]:
    """Stream ``samples`` into temporary files, then commit them with their manifest."""
    main, manifest = paths[-2], paths[-1]
    stats = _SizeStats()
    with atomic_outputs(paths) as temp:
        if spec.output_format == "parquet":
            writer = TrainingWriter(temp[main], temp[paths[0]], paths[0], spec.agent_name, spec.inline_context)
            with contextlib.closing(writer):
                for sample in samples:
                    writer.write(sample)
                    stats.add(sample.meta)
        else:
            with temp[main].open("w", encoding="utf-8") as handle:
                writer = PublishedWriter(handle, indices=uses_indices(spec, target))
                for sample in samples:
                    writer.write(sample)
                    stats.add(sample.meta)
                writer.close()
        if stats.count == 0:
            raise DataError(f"{spec.input}: no questions left to write (check --offset, --limit and the filter)")
        # The real sizes beside the label: a capped output's name states its target, not its length.
        summary = {
            "samples": stats.count,
            "tokens": stats.tokens.summary(),
            "docs": stats.docs.summary(),
            "capped": stats.capped,
        } | counts
        write_manifest(temp[manifest], params, summary)
    return summary


class _Running:
    """Running count, min, mean and max of one number per sample."""

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.low: int | None = None
        self.high: int | None = None

    def add(self, value: int) -> None:
        self.count += 1
        self.total += value
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)

    def summary(self) -> dict[str, float]:
        return {"min": self.low, "mean": round(self.total / max(self.count, 1), 1), "max": self.high}


class _SizeStats:
    """The samples' real sizes (token and document counts) and how many were capped."""

    def __init__(self) -> None:
        self.tokens = _Running()
        self.docs = _Running()
        self.capped = 0

    @property
    def count(self) -> int:
        return self.tokens.count

    def add(self, meta: dict[str, Any]) -> None:
        self.tokens.add(meta["num_tokens"])
        self.docs.add(meta["num_docs"])
        self.capped += bool(meta["capped"])


# ------------------------------------------------------------------------------ command line


def _targets(values: Sequence[str], kind: str) -> list[Target]:
    option = "--tokens" if kind == "tokens" else "--num-docs"
    out = []
    for value in values:
        for part in value.split(","):
            if part.strip():
                out.append(Target(kind, parse_size(part, option) if kind == "tokens" else _count(part, option)))
    return out


def _count(text: str, option: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{option}: expected a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: Sequence[str] | None = None) -> BuildSpec:
    """The :class:`BuildSpec` of a command line."""
    parser = argparse.ArgumentParser(prog="python -m data_prep.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", required=True, choices=SOURCES)
    parser.add_argument("--input", required=True, type=Path, help="the official file of the split")
    parser.add_argument("--split", required=True, help="split name (train makes the verl parquet by default)")
    parser.add_argument("--tokens", action="append", default=[], help="context tokens, e.g. 32k,64k,1m (k=1024)")
    parser.add_argument("--num-docs", action="append", default=[], help="document counts, e.g. 50,100,200")
    parser.add_argument("--out", required=True, type=Path, help="output folder")
    parser.add_argument("--format", choices=("parquet", "published"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--limit", type=int, default=None, help="keep the first N questions (after the filter)")
    parser.add_argument("--offset", type=int, default=0, help="skip the first N questions of the split")
    parser.add_argument("--exclude-pool", action="append", type=Path, default=[], help="hold out these files' paragraphs")
    parser.add_argument("--no-exclude-pool", action="store_true", help="evaluation split: share the reference's pool")
    parser.add_argument(
        "--extra-pool", action="append", type=Path, default=[], help="another file of the source: more distractors"
    )
    parser.add_argument(
        "--cap-at-pool", action="store_true", help="a pool too small for a target gives its whole pool (the reference)"
    )
    parser.add_argument("--index-context", choices=("auto", "always", "never"), default="auto")
    parser.add_argument(
        "--agent", choices=AGENT_LOOPS, default=None, help="parquet: an agent_name column naming this loop (default: none)"
    )
    parser.add_argument(
        "--inline-context", action="store_true", help="parquet: also a context column (not for our trainer)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: Qwen3's)")
    parser.add_argument("--skip-invalid", action="store_true", help="leave out questions that fail their checks instead of stopping")
    parser.add_argument("--overwrite", action="store_true", help="rebuild outputs finished with other parameters")
    parser.add_argument("--filter-policy", default=None, help="closed-book filter model, 'module:callable'")
    parser.add_argument("--filter-policy-arg", default=None, help="argument of the filter's callable")
    parser.add_argument("--filter-samples", type=int, default=ClosedBookSettings.samples)
    parser.add_argument("--filter-max-tokens", type=int, default=ClosedBookSettings.max_tokens)
    parser.add_argument("--filter-concurrency", type=int, default=ClosedBookSettings.concurrency)
    args = parser.parse_args(argv)
    try:
        targets = _targets(args.tokens, "tokens") + _targets(args.num_docs, "docs")
        closed_book = None
        if args.filter_policy is not None:
            settings = ClosedBookSettings(
                samples=args.filter_samples, max_tokens=args.filter_max_tokens, concurrency=args.filter_concurrency
            )
            closed_book = ClosedBookFilter(args.filter_policy, args.filter_policy_arg, settings)
    except ValueError as err:
        parser.error(str(err))
    return BuildSpec(
        source=args.source,
        input=args.input,
        split=args.split,
        targets=tuple(targets) or (Target("tokens", 32 << 10),),
        out_dir=args.out,
        format=args.format,
        seed=args.seed,
        limit=args.limit,
        offset=args.offset,
        exclude_pools=tuple(args.exclude_pool),
        shared_pool=args.no_exclude_pool,
        extra_pools=tuple(args.extra_pool),
        cap_at_pool=args.cap_at_pool,
        index_context=args.index_context,
        agent_name=args.agent,
        inline_context=args.inline_context,
        tokenizer=args.tokenizer,
        closed_book=closed_book,
        skip_invalid=args.skip_invalid,
        overwrite=args.overwrite,
    )


def main(argv: Sequence[str] | None = None) -> list[JobResult]:
    """Build what the command line asks; bad input ends in one line and exit status 2
    (:mod:`infmem_verl.cli`; the spec's own checks raise ValueError naming the option)."""
    args = list(sys.argv[1:] if argv is None else argv)
    take_traceback_flag(args)
    with exit_on_input_error("data_prep.build", (ValueError,)):
        return build(parse_args(args))


if __name__ == "__main__":
    main()
