"""``warmup.json``, the record a warmed-up model folder carries (see :mod:`infmem_verl.cpu.warmup`).

Its own module, below the trainer that plots its SFT losses in the run summary and the warm-up
that writes it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPORT = "warmup.json"


@dataclass
class HeldOut:
    """What the warmed model does on held-out documents: per-turn protocol validity and the
    figures the RL run logs per trajectory (means over trajectories)."""

    samples: int
    prethink_valid: float  # PreThink turns whose action parsed
    write_valid: float  # Writes that closed their thinking and stayed within the memory cap
    retrieval_calls: float
    chunks_read: float
    stopped_early: float
    early_stop: float  # the early-stop reward component
    accuracy: float  # exact match of the boxed answer
    sub_em: float = float("nan")  # a gold answer inside the boxed one (NaN in reports before it)
    answer_in_memory: float = float("nan")  # the last memory holds a gold answer (the copy itself)

    def line(self) -> str:
        return (
            f"held-out {self.samples} docs: PreThink actions valid {self.prethink_valid:.0%}, "
            f"Writes valid {self.write_valid:.0%} | retrievals {self.retrieval_calls:.1f}/traj, "
            f"chunks read {self.chunks_read:.1f}, stopped early {self.stopped_early:.0%}, "
            f"answer in memory {self.answer_in_memory:.0%}, early-stop reward {self.early_stop:.2f}, "
            f"accuracy {self.accuracy:.0%} (sub-EM {self.sub_em:.0%})"
        )


@dataclass
class WarmupReport:
    """``warmup.json``: how the model was made and what it reached."""

    settings: dict[str, Any]
    protocol_key: str
    sft_losses: list[float] = field(default_factory=list)  # every SFT step, the stages in order
    stages: dict[str, int] = field(default_factory=dict)  # steps of each SFT stage, in order (curriculum, then "sft")
    lm_losses: list[float] = field(default_factory=list)  # the stage on every token, before SFT
    heldout: HeldOut | None = None  # of the agent whose run built the model
    agents: dict[str, HeldOut] = field(default_factory=dict)  # of every agent it was built and checked for
    seconds: dict[str, float] = field(default_factory=dict)  # per stage
    # Per segment of a gated stage (infmem_verl.cpu.warmup.GATES), what the student copies after it:
    # an answer segment's share of held-out answer calls answered exactly per kind of question
    # (infmem_verl.sft.curriculum.copied_kinds), a MemAgent segment's "answer in memory".
    copied: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def read(cls, path: Path) -> WarmupReport:
        data = json.loads(path.read_text(encoding="utf-8"))
        heldout = data.pop("heldout", None)
        agents = {agent: HeldOut(**figures) for agent, figures in data.pop("agents", {}).items()}
        return cls(**data, heldout=HeldOut(**heldout) if heldout else None, agents=agents)


def warmup_report(model_path: str | Path | None) -> WarmupReport | None:
    """The warm-up report of a model folder the warm-up built; None for any other model (or none)."""
    if model_path is None:
        return None
    path = Path(model_path).parent / REPORT
    return WarmupReport.read(path) if path.is_file() else None
