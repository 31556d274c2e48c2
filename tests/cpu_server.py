"""The CPU generation actor for the verl pipeline tests; it lives in :mod:`infmem_verl.cpu.server`
(the CPU backend trains with it), re-exported here for the tests that import ``cpu_server``."""

from infmem_verl.cpu.server import CPUGenerationServer, start_cpu_router

__all__ = ["CPUGenerationServer", "start_cpu_router"]
