"""See what the agent did: evaluation results and training trajectories as one HTML page.

    python -m infmem_verl.inspect runs/eval/default                 # every method of an evaluation
    python -m infmem_verl.inspect runs/eval/step0 runs/eval/step200 --out compare.html
    python -m infmem_verl.inspect tensorboard_log/infmem_verl/smoke  # training records, one run per step

PATH is an evaluation ``--out`` folder (turns and texts when it ran with ``--record-turns``), a
training records folder (``infmem.records.trajectories=true``) or one of its
``trajectories/step_<N>.jsonl`` files. The page needs no server and no network: open it from
disk. It lists every sample (filter, sort), shows a sample's chunk timeline, PreThink actions,
retrieved units with gold evidence highlighted, the memory after each Write with what changed
and the answer turn, and puts two runs side by side on the same samples.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .cli import entry_point
from .viewer.load import ViewerError, load
from .viewer.page import render


@entry_point("inspect", (ViewerError,))
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="evaluation folder, training records folder or step file")
    parser.add_argument("--out", type=Path, help="HTML file to write (default: trajectories.html in the first PATH, or beside it)")
    parser.add_argument("--limit", type=int, help="keep the first N samples of each run (pages of 1M-token documents stay small)")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit: expected an integer >= 1, got {args.limit}")
    first = args.paths[0]
    out = args.out or (first if first.is_dir() else first.parent) / "trajectories.html"
    runs = load(list(args.paths), args.limit)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(runs, f"Trajectories: {', '.join(p.name for p in args.paths)}"), encoding="utf-8")
    tmp.replace(out)
    samples = sum(len(run.samples) for run in runs.runs)
    print(f"[inspect] {len(runs.runs)} runs, {samples} samples, {out.stat().st_size / 1e6:.1f} MB: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
