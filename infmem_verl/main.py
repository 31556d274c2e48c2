"""Hydra entry point: verl's PPO trainer with InfMem / MemAgent agent loops and reward.

    python -m infmem_verl.main +recipe=smoke                   # CPU or GPU, builds its own inputs
    python -m infmem_verl.main +recipe=infmem_4b [key=value ...]
    python -m infmem_verl.main +recipe=infmem_4b dry_run=true  # compose + validate, start nothing

The config is verl's ``ppo_trainer`` composed with ``infmem_verl/conf`` (groups ``agent``,
``reward_fn``, ``recipe``). Before any worker starts, :func:`prepare_config` checks what verl
would only discover inside a Ray actor (or silently ignore): the agent-loop name, reward manager,
reward components and trainer mode are registered/importable, the agent budgets are valid (and
size ``rollout.prompt_length`` / ``response_length``), and the dataset files have the columns the
agent loops read. Then verl's own ``validate_config`` runs, and (unless ``dry_run``) verl's
``run_ppo`` with its v1 task runner.

A recipe with ``infmem.bootstrap`` (the smoke recipe) first builds its missing inputs: the tiny
Qwen3 and synthetic data files. ``infmem.backend`` (:mod:`infmem_verl.cpu.backend`) picks stock
verl on GPUs or the CPU backend, and says which; a GPU recipe on a machine without a GPU stops
with the recipe to use instead. Ctrl-C stops every Ray process the run started.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from infmem_verl.agent.config import ConfigError
from infmem_verl.console import console_mode, silence_known_warnings, take_verbose_flag
from infmem_verl.cpu.backend import apply_cpu_backend, select_backend
from infmem_verl.cpu.bootstrap import bootstrap_inputs
from infmem_verl.reward.components import load_components
from infmem_verl.rollout.settings import (
    agent_settings,
    apply_rollout_lengths,
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
    checked_files: list[str]
    missing_files: list[str]


def prepare_config(config: DictConfig) -> PreparedRun:
    """Validate our part of ``config`` and fill derived values (in place); ConfigError names the key."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    import infmem_verl.plugin  # noqa: F401  (registrations, also done by `import verl`)

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
    checked, missing = check_datasets(config)
    return PreparedRun(
        agent_loop=loop,
        prompt_length=prompt_length,
        response_length=response_length,
        reward_components={c.name: c.weight for c in components},
        checked_files=checked,
        missing_files=missing,
    )


def _check_choice(key: str, value: object, registry: dict) -> None:
    if value not in registry:
        raise ConfigError(f"{key}: {value!r} is not registered; available: {sorted(registry)}")


def required_columns(config: DictConfig) -> list[str]:
    """Dataset columns our agent loops and reward manager read."""
    return [config.data.prompt_key, "reward_model", document_settings(config).ref_key]


def check_datasets(config: DictConfig) -> tuple[list[str], list[str]]:
    """Check the columns of every existing train/val parquet file; returns (checked, missing files).

    A file that lacks a column raises :class:`ConfigError` naming the file, the column and the
    columns it has. A document stored inline (``context`` column) gets a pointer to the packer.
    """
    import pyarrow.parquet as pq

    required = required_columns(config)
    checked, missing = [], []
    for key in ("data.train_files", "data.val_files"):
        files = OmegaConf.select(config, key)
        for file in [files] if isinstance(files, str) else list(files or []):
            path = os.path.expanduser(file)
            if not os.path.isfile(path):
                missing.append(path)
                continue
            columns = pq.read_schema(path).names
            absent = [c for c in required if c not in columns]
            if absent:
                hint = ""
                if "context" in columns:
                    hint = (
                        "; documents must be passed by reference: build the file with `python -m data_prep.build` "
                        "or `python -m infmem_verl.rollout.dataset`"
                    )
                raise ConfigError(f"{key}: {path} lacks column(s) {absent}; it has {columns}{hint}")
            checked.append(path)
    return checked, missing


def run(config: DictConfig) -> PreparedRun:
    """Prepare, validate with verl, and train (or stop there with ``dry_run=true``)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    if not config.dry_run:
        for line in bootstrap_inputs(config):
            print(f"[infmem] {line}", flush=True)
    prepared = prepare_config(config)
    if prepared.missing_files and not config.dry_run:
        raise ConfigError(f"data.train_files / data.val_files: not found: {prepared.missing_files}")
    backend = None if config.dry_run else select_backend(config)
    auto_set_device(config)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    if config.dry_run:
        print(f"[infmem dry run] recipe={config.recipe_name} {prepared}")
        return prepared
    print(backend.message, flush=True)
    if backend.name == "cpu":
        apply_cpu_backend(config)
    with console_mode(config):  # compact console, full output to a log file (-v: everything here)
        train(config)
    return prepared


def train(config: DictConfig) -> None:
    """verl's ``run_ppo`` with its v1 task runner; the Ray session it starts ends with it.

    On Ctrl-C (or any error) every Ray process this call started - task runner, TransferQueue,
    agent-loop and reward workers, generation actor - is stopped; a Ray session the caller
    started is left to the caller.
    """
    import ray
    from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

    owns_ray = not ray.is_initialized()
    try:
        run_ppo(config, task_runner_class=TaskRunnerV1)
    except KeyboardInterrupt:
        print("[infmem] interrupted: stopping the Ray workers this run started", file=sys.stderr, flush=True)
        raise
    finally:
        if owns_ray and ray.is_initialized():
            ray.shutdown()


@hydra.main(config_path="conf", config_name="infmem_trainer", version_base=None)
def main(config: DictConfig) -> None:
    silence_known_warnings()
    run(config)


if __name__ == "__main__":
    take_verbose_flag(sys.argv)
    main()
