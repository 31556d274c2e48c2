"""RL steps of InfMem on verl's own workers on a CPU: verl's ``ActorRolloutRefWorker`` (FSDP2) on
2 gloo ranks, two hybrid vLLM replicas on vLLM's CPU build, verl's weight sync after each update.

    VERL_PLATFORM=cpu PYTHONPATH=. .venv-vllm/bin/python tests/verl_cpu_rl.py WORK_DIR [STEPS] [OVERRIDES ...]

Driven by tests/test_verl_cpu_rl.py (2 steps, checkpoints, a reward that varies, the KL loss off
for the zero-advantage drop). Each
step line reports the measured optimizer-step count (``infmem/optimizer_steps``), the sync time
and the rollout-vs-trainer gap, also written to WORK_DIR/records/steps.jsonl.

The path is a GPU run's, through verl's hooks only: ``infmem_verl.main.run`` on ``+recipe=smoke``
with ``infmem.backend=gpu`` and two ranks, on the ``cpu`` platform (ranks are the two logical Ray
GPU slots ``ray.init(num_gpus=2)`` creates; verl_plugin/platform.py), trainer mode ``infmem_sync``,
our agent loop and reward manager. What differs from a GPU run, and why:

* the model is the tiny Qwen3 over the 4,096-token small vocabulary (hidden 64, 2 layers; with
  Qwen3's 151,936 tokens the logits of every position dominate the cost), re-initialised at
  initializer range 0.3 (WORK_DIR/model): at the default 0.02 its next-token distribution is near
  uniform (log-perplexity 8.31 against ln 4096 = 8.32), so no log-prob check could tell one set of
  weights from another;
* the reference model (the KL loss's, as in the GPU recipes) is verl's FSDP2 engine without the
  pinned CPU offload verl forces on forward-only models: pinning needs an accelerator
  (infmem_verl/verl_plugin/cpu_engine.py); its log-probs are one row per micro-batch too;
* sdpa attention, no padding removal, one row per micro-batch (``use_dynamic_bsz=false`` for the
  update and the old log-probs, ``ppo_micro_batch_size_per_gpu=1``): flash-attention is
  CUDA-only, and sdpa on CPU computes a padded micro-batch's whole ``rows x longest^2`` masked
  attention (or, with padding removal, the packed length squared), but only the causal half of
  one unpadded row: against verl's dynamic batches (8,192 tokens) one row at a time took the old
  log-probs from 11.5 to 2.6 s and the update from 12.3 to 8.3 s at the same load
  (docs/experiments/2026-12-04-verl-cpu-rl.md);
* the rollout in float32, eager, without sleep mode (vLLM's CPU build has no sleep mode);
* ``actor.fsdp_config.use_torch_compile=false``: the engine's switch for verl's compiled
  log-prob/entropy functions (``actor.use_torch_compile`` does not reach the v1 engine);
* Ray's workers at the driver's priority (``RAY_worker_niceness=0``; Ray's default starts them 15
  nice levels below it, a CFS weight of 15 against 110 for a process at the driver's nice 10, and
  in the profiled baseline both ranks together got 0.6-1.1 of the 2 cores during the update; no
  gain was measured from it alone on the SFT test at load 9-10);
* 4,000-token documents (``infmem.bootstrap.doc_tokens``) written to WORK_DIR, checkpoints and
  records there too.
OVERRIDES are appended (Hydra syntax).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROLLOUT = "actor_rollout_ref.rollout"


def text_score_on_even_samples(record) -> float:
    """A test reward component (``infmem.reward.components``) that gives the random model's GRPO
    groups both kinds of advantage: on samples of even ``extra_info.index``, a score in [0, 1)
    drawn from the final response's text (its SHA-256), so two sampled responses score alike only
    if they are the same text (a length, tried first, tied in some groups); on odd ones 0 for every
    member (the group's advantages are exactly zero). The built-in components give a random model 0
    everywhere, hence no gradient at all."""
    if int(record.extra_info.get("index", 1)) % 2:
        return 0.0
    return int.from_bytes(hashlib.sha256(record.solution_str.encode()).digest()[:4], "big") / 2**32


def non_uniform_model(work: Path) -> Path:
    """The tiny small-vocabulary Qwen3 re-initialised at initializer range 0.3 (the server test's
    ``random_model``), saved with its tokenizer to WORK_DIR/model (see the module docstring)."""
    from transformers import AutoTokenizer
    from verl_vllm_server import random_model

    from infmem_verl.assets import tiny_qwen3_dir
    from infmem_verl.small_vocab import small_vocab_dir

    source = tiny_qwen3_dir(tokenizer_dir=small_vocab_dir(4096))
    target = work / "model"
    random_model(source, seed=0).save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


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
        f"{actor}.model.use_remove_padding=false",
        f"+{actor}.model.override_config.attn_implementation=sdpa",
        f"{actor}.actor.use_dynamic_bsz=false",
        f"{actor}.actor.ppo_micro_batch_size_per_gpu=1",
        f"{ROLLOUT}.log_prob_use_dynamic_bsz=false",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=1",
        f"{actor}.ref.log_prob_use_dynamic_bsz=false",
        f"{actor}.ref.log_prob_micro_batch_size_per_gpu=1",
        f"{actor}.actor.fsdp_config.use_torch_compile=false",
        f"{actor}.ref.fsdp_config.use_torch_compile=false",
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
    from infmem_verl.main import run

    work.mkdir(parents=True, exist_ok=True)
    model = non_uniform_model(work)
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=overrides(work.resolve(), model, steps) + extra)
    passed = ("VERL_PLATFORM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {key: os.environ[key] for key in passed if key in os.environ}
    # Reward components named by dotted path (text_score_on_even_samples) import in the workers.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    os.environ.setdefault("RAY_worker_niceness", "0")  # read by the raylet ray.init starts (module docstring)
    # Two logical GPU slots, one per rank; verl's bundles ask for CPUs beyond the machine's count.
    ray.init(num_cpus=32, num_gpus=2, include_dashboard=False, runtime_env={"env_vars": env})
    try:
        run(config)
    finally:
        ray.shutdown()
        print(f"[verl_cpu_rl] {steps} step(s), {time.monotonic() - started:.0f} s from start", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 1, sys.argv[3:])
