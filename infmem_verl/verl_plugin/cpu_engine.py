"""verl's own FSDP engines, registered for the ``cpu`` device (:mod:`.platform`).

verl picks a training engine by (model type, strategy, device): its FSDP engines are registered
for ``cuda`` and ``npu`` only, though nothing in them needs more than what torch's FSDP and gloo
provide on a CPU. This registers them for ``cpu``, for both strategies verl accepts, ``fsdp``
(FSDP1) and ``fsdp2``, with one change (:class:`HostResidentForwardOnly`): a forward-only FSDP2
model (the reference policy) is built without the CPU offload policy verl forces on it.

Why: verl gives every forward-only FSDP2 model ``CPUOffloadPolicy(pin_memory=True)``, and no
setting turns it off (``verl/workers/engine/fsdp/transformer_impl.py``, ``_build_fsdp_module``).
Pinning host memory needs an accelerator ("Cannot access accelerator device when none is
available" in torch's ``_fsdp_param.py``), so the reference model, hence the KL loss, could not run
on a CPU. Offloading to host memory means nothing when the device is the host: the same module
sharded without an offload policy is what such a policy would leave on a CPU, minus the pinning.
Registered from :mod:`infmem_verl.plugin` once ``verl.workers.engine`` has been imported.
"""

from __future__ import annotations

from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from infmem_verl.verl_plugin.platform import PLATFORM

STRATEGIES = ["fsdp", "fsdp2"]


class HostResidentForwardOnly:
    """An FSDP engine mixin: a forward-only FSDP2 model is sharded as a trained one is (no offload
    policy, so no pinned memory); everything else is verl's. verl reads ``forward_only`` in
    ``_build_fsdp_module`` only to choose that policy for FSDP2 (and its offload flags, which stay
    as the config sets them), so the flag is lowered for that call alone."""

    def _build_fsdp_module(self, module):
        config = self.engine_config
        if config.strategy != "fsdp2" or not config.forward_only:
            return super()._build_fsdp_module(module)
        # verl's configs refuse attribute writes after construction; verl writes them the same way.
        object.__setattr__(config, "forward_only", False)
        try:
            return super()._build_fsdp_module(module)
        finally:
            object.__setattr__(config, "forward_only", True)


class CPUFSDPEngineWithLMHead(HostResidentForwardOnly, FSDPEngineWithLMHead):
    """verl's FSDP language-model engine on the ``cpu`` device (see :class:`HostResidentForwardOnly`)."""


class CPUFSDPEngineWithValueHead(HostResidentForwardOnly, FSDPEngineWithValueHead):
    """verl's FSDP value-model engine on the ``cpu`` device (see :class:`HostResidentForwardOnly`)."""


for _model_type, _engine in (("language_model", CPUFSDPEngineWithLMHead), ("value_model", CPUFSDPEngineWithValueHead)):
    EngineRegistry.register(model_type=_model_type, backend=STRATEGIES, device=PLATFORM)(_engine)
