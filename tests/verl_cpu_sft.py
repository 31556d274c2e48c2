"""verl's own Ray SFT trainer on 2 gloo ranks through the ``cpu`` platform (verl_plugin/platform.py).

    python tests/verl_cpu_sft.py SFT_PARQUET WORK_DIR STEPS

Run by tests/test_verl_cpu_sft.py. The launch of ``python -m infmem_verl.sft +recipe=sft_smoke
sft.backend=verl-cpu`` (``infmem_verl.sft.launch.run``): ``verl.trainer.sft_trainer_ray.SFTTrainer``
with two ``TrainingWorker`` ranks (verl's FSDP2 engine, each on one logical Ray GPU slot), STEPS
optimizer steps, a checkpoint at the last. Afterwards each rank reports, through Ray's
``__ray_call__`` on the live workers, its AdamW step count, a digest of its all-gathered
parameters (both ranks gather at once: it is a collective) and the dtype its engine computes in.
Writes WORK_DIR/result.json.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

RANKS = 2


def rank_state(worker) -> dict:
    """What one TrainingWorker rank holds: optimizer steps taken, digest of the full parameters."""
    import torch
    from torch.distributed.tensor import DTensor

    engine = worker.engine
    steps = {int(state["step"]) for state in engine.optimizer.state.values()}
    digest = hashlib.sha256()
    for name, param in sorted(engine.module.named_parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        digest.update(name.encode())
        digest.update(full.detach().to(torch.float32).contiguous().numpy().tobytes())
    # The dtype verl's engine computes in (its FSDP param dtype, which also decides its autocast).
    compute = str(engine._autocast_dtype).removeprefix("torch.")
    return {"optimizer_steps": sorted(steps), "params_sha256": digest.hexdigest(), "compute_dtype": compute}


def main(parquet: Path, work: Path, steps: int) -> None:
    from hydra import compose, initialize_config_dir

    from infmem_verl import conf_dir
    from infmem_verl.sft.launch import run

    with initialize_config_dir(str(conf_dir() / "sft"), version_base=None):
        config = compose(
            "sft_trainer",
            overrides=[
                "+recipe=sft_smoke",
                "sft.backend=verl-cpu",
                f"data.train_files={parquet}",
                "data.micro_batch_size_per_gpu=1",  # full-vocabulary logits of 8K tokens are ~5 GB a rank
                f"trainer.n_gpus_per_node={RANKS}",
                f"trainer.total_training_steps={steps}",
                f"trainer.save_freq={steps}",
                f"trainer.default_local_dir={work / 'checkpoints'}",
            ],
        )
    import ray

    started = time.monotonic()
    try:
        trainer = run(config)  # python -m infmem_verl.sft's own path, Ray left running
        ranks = ray.get([worker.__ray_call__.remote(rank_state) for worker in trainer.training_client.workers])
    finally:
        ray.shutdown()
    result = {"ranks": ranks, "model": str(config.model.path), "seconds": {"total": time.monotonic() - started}}
    (work / "result.json").write_text(json.dumps(result))
    print(json.dumps(result["seconds"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
