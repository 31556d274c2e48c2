"""An in-process :class:`~infmem_verl.agent.policy.Policy` over a Hugging Face causal LM.

Used on CPU for tests, small runs and the CPU trainer, where no generation server exists. The
agent runs many samples concurrently, each awaiting ``generate``; answering them one by one would
waste most of the model's throughput, so concurrent calls are queued and decoded together as one
left-padded batch by a background worker. Decoding runs in a worker thread so the event loop (and
the agents' retrieval and parsing) keeps going meanwhile.

A row that ends at its token budget leaves its KV cache in a small prefix store: the agent's
two-stage thinking sends the same prompt and thinking again, closed by ``</think>``, to get the
output (see ``agent/turns.py``), and a call whose prompt starts with a stored row prefills only
the new tokens, as vLLM's prefix cache does for the GPU servers. Weight updates must call
:meth:`TransformersPolicy.clear_prefix_cache`.

The decode loop is written out rather than delegated to ``model.generate`` because every row of a
batch carries its own budget and sampling settings, and because the sampled tokens' log-probs must
be exactly what verl's actor recomputes: ``log_softmax(logits / temperature)`` before any top-k /
top-p filtering (raw logits for greedy rows).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from infmem_verl.agent.policy import FinishReason, Generation, SamplingParams

# Names of the end-of-turn / end-of-text tokens of the Qwen chat format.
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
# Top-p sampling looks for the nucleus among this many likeliest tokens before sorting them all.
NUCLEUS_PROBE = 64
# The attention TransformersPolicy.from_pretrained loads a model with (see register_grouped_sdpa).
GROUPED_SDPA = "infmem_grouped_sdpa"


@dataclass
class _Request:
    """One queued generate call: its inputs, its private RNG and the future its caller awaits."""

    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    future: asyncio.Future


@dataclass
class _RowState:
    """What one row of a batch has produced so far."""

    request: _Request
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    def append(self, token: int, log_prob: float, end_ids: frozenset[int]) -> None:
        """Record a sampled token; an end token finishes the row and is kept as its last token."""
        self.token_ids.append(token)
        self.log_probs.append(log_prob)
        if token in end_ids:
            self.finish_reason = "stop"
        elif len(self.token_ids) >= self.request.params.max_tokens:
            self.finish_reason = "length"

    def generation(self) -> Generation:
        assert self.finish_reason is not None, "row returned before it finished"
        wants_log_probs = self.request.params.logprobs
        return Generation(
            token_ids=self.token_ids,
            log_probs=self.log_probs if wants_log_probs else None,
            finish_reason=self.finish_reason,
        )


@dataclass
class _Prefix:
    """The KV cache of a row that ended at its budget: ``ids`` are the tokens it holds."""

    ids: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [kv_heads, len(ids), head_dim]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)


class _PrefixStore:
    """Least-recently-stored rows' KV caches, up to ``max_bytes``; a hit is taken out (a
    continuation is sent once)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, ...], _Prefix] = {}  # insertion order: oldest first
        self._bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    def put(self, prefix: _Prefix) -> None:
        if prefix.nbytes > self.max_bytes or prefix.ids in self._entries:
            return
        self._entries[prefix.ids] = prefix
        self._bytes += prefix.nbytes
        while self._bytes > self.max_bytes:
            self._bytes -= self._entries.pop(next(iter(self._entries))).nbytes

    def take(self, prompt: Sequence[int]) -> _Prefix | None:
        """The longest stored row that is a strict prefix of ``prompt`` (removed from the store)."""
        best = None
        for ids in self._entries:
            if len(ids) < len(prompt) and (best is None or len(ids) > len(best)) and tuple(prompt[: len(ids)]) == ids:
                best = ids
        if best is None:
            return None
        prefix = self._entries.pop(best)
        self._bytes -= prefix.nbytes
        self.hits += 1
        self.reused_tokens += len(best)
        return prefix

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` ([rows, vocab]) with that row's settings.

    Returns the tokens and their log-probs under ``log_softmax(logits / temperature)`` (raw logits
    for greedy rows). Filtering by top-k / top-p shapes only the draw, not the reported log-prob,
    because verl's actor recomputes log-probs without it. Rows that share their filtering are drawn
    together (one top-k call for all of them: one a row took 3.7 of a 9.5-ms decode step of the
    demo's student, 8 rows), each still from its own generator, so a row draws what it would alone.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    temperatures = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    scaled = logits / temperatures[:, None]
    tokens = torch.empty(len(params), dtype=torch.long)
    greedy: list[int] = []
    filters: dict[tuple[int, float], list[int]] = {}
    for i, p in enumerate(params):
        if p.temperature == 0:
            greedy.append(i)
        else:
            # top_k < 1 means no top-k limit (vLLM's convention for -1), as does top_k >= vocab.
            filters.setdefault((p.top_k if 0 < p.top_k < vocab else 0, p.top_p), []).append(i)
    if greedy:  # an argmax over Qwen3's vocabulary is ~0.15 ms a row: only for the rows that take it
        tokens[greedy] = torch.argmax(logits[greedy], dim=-1)
    for (top_k, top_p), rows in filters.items():
        tokens[rows] = _draw(scaled[rows], top_k, top_p, [generators[i] for i in rows])
    chosen = torch.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    return tokens.tolist(), chosen.tolist()


def _draw(scaled: torch.Tensor, top_k: int, top_p: float, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One token per row of temperature-scaled logits after top-k (0: none), then top-p filtering.

    Top-p alone looks for each row's nucleus among its :data:`NUCLEUS_PROBE` likeliest tokens, and
    sorts the whole vocabulary only for a row whose nucleus reaches past them: sorting Qwen3's
    151,936 logits costs ~15 ms a row on a CPU core, picking the likeliest 64 ~0.3 ms. Which way a
    row goes depends on its own logits only, so a row draws the same whatever shares its batch.
    """
    if top_k:  # top-k renormalises over the k tokens it keeps
        values, indices = torch.topk(scaled, top_k)
        return _nucleus_draw(torch.softmax(values, dim=-1), indices, top_p, generators)
    if top_p >= 1.0:
        return _inverse_cdf_draw(torch.softmax(scaled, dim=-1), generators)
    vocab = scaled.shape[-1]
    log_total = scaled.logsumexp(-1, keepdim=True)
    values, indices = torch.topk(scaled, min(NUCLEUS_PROBE, vocab))  # sorted, best first
    probs = (values - log_total).exp()
    reaches_past = (probs.cumsum(-1)[:, -1] < top_p) & (values.shape[-1] < vocab)
    narrow, wide = (~reaches_past).nonzero().flatten().tolist(), reaches_past.nonzero().flatten().tolist()
    tokens = torch.empty(len(scaled), dtype=torch.long)
    if narrow:
        tokens[narrow] = _nucleus_draw(probs[narrow], indices[narrow], top_p, [generators[i] for i in narrow])
    if wide:
        values, indices = torch.topk(scaled[wide], vocab)
        tokens[wide] = _nucleus_draw((values - log_total[wide]).exp(), indices, top_p, [generators[i] for i in wide])
    return tokens


def _nucleus_draw(
    probs: torch.Tensor, indices: torch.Tensor, top_p: float, generators: Sequence[torch.Generator]
) -> torch.Tensor:
    """Per row, a draw from ``probs`` (the probabilities of the tokens ``indices``, likeliest
    first) cut to the smallest prefix whose mass reaches ``top_p``: a token stays if the mass
    before it is still below ``top_p``, so the likeliest token always stays."""
    if top_p < 1.0:
        probs = probs * (probs.cumsum(-1) - probs < top_p)
    return indices.gather(-1, _inverse_cdf_draw(probs, generators)[:, None]).squeeze(-1)


def _inverse_cdf_draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """Per row of ``probs`` ([rows, n], not necessarily normalised), an index drawn with
    probability proportional to it, from that row's generator.

    One uniform number against the cumulative sum: over a 150k vocabulary this is several times
    cheaper than ``torch.multinomial``. A zero-probability index is never drawn, since its
    cumulative value equals its predecessor's and ``right=True`` needs ``cdf[i-1] <= u < cdf[i]``.
    """
    cdf = probs.double().cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]) * cdf[:, -1]
    index = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1)
    for row in (index == cdf.shape[-1]).nonzero().flatten().tolist():
        index[row] = torch.nonzero(probs[row])[-1, 0]  # u rounded up to the total: the last drawable index
    return index


def end_token_ids(tokenizer: Any, generation_config: Any = None) -> list[int]:
    """The ids that end a generation, without repeats: Qwen's ``<|im_end|>`` / ``<|endoftext|>``
    when the tokenizer has them, the generation config's ``eos_token_id`` (an int or a list) and
    the tokenizer's own eos token."""
    ids: list[int] = []
    vocab = tokenizer.get_vocab()
    ids.extend(vocab[name] for name in END_TOKENS if name in vocab)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.extend([configured] if isinstance(configured, int) else list(configured))
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return list(dict.fromkeys(int(i) for i in ids))


def _grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' ``sdpa`` attention with the key and value heads left grouped.

    transformers' own copies each key and value head ``num_key_value_groups`` times before any
    masked call (it hands grouped heads to torch only without a mask, for CUDA's kernels), and a
    left-padded batch always has a mask: the copy of the whole KV cache at every decode step was
    most of a step's attention. torch's CPU ``scaled_dot_product_attention`` takes grouped heads
    with a mask (``enable_gqa``) and gives the same bits (checked in tests/test_transformers_policy.py).
    """
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=query.shape[2] > 1 and attention_mask is None and is_causal, enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def register_grouped_sdpa() -> str:
    """Register :func:`_grouped_sdpa` with transformers (masks as for ``sdpa``); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_SDPA, _grouped_sdpa)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    return GROUPED_SDPA


class TransformersPolicy:
    """A batching, in-process :class:`Policy` over a causal LM (see the module docstring).

    ``max_batch`` caps how many queued calls are decoded together; after the first call arrives the
    worker waits at most ``batch_wait_s`` for more. ``seed`` makes sampling reproducible: the
    n-th call with a given prompt draws from its own generator seeded by ``(seed, prompt, n)``, so
    a row's tokens depend neither on which other rows shared its batch nor on the order in which
    concurrent agents happened to call (a held-out check gives the same trajectories whatever the
    timing); the n rollouts of one prompt still draw differently.
    ``batch_sizes`` records the size of every batch run, for tests and benchmarks.
    ``prefix_cache_bytes`` bounds the prefix store (0 turns it off).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_ids: Sequence[int],
        max_batch: int = 8,
        batch_wait_s: float = 0.005,
        seed: int | None = None,
        prefix_cache_bytes: int = 512 * 2**20,
    ) -> None:
        if not eos_token_ids or not all(isinstance(i, int) for i in eos_token_ids):
            raise ValueError(f"eos_token_ids must be a non-empty sequence of ints, got {eos_token_ids!r}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        if prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0, got {prefix_cache_bytes}")
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_batch = max_batch
        self.batch_wait_s = batch_wait_s
        self.seed = seed
        self.tokenizer: Any = None  # set by from_pretrained, for callers that need to encode
        self.batch_sizes: list[int] = []
        self.prefixes = _PrefixStore(prefix_cache_bytes)  # .hits / .reused_tokens for tests and benchmarks
        config = model.config
        # Left-padding slots are masked out, so any valid id will do; prefer the model's own.
        pad = getattr(config, "pad_token_id", None)
        self._pad_id = int(pad) if pad is not None else min(self.eos_token_ids)
        self._vocab_size = int(model.get_input_embeddings().num_embeddings)
        self._max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._prompt_calls: dict[int, int] = {}  # prompt digest -> calls so far, for seeding
        self._closed = False
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, **kw: Any) -> TransformersPolicy:
        """Load model and tokenizer from a local folder; ``kw`` goes to the constructor."""
        from transformers import AutoModelForCausalLM

        from infmem_verl.assets import load_tokenizer

        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"path: {path} is not a model folder (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=register_grouped_sdpa())
        model.eval()
        tokenizer = load_tokenizer(str(path))
        policy = cls(model, end_token_ids(tokenizer, model.generation_config), **kw)
        policy.tokenizer = tokenizer
        return policy

    # ----------------------------------------------------------------------------------- serving

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Continue ``prompt_ids``; the call is decoded in a batch with other concurrent calls."""
        if self._closed:
            raise RuntimeError("TransformersPolicy is closed")
        prompt = self._checked_prompt(prompt_ids, params.max_tokens)
        queue = self._ensure_worker()
        request = _Request(prompt, params, self._generator_for(prompt), self._loop.create_future())
        queue.put_nowait(request)
        return await request.future

    async def close(self) -> None:
        """Stop the worker; calls still queued or running fail with RuntimeError."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None and not worker.done():
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        while self._queue is not None and not self._queue.empty():
            _fail([self._queue.get_nowait()], RuntimeError("TransformersPolicy closed"))

    def clear_prefix_cache(self) -> None:
        """Forget every stored KV cache (they are stale once the weights change)."""
        self.prefixes.clear()

    async def __aenter__(self) -> TransformersPolicy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _ensure_worker(self) -> asyncio.Queue[_Request]:
        """Start the worker on the running loop (again, if an earlier loop has gone)."""
        loop = asyncio.get_running_loop()
        if self._worker is None or self._worker.done() or self._loop is not loop:
            self._loop = loop
            self._queue = asyncio.Queue()
            self._worker = loop.create_task(self._serve(self._queue))
        return self._queue

    def _generator_for(self, prompt: list[int]) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
            return generator
        digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8).digest()
        key = int.from_bytes(digest, "little")
        nth = self._prompt_calls.get(key, 0)
        self._prompt_calls[key] = nth + 1
        state = np.random.SeedSequence((self.seed, key, nth)).generate_state(1, dtype=np.uint64)
        generator.manual_seed(int(state[0]))
        return generator

    async def _serve(self, queue: asyncio.Queue[_Request]) -> None:
        """Forever: gather a batch, decode it in a thread, hand each caller its result."""
        while True:
            batch = [r for r in await self._collect(queue) if not r.future.done()]  # skip cancelled
            if not batch:
                continue
            self.batch_sizes.append(len(batch))
            try:
                results = await asyncio.to_thread(self._decode_batch, batch)
            except asyncio.CancelledError:
                _fail(batch, RuntimeError("TransformersPolicy closed"))
                raise
            except Exception as exc:  # every caller of a failed batch gets the error; none hangs
                _fail(batch, exc)
                continue
            for request, result in zip(batch, results):
                if not request.future.done():
                    request.future.set_result(result)

    async def _collect(self, queue: asyncio.Queue[_Request]) -> list[_Request]:
        """Wait for one request, then take more until ``max_batch`` or ``batch_wait_s`` is up."""
        batch = [await queue.get()]
        deadline = asyncio.get_running_loop().time() + self.batch_wait_s
        while len(batch) < self.max_batch:
            if not queue.empty():
                batch.append(queue.get_nowait())
                continue
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(queue.get(), remaining))
            except asyncio.TimeoutError:
                break
        return batch

    # ---------------------------------------------------------------------------------- decoding

    def _checked_prompt(self, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Reject prompts the model cannot take, before they can fail a whole batch."""
        prompt = self._checked_ids("prompt_ids", prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids must not be empty")
        if self._max_positions is not None and len(prompt) + max_tokens > self._max_positions:
            raise ValueError(
                f"prompt length {len(prompt)} + max_tokens {max_tokens} exceeds the model's "
                f"max_position_embeddings {self._max_positions}"
            )
        return prompt

    def _checked_ids(self, name: str, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list of ints, each inside the model's vocabulary."""
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"{name}: token id {bad[0]} is outside the model's vocabulary [0, {self._vocab_size})")
        return out

    def _forward_last(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Run the model and return the logits of each row's last position only ([rows, vocab])."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,  # never materialise vocab-sized logits for every prompt position
        )
        return out.logits[:, -1, :]

    @torch.inference_mode()
    def _decode_batch(self, requests: Sequence[_Request]) -> list[Generation]:
        """Decode all requests as one batch with a KV cache (runs in a worker thread).

        Row i is laid out as ``[pad][stored prefix p_i][pad][new tokens s_i]``: the stored
        prefixes (none: length 0) left-padded to the longest, then the rest of each prompt
        left-padded to the longest rest, so only the new tokens are prefilled. Rows that finish
        are dropped from the batch (and the cache), so a short request sharing a batch with a long
        one costs nothing after it ends; a row that ends at its budget is stored first.
        """
        from transformers import DynamicCache

        prefixes = [self.prefixes.take(r.prompt_ids) if self.prefixes.max_bytes else None for r in requests]
        held = [len(p.ids) if p else 0 for p in prefixes]
        rests = [r.prompt_ids[n:] for r, n in zip(requests, held)]
        width_p, width_s = max(held), max(len(rest) for rest in rests)
        rows_n = len(requests)
        input_ids = torch.full((rows_n, width_s), self._pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows_n, width_p + width_s), dtype=torch.long)
        for i, (n, rest) in enumerate(zip(held, rests)):
            input_ids[i, width_s - len(rest) :] = torch.tensor(rest)
            attention_mask[i, width_p - n : width_p] = 1
            attention_mask[i, width_p + width_s - len(rest) :] = 1
        stored = self._stored_layers(prefixes, width_p) if width_p else None
        cache = DynamicCache(stored, config=self.model.config)
        # A row's positions count its real tokens only, so a padded row sees the same rotary
        # positions as when it runs alone.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, width_p:]
        logits = self._forward_last(input_ids, attention_mask, position_ids, cache)

        rows = [_RowState(r) for r in requests]
        active = list(range(len(rows)))  # row index of each batch slot still decoding
        while True:
            tokens, log_probs = sample_next_tokens(
                logits, [rows[i].request.params for i in active], [rows[i].request.generator for i in active]
            )
            for i, token, log_prob in zip(active, tokens, log_probs):
                rows[i].append(token, log_prob, self.eos_token_ids)
            for slot, i in enumerate(active):
                if rows[i].finish_reason == "length" and self.prefixes.max_bytes:
                    self.prefixes.put(self._row_prefix(rows[i], cache, slot, attention_mask[slot]))
            keep = [slot for slot, i in enumerate(active) if rows[i].finish_reason is None]
            if not keep:
                return [row.generation() for row in rows]
            if len(keep) < len(active):
                cache.batch_select_indices(torch.tensor(keep))
                attention_mask = attention_mask[keep]
                active = [active[slot] for slot in keep]
                tokens = [tokens[slot] for slot in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            position_ids = attention_mask.sum(-1, keepdim=True) - 1
            logits = self._forward_last(torch.tensor(tokens)[:, None], attention_mask, position_ids, cache)

    def _stored_layers(self, prefixes: Sequence[_Prefix | None], width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the batch's keys and values for the stored prefixes, left-padded to ``width``."""
        template = next(p for p in prefixes if p is not None).layers
        layers = []
        for layer, (k0, v0) in enumerate(template):
            keys = k0.new_zeros((len(prefixes), k0.shape[0], width, k0.shape[2]))
            values = v0.new_zeros((len(prefixes), v0.shape[0], width, v0.shape[2]))
            for i, prefix in enumerate(prefixes):
                if prefix is not None:
                    k, v = prefix.layers[layer]
                    keys[i, :, width - k.shape[1] :] = k
                    values[i, :, width - v.shape[1] :] = v
            layers.append((keys, values))
        return layers

    @staticmethod
    def _row_prefix(row: _RowState, cache: Any, slot: int, mask: torch.Tensor) -> _Prefix:
        """The KV cache of batch slot ``slot``: its prompt and every sampled token but the last
        (sampled, not fed yet), without the padding."""
        real = mask.bool()
        return _Prefix(
            ids=tuple(row.request.prompt_ids) + tuple(row.token_ids[:-1]),
            layers=[(layer.keys[slot][:, real].clone(), layer.values[slot][:, real].clone()) for layer in cache.layers],
        )

    # ------------------------------------------------------------------------------- scoring

    @torch.inference_mode()
    def compute_log_probs(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float = 1.0
    ) -> np.ndarray:
        """Log-probs of ``response_ids`` after ``prompt_ids``, from one forward pass.

        The same quantity ``generate`` reports (``log_softmax(logits / temperature)``, raw logits
        when ``temperature == 0``), computed the way a trainer recomputes it, so the two can be
        compared. Returns float32 of shape ``[len(response_ids)]``.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        response = self._checked_ids("response_ids", response_ids)
        prompt = self._checked_prompt(prompt_ids, len(response))
        if not response:
            return np.zeros(0, dtype=np.float32)
        input_ids = torch.tensor([prompt + response])
        # Positions len(prompt)-1 .. end-1 predict the response tokens; keep just those logits.
        logits = self.model(input_ids=input_ids, logits_to_keep=len(response) + 1).logits[0, :-1].float()
        if temperature > 0:
            logits = logits / temperature
        log_probs = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])
        return log_probs.squeeze(-1).numpy().astype(np.float32)


def _fail(requests: Sequence[_Request], exc: BaseException) -> None:
    """Hand ``exc`` to every caller still waiting on one of ``requests``."""
    for request in requests:
        if not request.future.done():
            request.future.set_exception(exc)
