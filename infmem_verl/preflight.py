"""Pre-flight checks of a composed run: what verl would only find out after a whole rollout.

verl checks most shapes lazily: a per-GPU token cap below the longest sequence fails at the first
log-prob pass, a TransferQueue too small for a step's rows fails inside the agent-loop workers (and
then only shrinks GRPO groups), a training file naming another agent loop silently trains that one.
On a GPU cluster each of those costs a rollout. :func:`preflight` checks all of them from the
composed config and the dataset files, before any worker starts (``dry_run=true`` included), and
sizes one RL step so the numbers a user acts on are printed (:meth:`Preflight.table`). Every failing
check is listed at once, each with the key to change and the numbers.

Rows: every LLM call of a trajectory is one training sequence. InfMem makes at most a PreThink and a
Write per chunk plus the answer (``2 * chunks + 1``), MemAgent a Write per chunk plus the answer
(:func:`infmem_verl.cost.budget_trajectory`).
Document lengths come from the files' ``extra_info.num_tokens`` (written by ``data_prep.build`` and
the synthetic builder); without them the sizing says so instead of guessing.
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field

import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.cost import budget_trajectory
from infmem_verl.data.documents import split_ref, store_path
from infmem_verl.data.identity import IdLedger
from infmem_verl.settings import document_settings, train_settings

DATA_KEYS = ("data.train_files", "data.val_files")
CHECKPOINT_KEYS = ("trainer.default_local_dir", "trainer.resume_from_path")
# Set by Ray's job supervisor in the environment of a job's entrypoint, and only there
# (ray/_private/runtime_env/constants.py; job_supervisor.py _get_driver_env_vars): JSON with the
# job's runtime_env and metadata (the submission id under "job_submission_id").
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
# Advantage estimators whose advantage verl 0.9.1's v1 trainer computes per trajectory (on its final
# sequence) and broadcasts to the trajectory's other sequences (trainer/ppo/v1/utils.py,
# compute_advantage_for_multi_trajectories); any other one is applied row by row, as if every LLM
# call were its own sample.
TRAJECTORY_ESTIMATORS = ("grpo",)
STORAGE_KEY = "transfer_queue.backend.SimpleStorage"
# verl's checkpoint tracker in trainer.default_local_dir: the step of the latest complete save.
TRACKER = "latest_checkpointed_iteration.txt"


@dataclass(frozen=True)
class Check:
    """One pre-flight check: what it compared, and the key to change when it failed."""

    name: str
    ok: bool
    detail: str
    key: str = ""

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        key = f" ({self.key})" if self.key else ""
        return f"  {mark} {self.name}{key}: {self.detail}"


@dataclass(frozen=True)
class DatasetFile:
    """What the checks read of one dataset file."""

    key: str  # data.train_files | data.val_files
    path: str
    rows: int
    num_tokens: list[int]  # per sample, from extra_info.num_tokens (empty: not recorded)
    stores: list[str]  # document stores the references name


@dataclass(frozen=True)
class StepSize:
    """Rows (sequences) and budget-bound tokens of one pass over ``trajectories`` trajectories."""

    trajectories: int
    rows_expected: int  # documents of mean length, read to the end
    rows_worst: int  # the longest document, read to the end
    tokens_expected: int
    tokens_worst: int
    longest_document: int  # tokens


@dataclass
class Preflight:
    """The checks and the sizing of one RL step."""

    checks: list[Check] = field(default_factory=list)
    files: list[DatasetFile] = field(default_factory=list)
    train: StepSize | None = None
    val: StepSize | None = None
    longest_sequence: int = 0
    optimizer_steps: int = 0

    def add(self, name: str, ok: bool, detail: str, key: str = "") -> None:
        self.checks.append(Check(name, ok, detail, key))

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def raise_on_failure(self) -> None:
        """One ConfigError listing every failed check (key, numbers), or nothing."""
        if self.failures:
            lines = "\n".join(c.line() for c in self.failures)
            raise ConfigError(f"{len(self.failures)} pre-flight check(s) failed:\n{lines}")

    def table(self) -> str:
        """The sizing table and the checks, as printed by the dry run."""
        out = ["[infmem] sizing of one RL step (token counts are budget bounds: every call at its full budget)"]
        for name, size in (("train step", self.train), ("validation", self.val)):
            if size is None:
                out.append(f"  {name:<11} not sized: no dataset file with extra_info.num_tokens")
                continue
            out.append(
                f"  {name:<11} {size.trajectories:>7,} trajectories  rows {size.rows_expected:>9,} expected "
                f"/ {size.rows_worst:>9,} worst  tokens {size.tokens_expected:>14,} expected / {size.tokens_worst:>14,} worst"
            )
        if self.train is not None and self.optimizer_steps:
            out.append(
                f"  optimizer   {self.optimizer_steps} steps per RL step, up to "
                f"{math.ceil(self.train.rows_worst / self.optimizer_steps):,} rows each"
            )
        out.append(f"  longest sequence {self.longest_sequence:,} tokens (prompt + response)")
        out.append("[infmem] pre-flight checks")
        out.extend(c.line() for c in self.checks)
        return "\n".join(out)


def ray_job() -> str | None:
    """The submission id of the Ray job whose entrypoint this process is, or None outside a Ray job."""
    raw = os.environ.get(RAY_JOB_ENV)
    if raw is None:
        return None
    try:
        metadata = json.loads(raw).get("metadata") or {}
    except (ValueError, AttributeError):
        metadata = {}
    return str(metadata.get("job_submission_id") or "(no submission id)")


def resolve_paths(config: DictConfig, launch_dir: str | None = None) -> None:
    """Make relative data-file and checkpoint paths absolute against the launch directory (in place).

    Ray workers may run in another directory (a job's uploaded working dir, another node), so
    verl's dataset must get paths that mean the same file everywhere, and so must the checkpoint
    folder: each FSDP worker resolves it against its own working directory (verl's
    ``_save_checkpoint``), the resume only against the task runner's. A Ray job's entrypoint runs
    inside Ray's per-job copy of the working directory, so there a relative checkpoint folder is
    refused (ConfigError) when the run saves or resumes: it would be written into that copy.
    """
    base = launch_dir or os.getcwd()
    for key in DATA_KEYS:
        files = OmegaConf.select(config, key)
        if files is None:
            continue
        absolute = [os.path.abspath(os.path.join(base, os.path.expanduser(f))) for f in _as_list(files)]
        OmegaConf.update(config, key, absolute[0] if isinstance(files, str) else absolute, merge=False)
    trainer = config.trainer
    uses_checkpoints = int(trainer.get("save_freq", -1) or -1) > 0 or trainer.get("resume_mode", "disable") != "disable"
    job = ray_job()
    for key in CHECKPOINT_KEYS:
        path = OmegaConf.select(config, key)
        if path is None:
            continue
        path = os.path.expanduser(str(path))
        if not os.path.isabs(path) and job is not None and uses_checkpoints:
            raise ConfigError(
                f"{key}: {path!r} is relative, and this is the entrypoint of Ray job {job}, whose working "
                "directory is Ray's temporary copy of the uploaded one on this node; checkpoints would be "
                "written there and lost with it. Pass an absolute folder on storage every node shares "
                f"({key}=/shared/..., or recipes/submit.sh --shared DIR)"
            )
        OmegaConf.update(config, key, os.path.abspath(os.path.join(base, path)), merge=False)


def _as_list(files) -> list[str]:
    return [files] if isinstance(files, str) else list(files or [])


def read_dataset(
    key: str, path: str, required: list[str], ref_key: str, agent_loop: str, mixed_agents: bool, report: Preflight
) -> DatasetFile | None:
    """Check one dataset file's columns and agent names (with ``mixed_agents``, rows of other agents
    beside the configured one are allowed); None (after a failed check) when unusable."""
    columns = pq.read_schema(path).names
    absent = [c for c in required if c not in columns]
    if absent:
        hint = ""
        if "context" in columns:
            hint = (
                "; documents must be passed by reference: build the file with `python -m data_prep.build` "
                "or `python -m infmem_verl.verl_plugin.dataset`"
            )
        report.add("dataset columns", False, f"{path} lacks column(s) {absent}; it has {columns}{hint}", key)
        return None
    read = [ref_key] + [c for c in ("agent_name", "extra_info") if c in columns]
    table = pq.read_table(path, columns=read)
    if "agent_name" in columns:
        names = sorted({str(n) for n in table.column("agent_name").to_pylist() if n is not None})
        if names and names != [agent_loop] and not (mixed_agents and agent_loop in names):
            report.add(
                "agent loop of the data",
                False,
                f"{path} column 'agent_name' names {names}, but the run is configured for {agent_loop!r} "
                "(actor_rollout_ref.rollout.agent.default_agent_loop); verl runs the loop a row names. Rebuild "
                "the file without --agent, choose the agent that matches it, or (rows of both agents on purpose) "
                "set infmem.allow_mixed_agents=true",
                key,
            )
    num_tokens: list[int] = []
    if "extra_info" in columns and "num_tokens" in {f.name for f in table.schema.field("extra_info").type}:
        values = pc.struct_field(table.column("extra_info"), "num_tokens").to_pylist()
        if all(v is not None for v in values):
            num_tokens = [int(v) for v in values]
    unique_refs = pc.unique(table.column(ref_key))
    if len(unique_refs) < table.num_rows:
        _check_one_document_per_question(path, pq.read_table(path, columns=[ref_key, required[0]]), ref_key, required[0], key, report)
    stores = sorted({split_ref(ref)[0] for ref in unique_refs.to_pylist()})
    return DatasetFile(key, path, table.num_rows, num_tokens, stores)


def _check_one_document_per_question(path: str, table, ref_key: str, prompt_key: str, key: str, report: Preflight) -> None:
    """Rows naming one document must ask one question: two samples with one id would have the
    second trained on the first's document (the store keys documents by sample id). The same row
    twice (a question repeated on purpose) is allowed."""
    asked: dict[str, object] = {}
    ids = IdLedger("document_ref")
    for row, (ref, prompt) in enumerate(zip(table.column(ref_key).to_pylist(), table.column(prompt_key).to_pylist())):
        if asked.setdefault(ref, prompt) == prompt:
            ids.repeat(ref, f"{path} row {row}")
            continue
        refusal = ids.repeat(ref, f"{path} row {row}")
        report.add("one document per question", False, f"{refusal} with another question; rebuild the file with "
                   "python -m data_prep.build or python -m infmem_verl.verl_plugin.dataset (both refuse repeated ids)", key)  # fmt: skip
        return


def check_datasets(config: DictConfig, required: list[str], agent_loop: str, report: Preflight) -> list[str]:
    """Read every existing train/val file into ``report.files``; returns the paths that do not exist."""
    ref_key = document_settings(config).ref_key
    root = document_settings(config).root
    mixed_agents = bool(OmegaConf.select(config, "infmem.allow_mixed_agents", default=False))
    missing, stores = [], set()
    for key in DATA_KEYS:
        for path in _as_list(OmegaConf.select(config, key)):
            if not os.path.isfile(path):
                missing.append(path)
                continue
            dataset = read_dataset(key, path, required, ref_key, agent_loop, mixed_agents, report)
            if dataset is None:
                continue
            report.files.append(dataset)
            for store in set(dataset.stores) - stores:
                _check_store(store, root, dataset, report)
            stores.update(dataset.stores)
    return missing


def _check_store(store: str, root: str | None, dataset: DatasetFile, report: Preflight) -> None:
    path = store_path(store, root)
    readable = os.path.isfile(path) and os.access(path, os.R_OK)
    report.add(
        "document store readable",
        readable,
        f"{path} (named by {dataset.path})"
        + (
            ""
            if readable
            else f" is not readable on {socket.gethostname()}; documents travel by reference, so every node of "
            "the cluster needs the store at this same path (shared storage)"
        ),
        "infmem.documents.root" if not readable else "",
    )


def check_token_caps(config: DictConfig, longest: int, use_reference: bool, report: Preflight) -> None:
    """Every cap that bounds one sequence against the longest one (prompt + response budget)."""
    aro = config.actor_rollout_ref
    actor, rollout, ref = aro.actor, aro.rollout, aro.ref
    sp = int(OmegaConf.select(config, "actor_rollout_ref.actor.ulysses_sequence_parallel_size", default=1) or 1)
    caps = []
    if actor.use_dynamic_bsz:
        caps.append(("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, sp))
    if rollout.log_prob_use_dynamic_bsz:
        caps.append(("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", rollout.log_prob_max_token_len_per_gpu, sp))
    if use_reference and ref.log_prob_use_dynamic_bsz:
        ref_sp = int(ref.get("ulysses_sequence_parallel_size", sp) or 1)
        caps.append(("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", ref.log_prob_max_token_len_per_gpu, ref_sp))
    if not rollout.enable_chunked_prefill and rollout.max_num_batched_tokens is not None:
        caps.append(("actor_rollout_ref.rollout.max_num_batched_tokens (chunked prefill off)", rollout.max_num_batched_tokens, 1))
    if rollout.get("max_model_len") is not None:
        caps.append(("actor_rollout_ref.rollout.max_model_len", rollout.max_model_len, 1))
    for key, cap, factor in caps:
        limit = int(cap) * factor
        scale = f" x sequence parallel {factor}" if factor > 1 else ""
        report.add(
            "token cap",
            limit >= longest,
            f"{int(cap):,}{scale} {'>=' if limit >= longest else '<'} longest sequence {longest:,} "
            f"(rollout.prompt_length {aro.rollout.prompt_length:,} + response_length {aro.rollout.response_length:,})",
            key.split(" ")[0],
        )


def size_step(agent_loop: str, cfg: AgentConfig, files: list[DatasetFile], trajectories: int) -> StepSize | None:
    """Rows and budget-bound tokens of ``trajectories`` trajectories over documents of ``files``'
    lengths (:func:`infmem_verl.cost.budget_trajectory`: every chunk read, every call at its budget)."""
    lengths = [t for f in files for t in f.num_tokens]
    if not lengths or len(lengths) < sum(f.rows for f in files):
        return None
    agent = "infmem" if agent_loop == "infmem_agent" else "memagent"
    expected = budget_trajectory(cfg, agent, math.ceil(sum(lengths) / len(lengths)))
    worst = budget_trajectory(cfg, agent, max(lengths))
    return StepSize(
        trajectories=trajectories,
        rows_expected=trajectories * len(expected),
        rows_worst=trajectories * len(worst),
        tokens_expected=trajectories * sum(prompt + response for prompt, response, _, _ in expected),
        tokens_worst=trajectories * sum(prompt + response for prompt, response, _, _ in worst),
        longest_document=max(lengths),
    )


def check_storage(config: DictConfig, report: Preflight) -> None:
    """TransferQueue's SimpleStorage must hold a step's rows, its prompts, and a validation pass
    (verl validates before it clears the step's rows)."""
    storage = OmegaConf.select(config, STORAGE_KEY)
    if storage is None or storage.get("total_storage_size") is None or report.train is None:
        return
    units = int(storage.get("num_data_storage_units", 1))
    prompts = int(config.data.train_batch_size)
    rows = report.train.rows_worst + prompts + (report.val.rows_worst + report.val.trajectories if report.val else 0)
    # Rows are routed to units by index modulo the unit count, and each unit holds ceil(total / units).
    per_unit = math.ceil(int(storage.total_storage_size) / units)
    needed = math.ceil(rows / units) + 1
    report.add(
        "TransferQueue capacity",
        per_unit >= needed,
        f"{int(storage.total_storage_size):,} rows over {units} unit(s) "
        f"{'>=' if per_unit >= needed else '<'} {rows:,} worst-case rows (train step + prompts + validation)"
        + ("" if per_unit >= needed else f"; raise total_storage_size to at least {needed * units:,}"),
        f"{STORAGE_KEY}.total_storage_size",
    )


def check_algorithm(config: DictConfig, report: Preflight) -> None:
    """What verl would run but not as the multi-sequence trajectories need."""
    estimator = str(config.algorithm.adv_estimator)
    report.add(
        "advantage estimator",
        estimator in TRAJECTORY_ESTIMATORS,
        f"{estimator!r}"
        + (
            " (per trajectory, broadcast to its sequences)"
            if estimator in TRAJECTORY_ESTIMATORS
            else f": verl 0.9.1's v1 trainer applies it to every LLM call as its own sample; supported: "
            f"{list(TRAJECTORY_ESTIMATORS)}"
        ),
        "algorithm.adv_estimator",
    )
    reward_model = bool(config.reward.reward_model.enable)
    report.add(
        "reward model",
        not reward_model,
        "disabled (rule-based reward manager)"
        if not reward_model
        else "true: verl scores a reward model on the final sequence only, without the turn facts the "
        "infmem reward manager reads; set it to false",
        "reward.reward_model.enable",
    )

def tracked_step(run_folder: str | os.PathLike) -> int | None:
    """The step verl's tracker file in ``run_folder`` names (None: no tracker, a first run).

    ValueError when the tracker holds no step number (verl writes it with a plain open and write,
    so a kill in between leaves it empty) or names a step whose folder is gone.
    """
    tracker = os.path.join(os.fspath(run_folder), TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8", errors="replace") as handle:
        text = handle.read().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected the number of the latest saved step, got {text!r} (a save cut short?)")
    folder = os.path.join(os.fspath(run_folder), f"global_step_{int(text)}")
    if not os.path.isdir(folder):
        raise ValueError(f"{tracker} names step {text}, but {folder} does not exist (deleted?)")
    return int(text)


def check_resume(config: DictConfig, report: Preflight) -> None:
    """An automatic resume verl would stop on (a cut tracker file) or turn into a silent start
    from step 0 (the step the tracker names is gone): a week of training is not lost quietly."""
    trainer = config.trainer
    if str(trainer.get("resume_mode", "disable")) != "auto" or trainer.get("default_local_dir") is None:
        return
    try:
        step = tracked_step(trainer.default_local_dir)
    except ValueError as err:
        fix = "write the step of the last complete global_step_N folder into it, or pass trainer.resume_mode=disable to start over"
        report.add("resume", False, f"{err}; {fix}", "trainer.resume_mode")
        return
    if step is not None:
        report.add("resume", True, f"from step {step} in {trainer.default_local_dir}")


def preflight(
    config: DictConfig, cfg: AgentConfig, agent_loop: str, required: list[str], use_reference: bool
) -> tuple[Preflight, list[str]]:
    """Every check of this module on ``config`` (lengths already derived); returns the report and
    the dataset files that do not exist (a dry run may size a recipe without its data)."""
    report = Preflight()
    missing = check_datasets(config, required, agent_loop, report)
    rollout = config.actor_rollout_ref.rollout
    report.longest_sequence = int(rollout.prompt_length) + int(rollout.response_length)
    check_token_caps(config, report.longest_sequence, use_reference, report)
    by_key = {key: [f for f in report.files if f.key == key] for key in DATA_KEYS}
    report.train = size_step(agent_loop, cfg, by_key["data.train_files"], int(config.data.train_batch_size) * int(rollout.n))
    val_samples = sum(f.rows for f in by_key["data.val_files"])
    limit = OmegaConf.select(config, "data.val_max_samples", default=None)
    if limit is not None and int(limit) > 0:
        val_samples = min(val_samples, int(limit))
    report.val = size_step(agent_loop, cfg, by_key["data.val_files"], val_samples * int(rollout.val_kwargs.n))
    report.optimizer_steps = train_settings(config).optimizer_steps_per_rl_step
    check_storage(config, report)
    check_algorithm(config, report)
    check_resume(config, report)
    return report, missing
