"""Shared fixtures (the real Qwen3 tokenizer, a tiny random Qwen3 built at test time, one CPU vLLM
server, the small warm-up) and the suite's split over pytest-xdist's workers."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# `make test` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup
# --no-loadscope-reorder``): most of its time is single-threaded (a tiny model's forward is Python
# overhead, a Ray start waits on its actors), so a second worker fills the idle core. Work is handed
# out in groups, which pytest_collection_modifyitems below sets: a module's tests stay together (its
# module fixtures run once), and the modules that share one of these session fixtures join one group,
# so each starts once per suite, as in a run without workers.
SHARED_SESSION_FIXTURES = ("vllm_server", "warm_model")
# Groups handed out first, the longest first (as `make test`'s --durations shows them): a long group
# started last would leave the other worker idle at the end.
LONGEST_GROUPS = ("vllm_server", "test_metrics_tb", "warm_model", "test_verl_pipeline", "test_preflight", "test_eval")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    modules: dict[str, str] = {}  # module name -> group
    for item in items:
        module = item.module.__name__
        shared = next((f for f in SHARED_SESSION_FIXTURES if f in item.fixturenames), None)
        if shared is not None or module not in modules:
            modules[module] = shared or modules.get(module, module)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(modules[item.module.__name__]))
    rank = {group: i for i, group in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(modules[item.module.__name__], len(rank)))  # stable: file order kept


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
