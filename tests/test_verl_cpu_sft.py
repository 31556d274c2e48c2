"""verl's own FSDP workers (``TrainingWorker``, the FSDP2 engine) on 2 gloo ranks, through verl's
platform hook (``VERL_PLATFORM=cpu``, :mod:`infmem_verl.verl_plugin.platform`), driven by verl's
own Ray SFT trainer on the smoke SFT data: no verl code replaced, no verl patch. The run is
tests/verl_cpu_sft.py in its own process (the platform and the Ray session are per process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from test_sft import distilled  # noqa: F401  (the scripted-teacher distillation: real SFT samples)

from infmem_verl.sft.samples import sft_paths

REPO = Path(__file__).resolve().parents[1]
STEPS = 2


def test_verl_sft_trainer_on_two_gloo_ranks(tmp_path, distilled):
    from transformers import AutoModelForCausalLM

    from infmem_verl.export import export_checkpoint

    parquet = sft_paths(distilled[0])["train"]
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "verl_cpu_sft.py"), str(parquet), str(tmp_path), str(STEPS)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    # A bound for a hung Ray job, not a speed target. The run took 71 s on quiet cores of one
    # machine and 300-372 s alone on an AVX2 EPYC, where bfloat16 matrix products are a scalar
    # loop; in float32 (CPU_MIXED_PRECISION, 2026-12-07) 82 s alone there.
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads((tmp_path / "result.json").read_text())
    ranks = result["ranks"]
    assert len(ranks) == 2
    # Both ranks computed in float32 (infmem_verl.cpu.backend.CPU_MIXED_PRECISION), not verl's bfloat16.
    assert [rank["compute_dtype"] for rank in ranks] == ["float32", "float32"]
    # Every rank's AdamW took exactly one step per SFT step (read from the optimizer's own state).
    assert [rank["optimizer_steps"] for rank in ranks] == [[STEPS], [STEPS]]
    # FSDP2 shards the parameters over the two ranks; gathered, both hold the same model ...
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    # ... which verl's checkpoint of the last step holds: the export loads in transformers.
    export = export_checkpoint(tmp_path / "checkpoints" / f"global_step_{STEPS}", tmp_path / "export")
    trained = AutoModelForCausalLM.from_pretrained(export.out, dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(result["model"], dtype=torch.float32)
    moved = max((a - b).abs().max().item() for a, b in zip(trained.parameters(), initial.parameters(), strict=True))
    assert moved > 0, "the exported weights are the initial ones"
