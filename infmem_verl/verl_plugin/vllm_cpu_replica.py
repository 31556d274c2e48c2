"""verl's ``vllm`` rollout replica on the ``cpu`` platform: :class:`~infmem_verl.verl_plugin.
vllm_cpu_rollout.CPUvLLMReplica`, whose weight sync vLLM's CPU build can take (that module says
why verl's own cannot).

Registered from :mod:`infmem_verl.plugin` once ``verl.workers.rollout.replica`` (verl's
``RolloutReplicaRegistry``) has been imported: in the process that builds the replicas (verl's
``LLMServerManager``: the TaskRunner, or a script's driver). The loader decides when verl asks
for the class, not at import: with the ``cpu`` platform active (``VERL_PLATFORM=cpu``) it returns
ours; on any other platform verl's own ``vLLMReplica``, as verl's loader does. Nothing is imported
from vLLM until then, so this module is safe where vLLM is not installed.
"""

from __future__ import annotations

from verl.plugin.platform import get_platform
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

from infmem_verl.verl_plugin.platform import PlatformCPU

NAME = "vllm"


def load_vllm_replica() -> type[RolloutReplica]:
    """The replica class for ``rollout.name=vllm`` on the current platform."""
    if isinstance(get_platform(), PlatformCPU):
        from infmem_verl.verl_plugin.vllm_cpu_rollout import CPUvLLMReplica

        return CPUvLLMReplica
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica

    return vLLMReplica


RolloutReplicaRegistry.register(NAME, load_vllm_replica)
