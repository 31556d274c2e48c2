"""A CPU stand-in for verl's vLLM rollout server: a Ray actor on transformers with verl's contract.

verl's ``LLMServerClient`` asks a load-balancer actor for a server and then awaits
``server.generate.remote(request_id=..., prompt_ids=..., sampling_params=..., image_data=...,
video_data=..., **kw)``, expecting a ``TokenOutput``. Any Ray actor with that method can stand in
for vLLM (verl 0.9.1 has no CPU rollout backend), so the real client, router, agent-loop workers
and TransferQueue run unchanged in CPU tests. Generation is the project's batching
:class:`~infmem_verl.policy.transformers.TransformersPolicy`, whose log-probs are what verl's actor
recomputes (``log_softmax(logits / temperature)``).
"""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import get_router_handle

from infmem_verl.agent.policy import SamplingParams


class CPUGenerationServer:
    """verl's ``generate`` contract over a local model folder; counts its calls."""

    def __init__(self, model_dir: str, seed: int = 0, global_steps: int = 0, max_batch: int = 8):
        import torch

        from infmem_verl.policy.transformers import TransformersPolicy

        torch.set_num_threads(1)
        self.policy = TransformersPolicy.from_pretrained(model_dir, seed=seed, max_batch=max_batch)
        self.global_steps = global_steps
        self.calls = 0

    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise ValueError("CPUGenerationServer: text only (image_data/video_data must be None)")
        if sampling_params.get("repetition_penalty", 1.0) != 1.0:
            raise ValueError("CPUGenerationServer: repetition_penalty is not supported")
        params = SamplingParams(
            max_tokens=int(sampling_params["max_tokens"]),
            temperature=float(sampling_params.get("temperature", 1.0)),
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=int(sampling_params.get("top_k", -1)),
            logprobs=bool(sampling_params.get("logprobs", False)),
        )
        generation = await self.policy.generate(prompt_ids, params)
        self.calls += 1
        # vLLM reports both a natural stop and a cut response as "completed".
        return TokenOutput(
            token_ids=generation.token_ids,
            log_probs=generation.log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def num_calls(self) -> int:
        return self.calls


def start_cpu_router(model_dir: str, seed: int = 0, global_steps: int = 0):
    """One CPU server behind verl's real load balancer: ``(server handle, balancer handle)``."""
    server = ray.remote(num_cpus=1)(CPUGenerationServer).remote(str(model_dir), seed=seed, global_steps=global_steps)
    balancer = get_router_handle(servers={"cpu-server-0": server})
    return server, balancer
