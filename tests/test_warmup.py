"""The demo recipe's warm-up end to end on real components: distil -> SFT -> held-out check.

The warm-up (:mod:`infmem_verl.cpu.warmup`) runs the real ``python -m infmem_verl.distill
--teacher oracle`` and ``python -m infmem_verl.sft +recipe=sft_warmup`` commands, checks the
student on held-out documents with the agent core, and caches the model with its report. The
``warm_model`` fixture of conftest.py (4 distilled trajectories, 3 SFT steps) proves the chain,
and GRPO from its SFT output, in console mode, is the MemAgent learning run of
tests/test_cpu_training_runs.py. A longer warm-up (64 trajectories, 300 steps over the demo's
4,096-token vocabulary) proves the student learns the protocol, against a threshold it reaches,
in tests/test_infmem_learning.py, whose InfMem learning run starts from it.
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


def test_the_check_samples_at_the_warm_ups_own_settings_whatever_the_launch_samples_at():
    """The cache key leaves the run's sampling out, so the model one launch builds is the one
    every launch reuses: its check (and the refusal under min_valid) must not follow the launch."""
    import pytest

    from infmem_verl.agent.errors import ConfigError
    from infmem_verl.cpu.warmup import check_sampling, protocol_key, warmup_settings
    from infmem_verl.settings import agent_settings

    hot = demo_config("actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0")
    cool = demo_config()
    settings, agent_cfg = warmup_settings(hot), agent_settings(hot)
    checked = check_sampling(settings, agent_cfg)
    assert (checked.temperature, checked.top_p) == (0.6, 0.95) != (agent_cfg.temperature, agent_cfg.top_p)
    assert protocol_key(settings, "infmem", agent_cfg) == protocol_key(warmup_settings(cool), "infmem", agent_settings(cool))
    colder = warmup_settings(demo_config("infmem.warmup.check_temperature=0.3"))
    assert check_sampling(colder, agent_cfg).temperature == 0.3
    assert protocol_key(colder, "infmem", agent_cfg) != protocol_key(settings, "infmem", agent_cfg)
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.check_top_p: expected a number in \(0, 1\], got 0"):
        warmup_settings(demo_config("infmem.warmup.check_top_p=0"))


# The demo's curriculum in miniature (its figures come from the full stages, `make demo` and
# docs/experiments/2026-12-06-demo-curriculum.md): every stage runs, in segments, through the SFT
# command; one student is built and checked for both agents; a rebuild resumes where it stopped.
CURRICULUM_SMALL = [
    "infmem.warmup.hidden_size=64",
    "infmem.warmup.answer_steps=4",
    "infmem.warmup.memagent_steps=2",
    "infmem.warmup.infmem_steps=2",
    "infmem.warmup.segment_steps=2",
    "infmem.warmup.batch_size=4",
    "infmem.warmup.answers_per_batch=2",
    "infmem.warmup.heldout_samples=2",
    "infmem.warmup.min_valid=0",
    "infmem.warmup.answer_copy_min=0",  # a 4-step answer stage copies nothing (the gate's own test below)
    "infmem.warmup.memory_copy_min=0",  # nor do 2 MemAgent steps teach Writes to copy (its test below)
    "infmem.warmup.min_accuracy=0",  # nor does the student answer (refused first in the test below)
]


def test_warm_up_settings_without_training_or_with_a_negative_share_are_refused():
    import pytest

    from infmem_verl.agent.errors import ConfigError
    from infmem_verl.cpu.bootstrap import bootstrap_settings
    from infmem_verl.cpu.warmup import warmup_settings

    with pytest.raises(ConfigError, match=r"infmem\.warmup: no training; set sft_steps or the curriculum's"):
        warmup_settings(demo_config("infmem.warmup.answer_steps=0", "infmem.warmup.memagent_steps=0", "infmem.warmup.infmem_steps=0"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.lm_steps: trains on the distilled calls"):
        warmup_settings(demo_config("infmem.warmup.lm_steps=5"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.answers_per_batch: expected an integer >= 0, got -1"):
        warmup_settings(demo_config("infmem.warmup.answers_per_batch=-1"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.answer_copy_min: expected a number in \[0, 1\], got 1\.5"):
        warmup_settings(demo_config("infmem.warmup.answer_copy_min=1.5"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.memory_copy_min: expected a number in \[0, 1\], got 2"):
        warmup_settings(demo_config("infmem.warmup.memory_copy_min=2"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.min_accuracy: expected a number in \[0, 1\], got -0\.1"):
        warmup_settings(demo_config("infmem.warmup.min_accuracy=-0.1"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.answer_names: expected '' \(the documents' names\), 'syllables', 'list' or 'roles', got 'greek'"):
        warmup_settings(demo_config("infmem.warmup.answer_names=greek"))
    with pytest.raises(ConfigError, match=r"infmem\.warmup\.segment_steps: expected an integer >= 1, got 0"):
        warmup_settings(demo_config("infmem.warmup.segment_steps=0"))
    with pytest.raises(ConfigError, match=r"infmem\.bootstrap\.names: expected 'syllables', 'list' or 'roles', got 'greek'"):
        bootstrap_settings(demo_config("infmem.bootstrap.names=greek"))


def test_the_curriculum_trains_its_stages_in_segments_for_both_agents_and_resumes(tmp_path, monkeypatch):
    import shutil

    import pyarrow.parquet as pq
    import pytest

    from infmem_verl.agent.errors import ConfigError
    from infmem_verl.cpu.warmup import WARMUP_KEY, WarmupError

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)  # where a user would find Hydra's outputs/ of each SFT command
    # Under min_accuracy the student is refused after its check; rerun with a lower bar (the same
    # cache entry: the bar decides no weights), the finished segments are reused.
    refused = [*CURRICULUM_SMALL, "infmem.warmup.min_accuracy=0.5"]
    with pytest.raises(WarmupError, match=r"answers 0% of held-out infmem questions, under min_accuracy=50%.*min_accuracy=0 runs RL"):
        warm_qwen3_dir(demo_config(*refused), "demo", refused, cache_dir=tmp_path)
    work = next(tmp_path.glob("warm-qwen3-*")) / "work"
    first = {name: (work / name / "sft_losses.jsonl").stat().st_mtime_ns for name in ("answer1", "answer2", "memagent1", "infmem1")}
    model = warm_qwen3_dir(demo_config(*CURRICULUM_SMALL), "demo", CURRICULUM_SMALL, cache_dir=tmp_path)
    assert model.parent / "work" == work and {name: (work / name / "sft_losses.jsonl").stat().st_mtime_ns for name in first} == first
    report = warmup_report(model)
    assert report.stages == {"answer1": 2, "answer2": 2, "memagent1": 2, "infmem1": 2}
    assert len(report.sft_losses) == 8 and set(report.seconds) == {"curriculum", "check"}
    assert (work / "answer1" / ".hydra").is_dir() and not (tmp_path / "outputs").exists()
    assert set(report.agents) == {"infmem", "memagent"} and report.heldout == report.agents["infmem"]
    assert report.agents["memagent"].retrieval_calls == 0 and report.agents["infmem"].samples == 2
    # Each segment trains one pass over calls of its own seed: none is seen twice.
    segments = [pq.read_table(work / f"answer{i}.parquet").column("input_ids").to_pylist() for i in (1, 2)]
    assert [len(rows) for rows in segments] == [8, 8]
    assert len({tuple(row) for rows in segments for row in rows}) == 16
    # The MemAgent run uses the same student (one cache entry for both agents).
    assert warm_qwen3_dir(demo_config(*CURRICULUM_SMALL, "agent=memagent"), "demo", CURRICULUM_SMALL, cache_dir=tmp_path) == model
    # A build stopped before its last segment resumes there: the finished ones are not trained again.
    trained = {name: (work / name / "sft_losses.jsonl").stat().st_mtime_ns for name in ("answer1", "answer2", "memagent1")}
    shutil.rmtree(model)
    (model.parent / "warmup.json").unlink()
    shutil.rmtree(work / "infmem1")
    assert warm_qwen3_dir(demo_config(*CURRICULUM_SMALL), "demo", CURRICULUM_SMALL, cache_dir=tmp_path) == model
    assert {name: (work / name / "sft_losses.jsonl").stat().st_mtime_ns for name in trained} == trained
    assert warmup_report(model).stages == report.stages
    # The distillation's documents have syllable names: with role names the warm-up refuses it.
    with pytest.raises(ConfigError, match=rf"{WARMUP_KEY}\.sft_steps: the distillation's documents have syllable names"):
        warm_qwen3_dir(demo_config(*CURRICULUM_SMALL, "infmem.warmup.sft_steps=5"), "demo", [], cache_dir=tmp_path)


def test_a_student_that_copies_no_kind_of_name_stops_the_build_after_its_answer_stage(tmp_path):
    """The answer stage's gate (infmem.warmup.answer_copy_min): the miniature's answer stage
    copies no name, so the build stops after it with the figures, before the MemAgent stage."""
    import pytest

    from infmem_verl.cpu.warmup import WarmupError

    gated = [*CURRICULUM_SMALL, "infmem.warmup.answer_copy_min=0.5"]
    with pytest.raises(WarmupError, match=r"after 4 answer steps, held-out answer calls answered exactly: two-hop 0%, bridge 0%, entity 0%, under answer_copy_min=50%.*infmem\.warmup\.model_seed"):
        warm_qwen3_dir(demo_config(*gated), "demo", gated, cache_dir=tmp_path)
    work = next(tmp_path.glob("warm-qwen3-*")) / "work"
    assert (work / "answer2").is_dir() and not (work / "memagent1.parquet").exists()


def test_writes_that_copy_no_answer_stop_the_build_after_its_memagent_stage(tmp_path):
    """The MemAgent stage's gate (infmem.warmup.memory_copy_min): after each MemAgent segment the
    student runs MemAgent on the held-out documents; the miniature's Writes leave no answer in
    memory, so the build stops after its last MemAgent segment, before the InfMem stage (no answer
    stage: two SFT commands instead of four)."""
    import pytest

    from infmem_verl.cpu.warmup import WarmupError

    gated = [*CURRICULUM_SMALL, "infmem.warmup.answer_steps=0", "infmem.warmup.memagent_steps=4", "infmem.warmup.memory_copy_min=0.5"]
    with pytest.raises(WarmupError, match=r"after 4 memagent steps, held-out MemAgent runs whose last memory holds the answer: answer in memory 0%, under memory_copy_min=50%.*infmem\.warmup\.memagent_steps"):
        warm_qwen3_dir(demo_config(*gated), "demo", gated, cache_dir=tmp_path)
    work = next(tmp_path.glob("warm-qwen3-*")) / "work"
    assert (work / "memagent2").is_dir() and not (work / "infmem1.parquet").exists()
