"""Where the built-once offline assets live: ``$INFMEM_CACHE``, else ``~/.cache/infmem_verl``.

The tiny models, the warmed-up student and the distilled static embedding table all go here. The
variable is read at each call, so a process (a test, a launcher) that sets it after import is
obeyed. It sits in the agent core because the static embedding table (agent/static_embed.py)
is one of those assets; everything above imports it from here.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The folder of the offline assets (not created here)."""
    return Path(os.environ.get("INFMEM_CACHE", Path.home() / ".cache" / "infmem_verl"))
