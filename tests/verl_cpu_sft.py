"""verl's own Ray SFT trainer on 2 gloo ranks through the ``cpu`` platform (verl_plugin/platform.py).

    python tests/verl_cpu_sft.py SFT_PARQUET WORK_DIR STEPS

Run by tests/test_verl_cpu_sft.py. ``verl.trainer.sft_trainer_ray.SFTTrainer`` with the smoke SFT
recipe: two ``TrainingWorker`` ranks (verl's FSDP2 engine, each on one logical Ray GPU slot),
STEPS optimizer steps, a checkpoint at the last. Afterwards each rank reports, through Ray's
``__ray_call__`` on the live workers, its AdamW step count and a digest of its all-gathered
parameters (both ranks gather at once: it is a collective). Writes WORK_DIR/result.json.
"""

from __future__ import annotations

import hashlib
import json
import os
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
    return {"optimizer_steps": sorted(steps), "params_sha256": digest.hexdigest()}


def main(parquet: Path, work: Path, steps: int) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    from hydra import compose, initialize_config_dir

    from infmem_verl import conf_dir
    from infmem_verl.sft.launch import prepare_sft_config

    with initialize_config_dir(str(conf_dir() / "sft"), version_base=None):
        config = compose(
            "sft_trainer",
            overrides=[
                "+recipe=sft_smoke",
                f"data.train_files={parquet}",
                "data.micro_batch_size_per_gpu=1",  # full-vocabulary logits of 8K tokens are ~5 GB a rank
                f"trainer.n_gpus_per_node={RANKS}",
                "trainer.device=cpu",
                "engine.strategy=fsdp2",
                "+model.override_config.attn_implementation=sdpa",
                f"trainer.total_training_steps={steps}",
                f"trainer.save_freq={steps}",
                f"trainer.default_local_dir={work / 'checkpoints'}",
            ],
        )
    prepare_sft_config(config)  # fills the tiny model's path, checks the data

    import ray
    from verl.trainer.sft_trainer_ray import SFTTrainer

    started = time.monotonic()
    # RayResourcePool bundles {"CPU": 10, "GPU": 1} per rank: logical CPUs, as the RL backends use.
    ray.init(num_cpus=32, num_gpus=RANKS, include_dashboard=False, runtime_env={"env_vars": {"VERL_PLATFORM": "cpu"}})
    try:
        trainer = SFTTrainer(config=config)
        setup_s = time.monotonic() - started
        trainer.fit()
        workers = trainer.training_client.workers
        ranks = ray.get([worker.__ray_call__.remote(rank_state) for worker in workers])
    finally:
        ray.shutdown()
    result = {
        "ranks": ranks,
        "model": str(config.model.path),
        "seconds": {"setup": setup_s, "total": time.monotonic() - started},
    }
    (work / "result.json").write_text(json.dumps(result))
    print(json.dumps(result["seconds"]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
