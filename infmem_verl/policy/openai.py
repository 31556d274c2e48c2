"""A :class:`~infmem_verl.agent.policy.Policy` over OpenAI-compatible completions servers (vLLM).

Token in, token out: the prompt goes to ``/v1/completions`` as a list of token ids built by our
own :class:`~infmem_verl.agent.protocol.PromptBuilder`, and the generated token ids come back
through vLLM's ``return_token_ids`` extension. The server's tokenizer and chat template are never
used, so evaluation and distillation send exactly the ids training sends. The server echoes the
prompt ids it received; every call checks them against what was sent.

Robustness: a per-request timeout, retries with exponential backoff and jitter on connection
errors, timeouts and retryable statuses (408, 429, 5xx), a cap on requests in flight, and several
endpoints with each request going to the one with the fewest requests in flight (an endpoint that
just failed is avoided while it cools down). Errors that retrying cannot fix (a rejected request,
a malformed response) raise :class:`PolicyError` at once, with the endpoint and the reason.

Log-probs are what the server reports: vLLM's default ``--logprobs-mode raw_logprobs`` gives the
model's unscaled distribution, which equals the :class:`Generation` contract for greedy decoding
(evaluation); sampling runs that need temperature-scaled values must start the server with
``--logprobs-mode processed_logprobs``.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson

from infmem_verl.agent.policy import FinishReason, Generation, SamplingParams

ErrorKind = Literal["unreachable", "timeout", "server_error", "rejected", "malformed", "prompt_changed"]
# Statuses worth retrying: the server is overloaded, restarting or timed out.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Kinds that say nothing about the request (the server was unreachable, slow or failing): a call
# retries them, and a resumed evaluation or distillation runs such a failed sample again
# (``--retry-failed transient``, the default).
TRANSIENT_KINDS: frozenset[ErrorKind] = frozenset({"unreachable", "timeout", "server_error"})
# How much of a server's error body goes into a message.
_BODY_CHARS = 300


# Seconds a failed endpoint is avoided while healthy ones remain (after its backoff).
COOLDOWN_S = 1.0

class PolicyError(RuntimeError):
    """A generate call failed; ``kind`` classifies it, the message names the endpoint and why."""

    def __init__(self, kind: ErrorKind, endpoint: str, message: str):
        super().__init__(f"{endpoint}: {kind}: {message}")
        self.kind = kind
        self.endpoint = endpoint


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` says about the served model."""

    model: str
    max_model_len: int | None


@dataclass
class PolicyStats:
    """Counters of a policy's traffic, for evaluation records and benchmarks.

    ``request_s`` sums the wall time spent awaiting HTTP responses (server time as seen by the
    client); ``per_endpoint`` counts the requests sent to each endpoint, retries included.
    """

    calls: int = 0
    retries: int = 0
    failures: int = 0
    request_s: float = 0.0
    per_endpoint: dict[str, int] = field(default_factory=dict)


@dataclass
class _Endpoint:
    url: str  # base URL without a trailing "/v1"
    in_flight: int = 0
    cool_until: float = 0.0  # monotonic time before which a failed endpoint is avoided


def normalize_endpoint(url: object, name: str = "endpoint") -> str:
    """``url`` as a base URL (``http://host:port``, no trailing ``/`` or ``/v1``)."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{name}: expected an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    base = url.strip().rstrip("/")
    base = base.removesuffix("/v1")
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{name}: expected an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    return base


class OpenAIPolicy:
    """Token-in / token-out generation against one or more OpenAI-compatible servers.

    ``endpoints``: base URLs (``http://127.0.0.1:8000`` or ``.../v1``). ``model``: the served
    model name; ``None`` asks the first endpoint's ``/v1/models`` once. ``end_token_ids``: ids that
    end a generation (sent as ``stop_token_ids`` so the server's generation config does not
    matter; a stopped generation returns its end token last, as the :class:`Generation` contract
    requires). ``timeout_s`` bounds one HTTP request, ``max_retries`` the retries of one call
    (backoff ``backoff_s * 2**attempt`` with full jitter, at most ``max_backoff_s``);
    ``max_concurrency`` caps requests in flight over all endpoints. ``seed`` seeds the jitter and,
    when given, the server's sampling (per call ``seed + call number``).

    Use as ``async with OpenAIPolicy(...) as policy:``; the HTTP session belongs to the event loop
    that first used it.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        end_token_ids: Sequence[int],
        model: str | None = None,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_concurrency: int = 64,
        api_key: str | None = None,
        seed: int | None = None,
    ) -> None:
        if isinstance(endpoints, str) or not endpoints:
            raise ValueError(f"endpoints: expected a non-empty list of URLs, got {endpoints!r}")
        if not end_token_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in end_token_ids):
            raise ValueError(f"end_token_ids: expected a non-empty list of ints, got {end_token_ids!r}")
        for name, value in (("timeout_s", timeout_s), ("connect_timeout_s", connect_timeout_s)):
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: expected a number > 0, got {value!r}")
        for name, value in (("backoff_s", backoff_s), ("max_backoff_s", max_backoff_s)):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: expected a number >= 0, got {value!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries: expected an integer >= 0, got {max_retries!r}")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected an integer >= 1, got {max_concurrency!r}")
        self.endpoints = [_Endpoint(normalize_endpoint(url, f"endpoints[{i}]")) for i, url in enumerate(endpoints)]
        self.end_token_ids = frozenset(end_token_ids)
        self._stop_ids = sorted(self.end_token_ids)
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_concurrency = max_concurrency
        self.seed = seed
        self.stats = PolicyStats()
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._rng = random.Random(seed)
        self._turn = itertools.count()  # round-robin tie-break between equally loaded endpoints
        self._session: aiohttp.ClientSession | None = None
        self._limit: asyncio.Semaphore | None = None
        self._info_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._info: ServerInfo | None = None

    # ------------------------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> OpenAIPolicy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP session (a later call opens a new one)."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session cannot move between event loops; a new loop gets its own.
            self._loop = loop
            self._limit = asyncio.Semaphore(self.max_concurrency)
            self._info_lock = asyncio.Lock()
            connector = aiohttp.TCPConnector(limit=self.max_concurrency, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self._headers)
        return self._session

    # ------------------------------------------------------------------------------ server info

    @classmethod
    async def connect(cls, who: str, *args: Any, **kwargs: Any) -> tuple["OpenAIPolicy", ServerInfo]:
        """A policy (``OpenAIPolicy(*args, **kwargs)``) whose server answered ``/v1/models``.

        An unreachable server ends the program with a message naming ``who`` (the caller, e.g.
        ``eval``) before anything ran, rather than every sample failing one by one.
        """
        policy = cls(*args, **kwargs)
        try:
            return policy, await policy.server_info()
        except PolicyError as err:
            await policy.close()
            raise SystemExit(f"[{who}] cannot reach the model server ({err}); nothing was run") from None

    async def server_info(self) -> ServerInfo:
        """The served model's name and context length from ``/v1/models`` (asked once)."""
        self._ensure_session()
        async with self._info_lock:  # concurrent first calls share one request
            if self._info is None:
                self._info = await self._fetch_info()
                self.model = self._info.model
        return self._info

    async def _fetch_info(self) -> ServerInfo:
        endpoint = self.endpoints[0]
        data = await self._with_retries(lambda ep: self._get_models(ep), prefer=endpoint)
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list) or not models or not all(isinstance(m, dict) and "id" in m for m in models):
            raise PolicyError("malformed", endpoint.url, f"/v1/models: expected data[0].id, got {_clip(data)}")
        wanted = self.model or models[0]["id"]
        entry = next((m for m in models if m["id"] == wanted), None)
        if entry is None:
            served = [m["id"] for m in models]
            raise PolicyError("rejected", endpoint.url, f"model {wanted!r} is not served; served: {served}")
        max_len = entry.get("max_model_len")
        return ServerInfo(model=wanted, max_model_len=max_len if isinstance(max_len, int) else None)

    async def _get_models(self, endpoint: _Endpoint) -> Any:
        async with self._ensure_session().get(f"{endpoint.url}/v1/models") as response:
            return await _json_body(response, endpoint.url)

    # ---------------------------------------------------------------------------------- generate

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Continue ``prompt_ids`` on the least loaded endpoint, retrying what can be retried."""
        prompt = np.asarray(prompt_ids).tolist()
        if not prompt:
            raise ValueError("prompt_ids: expected at least one token id, got none")
        if self._info is None:
            await self.server_info()  # the model name, and a check that it is served
        body = self._request_body(prompt, params)
        self.stats.calls += 1
        # orjson: a long prompt's ids cost the event loop 0.03 ms instead of json's 0.5 (bench.rollout).
        payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)  # a numpy scalar in the sampling too
        return await self._with_retries(lambda ep: self._complete(ep, payload, prompt, params))

    def _request_body(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop_token_ids": self._stop_ids,
            # vLLM extensions: the generated and the received prompt ids, and no stop on the
            # served model's own eos list beyond ours.
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.top_k > 0:
            body["top_k"] = params.top_k
        if params.logprobs:
            body["logprobs"] = 0  # the sampled token's log-prob only
        if self.seed is not None:
            body["seed"] = self.seed + self.stats.calls
        return body

    async def _complete(self, endpoint: _Endpoint, payload: bytes, prompt: list[int], params: SamplingParams) -> Generation:
        async with self._ensure_session().post(f"{endpoint.url}/v1/completions", data=payload) as response:
            data = await _json_body(response, endpoint.url)
        return self._generation(data, prompt, params, endpoint.url)

    async def _with_retries(self, request, prefer: _Endpoint | None = None) -> Any:
        """``await request(endpoint)`` under the concurrency cap, retrying retryable failures
        with backoff, each attempt on the best endpoint at that moment."""
        self._ensure_session()
        assert self._limit is not None
        attempt = 0
        while True:
            async with self._limit:
                # Picked once a slot is free, so the load it compares is the load it joins.
                endpoint = prefer or self._pick()
                endpoint.in_flight += 1
                self.stats.per_endpoint[endpoint.url] = self.stats.per_endpoint.get(endpoint.url, 0) + 1
                started = time.perf_counter()
                try:
                    return await request(endpoint)
                except PolicyError as err:
                    error = err
                except asyncio.TimeoutError:
                    error = PolicyError("timeout", endpoint.url, f"no response within {self.timeout.total} s")
                except aiohttp.ClientConnectionError as err:
                    error = PolicyError("unreachable", endpoint.url, f"{type(err).__name__}: {err}")
                except aiohttp.ClientError as err:
                    error = PolicyError("malformed", endpoint.url, f"{type(err).__name__}: {err}")
                finally:
                    endpoint.in_flight -= 1
                    self.stats.request_s += time.perf_counter() - started
            if error.kind not in TRANSIENT_KINDS or attempt >= self.max_retries:
                self.stats.failures += 1
                if attempt:
                    raise PolicyError(error.kind, error.endpoint, f"{error} (after {attempt + 1} attempts)") from None
                raise error
            delay = self._rng.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))
            # Avoided past this call's own retry (which wakes after ``delay``), for at least
            # COOLDOWN_S: other endpoints take the traffic, however slow the event loop is.
            endpoint.cool_until = time.monotonic() + delay + max(self.backoff_s, COOLDOWN_S)
            attempt += 1
            self.stats.retries += 1
            prefer = None
            await asyncio.sleep(delay)

    def _pick(self) -> _Endpoint:
        """The endpoint with the fewest requests in flight, healthy ones first, in turn on ties."""
        now = time.monotonic()
        turn = next(self._turn)
        count = len(self.endpoints)
        order = [self.endpoints[(turn + i) % count] for i in range(count)]
        return min(order, key=lambda ep: (ep.cool_until > now, ep.in_flight))

    def _generation(self, data: Any, prompt: list[int], params: SamplingParams, where: str) -> Generation:
        """A :class:`Generation` from a completions response of ``where``, validated field by field."""
        try:
            choice = data["choices"][0]
            token_ids = choice["token_ids"]
            finish = choice.get("finish_reason")
            received = choice.get("prompt_token_ids")
        except (KeyError, IndexError, TypeError):
            raise PolicyError(
                "malformed", where, f"expected choices[0].token_ids (vLLM's return_token_ids), got {_clip(data)}"
            ) from None
        if not isinstance(token_ids, list) or not all(isinstance(t, int) for t in token_ids):
            raise PolicyError("malformed", where, f"choices[0].token_ids: expected a list of ints, got {_clip(token_ids)}")
        if received is not None and received != prompt:
            raise PolicyError(
                "prompt_changed", where, f"the server received {len(received)} prompt ids that differ from the {len(prompt)} sent"
            )
        reason = self._finish_reason(finish, token_ids, where)
        log_probs = _log_probs(choice, len(token_ids), where) if params.logprobs else None
        return Generation(token_ids=token_ids, log_probs=log_probs, finish_reason=reason)

    def _finish_reason(self, finish: Any, token_ids: list[int], where: str) -> FinishReason:
        if finish == "length":
            return "length"
        if finish == "stop":
            if not token_ids or token_ids[-1] not in self.end_token_ids:
                # A stop string (not ours) or a server that drops the end token: the contract
                # needs the end token last, and we only ask the server to stop on end tokens.
                raise PolicyError("malformed", where, f"finish_reason 'stop' without an end token {self._stop_ids} last")
            return "stop"
        if finish == "abort":
            return "abort"
        raise PolicyError("malformed", where, f"choices[0].finish_reason: expected stop, length or abort, got {finish!r}")


async def _json_body(response: aiohttp.ClientResponse, url: str) -> Any:
    """The decoded JSON body of ``response``; non-2xx statuses become classified errors."""
    raw = await response.read()
    if response.status >= 400:
        kind: ErrorKind = "server_error" if response.status in _RETRY_STATUSES else "rejected"
        text = raw[:_BODY_CHARS].decode("utf-8", errors="replace")
        raise PolicyError(kind, url, f"HTTP {response.status}: {text}")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        text = raw[:_BODY_CHARS].decode("utf-8", errors="replace")
        raise PolicyError("malformed", url, f"response is not JSON: {text!r}") from None


def _log_probs(choice: dict, count: int, where: str) -> list[float]:
    """The sampled tokens' log-probs of a completions choice (``logprobs.token_logprobs``)."""
    values = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(values, list) or len(values) != count:
        got = "none" if values is None else f"{len(values) if isinstance(values, list) else type(values).__name__}"
        raise PolicyError("malformed", where, f"logprobs.token_logprobs: expected {count} values, got {got}")
    # The log-prob of a token may be -inf, which JSON servers send as null or a very low number.
    return [float(v) if v is not None else float("-inf") for v in values]


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _BODY_CHARS else text[: _BODY_CHARS - 3] + "..."
