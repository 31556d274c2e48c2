"""Training cost of one RL step, counted: the ledger logged as ``infmem/cost/...``.

A GPU's seconds cannot be measured on a CPU machine, but what they are spent on can be counted,
and the counts do not depend on the hardware. Per RL step the ledger holds:

* rollout: LLM calls, prompt tokens prefilled (a two-stage call prefills its prompt twice, the
  second time with the thinking appended), tokens decoded;
* trainer: rows (sequences, verl's padding rows included), tokens through each pass (old
  log-prob forward, reference forward, actor forward+backward), and the *loss tokens* (response
  tokens the model generated in real rows: the tokens the objective is defined over, the same
  whichever passes run);
* transport: bytes the reward call ships through Ray (verl pads five int64 tensors over every
  sequence of a trajectory) and bytes the agent loops put into TransferQueue.

``trainer tokens per loss token`` (:attr:`StepLedger.tokens_per_loss_token`) is the headline: a
token that goes through three passes counts three times. ``forward_equivalents`` weighs a
forward+backward as three forwards, closer to compute.

Its ratio to the reference pipeline's depends on the objective. With the KL loss off and the
rollout's log-probs standing in for the trainer's (``bypass_mode``), two of the three passes go and
``bench/train_cost.py`` measures 0.25; at the reference objective (``kl_loss_coef`` 0.001, old
log-probs recomputed by the trainer) every pass stays, and only a **prefix-grouped forward** cuts
them: the n rollouts' rows of one call slot (a ``chunk_first`` Write of the same chunk, the first
PreThink) share a prompt prefix, which one packed sequence computes once for the group
(:func:`pass_tokens`; ``Row.prefix_group`` / ``shared_prefix``; :class:`TokenCaps` splits a group
that exceeds its pass's micro-batch cap). The same objective, fewer tokens: prototyped on the CPU
engine (:func:`infmem_verl.cpu.engine.score_prefix_group`); verl 0.9.1's FSDP engine does not do
it yet, so ``pipeline_of`` never sets it and the dry run prints it as what it would save.

The same code runs on CPU and GPU: the trainer (``infmem_sync``, which the CPU backend
subclasses) records the batches verl's trainer hands to each pass (keys and tags, plus the
per-row loss-token counts from TransferQueue) and the turn facts; :func:`step_ledger` turns them
into the ledger. The dry run and ``bench/train_cost.py`` call the same function on modelled rows
(:func:`estimate_step`).

It also holds the row-dropping rule of ``infmem.cost.drop_zero_advantage``
(:func:`zero_advantage_rows`, :func:`rows_to_train`, :func:`kept_loss_scale`). Pure Python and torch: no verl import.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from infmem_verl.agent.errors import ConfigError

COST_PREFIX = "infmem/cost"
INT64_BYTES = 8
FLOAT32_BYTES = 4
# Tensors verl's reward call pads per trajectory (agent_loop.py _compute_score): prompts,
# responses, and three over the whole sequence (input_ids, attention_mask, position_ids).
REWARD_SEQUENCE_TENSORS = 3
# Per sequence, what an agent loop puts into TransferQueue (agent_loop_tq.py): int64 prompts,
# responses, input_ids, attention_mask, position_ids, response_mask, loss_mask; float32 rollout
# log-probs when the rollout returns them.
TQ_SEQUENCE_TENSORS = 3  # input_ids, attention_mask, position_ids
TQ_RESPONSE_TENSORS = 3  # responses, response_mask, loss_mask
# Loss aggregations whose normalisation the row dropping can keep (see kept_loss_scale).
DROPPABLE_AGGREGATIONS = ("token-mean", "token-sum")


@dataclass(frozen=True)
class Row:
    """One training sequence as verl's trainer sees it (tags ``prompt_len``/``response_len``)."""

    key: str
    prompt: int
    response: int
    loss_tokens: int = 0  # response-mask ones: tokens the model generated
    padding: bool = False  # verl's zero-weight padding row
    zero_advantage: bool = False  # every trained token's advantage is exactly 0
    prefix_group: str = ""  # rows with the same key share their first ``shared_prefix`` prompt tokens
    shared_prefix: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt + self.response


@dataclass(frozen=True)
class Call:
    """The rollout side of one training sequence: its generate calls (from its turn facts)."""

    llm_calls: int
    prefill_tokens: int
    decode_tokens: int


@dataclass(frozen=True)
class TokenCaps:
    """Per-GPU micro-batch token caps of each pass (verl's dynamic batching); None: no cap. A prefix
    group's packed sequence must fit one micro-batch, so a larger group is split, each part paying
    the prefix again."""

    old_log_prob: int | None = None
    reference: int | None = None
    update: int | None = None


def token_caps(config) -> TokenCaps:
    """The caps a composed trainer config sets (None where dynamic batching is off)."""
    aro = config.actor_rollout_ref
    rollout, ref, actor = aro.rollout, aro.ref, aro.actor
    return TokenCaps(
        old_log_prob=int(rollout.log_prob_max_token_len_per_gpu) if rollout.log_prob_use_dynamic_bsz else None,
        reference=int(ref.log_prob_max_token_len_per_gpu) if ref.log_prob_use_dynamic_bsz else None,
        update=int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else None,
    )


def pass_tokens(rows: Sequence[Row], grouped: bool = False, cap: int | None = None) -> int:
    """Tokens one pass computes over ``rows``: every row's, or with a prefix-grouped forward each
    group's shared prefix once per micro-batch of at most ``cap`` tokens (prefix + the members'
    suffixes). The prefix stops a token short of the shortest prompt, so every row keeps the
    position that predicts its first response token."""
    if not grouped:
        return sum(r.tokens for r in rows)
    total, groups = 0, {}
    for row in rows:
        if row.prefix_group and row.shared_prefix > 0:
            groups.setdefault(row.prefix_group, []).append(row)
        else:
            total += row.tokens
    for members in groups.values():
        if len(members) == 1:
            total += members[0].tokens
            continue
        prefix = min(min(r.shared_prefix for r in members), min(r.prompt for r in members) - 1)
        packed = prefix
        for row in members:
            suffix = row.tokens - prefix
            if cap is not None and packed > prefix and packed + suffix > cap:
                total, packed = total + packed, prefix
            packed += suffix
        total += packed
    return total


@dataclass(frozen=True)
class Passes:
    """The rows each trainer pass received in one RL step (padding rows included)."""

    old_log_prob: Sequence[Row] = ()
    reference: Sequence[Row] = ()
    update: Sequence[Row] = ()


@dataclass
class StepLedger:
    """Counts of one RL step (see the module docstring). Token counts are sequence tokens."""

    llm_calls: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    rows: int = 0
    padding_rows: int = 0
    old_log_prob_tokens: int = 0
    reference_tokens: int = 0
    update_rows: int = 0
    update_tokens: int = 0
    loss_tokens: int = 0
    reward_bytes: int = 0
    rollout_bytes: int = 0

    @property
    def trainer_tokens(self) -> int:
        return self.old_log_prob_tokens + self.reference_tokens + self.update_tokens

    @property
    def forward_equivalents(self) -> int:
        """Tokens weighted by compute: a forward 1, a forward+backward 3."""
        return self.old_log_prob_tokens + self.reference_tokens + 3 * self.update_tokens

    @property
    def tokens_per_loss_token(self) -> float:
        return self.trainer_tokens / self.loss_tokens if self.loss_tokens else math.nan

    @property
    def transport_bytes(self) -> int:
        return self.reward_bytes + self.rollout_bytes

    def metrics(self, prefix: str = COST_PREFIX) -> dict[str, float]:
        """The ledger as logged metrics ``infmem/cost/<name>``."""
        values = asdict(self)
        values.update(
            trainer_tokens=self.trainer_tokens,
            forward_equivalents=self.forward_equivalents,
            tokens_per_loss_token=self.tokens_per_loss_token,
            transport_bytes=self.transport_bytes,
        )
        return {f"{prefix}/{name}": float(value) for name, value in values.items()}


def session_of(key: str) -> str:
    """The trajectory of a TransferQueue key ``{uid}_{session_id}_{index}``."""
    return key.rsplit("_", 1)[0]


def reward_call_bytes(rows: Sequence[Row]) -> int:
    """Bytes of the token tensors verl's remote reward call pads and ships for ``rows``.

    ``rows`` are the sequences of *one* trajectory: verl pads them to the trajectory's longest
    prompt, response and sequence.
    """
    if not rows:
        return 0
    width = max(r.prompt for r in rows) + max(r.response for r in rows)
    width += REWARD_SEQUENCE_TENSORS * max(r.tokens for r in rows)
    return INT64_BYTES * len(rows) * width


def rollout_put_bytes(row: Row, log_probs: bool) -> int:
    """Bytes of the tensors an agent loop puts into TransferQueue for one sequence."""
    tokens = row.prompt + row.response + TQ_SEQUENCE_TENSORS * row.tokens + TQ_RESPONSE_TENSORS * row.response
    return INT64_BYTES * tokens + (FLOAT32_BYTES * row.response if log_probs else 0)


def step_ledger(
    rows: Sequence[Row],
    calls: Mapping[str, Call],
    passes: Passes,
    reward_remote: bool,
    log_probs: bool,
    prefix_caps: TokenCaps | None = None,
) -> StepLedger:
    """The ledger of one RL step.

    ``rows``: every row of the step's batch (padding included); ``calls``: the rollout side of
    each real row, by key; ``passes``: the rows each trainer pass received; ``reward_remote``: the reward call shipped token tensors (verl's default; not when the agent
    loop scored the trajectory); ``log_probs``: the rollout returned log-probs; ``prefix_caps``:
    the passes run a prefix-grouped forward under these micro-batch caps (None: row by row).
    """
    real = [r for r in rows if not r.padding]
    ledger = StepLedger(rows=len(rows), padding_rows=len(rows) - len(real))
    for row in real:
        call = calls.get(row.key)
        if call is not None:
            ledger.llm_calls += call.llm_calls
            ledger.prefill_tokens += call.prefill_tokens
            ledger.decode_tokens += call.decode_tokens
        ledger.loss_tokens += row.loss_tokens
        ledger.rollout_bytes += rollout_put_bytes(row, log_probs)
    grouped, caps = prefix_caps is not None, prefix_caps or TokenCaps()
    ledger.old_log_prob_tokens = pass_tokens(passes.old_log_prob, grouped, caps.old_log_prob)
    ledger.reference_tokens = pass_tokens(passes.reference, grouped, caps.reference)
    ledger.update_rows = len(passes.update)
    ledger.update_tokens = pass_tokens(passes.update, grouped, caps.update)
    if reward_remote:
        trajectories: dict[str, list[Row]] = {}
        for row in real:
            trajectories.setdefault(session_of(row.key), []).append(row)
        ledger.reward_bytes = sum(reward_call_bytes(group) for group in trajectories.values())
    return ledger


# ------------------------------------------------------------------ lever c: zero-advantage rows


def zero_advantage_rows(advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Rows whose advantage is exactly 0 on every trained token (padded ``(rows, response)``).

    Such a row adds nothing to the policy-gradient loss (it is linear in the advantage); a row
    without trained tokens (verl's padding) counts as zero too.
    """
    mask = response_mask.bool()
    return ~((advantages != 0) & mask).any(dim=1)


def rows_to_train(rows: Sequence[Row], multiple: int) -> list[Row] | None:
    """The rows the update trains on when zero-advantage rows are dropped; None: train them all.

    The update needs a multiple of ``multiple`` rows (verl's data-parallel and mini-batch sizes).
    New padding rows cannot be made at this point (verl copies a real row's advantages and
    log-probs into them, shaped for another response), so the kept rows are filled up with rows
    that carry no gradient anyway: the batch's own padding rows first, then the shortest
    zero-advantage rows. None when nothing would be left out, or nothing carries a gradient.
    """
    kept = [r for r in rows if not r.padding and not r.zero_advantage]
    if not kept:
        return None
    fillers = sorted((r for r in rows if r.padding or r.zero_advantage), key=lambda r: (not r.padding, r.tokens))
    selected = [*kept, *fillers[: -len(kept) % max(multiple, 1)]]
    return selected if len(selected) < len(rows) else None


def kept_loss_scale(loss_agg_mode: str, kept_tokens: int, total_tokens: int) -> float:
    """The advantage scale that keeps the loss normalisation of the full batch after dropping rows.

    verl's ``token-mean`` divides the mini-batch's loss by its trained tokens: with only the kept
    rows it would divide by ``kept_tokens`` instead of ``total_tokens``, so the kept advantages are
    scaled by ``kept_tokens / total_tokens`` (the PPO-clip loss is positively homogeneous in the
    advantage, so the gradient is then exactly the full batch's). ``token-sum`` needs no scale.
    """
    if loss_agg_mode == "token-sum":
        return 1.0
    if loss_agg_mode == "token-mean":
        return kept_tokens / total_tokens if total_tokens else 1.0
    raise ConfigError(
        f"actor_rollout_ref.actor.loss_agg_mode: infmem.cost.drop_zero_advantage supports "
        f"{list(DROPPABLE_AGGREGATIONS)}, got {loss_agg_mode!r}"
    )


def check_droppable(actor) -> None:
    """Dropping zero-advantage rows keeps the objective only if nothing but the policy-gradient
    term has a gradient on them: no KL loss, no entropy bonus, a supported loss aggregation."""
    if actor.use_kl_loss and actor.kl_loss_coef != 0:
        raise ConfigError(
            "infmem.cost.drop_zero_advantage: zero-advantage rows still carry the KL loss "
            f"(actor_rollout_ref.actor.use_kl_loss with kl_loss_coef={actor.kl_loss_coef}); set kl_loss_coef=0 "
            "or use_kl_loss=false, or turn the lever off"
        )
    if actor.entropy_coeff != 0:
        raise ConfigError(
            "infmem.cost.drop_zero_advantage: zero-advantage rows still carry the entropy bonus "
            f"(actor_rollout_ref.actor.entropy_coeff={actor.entropy_coeff}); set it to 0 or turn the lever off"
        )
    kept_loss_scale(actor.loss_agg_mode, 1, 1)


# ------------------------------------------------------------------- levers set in the config


def scores_in_agent_loop(config) -> bool:
    """Whether the agent loop scores trajectories itself (``infmem.cost.score_in_agent_loop``):
    only for the ``infmem`` reward manager without a ``reward.custom_reward_function``, which
    keep verl's remote reward call."""
    from omegaconf import OmegaConf

    lever = OmegaConf.select(config, "infmem.cost.score_in_agent_loop", default=False)
    manager = OmegaConf.select(config, "reward.reward_manager.name", default=None)
    custom = OmegaConf.select(config, "reward.custom_reward_function.path", default=None)
    return bool(lever) and manager == "infmem" and not custom


def apply_cost_levers(config, settings) -> list[str]:
    """Set the config side of ``infmem.cost`` (``settings``, a CostSettings) in place, before any
    worker starts; what changed, as lines for the console.

    ``skip_reference_at_zero_kl``: a KL loss with coefficient 0 contributes nothing, but verl still
    builds a reference model and runs its pass over every row (``need_reference_policy`` only looks
    at ``use_kl_loss``), so the KL loss is switched off. ``drop_zero_advantage`` is checked
    (:func:`check_droppable`) so a config where it would change the objective fails here.
    """
    actor = config.actor_rollout_ref.actor
    changed = []
    kl_in_reward = bool(config.algorithm.get("use_kl_in_reward", False))
    if settings.skip_reference_at_zero_kl and actor.use_kl_loss and actor.kl_loss_coef == 0 and not kl_in_reward:
        actor.use_kl_loss = False
        changed.append(
            "actor_rollout_ref.actor.use_kl_loss: false (kl_loss_coef is 0: no reference pass; "
            "infmem.cost.skip_reference_at_zero_kl)"
        )
    if settings.drop_zero_advantage:
        check_droppable(actor)
    return changed


# ------------------------------------------------------------------------ estimates (no run)


@dataclass(frozen=True)
class Pipeline:
    """Which costs a configuration pays: the trainer passes and the reward transport."""

    name: str
    old_log_prob: bool = True
    reference: bool = True
    reward_remote: bool = True
    drop_zero_advantage: bool = False
    prefix_grouped: bool = False  # a prefix-grouped forward in every pass (not in verl 0.9.1's engine)


def pipeline_of(config, name: str = "config") -> Pipeline:
    """The :class:`Pipeline` a composed trainer config runs (after :func:`infmem_verl.main.prepare_config`)."""
    from omegaconf import OmegaConf

    actor = config.actor_rollout_ref.actor
    bypass = bool(OmegaConf.select(config, "algorithm.rollout_correction.bypass_mode", default=False))
    use_kl_in_reward = bool(OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False))
    return Pipeline(
        name=name,
        old_log_prob=not bypass,
        reference=bool(actor.use_kl_loss) or use_kl_in_reward,
        reward_remote=not scores_in_agent_loop(config),
        drop_zero_advantage=bool(OmegaConf.select(config, "infmem.cost.drop_zero_advantage", default=False)),
    )


def estimate_step(
    trajectories: Iterable[Sequence[tuple[int, int, int, Call]]],
    pipeline: Pipeline,
    batch_multiple: int = 1,
    zero_advantage_groups: Sequence[bool] = (),
    n: int = 1,
    log_probs: bool = True,
    shared_prefixes: Sequence[Sequence[int]] = (),
    caps: TokenCaps = TokenCaps(),
) -> StepLedger:
    """The ledger of a modelled RL step: ``trajectories`` (in group order, ``n`` per prompt) each a
    list of ``(prompt, response, loss_tokens, Call)`` per sequence; ``zero_advantage_groups[g]``
    marks group ``g`` as uniform-reward (its rows have zero advantage). The batch is padded to
    ``batch_multiple`` rows with verl's 128-token padding rows; dropping follows :func:`rows_to_train`.
    ``shared_prefixes[t][i]``: prompt tokens row ``i`` of trajectory ``t`` shares with the rows ``i``
    of its group's other trajectories (a ``pipeline.prefix_grouped`` forward computes them once,
    under ``caps``).
    """
    rows: list[Row] = []
    calls: dict[str, Call] = {}
    for t, trajectory in enumerate(trajectories):
        group = t // n
        zero = group < len(zero_advantage_groups) and zero_advantage_groups[group]
        shared = shared_prefixes[t] if t < len(shared_prefixes) else ()
        for i, (prompt, response, loss, call) in enumerate(trajectory):
            key = f"u{group}_{t % n}_{i}"
            prefix = shared[i] if i < len(shared) else 0
            rows.append(Row(key, prompt, response, loss, zero_advantage=zero, prefix_group=f"u{group}#{i}", shared_prefix=prefix))
            calls[key] = call
    batch = _padded(rows, batch_multiple)
    update = (rows_to_train(batch, batch_multiple) if pipeline.drop_zero_advantage else None) or batch
    passes = Passes(
        old_log_prob=batch if pipeline.old_log_prob else (),
        reference=batch if pipeline.reference else (),
        update=update,
    )
    return step_ledger(batch, calls, passes, pipeline.reward_remote, log_probs, caps if pipeline.prefix_grouped else None)


PADDING_ROW_TOKENS = 128  # verl's SYNTHETIC_PADDING_SEQ_LEN: prompt 127 + response 1


def _padded(rows: list[Row], multiple: int) -> list[Row]:
    missing = -len(rows) % max(multiple, 1)
    pads = [Row(f"pad_{i}_0", PADDING_ROW_TOKENS - 1, 1, padding=True) for i in range(missing)]
    return [*rows, *pads]


def budget_trajectory(cfg, agent: str, doc_tokens: int) -> list[tuple[int, int, int, Call]]:
    """An upper bound of one trajectory's rows ``(prompt, response, loss_tokens, Call)`` from the
    agent budgets (``cfg``, an AgentConfig) alone: every chunk of a ``doc_tokens`` document read,
    every prompt and response at its budget, every thinking call two-stage."""
    chunks = max(1, math.ceil(doc_tokens / cfg.document.chunk_tokens))
    two_stage = cfg.thinking and cfg.thinking_mode == "two_stage"

    def row(budget) -> tuple[int, int, int, Call]:
        response = budget.response_tokens(cfg.thinking)
        if two_stage:
            first = budget.thinking_tokens
            call = Call(2, 2 * budget.prompt_tokens + first, response)
        else:
            call = Call(1, budget.prompt_tokens, response)
        return budget.prompt_tokens, response, response, call

    per_chunk = [row(cfg.prethink), row(cfg.write)] if agent == "infmem" else [row(cfg.write)]
    return per_chunk * chunks + [row(cfg.answer)]


def budget_shared_prefixes(cfg, agent: str, trajectory: Sequence[tuple]) -> list[int]:
    """What the n rollouts' rows of a :func:`budget_trajectory` surely share: a ``chunk_first``
    Write's chunk (its question and template head, shared too, are not counted: a lower bound, so
    grouped tokens stay an upper bound). PreThink and answer prompts part at the memory."""
    write = cfg.document.chunk_tokens if cfg.write_layout == "chunk_first" else 0
    per_chunk = [0, write] if agent == "infmem" else [write]
    return per_chunk * ((len(trajectory) - 1) // len(per_chunk)) + [0]


def dry_run_ledger(config, doc_tokens: int = 32768) -> list[str]:
    """The dry run's cost lines: the ledger of one RL step of the composed ``config`` (after
    :func:`infmem_verl.main.prepare_config`) next to the reference pipeline's, on budget-bound
    trajectories of ``doc_tokens``-token documents (:func:`budget_trajectory`)."""
    from infmem_verl.settings import agent_settings, train_settings

    rollout = config.actor_rollout_ref.rollout
    agent = "memagent" if "memagent" in rollout.agent.default_agent_loop else "infmem"
    n = int(rollout.n)
    cfg = agent_settings(config)
    trajectory = budget_trajectory(cfg, agent, doc_tokens)
    trajectories = [trajectory] * (int(config.data.train_batch_size) * n)
    shared = [budget_shared_prefixes(cfg, agent, trajectory)] * len(trajectories)
    gpus = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
    multiple = math.lcm(gpus, n) * train_settings(config).optimizer_steps_per_rl_step
    this = pipeline_of(config, "this config")
    grouped = replace(this, name="this config with a prefix-grouped forward (not in verl 0.9.1's engine)", prefix_grouped=True)
    lines, reference = [], None
    for pipeline in (Pipeline("reference"), this, grouped):
        ledger = estimate_step(trajectories, pipeline, multiple, n=n, shared_prefixes=shared, caps=token_caps(config))
        reference = reference or ledger
        lines.append(
            f"cost per RL step, {pipeline.name} (at most, {doc_tokens}-token documents): {ledger.rows:,} rows, "
            f"trainer tokens {ledger.trainer_tokens / 1e6:.1f}M (old log-prob {ledger.old_log_prob_tokens / 1e6:.1f}M, "
            f"reference {ledger.reference_tokens / 1e6:.1f}M, update {ledger.update_tokens / 1e6:.1f}M), "
            f"{ledger.tokens_per_loss_token:.2f} per loss token ({ledger.trainer_tokens / reference.trainer_tokens:.2f} "
            f"of the reference's), reward call {ledger.reward_bytes / 2**20:,.0f} MiB"
        )
    actor = config.actor_rollout_ref.actor
    kl = f"kl_loss_coef {actor.kl_loss_coef}" if actor.use_kl_loss else "KL loss off"
    old = "rollout log-probs as old" if not this.old_log_prob else "old log-probs recomputed by the trainer"
    lines.append(
        f"objective of this config: {kl}, {old}. bench/train_cost.py's 0.25 of the reference's trainer tokens "
        "is with the KL loss off and rollout log-probs standing in (kl_loss_coef=0 "
        "algorithm.rollout_correction.bypass_mode=true); at the reference objective only the prefix-grouped "
        "forward cuts them"
    )
    return lines


# ---------------------------------------------------------------- lever e: prefix-cache counters


@dataclass(frozen=True)
class PrefixCache:
    """A vLLM server's prefix-cache counters: prompt tokens looked up, and those found cached."""

    queries: float
    hits: float

    def __sub__(self, earlier: PrefixCache) -> PrefixCache:
        return PrefixCache(self.queries - earlier.queries, self.hits - earlier.hits)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else math.nan


def prefix_cache_counters(metrics_text: str) -> PrefixCache:
    """``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits`` from a vLLM ``/metrics`` page
    (Prometheus text; summed over engines). A server started with ``--disable-log-stats`` has none:
    that is an error, not zero hits."""
    totals = {"vllm:prefix_cache_queries": None, "vllm:prefix_cache_hits": None}
    for line in metrics_text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in totals and not line.startswith("#"):
            totals[name] = (totals[name] or 0.0) + float(line.rsplit(" ", 1)[1])
    missing = [name for name, value in totals.items() if value is None]
    if missing:
        raise ValueError(f"/metrics: no {missing} counters (was the server started with --disable-log-stats?)")
    return PrefixCache(totals["vllm:prefix_cache_queries"], totals["vllm:prefix_cache_hits"])
