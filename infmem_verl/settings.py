"""Our part of the trainer config (the ``infmem`` key), read into validated records.

One place turns ``infmem.*`` into records, used by the entry point (before any worker starts),
the agent loops, and the trainer, so all of them agree on defaults and derived values. Errors are
:class:`ConfigError` naming the full config path. No verl import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from omegaconf import DictConfig, OmegaConf

from infmem_verl.agent.config import AgentConfig, agent_config, from_mapping
from infmem_verl.agent.errors import ConfigError

AGENT_KEY = "infmem.agent"
# Headroom of a Write prompt beyond chunk, memory, evidence and question: the chat template,
# the instructions and the section labels.
WRITE_TEMPLATE_TOKENS = 512
S = TypeVar("S")


def _container(node: Any, path: str) -> dict[str, Any]:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)  # type: ignore[return-value]
    if isinstance(node, Mapping):
        return dict(node)
    raise ConfigError(f"{path}: expected a mapping, got {node!r}")


def section(config: Any, path: str, required: bool = True) -> dict[str, Any] | None:
    """The mapping at ``path`` as plain data; when absent, a ConfigError, or None if not ``required``."""
    value = OmegaConf.select(config, path, default=None) if isinstance(config, DictConfig) else None
    if value is None:
        if not required:
            return None
        raise ConfigError(f"{path}: missing; compose the config through infmem_verl.main (conf/infmem_trainer.yaml)")
    return _container(value, path)


def read_settings(cls: type[S], config: Any, path: str, required: bool = True) -> S:
    """``cls`` (a settings dataclass with ``validate(path)``) read from the ``path`` section;
    an absent optional section gives ``cls``'s defaults."""
    return from_mapping(cls, section(config, path, required), path).validate(path)


def agent_settings(config: Any) -> AgentConfig:
    """The validated :class:`AgentConfig` of ``config.infmem.agent``.

    ``write.prompt_tokens: null`` is derived: chunk + memory + evidence + the question budget
    (``data.max_prompt_length``) + template headroom.
    """
    mapping = section(config, AGENT_KEY)
    write = dict(mapping.get("write") or {})
    if write.get("prompt_tokens") is None:
        defaults = AgentConfig()
        question = OmegaConf.select(config, "data.max_prompt_length", default=1024)
        chunk = mapping.get("document", {}).get("chunk_tokens", defaults.document.chunk_tokens)
        memory = mapping.get("memory_tokens", defaults.memory_tokens)
        evidence = mapping.get("retrieval", {}).get("evidence_tokens", defaults.retrieval.evidence_tokens)
        write["prompt_tokens"] = int(chunk + memory + evidence + question + WRITE_TEMPLATE_TOKENS)
        mapping["write"] = write
    try:
        return agent_config(mapping)
    except ConfigError as exc:
        raise ConfigError(f"{AGENT_KEY}.{exc}") from exc


def rollout_lengths(cfg: AgentConfig) -> tuple[int, int]:
    """``(prompt_length, response_length)`` verl's rollout needs for the agent's largest call."""
    return cfg.max_prompt_tokens(), cfg.max_response_tokens()


def apply_rollout_lengths(config: DictConfig, cfg: AgentConfig) -> tuple[int, int]:
    """Fill null ``actor_rollout_ref.rollout.{prompt,response}_length`` from the agent budgets.

    An explicit value must be at least the derived one; otherwise a call could be cut by verl's
    padding, so it is a :class:`ConfigError` naming both numbers.
    """
    rollout = config.actor_rollout_ref.rollout
    needed = dict(zip(("prompt_length", "response_length"), rollout_lengths(cfg), strict=False))
    source = {"prompt_length": "the largest prompt budget", "response_length": "the largest response budget"}
    for key, value in needed.items():
        current = rollout.get(key)
        if current is None:
            rollout[key] = value
        elif not isinstance(current, int) or current < value:
            raise ConfigError(
                f"actor_rollout_ref.rollout.{key}: expected an integer >= {value} ({source[key]} of "
                f"{AGENT_KEY}), got {current!r}; set it to null to derive it"
            )
    return int(rollout.prompt_length), int(rollout.response_length)


@dataclass(frozen=True)
class DocumentSettings:
    """Where the agent loop finds documents: dataset column of the reference, store root, cache."""

    ref_key: str = "document_ref"
    root: str | None = None
    cache_size: int = 8

    def validate(self, path: str) -> "DocumentSettings":
        if not self.ref_key:
            raise ConfigError(f"{path}.ref_key: expected a column name, got {self.ref_key!r}")
        if self.cache_size < 1:
            raise ConfigError(f"{path}.cache_size: expected an integer >= 1, got {self.cache_size!r}")
        return self


def document_settings(config: Any) -> DocumentSettings:
    return read_settings(DocumentSettings, config, "infmem.documents")


@dataclass(frozen=True)
class TrainSettings:
    """How an RL step turns its rows (one per LLM call) into optimizer updates."""

    optimizer_steps_per_rl_step: int = 16
    loss_normalization: Literal["token_mean", "trajectory"] = "token_mean"
    turn_protocol_penalty: float = 0.0
    # A step stops (before any log-prob pass) when more of its trajectories failed in the rollout.
    max_failed_trajectory_rate: float = 0.05

    def validate(self, path: str) -> "TrainSettings":
        if self.optimizer_steps_per_rl_step < 1:
            raise ConfigError(
                f"{path}.optimizer_steps_per_rl_step: expected an integer >= 1, got {self.optimizer_steps_per_rl_step!r}"
            )
        if self.turn_protocol_penalty < 0:
            raise ConfigError(f"{path}.turn_protocol_penalty: expected a number >= 0, got {self.turn_protocol_penalty!r}")
        if not 0 <= self.max_failed_trajectory_rate <= 1:
            raise ConfigError(
                f"{path}.max_failed_trajectory_rate: expected a number in [0, 1], got {self.max_failed_trajectory_rate!r}"
            )
        return self


def train_settings(config: Any) -> TrainSettings:
    return read_settings(TrainSettings, config, "infmem.train")


@dataclass(frozen=True)
class CostSettings:
    """``infmem.cost``: switches that cut what an RL step costs (see :mod:`infmem_verl.cost`).

    ``score_in_agent_loop``: the agent loop scores its trajectory with the reward manager's
    components, so verl skips the remote reward call and its token tensors. ``drop_zero_advantage``:
    rows whose advantage is exactly 0 skip the actor update, the loss normalisation kept (needs no
    KL loss and no entropy bonus). ``skip_reference_at_zero_kl``: with ``kl_loss_coef`` 0 and no KL in
    the reward, the KL loss is switched off, so verl runs no reference pass (the objective is the same).
    """

    score_in_agent_loop: bool = True
    drop_zero_advantage: bool = False
    skip_reference_at_zero_kl: bool = True

    def validate(self, path: str) -> "CostSettings":
        return self  # three booleans, type-checked when read


def cost_settings(config: Any) -> CostSettings:
    return read_settings(CostSettings, config, "infmem.cost", required=False)
