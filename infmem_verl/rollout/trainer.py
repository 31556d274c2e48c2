"""The ``infmem_sync`` trainer mode: verl's sync trainer, sized for multi-sequence trajectories.

Registered with ``verl.trainer.ppo.v1.register_trainer`` and chosen by
``trainer.v1.trainer_mode=infmem_sync`` (the default of conf/infmem_trainer.yaml). It trains
exactly like verl's ``sync`` mode (verl branches on the mode's name, so this class reports
``trainer_mode == "sync"``) and changes three things about training, nothing else:

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

It also reports what verl's row-level metrics cannot (:mod:`infmem_verl.metrics`): every step
logs ``infmem/...`` means over *trajectories* computed from the per-turn facts in TransferQueue
(reward and components, accuracy, reading, stopping, retrieval, protocol error rates per turn
kind, memory, calls and tokens), the clip fraction, the rollout/trainer log-prob gap and the step
time; validation adds ``val-infmem/...`` from the same per-trajectory values (the reward manager
puts them in ``reward_extra_info``; the validation before training is recorded at the step
training starts from). Each step is appended to the run's records
(:mod:`infmem_verl.run_record`, next to the TensorBoard events, flushed per step so a killed run
keeps them), and the run summary plot is drawn when training ends. verl's checkpointing is used
as is (``trainer.save_freq``, ``trainer.resume_mode``).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence

import torch
import transfer_queue as tq
from tensordict import TensorDict
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from infmem_verl.metrics import PREFIX, log_prob_gap, numeric, summarize, trajectory_values
from infmem_verl.reward.components import TrajectoryRecord, breaks_protocol
from infmem_verl.rollout.facts import TurnFacts
from infmem_verl.rollout.settings import TrainSettings, train_settings
from infmem_verl.run_record import RunRecord, record_settings, records_dir

# verl's step metrics repeated under infmem/, so one TensorBoard section holds a run's story.
VERL_ALIASES = {"actor/pg_clipfrac": "clip_fraction", "timing_s/step": "step_time_s"}
# What log_prob_gap reads, in its argument order.
LOG_PROB_FIELDS = ("old_log_probs", "rollout_log_probs", "response_mask")


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


def trajectory_rows(
    keys: Sequence[str],
    extra_fields: Sequence[dict],
    scores: Sequence[float],
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
    with_turns: bool = False,
) -> list[dict]:
    """One record per trajectory of a batch's sequences (aligned lists, padding rows excluded).

    Each record holds the trajectory's ``key`` (``{uid}_{session}``) and its ``values`` (the final
    sequence's ``reward_extra_info``, then :func:`~infmem_verl.metrics.trajectory_values` of its
    turns in order, and ``reward``, the final sequence's score). The values are computed here from
    the turn facts rather than taken from ``reward_extra_info``, so they do not depend on which
    reward manager ran. ``with_turns`` adds ``turns`` (facts without the memory text, with token
    counts), for the per-trajectory records.
    """
    sessions: dict[str, list[int]] = defaultdict(list)
    for row, key in enumerate(keys):
        sessions[session_of(key)].append(row)
    records = []
    for session, rows in sessions.items():
        rows.sort(key=lambda r: int(keys[r].rsplit("_", 1)[1]))
        facts = [TurnFacts.from_dict(extra_fields[r], f"sequence {keys[r]}") for r in rows]
        prompts = [int(prompt_lengths[r]) for r in rows]
        responses = [int(response_lengths[r]) for r in rows]
        final = rows[-1]
        values = numeric(extra_fields[final].get("reward_extra_info", {}))
        values.update(trajectory_values(TrajectoryRecord(facts, golds=[]), prompts, responses))
        values["reward"] = float(scores[final])
        record = {"key": session, "values": values}
        if with_turns:
            record["turns"] = [
                {**f.to_dict(), "memory_text": None, "prompt_tokens": p, "response_tokens": n}
                for f, p, n in zip(facts, prompts, responses, strict=True)
            ]
        records.append(record)
    return records


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
    """verl's sync trainer with the three training changes of the module docstring, plus its
    per-trajectory metrics and the run's records."""

    def __init__(self, config):
        self.infmem_train = train_settings(config)
        self.record_trajectories = record_settings(config).trajectories
        self.run_record = RunRecord(records_dir(config))
        self._training = False  # set when verl's training loop starts (after val_before_train)
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

    # ------------------------------------------------------------------------------ metrics

    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch) -> None:
        """verl's metrics, then ours per trajectory; the step is appended to the run's records."""
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        trajectories, gap = self._read_step(batch)
        metrics.update(summarize([t["values"] for t in trajectories]))
        metrics.update(gap)
        metrics.update({f"{PREFIX}/{alias}": metrics[name] for name, alias in VERL_ALIASES.items() if name in metrics})
        self.run_record.log_step(global_steps, metrics)
        if self.record_trajectories:
            self.run_record.log_trajectories(global_steps, trajectories)

    def _read_step(self, batch) -> tuple[list[dict], dict[str, float]]:
        """One TransferQueue read of the batch's real (non-padding) sequences: their
        :func:`trajectory_rows`, and the :func:`~infmem_verl.metrics.log_prob_gap` of the trainer's
        old log-probs and the rollout's (when the rollout returned log-probs). Token counts come
        from the tags verl's agent loop wrote, not from the token tensors."""
        real = [(key, tag) for key, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding", False)]
        keys, tags = [key for key, _ in real], [tag for _, tag in real]
        with_gap = self.config.actor_rollout_ref.rollout.calculate_log_probs
        fields = ["extra_fields", "rm_scores"] + (list(LOG_PROB_FIELDS) if with_gap else [])
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields)
        scores = [float(row.sum()) for row in data["rm_scores"].unbind()]
        # TransferQueue returns a non-tensor column as a list-like whose type depends on its backend.
        trajectories = trajectory_rows(
            keys,
            list(data["extra_fields"]),
            scores,
            [tag["prompt_len"] for tag in tags],
            [tag["response_len"] for tag in tags],
            with_turns=self.record_trajectories,
        )
        if not with_gap:
            return trajectories, {}
        padded = data.select(*LOG_PROB_FIELDS).to_padded_tensor()
        return trajectories, log_prob_gap(*(padded[name] for name in LOG_PROB_FIELDS))

    def _val_metrics_update(self, data_sources, sample_uids, reward_extra_infos_dict, sample_turns, **kwargs):
        """verl's validation metrics plus ``val-infmem/...``: the same per-trajectory summary as training.

        verl keeps the final sequence of each trajectory, whose ``reward_extra_info`` holds the
        trajectory's values (the ``infmem`` reward manager puts them there).
        """
        metrics = super()._val_metrics_update(data_sources, sample_uids, reward_extra_infos_dict, sample_turns, **kwargs)
        rows = [{name: values[i] for name, values in reward_extra_infos_dict.items()} for i in range(len(sample_uids))]
        metrics.update(summarize(rows, prefix=f"val-{PREFIX}"))
        return metrics

    def _validate(self) -> dict:
        """verl's validation. The one before training (``trainer.val_before_train``) verl logs but
        never passes to ``_compute_metrics``: it is recorded here, at the step training starts from."""
        metrics = super()._validate()
        if not self._training:
            self.run_record.log_step(self.global_steps, metrics)
        return metrics

    # ------------------------------------------------------------- records and run summary

    def on_train_begin(self) -> None:
        super().on_train_begin()
        self._training = True

    def on_step_begin(self) -> None:
        super().on_step_begin()
        # verl's TensorBoard writer flushes every two minutes; flushing here puts the previous
        # step's events on disk before the next one can be interrupted.
        tensorboard = self.logger.logger.get("tensorboard")  # fit made self.logger before the first step
        if tensorboard is not None:
            tensorboard.writer.flush()

    def fit(self, agent_loop_manager) -> None:
        """verl's training loop; then (also when it fails) the loggers are flushed and the run
        summary is drawn from the run's records."""
        try:
            super().fit(agent_loop_manager)
        finally:
            tracking = getattr(self, "logger", None)
            if tracking is not None:
                tracking.finish()
            self._plot_summary()

    def _plot_summary(self) -> None:
        """Draw the run summary; a plotting failure is reported, never allowed to fail the run."""
        from infmem_verl.cpu.warmup import warmup_report

        trainer = self.config.trainer
        warmup = warmup_report(self.config.actor_rollout_ref.model.path)
        try:
            path = self.run_record.plot(
                title=f"{trainer.project_name} / {trainer.experiment_name}",
                components=list(self.config.infmem.reward.components),
                sft_losses=warmup.sft_losses if warmup else (),
            )
        except Exception:
            logging.getLogger(__name__).exception(
                "run summary plot failed; the run's records are in %s", self.run_record.directory
            )
            return
        if path is not None:
            print(f"[infmem] run summary: {path.resolve()}", flush=True)
