"""Shared fixtures (the real Qwen3 tokenizer, a tiny random Qwen3 built at test time, one CPU vLLM
server, the small warm-up) and the suite's split over pytest-xdist's workers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Each of xdist's workers takes its share of the cores for every process it starts (its own torch,
# launched runs and their Ray actors through infmem.cpu.threads, SFT and vLLM subprocesses): two
# workers starting threads for all cores contend (two 40-step SFT runs side by side on 2 cores:
# 88 s each at two threads, 47 s at one). Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault(
        "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    )


# `make test` runs the suite on two pytest-xdist workers (``-n 2``): most of its time is
# single-threaded (a tiny model's forward is Python overhead, a Ray start waits on its actors), so a
# second worker fills the idle core. Work is handed out in groups (ModuleGroups below): a module's
# tests stay together, so its module fixtures run once, and the modules that share an expensive
# session fixture form one group, so it starts once per suite as in a run without workers.
# (xdist's own ``--dist loadgroup`` marks tests by rewriting their ids, which pytest 9 ignores.)
SHARED_SESSION_GROUPS = {
    "vllm_server": ("test_cost", "test_distill_vllm", "test_eval_vllm"),
    "warm_model": ("test_cpu_training_runs", "test_warmup"),
}
GROUP_OF_MODULE = {module: group for group, modules in SHARED_SESSION_GROUPS.items() for module in modules}
# Groups handed out first, the longest first (a long group started last would leave the other
# worker idle at the end). The order is from the 2026-12-07 morning's measures (warm_model 662 s
# with the longer warm-up's build, now in test_infmem_learning). Seconds in the suite that added
# test_infmem_learning (2026-12-07, 26 min 34 s): test_verl_cpu_rl 447, warm_model 421,
# test_infmem_learning 399, test_metrics_tb 360, vllm_server 348, test_training_faults 241,
# test_verl_vllm_server 138, test_retrieval 125, test_verl_cpu_sft 124, test_preflight 101,
# test_export 98, test_verl_pipeline 87.
LONGEST_GROUPS = ("warm_model", "test_infmem_learning", "test_metrics_tb", "test_verl_cpu_rl", "vllm_server", "test_training_faults", "test_retrieval",
                  "test_verl_pipeline", "test_preflight", "test_verl_vllm_server", "test_export", "test_verl_cpu_sft")


def _group(test_file: Path) -> str:
    """The work group of a test file's tests (the module name, or its shared fixture's)."""
    return GROUP_OF_MODULE.get(test_file.stem, test_file.stem)


def pytest_collection_modifyitems(config, items):
    """Refuse a test whose module is outside its shared fixture's group (the fixture would start
    again on the other worker); put the longest groups first, each module's tests in file order."""
    for item in items:
        for fixture in SHARED_SESSION_GROUPS:
            if fixture in item.fixturenames and _group(item.path) != fixture:
                raise pytest.UsageError(
                    f"{item.nodeid} uses the session fixture {fixture}: add {item.path.stem!r} to "
                    f"SHARED_SESSION_GROUPS[{fixture!r}] in tests/conftest.py so that it starts once per suite"
                )
    rank = {group: i for i, group in enumerate(LONGEST_GROUPS)}
    items.sort(key=lambda item: rank.get(_group(item.path), len(rank)))


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        """xdist's per-module scheduling, with the modules of a shared session fixture as one unit."""

        def _split_scope(self, nodeid: str) -> str:
            return _group(Path(nodeid.split("::", 1)[0]))

    config.option.loadscopereorder = False  # keep the collection's order: longest groups first
    return ModuleGroups(config, log)


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
    _RUNNING_SERVERS.append(server)
    yield server
    server.stop()


# The session's vLLM server, stopped as soon as the last test of its group is done rather than at
# the end of the session: idle, it still took about a quarter of a core (162 CPU-s in 11 minutes of
# a 2026-12-04 suite run), which the other groups' tests lost for the rest of the suite. The
# group's tests run one after another (see ModuleGroups), so no later test needs it.
_RUNNING_SERVERS: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _group(item.path) == "vllm_server" and (nextitem is None or _group(nextitem.path) != "vllm_server"):
        while _RUNNING_SERVERS:
            _RUNNING_SERVERS.pop().stop()


# The demo recipe before its curriculum (the distilled warm-up the tests below were measured with):
# Qwen3's vocabulary, syllable names, 1,024-token documents in chunks of 256, GRPO on 2 prompts x 2.
DISTILLED_DEMO = [
    # The suite's distilled students were measured (tests/test_warmup.py, tests/test_infmem_learning.py)
    # with the thinking budget enforced by a second call; the demo's curriculum student never spends
    # it, so the demo makes one call per turn (conf/recipe/demo.yaml).
    "infmem.agent.thinking_mode=two_stage",
    "infmem.bootstrap.names=syllables",
    "infmem.bootstrap.train_samples=4",
    "infmem.bootstrap.val_samples=2",
    "infmem.bootstrap.doc_tokens=1024",
    "infmem.warmup.vocab_size=0",
    "infmem.warmup.answer_steps=0",
    "infmem.warmup.memagent_steps=0",
    "infmem.warmup.infmem_steps=0",
    "infmem.warmup.min_accuracy=0",  # the distilled students follow the protocol and answer nothing
    "infmem.warmup.doc_tokens=1024",
    "infmem.agent.document.chunk_tokens=256",
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.optim.lr=2.0e-4",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
    "trainer.val_before_train=false",
]

# The demo recipe's warm-up in miniature: it proves the chain distil -> SFT -> check, not the
# student's quality (no validity threshold: its 3-step student parses 0% of its actions; the
# longer warm-up of tests/test_warmup.py is held to one it reaches).
WARMUP_SMALL = [
    *DISTILLED_DEMO,
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


@pytest.fixture
def token_auth(monkeypatch):
    """This process's Ray clients in token mode. Ray reads the mode into its config when first
    imported (an earlier test may have), so the config is read again, as `ray start` does when it
    turns the mode on (ray/_private/authentication/authentication_token_setup.py), and after."""
    from ray._raylet import Config

    from ray_jobs import AUTH

    for key, value in AUTH.items():
        monkeypatch.setenv(key, value)
    Config.initialize("")
    yield
    monkeypatch.undo()
    Config.initialize("")
