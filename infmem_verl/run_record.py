"""A run's own records next to its TensorBoard events: per-step metrics, trajectories, a summary plot.

Files in the records folder (by default the TensorBoard folder verl writes to, so one folder
holds everything a person opens after a run):

* ``steps.jsonl`` - one line per training step with every numeric metric logged at that step
  (training ``infmem/...``, validation ``val-infmem/...``, verl's own). Appended and flushed per
  step, so a killed run keeps what it logged; a resumed run appends, and a run from step 0 first
  moves an earlier run's file and trajectories into ``previous/<UTC time>/``. Read back, the lines of one
  step merge, later values winning: a redone step replaces what the killed run logged of it, and
  the validation before training (``trainer.val_before_train``) joins its step.
* ``trajectories/step_<N>.jsonl`` (optional) - one line per trajectory of step N: its ``key``, its
  ``values`` (reward, ``reward_extra_info``, the figures of :mod:`infmem_verl.metrics`) and its
  ``turns`` (every turn's facts with its token counts; memory text left out).
* ``run.json`` - what the run's held-out figures depend on besides its training (see
  :func:`run_identity`): written when a run starts from step 0, so that a comparison with another
  run's records (the demo's InfMem against MemAgent) can tell whether they share a model and a
  validation.
* ``run_summary.png`` - reward, its components, accuracy and chunks read over steps (training
  lines, validation points), and, for a model the warm-up made (:mod:`infmem_verl.cpu.warmup`),
  its SFT loss curve first: the whole recipe in one picture, for people who would rather look
  than read; drawn from ``steps.jsonl`` at the end of a run, so it covers every step of a
  resumed run too.

``infmem.records`` configures it: ``dir`` (null: the TensorBoard folder) and ``trajectories``
(write the per-trajectory files; off by default, since a 128-prompt step holds thousands of turns).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from infmem_verl.agent.errors import ConfigError
from infmem_verl.data.documents import split_ref, store_path
from infmem_verl.metrics import numeric
from infmem_verl.settings import document_settings, read_settings

RECORDS_KEY = "infmem.records"
STEPS_FILE = "steps.jsonl"
RUN_FILE = "run.json"
TRAJECTORIES_DIR = "trajectories"
SUMMARY_PNG = "run_summary.png"


@dataclass(frozen=True)
class Panel:
    """One plot of the summary: a training metric and its validation counterpart."""

    title: str
    train: str
    val: str


PANELS = (
    Panel("reward", "infmem/reward", "val-infmem/reward"),
    Panel("accuracy", "infmem/acc", "val-infmem/acc"),
    Panel("chunks read", "infmem/chunks_read", "val-infmem/chunks_read"),
)
# The panel of the reward's components: one training line and validation points per component.
COMPONENTS_PANEL = Panel("reward components", "", "")


@dataclass(frozen=True)
class RecordSettings:
    """``infmem.records``: where the records go and whether per-trajectory files are written."""

    dir: str | None = None  # None: the TensorBoard folder (see records_dir)
    trajectories: bool = False  # write every trajectory's turns per step (trajectories/step_N.jsonl)

    def validate(self, path: str) -> RecordSettings:
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir):
            raise ConfigError(f"{path}.dir: expected a folder path or null, got {self.dir!r}")
        return self


def record_settings(config: DictConfig) -> RecordSettings:
    """The validated ``infmem.records`` of ``config`` (defaults when the key is absent)."""
    return read_settings(RecordSettings, config, RECORDS_KEY, required=False)


def run_identity(config: DictConfig) -> dict[str, Any]:
    """What a run's held-out figures share with another run's only if they started alike: the model
    (``actor_rollout_ref.model.path``, and the size and modification time of each of its local
    files, so a student rebuilt in the same folder is another model), the validation documents
    (each of ``data.val_files`` and each document store their rows reference, by SHA-256: a
    bootstrap that rewrote them with other documents changes it, one that rewrote the same bytes
    does not) and the validation's sampling (``actor_rollout_ref.rollout.val_kwargs``). A path
    that is not a local file (a Hub id, a remote store) is kept as its name alone."""
    model = str(config.actor_rollout_ref.model.path)
    folder = Path(model).expanduser()
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    return {
        "model": model,
        "model_files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in files},
        "val_files": {path: _sha256(Path(path)) for path in _validation_files(config)},
        "val_sampling": OmegaConf.to_container(config.actor_rollout_ref.rollout.val_kwargs, resolve=True),
    }


def _validation_files(config: DictConfig) -> list[str]:
    """``data.val_files``, then the document stores their rows reference (``infmem.documents``)."""
    val_files = config.data.get("val_files")
    paths = [] if val_files is None else [str(val_files)] if isinstance(val_files, str) else [str(p) for p in val_files]
    documents = document_settings(config)
    stores: set[str] = set()
    for path in filter(os.path.isfile, paths):
        if documents.ref_key in pq.read_schema(path).names:
            refs = pc.unique(pq.read_table(path, columns=[documents.ref_key]).column(documents.ref_key)).to_pylist()
            stores.update(store_path(split_ref(ref)[0], documents.root) for ref in refs)
    return paths + sorted(stores)


def _sha256(path: Path) -> str:
    """The file's SHA-256, or "" where ``path`` is not a local file."""
    if not path.is_file():
        return ""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# run_identity's keys as a comparison names them.
IDENTITY_PARTS = {"model": "model", "model_files": "model", "val_files": "validation documents", "val_sampling": "validation sampling"}


def identity_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """The parts (IDENTITY_PARTS' names, each once) in which two runs' ``run.json`` differ."""
    return list(dict.fromkeys(name for key, name in IDENTITY_PARTS.items() if a.get(key) != b.get(key)))


def records_dir(config: DictConfig) -> Path:
    """``infmem.records.dir``, else where verl's TensorBoard logger writes: ``$TENSORBOARD_DIR`` or
    ``tensorboard_log/<trainer.project_name>/<trainer.experiment_name>`` (relative to the trainer's
    working directory, as verl's is)."""
    configured = record_settings(config).dir
    if configured:
        return Path(configured).expanduser()
    trainer = config.trainer
    return Path(os.environ.get("TENSORBOARD_DIR", f"tensorboard_log/{trainer.project_name}/{trainer.experiment_name}"))


class RunRecord:
    """Writes and reads the records of one run in ``directory`` (created on first write)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)

    @property
    def steps_file(self) -> Path:
        return self.directory / STEPS_FILE

    def trajectories_file(self, step: int) -> Path:
        return self.directory / TRAJECTORIES_DIR / f"step_{step}.jsonl"

    @property
    def run_file(self) -> Path:
        return self.directory / RUN_FILE

    def write_identity(self, identity: Mapping[str, Any]) -> None:
        """Write ``run.json`` (:func:`run_identity`), whole or not at all."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(identity, indent=1) + "\n")
        os.replace(tmp, self.run_file)

    def identity(self) -> dict[str, Any] | None:
        """The run's ``run.json``; None for records written without one."""
        return json.loads(self.run_file.read_text()) if self.run_file.is_file() else None

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Append step ``step``'s numeric metrics to ``steps.jsonl`` and flush it to disk."""
        self.directory.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": int(step), **numeric(metrics)}) + "\n"
        with self.steps_file.open("a+b") as file:
            if file.tell() > 0:
                file.seek(-1, os.SEEK_END)
                if file.read(1) != b"\n":
                    line = "\n" + line  # a run killed mid-line left it torn: start a fresh one
            file.write(line.encode())
            file.flush()
            os.fsync(file.fileno())

    def start_fresh(self) -> Path | None:
        """For a run from step 0: move an earlier run's ``steps.jsonl``, trajectories and ``run.json``
        into ``previous/<UTC time>/``, kept rather than merged into this run's records; returns that folder."""
        old = [p for p in (self.steps_file, self.directory / TRAJECTORIES_DIR, self.run_file) if p.exists()]
        if not old:
            return None
        moved = self.directory / "previous" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        moved.mkdir(parents=True, exist_ok=True)
        for path in old:
            os.replace(path, moved / path.name)
        return moved

    def log_trajectories(self, step: int, trajectories: Sequence[Mapping[str, Any]]) -> None:
        """Write step ``step``'s trajectory records (one JSON object each), replacing an earlier file."""
        path = self.trajectories_file(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as file:
            for record in trajectories:
                file.write(json.dumps(record) + "\n")

    def steps(self) -> list[dict[str, float]]:
        """The step records in step order; the lines of a step logged more than once merged, later values winning."""
        if not self.steps_file.is_file():
            return []
        by_step: dict[int, dict[str, float]] = {}
        for line in self.steps_file.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # blank, or the torn last line of a run killed while writing it
            by_step.setdefault(int(record["step"]), {}).update(record)
        return [by_step[step] for step in sorted(by_step)]

    def trajectories(self, step: int) -> list[dict[str, Any]]:
        path = self.trajectories_file(step)
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def plot(self, title: str = "", components: Sequence[str] = (), sft_losses: Sequence[float] = ()) -> Path | None:
        """Draw ``run_summary.png`` from ``steps.jsonl``; None when no step was logged.

        ``components``: reward components drawn in their own panel (training lines, validation
        points); ``sft_losses``: the warm-up's loss per SFT step, drawn first when given.
        """
        steps = self.steps()
        if not steps:
            return None
        import matplotlib

        matplotlib.use("Agg")  # files only; never a window, whatever the environment says
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        panels = [PANELS[0], *([COMPONENTS_PANEL] if components else []), *PANELS[1:]]
        count = len(panels) + bool(sft_losses)
        fig, axes = plt.subplots(1, count, figsize=(4.2 * count, 3.4), squeeze=False)
        axes = list(axes[0])
        if sft_losses:
            ax = axes.pop(0)
            ax.plot(range(1, len(sft_losses) + 1), sft_losses, "-", linewidth=1)
            ax.set_title("warm-up SFT loss")
            ax.set_xlabel("SFT step")
            ax.grid(alpha=0.3)
        for ax, panel in zip(axes, panels):
            if panel is COMPONENTS_PANEL:
                series = [(f"infmem/{c}", f"val-infmem/{c}", c) for c in components]
            else:
                series = [(panel.train, panel.val, "")]
            for train, val, name in series:
                for key, style, label in ((train, ".-", "train"), (val, "o", "validation")):
                    points = [(s["step"], s[key]) for s in steps if key in s]
                    if points:
                        xs, ys = zip(*points)
                        ax.plot(xs, ys, style, label=f"{name} {label}".strip(), markersize=5)
            ax.set_title(panel.title)
            ax.set_xlabel("RL step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=8)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        path = self.directory / SUMMARY_PNG
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
