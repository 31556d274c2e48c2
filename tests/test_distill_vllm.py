"""Distillation from a real CPU vLLM server (``.venv-vllm``, the tiny Qwen3), then SFT on it.

The session's one server (``vllm_server`` in conftest.py). The tests prove that every SFT sample trains on
exactly the ids our agent core sent to the server and the ids the server generated (nothing of
the prompt, nothing the loop injected), that a few SFT steps on those samples lower the loss and
leave a loadable checkpoint, and that a killed distillation, then a server dying mid-run, both
end in a resume that redoes no finished sample (the failures are recorded, then retried). The
server "dies" behind a loopback proxy, so it comes back at once without a second vLLM start.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from data_prep.training import TrainingWriter
from infmem_verl.agent.protocol import PromptBuilder
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.distill import DistillConfig, distill, recipe_agent
from infmem_verl.policy.openai import OpenAIPolicy
from infmem_verl.policy.source import ModelSource, OpenedModel
from infmem_verl.policy.transformers import end_token_ids
from infmem_verl.sft.launch import run as run_sft
from infmem_verl.sft.samples import sft_paths

from test_sft import RecordingPolicy, close_think_ids, samples_from_calls, sft_config
from vllm_server import REPO, SERVED_NAME, Proxy

RUN_TIMEOUT_S = 240
SAMPLES = 4
# Two 1000-token chunks per document: five protocol calls (ten generate calls) per sample, with
# small budgets (the random model always spends them all).
DOC_TOKENS = 1200
VLLM_OVERRIDES = [
    "infmem.agent.document.chunk_tokens=1000",
    "infmem.agent.document.unit_tokens=200",
    "infmem.agent.document.unit_overlap=40",
    "infmem.agent.memory_tokens=16",
    "infmem.agent.prethink.thinking_tokens=8",
    "infmem.agent.prethink.output_tokens=16",
    "infmem.agent.write.thinking_tokens=8",
    "infmem.agent.write.output_tokens=16",
    "infmem.agent.answer.thinking_tokens=8",
    "infmem.agent.answer.output_tokens=8",
]


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_dataset(SAMPLES, DOC_TOKENS, tokenizer, seed=3)


@pytest.fixture(scope="module")
def train_file(samples, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "train.parquet"
    writer = TrainingWriter(out, out.with_name("docs.parquet"), out.with_name("docs.parquet"), "infmem_agent")
    for sample in samples:
        writer.write(sample)
    writer.close()
    return out


def cfg_for(out: Path, data: Path, endpoint: str, concurrency: int = 2, max_retries: int = 3, **kw) -> DistillConfig:
    # The random model never answers right and never follows the grammar: keep everything.
    source = ModelSource((endpoint,), concurrency=concurrency, max_retries=max_retries, backoff_s=0.1)
    return DistillConfig(out=out, data=data, recipe="smoke", overrides=VLLM_OVERRIDES, source=source,
                         keep="all", drop_flags=(), progress=False, **kw)  # fmt: skip


def records(out: Path) -> list[dict]:
    """The whole records written so far (a killed writer may leave a cut last line)."""
    path = out / "results.jsonl"
    whole = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            whole.append(json.loads(line))
        except ValueError:
            pass
    return whole


@pytest.fixture(scope="module")
def distilled(vllm_server, tokenizer, train_file, tmp_path_factory):
    """Two samples distilled from the server, every generate call recorded."""
    out = tmp_path_factory.mktemp("distilled")

    async def scenario():
        policy = RecordingPolicy(OpenAIPolicy([vllm_server.url], end_token_ids(tokenizer), SERVED_NAME, max_concurrency=4))
        try:
            report = await distill(cfg_for(out, train_file, vllm_server.url, samples=2), OpenedModel(policy, tokenizer, SERVED_NAME))
        finally:
            await policy.close()
        return report, policy.calls

    report, calls = asyncio.run(asyncio.wait_for(scenario(), RUN_TIMEOUT_S))
    assert report.kept == 2 and report.keep_rate == 1.0
    return out, calls


def test_samples_train_exactly_the_ids_the_agent_core_sent_and_the_server_generated(distilled, tokenizer, samples):
    out, calls = distilled
    table = pq.read_table(sft_paths(out)["train"]).to_pylist()
    written = {
        (np.asarray(r["input_ids"], dtype=np.int64).tobytes(), np.asarray(r["loss_mask"], dtype=np.int64).tobytes()) for r in table
    }
    expected = samples_from_calls(calls, close_think_ids(tokenizer))
    assert set(expected) == written and sum(expected.values()) == len(table)
    # The random model never closes its thinking: the loop injects the tag, which stays untrained.
    assert any(0 in r["loss_mask"][r["loss_mask"].index(1) :] for r in table)
    # The prompts are the agent core's: the first PreThink of a sample, built here on its own.
    _, recipe_cfg = recipe_agent("smoke", VLLM_OVERRIDES)
    builder = PromptBuilder(tokenizer, recipe_cfg)
    by_sample = {r["sample_id"]: r for r in table if r["turn"] == 0}
    chunks = {r["sample_id"]: r["num_chunks"] for r in records(out)}
    for sample in samples[:2]:
        row = by_sample[sample.id]
        prompt = builder.prethink(builder.encode(sample.question), [], [], 0, chunks[sample.id]).ids
        assert row["input_ids"][: len(prompt)] == prompt.tolist() and not any(row["loss_mask"][: len(prompt)])


def test_sft_steps_on_distilled_trajectories_lower_the_loss(distilled, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out, _ = distilled
    config = sft_config(
        "+recipe=sft_smoke",
        f"data.train_files={sft_paths(out)['train']}",
        "sft.tiny_model=false",
        f"model.path={tiny_model_dir}",
        "trainer.total_training_steps=4",
        f"trainer.default_local_dir={tmp_path}",
    )
    result = run_sft(config)
    assert len(result.losses) == 4
    assert result.loss_after < result.loss_before - 0.05, (result.loss_before, result.loss_after)
    # The checkpoint is the Hugging Face folder the RL recipes take as actor_rollout_ref.model.path.
    assert result.checkpoint == tmp_path / "global_step_4" / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(result.checkpoint)
    assert model.config.vocab_size == 151936 and (result.checkpoint / "tokenizer_config.json").is_file()


def ok_records(out: Path) -> list[dict]:
    return [r for r in records(out) if r["status"] == "ok"]


def test_killed_run_and_dying_server_both_resume_without_redoing_a_sample(vllm_server, train_file, tmp_path):
    """The CLI is killed after its first record; a resume goes on through a proxy that dies
    after one more; a last resume, with the server back, retries only what failed."""
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "infmem_verl.distill", "--endpoint", vllm_server.url, "--data", str(train_file),
        "--out", str(out), "--recipe", "smoke", "--keep", "all", "--drop-flags", "none", "--concurrency", "1",
        "--no-progress", *[arg for item in VLLM_OVERRIDES for arg in ("--set", item)],
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not records(out):
        assert process.poll() is None, f"distillation ended early:\n{process.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "distillation made no progress"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    killed = (out / "results.jsonl").read_text().rsplit("\n", 1)[0]  # whole lines only
    done = len(records(out))
    assert 1 <= done <= SAMPLES - 2

    async def scenario():
        proxy = Proxy(vllm_server.url)
        await proxy.start()
        cfg = cfg_for(out, train_file, proxy.url, concurrency=1, max_retries=1)
        run = asyncio.create_task(distill(cfg))
        while len(ok_records(out)) < done + 1:
            await asyncio.sleep(0.05)
        await proxy.stop()  # the server is gone: connections refused from now on
        first = await run
        await proxy.start()  # back on the same port: the same command resumes
        second = await distill(cfg)
        await proxy.stop()
        return first, second

    first, second = asyncio.run(asyncio.wait_for(scenario(), RUN_TIMEOUT_S))
    assert (out / "results.jsonl").read_text().startswith(killed), "earlier records stay as they were"
    assert first.samples == SAMPLES and first.transient_failures >= 1, "the run goes on, recording every sample"
    assert set(first.failed) == {"teacher unreachable"}
    failed = [r for r in records(out) if r["status"] == "failed"]
    assert failed and all(r["transient"] for r in failed)
    assert second.kept == SAMPLES and not second.failed
    ids = [r["sample_id"] for r in ok_records(out)]
    assert len(ids) == len(set(ids)) == SAMPLES, "every sample finished exactly once: nothing redone"
    assert len(records(out)) == SAMPLES + len(failed), "only the failed samples ran again"
