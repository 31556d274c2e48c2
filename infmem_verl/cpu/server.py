"""The generation actor of the CPU backend: verl's rollout-server contract on transformers.

verl's ``LLMServerClient`` asks a load-balancer actor for a server and then awaits
``server.generate.remote(request_id=..., prompt_ids=..., sampling_params=..., image_data=...,
video_data=..., **kw)``, expecting a ``TokenOutput``. Any Ray actor with that method can stand in
for vLLM (verl 0.9.1 has no CPU rollout backend), so verl's real client, router, agent-loop workers
and TransferQueue run unchanged. Generation is the agent core's batching
:class:`~infmem_verl.policy.transformers.TransformersPolicy` (no second implementation); its
log-probs are what verl's actor recomputes (``log_softmax(logits / temperature)``).

For training the actor also takes new weights (:meth:`CPUGenerationServer.update_weights`, the
CPU counterpart of verl's checkpoint-engine sync) and reports which weights it serves
(:func:`weights_digest`), so a run can prove that rollouts use exactly the last update.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import ray
import torch
from verl.workers.rollout.replica import TokenOutput
from verl.workers.rollout.router import get_router_handle

from infmem_verl.agent.policy import SamplingParams

# Bits of the SHA-256 kept by weights_digest: small enough to travel as an exact float in metrics.
DIGEST_BITS = 48


def weights_digest(model: torch.nn.Module) -> int:
    """A fingerprint of every tensor of ``model.state_dict()`` (names, shapes, dtypes and bytes).

    Two models with bit-identical weights give the same value whatever their thread counts, which
    a float checksum would not guarantee. Truncated to :data:`DIGEST_BITS` bits so that it is
    exactly representable in a float64 metric.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().contiguous()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype}".encode())
        digest.update(data.view(torch.uint8).numpy())
    return int.from_bytes(digest.digest()[: DIGEST_BITS // 8], "big")


def torch_threads(threads: int | None) -> int:
    """The torch thread count to use: ``threads``, or every core of the machine when ``None``
    (the launcher sets ``threads`` from the shell's ``OMP_NUM_THREADS``, see ``apply_cpu_backend``).

    Ray sets ``OMP_NUM_THREADS`` to an actor's reserved CPUs (one), which would leave a laptop's
    other cores idle; generation and updates never overlap in sync training, so each may use all.
    """
    return threads or os.cpu_count() or 1


class CPUGenerationServer:
    """verl's ``generate`` contract over a local model folder; takes weight updates between steps.

    ``global_steps`` is the weight version reported with every output (verl's trainer computes
    its off-policy staleness from it); :meth:`update_weights` advances it.
    """

    def __init__(
        self,
        model_dir: str,
        seed: int = 0,
        global_steps: int = 0,
        max_batch: int = 8,
        threads: int | None = None,
    ):
        from infmem_verl.policy.transformers import TransformersPolicy

        torch.set_num_threads(torch_threads(threads))
        self.policy = TransformersPolicy.from_pretrained(model_dir, seed=seed, max_batch=max_batch)
        self.global_steps = global_steps
        self.calls = 0
        self.in_flight = 0

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
        """One call of verl's rollout contract: the sampled ids and their log-probs."""
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
        self.in_flight += 1
        try:
            generation = await self.policy.generate(prompt_ids, params)
        finally:
            self.in_flight -= 1
        self.calls += 1
        # vLLM reports both a natural stop and a cut response as "completed".
        return TokenOutput(
            token_ids=generation.token_ids,
            log_probs=generation.log_probs,
            stop_reason="completed",
            extra_fields={"global_steps": self.global_steps},
        )

    def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int) -> int:
        """Serve ``state_dict`` from now on, as weight version ``global_steps``; returns the digest.

        Refused while a request is being decoded: a sync trainer updates between rollouts, and a
        batch that changed weights half-way would report log-probs of no single policy.
        """
        if self.in_flight:
            raise RuntimeError(f"update_weights: {self.in_flight} generate call(s) still in flight")
        self.policy.model.load_state_dict(state_dict, strict=True)
        self.policy.clear_prefix_cache()  # its KV caches came from the old weights
        self.global_steps = int(global_steps)
        return weights_digest(self.policy.model)

    def weights_digest(self) -> int:
        return weights_digest(self.policy.model)

    def compute_log_probs(
        self, prompt_ids: list[int], response_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Log-probs of ``response_ids`` under the served weights (see ``TransformersPolicy``)."""
        return self.policy.compute_log_probs(prompt_ids, response_ids, temperature).tolist()

    def num_calls(self) -> int:
        return self.calls


def start_cpu_router(model_dir: str, seed: int = 0, global_steps: int = 0, **server_kwargs: Any):
    """One generation actor behind verl's real load balancer: ``(server handle, balancer handle)``.

    ``server_kwargs`` go to :class:`CPUGenerationServer` (``max_batch``, ``threads``).
    """
    actor = ray.remote(num_cpus=1)(CPUGenerationServer)
    server = actor.remote(str(model_dir), seed=seed, global_steps=global_steps, **server_kwargs)
    balancer = get_router_handle(servers={"cpu-server-0": server})
    return server, balancer
