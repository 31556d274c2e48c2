"""The model a command talks to: OpenAI-compatible servers, or a transformers model in process.

``python -m infmem_verl.eval`` and ``python -m infmem_verl.distill`` take the same model
options (:func:`add_model_options`, read back as a :class:`ModelSource` by :func:`model_source`),
hold them as their config's ``source`` and open the model the same way (:func:`open_model`): with ``--endpoint`` an :class:`~infmem_verl.policy.openai.OpenAIPolicy`
whose server has answered ``/v1/models``; without, a :class:`~infmem_verl.policy.transformers.TransformersPolicy`
on ``--model-dir`` (the tiny random Qwen3 by default), so both commands run anywhere.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.policy import Policy


@dataclass(frozen=True)
class ModelSource:
    """Where the model comes from and how requests to it behave."""

    endpoints: tuple[str, ...] = ()
    model: str | None = None  # served model name; None: the server's first
    model_dir: Path | None = None  # in-process model (no endpoints); None: the tiny random Qwen3
    tokenizer: Path | None = None  # None: the in-process model's, else Qwen3's
    concurrency: int = 8  # batch of the in-process model / requests in flight over all servers
    request_timeout_s: float = 600.0
    max_retries: int = 3
    backoff_s: float = 0.5

    def validate(self) -> ModelSource:
        for name, value, low in (("concurrency", self.concurrency, 1), ("max_retries", self.max_retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}: expected an integer >= {low}, got {value!r}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"request_timeout_s: expected a number > 0, got {self.request_timeout_s!r}")
        if self.backoff_s < 0:
            raise ConfigError(f"backoff_s: expected a number >= 0, got {self.backoff_s!r}")
        return self

    def describe(self) -> str:
        return ", ".join(self.endpoints) if self.endpoints else "in-process transformers"


@dataclass(frozen=True)
class OpenedModel:
    """A ready policy, the tokenizer prompts are built with, the model's name for records and
    reports, and its context window when the source tells it (None: unknown)."""

    policy: Policy
    tokenizer: Any
    name: str
    context_window: int | None = None

    async def close(self) -> None:
        """Release the policy's connections (the HTTP session; in-process policies hold none)."""
        close = getattr(self.policy, "close", None)
        if close is not None:
            await close()


async def open_model(source: ModelSource, who: str, seed: int) -> OpenedModel:
    """Open ``source``; an unreachable server ends the program naming ``who`` before anything ran.

    ``seed`` seeds the in-process sampler, or with servers the per-call sampling seeds.
    """
    from infmem_verl.assets import load_tokenizer
    from infmem_verl.policy.transformers import TransformersPolicy, end_token_ids

    if not source.endpoints:
        from infmem_verl.assets import tiny_qwen3_dir

        model_dir = source.model_dir or tiny_qwen3_dir()
        policy = TransformersPolicy.from_pretrained(model_dir, seed=seed, max_batch=source.concurrency)
        tokenizer = load_tokenizer(str(source.tokenizer)) if source.tokenizer else policy.tokenizer
        window = policy.model.config.max_position_embeddings
        return OpenedModel(policy, tokenizer, f"in-process:{Path(model_dir).name}", window)
    from infmem_verl.policy.openai import OpenAIPolicy

    tokenizer = load_tokenizer(str(source.tokenizer) if source.tokenizer else None)
    policy, info = await OpenAIPolicy.connect(
        who,
        list(source.endpoints),
        end_token_ids(tokenizer),
        source.model,
        timeout_s=source.request_timeout_s,
        max_retries=source.max_retries,
        backoff_s=source.backoff_s,
        max_concurrency=source.concurrency,
        seed=seed,
    )
    return OpenedModel(policy, tokenizer, info.model, info.max_model_len)


def add_model_options(parser: argparse.ArgumentParser, role: str, defaults: ModelSource) -> None:
    """The model options, as a group of ``parser`` with ``defaults``; ``role`` names the model in the help (e.g. "teacher")."""
    group = parser.add_argument_group(f"{role} (servers, or in process)")
    group.add_argument("--endpoint", dest="endpoints", action="append", default=list(defaults.endpoints), help=f"{role} server URL, OpenAI-compatible (repeatable)")
    group.add_argument("--model", default=defaults.model, help="served model name (default: the server's first)")
    group.add_argument("--model-dir", type=Path, default=defaults.model_dir, help=f"in-process {role} folder without --endpoint (default: the tiny random Qwen3)")
    group.add_argument("--tokenizer", type=Path, default=defaults.tokenizer, help="tokenizer folder prompts are built with (default: --model-dir's in process, else Qwen3's)")
    group.add_argument("--concurrency", type=int, default=defaults.concurrency, help="samples (and requests) in flight")
    group.add_argument("--timeout", type=float, default=defaults.request_timeout_s, help="seconds per HTTP request")
    group.add_argument("--retries", type=int, default=defaults.max_retries, help="retries of a failed request")
    group.add_argument("--backoff", type=float, default=defaults.backoff_s, help="first retry delay, seconds (doubles)")


def model_source(args: argparse.Namespace) -> ModelSource:
    """What :func:`add_model_options` parsed."""
    return ModelSource(
        endpoints=tuple(args.endpoints),
        model=args.model,
        model_dir=args.model_dir,
        tokenizer=args.tokenizer,
        concurrency=args.concurrency,
        request_timeout_s=args.timeout,
        max_retries=args.retries,
        backoff_s=args.backoff,
    )
