"""The demo recipe's warm-up end to end on real components: distil -> SFT -> held-out check.

Smaller than ``make demo`` (4 distilled trajectories, 3 SFT steps, no validity threshold; the
``warm_model`` fixture of conftest.py), so it proves the chain, not the student's quality: the
warm-up (:mod:`infmem_verl.cpu.warmup`) runs the real ``python -m infmem_verl.distill --teacher
oracle`` and ``python -m infmem_verl.sft +recipe=sft_warmup`` commands, checks the student on
held-out documents with the agent core, and caches the model with its report. GRPO from that
SFT output, in console mode, is the learning run of tests/test_cpu_training_runs.py.
"""

from __future__ import annotations

from conftest import WARMUP_SMALL, demo_config
from infmem_verl.cpu.warmup import warm_qwen3_dir
from infmem_verl.warmup_report import warmup_report


def test_the_warm_up_distils_trains_checks_and_caches_the_student(warm_model):
    assert (warm_model / "config.json").is_file() and any(warm_model.glob("*.safetensors"))
    report = warmup_report(warm_model)
    assert len(report.sft_losses) == 3 and report.sft_losses[-1] < report.sft_losses[0]
    heldout = report.heldout
    assert heldout.samples == 2 and 0 <= heldout.prethink_valid <= 1 and 0 <= heldout.write_valid <= 1
    assert 1 <= heldout.chunks_read <= 4
    assert set(report.seconds) == {"distill", "sft", "check"}
    # The oracle's records and the SFT samples built from them stay next to the model.
    work = warm_model.parent / "work"
    assert (work / "distill" / "sft_train.parquet").is_file() and (work / "sft.log").is_file()
    assert warm_qwen3_dir(demo_config(*WARMUP_SMALL), "demo", WARMUP_SMALL, cache_dir=warm_model.parent.parent) == warm_model
