"""Hydra entry point: verl's PPO trainer with InfMem / MemAgent agent loops and reward.

    python -m infmem_verl.main +recipe=smoke                   # CPU or GPU, builds its own inputs
    python -m infmem_verl.main +recipe=infmem_4b [key=value ...]
    python -m infmem_verl.main +recipe=infmem_4b dry_run=true  # compose + validate, start nothing
    python -m infmem_verl.main --help                          # the recipes and the common overrides

The config is verl's ``ppo_trainer`` composed with the top-level ``conf/`` (groups ``agent``,
``reward_fn``, ``recipe``). Before any worker starts, :func:`prepare_config` checks what verl
would only discover inside a Ray actor (or silently ignore): the agent-loop name, reward manager,
reward components and trainer mode are registered/importable, the agent budgets are valid (and
size ``rollout.prompt_length`` / ``response_length``), and the dataset files have the columns the
agent loops read. Then verl's own ``validate_config`` runs, and (unless ``dry_run``) verl's
``run_ppo`` with its v1 task runner.

A recipe with ``infmem.bootstrap`` (the smoke recipe) first builds its missing inputs: the tiny
Qwen3 and synthetic data files. ``infmem.backend`` (:mod:`infmem_verl.cpu.backend`) picks stock
verl on GPUs or the CPU backend, and says which; a GPU recipe on a machine without a GPU stops
with the recipe to use instead. Ctrl-C stops every Ray process the run started; so does the death
of one the step waits on (the generation server, an agent-loop worker; with rule-based rewards
verl scores inside the agent-loop workers, so a reward worker's death surfaces only when one is
called), with one line naming it and the checkpoint to resume from
(:mod:`infmem_verl.actor_faults`), exit status 1.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from infmem_verl import conf_dir
from infmem_verl.actor_faults import TrainingStopped, dead_actor, stop_line
from infmem_verl.agent.errors import ConfigError
from infmem_verl.cli import exit_on_input_error, run_hydra
from infmem_verl.cost import apply_cost_levers, dry_run_ledger
from infmem_verl.console import console_mode, silence_known_warnings, take_verbose_flag
from infmem_verl.cpu.backend import (
    VERL_CPU,
    apply_cpu_backend,
    apply_verl_cpu_backend,
    check_cpu_platform,
    select_backend,
    select_cpu_platform,
)
from infmem_verl.cpu.bootstrap import bootstrap_inputs
from infmem_verl.cpu.warmup import WarmupError
from infmem_verl.footprint import dry_run_footprint
from infmem_verl.preflight import Preflight, preflight, resolve_paths
from infmem_verl.ray_start import start_ray_retrying
from infmem_verl.reward.components import load_components
from infmem_verl.settings import (
    agent_settings,
    apply_rollout_lengths,
    cost_settings,
    document_settings,
    train_settings,
)
from infmem_verl.run_record import record_settings


@dataclass
class PreparedRun:
    """What :func:`prepare_config` derived, for the dry-run summary and tests."""

    agent_loop: str
    prompt_length: int
    response_length: int
    reward_components: dict[str, float]
    preflight: Preflight
    missing_files: list[str]
    cost_changes: list[str]

    @property
    def checked_files(self) -> list[str]:
        return [f.path for f in self.preflight.files]


def prepare_config(config: DictConfig) -> PreparedRun:
    """Validate our part of ``config`` and fill derived values (in place); ConfigError names the key.

    Registry names and our settings fail at the first bad one (later checks need them); then every
    :mod:`~infmem_verl.preflight` check runs and all failures are reported together.
    """
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
    from verl.trainer.ppo.utils import need_reference_policy
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from infmem_verl.plugin import register

    register()  # as `import verl` does in every process; here also after a direct import of our modules

    if not config.trainer.use_v1:
        raise ConfigError(
            "trainer.use_v1: expected true (only verl's v1 trainer trains on several sequences per sample)"
        )
    _check_choice("trainer.v1.trainer_mode", config.trainer.v1.trainer_mode, TRAINER_REGISTRY)
    loop = config.actor_rollout_ref.rollout.agent.default_agent_loop
    _check_choice("actor_rollout_ref.rollout.agent.default_agent_loop", loop, _agent_loop_registry)
    manager = config.reward.reward_manager
    if manager.source == "register":
        _check_choice("reward.reward_manager.name", manager.name, REWARD_MANAGER)
    components = load_components(config.infmem.reward.components)
    custom = config.reward.custom_reward_function
    if custom.get("path") and not Path(custom.path).is_file():
        raise ConfigError(f"reward.custom_reward_function.path: file {custom.path!r} not found")
    cfg = agent_settings(config)
    config.infmem.agent.write.prompt_tokens = cfg.write.prompt_tokens
    prompt_length, response_length = apply_rollout_lengths(config, cfg)
    train_settings(config)
    record_settings(config)
    cost_changes = apply_cost_levers(config, cost_settings(config))
    resolve_paths(config)
    report, missing = preflight(config, cfg, loop, required_columns(config), need_reference_policy(config))
    report.raise_on_failure()
    return PreparedRun(
        agent_loop=loop,
        prompt_length=prompt_length,
        response_length=response_length,
        reward_components={c.name: c.weight for c in components},
        preflight=report,
        missing_files=missing,
        cost_changes=cost_changes,
    )


def _check_choice(key: str, value: object, registry: dict) -> None:
    if value not in registry:
        raise ConfigError(f"{key}: {value!r} is not registered; available: {sorted(registry)}")


def required_columns(config: DictConfig) -> list[str]:
    """Dataset columns our agent loops and reward manager read."""
    return [config.data.prompt_key, "reward_model", document_settings(config).ref_key]


def run(config: DictConfig) -> PreparedRun:
    """Prepare, validate with verl, and train (or stop there with ``dry_run=true``)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    verl_cpu_changes = []
    if OmegaConf.select(config, "infmem.backend") == VERL_CPU:  # before anything asks verl for its platform
        if not config.dry_run:
            select_cpu_platform()
        verl_cpu_changes = apply_verl_cpu_backend(config)
    if not config.dry_run:
        for line in bootstrap_inputs(config):
            print(f"[infmem] {line}", flush=True)
    prepared = prepare_config(config)
    for line in prepared.cost_changes:
        print(f"[infmem] {line}", flush=True)
    if prepared.missing_files and not config.dry_run:
        raise ConfigError(
            "data.train_files / data.val_files: not found: "
            f"{prepared.missing_files}; build them as data_prep/README.md shows (python -m data_prep.build ...)"
        )
    backend = select_backend(config, dry_run=config.dry_run)
    if verl_cpu_changes:
        backend = replace(backend, message=f"{backend.message}\n[infmem] set for a CPU: {'; '.join(verl_cpu_changes)}")
    auto_set_device(config)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.dry_run:
        print(prepared.preflight.table())
        print(backend.message)
        if prepared.missing_files:
            print(f"[infmem dry run] not found (not checked): {prepared.missing_files}")
        print(
            f"[infmem dry run] recipe={config.recipe_name} agent_loop={prepared.agent_loop!r} "
            f"prompt_length={prepared.prompt_length} response_length={prepared.response_length} "
            f"reward={prepared.reward_components}"
        )
        sized = prepared.preflight.train
        ledger = dry_run_ledger(config, sized.longest_document) if sized else dry_run_ledger(config)
        train_rows = sum(f.rows for f in prepared.preflight.files if f.key == "data.train_files") or None
        ledger += dry_run_footprint(config, need_reference_policy(config), train_rows)
        print("\n".join(f"[infmem dry run] {line}" for line in ledger))
        return prepared
    print(backend.message, flush=True)
    if backend.name == "cpu":
        apply_cpu_backend(config)
    if backend.name == VERL_CPU:
        check_cpu_platform("infmem.backend")
    with console_mode(config):  # compact console, full output to a log file (-v: everything here)
        train(config)
    return prepared


def train(config: DictConfig) -> None:
    """verl's ``run_ppo`` with its v1 task runner; the Ray session it starts ends with it.

    On Ctrl-C (or any error) every Ray process this call started - task runner, TransferQueue,
    agent-loop and reward workers, generation actor - is stopped; a Ray session the caller
    started is left to the caller. One of those actors dying raises :class:`TrainingStopped`,
    whose message names it (Ray's traceback goes to verl's output).
    """
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

    owns_ray = not ray.is_initialized()
    try:
        # run_ppo starts Ray's node first; a node that timed out starting is started again (ray_start).
        start_ray_retrying(lambda: run_ppo(config, task_runner_class=TaskRunnerV1))
    except KeyboardInterrupt:
        print("[infmem] interrupted: stopping the Ray workers this run started", file=sys.stderr, flush=True)
        raise
    except ray.exceptions.ActorDiedError as err:
        actor = dead_actor(err)
        if actor is None:
            raise
        traceback.print_exc()  # in full where verl's output goes (run.log unless -v)
        raise TrainingStopped(stop_line(actor, Path(config.trainer.default_local_dir))) from None
    finally:
        if owns_ray and ray.is_initialized():
            ray.shutdown()


@hydra.main(config_path=str(conf_dir()), config_name="infmem_trainer", version_base=None)
def main(config: DictConfig) -> None:
    silence_known_warnings()
    with exit_on_input_error("infmem", (WarmupError,)):
        try:
            run(config)
        except TrainingStopped as stopped:  # outside the compact console: the line reaches the terminal
            print(f"[infmem] {stopped}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None


HELP_FLAGS = ("-h", "--help")
# Hydra's own --help (config groups, then verl's whole composed config, ~1,200 lines), one flag away.
FULL_HELP_FLAG = "--help-full"
# The overrides people change most, with what each does (every infmem.* key: docs/configuration.md).
COMMON_OVERRIDES = (
    ("dry_run=true", "compose, validate, print the checks and one step's sizing; start nothing"),
    ("agent=memagent", "the MemAgent loop instead of InfMem (same pipeline)"),
    ("reward_fn=NAME", "reward preset: infmem (default), infmem_f1_gated, infmem_ungated, outcome, outcome_f1"),
    ("data.train_files=P data.val_files=P", "training / validation parquet (python -m data_prep.build)"),
    ("actor_rollout_ref.model.path=DIR", "the model to start from, e.g. an SFT checkpoint's huggingface/ folder"),
    ("trainer.nnodes=N trainer.n_gpus_per_node=G", "cluster shape (the recipes size 1 x 8)"),
    ("trainer.total_training_steps=N", "stop after N RL steps"),
    ("trainer.save_freq=N trainer.resume_mode=auto", "save every N steps; the same command resumes"),
    ("infmem.agent.stop_votes=3", "an ablation: any infmem.* key is one override"),
    ("infmem.backend=auto|cpu|gpu|verl-cpu", "where training runs (auto: GPUs with vLLM when present, else CPU)"),
    ("-v", "verl's and Ray's full output on the console (default: run.log)"),
)


def recipe_summary(path: Path) -> tuple[str, str]:
    """(what, hardware) of a recipe, from the header every recipe opens with: its first comment
    sentence up to a colon, and its ``# Hardware:`` line up to the first aside."""
    comments = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    described = [c for c in comments if c and not c.startswith("@package")]
    what = described[0].split(": ")[0].split(", the ")[0].rstrip(".,") if described else "(no header)"
    hardware = next((c.partition(":")[2].strip() for c in comments if c.startswith("Hardware:")), "not stated")
    for aside in (" - ", ", ", "; ", ". ", " (the "):
        hardware = hardware.split(aside)[0]
    return what, hardware.rstrip(".")


def usage() -> str:
    """Our one-screen help: the recipes, the common overrides, where the full config lives."""
    recipes = sorted((conf_dir() / "recipe").glob("*.yaml"))
    width = max(len(p.stem) for p in recipes)
    lines = [
        "usage: python -m infmem_verl.main +recipe=NAME [key=value ...]",
        "",
        "Train InfMem or MemAgent with verl's GRPO. A recipe is a whole run: model, data, agent, reward,",
        "hardware (conf/recipe/NAME.yaml opens with its purpose and command); overrides change any key.",
        "",
        "recipes:",
        *(f"  {p.stem:<{width}}  {what} [{hardware}]" for p in recipes for what, hardware in [recipe_summary(p)]),
        "",
        "common overrides:",
        *(f"  {key:<46}{meaning}" for key, meaning in COMMON_OVERRIDES),
        "",
        "more:",
        "  every infmem.* key, its default and meaning: docs/configuration.md (python -m infmem_verl.config_reference)",
        "  the composed config of a recipe:  python -m infmem_verl.main +recipe=NAME --cfg job",
        f"  Hydra's help with verl's whole config: python -m infmem_verl.main {FULL_HELP_FLAG}",
        "  SFT warm-up: python -m infmem_verl.sft; evaluation: python -m infmem_verl.eval --help",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if any(arg in HELP_FLAGS for arg in sys.argv[1:]):
        print(usage())
        sys.exit(0)
    sys.argv[1:] = ["--help" if arg == FULL_HELP_FLAG else arg for arg in sys.argv[1:]]
    take_verbose_flag(sys.argv)
    run_hydra(main, "infmem")
