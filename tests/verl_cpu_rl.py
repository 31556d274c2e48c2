"""RL steps of InfMem on verl's own workers on a CPU: verl's ``ActorRolloutRefWorker`` (FSDP2) on
2 gloo ranks, two hybrid vLLM replicas on vLLM's CPU build, verl's weight sync after each update.

    PYTHONPATH=. .venv-vllm/bin/python tests/verl_cpu_rl.py WORK_DIR [STEPS] [--model-seed N] [OVERRIDES ...]

Driven by tests/test_verl_cpu_rl.py (2 steps over two launches, the first killed after its save of
step 1, the second resuming; checkpoints, a reward that varies, the KL loss off for the
zero-advantage drop). Each step line reports the measured optimizer-step count
(``infmem/optimizer_steps``), the sync time and the rollout-vs-trainer gap, also written to
WORK_DIR/records/steps.jsonl.

The launch is ``make smoke-verl``'s: ``infmem_verl.main.run`` on ``+recipe=smoke_verl``
(``infmem.backend=verl-cpu``: the ``cpu`` platform, Ray's logical GPU slots as ranks, and the
settings a CPU needs, infmem_verl/cpu/backend.py ``VERL_CPU_SETTINGS``; the KL loss and its
reference model on, as in the GPU recipes), trainer mode ``infmem_sync``, our agent loop and
reward manager. What this script adds:

* the model is the recipe's tiny Qwen3 over the 4,096-token small vocabulary re-initialised at
  initializer range 0.3 from seed 0 (WORK_DIR/model; ``--model-seed N``: from seed N, in
  WORK_DIR/model_seed_N): at the default 0.02 its next-token distribution is near uniform
  (log-perplexity 8.31 against ln 4096 = 8.32), so no log-prob check could tell one set of weights
  from another;
* data, records and checkpoints under WORK_DIR, no validation, console logging only;
* ``tests/`` on the workers' path, so a test reward component named by dotted path
  (:func:`text_score_on_even_samples`) imports there.
OVERRIDES are appended (Hydra syntax).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def non_uniform_model(work: Path, seed: int) -> Path:
    """The tiny small-vocabulary Qwen3 re-initialised at initializer range 0.3 from ``seed`` (the
    server test's ``random_model``), saved with its tokenizer (see the module docstring)."""
    from transformers import AutoTokenizer
    from verl_vllm_server import random_model

    from infmem_verl.assets import tiny_qwen3_dir
    from infmem_verl.small_vocab import small_vocab_dir

    source = tiny_qwen3_dir(tokenizer_dir=small_vocab_dir(4096))
    target = work / ("model" if seed == 0 else f"model_seed_{seed}")
    random_model(source, seed=seed).save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def overrides(work: Path, model: Path, steps: int) -> list[str]:
    """The recipe and the module docstring's additions, for ``steps`` RL steps."""
    return [
        "+recipe=smoke_verl",
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={work}/train.parquet",
        f"data.val_files={work}/val.parquet",
        f"infmem.records.dir={work}/records",
        f"trainer.default_local_dir={work}/checkpoints",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.logger=[console]",
    ]


def main(work: Path, steps: int, extra: list[str], model_seed: int = 0) -> None:
    started = time.monotonic()
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from infmem_verl import conf_dir
    from infmem_verl.main import run

    work.mkdir(parents=True, exist_ok=True)
    model = non_uniform_model(work, model_seed)
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=overrides(work.resolve(), model, steps) + extra)
    path = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    OmegaConf.update(config, "ray_kwargs.ray_init.runtime_env.env_vars", path, force_add=True)
    try:
        run(config)  # the backend starts and stops the Ray session
    finally:
        print(f"[verl_cpu_rl] {steps} step(s), {time.monotonic() - started:.0f} s from start", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="RL steps of InfMem on verl's own workers on a CPU")
    parser.add_argument("work", type=Path)
    parser.add_argument("steps", type=int, nargs="?", default=1)
    parser.add_argument("--model-seed", type=int, default=0)
    args, hydra_overrides = parser.parse_known_args()
    main(args.work, args.steps, hydra_overrides, args.model_seed)
