"""The ``infmem_sync`` trainer mode: verl's sync trainer, sized for multi-sequence trajectories.

Registered with ``verl.trainer.ppo.v1.register_trainer`` and chosen by
``trainer.v1.trainer_mode=infmem_sync`` (the default of conf/infmem_trainer.yaml). It trains
exactly like verl's ``sync`` mode (verl branches on the mode's name, so this class reports
``trainer_mode == "sync"``) and changes three things, nothing else:

* **Optimizer steps per RL step.** verl slices optimizer mini-batches in rows
  (``ppo_mini_batch_size * n``), and every trajectory is about two rows per chunk read, so the
  reference's 16 updates per step would become hundreds. Here an RL step always makes
  ``infmem.train.optimizer_steps_per_rl_step`` updates: the batch is padded (with verl's
  zero-weight padding rows) to a multiple of ``lcm(dp, n) * steps`` and each update takes
  ``rows / steps`` rows.
* **Per-trajectory loss normalization** (``infmem.train.loss_normalization=trajectory``). With
  token-mean aggregation a trajectory weighs as much as its tokens, so long never-stopping
  trajectories dominate the gradient and fight the early-stop reward. Each row's advantage is
  scaled by ``mean trajectory tokens / its trajectory's tokens`` so every trajectory counts equally.
* **Per-turn protocol credit** (``infmem.train.turn_protocol_penalty > 0``). GRPO gives every turn
  the trajectory's advantage; this subtracts the penalty from the advantage of each turn that
  broke the protocol (see :func:`infmem_verl.reward.components.breaks_protocol`), crediting the
  failure to the turn that caused it. Use it with the ``protocol`` reward component's weight at 0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from infmem_verl.reward.components import breaks_protocol
from infmem_verl.rollout.facts import TurnFacts
from infmem_verl.rollout.settings import TrainSettings, train_settings


def session_of(key: str) -> str:
    """The trajectory of a TransferQueue key ``{uid}_{session_id}_{index}``."""
    return key.rsplit("_", 1)[0]


def trajectory_weights(keys: Sequence[str], response_mask: torch.Tensor) -> torch.Tensor:
    """Per-row scale that gives every trajectory the same total token weight.

    ``mean tokens per trajectory / tokens of the row's trajectory``, over trajectories with at least
    one trained token (verl's padding rows have none and keep weight 1; their mask zeroes them).
    """
    tokens: dict[str, float] = defaultdict(float)
    row_tokens = response_mask.sum(dim=1).tolist()
    for key, count in zip(keys, row_tokens, strict=False):
        tokens[session_of(key)] += count
    trained = [t for t in tokens.values() if t > 0]
    mean = sum(trained) / len(trained) if trained else 1.0
    return torch.tensor([mean / tokens[session_of(k)] if tokens[session_of(k)] > 0 else 1.0 for k in keys])


def shape_advantages(
    keys: Sequence[str],
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    facts: Sequence[dict | None],
    settings: TrainSettings,
) -> torch.Tensor:
    """``advantages`` after the optional per-trajectory normalization and per-turn penalty."""
    mask = response_mask.to(advantages.dtype)
    shaped = advantages.clone()
    if settings.loss_normalization == "trajectory":
        shaped = shaped * trajectory_weights(keys, response_mask).to(shaped.dtype).unsqueeze(1)
    if settings.turn_protocol_penalty > 0:
        offending = torch.tensor([f is not None and breaks_protocol(TurnFacts.from_dict(f)) for f in facts])
        shaped = shaped - settings.turn_protocol_penalty * offending.to(shaped.dtype).unsqueeze(1) * mask
    return shaped * mask


@register_trainer("infmem_sync")
class InfMemSyncTrainer(PPOTrainerSync):
    """verl's sync trainer with the three changes of the module docstring."""

    def __init__(self, config):
        self.infmem_train = train_settings(config)
        super().__init__(config)

    # verl keys its sync-vs-async behaviour (replay buffer, dataloader refill, checkpoint resume) on
    # the trainer mode's *name* being "sync"; this mode is sync training, so it answers "sync".
    @property
    def trainer_mode(self) -> str:
        return "sync"

    @trainer_mode.setter
    def trainer_mode(self, registered_name: str) -> None:
        self.registered_mode = registered_name

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        n = self.config.actor_rollout_ref.rollout.n
        multiple = math.lcm(dp_size, n) * self.infmem_train.optimizer_steps_per_rl_step
        if self.use_critic:
            multiple = math.lcm(multiple, self.config.critic.ppo_mini_batch_size * n)
        return multiple

    def _update_actor(self, batch, metrics: dict):
        # verl's update takes ppo_mini_batch_size * n rows per optimizer step; size it for this
        # step's row count (a multiple of lcm(dp, n) * steps after _balance_batch's padding).
        actor = self.config.actor_rollout_ref.actor
        n = self.config.actor_rollout_ref.rollout.n
        steps = self.infmem_train.optimizer_steps_per_rl_step
        configured = actor.ppo_mini_batch_size
        actor.ppo_mini_batch_size = len(batch) // (steps * n)
        try:
            batch = super()._update_actor(batch, metrics)
        finally:
            actor.ppo_mini_batch_size = configured
        metrics["infmem/optimizer_steps"] = steps
        metrics["infmem/rows_per_optimizer_step"] = len(batch) // steps
        return batch

    def _compute_advantage(self, batch, metrics: dict):
        batch = super()._compute_advantage(batch, metrics)
        settings = self.infmem_train
        if settings.loss_normalization == "token_mean" and settings.turn_protocol_penalty == 0:
            return batch
        data = tq.kv_batch_get(
            keys=batch.keys,
            partition_id=batch.partition_id,
            select_fields=["advantages", "response_mask", "extra_fields"],
        )
        facts = data.pop("extra_fields").tolist()
        nested_mask = data["response_mask"]
        padded = data.select("advantages", "response_mask").to_padded_tensor()
        shaped = shape_advantages(batch.keys, padded["advantages"], padded["response_mask"], facts, settings)
        output = TensorDict({"advantages": response_to_nested(shaped, nested_mask)}, batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=output)
