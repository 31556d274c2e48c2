"""verl's own FSDP engines, registered for the ``cpu`` device (:mod:`.platform`).

verl picks a training engine by (model type, strategy, device): its FSDP engines are registered
for ``cuda`` and ``npu`` only, though nothing in them needs more than what torch's FSDP and gloo
provide on a CPU. This registers the same classes (nothing subclassed or changed) for ``cpu``, for
both strategies verl accepts, ``fsdp`` (FSDP1) and ``fsdp2``. Registered from
:mod:`infmem_verl.plugin` once ``verl.workers.engine`` has been imported.
"""

from __future__ import annotations

from verl.workers.engine import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from infmem_verl.verl_plugin.platform import PLATFORM

STRATEGIES = ["fsdp", "fsdp2"]

for _model_type, _engine in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
    EngineRegistry.register(model_type=_model_type, backend=STRATEGIES, device=PLATFORM)(_engine)
