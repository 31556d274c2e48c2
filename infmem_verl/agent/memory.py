"""The bounded memory an agent carries from chunk to chunk.

The memory is the text a Write call produces after ``</think>`` (or its whole response with
thinking off). It overwrites the previous memory, is hard-capped at ``memory_tokens`` tokens and
is never silently lost: a Write that yields no usable memory keeps the old one and is flagged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .trajectory import FLAG_MEMORY_KEPT, FLAG_MEMORY_TRUNCATED, FLAG_OUTPUT_TRUNCATED, FLAG_THINK_UNCLOSED


@dataclass(frozen=True)
class Memory:
    ids: np.ndarray  # int32 token ids as they appear in the next prompt
    text: str

    @classmethod
    def empty(cls) -> "Memory":
        return cls(ids=np.zeros(0, dtype=np.int32), text="")

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class MemoryUpdate:
    memory: Memory
    valid: bool
    flags: list[str] = field(default_factory=list)
    reason: str = ""


def update_memory(
    old: Memory,
    output: str,
    closed: bool,
    output_finished: bool,
    cap: int,
    encode: Callable[[str], np.ndarray],
    decode: Callable[[np.ndarray], str],
) -> MemoryUpdate:
    """The memory after a Write whose post-thinking text is ``output``.

    ``closed`` says the thinking block was closed (always true with thinking off);
    ``output_finished`` that the output ended with the model's end token rather than the budget.
    The text is re-tokenized (stripped by string, never by a token offset) and cut at ``cap``.
    """
    if not closed:
        return MemoryUpdate(old, False, [FLAG_THINK_UNCLOSED, FLAG_MEMORY_KEPT], "thinking never closed")
    text = output.strip()
    if not text:
        return MemoryUpdate(old, False, [FLAG_MEMORY_KEPT], "empty memory")
    flags: list[str] = []
    reasons: list[str] = []
    if not output_finished:
        flags.append(FLAG_OUTPUT_TRUNCATED)
        reasons.append("memory output hit its token budget")
    ids = encode(text)
    if ids.shape[0] > cap:
        ids = ids[:cap]
        text = decode(ids)
        flags.append(FLAG_MEMORY_TRUNCATED)
        reasons.append(f"memory longer than {cap} tokens, truncated")
    return MemoryUpdate(Memory(ids=ids, text=text), not flags, flags, "; ".join(reasons))
