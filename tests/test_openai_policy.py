"""OpenAIPolicy's HTTP behaviour against small real aiohttp servers on loopback.

These servers misbehave on purpose (503s, malformed bodies, a changed prompt, silence), which a
real vLLM cannot be made to do on demand; the happy path against the real CPU vLLM server is in
``test_eval_vllm.py``. Each server answers like vLLM's ``/v1/completions`` with
``return_token_ids``: it echoes the prompt ids and generates ``len(prompt) % 7`` tokens.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from infmem_verl.agent.policy import SamplingParams
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.policy.openai import OpenAIPolicy, PolicyError, normalize_endpoint

IM_END, END_OF_TEXT = 151645, 151643
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@dataclass
class Behaviour:
    """What a test server does; ``script`` lists per-request overrides, consumed in order."""

    script: list[str] = field(default_factory=list)
    delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def completion(prompt: list[int], max_tokens: int, mode: str) -> dict:
    count = min(len(prompt) % 7 + 1, max_tokens)
    tokens = [1000 + i for i in range(count)]
    finish = "length" if count == max_tokens else "stop"
    if finish == "stop":
        tokens[-1] = IM_END
    if mode == "drop_end":
        tokens[-1] = 42
    choice = {
        "index": 0,
        "text": "",
        "finish_reason": finish,
        "token_ids": tokens,
        "prompt_token_ids": prompt[:-1] + [7] if mode == "change_prompt" else prompt,
        "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
    }
    if mode == "no_token_ids":
        del choice["token_ids"]
    return {"id": "cmpl-test", "object": "text_completion", "model": "tiny", "choices": [choice]}


async def start_server(behaviour: Behaviour) -> tuple[web.AppRunner, str]:
    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "max_model_len": 4096}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        behaviour.requests.append(body)
        behaviour.in_flight += 1
        behaviour.max_in_flight = max(behaviour.max_in_flight, behaviour.in_flight)
        try:
            await asyncio.sleep(behaviour.delay_s)
            mode = behaviour.script.pop(0) if behaviour.script else "ok"
            if mode == "503":
                return web.Response(status=503, text="overloaded")
            if mode == "400":
                return web.Response(status=400, text='{"message": "prompt is too long"}')
            if mode == "not_json":
                return web.Response(status=200, text="<html>proxy</html>")
            if mode == "hang":
                await asyncio.sleep(1.5)  # well past the client's timeout
            return web.json_response(completion(body["prompt"], body["max_tokens"], mode))
        finally:
            behaviour.in_flight -= 1

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Real token ids of real Wikipedia text, of various lengths."""
    paragraphs = wiki_paragraphs()
    return [tokenizer.encode(paragraphs[i]["text"])[: 20 + 9 * i] for i in range(8)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def make_policy(urls: list[str], **kw) -> OpenAIPolicy:
    kw.setdefault("backoff_s", 0.01)
    return OpenAIPolicy(urls, [IM_END, END_OF_TEXT], **kw)


def test_request_carries_our_ids_and_settings_and_the_reply_becomes_a_generation(prompts):
    async def scenario():
        behaviour = Behaviour()
        runner, url = await start_server(behaviour)
        try:
            async with make_policy([url]) as policy:
                params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20)
                generation = await policy.generate(prompts[2], params)
                info = await policy.server_info()
            return behaviour, generation, info
        finally:
            await runner.cleanup()

    behaviour, generation, info = run(scenario())
    body = behaviour.requests[0]
    assert body["prompt"] == prompts[2] and body["model"] == "tiny"
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["top_k"]) == (8, 0.7, 0.9, 20)
    assert body["return_token_ids"] is True and body["stop_token_ids"] == [END_OF_TEXT, IM_END]
    assert body["logprobs"] == 0
    expected = completion(prompts[2], 8, "ok")["choices"][0]
    assert generation.token_ids == expected["token_ids"]
    assert generation.finish_reason == expected["finish_reason"]
    assert generation.log_probs == [-0.5] * len(expected["token_ids"])
    assert (info.model, info.max_model_len) == ("tiny", 4096)


def test_stop_generation_ends_with_the_end_token_and_length_does_not(prompts):
    async def scenario():
        runner, url = await start_server(Behaviour())
        try:
            async with make_policy([url]) as policy:
                return [await policy.generate(p, SamplingParams(max_tokens=4, temperature=0.0, logprobs=False)) for p in prompts]
        finally:
            await runner.cleanup()

    generations = run(scenario())
    assert {g.finish_reason for g in generations} == {"stop", "length"}
    for g in generations:
        assert g.log_probs is None
        assert (g.token_ids[-1] == IM_END) == (g.finish_reason == "stop")
        assert len(g.token_ids) <= 4


def test_retries_server_errors_with_backoff_then_succeeds(prompts):
    async def scenario():
        behaviour = Behaviour(script=["503", "503"])
        runner, url = await start_server(behaviour)
        try:
            async with make_policy([url], max_retries=3) as policy:
                generation = await policy.generate(prompts[0], GREEDY)
                return generation, policy.stats, len(behaviour.requests)
        finally:
            await runner.cleanup()

    generation, stats, requests = run(scenario())
    assert requests == 3 and stats.retries == 2 and stats.failures == 0
    assert generation.token_ids


def test_gives_up_after_max_retries_with_the_reason(prompts):
    async def scenario():
        runner, url = await start_server(Behaviour(script=["503"] * 5))
        try:
            async with make_policy([url], max_retries=2) as policy:
                with pytest.raises(PolicyError) as info:
                    await policy.generate(prompts[0], GREEDY)
                return info.value, policy.stats
        finally:
            await runner.cleanup()

    error, stats = run(scenario())
    assert error.kind == "server_error" and "HTTP 503" in str(error) and "after 3 attempts" in str(error)
    assert stats.failures == 1 and stats.retries == 2


@pytest.mark.parametrize(
    ("mode", "kind", "words"),
    [
        ("400", "rejected", "prompt is too long"),
        ("not_json", "malformed", "not JSON"),
        ("no_token_ids", "malformed", "return_token_ids"),
        ("change_prompt", "prompt_changed", "differ"),
        ("drop_end", "malformed", "without an end token"),
    ],
)
def test_errors_retrying_cannot_fix_fail_at_once_with_a_clear_reason(prompts, mode, kind, words):
    async def scenario():
        behaviour = Behaviour(script=[mode])
        runner, url = await start_server(behaviour)
        try:
            async with make_policy([url], max_retries=3) as policy:
                with pytest.raises(PolicyError) as info:
                    await policy.generate(prompts[6], GREEDY)
                return info.value, len(behaviour.requests)
        finally:
            await runner.cleanup()

    error, requests = run(scenario())
    assert requests == 1, "a non-retryable error must not be retried"
    assert error.kind == kind and words in str(error) and "127.0.0.1" in str(error)


def test_unreachable_endpoint_is_classified_and_a_live_one_takes_over(prompts):
    async def scenario():
        behaviour = Behaviour()
        runner, live = await start_server(behaviour)
        dead_runner, dead = await start_server(Behaviour())
        await dead_runner.cleanup()  # its port now refuses connections
        try:
            async with make_policy([dead], max_retries=1) as policy:
                with pytest.raises(PolicyError) as info:
                    await policy.generate(prompts[0], GREEDY)
            async with make_policy([dead, live], max_retries=2) as policy:
                generations = await asyncio.gather(*(policy.generate(p, GREEDY) for p in prompts))
            return info.value, generations, len(behaviour.requests)
        finally:
            await runner.cleanup()

    error, generations, live_requests = run(scenario())
    assert error.kind == "unreachable" and "after 2 attempts" in str(error)
    assert all(g.token_ids for g in generations)
    assert live_requests == len(prompts)


def test_timeout_is_retried_then_reported(prompts):
    async def scenario():
        runner, url = await start_server(Behaviour(script=["hang", "hang"]))
        try:
            async with make_policy([url], max_retries=1, timeout_s=0.3) as policy:
                with pytest.raises(PolicyError) as info:
                    await policy.generate(prompts[0], GREEDY)
                return info.value
        finally:
            await runner.cleanup()

    error = run(scenario())
    assert error.kind == "timeout" and "0.3 s" in str(error)


def test_requests_spread_over_endpoints_under_the_concurrency_cap(prompts):
    async def scenario():
        behaviours = [Behaviour(delay_s=0.05), Behaviour(delay_s=0.05)]
        servers = [await start_server(b) for b in behaviours]
        try:
            async with make_policy([url for _, url in servers], max_concurrency=4) as policy:
                await asyncio.gather(*(policy.generate(prompts[i % len(prompts)], GREEDY) for i in range(24)))
                return behaviours, policy.stats
        finally:
            for runner, _ in servers:
                await runner.cleanup()

    behaviours, stats = run(scenario())
    counts = [len(b.requests) for b in behaviours]
    assert sum(counts) == 24 and min(counts) >= 8, counts
    assert sum(b.max_in_flight for b in behaviours) <= 4
    assert max(b.max_in_flight for b in behaviours) >= 2
    assert stats.calls == 24 and sum(stats.per_endpoint.values()) == 24 + 1  # + one /v1/models


def test_unknown_model_name_is_rejected_with_the_served_names():
    async def scenario():
        runner, url = await start_server(Behaviour())
        try:
            async with make_policy([url], model="qwen3-4b") as policy:
                with pytest.raises(PolicyError) as info:
                    await policy.server_info()
                return info.value
        finally:
            await runner.cleanup()

    error = run(scenario())
    assert error.kind == "rejected" and "'qwen3-4b' is not served" in str(error) and "tiny" in str(error)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"endpoints": []}, "endpoints"),
        ({"endpoints": "http://127.0.0.1:1"}, "endpoints"),
        ({"endpoints": ["ftp://host"]}, "endpoints[0]"),
        ({"end_token_ids": []}, "end_token_ids"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"backoff_s": -1}, "backoff_s"),
        ({"max_retries": -1}, "max_retries"),
        ({"max_concurrency": 0}, "max_concurrency"),
    ],
)
def test_bad_settings_name_the_field(kwargs, field):
    args = {"endpoints": ["http://127.0.0.1:8000"], "end_token_ids": [IM_END], **kwargs}
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}:"):
        OpenAIPolicy(**args)


def test_endpoint_urls_are_normalized():
    assert normalize_endpoint("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_endpoint(" https://host:1 ") == "https://host:1"
