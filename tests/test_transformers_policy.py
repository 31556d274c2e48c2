"""TransformersPolicy on the tiny random Qwen3 with the real Qwen3 tokenizer and Wikipedia prompts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from infmem_verl.agent.policy import Generation, Policy, SamplingParams
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.policy import TransformersPolicy
from infmem_verl.policy.transformers import GROUPED_SDPA, NUCLEUS_PROBE, sample_next_tokens

IM_END, END_OF_TEXT = 151645, 151643
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
# Guards against a hang only; a correct run finishes in well under a second per call.
NO_HANG_S = 60


@pytest.fixture(scope="module")
def policy_model(tiny_model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    """Real Wikipedia prompts of clearly different lengths, so batches need left padding."""
    paragraphs = wiki_paragraphs()
    return [tokenizer.encode(paragraphs[i]["text"])[:n] for i, n in enumerate([40, 7, 120, 23, 64])]


def make_policy(model: torch.nn.Module, **kw) -> TransformersPolicy:
    kw.setdefault("batch_wait_s", 0.05)
    return TransformersPolicy(model, [IM_END, END_OF_TEXT], **kw)


async def gather(policy: TransformersPolicy, prompts, params) -> list[Generation]:
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    calls = [policy.generate(p, sp) for p, sp in zip(prompts, params)]
    return await asyncio.wait_for(asyncio.gather(*calls), NO_HANG_S)


@pytest.fixture
def eos_bias(policy_model) -> Iterator[None]:
    """Make <|im_end|> certain at every step by adding a large bias to its logit in the lm_head."""

    def hook(module, args, output):
        output[..., IM_END] += 1e4
        return output

    handle = policy_model.lm_head.register_forward_hook(hook)
    yield
    handle.remove()


@pytest.fixture
def broken_model(policy_model) -> Iterator[None]:
    """Make every forward pass fail the way a device error would, from inside the model."""

    def hook(module, args):
        raise RuntimeError("simulated device failure")

    handle = policy_model.model.layers[0].register_forward_pre_hook(hook)
    yield
    handle.remove()


def test_from_pretrained_reads_end_tokens_and_tokenizer(tiny_model_dir) -> None:
    policy = TransformersPolicy.from_pretrained(tiny_model_dir, max_batch=3)
    assert isinstance(policy, Policy)
    assert policy.eos_token_ids == {IM_END, END_OF_TEXT}
    assert policy.max_batch == 3
    assert policy.tokenizer.convert_tokens_to_ids("<|im_end|>") == IM_END


def test_from_pretrained_attends_with_grouped_heads_and_gives_transformers_sdpa_bits(tiny_model_dir, policy_model, prompts) -> None:
    """The policy's attention passes grouped key/value heads to torch as they are; on a left-padded
    batch (prefill, then decode steps on the cache) its logits are transformers' ``sdpa``'s, bit for bit."""
    from transformers import DynamicCache

    grouped = TransformersPolicy.from_pretrained(tiny_model_dir).model
    assert grouped.config._attn_implementation == GROUPED_SDPA
    assert policy_model.config._attn_implementation == "sdpa"
    assert grouped.config.num_key_value_heads < grouped.config.num_attention_heads  # the heads are grouped
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    logits = []
    with torch.inference_mode():
        for model in (policy_model, grouped):
            cache, step_mask = DynamicCache(config=model.config), mask
            steps = [model(input_ids=input_ids, attention_mask=mask, past_key_values=cache).logits]
            for token in (11, 2000, 42):
                step_mask = torch.cat([step_mask, step_mask.new_ones(len(prompts), 1)], dim=1)
                steps.append(model(input_ids=torch.full((len(prompts), 1), token), attention_mask=step_mask, past_key_values=cache).logits)
            logits.append(torch.cat(steps, dim=1))
    assert torch.equal(*logits)


def test_from_pretrained_rejects_a_folder_without_a_model(tmp_path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        TransformersPolicy.from_pretrained(tmp_path)


async def test_greedy_batch_equals_rows_run_alone(policy_model, prompts) -> None:
    async with make_policy(policy_model) as policy:
        batched = await gather(policy, prompts, GREEDY)
        alone = [await policy.generate(p, GREEDY) for p in prompts]
        again = await gather(policy, prompts, GREEDY)
        assert policy.batch_sizes == [len(prompts)] + [1] * len(prompts) + [len(prompts)]
    for b, a, r in zip(batched, alone, again):
        assert b.token_ids == a.token_ids == r.token_ids
        assert b.finish_reason == "length" and len(b.token_ids) == GREEDY.max_tokens
        np.testing.assert_allclose(b.log_probs, a.log_probs, atol=1e-4)


async def test_greedy_rows_equal_transformers_generate(policy_model, prompts) -> None:
    """An independent reference for the decode loop: transformers' own greedy generate."""
    async with make_policy(policy_model) as policy:
        ours = await gather(policy, prompts, GREEDY)
    for prompt, out in zip(prompts, ours):
        ref = policy_model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=GREEDY.max_tokens, eos_token_id=[IM_END, END_OF_TEXT]
        )
        assert out.token_ids == ref[0, len(prompt) :].tolist()


async def continue_rows(policy: TransformersPolicy, prompts, extra: list[int], between=lambda: None) -> list[Generation]:
    """Two-stage calls as the agent makes them: a budget-capped first call, then the prompt,
    its tokens and ``extra`` again (with one fresh prompt in the second batch)."""
    first = await gather(policy, prompts, SamplingParams(max_tokens=6, temperature=0.0))
    between()
    again = [p + g.token_ids + extra for p, g in zip(prompts, first)]
    return await gather(policy, again + [prompts[0][:5]], SamplingParams(max_tokens=8, temperature=1.0))


async def test_a_continuation_prefills_only_its_new_tokens_and_decodes_the_same(policy_model, prompts, tokenizer) -> None:
    close_think = tokenizer.encode("</think>\n\n")
    async with make_policy(policy_model, seed=5) as policy:
        reused = await continue_rows(policy, prompts, close_think)
        # every first call ended at its budget; its prompt and 5 fed tokens are reused
        assert policy.prefixes.hits == len(prompts)
        assert policy.prefixes.reused_tokens == sum(len(p) + 5 for p in prompts)
    async with make_policy(policy_model, seed=5, prefix_cache_bytes=0) as policy:
        fresh = await continue_rows(policy, prompts, close_think)
        assert policy.prefixes.hits == 0
    for a, b in zip(reused, fresh):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-4)


async def test_the_prefix_store_is_bounded_and_cleared(policy_model, prompts) -> None:
    async with make_policy(policy_model, prefix_cache_bytes=1) as policy:
        await continue_rows(policy, prompts, [])
        assert policy.prefixes.hits == 0  # no row's cache fits in one byte
    async with make_policy(policy_model) as policy:
        await continue_rows(policy, prompts, [], between=policy.clear_prefix_cache)  # what a weight update does
        assert policy.prefixes.hits == 0
        await continue_rows(policy, prompts, [])
        assert policy.prefixes.hits == len(prompts)


async def test_concurrent_calls_are_batched_and_get_their_own_budgets(policy_model, prompts) -> None:
    """Rows with different budgets leave the batch at different steps; the rows left behind must
    keep their own KV cache, which the log-probs (sensitive to every cached key) verify."""
    budgets = [1, 5, 3, 9, 2]
    params = [SamplingParams(max_tokens=n, temperature=1.0) for n in budgets]
    async with make_policy(policy_model, max_batch=2, seed=4) as policy:
        outs = await gather(policy, prompts, params)
        assert policy.batch_sizes == [2, 2, 1]
    async with make_policy(policy_model, max_batch=8, seed=4) as policy:
        outs_one_batch = await gather(policy, prompts, params)
        assert policy.batch_sizes == [5]
    for prompt, out, again, n in zip(prompts, outs, outs_one_batch, budgets):
        assert len(out.token_ids) == len(out.log_probs) == n
        assert out.finish_reason == again.finish_reason == "length"
        assert out.token_ids == again.token_ids
        np.testing.assert_allclose(again.log_probs, policy.compute_log_probs(prompt, again.token_ids), atol=1e-4)
        np.testing.assert_allclose(out.log_probs, again.log_probs, atol=1e-4)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=16, temperature=1.0),
        SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, top_k=50),
        SamplingParams(max_tokens=16, temperature=0.0),
    ],
    ids=["t1.0", "t0.7-topp-topk", "greedy"],
)
async def test_log_probs_match_a_recompute(policy_model, prompts, params) -> None:
    async with make_policy(policy_model, seed=5) as policy:
        outs = await gather(policy, prompts, params)
    for prompt, out in zip(prompts, outs):
        recomputed = policy.compute_log_probs(prompt, out.token_ids, temperature=params.temperature)
        assert recomputed.shape == (len(out.token_ids),)
        np.testing.assert_allclose(out.log_probs, recomputed, atol=1e-4)


async def test_sampling_is_reproducible_and_independent_of_batching(policy_model, prompts) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0)
    async with make_policy(policy_model, seed=11) as policy:
        batched = await gather(policy, prompts, params)
    async with make_policy(policy_model, seed=11) as policy:
        sequential = [await policy.generate(p, params) for p in prompts]
    async with make_policy(policy_model, seed=12) as policy:
        other_seed = await gather(policy, prompts, params)
    assert [g.token_ids for g in batched] == [g.token_ids for g in sequential]
    assert [g.token_ids for g in batched] != [g.token_ids for g in other_seed]


async def test_sampling_does_not_depend_on_the_order_concurrent_calls_arrive_in(policy_model, prompts) -> None:
    """Agents running concurrently call in an order set by timing; a seeded row must not follow it.
    Repeats of one prompt (the n rollouts of a group) still draw differently."""
    params = SamplingParams(max_tokens=10, temperature=1.0)
    async with make_policy(policy_model, seed=11) as policy:
        forward = await gather(policy, prompts + [prompts[0]], params)
    async with make_policy(policy_model, seed=11) as policy:
        backward = await gather(policy, [prompts[0]] + prompts[::-1], params)
    assert [g.token_ids for g in forward[1:-1]] == [g.token_ids for g in backward[1:-1][::-1]]
    # the first and second call with prompts[0] come first and last in both orders
    assert (forward[0].token_ids, forward[-1].token_ids) == (backward[0].token_ids, backward[-1].token_ids)
    assert forward[0].token_ids != forward[-1].token_ids


async def test_logprobs_false_returns_none(policy_model, prompts) -> None:
    async with make_policy(policy_model) as policy:
        out = await policy.generate(prompts[0], SamplingParams(max_tokens=3, temperature=0.0, logprobs=False))
    assert out.log_probs is None and len(out.token_ids) == 3


async def test_certain_end_token_stops_with_the_end_token_included(policy_model, prompts, eos_bias) -> None:
    async with make_policy(policy_model, seed=0) as policy:
        outs = await gather(policy, prompts[:3], SamplingParams(max_tokens=8, temperature=1.0))
    for out in outs:
        assert out.token_ids == [IM_END]
        assert out.finish_reason == "stop"
        assert out.log_probs[0] == pytest.approx(0.0, abs=1e-6)


async def test_rows_stop_independently_inside_a_batch(policy_model, prompts) -> None:
    """Declare a token that a seeded sample reaches mid-way as the end token of a second policy
    with the same seed: that row stops there (end token kept), the other row runs to its budget
    unchanged. (Greedy decoding of the random model repeats one token, so it cannot be used.)"""
    params = SamplingParams(max_tokens=12, temperature=1.0)
    async with make_policy(policy_model, seed=3) as policy:
        first, second = await gather(policy, prompts[:2], params)
    cut = next(i for i in range(2, 12) if first.token_ids[i] not in first.token_ids[:i] + second.token_ids)
    end = first.token_ids[cut]
    async with TransformersPolicy(policy_model, [end], batch_wait_s=0.05, seed=3) as policy:
        stopped, running = await gather(policy, prompts[:2], params)
        assert policy.batch_sizes == [2]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == first.token_ids[: cut + 1]
    np.testing.assert_allclose(stopped.log_probs, first.log_probs[: cut + 1], atol=1e-4)
    assert running.finish_reason == "length"
    assert running.token_ids == second.token_ids
    np.testing.assert_allclose(running.log_probs, second.log_probs, atol=1e-4)


async def test_a_failing_batch_fails_every_caller_and_the_worker_survives(
    policy_model, prompts, broken_model
) -> None:
    async with make_policy(policy_model) as policy:
        results = await asyncio.wait_for(
            asyncio.gather(*[policy.generate(p, GREEDY) for p in prompts[:3]], return_exceptions=True), NO_HANG_S
        )
        assert policy.batch_sizes == [3]
        assert all(isinstance(r, RuntimeError) and "simulated device failure" in str(r) for r in results)


async def test_worker_serves_again_after_a_failed_batch(policy_model, prompts) -> None:
    async with make_policy(policy_model) as policy:
        def fail(module, args):
            raise RuntimeError("simulated device failure")

        handle = policy_model.model.layers[0].register_forward_pre_hook(fail)
        try:
            with pytest.raises(RuntimeError, match="simulated"):
                await asyncio.wait_for(policy.generate(prompts[0], GREEDY), NO_HANG_S)
        finally:
            handle.remove()
        out = await asyncio.wait_for(policy.generate(prompts[0], GREEDY), NO_HANG_S)
    assert len(out.token_ids) == GREEDY.max_tokens


async def test_bad_prompts_fail_only_their_caller(policy_model, prompts) -> None:
    max_positions = policy_model.config.max_position_embeddings
    async with make_policy(policy_model) as policy:
        too_long, out_of_vocab, empty, good = await asyncio.wait_for(
            asyncio.gather(
                policy.generate([1] * max_positions, GREEDY),
                policy.generate([5, 10**6], GREEDY),
                policy.generate([], GREEDY),
                policy.generate(prompts[0], GREEDY),
                return_exceptions=True,
            ),
            NO_HANG_S,
        )
    assert isinstance(too_long, ValueError) and f"prompt length {max_positions}" in str(too_long)
    assert isinstance(out_of_vocab, ValueError) and "1000000" in str(out_of_vocab)
    assert isinstance(empty, ValueError) and "prompt_ids" in str(empty)
    assert isinstance(good, Generation) and len(good.token_ids) == GREEDY.max_tokens


async def test_cancelled_caller_does_not_disturb_the_others(policy_model, prompts) -> None:
    async with make_policy(policy_model) as policy:
        doomed = asyncio.ensure_future(policy.generate(prompts[0], GREEDY))
        kept = asyncio.ensure_future(policy.generate(prompts[1], GREEDY))
        await asyncio.sleep(0)
        doomed.cancel()
        out = await asyncio.wait_for(kept, NO_HANG_S)
    assert doomed.cancelled() and len(out.token_ids) == GREEDY.max_tokens


async def test_closed_policy_refuses_calls(policy_model, prompts) -> None:
    policy = make_policy(policy_model)
    await policy.generate(prompts[1], SamplingParams(max_tokens=2, temperature=0.0))
    await policy.close()
    with pytest.raises(RuntimeError, match="closed"):
        await policy.generate(prompts[1], GREEDY)


def test_compute_log_probs_validates_and_handles_empty_responses(policy_model, prompts) -> None:
    policy = make_policy(policy_model)
    assert policy.compute_log_probs(prompts[0], []).shape == (0,)
    with pytest.raises(ValueError, match="response_ids"):
        policy.compute_log_probs(prompts[0], [-1])
    with pytest.raises(ValueError, match="temperature"):
        policy.compute_log_probs(prompts[0], [5], temperature=-1.0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eos_token_ids": []}, "eos_token_ids"),
        ({"max_batch": 0}, "max_batch"),
        ({"batch_wait_s": -1}, "batch_wait_s"),
        ({"prefix_cache_bytes": -1}, "prefix_cache_bytes"),
    ],
)
def test_constructor_validation(policy_model, kwargs, field) -> None:
    args = {"eos_token_ids": [IM_END], **kwargs}
    with pytest.raises(ValueError, match=field):
        TransformersPolicy(policy_model, **args)


def test_top_k_and_top_p_restrict_the_draw() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 2.8, -1.0]] * 3)
    params = [
        SamplingParams(max_tokens=1, top_k=2),  # only tokens 1 and 2
        SamplingParams(max_tokens=1, top_p=0.5),  # token 1 alone holds < 0.5, so 1 and 2
        SamplingParams(max_tokens=1, top_p=1e-6),  # the single most likely token
    ]
    generators = [torch.Generator().manual_seed(s) for s in range(3)]
    seen: list[set[int]] = [set(), set(), set()]
    for _ in range(200):
        tokens, log_probs = sample_next_tokens(logits, params, generators)
        for i, token in enumerate(tokens):
            seen[i].add(token)
        # the reported log-prob ignores filtering: it is the plain softmax at temperature 1
        expected = torch.log_softmax(logits[0], -1)[torch.tensor(tokens)]
        np.testing.assert_allclose(log_probs, expected.numpy(), atol=1e-6)
    assert seen == [{1, 2}, {1, 2}, {1}]


def test_sampling_follows_the_distribution() -> None:
    """4000 seeded draws land near the true probabilities; a zero-probability token never appears."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    params = [SamplingParams(max_tokens=1, temperature=1.0)]
    generator = [torch.Generator().manual_seed(0)]
    draws = [sample_next_tokens(probs.log()[None], params, generator)[0][0] for _ in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[1] == 0.0
    np.testing.assert_allclose(freq, probs.numpy(), atol=0.03)  # ~4 standard deviations


def _draw_after_sorting_everything(scaled: torch.Tensor, top_p: float, generator: torch.Generator) -> int:
    """Top-p as a sort of the whole vocabulary, then one inverse-CDF draw: the rule written out."""
    values, indices = torch.sort(scaled, descending=True)
    probs = torch.softmax(values, dim=-1)
    probs = probs * (probs.cumsum(0) - probs < top_p)
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    return int(indices[torch.searchsorted(cdf, u, right=True)])


def test_top_p_draws_as_a_whole_sort_would_whether_or_not_the_nucleus_lies_in_the_probe() -> None:
    """Peaked rows find their nucleus among the NUCLEUS_PROBE likeliest tokens, flat rows reach past
    them and sort the whole vocabulary; each row, batched with rows of the other kind, alone, and by
    the rule written out, draws the same tokens from the same generator."""
    vocab, top_p, temperature = 2000, 0.95, 0.8
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(3, vocab, generator=g)
    peaked[:, :6] += 10  # a nucleus of a few tokens
    flat = torch.randn(3, vocab, generator=g)
    logits = torch.stack([peaked[0], flat[0], peaked[1], flat[1], peaked[2], flat[2]])
    nucleus = [int((torch.sort(torch.softmax(r / temperature, -1), descending=True).values.cumsum(0) < top_p).sum()) + 1 for r in logits]
    assert [n <= NUCLEUS_PROBE for n in nucleus] == [True, False] * 3, nucleus
    params = [SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)] * len(logits)

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(len(logits))]

    batched_g, alone_g, rule_g = generators(), generators(), generators()
    for _ in range(100):
        batched, _ = sample_next_tokens(logits, params, batched_g)
        alone = [sample_next_tokens(logits[i : i + 1], params[:1], alone_g[i : i + 1])[0][0] for i in range(len(logits))]
        rule = [_draw_after_sorting_everything(logits[i] / temperature, top_p, rule_g[i]) for i in range(len(logits))]
        assert batched == alone == rule
