"""Shared fixtures: the real Qwen3 tokenizer and a tiny random Qwen3 built at test time."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tokenizer():
    from infmem_verl.assets import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from infmem_verl.assets import tiny_qwen3_dir

    return tiny_qwen3_dir(cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir, tmp_path_factory):
    """One real CPU vLLM server (``.venv-vllm``) serving the tiny Qwen3 for the whole session:
    a start costs ~45 s on 2 cores (tests that need it gone take away a proxy in front of it)."""
    from vllm_server import VLLMServer

    server = VLLMServer(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "server.log").start()
    yield server
    server.stop()


# The demo recipe's warm-up in miniature: it proves the chain distil -> SFT -> check, not the
# student's quality (no validity threshold: its 3-step student parses 0% of its actions).
WARMUP_SMALL = [
    "infmem.warmup.hidden_size=64",
    "infmem.warmup.lr=2.0e-3",  # the learning run of test_cpu_training_runs.py is tuned from this student
    "infmem.warmup.distill_samples=4",
    "infmem.warmup.sft_steps=3",
    "infmem.warmup.batch_size=4",
    "infmem.warmup.heldout_samples=2",
    "infmem.warmup.min_valid=0",
]


def demo_config(*overrides: str):
    from hydra import compose, initialize_config_dir

    from infmem_verl import conf_dir

    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=["+recipe=demo", *overrides])


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory):
    """The SFT output of the small warm-up (tests/test_warmup.py checks it; the learning run of
    tests/test_cpu_training_runs.py starts GRPO from it)."""
    from infmem_verl.cpu.warmup import warm_qwen3_dir

    cache = tmp_path_factory.mktemp("warm_cache")
    return warm_qwen3_dir(demo_config(*WARMUP_SMALL), "demo", WARMUP_SMALL, cache_dir=cache)
