"""Trajectory viewer benchmark: the page of a 1M-token document, its size and how fast it responds.

Run ``python -m bench.viewer`` (a few minutes on 2 cores; ``--quick``: a 128K-token document).
InfMem (the oracle controller of :mod:`bench.eval`, which stops once both facts are in memory) and
MemAgent (reads every chunk) run on one synthetic sample through the evaluation runner with
``--record-turns``'s writer; then ``python -m infmem_verl.inspect`` builds the page and a headless
Chromium (``tests/browser.py``) opens it from disk. Prints one table, asserts nothing.

- recording: the writer's time and the files it adds (the document's chunk texts once, each
  method's turn line);
- page: file size, load time (navigation to the load event), opening the sample (click to its
  two timelines drawn, InfMem beside MemAgent), showing the last chunk's text (on demand), the
  page's DOM nodes and JS heap after that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

from bench.agent_core import REPO, Row, print_table
from bench.eval import SEED, default_cfg, oracle_policy
from infmem_verl import inspect as inspect_cli
from infmem_verl.assets import load_tokenizer
from infmem_verl.data.synthetic import make_sample
from infmem_verl.evaluation.data import CellSource, length_tokens
from infmem_verl.evaluation.methods import build_methods
from infmem_verl.evaluation.runner import Runner
from infmem_verl.evaluation.store import ResultStore
from infmem_verl.evaluation.trajectories import DOCUMENTS, TRAJECTORIES, TrajectoryWriter


class TimedWriter(TrajectoryWriter):
    """The writer, timed (the figure is its own cost, not the agents')."""

    seconds = 0.0

    def write(self, *args) -> None:
        started = time.perf_counter()
        super().write(*args)
        self.seconds += time.perf_counter() - started


async def drive(page: Path, key: str, last_chunk: int) -> dict[str, float]:
    sys.path.insert(0, str(REPO / "tests"))
    from browser import Browser  # the tests' headless Chromium client

    async with Browser(1400, 1000) as browser:
        started = time.perf_counter()
        await browser.open(page)
        loaded = time.perf_counter() - started
        await browser.set_value("#run-b", "1")
        started = time.perf_counter()
        await browser.click_and_wait(f"#index tbody tr[data-key='{key}']", "#detail .pane:nth-child(2) .timeline .chunk")
        opened = time.perf_counter() - started
        started = time.perf_counter()
        step = f"#detail .pane:nth-child(2) .step[data-chunk='{last_chunk}']"
        await browser.click_and_wait(f"{step} summary", f"{step} .show-chunk")
        await browser.click_and_wait(f"{step} .show-chunk", f"{step} .chunk-text")
        chunk = time.perf_counter() - started
        await browser.send("Performance.enable")
        metrics = {m["name"]: m["value"] for m in (await browser.send("Performance.getMetrics"))["metrics"]}
        if browser.errors:
            raise RuntimeError(f"the page reported errors: {browser.errors}")
        return {"load": loaded, "open": opened, "chunk": chunk, "nodes": metrics["Nodes"], "heap": metrics["JSHeapUsedSize"]}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 128K-token document instead of 1M")
    args = parser.parse_args(argv)
    label = "128k" if args.quick else "1m"
    tokenizer = load_tokenizer()
    sample = make_sample(0, length_tokens(label), tokenizer, seed=SEED)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "eval"
        writer = TimedWriter(out)
        methods = build_methods(["infmem", "memagent"], default_cfg(), tokenizer, window=32768)
        runner = Runner(oracle_policy(tokenizer, [sample]), methods, ResultStore(out, {"bench": "viewer"}), 1,
                        progress=False, trajectories=writer)  # fmt: skip
        asyncio.run(runner.run([CellSource("synthetic", label, lambda: iter([sample]))]))
        documents = sum(p.stat().st_size for p in (out / DOCUMENTS).iterdir())
        lines = (out / TRAJECTORIES).read_text().splitlines()
        page = Path(tmp) / "page.html"
        inspect_cli.main([str(out), "--out", str(page)])
        chunks = json.loads(lines[-1])["num_chunks"]
        figures = asyncio.run(drive(page, f"synthetic/{label}/{sample.id}", chunks - 1))
        rows = [
            Row(f"recording both methods' turns ({label}, {chunks} chunks)", f"{writer.seconds:.2f} s",
                note=f"documents/: {documents / 1e6:.1f} MB (once, {len(sample.context) / 1e6:.1f} MB of text); "
                     f"trajectories.jsonl: InfMem {len(lines[0]) / 1e3:.0f} KB, MemAgent {len(lines[1]) / 1e3:.0f} KB"),
            Row("page size", f"{page.stat().st_size / 1e6:.1f} MB"),
            Row("page load (from disk to the load event)", f"{figures['load']:.2f} s"),
            Row("open the sample (two timelines drawn)", f"{figures['open'] * 1e3:.0f} ms"),
            Row("show the last chunk's text (on demand)", f"{figures['chunk'] * 1e3:.0f} ms"),
            Row("DOM nodes / JS heap after that", f"{figures['nodes']:.0f} / {figures['heap'] / 2**20:.0f} MiB"),
        ]  # fmt: skip
    print_table(f"Trajectory viewer, one {label}-token sample, InfMem beside MemAgent", rows)


if __name__ == "__main__":
    main()
