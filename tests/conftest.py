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
    a start costs ~45 s on 2 cores. A test that kills it starts it again on the same port."""
    from vllm_server import VLLMServer

    server = VLLMServer(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "server.log").start()
    yield server
    server.stop()
