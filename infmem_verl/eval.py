"""Evaluate InfMem, MemAgent and two plain baselines over long-document QA files.

    python -m infmem_verl.eval                       # embedded default: tiny model, synthetic set
    python -m infmem_verl.eval --endpoint http://127.0.0.1:8000 --preset reference \\
        --data-dir data/ --datasets hotpotqa,squad --lengths 64k,128k,1m --out runs/ref
    python -m infmem_verl.eval --endpoint http://h1:8000 --endpoint http://h2:8000 \\
        --data hotpotqa:128k=data/eval_800.json --methods infmem,memagent

Without ``--endpoint`` the in-process transformers policy runs the model at ``--model-dir`` (the
tiny random Qwen3 by default), and without data the synthetic two-hop set is used, so the
command runs anywhere. Results go to ``--out`` as resumable per-sample JSONL (run the same
command again to resume: finished samples are never redone, samples that failed because of the
server are retried), then ``report.md`` and PNG plots are written there and the table printed.
``--record-turns`` also records every agent turn there for the trajectory viewer
(``python -m infmem_verl.inspect OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.templates import load_templates
from infmem_verl.cli import entry_point
from infmem_verl.policy.source import ModelSource, add_model_options, model_source, open_model

from .evaluation.aggregate import aggregate
from .evaluation.config import PRESETS, VARIANTS, DataSpec, EvalConfig, merge
from .evaluation.data import CellSource, file_source, find_file, missing_source, synthetic_sources
from .evaluation.methods import METHODS, build_methods
from .evaluation.published import BACKBONES
from .evaluation.reference_templates import LAYOUTS, TEMPLATES_FILE, templates_from
from .evaluation.report import dataset_tables, write_report
from .evaluation.runner import Runner
from .evaluation.store import RETRY_POLICIES, ResultStore
from .evaluation.trajectories import TrajectoryWriter

# Synthetic lengths and samples per length when no data is given, by preset.
SYNTHETIC_DEFAULTS = {"embedded": (["2k", "4k"], 2), "default": (["32k", "128k"], 16), "reference": (["32k", "128k"], 16)}
# Context window of the full-context baseline when neither the flag nor the server gives one.
FALLBACK_WINDOW = 32768


def parse_args(argv: Sequence[str] | None = None) -> EvalConfig:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="protocol (default: embedded without --endpoint, default with)")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {','.join(METHODS)}")
    parser.add_argument("--data", action="append", default=[], metavar="DATASET:LENGTH=PATH", help="an evaluation file (repeatable)")
    parser.add_argument("--data-dir", type=Path, help="folder of evaluation files under the reference's names")
    parser.add_argument("--datasets", default="", help="datasets to look up in --data-dir: hotpotqa,squad,musique,2wiki")
    parser.add_argument("--lengths", default="", help="length labels, e.g. 32k,128k,1m (also the synthetic set's lengths)")
    parser.add_argument("--pool", action="append", default=[], metavar="DATASET=PATH", help="official file whose paragraph pool expands index contexts")
    parser.add_argument("--samples", type=int, help="samples per cell (default: all; synthetic: 2 embedded, 16 otherwise)")
    parser.add_argument("--seed", type=int, default=0)
    add_model_options(parser, "model", ModelSource())
    parser.add_argument("--context-window", type=int, help="full-context baseline window (default: the server's max_model_len)")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/eval/<preset>)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="agent setting, e.g. document.chunk_tokens=2000")
    parser.add_argument("--templates-from", metavar="[LAYOUT=]PATH",
                        help="a released checkpoint's prompts: read them (and InfMem's controller grammar) from your checkout "
                        f"of the reference repository; LAYOUT {'|'.join(LAYOUTS)} (default: infmem when its file is there). "
                        f"Writes --out/{TEMPLATES_FILE}; --set overrides what it sets")  # fmt: skip
    parser.add_argument("--published-backbone", default="qwen3-4b", choices=BACKBONES)
    parser.add_argument("--retry-failed", default="transient", choices=RETRY_POLICIES)
    parser.add_argument("--variant", action="append", default=[], choices=sorted(VARIANTS), help="protocol variant on top of the preset (repeatable): " + "; ".join(f"{v.name}: {v.description}" for v in VARIANTS.values()))
    parser.add_argument("--repeats", type=int, default=1, metavar="K", help="samples per question and method; the report adds mean ± std over repeats")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the preset's; greedy presets use 0)")
    parser.add_argument("--record-turns", action="store_true",
                        help="also write every agent turn for the viewer (python -m infmem_verl.inspect OUT): "
                        "trajectories.jsonl and documents/ in --out. Costs each document's text once (~4 bytes "
                        "per token, ~4 MB at 1M tokens) plus the memories written (up to memory_tokens per chunk read) "
                        "per sample and agent method")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    cfg = EvalConfig(
        preset=args.preset,
        methods=comma_list(args.methods),
        data=[_data_spec(text) for text in args.data],
        data_dir=args.data_dir,
        datasets=comma_list(args.datasets),
        lengths=comma_list(args.lengths),
        pools=dict(_pair(text, "--pool") for text in args.pool),
        samples=args.samples,
        seed=args.seed,
        source=model_source(args),
        context_window=args.context_window,
        agent=merge(_overrides(args.set), {} if args.temperature is None else {"temperature": args.temperature}),
        published_backbone=args.published_backbone,
        retry_failed=args.retry_failed,
        progress=not args.no_progress,
        repeats=args.repeats,
        variants=args.variant,
        record_turns=args.record_turns,
    )
    preset = cfg.resolved_preset().name
    cfg.out = args.out or Path("runs/eval") / preset
    if args.templates_from:
        if "prompt_templates" in cfg.agent:
            raise ConfigError("--templates-from: give it or --set prompt_templates=FILE, not both")
        cfg.agent = merge(templates_from(args.templates_from, cfg.out), cfg.agent)
    return cfg.validate()


def comma_list(text: str) -> list[str]:
    """The non-empty, stripped items of a comma-separated option value."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _pair(text: str, option: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"{option}: expected NAME=PATH, got {text!r}")
    return name.strip(), Path(path)


def _data_spec(text: str) -> DataSpec:
    head, path = _pair(text, "--data")
    dataset, sep, length = head.partition(":")
    if not sep or not dataset or not length:
        raise ConfigError(f"--data: expected DATASET:LENGTH=PATH, got {text!r}")
    return DataSpec(dataset, length, path)


def _overrides(items: Sequence[str]) -> dict[str, Any]:
    """``a.b=1`` items as a nested mapping; values are JSON when they parse, strings otherwise."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set: expected KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _sources(cfg: EvalConfig, tokenizer) -> tuple[list[CellSource], int | None]:
    """The cells' sources and the per-cell sample limit."""
    pools: dict[str, Any] = {}

    def pool_of(dataset: str):
        def load():
            if dataset not in cfg.pools:
                return None
            if dataset not in pools:
                from data_prep.sources import load_pool

                pools[dataset] = load_pool(dataset, cfg.pools[dataset])
            return pools[dataset]

        return load

    if cfg.data:
        return [file_source(s.dataset, s.length, s.path, pool_of(s.dataset), cfg.samples) for s in cfg.data], cfg.samples
    if cfg.data_dir is not None:
        sources = []
        for dataset in cfg.datasets:
            for length in cfg.lengths:
                try:
                    sources.append(file_source(dataset, length, find_file(cfg.data_dir, dataset, length), pool_of(dataset), cfg.samples))
                except ValueError as err:  # DataError: a length or dataset that is not there
                    sources.append(missing_source(dataset, length, str(err)))
        return sources, cfg.samples
    lengths, samples = SYNTHETIC_DEFAULTS[cfg.resolved_preset().name]
    samples = cfg.samples or samples
    return synthetic_sources(cfg.lengths or lengths, samples, tokenizer, cfg.seed), samples


def run_protocol(preset: str, agent_cfg: AgentConfig, model: str, window: int) -> dict[str, Any]:
    """What the results of a run depend on, kept in its manifest: a resume under another protocol
    is refused. A prompt-templates file counts by its texts, not its path (``--templates-from``
    rewrites the same file from whatever the checkout holds now)."""
    protocol = {"preset": preset, "agent": dataclasses.asdict(agent_cfg), "model": model, "context_window": window}
    if agent_cfg.prompt_templates:
        templates = load_templates(agent_cfg.prompt_templates)
        protocol["prompt_texts"] = {kind: dataclasses.asdict(t) for kind, t in sorted(templates.items())}
    return protocol


async def evaluate(cfg: EvalConfig) -> Path:
    """Run (or resume) the evaluation ``cfg`` describes and write its report."""
    preset = cfg.resolved_preset()
    agent_cfg = cfg.agent_config()
    opened = await open_model(cfg.source, "eval", cfg.seed)
    tokenizer, model = opened.tokenizer, opened.name
    window = cfg.context_window or opened.context_window or FALLBACK_WINDOW
    try:
        store = ResultStore(cfg.out, run_protocol(preset.name, agent_cfg, model, window))
        sources, limit = _sources(cfg, tokenizer)
        methods = build_methods(cfg.methods, agent_cfg, tokenizer, window, cfg.source.concurrency)
        trajectories = TrajectoryWriter(cfg.out) if cfg.record_turns else None
        runner = Runner(opened.policy, methods, store, cfg.source.concurrency, cfg.retry_failed, cfg.progress, cfg.repeats, trajectories)
        counts = await runner.run(sources, limit)
    finally:
        await opened.close()
    stats = aggregate(store.latest(), cfg.published_backbone)
    header = (
        f"Model `{model}` ({cfg.source.describe()}), concurrency {cfg.source.concurrency}, context window {window}. "
        f"This run: {counts.read} records read (once per method), {counts.ran} samples run ({counts.failed} failed), "
        f"{counts.skipped} already done" + (f", {counts.unread} file(s) not read to their end." if counts.unread else ".")
    )
    variants = "".join(f" Variant **{name}**: {VARIANTS[name].description}." for name in cfg.variants)
    if variants or agent_cfg.prompt_templates:
        header += variants + (f" Prompt templates: `{agent_cfg.prompt_templates}`." if agent_cfg.prompt_templates else "")
    decoding = (
        f"Decoding: temperature {agent_cfg.temperature:g}{' (greedy)' if agent_cfg.temperature == 0 else ''}, "
        f"top-p {agent_cfg.top_p:g}, top-k {agent_cfg.top_k}; {cfg.repeats} sample(s) per question and method."
    )
    files = {(s.dataset, s.length): str(s.path) if s.path else "generated" for s in sources}
    report = write_report(cfg.out, stats, preset, cfg.published_backbone, header, decoding, files)
    print(header)
    print(decoding)
    for dataset, table in dataset_tables(stats, preset, cfg.published_backbone).items():
        print(f"\n{dataset}")
        print("\n".join(table))
    print(f"\n[eval] report: {report}")
    return report


@entry_point("eval")
def main(argv: Sequence[str] | None = None) -> int:
    asyncio.run(evaluate(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
