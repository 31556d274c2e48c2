"""RL steps of InfMem on verl's own workers on a CPU: verl's ``ActorRolloutRefWorker`` (FSDP2) on
2 gloo ranks, two hybrid vLLM replicas on vLLM's CPU build, verl's weight sync after each update.

    VERL_PLATFORM=cpu PYTHONPATH=. .venv-vllm/bin/python tests/verl_cpu_rl.py WORK_DIR [STEPS] [OVERRIDES ...]

Not in the suite (no test calls it yet): two steps took 6 min 18 s from start to exit on 2 shared
cores (steps of 141 and 128 s, ~100 s of them verl's FSDP update), one step 4 min 5 s on quiet
cores, over or at the suite's budget of 5 minutes for one launch once other tests share the cores
(docs/experiments/2026-12-03-verl-cpu.md, "2026-12-03 evening", has the figures). It is the
launch a suite test of issue 28 would make; each step line reports the measured optimizer-step
count (``infmem/optimizer_steps``), the sync time and the rollout-vs-trainer gap, also written
to WORK_DIR/records/steps.jsonl.

The path is a GPU run's, through verl's hooks only: ``infmem_verl.main.run`` on ``+recipe=smoke``
with ``infmem.backend=gpu`` and two ranks, on the ``cpu`` platform (ranks are the two logical Ray
GPU slots ``ray.init(num_gpus=2)`` creates; verl_plugin/platform.py), trainer mode ``infmem_sync``,
our agent loop and reward manager. What differs from a GPU run, and why:

* the model is the tiny Qwen3 over the 4,096-token small vocabulary (hidden 64, 2 layers): with
  Qwen3's 151,936 tokens the logits of every position dominate the cost;
* no KL loss (``actor.use_kl_loss=false``): verl pins a forward-only FSDP2 model's host memory,
  which needs an accelerator, so the reference model cannot run on CPU;
* sdpa attention and no padding removal (flash-attention is CUDA-only);
* the rollout in float32, eager, without sleep mode (vLLM's CPU build has no sleep mode);
* ``use_torch_compile=false`` for actor and reference: verl compiles its log-prob/entropy
  functions by default, and inductor's C++ compile on CPU cost ~25 s of old-log-prob time and
  ~20 s of update time in the first step (measured 47 -> 21 s and 117 -> 99 s);
* 4,000-token documents (``infmem.bootstrap.doc_tokens``) written to WORK_DIR, checkpoints and
  records there too.
OVERRIDES are appended (Hydra syntax).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROLLOUT = "actor_rollout_ref.rollout"


def overrides(work: Path, model: Path, steps: int) -> list[str]:
    """The overrides of the module docstring, for ``steps`` RL steps."""
    actor = "actor_rollout_ref"
    return [
        "+recipe=smoke",
        "infmem.backend=gpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=2",
        f"{actor}.model.path={model}",
        f"data.train_files={work}/train.parquet",
        f"data.val_files={work}/val.parquet",
        "infmem.bootstrap.doc_tokens=4000",
        f"infmem.records.dir={work}/records",
        f"trainer.default_local_dir={work}/checkpoints",
        f"{actor}.actor.use_kl_loss=false",
        f"{actor}.model.use_remove_padding=false",
        f"+{actor}.model.override_config.attn_implementation=sdpa",
        f"{actor}.actor.use_torch_compile=false",
        f"{actor}.ref.use_torch_compile=false",
        f"{ROLLOUT}.dtype=float32",
        f"{ROLLOUT}.enforce_eager=true",
        f"{ROLLOUT}.free_cache_engine=false",
        f"+{ROLLOUT}.enable_sleep_mode=false",
        f"{ROLLOUT}.max_model_len=8192",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[console]",
    ]


def main(work: Path, steps: int, extra: list[str]) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    started = time.monotonic()
    import ray
    from hydra import compose, initialize_config_dir

    from infmem_verl import conf_dir
    from infmem_verl.assets import tiny_qwen3_dir
    from infmem_verl.main import run
    from infmem_verl.small_vocab import small_vocab_dir

    work.mkdir(parents=True, exist_ok=True)
    model = tiny_qwen3_dir(tokenizer_dir=small_vocab_dir(4096))
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=overrides(work.resolve(), model, steps) + extra)
    passed = ("VERL_PLATFORM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {key: os.environ[key] for key in passed if key in os.environ}
    # Two logical GPU slots, one per rank; verl's bundles ask for CPUs beyond the machine's count.
    ray.init(num_cpus=32, num_gpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        run(config)
    finally:
        ray.shutdown()
        print(f"[verl_cpu_rl] {steps} step(s), {time.monotonic() - started:.0f} s from start", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1, sys.argv[3:])
