"""The ``infmem_sync`` trainer mode: verl's sync trainer, sized for multi-sequence trajectories.

Registered with ``verl.trainer.ppo.v1.register_trainer`` and chosen by
``trainer.v1.trainer_mode=infmem_sync`` (the default of conf/infmem_trainer.yaml). It trains
exactly like verl's ``sync`` mode (verl branches on the mode's name, so this class reports
``trainer_mode == "sync"``) and changes three things about training, nothing else (a fourth,
optional, below):

* **Optimizer steps per RL step.** verl slices optimizer mini-batches in rows
  (``ppo_mini_batch_size * n``), and every trajectory is about two rows per chunk read, so the
  reference's 16 updates per step would become hundreds. Here an RL step always makes
  ``infmem.train.optimizer_steps_per_rl_step`` updates: the batch is padded (with verl's
  zero-weight padding rows) to a multiple of ``lcm(dp, n) * steps`` and each update takes
  ``rows / steps`` rows. ``infmem/optimizer_steps`` is the count the update made, measured from
  verl's per-mini-batch metrics (one ``grad_norm`` per optimizer step), not the configured one.
* **Per-trajectory loss normalization** (``infmem.train.loss_normalization=trajectory``). With
  token-mean aggregation a trajectory weighs as much as its tokens, so long never-stopping
  trajectories dominate the gradient and fight the early-stop reward. Each row's advantage is
  scaled by ``mean trajectory tokens / its trajectory's tokens`` so every trajectory counts equally.
* **Per-turn protocol credit** (``infmem.train.turn_protocol_penalty > 0``). GRPO gives every turn
  the trajectory's advantage; this subtracts the penalty from the advantage of each turn that
  broke the protocol (see :func:`infmem_verl.reward.components.breaks_protocol`), crediting the
  failure to the turn that caused it. Use it with the ``protocol`` reward component's weight at 0.

With ``infmem.cost.drop_zero_advantage`` it also leaves rows of exactly zero advantage out of the
actor update (:mod:`infmem_verl.cost`): verl pads and balances the kept rows again, their
advantages are scaled so the loss normalisation is the whole batch's, and both are undone after
the update, so metrics and clean-up see the step's whole batch.

It also reports what verl's row-level metrics cannot (:mod:`infmem_verl.metrics`): every step
logs ``infmem/...`` means over *trajectories* computed from the per-turn facts in TransferQueue
(reward and components, accuracy, reading, stopping, retrieval, protocol error rates per turn
kind, memory, calls and tokens), the clip fraction, the rollout/trainer log-prob gap, the step
time and the step's cost ledger (``infmem/cost/...``: the rows each pass was handed, recorded as
verl's trainer calls it); validation adds ``val-infmem/...`` from the same per-trajectory values (the reward manager
puts them in ``reward_extra_info``; the validation before training is recorded at the step
training starts from). Each step is appended to the run's records
(:mod:`infmem_verl.run_record`, next to the TensorBoard events, flushed per step so a killed run
keeps them), and the run summary plot is drawn when training ends. verl's checkpointing is used
as is (``trainer.save_freq``, ``trainer.resume_mode``). Its replay buffer looks for finished
trajectories every :data:`REPLAY_POLL_S` instead of verl's 2 s.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from infmem_verl.cost import (
    COST_PREFIX,
    Call,
    Passes,
    Row,
    check_droppable,
    kept_loss_scale,
    rows_to_train,
    scores_in_agent_loop,
    session_of,
    step_ledger,
    zero_advantage_rows,
)
from infmem_verl.metrics import PREFIX, log_prob_gap, numeric, summarize, trajectory_values
from infmem_verl.reward.components import TrajectoryRecord, breaks_protocol
from infmem_verl.agent.facts import TurnFacts
from infmem_verl.settings import TrainSettings, cost_settings, train_settings
from infmem_verl.run_record import RunRecord, record_settings, records_dir, run_identity

# verl's step metrics repeated under infmem/, so one TensorBoard section holds a run's story.
VERL_ALIASES = {"actor/pg_clipfrac": "clip_fraction", "timing_s/step": "step_time_s"}
# What log_prob_gap reads, in its argument order.
LOG_PROB_FIELDS = ("old_log_probs", "rollout_log_probs", "response_mask")
# How often the replay buffer looks for finished trajectories. verl's 2 s left each rollout and
# validation waiting 1 s on average after its last trajectory (the CPU demo's `timing_s/gen` came
# in 2-second steps: 18.1, 20.1, 22.1 s); one look is a TransferQueue metadata read of under 1 ms.
REPLAY_POLL_S = 0.2


def batch_rows(batch: KVBatchMeta) -> list[Row]:
    """The rows of a batch as the cost ledger counts them, from the tags verl's agent loop (and its
    padding) wrote: prompt and response lengths, padding flag."""
    return [
        Row(key, int(tag["prompt_len"]), int(tag["response_len"]), padding=bool(tag.get("is_padding", False)))
        for key, tag in zip(batch.keys, batch.tags, strict=True)
    ]


def rollout_bypassed(config) -> bool:
    """verl's rollout-correction bypass mode: the rollout's log-probs are the old log-probs, no
    old-log-prob pass (the test verl's ``_compute_old_log_prob`` makes)."""
    rollout_correction = config.algorithm.get("rollout_correction", None)
    return bool(rollout_correction and rollout_correction.get("bypass_mode", False))


def failed_trajectories(keys: Sequence[str], tags: Sequence[dict], expected: int) -> int:
    """Trajectories of a sampled batch that never arrived: ``expected`` (prompts x n) minus the
    trajectories with at least one sequence (a failed session stores none; padding rows don't count)."""
    present = {session_of(key) for key, tag in zip(keys, tags, strict=True) if not tag.get("is_padding", False)}
    return max(0, expected - len(present))


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


@dataclass
class _DroppedRows:
    """The update batch without zero-advantage rows, and the kept rows' unscaled advantages
    (in ``keys`` order; None when they were not scaled) to put back after the update."""

    batch: KVBatchMeta
    keys: list[str]
    advantages: TensorDict | None

    def restore(self) -> None:
        if self.advantages is not None:
            tq.kv_batch_put(keys=self.keys, partition_id=self.batch.partition_id, fields=self.advantages)


class _RecordedUpdate:
    """The actor worker group, keeping the per-mini-batch metrics its ``update_actor`` returns.

    verl's ``_update_actor`` reduces them to means before anything else sees them, so the number
    of optimizer steps an update made is read here: verl's engines record one ``grad_norm`` per
    optimizer step (``verl/workers/engine/base.py: train_batch``), and with several data-parallel
    ranks the worker group returns the first rank's list (FSDP's collectives keep the other ranks
    in step with it).
    """

    def __init__(self, group):
        self.group = group
        self.metrics: dict | None = None

    def update_actor(self, batch):
        output = self.group.update_actor(batch)
        self.metrics = dict(output["metrics"])
        return output

    def optimizer_steps(self) -> int:
        if self.metrics is None or "grad_norm" not in self.metrics:
            raise RuntimeError("actor update: verl's update returned no per-step grad_norm to count optimizer steps by")
        return len(self.metrics["grad_norm"])

    def __getattr__(self, name: str):
        return getattr(self.group, name)


@register_trainer("infmem_sync")
class InfMemSyncTrainer(PPOTrainerSync):
    """verl's sync trainer with the three training changes of the module docstring, plus its
    per-trajectory metrics and the run's records."""

    def __init__(self, config):
        self.infmem_train = train_settings(config)
        self.infmem_cost = cost_settings(config)
        if self.infmem_cost.drop_zero_advantage:
            check_droppable(config.actor_rollout_ref.actor)
        self._passes: dict[str, list[Row]] = {}  # the rows each trainer pass got this step (cost ledger)
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

    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):  # verl's buffers and custom samplers built on them
            buffer.poll_interval = REPLAY_POLL_S
        return buffer

    def _get_required_batch_multiple(self, dp_size: int) -> int:
        n = self.config.actor_rollout_ref.rollout.n
        multiple = math.lcm(dp_size, n) * self.infmem_train.optimizer_steps_per_rl_step
        if self.use_critic:
            multiple = math.lcm(multiple, self.config.critic.ppo_mini_batch_size * n)
        return multiple

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        # The first hook after sampling, before any log-prob pass: a step whose rollouts failed
        # too often stops here instead of training GRPO groups that lost members.
        self._count_failed_trajectories(batch, metrics)
        return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)

    def _count_failed_trajectories(self, batch, metrics: dict) -> None:
        n = int(self.config.actor_rollout_ref.rollout.n)
        expected = int(self.config.data.train_batch_size) // self.parameter_sync_step * n
        failed = failed_trajectories(batch.keys, batch.tags, expected)
        rate = failed / expected
        metrics[f"{PREFIX}/failed_trajectories"] = failed
        metrics[f"{PREFIX}/failed_trajectory_rate"] = rate
        limit = self.infmem_train.max_failed_trajectory_rate
        if rate > limit:
            raise RuntimeError(
                f"step {self.global_steps}: {failed} of {expected} trajectories failed in the rollout ({rate:.1%}), more "
                f"than infmem.train.max_failed_trajectory_rate={limit}; verl would train their GRPO groups with fewer "
                "members. The agent-loop workers' log names each failure; raise the rate to tolerate transient ones."
            )

    def _compute_old_log_prob(self, batch, metrics: dict):
        if not rollout_bypassed(self.config):
            self._passes["old_log_prob"] = batch_rows(batch)
        return super()._compute_old_log_prob(batch, metrics)

    def _compute_ref_log_prob(self, batch, metrics: dict):
        self._passes["reference"] = batch_rows(batch)
        return super()._compute_ref_log_prob(batch, metrics)

    def _update_actor(self, batch, metrics: dict):
        # verl's update takes ppo_mini_batch_size * n rows per optimizer step; size it for this
        # step's row count (a multiple of lcm(dp, n) * steps after _balance_batch's padding).
        actor = self.config.actor_rollout_ref.actor
        n = self.config.actor_rollout_ref.rollout.n
        steps = self.infmem_train.optimizer_steps_per_rl_step
        configured = actor.ppo_mini_batch_size
        dropped = self._drop_zero_advantage(batch, metrics) if self.infmem_cost.drop_zero_advantage else None
        trained = dropped.batch if dropped is not None else batch
        actor.ppo_mini_batch_size = len(trained) // (steps * n)
        recorded = self.actor_rollout_wg = _RecordedUpdate(self.actor_rollout_wg)
        try:
            super()._update_actor(trained, metrics)
        finally:
            self.actor_rollout_wg = recorded.group
            actor.ppo_mini_batch_size = configured
            if dropped is not None:
                dropped.restore()
        self._passes["update"] = batch_rows(trained)
        metrics["infmem/optimizer_steps"] = recorded.optimizer_steps()
        metrics["infmem/rows_per_optimizer_step"] = len(trained) // steps
        return batch  # the whole step's batch: metrics and TransferQueue clean-up cover every row

    def _drop_zero_advantage(self, batch, metrics: dict) -> _DroppedRows | None:
        """The batch without its rows of exactly zero advantage (:func:`~infmem_verl.cost.rows_to_train`),
        balanced over data-parallel ranks by verl, with the kept advantages scaled so the loss
        normalisation is the full batch's (:func:`~infmem_verl.cost.kept_loss_scale`); None when
        every row is trained."""
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages", "response_mask"]
        )
        padded = data.to_padded_tensor()
        zero = zero_advantage_rows(padded["advantages"], padded["response_mask"]).tolist()
        rows = [replace(row, zero_advantage=z) for row, z in zip(batch_rows(batch), zero, strict=True)]
        dp = max(self.actor_rollout_wg._dispatch_info["actor"]) + 1  # cached by verl's _balance_batch
        selected = rows_to_train(rows, self._get_required_batch_multiple(dp))
        metrics[f"{COST_PREFIX}/dropped_rows"] = float(len(rows) - len(selected)) if selected else 0.0
        if selected is None:
            return None
        index = {key: i for i, key in enumerate(batch.keys)}
        keep = [index[row.key] for row in selected]
        tokens = padded["response_mask"].sum(dim=1)
        scale = kept_loss_scale(
            self.config.actor_rollout_ref.actor.loss_agg_mode, int(tokens[keep].sum()), int(tokens.sum())
        )
        keys = [batch.keys[i] for i in keep]
        kept = KVBatchMeta(
            partition_id=batch.partition_id,
            keys=list(keys),
            tags=[batch.tags[i] for i in keep],
            fields=batch.fields,
            extra_info=dict(batch.extra_info),
        )
        original = None
        if scale != 1.0:
            original = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=["advantages", "response_mask"])
            scaled = original.to_padded_tensor()["advantages"] * scale
            fields = TensorDict({"advantages": response_to_nested(scaled, original["response_mask"])}, batch_size=len(keys))
            tq.kv_batch_put(keys=keys, partition_id=batch.partition_id, fields=fields)
            original = original.select("advantages")
        # verl's data-parallel balancing (the row count is already a multiple: nothing is padded)
        return _DroppedRows(super()._balance_batch(kept, metrics={}), keys, original)

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
        trajectories, gap, ledger = self._read_step(batch)
        metrics.update(summarize([t["values"] for t in trajectories]))
        metrics.update(gap)
        metrics.update(ledger)
        metrics.update({f"{PREFIX}/{alias}": metrics[name] for name, alias in VERL_ALIASES.items() if name in metrics})
        self.run_record.log_step(global_steps, metrics)
        if self.record_trajectories:
            self.run_record.log_trajectories(global_steps, trajectories)

    def _read_step(self, batch) -> tuple[list[dict], dict[str, float], dict[str, float]]:
        """One TransferQueue read of the batch's real (non-padding) sequences: their
        :func:`trajectory_rows`, the :func:`~infmem_verl.metrics.log_prob_gap` of the trainer's
        old log-probs and the rollout's (when the rollout returned log-probs and the old-log-prob
        pass ran), and the step's cost ledger (:mod:`infmem_verl.cost`). Token counts come from
        the tags verl's agent loop wrote, not from the token tensors."""
        real = [(key, tag) for key, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding", False)]
        keys, tags = [key for key, _ in real], [tag for _, tag in real]
        log_probs = bool(self.config.actor_rollout_ref.rollout.calculate_log_probs)
        with_gap = log_probs and not rollout_bypassed(self.config)
        fields = ["extra_fields", "rm_scores", "response_mask"] + (list(LOG_PROB_FIELDS[:2]) if with_gap else [])
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id, select_fields=fields)
        scores = [float(row.sum()) for row in data["rm_scores"].unbind()]
        # TransferQueue returns a non-tensor column as a list-like whose type depends on its backend.
        extra_fields = list(data["extra_fields"])
        trajectories = trajectory_rows(
            keys,
            extra_fields,
            scores,
            [tag["prompt_len"] for tag in tags],
            [tag["response_len"] for tag in tags],
            with_turns=self.record_trajectories,
        )
        ledger = self._ledger(batch, keys, extra_fields, data["response_mask"], log_probs)
        if not with_gap:
            return trajectories, {}, ledger
        padded = data.select(*LOG_PROB_FIELDS).to_padded_tensor()
        return trajectories, log_prob_gap(*(padded[name] for name in LOG_PROB_FIELDS)), ledger

    def _ledger(self, batch, keys, extra_fields, response_mask, log_probs: bool) -> dict[str, float]:
        """The step's cost ledger from the rows each pass got (recorded as verl handed them over),
        the real rows' trained tokens (``response_mask``) and their turn facts."""
        loss = dict(zip(keys, (int(row.sum()) for row in response_mask.unbind()), strict=True))
        rows = [
            Row(r.key, r.prompt, r.response, loss_tokens=loss.get(r.key, 0), padding=r.padding)
            for r in batch_rows(batch)
        ]
        calls = {}
        for key, facts in zip(keys, extra_fields, strict=True):
            calls[key] = Call(int(facts.get("llm_calls", 1)), int(facts.get("prefill_tokens", 0)), loss[key])
        passes = Passes(**{name: self._passes.get(name, ()) for name in ("old_log_prob", "reference", "update")})
        self._passes = {}
        remote = not scores_in_agent_loop(self.config)
        return step_ledger(rows, calls, passes, reward_remote=remote, log_probs=log_probs).metrics()

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

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps == 0:  # from the start: an earlier run's records must not merge into this one's
            self.run_record.start_fresh()
            self.run_record.write_identity(run_identity(self.config))

    def fit(self, agent_loop_manager) -> None:
        """verl's training loop; then (also when it fails) the loggers are finished with the run's
        real outcome (W&B records a crashed run as failed: exit code 1) and the run summary is drawn
        from the run's records."""
        succeeded = False
        try:
            super().fit(agent_loop_manager)
            succeeded = True
        finally:
            tracking = getattr(self, "logger", None)
            if tracking is not None:
                tracking.finish(exit_code=0 if succeeded else 1)
            self._plot_summary()

    def _plot_summary(self) -> None:
        """Draw the run summary; a plotting failure is reported, never allowed to fail the run."""
        from infmem_verl.warmup_report import warmup_report

        trainer = self.config.trainer
        try:
            warmup = warmup_report(self.config.actor_rollout_ref.model.path)
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
