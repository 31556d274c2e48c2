"""Write a real verl FSDP checkpoint on CPU: FSDP2-sharded ranks over Gloo, saved by verl's manager.

    python tests/fsdp_checkpoint.py MODEL_DIR RUN_DIR WORLD_SIZE PORT

What GPU runs write, made on a laptop: the model is sharded with ``fully_shard`` over a Gloo
process group of WORLD_SIZE CPU processes, takes one AdamW step (so the weights are no longer the
initial ones), and verl's own ``FSDPCheckpointManager`` saves it to
``RUN_DIR/global_step_1/actor`` (per-rank DTensor shards, ``fsdp_config.json``, ``huggingface/``)
followed by the tracker file verl's trainer writes. Rank 0 also saves the full, unsharded
float32 weights to ``RUN_DIR/full_state.pt`` for the export test to compare against.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEP = 1


def rank_main(rank: int, world_size: int, model_dir: str, run_dir: str, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:  # verl wraps each decoder layer, then the whole model
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(100, 132).unsqueeze(0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()

    manager = FSDPCheckpointManager(model, optimizer, processing_class=AutoTokenizer.from_pretrained(model_dir))
    manager.save_checkpoint(str(Path(run_dir) / f"global_step_{STEP}" / "actor"), global_step=STEP)
    full = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if rank == 0:
        torch.save(full, Path(run_dir) / "full_state.pt")
        (Path(run_dir) / "latest_checkpointed_iteration.txt").write_text(str(STEP))
    dist.destroy_process_group()


if __name__ == "__main__":
    model_dir, run_dir, world_size, port = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    mp.spawn(rank_main, args=(world_size, model_dir, run_dir, port), nprocs=world_size)
