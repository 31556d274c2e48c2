"""The CPU engine's checkpoints, in verl's FSDP checkpoint layout for one process.

verl's ``FSDPCheckpointManager`` writes, for each rank R of a world of size W, into the step's
``actor`` folder: ``model_world_size_W_rank_R.pt`` (the rank's state dict), ``optim_...`` (its
optimizer state), ``extra_state_...`` (learning-rate scheduler and RNG states), and on rank 0 a
``huggingface/`` folder (model config, generation config, tokenizer) and ``fsdp_config.json``.
The CPU engine is one process holding the whole model: the W=1 case, with plain tensors where
FSDP has DTensor shards, which verl's model merger reads as it is. Writing exactly that layout
lets verl's own machinery handle CPU checkpoints unchanged: the trainer's save and resume
(``global_step_N/actor``, ``data.pt``, the tracker file, ``resume_mode``, ``max_actor_ckpt_to_keep``)
and ``python -m infmem_verl.export`` (verl's ``FSDPModelMerger``).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

from infmem_verl.cpu.engine import TorchEngine

WORLD_SIZE = 1
RANK = 0
# verl's FSDPConfig records the FSDP version of the saved model; 0 is verl's fsdp_version() of a
# model that is not wrapped by FSDP at all.
NOT_FSDP = 0


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one actor checkpoint folder, named as verl names them for rank 0 of 1."""

    folder: Path

    def _rank_file(self, kind: str) -> Path:
        return self.folder / f"{kind}_world_size_{WORLD_SIZE}_rank_{RANK}.pt"

    @property
    def model(self) -> Path:
        return self._rank_file("model")

    @property
    def optimizer(self) -> Path:
        return self._rank_file("optim")

    @property
    def extra(self) -> Path:
        return self._rank_file("extra_state")

    @property
    def huggingface(self) -> Path:
        return self.folder / "huggingface"

    @property
    def fsdp_config(self) -> Path:
        return self.folder / "fsdp_config.json"


def save_checkpoint(engine: TorchEngine, folder: str | Path, tokenizer) -> None:
    """Write the engine's weights, optimizer, scheduler and RNG states to ``folder`` (verl's layout).

    The files are written into ``<folder>.partial`` and the folder renamed into place once all of
    them are, so ``folder`` never holds a half-written checkpoint: a full disk, an unwritable
    folder or Ctrl-C during the save leaves the previous checkpoints as they were and raises. The
    caller (verl's trainer) writes the tracker file only after this returns, so a resume loads
    the previous, complete checkpoint.
    """
    final = Path(folder)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an earlier save that did not finish left
    partial.mkdir(parents=True)
    try:
        _write(engine, CheckpointFiles(partial), tokenizer)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if final.exists():  # this step saved again (a run resumed from an earlier step)
        shutil.rmtree(final)
    partial.rename(final)


def _write(engine: TorchEngine, files: CheckpointFiles, tokenizer) -> None:
    torch.save(engine.model.state_dict(), files.model)
    torch.save(engine.optimizer.state_dict(), files.optimizer)
    extra = {"lr_scheduler": engine.lr_scheduler.state_dict(), "rng": BaseCheckpointManager.get_rng_state()}
    torch.save(extra, files.extra)
    engine.model.config.save_pretrained(files.huggingface)
    if engine.model.generation_config is not None:
        engine.model.generation_config.save_pretrained(files.huggingface)
    tokenizer.save_pretrained(files.huggingface)
    files.fsdp_config.write_text(json.dumps({"FSDP_version": NOT_FSDP, "world_size": WORLD_SIZE}, indent=4))


def load_checkpoint(engine: TorchEngine, folder: str | Path) -> None:
    """Restore what :func:`save_checkpoint` wrote into ``engine`` (weights, optimizer, scheduler, RNG).

    A GPU run's checkpoint (FSDP shards of several ranks) is refused with what to do instead.
    """
    files = CheckpointFiles(Path(folder))
    if not files.fsdp_config.is_file():
        raise FileNotFoundError(f"{files.fsdp_config}: not found; expected a checkpoint saved by a run of this trainer")
    world_size = json.loads(files.fsdp_config.read_text()).get("world_size")
    if world_size != WORLD_SIZE:
        raise ValueError(
            f"{files.folder}: a checkpoint of {world_size} FSDP ranks (a GPU run); the CPU backend resumes only its "
            f"own checkpoints. Export it (python -m infmem_verl.export {files.folder} OUT) and start from "
            "actor_rollout_ref.model.path=OUT"
        )
    model = _read(files.model, files.folder, weights_only=True)
    optimizer = _read(files.optimizer, files.folder, weights_only=True)
    extra = _read(files.extra, files.folder, weights_only=False)  # RNG states hold numpy objects
    # Everything is read before anything is restored: a bad file leaves the engine as it was.
    engine.model.load_state_dict(model)
    engine.optimizer.load_state_dict(optimizer)
    engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
    BaseCheckpointManager.load_rng_state(extra["rng"])


def _read(path: Path, folder: Path, weights_only: bool):
    """One file of a checkpoint; a missing or unreadable one (a save cut short by a full disk or
    a kill, a damaged copy) is an error naming it and the way back to an earlier checkpoint."""
    back = (f"the checkpoint {folder} is incomplete or damaged; resume from an earlier one with "
            "trainer.resume_mode=resume_path trainer.resume_from_path=<run folder>/global_step_N")  # fmt: skip
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {back}")
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        first = str(err).splitlines()[0][:120] if str(err) else ""
        raise ValueError(f"{path}: cannot be read ({type(err).__name__}: {first}); {back}") from None
