"""A single-process torch engine: what verl's FSDP actor computes, on one CPU process.

verl's training engines (FSDP, Megatron) need a GPU process group. On CPU one process holds the
whole model, so this engine does the same work without sharding: per-token log-probs and entropy
of responses (``log_softmax(logits / temperature)``, the quantity the rollout reports), and PPO
optimizer steps whose loss is **verl's own** ``ppo_loss`` (policy loss by ``policy_loss.loss_mode``,
entropy bonus, KL to the reference with ``kl_loss_type``), with verl's loss normalization over
the mini-batch, optimizer and learning-rate schedule.

Sequences are processed one at a time (a micro-batch is one prompt + response), so no token is
padded; logits are computed at the response positions only, because vocabulary-sized logits for
a 5000-token prompt would cost gigabytes for nothing. No verl worker or process group is involved.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.utils.metric import Metric
from verl.utils.py_functional import append_to_dict
from verl.utils.torch_functional import (
    entropy_from_logits,
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    logprobs_from_logits_naive,
)
from verl.workers.config import ActorConfig
from verl.workers.config.optimizer import build_optimizer
from verl.workers.utils.losses import ppo_loss

# Fields of a training row that verl's ppo_loss reads (besides the token ids).
LOSS_FIELDS = ("response_mask", "old_log_probs", "advantages")


@dataclass
class TokenScores:
    """Per-response-token outputs of one forward pass: log-probs and (optionally) entropy."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None


def load_model(path: str) -> torch.nn.Module:
    """A causal LM from a local folder, in float32 (CPU training keeps full precision)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def score_response(
    model: torch.nn.Module, prompt: torch.Tensor, response: torch.Tensor, temperature: float, entropy: bool
) -> TokenScores:
    """Log-probs (and entropy) of ``response`` after ``prompt`` at ``temperature``, differentiable.

    The logits of position ``t`` predict token ``t + 1``, so the ``len(response) + 1`` last
    positions hold everything needed; the final one (after the last token) is dropped.
    """
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0 (verl divides logits by it), got {temperature!r}")
    input_ids = torch.cat([prompt, response]).unsqueeze(0)
    logits = model(input_ids=input_ids, logits_to_keep=len(response) + 1, use_cache=False).logits[0, :-1]
    logits = logits.float() / temperature
    # verl's log_softmax + gather; its default (a per-row loop that saves GPU memory) costs far more
    # on CPU, and a response's [tokens, vocab] logits are small enough to take whole.
    return TokenScores(
        log_probs=logprobs_from_logits_naive(logits, response),
        entropy=entropy_from_logits(logits) if entropy else None,
    )


def score_prefix_group(
    model: torch.nn.Module,
    prompts: Sequence[torch.Tensor],
    responses: Sequence[torch.Tensor],
    prefix_len: int,
    temperature: float,
    entropy: bool,
) -> list[TokenScores]:
    """What :func:`score_response` gives for each row, with the rows' first ``prefix_len`` prompt
    tokens (the same in every row) computed once: the prefix-grouped forward (``infmem_verl.cost``).

    One packed sequence ``[prefix, suffix_1, ..., suffix_k]`` (a suffix: the rest of a row's prompt
    and its response) goes through the model with the ``prefix_grouper`` package's attention
    split: the prefix attends to itself, each suffix to the prefix and to itself, and each suffix's
    positions continue the prefix's (verl's ``build_position_ids_for_prefix_grouper``). Every layer
    but attention runs once over ``prefix_len + sum(suffix lengths)`` tokens; logits are taken at
    the response positions only. Differentiable: the prefix's activations collect every row's
    gradient. The model must use transformers' ``sdpa`` attention (:func:`_grouped_sdpa`).
    """
    from prefix_grouper import PrefixGrouper
    from verl.trainer.ppo.prefix_grouper_utils import build_position_ids_for_prefix_grouper

    if model.config._attn_implementation != "sdpa":
        raise ValueError(f"score_prefix_group: needs the model's sdpa attention, got {model.config._attn_implementation!r}")
    if temperature <= 0:
        raise ValueError(f"temperature: expected > 0 (verl divides logits by it), got {temperature!r}")
    prefix = prompts[0][:prefix_len]
    if not 0 < prefix_len <= min(len(p) for p in prompts) or any(not torch.equal(p[:prefix_len], prefix) for p in prompts):
        raise ValueError(f"prefix_len: expected 1..{min(len(p) for p in prompts)} tokens every prompt starts with, got {prefix_len}")
    _install_grouped_sdpa()
    suffixes = [torch.cat([p[prefix_len:], r]).long() for p, r in zip(prompts, responses, strict=True)]
    width = max(len(x) for x in suffixes)
    suffix_ids = torch.stack([torch.nn.functional.pad(x, (0, width - len(x))) for x in suffixes])
    suffix_mask = torch.stack([torch.arange(width) < len(x) for x in suffixes])
    prefix_ids, prefix_mask = prefix.long().unsqueeze(0), torch.ones(1, prefix_len, dtype=torch.bool)
    grouper = PrefixGrouper.from_ungrouped_masks(prefix_mask, suffix_mask, group_sizes=[len(suffixes)])
    packed = grouper.concat_input(prefix_ids.unsqueeze(-1), prefix_mask, suffix_ids.unsqueeze(-1), suffix_mask).squeeze(-1)
    hidden = model.model(
        input_ids=packed,
        attention_mask=grouper.padding_mask,
        position_ids=build_position_ids_for_prefix_grouper(grouper),
        use_cache=False,
        prefix_grouper=grouper,
    ).last_hidden_state
    # Per row, the prefix's last position then its suffix: position j predicts suffix token j.
    _, _, per_row, _ = grouper.split_output(hidden, include_prefix_last=1)
    scores = []
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        start = len(prompt) - prefix_len
        logits = model.lm_head(per_row[row, start : start + len(response)]).float() / temperature
        scores.append(
            TokenScores(
                log_probs=logprobs_from_logits_naive(logits, response),
                entropy=entropy_from_logits(logits) if entropy else None,
            )
        )
    return scores


def _grouped_sdpa(module, query, key, value, attention_mask, *args, prefix_grouper=None, scaling=None, **kwargs):
    """transformers' ``sdpa`` attention, split by ``prefix_grouper`` when a call passes one.

    verl's patch (``monkey_patch.apply_prefix_grouper_patch``) hands the package's 2-D key-padding
    masks to the wrapped attention function unchanged, which suits flash attention (its causal mask
    aligns a shorter query block to the end of the keys) but not transformers' ``sdpa``, which
    wants a 4-D mask (it fails there with a shape error). This inner function builds that mask:
    causal, aligned to the end of the keys, keys present.
    """
    if prefix_grouper is None:
        return _SDPA[0](module, query, key, value, attention_mask, *args, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import repeat_kv

    def attend(q, k, v, keys_present):
        width, length = q.shape[2], k.shape[2]
        causal = torch.ones(width, length, dtype=torch.bool, device=q.device).tril(length - width)
        mask = causal & keys_present.bool()[:, None, None, :]
        k, v = repeat_kv(k, module.num_key_value_groups), repeat_kv(v, module.num_key_value_groups)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous()

    return prefix_grouper.forward(attend, query, key, value), None


_SDPA: list = []  # transformers' own sdpa function, once _grouped_sdpa stands in for it


def _install_grouped_sdpa() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if not _SDPA:
        _SDPA.append(ALL_ATTENTION_FUNCTIONS["sdpa"])
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _grouped_sdpa


@torch.no_grad()
def score_rows(
    model: torch.nn.Module, rows: Sequence[dict[str, torch.Tensor]], temperature: float, entropy: bool
) -> list[TokenScores]:
    """Log-probs (and entropy) of every row's response under ``model``, without gradients."""
    return [score_response(model, r["prompts"], r["responses"], temperature, entropy) for r in rows]


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, optim, key: str = "actor_rollout_ref.actor.optim"
) -> torch.optim.lr_scheduler.LRScheduler:
    """verl's learning-rate schedule for an optimizer config (constant or cosine, with warm-up), as
    its FSDP engine builds it; ``key`` is where ``optim`` sits in the config, named in the error."""
    warmup = optim.lr_warmup_steps
    if warmup <= 0:
        warmup = int(optim.lr_warmup_steps_ratio * optim.total_training_steps)
    if optim.lr_scheduler_type == "constant":
        return get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=warmup)
    if optim.lr_scheduler_type == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer=optimizer,
            num_warmup_steps=warmup,
            num_training_steps=optim.total_training_steps,
            min_lr_ratio=optim.min_lr_ratio,
            num_cycles=optim.num_cycles,
            zero_indexed_step=optim.zero_indexed_step,
        )
    raise ValueError(f"{key}.lr_scheduler_type: expected 'constant' or 'cosine', got {optim.lr_scheduler_type!r}")


def row_tensordict(row: dict[str, torch.Tensor], fields: Iterable[str]) -> TensorDict:
    """One sequence as the padded one-row TensorDict verl's ``ppo_loss`` accepts.

    With plain (not nested) tensors verl reads prompt and response lengths from
    ``attention_mask``; a single row has no padding, so the mask is all ones.
    """
    length = len(row["prompts"]) + len(row["responses"])
    tensors = {name: row[name].unsqueeze(0) for name in ("prompts", "responses", *fields)}
    tensors["attention_mask"] = torch.ones(1, length, dtype=torch.long)
    return TensorDict(tensors, batch_size=1)


def unbind_rows(data: TensorDict, fields: Sequence[str]) -> list[dict[str, torch.Tensor]]:
    """The rows of a TransferQueue batch (nested per-row tensors) as dicts of 1-D tensors."""
    columns = {name: data[name].unbind() for name in fields}
    return [{name: columns[name][i] for name in fields} for i in range(len(data))]


def merge_metrics(per_row: list[dict[str, Any]]) -> dict[str, float]:
    """Aggregate the micro-batch metrics of one optimizer step the way verl's workers do.

    ``ppo_loss`` tags each metric with its aggregation: a loss normalized over the whole
    mini-batch is a partial sum per micro-batch (SUM), ratios like the clip fraction are means
    (MEAN). Plain numbers (e.g. ``kl_coef``) are averaged.
    """
    merged: dict[str, Metric | list[Any]] = {}
    for metrics in per_row:
        append_to_dict(merged, metrics)  # verl's accumulation: Metrics merge, plain values list up
    return {
        key: float(value.aggregate()) if isinstance(value, Metric) else sum(map(float, value)) / len(value)
        for key, value in merged.items()
    }


class TorchEngine:
    """The trainable policy: a causal LM, verl's optimizer and schedule, verl's PPO loss.

    ``actor`` is verl's ``ActorConfig`` (``omega_conf_to_dataclass(actor_rollout_ref.actor)``,
    with ``optim.total_training_steps`` filled in by the trainer). Engine knobs of the GPU
    engines (micro-batch sizes, dynamic batching, offload) do not apply: one sequence at a time.
    """

    def __init__(self, model_path: str, actor: ActorConfig):
        self.actor = actor
        self.model = load_model(model_path)
        self.model.train()
        self.loss_fn = partial(ppo_loss, config=actor)
        self.optimizer = build_optimizer(self.model.parameters(), actor.optim)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, actor.optim)

    def score(self, rows: Sequence[dict[str, torch.Tensor]], temperature: float, entropy: bool) -> list[TokenScores]:
        """Log-probs (and entropy) of every row's response under the current weights."""
        return score_rows(self.model, rows, temperature, entropy)

    def train_mini_batch(
        self, rows: Sequence[dict[str, torch.Tensor]], temperature: float, fields: Sequence[str]
    ) -> dict[str, float]:
        """One optimizer step on ``rows`` (a mini-batch): accumulate every row's loss, clip, step.

        Each row's loss is verl's ``ppo_loss`` told the mini-batch's size and total response
        tokens, so the accumulated gradient is the mini-batch's token-mean (or sequence-mean)
        loss exactly, however the rows are split. A non-finite gradient norm skips the step, as
        verl's engines do.
        """
        calculate_entropy = self.actor.calculate_entropy or self.actor.entropy_coeff != 0
        batch_tokens = int(sum(int(r["response_mask"].sum()) for r in rows))
        self.optimizer.zero_grad(set_to_none=True)
        per_row, loss_total = [], 0.0
        for row in rows:
            data = row_tensordict(row, fields)
            tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=batch_tokens, global_batch_size=len(rows))
            scores = score_response(self.model, row["prompts"], row["responses"], temperature, calculate_entropy)
            loss, metrics = self.loss_fn(model_output=sequence_scores(scores, len(row["prompts"])), data=data)
            loss.backward()
            loss_total += float(loss.detach())
            per_row.append(metrics)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=self.actor.optim.clip_grad)
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return {**merge_metrics(per_row), "loss": loss_total, "grad_norm": float(grad_norm)}

    def lr_step(self) -> float:
        """Advance the learning-rate schedule (verl does it once per update call); the new lr."""
        self.lr_scheduler.step()
        return float(self.lr_scheduler.get_last_lr()[0])

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's own (detached) tensors, not copies: their takers copy them (``ray.put`` into
        the object store, ``load_state_dict`` into its parameters)."""
        return self.model.state_dict()


def over_sequence(response_values: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``[0] * (prompt_len - 1) + response_values + [0]``: per-position values of the full sequence.

    The layout of verl's model outputs: position ``t`` scores token ``t + 1``, read back with
    ``no_padding_2_padding`` / ``response_from_nested``; prompt positions carry nothing.
    """
    before = response_values.new_zeros(prompt_len - 1)
    after = response_values.new_zeros(1)
    return torch.cat([before, response_values, after])


def sequence_scores(scores: TokenScores, prompt_len: int) -> dict[str, torch.Tensor]:
    """``scores`` over the whole sequence (``log_probs``, and ``entropy`` when computed), as verl's
    engines return model outputs and its workers store them."""
    output = {"log_probs": over_sequence(scores.log_probs, prompt_len)}
    if scores.entropy is not None:
        output["entropy"] = over_sequence(scores.entropy, prompt_len)
    return output


def group_metrics(steps: Sequence[dict[str, float]]) -> dict[str, list[float]]:
    """Per-optimizer-step metrics as verl's update returns them: name -> one value per step."""
    out: dict[str, list[float]] = {}
    for metrics in steps:
        append_to_dict(out, metrics)
    return out
