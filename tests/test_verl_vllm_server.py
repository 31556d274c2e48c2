"""``VerlServerPolicy`` against verl's own ``vLLMHttpServer`` on vLLM's CPU build (not hand-made
``TokenOutput`` s): whether an end token is in ``token_ids``, how many log-probs come back, what a
cut response looks like, and how far the served log-probs are from transformers' on the same
weights. The server runs in the verl + vLLM environment (tests/verl_vllm_server.py)."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
from verl_vllm_server import STOP_AT
from vllm_server import REPO, require_vllm

# float32 on both sides, per token: measured 1.1e-3 to 1.8e-3 on this model (its log-probs -2 to
# -4.5); a prompt/response split off by one position would differ by whole nats.
LOG_PROB_GAP = 5e-3


def test_verl_vllm_server_reports_end_tokens_cuts_and_log_probs(tiny_model_dir, tmp_path):
    python = require_vllm()
    env = {**os.environ, "VERL_PLATFORM": "cpu", "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [str(python), str(REPO / "tests" / "verl_vllm_server.py"), str(tiny_model_dir), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    stop, greedy = result["stop_token"], result["greedy"]
    assert stop in result["eos_ids"]
    ended, cut = result["calls"]["ended"], result["calls"]["cut"]

    # The response that reached the end token: vLLM's greedy tokens up to and including it (verl
    # reports it "completed", like a cut one; the end token in token_ids is what tells them apart).
    end = greedy.index(stop)
    assert ended["token_ids"] == greedy[: end + 1]
    assert ended["finish_reason"] == "stop"
    # Cut at max_tokens before the end token: no end token, the whole budget, a cut.
    assert cut["token_ids"] == greedy[: len(cut["token_ids"])] and len(cut["token_ids"]) == STOP_AT
    assert cut["finish_reason"] == "length"
    for call in (ended, cut):
        assert len(call["log_probs"]) == len(call["token_ids"])  # one per token, the end token included
        gap = np.abs(np.array(call["log_probs"]) - np.array(call["reference_log_probs"])).max()
        assert gap < LOG_PROB_GAP, f"rollout-vs-transformers log-prob gap {gap:.2e}"
