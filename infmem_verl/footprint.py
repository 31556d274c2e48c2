"""What a run needs beside its GPUs, before it starts: checkpoint disk and host RAM at start-up.

Both follow from the model's size and verl 0.9.1's rules, read from its code:

* **checkpoints** (``FSDPCheckpointManager.save_checkpoint``): per save, the actor's parameters in
  their storage dtype (``actor.fsdp_config.model_dtype``, fp32 by default) and, with
  ``optimizer`` in ``actor.checkpoint.save_contents``, AdamW's two moments in the same dtype;
  ``hf_model`` adds a full fp32 copy. verl keeps ``trainer.max_actor_ckpt_to_keep`` saves: with 2 or
  more it deletes the oldest *before* writing, with 1 it deletes the old one only once the new one is
  complete (two on disk meanwhile), with null it keeps every save (``checkpoint_manager.py``).
* **host RAM at start-up** (``FSDPEngine._build_module``): with tied embeddings every rank loads the
  full model on the CPU in its storage dtype (``use_meta_tensor=not tie_word_embeddings``), else only
  the first rank of each FSDP group does (the others build on the meta device). The reference
  model, a forward-only engine, is then kept on the host whatever ``ref.fsdp_config.param_offload``
  says: FSDP1 wraps it with ``CPUOffload(offload_params=True)``, FSDP2 with a pinned
  ``CPUOffloadPolicy`` (``transformer_impl.py``); each layer is copied to the GPU and cast to the
  compute dtype for its forward. vLLM sleeps at level 2 in the colocated (hybrid) mode the recipes
  use, which frees its weights instead of copying them to the host.

The model's size comes from its ``config.json`` (a local folder, or the Hugging Face cache), built on
the meta device: nothing is downloaded or allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

GB = 1e9
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, one value per parameter each, in the parameter dtype
ADAM_OPTIMIZERS = ("adamw", "adam", "_adamw")


@dataclass(frozen=True)
class ModelSize:
    """Parameters of a model (tied weights counted once) and whether its embeddings are tied."""

    parameters: int
    tied_embeddings: bool


def model_size(model_path: str | None) -> ModelSize | None:
    """The size of the model at ``model_path`` from its config alone, or None when no config is found
    (offline and not in the cache: the sizing says so instead of guessing)."""
    if not model_path:
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())  # shared (tied) tensors are yielded once
    return ModelSize(parameters, bool(getattr(config, "tie_word_embeddings", False)))


def dtype_bytes(name: str) -> int:
    """Bytes per value of a verl precision name (``fp32``, ``bf16``, ``bfloat16`` ...)."""
    from verl.utils.torch_dtypes import PrecisionType

    return PrecisionType.to_dtype(name).itemsize


@dataclass(frozen=True)
class Footprint:
    """The sizes the dry run prints (bytes), and the facts they come from."""

    model: ModelSize
    per_save: int
    saves_on_disk: int | None  # None: every save is kept and the run's length is unknown
    keep: int | None
    ranks_per_node: int
    loaders_per_node: int  # ranks of a node that load the full model on the CPU
    load_bytes: int  # one full copy, as the actor loads it
    held_per_node: int  # what stays on the host after start-up (offloaded shards)
    reference: str  # how verl holds the reference model ("" without one)

    @property
    def checkpoint_disk(self) -> int | None:
        return None if self.saves_on_disk is None else self.saves_on_disk * self.per_save

    @property
    def startup_peak_per_node(self) -> int:
        return self.loaders_per_node * self.load_bytes + self.held_per_node

    def lines(self) -> list[str]:
        m = self.model
        out = []
        if self.saves_on_disk is None:
            out.append(
                f"checkpoints: {self.per_save / GB:,.1f} GB a save, every save kept "
                "(trainer.max_actor_ckpt_to_keep null): set it to bound the disk"
            )
        else:
            kept = "every save" if self.keep is None else f"max_actor_ckpt_to_keep={self.keep}"
            out.append(
                f"checkpoints: {self.per_save / GB:,.1f} GB a save ({m.parameters / 1e9:.2f}B parameters), "
                f"at most {self.saves_on_disk} on disk ({kept}): {self.checkpoint_disk / GB:,.1f} GB in "
                "trainer.default_local_dir"
            )
        why = "tied embeddings: every rank" if m.tied_embeddings else "one rank per FSDP group"
        out.append(
            f"host RAM at start-up, per node: ~{self.startup_peak_per_node / GB:,.0f} GB "
            f"({self.loaders_per_node} of {self.ranks_per_node} ranks load the full model on the CPU, "
            f"{self.load_bytes / GB:,.1f} GB each ({why}); {self.held_per_node / GB:,.1f} GB stays on the host)"
        )
        if self.reference:
            out.append(self.reference)
        return out


def _world(config: DictConfig) -> tuple[int, int]:
    nodes, per_node = int(config.trainer.nnodes), int(config.trainer.n_gpus_per_node)
    return nodes * per_node, per_node


def _loaders_per_node(tied: bool, fsdp_size: int, world: int, per_node: int) -> int:
    if tied:
        return per_node
    group = world if fsdp_size <= 0 else min(fsdp_size, world)
    return max(1, per_node // group)


def run_saves(config: DictConfig, train_rows: int | None) -> int | None:
    """How many checkpoints the run writes (verl saves every ``save_freq`` steps and at the last one),
    or None when its length is unknown (no step count and no training file read)."""
    save_freq = int(config.trainer.save_freq or -1)
    if save_freq <= 0:
        return 0
    steps = config.trainer.get("total_training_steps")
    if steps is None:
        if not train_rows:
            return None
        steps = int(config.trainer.total_epochs) * math.ceil(train_rows / int(config.data.train_batch_size))
    steps = int(steps)
    return steps // save_freq + (1 if steps % save_freq else 0)


def footprint(config: DictConfig, model: ModelSize, use_reference: bool, train_rows: int | None = None) -> Footprint:
    """The checkpoint disk and start-up host RAM of the composed ``config`` for ``model``."""
    from verl.utils.config import omega_conf_to_dataclass

    aro = config.actor_rollout_ref
    actor = omega_conf_to_dataclass(aro.actor.fsdp_config)
    storage = dtype_bytes(actor.model_dtype)
    contents = set(OmegaConf.select(config, "actor_rollout_ref.actor.checkpoint.save_contents", default=["model"]))
    optimizer = str(OmegaConf.select(config, "actor_rollout_ref.actor.optim.optimizer", default="AdamW")).lower()
    per_parameter = storage if "model" in contents else 0
    if "optimizer" in contents:
        per_parameter += ADAM_MOMENTS * storage if optimizer in ADAM_OPTIMIZERS else storage  # other optimizers: at least one state
    if "hf_model" in contents:
        per_parameter += dtype_bytes("fp32")
    per_save = model.parameters * per_parameter

    keep = config.trainer.get("max_actor_ckpt_to_keep")
    keep = int(keep) if keep else None
    saves = run_saves(config, train_rows)
    if keep is not None:
        bound = 2 if keep == 1 else keep  # with 1, the old save goes only once the new one is complete
        saves = bound if saves is None else min(saves, bound)

    world, per_node = _world(config)
    held = 0
    if actor.param_offload:
        held += model.parameters * storage * per_node // world
    if actor.optimizer_offload:
        held += ADAM_MOMENTS * model.parameters * storage * per_node // world
    reference = ""
    if use_reference:
        ref = omega_conf_to_dataclass(aro.ref.fsdp_config)
        ref_bytes = dtype_bytes(ref.model_dtype)
        shard = model.parameters * ref_bytes // world
        held += shard * per_node
        compute = (ref.mixed_precision or {}).get("param_dtype", "bf16")  # FSDP's MixedPrecision default
        reference = (
            f"reference model: {ref.model_dtype} (ref.fsdp_config.model_dtype), held on the host by verl's "
            f"{ref.strategy} engine whatever ref.fsdp_config.param_offload says ({ref.param_offload} here): "
            f"{shard / GB:,.1f} GB per rank, each layer copied to the GPU and cast to {compute} for its forward"
        )
    return Footprint(
        model=model,
        per_save=per_save,
        saves_on_disk=saves,
        keep=keep,
        ranks_per_node=per_node,
        loaders_per_node=_loaders_per_node(model.tied_embeddings, int(actor.fsdp_size), world, per_node),
        load_bytes=model.parameters * storage,
        held_per_node=held,
        reference=reference,
    )


def dry_run_footprint(config: DictConfig, use_reference: bool, train_rows: int | None = None) -> list[str]:
    """The dry run's lines: :class:`Footprint` of the configured model, or why it is not sized."""
    path = config.actor_rollout_ref.model.get("path")
    model = model_size(path)
    if model is None:
        return [
            f"checkpoints and host RAM not sized: no config.json for actor_rollout_ref.model.path={path!r} "
            "(a local folder, or the Hugging Face cache when offline)"
        ]
    return footprint(config, model, use_reference, train_rows).lines()
