"""Export a training checkpoint as a Hugging Face model folder that transformers and vLLM load.

    python -m infmem_verl.export CKPT OUT [--overwrite]

``CKPT`` is any of: a run's checkpoint folder (``trainer.default_local_dir``, holding
``latest_checkpointed_iteration.txt``; its latest step is exported), one ``global_step_N`` folder,
or that step's ``actor`` folder. ``OUT`` receives ``config.json``, ``generation_config.json``, the
weights as safetensors and the tokenizer: ``AutoModelForCausalLM.from_pretrained(OUT)`` and
``vllm serve OUT`` (or ``recipes/serve_vllm.sh OUT``) load it.

Both backends write verl's FSDP checkpoint layout: per-rank ``model_world_size_W_rank_R.pt``
shards, ``fsdp_config.json`` and a ``huggingface/`` folder with the model config and tokenizer.
GPU runs get it from verl's ``FSDPCheckpointManager``; the CPU backend writes the one-process
case of it (plain tensors, world size 1; :mod:`infmem_verl.cpu.engine`). So one path serves
both: verl's own ``FSDPModelMerger`` merges the shards (DTensor or plain) and saves the model,
exactly as ``python -m verl.model_merger merge --backend fsdp`` does, and checks the output is a
complete Hugging Face folder. Like verl's merger, the weights are written in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from infmem_verl.cli import entry_point
from infmem_verl.preflight import TRACKER, tracked_step

FSDP_CONFIG = "fsdp_config.json"
HF_FOLDER = "huggingface"
ACTOR = "actor"
_STEP = re.compile(r"^global_step_(\d+)$")


class ExportError(ValueError):
    """A checkpoint path or output folder that cannot be exported; the message says what was expected."""


@dataclass(frozen=True)
class ActorCheckpoint:
    """The actor folder of one saved step, and what its ``fsdp_config.json`` says."""

    path: Path
    global_step: int | None  # None when the folder is not under a global_step_N folder
    world_size: int


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_checkpoint` read and wrote."""

    checkpoint: ActorCheckpoint
    out: Path


def _expected(path: Path) -> str:
    return (
        f"{path}: expected a verl checkpoint - a run folder with {TRACKER} (trainer.default_local_dir), "
        f"a global_step_N folder, or its {ACTOR}/ folder with {FSDP_CONFIG}"
    )


def find_actor_checkpoint(path: str | Path) -> ActorCheckpoint:
    """Resolve ``path`` (run folder, ``global_step_N`` or ``actor`` folder) to the actor checkpoint."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ExportError(f"{path}: no such file or folder")
    if not path.is_dir():
        raise ExportError(_expected(path))
    try:
        step = tracked_step(path)
    except ValueError as err:
        raise ExportError(str(err)) from None
    if step is not None:
        path = path / f"global_step_{step}"
    if _STEP.match(path.name) and (path / ACTOR).is_dir():
        path = path / ACTOR
    return _read_actor(path)


def _read_actor(path: Path) -> ActorCheckpoint:
    config_file = path / FSDP_CONFIG
    if not config_file.is_file():
        if (path / "dist_ckpt").is_dir() or (path / "model" / "dist_ckpt").is_dir():
            raise ExportError(
                f"{path}: a Megatron checkpoint; export it with "
                f"`python -m verl.model_merger merge --backend megatron --local_dir {path} --target_dir OUT`"
            )
        raise ExportError(_expected(path))
    try:
        world_size = json.loads(config_file.read_text())["world_size"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ExportError(f"{config_file}: expected JSON with an integer 'world_size' ({error})") from error
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ExportError(f"{config_file}: world_size: expected an integer >= 1, got {world_size!r}")
    missing = [f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
    missing = [name for name in missing if not (path / name).is_file()]
    if missing:
        raise ExportError(f"{path}: model shards missing for world size {world_size}: {missing}")
    if not (path / HF_FOLDER / "config.json").is_file():
        raise ExportError(f"{path / HF_FOLDER}: expected the model config (config.json) saved with the checkpoint")
    step = _STEP.match(path.parent.name)
    return ActorCheckpoint(path=path, global_step=int(step.group(1)) if step else None, world_size=world_size)


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"OUT {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"OUT {out}: folder is not empty; pass --overwrite to write into it")
    out.mkdir(parents=True, exist_ok=True)


def export_checkpoint(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> ExportResult:
    """Merge the actor checkpoint found at ``checkpoint`` into a Hugging Face folder ``out``.

    Raises :class:`ExportError` for a path that is not an FSDP-layout checkpoint, a checkpoint
    with missing shards or config, and a non-empty ``out`` without ``overwrite``.
    """
    actor = find_actor_checkpoint(checkpoint)
    out = Path(out).expanduser()
    _prepare_out(out, overwrite)
    # verl is imported only now: a wrong path is reported without its seconds of imports.
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(actor.path),
        target_dir=str(out),
        hf_model_config_path=str(actor.path / HF_FOLDER),
    )
    merger = FSDPModelMerger(config)
    merger.merge_and_save()
    merger.cleanup()
    return ExportResult(checkpoint=actor, out=out)


@entry_point("export", (ExportError,))
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infmem_verl.export",
        description="Write a Hugging Face model folder (transformers, vLLM) from a verl checkpoint of either backend.",
    )
    parser.add_argument("checkpoint", type=Path, help=f"run folder ({TRACKER}), global_step_N or its actor/ folder")
    parser.add_argument("out", type=Path, help="output folder (created; must be empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty OUT")
    args = parser.parse_args(argv)
    result = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    step = "" if result.checkpoint.global_step is None else f" (step {result.checkpoint.global_step})"
    print(f"[infmem export] {result.checkpoint.path}{step} -> {result.out} (bfloat16; load with transformers or vLLM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
