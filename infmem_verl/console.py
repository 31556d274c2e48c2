"""The launcher's console: a few lines a person reads, the full output in a file.

By default ``python -m infmem_verl.main`` shows what runs (the bootstrap and backend lines, the
warm-up's progress bars), then one line per RL step and per validation while training, and at
the end a table: reward and its components, accuracy, chunks read, stop rate and LLM calls
(last step, training and validation), time per phase, InfMem over MemAgent once both agents'
records lie side by side from the same model and validation (:func:`agent_gap`), and the paths
of the TensorBoard events, ``steps.jsonl``, the run summary PNG and the full log. Everything else
the run prints - verl's metric dumps, Ray's notices, the workers' logs - goes to ``run.log`` next
to the TensorBoard events, named on the console. ``-v`` (or ``INFMEM_VERBOSE=1``) shows
everything as before.

How: while training, the process's stdout and stderr *descriptors* point at the log file, so
Ray's log forwarding, verl's prints, child processes and C-level output all land there; the
console lines go to a duplicate of the original terminal. They are drawn from the run's own
records (``steps.jsonl``, appended per step by the trainer, :mod:`infmem_verl.run_record`), which
a thread follows: no output is parsed, and every backend gets the same console.

Third-party warnings known to be harmless here are silenced where they are raised
(:func:`silence_known_warnings`): the emitting logger's level, the emitting module's warnings.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from omegaconf import DictConfig

from infmem_verl.cpu.report import step_line, validation_line
from infmem_verl.metrics import PREFIX
from infmem_verl.run_record import RUN_FILE, SUMMARY_PNG, RunRecord, identity_differences, records_dir

VERBOSE_ENV = "INFMEM_VERBOSE"
VERBOSE_FLAGS = ("-v", "--verbose")
LOG_FILE = "run.log"
# Per-trajectory statistics of the end table and the validation line, besides the reward components.
TABLE_ROWS = (("reward", "reward"), ("acc", "accuracy"), ("chunks_read", "chunks read"), ("stopped_early", "stop rate"), ("llm_calls", "LLM calls"))
# verl's per-step timers shown in the end table, summed over steps.
PHASES = (("gen", "generation"), ("reward", "reward"), ("old_log_prob", "old log-probs"), ("ref", "reference"), ("update_actor", "update"), ("testing", "validation"))


def take_verbose_flag(argv: list[str]) -> bool:
    """Remove ``-v`` / ``--verbose`` from ``argv`` (Hydra would reject them) and record the choice
    in ``INFMEM_VERBOSE``; True when the full output is wanted."""
    if any(arg in VERBOSE_FLAGS for arg in argv[1:]):
        argv[1:] = [arg for arg in argv[1:] if arg not in VERBOSE_FLAGS]
        os.environ[VERBOSE_ENV] = "1"
    return verbose()


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def silence_known_warnings() -> None:
    """Silence third-party warnings that are expected on every run of ours and say nothing.

    * verl's engine registry warns once per optional engine (torchtitan, veomni, automodel,
      mindspeed, megatron) that is not installed; we use none of them.
    * verl's platform manager warns that no accelerator was found on CPU-only machines and actors,
      where that is the point.
    * verl's validate_config warns that the critic is off because the estimator is not GAE: GRPO,
      by design (the pre-flight checks refuse other estimators).
    Process-wide: Ray workers import verl before our plugin and keep their warnings (they go to the
    log file in console mode).
    """
    warnings.filterwarnings("ignore", category=UserWarning, module=r"verl\.workers\.engine")
    warnings.filterwarnings("ignore", message=r"Disabled critic as algorithm\.adv_estimator != gae", category=UserWarning)
    # verl sets this logger's level when it imports the module (and warns during `import verl`),
    # so a level set here would not hold: a filter on the logger itself does.
    platform = logging.getLogger("verl.plugin.platform.platform_manager")
    if _errors_only not in platform.filters:
        platform.addFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def step_lines(record: Mapping[str, Any], total: int, components: Sequence[str]) -> list[str]:
    """The console lines of one ``steps.jsonl`` record: its training step, its validation, or both."""
    lines = []
    if f"{PREFIX}/reward" in record:
        lines.append(step_line(int(record["step"]), total, record, components))
    if any(key.startswith("val-") for key in record):
        lines.append(f"{validation_line(record, [name for name, _ in TABLE_ROWS] + list(components))} (step {int(record['step'])})")
    return lines


def end_table(steps: Sequence[Mapping[str, Any]], components: Sequence[str], seconds: Mapping[str, float]) -> list[str]:
    """The end-of-run table: the last training step's and the last validation's per-trajectory
    means, then time per phase (``seconds``: the launcher's own phases; verl's step timers summed)."""
    train = next((s for s in reversed(steps) if f"{PREFIX}/reward" in s), {})
    val = next((s for s in reversed(steps) if f"val-{PREFIX}/reward" in s), {})
    rows = [(name, name) for name in components]
    rows = [TABLE_ROWS[0], *rows, *TABLE_ROWS[1:]]
    head = f"  {'':<14}{'train (step ' + str(int(train['step'])) + ')' if train else 'train':>18}"
    head += f"{'validation (step ' + str(int(val['step'])) + ')' if val else 'validation':>24}"
    lines = ["[infmem] run summary", head]
    for name, label in rows:
        shown = label if name not in components else f"  {label}"
        lines.append(f"  {shown:<14}{_value(train.get(f'{PREFIX}/{name}')):>18}{_value(val.get(f'val-{PREFIX}/{name}')):>24}")
    lines += heldout_change(steps, components)
    timers = {label: sum(s.get(f"timing_s/{key}", 0.0) for s in steps) for key, label in PHASES}
    rl = sum(s.get("timing_s/step", 0.0) for s in steps)
    parts = [f"{label} {value:.0f}s" for label, value in seconds.items()]
    parts.append(f"RL steps {rl:.0f}s (" + ", ".join(f"{label} {value:.0f}s" for label, value in timers.items() if value) + ")")
    lines.append("  time: " + " | ".join(parts))
    return lines


def heldout_change(steps: Sequence[Mapping[str, Any]], components: Sequence[str]) -> list[str]:
    """First against last validation (``trainer.val_before_train`` gives the first at step 0):
    accuracy and each reward component, with two standard errors of the last mean.

    The standard error is ``sqrt(p (1 - p) / n)`` over the ``n`` validation trajectories: exact
    for a 0/1 value (accuracy, exact match), an upper bound for any value in [0, 1].
    """
    vals = [s for s in steps if f"val-{PREFIX}/reward" in s]
    if len(vals) < 2:
        return []
    first, last = vals[0], vals[-1]
    n = int(last.get(f"val-{PREFIX}/trajectories", 0))
    if n < 1:
        return []
    lines = [f"  held out, validation at step {int(first['step'])} -> {int(last['step'])} ({n} trajectories; 2 SE of the last mean):"]
    for name in ("acc", *components):
        a, b = first.get(f"val-{PREFIX}/{name}"), last.get(f"val-{PREFIX}/{name}")
        if a is None or b is None:
            continue
        two_se = 2 * math.sqrt(_variance(b) / n)
        lines.append(f"    {name:<12}{a:.3f} -> {b:.3f} ({b - a:+.3f}; 2 SE {two_se:.3f}: {_verdict(b - a, two_se)})")
    return lines


# The demo names each agent's records folder after its agent loop (conf/recipe/demo.yaml's
# trainer.experiment_name), so either run finds the other's beside its own.
AGENT_FOLDERS = {"InfMem": "_infmem_agent", "MemAgent": "_memagent_agent"}


def agent_gap(directory: Path) -> list[str]:
    """InfMem over MemAgent in held-out accuracy, the papers' comparison, once both agents' records
    lie side by side (``<name>_infmem_agent`` and ``<name>_memagent_agent``) with validations of as
    many trajectories: their first validations against each other, then their last.

    The two runs must have started from the same model and validated on the same documents the
    same way (each records folder's ``run.json``, :func:`~infmem_verl.run_record.run_identity`):
    otherwise one line says which of those differ instead. (A demo run with other warm-up settings
    trains another student; MemAgent's records beside it are still the earlier student's.)

    Two standard errors of the difference take the two means as independent,
    ``2 sqrt((pa (1 - pa) + pb (1 - pb)) / n)``; both runs validate on the same documents, which
    makes the true noise smaller, so the bar is cautious.
    """
    stem = next((directory.name.removesuffix(suffix) for suffix in AGENT_FOLDERS.values() if directory.name.endswith(suffix)), None)
    if stem is None:
        return []
    records = {agent: RunRecord(directory.with_name(stem + suffix)) for agent, suffix in AGENT_FOLDERS.items()}
    vals = {agent: [s for s in record.steps() if f"val-{PREFIX}/acc" in s] for agent, record in records.items()}
    counts = {int(v[-1].get(f"val-{PREFIX}/trajectories", 0)) for v in vals.values() if v}
    if not all(vals.values()) or len(counts) != 1 or min(counts) < 1:
        return []
    n = counts.pop()
    other = records["MemAgent" if directory.name.endswith(AGENT_FOLDERS["InfMem"]) else "InfMem"].directory
    identities = {agent: record.identity() for agent, record in records.items()}
    if None in identities.values():
        missing = " and ".join(f"{agent}'s" for agent, identity in identities.items() if identity is None)
        return [f"  InfMem over MemAgent: not compared: {missing} records hold no {RUN_FILE} (written by runs from step 0), so whether both runs share a model and validation is unknown ({other})"]
    differences = identity_differences(identities["InfMem"], identities["MemAgent"])
    if differences:
        return [
            f"  InfMem over MemAgent: not compared: the two runs differ in {', '.join(differences)} ({other}: {RUN_FILE});"
            " run both agents with the same settings"
        ]
    lines = [f"  InfMem over MemAgent, held-out accuracy ({n} trajectories each; 2 SE of the difference; MemAgent's records: {records['MemAgent'].directory}):"]
    for label, index in (("first validation", 0), ("last validation", -1)):
        if index == -1 and all(len(v) == 1 for v in vals.values()):
            break
        infmem, memagent = vals["InfMem"][index], vals["MemAgent"][index]
        a, b = infmem[f"val-{PREFIX}/acc"], memagent[f"val-{PREFIX}/acc"]
        two_se = 2 * math.sqrt((_variance(a) + _variance(b)) / n)
        steps = f"steps {int(infmem['step'])} / {int(memagent['step'])}"
        lines.append(f"    {label} ({steps}): {a:.3f} vs {b:.3f} ({a - b:+.3f}; 2 SE {two_se:.3f}: {_verdict(a - b, two_se)})")
    return lines


def _variance(p: float) -> float:
    """``p (1 - p)``: the variance of a 0/1 value of mean ``p``, a bound for any value in [0, 1]."""
    p = min(max(p, 0.0), 1.0)
    return p * (1 - p)


def _verdict(change: float, two_se: float) -> str:
    return "above noise" if change > two_se else "below noise" if -change > two_se else "within noise"


def _value(value: Any) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{float(value):.3f}"


class _Follower:
    """Prints the console lines of each new ``steps.jsonl`` record as the trainer appends it."""

    def __init__(self, record: RunRecord, out: TextIO, total: int, components: Sequence[str]):
        self.record, self.out, self.total, self.components = record, out, total, components
        self.seen: dict[int, set[str]] = {}
        # The lines the records gave before this run: a resumed run does not show its kept steps
        # again, but a line this run's metrics change (a redone step, the resumed run's validation
        # joining its step, a fresh start over an old folder) differs and is shown.
        self.before = {line for r in record.steps() for line in step_lines(r, total, components)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the last step's lines

    def _follow(self) -> None:
        while not self._stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        for record in self.record.steps():
            shown = self.seen.setdefault(int(record["step"]), set())
            for line in step_lines(record, self.total, self.components):
                kind = line.split("|")[0]  # a step's training line and its validation line
                if kind not in shown and line not in self.before:
                    shown.add(kind)
                    print(line, file=self.out, flush=True)


@contextlib.contextmanager
def console_mode(config: DictConfig) -> Iterator[None]:
    """Around the training call: the console of the module docstring (a no-op with ``-v``)."""
    if verbose():
        yield
        return
    directory = records_dir(config).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / LOG_FILE
    record = RunRecord(directory)
    started = time.time()
    setup = started - _process_start()
    sys.stdout.flush()
    console = os.fdopen(os.dup(1), "w", buffering=1)  # the terminal, whatever fd 1 becomes next
    components = list(config.infmem.reward.components)
    print(f"[infmem] training; verl's and Ray's full output: {log} (-v or {VERBOSE_ENV}=1 shows it here)", file=console, flush=True)
    follower = _Follower(record, console, int(config.trainer.total_training_steps or 0), components)
    with log.open("a", buffering=1) as file, _redirected(file):
        follower.start()
        try:
            yield
        finally:
            follower.stop()
    for line in end_table(record.steps(), components, {"set-up incl. warm-up": setup, "training": time.time() - started}) + agent_gap(directory):
        print(line, file=console)
    for label, path in _paths(config, directory, log):
        print(f"  {label:<14}{path}", file=console)
    console.close()


def _paths(config: DictConfig, directory: Path, log: Path) -> list[tuple[str, Path]]:
    paths = [("TensorBoard", directory), ("steps", directory / "steps.jsonl"), ("summary plot", directory / SUMMARY_PNG)]
    paths += [("viewer", page) for page in sorted(directory.glob("*.html"))]
    paths.append(("full log", log))
    return [(label, path) for label, path in paths if path.exists()]


@contextlib.contextmanager
def _redirected(file: TextIO) -> Iterator[None]:
    """Point descriptors 1 and 2 (and Python's streams) at ``file``; restore them after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    try:
        # Python's streams too, for when they are not descriptors 1 and 2 (a test's capture).
        with contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)


def _process_start() -> float:
    import psutil

    return psutil.Process().create_time()
