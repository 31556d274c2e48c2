"""verl's platform hook for a CPU: the ``cpu`` platform, chosen with ``VERL_PLATFORM=cpu``.

verl 0.9.1 reaches the accelerator only through ``verl.plugin.platform.get_platform()`` (device
name and module, process-group backend, Ray resource name, visible-devices variable, rollout
environment). It ships NVIDIA, Ascend and ROCm platforms and lets plugins register more
(``PlatformRegistry.register``); this module registers one for CPUs, so verl's own training
workers (the FSDP2 engine over a gloo process group; :mod:`.cpu_engine` registers the engines)
and its vLLM server (on vLLM's CPU build) run unchanged on a machine without a GPU. verl's RL
weight sync into vLLM's CPU build needs one worker-extension method of its own
(:mod:`.vllm_cpu_rollout` says why), which the ``vllm`` replica gets on this platform
(:mod:`.vllm_cpu_replica`).

* **Ranks are Ray ``GPU`` slots.** verl places every trainer rank on one unit of the resource the
  platform names, and its resource check counts Ray's ``GPU`` resource by that name; on CPU those
  are logical slots (``ray.init(num_gpus=N)``), one per rank. Ray then sets
  ``CUDA_VISIBLE_DEVICES`` per rank, which nothing on a CPU reads.
* **gloo** is the collective backend. verl builds its process-group backend as
  ``f"cpu:gloo,{device}:{backend}"`` (``verl/utils/distributed.py``), which names the CPU twice
  when the device is the CPU, and torch refuses that string. verl creates the group only when none
  exists, right after asking the platform for the backend's name, so
  :meth:`PlatformCPU.communication_backend_name` creates it there (plain gloo, from the same
  ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` environment verl's workers set) before answering.
* **Never auto-detected**: :meth:`PlatformCPU.is_platform_available` is false, so a GPU machine
  keeps verl's own detection; only ``VERL_PLATFORM=cpu`` selects this platform.
* The rollout environment gives vLLM's CPU build a small KV cache and leaves thread binding to
  the OS (see :data:`ROLLOUT_ENV`).

Registered from :mod:`infmem_verl.plugin` when ``verl.plugin.platform`` is imported (``import
verl`` does so before it loads plugins, and nothing asks for the platform before that).
"""

from __future__ import annotations

import os
import resource
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM = "cpu"
# vLLM's CPU build, as a rollout replica beside the trainer ranks on the same cores:
# * VLLM_CPU_KVCACHE_SPACE: GiB of KV cache (its default of 4 per engine is more than a small
#   model at CI's lengths uses);
# * VLLM_CPU_OMP_THREADS_BIND=nobind: vLLM otherwise pins its OpenMP threads to cores, one per
#   core, and they spin there; the trainer ranks and Ray's own processes share those cores.
ROLLOUT_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


class CPUDeviceModule(ModuleType):
    """``torch.cpu`` with the members verl calls on a device module that it lacks: memory figures
    of this process (``psutil``), the CPU RNG state, and no-ops for caches and memory fractions."""

    def __init__(self):
        super().__init__("torch.cpu")

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def ipc_collect() -> None:
        pass

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device=None) -> None:
        pass

    @staticmethod
    def mem_get_info(device=None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    @staticmethod
    def memory_allocated(device=None) -> int:
        return psutil.Process().memory_info().rss

    memory_reserved = memory_allocated

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    max_memory_reserved = max_memory_allocated

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"


DEVICE_MODULE = CPUDeviceModule()


def init_gloo_process_group() -> None:
    """The default process group over gloo, as verl would create it, in a rank of a worker group
    (``RANK`` and ``WORLD_SIZE`` set) that has none yet; elsewhere nothing."""
    import torch.distributed as dist

    if dist.is_initialized() or not {"RANK", "WORLD_SIZE"} <= os.environ.keys():
        return
    dist.init_process_group(
        backend="gloo",
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        init_method=os.environ.get("DIST_INIT_METHOD"),
    )


@PlatformRegistry.register(platform=PLATFORM)
class PlatformCPU(PlatformBase):
    """The CPU as verl's accelerator: one process per rank, gloo collectives, no device memory."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return False  # only VERL_PLATFORM=cpu selects it (see the module docstring)

    def current_device(self) -> str:
        # verl hands this to `.to()`, `torch.device()` and FSDP's `device_id`, where an integer means
        # an accelerator's index (torch raises "Cannot access accelerator device" without one).
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass  # one device per process

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cpu.synchronize()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass  # the CPU allocator has no expandable segments

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        init_gloo_process_group()  # see the module docstring: verl's own backend string fails on CPU
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its GPU slots

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
        return {"num_gpus": num_gpus}

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {key: os.environ.get(key, value) for key, value in ROLLOUT_ENV.items()}

    def cudart(self) -> Any:
        return None

