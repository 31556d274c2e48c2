"""The two verl surfaces the CPU backend stands in for: the actor worker group and the weight sync.

verl's trainer drives training through worker groups (``actor_rollout_wg``, ``ref_policy_wg``):
it hands them a ``KVBatchMeta`` (keys of sequences in TransferQueue plus ``extra_info``), the
workers read the fields they need from TransferQueue, write their outputs back and return the
meta (log-prob passes) or a ``metrics`` TensorDict (the update). :class:`CPUActorRolloutRef`
keeps that contract over the single-process :class:`~infmem_verl.cpu.engine.TorchEngine` and a
frozen reference model, so verl's ``_compute_old_log_prob``, ``_compute_ref_log_prob``,
``_update_actor`` and ``_balance_batch`` run unchanged, and so do ``_save_checkpoint`` and
``_load_checkpoint``: the worker writes and reads the engine's state in verl's FSDP checkpoint
layout (:mod:`.checkpoint`).

verl's sync trainer moves weights with a checkpoint manager (``update_weights`` after each step,
``sleep_replicas`` before training). :class:`WeightSync` does the same for the generation actor:
after every update the actor serves the engine's new weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import ray
import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.utils import tensordict_utils as tu

from infmem_verl.cpu.checkpoint import load_checkpoint, save_checkpoint
from infmem_verl.cpu.engine import (
    LOSS_FIELDS,
    TokenScores,
    TorchEngine,
    group_metrics,
    score_rows,
    sequence_scores,
    unbind_rows,
)
from infmem_verl.cpu.server import weights_digest

TOKEN_FIELDS = ("prompts", "responses")


def sequence_outputs(rows: list[dict[str, torch.Tensor]], scores: list[TokenScores]) -> TensorDict:
    """Scores laid out over each whole sequence as nested tensors, what verl's workers store.

    verl's trainer reads them back with ``response_from_nested`` (position ``t`` scores token
    ``t + 1``), the same layout the GPU engines produce.
    """
    per_row = [sequence_scores(s, len(r["prompts"])) for r, s in zip(rows, scores, strict=True)]
    nested = {key: torch.nested.as_nested_tensor([o[key] for o in per_row], layout=torch.jagged) for key in per_row[0]}
    return TensorDict(nested, batch_size=len(rows))


class CPUActorRolloutRef:
    """verl's ``ActorRolloutRefWorker`` group surface (actor and reference) on one CPU process.

    ``_dispatch_info`` is what verl's ``_balance_batch`` reads to learn the data-parallel layout:
    one rank here.
    """

    def __init__(self, engine: TorchEngine, reference: torch.nn.Module | None, tokenizer):
        self.engine = engine
        self.reference = reference
        self.tokenizer = tokenizer  # saved with every checkpoint, as verl's workers do
        self._dispatch_info = {"actor": [0]}
        self._saved: list[Path] = []  # this run's checkpoints, oldest first

    def compute_log_prob(self, batch: KVBatchMeta) -> KVBatchMeta:
        """The actor's log-probs (and entropy when asked) of every sequence, into TransferQueue."""
        info = batch.extra_info
        rows = self._rows(batch, TOKEN_FIELDS)
        scores = self.engine.score(rows, info["temperature"], bool(info.get("calculate_entropy", False)))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=sequence_outputs(rows, scores))

    def compute_ref_log_prob(self, batch: KVBatchMeta) -> KVBatchMeta:
        """The frozen reference model's log-probs of every sequence, into TransferQueue."""
        if self.reference is None:
            raise RuntimeError("compute_ref_log_prob: no reference model (actor.use_kl_loss is false)")
        rows = self._rows(batch, TOKEN_FIELDS)
        scores = score_rows(self.reference, rows, batch.extra_info["temperature"], entropy=False)
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=sequence_outputs(rows, scores))

    def update_actor(self, batch: KVBatchMeta) -> TensorDict:
        """verl's actor update: ``epochs`` passes over mini-batches of ``mini_batch_size`` rows.

        Mini-batches come from verl's own ``make_iterator`` (its shuffling and seed); the
        learning-rate schedule advances once per call, as in verl's workers. Returns the
        ``metrics`` TensorDict verl's trainer reduces (one value per optimizer step).
        """
        info = batch.extra_info
        fields = list(LOSS_FIELDS) + (["ref_log_prob"] if self.engine.actor.use_kl_loss else [])
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[*TOKEN_FIELDS, *fields])
        mini_batches = tu.make_iterator(
            data,
            mini_batch_size=info["mini_batch_size"],
            epochs=info["epochs"],
            seed=info["seed"],
            dataloader_kwargs=info["dataloader_kwargs"],
        )
        steps = []
        for mini_batch in mini_batches:
            rows = unbind_rows(mini_batch, [*TOKEN_FIELDS, *fields])
            steps.append(self.engine.train_mini_batch(rows, info["temperature"], fields))
        metrics = group_metrics(steps)
        metrics["lr"] = [self.engine.lr_step()]
        metrics["optimizer_steps"] = [len(steps)]
        # verl's trainer expects a model-FLOPs-utilisation figure; it is not measured on CPU.
        metrics["mfu"] = [float("nan")]
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})

    def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> None:
        """verl's worker call: save the engine to ``local_path``; keep the newest ``max_ckpt_to_keep``.

        Like verl's checkpoint manager, an older checkpoint of this run is removed only once the
        new one is complete, and only its actor folder (verl keeps ``data.pt`` beside it).
        ``hdfs_path`` is ignored, as verl's FSDP checkpoint manager ignores it.
        """
        save_checkpoint(self.engine, local_path, self.tokenizer)
        self._saved.append(Path(local_path))
        while max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep:
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False) -> None:
        """verl's worker call on resume: the engine continues from ``local_path`` (weights, optimizer,
        learning-rate schedule, RNG); the trainer then syncs the weights to the generation actor."""
        load_checkpoint(self.engine, local_path)

    @staticmethod
    def _rows(batch: KVBatchMeta, fields) -> list[dict[str, torch.Tensor]]:
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=list(fields))
        return unbind_rows(data, list(fields))


class WeightSync:
    """verl's checkpoint-manager surface for a sync trainer: engine weights -> generation actor.

    ``update_weights`` ships the engine's full state dict through Ray's object store (a tiny
    model is tens of megabytes), waits until the actor serves it and checks the actor's weight
    fingerprint against the engine's; ``last_digest`` is that fingerprint.
    """

    def __init__(self, engine: TorchEngine, server):
        self.engine = engine
        self.server = server
        self.last_digest: int | None = None

    def update_weights(self, global_steps: int | None = None) -> None:
        version = int(global_steps or 0)
        digest = ray.get(self.server.update_weights.remote(ray.put(self.engine.state_dict()), version))
        expected = weights_digest(self.engine.model)
        if digest != expected:
            raise RuntimeError(f"weight sync: the generation actor serves {digest:x}, the engine holds {expected:x}")
        self.last_digest = digest

    def sleep_replicas(self) -> None:
        """Nothing to release: on CPU the generation actor keeps its weights and no KV cache."""
