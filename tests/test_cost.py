"""The cost ledger (infmem_verl/cost.py) and the config side of the levers that cut it.

The ledger's counts against a CPU training step are checked in tests/test_metrics_tb.py (levers off)
and tests/test_cpu_training_runs.py (levers b, c, d on);
scoring inside the agent loop (lever a) in tests/test_verl_reward.py.
"""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from tensordict import TensorDict

from infmem_verl.agent.errors import ConfigError
from infmem_verl.cost import (
    Call,
    Passes,
    Pipeline,
    Row,
    apply_cost_levers,
    budget_trajectory,
    check_droppable,
    dry_run_ledger,
    estimate_step,
    kept_loss_scale,
    pipeline_of,
    rows_to_train,
    step_ledger,
    zero_advantage_rows,
)
from infmem_verl.main import prepare_config
from infmem_verl.settings import TrainSettings, agent_settings, cost_settings


RANKS = 2  # data-parallel ranks of the zero-advantage drop's gradient check


def make_config(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=list(overrides))


# ------------------------------------------------------------------------------- the ledger


def test_ledger_counts_each_pass_over_the_rows_it_got():
    # Two trajectories of two sequences, and one verl padding row.
    rows = [
        Row("u0_0_0", 100, 20, loss_tokens=18),
        Row("u0_0_1", 50, 10, loss_tokens=10),
        Row("u0_1_0", 300, 40, loss_tokens=40),
        Row("u0_1_1", 70, 5, loss_tokens=4),
        Row("pad_0_0", 127, 1, padding=True),
    ]
    calls = {r.key: Call(2, 2 * r.prompt + 7, r.loss_tokens) for r in rows if not r.padding}
    passes = Passes(old_log_prob=rows, reference=(), update=rows[:3])
    ledger = step_ledger(rows, calls, passes, reward_remote=True, log_probs=True)
    assert (ledger.rows, ledger.padding_rows, ledger.llm_calls) == (5, 1, 8)
    assert ledger.prefill_tokens == 2 * (100 + 50 + 300 + 70) + 4 * 7
    assert ledger.decode_tokens == ledger.loss_tokens == 72
    assert ledger.old_log_prob_tokens == 120 + 60 + 340 + 75 + 128 and ledger.reference_tokens == 0
    assert (ledger.update_rows, ledger.update_tokens) == (3, 120 + 60 + 340)
    assert ledger.tokens_per_loss_token == pytest.approx((723 + 520) / 72)
    # verl pads each trajectory's sequences to its longest prompt, response and sequence.
    assert ledger.reward_bytes == 8 * 2 * (100 + 20 + 3 * 120) + 8 * 2 * (300 + 40 + 3 * 340)
    metrics = ledger.metrics()
    assert metrics["infmem/cost/update_tokens"] == 520 and metrics["infmem/cost/trainer_tokens"] == 1243
    assert step_ledger(rows, calls, passes, reward_remote=False, log_probs=True).reward_bytes == 0


def test_estimates_change_only_what_each_lever_says():
    trajectory = [(1000, 100, 90, Call(2, 2100, 90)), (400, 50, 50, Call(1, 400, 50))]
    trajectories = [trajectory] * 8  # 2 groups of n=4
    base = estimate_step(trajectories, Pipeline("reference"), batch_multiple=32, zero_advantage_groups=[True], n=4)
    assert (base.rows, base.padding_rows) == (32, 16)
    assert base.old_log_prob_tokens == base.reference_tokens == base.update_tokens == 8 * 1550 + 16 * 128

    def with_(**lever) -> dict:
        pipeline = Pipeline("lever", **lever)
        ledger = estimate_step(trajectories, pipeline, batch_multiple=32, zero_advantage_groups=[True], n=4)
        return {k: v for k, v in vars(ledger).items() if v != vars(base)[k]}

    assert with_(reward_remote=False) == {"reward_bytes": 0}
    assert with_(old_log_prob=False) == {"old_log_prob_tokens": 0}
    assert with_(reference=False) == {"reference_tokens": 0}
    # Group 0 carries no gradient, but the update needs 32 rows: its 8 rows and the 16 padding rows
    # fill the 8 kept ones up to 32, so nothing is dropped...
    assert with_(drop_zero_advantage=True) == {}
    # ...while with 8 rows per update (no padding) its rows are left out.
    drop = Pipeline("c", drop_zero_advantage=True)
    ledger = estimate_step(trajectories, drop, batch_multiple=8, zero_advantage_groups=[True], n=4)
    assert (ledger.update_rows, ledger.update_tokens, ledger.rows) == (8, 4 * 1550, 16)


def test_dropped_rows_are_filled_up_with_rows_that_carry_no_gradient():
    rows = [
        Row("a", 100, 10, 10),
        Row("z_long", 900, 10, 10, zero_advantage=True),
        Row("b", 200, 10, 10),
        Row("z_short", 50, 10, 10, zero_advantage=True),
        Row("z_mid", 300, 10, 10, zero_advantage=True),
        Row("pad", 127, 1, padding=True),
    ]
    assert [r.key for r in rows_to_train(rows, 2)] == ["a", "b"]
    assert [r.key for r in rows_to_train(rows, 4)] == ["a", "b", "pad", "z_short"]  # padding first, then short
    assert rows_to_train(rows, 6) is None  # all of them: nothing to drop
    assert rows_to_train([r for r in rows if r.key.startswith(("z", "pad"))], 2) is None  # nothing to train


def test_the_dry_run_prints_the_ledger_from_the_budgets():
    config = make_config("+recipe=infmem_4b")
    prepare_config(config)
    cfg = agent_settings(config)
    rows = budget_trajectory(cfg, "infmem", 32768)
    assert len(rows) == 2 * 7 + 1 and rows[1][0] == cfg.write.prompt_tokens
    reference, ours, grouped, objective = dry_run_ledger(config)
    assert reference.startswith("cost per RL step, reference (at most, 32768-token documents): 7,680 rows")
    assert "reward call 0 MiB" in ours and "reward call 0 MiB" not in reference
    assert "21.32 per loss token (1.00 of the reference's)" in ours  # the reference objective: every pass
    assert grouped.startswith("cost per RL step, this config with a prefix-grouped forward (not in verl 0.9.1's engine)")
    assert objective.startswith("objective of this config: kl_loss_coef 0.001, old log-probs recomputed by the trainer")
    assert "0.25 of the reference's trainer tokens is with the KL loss off and rollout log-probs standing in" in objective
    # Each Write's 5,000-token chunk is counted once per micro-batch of a group's n=4 Writes: a
    # budget-bound Write is 11,596 tokens, so the update's 20,480-token cap packs 2 of them (the
    # chunk saved once per group and Write slot), the reference's 40,960 all 4 (saved 3 times).
    saved = 128 * 7 * cfg.document.chunk_tokens  # groups x Write slots x chunk
    every = 128 * 4 * sum(p + r for p, r, *_ in rows)  # a pass over all 7,680 rows, none padding
    assert f"update {every / 1e6:.1f}M" in ours and f"update {(every - 2 * saved) / 1e6:.1f}M" in grouped
    assert f"reference {(every - 3 * saved) / 1e6:.1f}M" in grouped


# ------------------------------------------------------ the prefix-grouped forward (lever g)


def test_grouped_passes_count_each_shared_prefix_once_per_micro_batch():
    from infmem_verl.cost import pass_tokens

    rows = [Row(f"u0_{s}_1", 1000, 100, prefix_group="u0#1", shared_prefix=800) for s in range(4)]
    lone = Row("u1_0_1", 500, 50, prefix_group="u1#1", shared_prefix=400)  # no other row of its slot
    plain = Row("u2_0_0", 300, 30)
    batch = [*rows, lone, plain]
    assert pass_tokens(batch) == 4 * 1100 + 550 + 330
    assert pass_tokens(batch, grouped=True) == 800 + 4 * 300 + 550 + 330
    # A cap of 1,500 tokens holds the prefix and two suffixes: two micro-batches, each with the prefix.
    assert pass_tokens(batch, grouped=True, cap=1500) == 2 * (800 + 2 * 300) + 550 + 330
    whole = [Row(f"u3_{s}_0", 200, 20, prefix_group="u3#0", shared_prefix=200) for s in range(2)]
    assert pass_tokens(whole, grouped=True) == 199 + 2 * 21  # one prompt token stays with each row


def test_prefix_grouped_forward_gives_the_ungrouped_log_probs_and_gradients(tiny_model_dir, tokenizer):
    """Real chunk_first Write prompts of three rollouts (their memories differ) on the tiny model:
    the grouped forward's log-probs, entropies and verl ppo_loss gradients are the row-by-row ones."""
    from transformers import AutoModelForCausalLM
    from verl.utils.config import omega_conf_to_dataclass

    from infmem_verl.agent.config import AgentConfig
    from infmem_verl.agent.protocol import PromptBuilder
    from infmem_verl.cost import pass_tokens
    from infmem_verl.cpu.engine import row_tensordict, score_prefix_group, score_response, sequence_scores

    builder = PromptBuilder(tokenizer, AgentConfig(write_layout="chunk_first"))
    question = tokenizer.encode("Who designed the bridge over the river?")
    chunk = tokenizer.encode("The bridge over the river was designed by an engineer from the north. " * 12)
    memories = ["", "The engineer came from the north.", "Nothing about the designer yet; the bridge is old."]
    prompts = [torch.as_tensor(builder.write(question, tokenizer.encode(m), chunk, None).ids) for m in memories]
    width = min(len(p) for p in prompts)
    prefix = int((torch.stack([p[:width] for p in prompts]) == prompts[0][:width]).all(dim=0).long().cumprod(0).sum())
    assert prefix > len(chunk)  # the rollouts part after the chunk
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, 5000, (k,), generator=generator) for k in (9, 4, 13)]

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    actor = omega_conf_to_dataclass(make_config("+recipe=smoke").actor_rollout_ref.actor)  # KL loss on
    tokens = sum(len(r) for r in responses)

    def loss(scores) -> torch.Tensor:
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss

        total = 0
        for prompt, response, score, sign in zip(prompts, responses, scores, (1.0, -0.5, 0.25), strict=True):
            with torch.no_grad():
                old = score.log_probs + 0.2 * torch.randn(len(response), generator=torch.Generator().manual_seed(len(response)))
            row = {"prompts": prompt, "responses": response, "response_mask": torch.ones(len(response), dtype=torch.long),
                   "old_log_probs": old, "ref_log_prob": old - 0.1, "advantages": torch.full((len(response),), sign)}  # fmt: skip
            data = row_tensordict(row, ("response_mask", "old_log_probs", "ref_log_prob", "advantages"))
            tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=tokens, global_batch_size=len(prompts))
            total = total + ppo_loss(config=actor, model_output=sequence_scores(score, len(prompt)), data=data)[0]
        return total

    def gradient(scores) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss(scores).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain = [score_response(model, p, r, 0.8, entropy=True) for p, r in zip(prompts, responses, strict=True)]
    expected = gradient(plain)
    grouped = score_prefix_group(model, prompts, responses, prefix, 0.8, entropy=True)
    for a, b in zip(plain, grouped, strict=True):
        torch.testing.assert_close(b.log_probs, a.log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.entropy, a.entropy, rtol=0, atol=1e-5)
    got = gradient(score_prefix_group(model, prompts, responses, prefix, 0.8, entropy=True))
    assert expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # The ledger counts the tokens this packed sequence holds.
    rows = [Row(f"u0_{i}_1", len(p), len(r), prefix_group="u0#1", shared_prefix=prefix) for i, (p, r) in enumerate(zip(prompts, responses))]
    assert pass_tokens(rows, grouped=True) == prefix + sum(len(p) - prefix + len(r) for p, r in zip(prompts, responses))
    with pytest.raises(ValueError, match=r"prefix_len: expected 1\.\.\d+ tokens every prompt starts with"):
        score_prefix_group(model, prompts, responses, prefix + 1, 0.8, entropy=False)


# -------------------------------------------------------------------- levers in the config


def test_pipeline_follows_the_lever_keys():
    assert pipeline_of(make_config("+recipe=infmem_4b")) == Pipeline("config", reward_remote=False)
    bypass = make_config("+recipe=infmem_4b", "algorithm.rollout_correction.bypass_mode=true")
    assert not pipeline_of(bypass).old_log_prob
    remote = make_config("+recipe=infmem_4b", "infmem.cost.score_in_agent_loop=false")
    assert pipeline_of(remote).reward_remote


def test_no_reference_pass_at_zero_kl_and_only_then():
    from verl.trainer.ppo.utils import need_reference_policy

    zero = make_config("+recipe=infmem_4b", "actor_rollout_ref.actor.kl_loss_coef=0")
    assert prepare_config(zero).cost_changes and not need_reference_policy(zero)
    for overrides in (
        [],  # the reference's 0.001
        ["actor_rollout_ref.actor.kl_loss_coef=0", "infmem.cost.skip_reference_at_zero_kl=false"],
        ["actor_rollout_ref.actor.kl_loss_coef=0", "algorithm.use_kl_in_reward=true"],
    ):
        config = make_config("+recipe=infmem_4b", *overrides)
        assert apply_cost_levers(config, cost_settings(config)) == [] and need_reference_policy(config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], r"zero-advantage rows still carry the KL loss"),
        (["actor_rollout_ref.actor.kl_loss_coef=0", "actor_rollout_ref.actor.entropy_coeff=0.01"], r"entropy bonus"),
        (
            ["actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
            r"loss_agg_mode: infmem\.cost\.drop_zero_advantage supports \['token-mean', 'token-sum'\]",
        ),
        (["+infmem.cost.drop_rows=true"], r"infmem\.cost\.drop_rows: unknown key"),
    ],
)
def test_dropping_rows_where_it_would_change_the_objective_is_refused(overrides, message):
    config = make_config("+recipe=infmem_4b", "infmem.cost.drop_zero_advantage=true", *overrides)
    with pytest.raises(ConfigError, match=message):
        prepare_config(config)


# -------------------------------------------------- lever c: the gradient without the rows


def _log_probs(model, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of ``response`` after ``prompt``, laid out over the whole sequence as
    verl's engines return them (position t scores token t + 1)."""
    ids = torch.cat([prompt, response]).unsqueeze(0)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    scores = torch.log_softmax(logits, dim=-1).gather(1, response.unsqueeze(1)).squeeze(1)
    return torch.cat([scores.new_zeros(len(prompt) - 1), scores, scores.new_zeros(1)])


def _gradient(model, actor, rows, advantages: list[torch.Tensor], ranks: int) -> torch.Tensor:
    """The gradient of verl's ``ppo_loss`` over ``rows`` as one mini-batch (normalised over it),
    dealt round-robin to ``ranks`` data-parallel ranks as verl's FSDP engine trains them: each rank
    scales its loss by ``dp_size`` over the mini-batch's token count summed over all ranks (the
    all-reduce in ``forward_backward_batch``, verl/workers/engine/fsdp/transformer_impl.py), and
    the ranks' gradients are averaged (FSDP's gradient reduction)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    tokens = int(sum(int(r["response_mask"].sum()) for r in rows))
    per_rank = []
    for rank in range(ranks):
        model.zero_grad(set_to_none=True)
        for row, advantage in list(zip(rows, advantages, strict=True))[rank::ranks]:
            fields = {**row, "advantages": advantage}
            data = TensorDict({k: v.unsqueeze(0) for k, v in fields.items()}, batch_size=1)
            data["attention_mask"] = torch.ones(1, len(row["prompts"]) + len(row["responses"]), dtype=torch.long)
            tu.assign_non_tensor(data, dp_size=ranks, batch_num_tokens=tokens, global_batch_size=len(rows))
            output = {"log_probs": _log_probs(model, row["prompts"], row["responses"])}
            loss, _ = ppo_loss(config=actor, model_output=output, data=data)
            loss.backward()
        per_rank.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    return torch.stack(per_rank).mean(dim=0)


# Checked at 2 data-parallel ranks, where the full batch and the kept rows are dealt to the ranks
# differently (rows 0, 2, 4 | 1, 3, 5 against 0, 4 | 1, 5), as verl's balancing of the kept rows
# deals them anew; one rank (the CPU backend's engine) is the same sum without the partition.
@pytest.mark.parametrize("normalization", ["token_mean", "trajectory"])
def test_dropping_zero_advantage_rows_keeps_the_gradient(tiny_model_dir, tokenizer, normalization):
    from transformers import AutoModelForCausalLM
    from verl.utils.config import omega_conf_to_dataclass

    from infmem_verl.verl_plugin.trainer import shape_advantages

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    config = make_config("+recipe=smoke", "actor_rollout_ref.actor.use_kl_loss=false")
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    check_droppable(actor)
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor(tokenizer.encode("The quick brown fox jumps over the lazy dog near the river bank " * 4))
    # Three trajectories of two sequences; GRPO gave trajectory 1 a zero advantage.
    keys = [f"u0_{s}_{i}" for s in range(3) for i in range(2)]
    trajectory_advantage = {"u0_0": 1.0, "u0_1": 0.0, "u0_2": -0.5}
    rows, lengths = [], [(6, 4), (9, 7), (5, 3), (12, 6), (7, 5), (8, 8)]
    for key, (p, r) in zip(keys, lengths, strict=True):
        start = int(torch.randint(0, len(ids) - p - r, (1,), generator=generator))
        prompt, response = ids[start : start + p], ids[start + p : start + p + r]
        mask = torch.ones(r, dtype=torch.long)
        mask[-1] = 0 if key.endswith("_1") else 1  # a token the loop injected
        with torch.no_grad():
            scores = _log_probs(model, prompt, response)[p - 1 : p - 1 + r]
        # old log-probs off by a little, so the ratio is not 1 and some tokens are clipped
        old = scores + 0.3 * torch.randn(r, generator=generator)
        rows.append({"prompts": prompt, "responses": response, "response_mask": mask, "old_log_probs": old})
    width = max(r for _, r in lengths)
    masks = torch.stack([torch.nn.functional.pad(row["response_mask"], (0, width - len(row["response_mask"]))) for row in rows])
    advantages = torch.tensor([[trajectory_advantage[k.rsplit("_", 1)[0]]] * width for k in keys])
    shaped = shape_advantages(keys, advantages, masks, [None] * len(keys), TrainSettings(loss_normalization=normalization))
    per_row = [shaped[i, : len(row["responses"])] for i, row in enumerate(rows)]

    full = _gradient(model, actor, rows, per_row, RANKS)
    zero = zero_advantage_rows(shaped, masks).tolist()
    assert zero == [False, False, True, True, False, False]
    kept = [i for i, z in enumerate(zero) if not z]
    tokens = masks.sum(dim=1)
    scale = kept_loss_scale(actor.loss_agg_mode, int(tokens[kept].sum()), int(tokens.sum()))
    dropped = _gradient(model, actor, [rows[i] for i in kept], [per_row[i] * scale for i in kept], RANKS)
    assert full.abs().max() > 0
    torch.testing.assert_close(dropped, full, rtol=1e-5, atol=1e-7)
    unscaled = _gradient(model, actor, [rows[i] for i in kept], [per_row[i] for i in kept], RANKS)
    assert not torch.allclose(unscaled, full, rtol=1e-3)  # the normalisation is what the scale keeps


# ------------------------------------------ lever e: the chunk before the memory in a Write


@pytest.mark.parametrize("with_evidence", [False, True])
def test_chunk_first_writes_of_a_group_share_the_prompt_through_the_chunk(tokenizer, with_evidence):
    from infmem_verl.agent.config import AgentConfig
    from infmem_verl.agent.protocol import PromptBuilder

    question = tokenizer.encode("Who designed the bridge?")
    chunk = tokenizer.encode("The bridge over the river was designed by an engineer from the north. " * 20)
    memories = [tokenizer.encode(f"Notes of rollout {i}: the engineer is unnamed so far.") for i in range(2)]
    evidence = [[tokenizer.encode(f"Passage {i} about rivers.")] if with_evidence else None for i in range(2)]

    def shared_prefix(write_layout: str) -> tuple[int, list]:
        builder = PromptBuilder(tokenizer, AgentConfig(write_layout=write_layout))
        prompts = [builder.write(question, m, chunk, e).ids for m, e in zip(memories, evidence, strict=True)]
        same = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
        return same, prompts

    memory_first, old = shared_prefix("memory_first")
    chunk_first, new = shared_prefix("chunk_first")
    assert chunk_first > memory_first + len(chunk)  # the rollouts' prompts part only after the chunk
    assert sorted(old[0].tolist()) == sorted(new[0].tolist())  # the same tokens, in another order
    text = PromptBuilder(tokenizer, AgentConfig(write_layout="chunk_first")).decode(new[0])
    assert text.index("<question>") < text.index("<current_chunk>") < text.index("<previous_memory>")


def test_chunk_first_writes_are_served_from_the_real_vllm_prefix_cache(vllm_server, tokenizer):
    from bench.train_cost import measure_prefix_cache

    def measured(write_layout: str, seed: int):
        return measure_prefix_cache(vllm_server.url, tokenizer, write_layout, samples=1, n=2, doc_tokens=4000, seed=seed)

    memory_first, chunk_first = measured("memory_first", 31), measured("chunk_first", 32)
    assert memory_first.queries > 0 and chunk_first.queries > 0
    # The second rollout's Write prompts hit the first one's cached chunk (2000 tokens a chunk).
    assert chunk_first.hits - memory_first.hits > 1500
