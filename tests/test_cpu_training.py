"""The CPU backend's pieces, without a Ray cluster: engine, generation actor, weight sync, backend
selection, self-contained inputs, the step report, and the contract with verl's trainer.

The whole pipeline (``python -m infmem_verl.main``) runs in tests/test_cpu_training_runs.py (learning,
weight versions, cost levers, console mode) and tests/test_metrics_tb.py (the smoke recipe: Ctrl-C,
checkpoints, resume, TensorBoard, the cost ledger).
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import json
import math
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir

from infmem_verl.agent.errors import ConfigError
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.cpu.backend import (
    GPUCount,
    apply_cpu_backend,
    check_cpu_support,
    cpu_settings,
    select_backend,
    visible_gpus,
    vllm_installed,
)
from infmem_verl.cpu.bootstrap import bootstrap_inputs, bootstrap_settings
from infmem_verl.cpu.engine import TorchEngine
from infmem_verl.cpu.report import step_line, validation_line
from infmem_verl.cpu.server import CPUGenerationServer, weights_digest
from infmem_verl.main import prepare_config, run
from infmem_verl.metrics import summarize
from infmem_verl.verl_plugin.trainer import trajectory_rows


def make_config(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=list(overrides))


# ----------------------------------------------------------------------- engine and actor


def _actor_config(lr: float):
    """verl's ActorConfig of the smoke recipe, as the trainer builds it."""
    from verl.utils.config import omega_conf_to_dataclass

    config = make_config(
        "+recipe=smoke", f"actor_rollout_ref.actor.optim.lr={lr}", "actor_rollout_ref.actor.optim.weight_decay=0"
    )
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


def _prompts(tokenizer, count: int, tokens: int) -> list[list[int]]:
    """``count`` prompts of real Wikipedia text, ``tokens`` tokens each."""
    paragraphs = [p["text"] for p in wiki_paragraphs()[:400]]
    ids = tokenizer("\n\n".join(paragraphs))["input_ids"]
    return [ids[i * tokens : (i + 1) * tokens] for i in range(count)]


@pytest.fixture(scope="module")
def generation(tiny_model_dir, tokenizer):
    """The generation actor's class, in-process, and three sampled continuations with log-probs."""
    server = CPUGenerationServer(str(tiny_model_dir), seed=0, threads=2)
    prompts = _prompts(tokenizer, 3, 160)
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True, "max_tokens": 12}

    async def sample():
        calls = [server.generate(f"r{i}", prompt_ids=p, sampling_params=sampling) for i, p in enumerate(prompts)]
        return await asyncio.gather(*calls)

    outputs = asyncio.run(sample())
    return server, prompts, outputs


def _rows(prompts, outputs, advantages):
    """Training rows as the actor update reads them from TransferQueue."""
    rows = []
    for prompt, output, advantage in zip(prompts, outputs, advantages, strict=True):
        old = torch.tensor(output.log_probs)
        rows.append(
            {
                "prompts": torch.tensor(prompt),
                "responses": torch.tensor(output.token_ids),
                "response_mask": torch.ones(len(output.token_ids), dtype=torch.long),
                "old_log_probs": old,
                "advantages": torch.full_like(old, advantage),
                "ref_log_prob": old.clone(),
            }
        )
    return rows


def test_engine_and_generation_actor_agree_before_and_after_a_weight_sync(generation, tiny_model_dir):
    server, prompts, outputs = generation
    engine = TorchEngine(str(tiny_model_dir), _actor_config(lr=1e-2))
    assert weights_digest(engine.model) == server.weights_digest()
    rows = _rows(prompts, outputs, advantages=[1.0, -1.0, 0.5])
    served = [torch.tensor(o.log_probs) for o in outputs]

    def gap(scores, reference) -> float:
        return max(float((s.log_probs - r).abs().max()) for s, r in zip(scores, reference, strict=True))

    # Same weights: the engine recomputes what the actor sampled with.
    assert gap(engine.score(rows, 1.0, entropy=False), served) < 1e-4

    fields = ["response_mask", "old_log_probs", "advantages", "ref_log_prob"]
    metrics = engine.train_mini_batch(rows, temperature=1.0, fields=fields)
    # verl's token-mean over the mini-batch: at ratio 1 the policy loss is -mean advantage per token.
    tokens = sum(len(o.token_ids) for o in outputs)
    expected = -sum(a * len(o.token_ids) for a, o in zip([1.0, -1.0, 0.5], outputs, strict=True)) / tokens
    assert metrics["actor/pg_loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["grad_norm"] > 0 and math.isfinite(metrics["loss"])

    # After the update the engine has moved and the actor still serves the old weights...
    updated = engine.score(rows, 1.0, entropy=False)
    assert gap(updated, served) > 1e-3
    stale = [torch.tensor(server.compute_log_probs(p, o.token_ids)) for p, o in zip(prompts, outputs, strict=True)]
    assert max(float((s - r).abs().max()) for s, r in zip(stale, served, strict=True)) < 1e-4

    # ...until the sync: then both give the same log-probs on the same tokens.
    digest = server.update_weights(engine.state_dict(), global_steps=1)
    assert digest == weights_digest(engine.model) == server.weights_digest()
    synced = [torch.tensor(server.compute_log_probs(p, o.token_ids)) for p, o in zip(prompts, outputs, strict=True)]
    assert gap(updated, synced) < 1e-5
    again = asyncio.run(server.generate("r9", prompt_ids=prompts[0], sampling_params={"max_tokens": 2}))
    assert again.extra_fields["global_steps"] == 1


def test_weights_are_not_swapped_under_a_running_generate(generation):
    server, prompts, _ = generation

    async def race():
        call = asyncio.create_task(server.generate("x", prompt_ids=prompts[0], sampling_params={"max_tokens": 4}))
        await asyncio.sleep(0)  # the call is now decoding in the policy's worker thread
        with pytest.raises(RuntimeError, match="still in flight"):
            server.update_weights(server.policy.model.state_dict(), global_steps=5)
        await call

    asyncio.run(race())


# ------------------------------------------------------------------------ backend selection


@pytest.mark.parametrize(
    "recipe, hint",
    [("infmem_4b", r"\+recipe=smoke` instead"), ("memagent_1p7b", r"\+recipe=smoke agent=memagent` instead")],
)
def test_a_gpu_recipe_without_a_gpu_names_the_recipe_to_use(recipe, hint):
    with pytest.raises(ConfigError, match=rf"infmem\.backend: recipe '{recipe}' trains on GPUs .* {hint}"):
        select_backend(make_config(f"+recipe={recipe}"), GPUCount(0, "this machine"))


def test_backend_is_chosen_by_the_gpus_present_and_says_which():
    smoke = make_config("+recipe=smoke")
    here = "this machine"
    cpu = select_backend(smoke, GPUCount(0, here))
    assert cpu.name == "cpu" and "backend: cpu (no GPU in this machine)" in cpu.message and "infmem_cpu" in cpu.message
    gpu = select_backend(smoke, GPUCount(2, here))
    assert gpu.name == "gpu" and "stock verl (vLLM rollout + FSDP update) on 1 of the 2 GPU(s) of this machine" in gpu.message
    forced = select_backend(make_config("+recipe=smoke", "infmem.backend=cpu"), GPUCount(2, here))
    assert forced.name == "cpu" and "(infmem.backend=cpu)" in forced.message
    assert select_backend(make_config("+recipe=infmem_4b"), GPUCount(8, here)).name == "gpu"
    with pytest.raises(ConfigError, match=r"infmem\.backend: expected one of \['auto', 'cpu', 'gpu', 'verl-cpu'\], got 'tpu'"):
        select_backend(make_config("+recipe=smoke", "infmem.backend=tpu"), GPUCount(0, here))


def test_a_gpu_without_vllm_falls_back_to_cpu_on_auto_and_names_the_install_on_gpu():
    """A laptop's CPU venv whose torch sees a GPU: stock verl's rollout cannot start without vLLM."""
    here = "this machine"
    fallback = select_backend(make_config("+recipe=smoke"), GPUCount(1, here, vllm=False))
    assert fallback.name == "cpu" and "1 GPU(s) in this machine but no vLLM in" in fallback.message
    with pytest.raises(ConfigError, match=r"infmem\.backend: recipe 'infmem_4b' .* vLLM is not installed .*requirements/gpu\.txt"):
        select_backend(make_config("+recipe=infmem_4b"), GPUCount(8, here, vllm=False))
    assert select_backend(make_config("+recipe=infmem_4b"), GPUCount(8, here, vllm=False), dry_run=True).name == "gpu"
    assert vllm_installed() == (importlib.util.find_spec("vllm") is not None)

def test_cpu_backend_selects_its_trainer_mode_and_ray_settings():
    config = make_config("+recipe=smoke")
    apply_cpu_backend(config)
    assert config.trainer.v1.trainer_mode == "infmem_cpu"
    assert config.ray_kwargs.ray_init.num_cpus >= 16 and config.ray_kwargs.ray_init.include_dashboard is False
    config = make_config(
        "+recipe=smoke", "ray_kwargs.ray_init.num_cpus=24", "+ray_kwargs.ray_init.include_dashboard=true"
    )
    apply_cpu_backend(config)
    assert config.ray_kwargs.ray_init.num_cpus == 24 and config.ray_kwargs.ray_init.include_dashboard is True
    assert cpu_settings(config).max_batch == 8


def test_the_shells_omp_num_threads_caps_the_cpu_runs_threads_unless_set(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = make_config("+recipe=smoke")
    apply_cpu_backend(config)
    assert cpu_settings(config).threads == 1
    config = make_config("+recipe=smoke", "infmem.cpu.threads=3")
    apply_cpu_backend(config)
    assert cpu_settings(config).threads == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    config = make_config("+recipe=smoke")
    apply_cpu_backend(config)
    assert cpu_settings(config).threads is None


def test_the_cpu_backend_runs_ray_workers_at_the_launchers_priority_with_transfer_queue_threads_capped(monkeypatch):
    """Ray's default starts workers 15 nice levels below the driver: on a CPU they are the
    training, and beside any busy process they starve. TransferQueue's default of 8 threads on
    fewer physical cores logs a warning at every put and get."""
    import os

    import psutil
    import ray

    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    monkeypatch.delenv("TQ_NUM_THREADS", raising=False)
    apply_cpu_backend(make_config("+recipe=smoke"))
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
    try:
        nice, threads = ray.get(ray.remote(lambda: (os.nice(0), os.environ.get("TQ_NUM_THREADS"))).remote())
        assert nice == os.nice(0)
        assert threads == str(min(8, psutil.cpu_count(logical=False)))
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "override, message",
    [
        ("actor_rollout_ref.model.lora.rank=8", r"actor_rollout_ref\.model\.lora\.rank: the CPU backend needs 0 \(full fine-tuning only\)"),
        ("distillation.enabled=true", r"distillation\.enabled: the CPU backend needs false"),
        ("infmem.cpu.threads=0", r"infmem\.cpu\.threads: expected an integer >= 1 or null"),
        ("+infmem.cpu.gpu=1", r"infmem\.cpu\.gpu: unknown key"),
    ],
)
def test_what_the_cpu_backend_lacks_is_refused_by_key(override, message):
    config = make_config("+recipe=smoke", override)
    with pytest.raises(ConfigError, match=message):
        check_cpu_support(config)
        cpu_settings(config)


@pytest.mark.skipif(visible_gpus() > 0, reason="needs a machine without a GPU")
def test_launching_a_gpu_recipe_here_stops_before_any_worker(tmp_path, tiny_model_dir):
    data = tmp_path / "train.parquet"
    config = make_config("+recipe=smoke", f"data.train_files={data}", f"data.val_files={data}")
    config.infmem.bootstrap.update({"train_samples": 1, "doc_tokens": 600})
    config.actor_rollout_ref.model.path = str(tiny_model_dir)
    bootstrap_inputs(config)  # a valid data file, so that only the backend can stop the run
    config = make_config("+recipe=memagent_4b", f"data.train_files={data}", f"data.val_files={data}")
    with pytest.raises(ConfigError, match=r"recipe 'memagent_4b' trains on GPUs.*\+recipe=smoke agent=memagent"):
        run(config)


# ---------------------------------------------------------------------- self-contained inputs


def test_bootstrap_builds_missing_data_once_and_keeps_existing_files(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def config_with(bootstrap: str):
        return make_config("+recipe=smoke", f"infmem.bootstrap={bootstrap}", f"actor_rollout_ref.model.path={tiny_model_dir}")

    config = config_with("{model:tiny_qwen3,train_samples:2,val_samples:1,doc_tokens:900,seed:3}")
    built = bootstrap_inputs(config)
    train, val = config.data.train_files, config.data.val_files
    assert train == str(tmp_path / "outputs/smoke/train.parquet") and val == str(tmp_path / "outputs/smoke/val.parquet")
    assert [line.split(":")[0] for line in built] == ["data.train_files", "data.val_files"]
    assert pq.read_metadata(train).num_rows == 2 and pq.read_metadata(val).num_rows == 1
    assert prepare_config(config).checked_files == [train, val]  # the columns our loops read
    questions = {r["prompt"][0]["content"] for f in (train, val) for r in pq.read_table(f).to_pylist()}
    assert len(questions) == 3  # validation questions are not training questions
    assert bootstrap_inputs(config_with("{model:tiny_qwen3,train_samples:2,val_samples:1,doc_tokens:900,seed:3}")) == []
    # Our files are written again when their settings change; the user's own file is kept.
    Path(f"{val}.bootstrap.json").unlink()
    rebuilt = bootstrap_inputs(config_with("{model:tiny_qwen3,train_samples:3,val_samples:1,doc_tokens:700,seed:3}"))
    assert [line.split(":")[0] for line in rebuilt] == ["data.train_files"] and "700-token documents" in rebuilt[0]
    assert pq.read_metadata(train).num_rows == 3 and pq.read_metadata(val).num_rows == 1
    # A damaged marker still marks our file: it is written again, not a JSON error.
    Path(f"{train}.bootstrap.json").write_text('{"samples": 3, "doc_to')
    again = bootstrap_inputs(config_with("{model:tiny_qwen3,train_samples:3,val_samples:1,doc_tokens:700,seed:3}"))
    assert [line.split(":")[0] for line in again] == ["data.train_files"]
    assert json.loads(Path(f"{train}.bootstrap.json").read_text())["doc_tokens"] == 700


def test_bootstrap_measures_documents_in_the_tokens_of_a_model_given_by_path(tmp_path, monkeypatch):
    """A small-vocabulary model passed by path (the demo's warmed student, reused in another run)
    reads documents as long, in its own tokens, as those it was warmed up and checked on; Qwen3's
    tokenizer, 1.4x coarser on this text, made them 1.4x longer (9 chunks of 128 instead of 6)."""
    from infmem_verl.assets import load_tokenizer, tiny_qwen3_dir
    from infmem_verl.data.documents import resolve
    from infmem_verl.small_vocab import small_vocab_dir

    monkeypatch.chdir(tmp_path)
    model = tiny_qwen3_dir(cache_dir=tmp_path, tokenizer_dir=small_vocab_dir(4096))
    config = make_config(
        "+recipe=smoke", "infmem.bootstrap={model:tiny_qwen3,train_samples:1,val_samples:1,doc_tokens:768,seed:3}",
        f"actor_rollout_ref.model.path={model}",
    )  # fmt: skip
    bootstrap_inputs(config)
    assert json.loads(Path(f"{config.data.train_files}.bootstrap.json").read_text())["vocab_size"] == 4096
    row = pq.read_table(config.data.train_files).to_pylist()[0]
    text = resolve(row["document_ref"])
    own, qwen3 = len(load_tokenizer(str(model))(text).input_ids), len(load_tokenizer()(text).input_ids)
    assert 700 <= own <= 768 and qwen3 < 0.8 * own, (own, qwen3)


def test_the_offline_cache_is_read_when_used_not_when_imported(tmp_path, monkeypatch):
    from infmem_verl.agent.static_embed import table_path
    from infmem_verl.assets import tiny_qwen3_dir

    monkeypatch.setenv("INFMEM_CACHE", str(tmp_path / "cache"))
    assert table_path().parent == tmp_path / "cache"
    built = tiny_qwen3_dir(hidden_size=64, seed=5)
    assert built.parent == tmp_path / "cache" and (built / "config.json").is_file()


@pytest.mark.parametrize(
    "override, message",
    [
        ("infmem.bootstrap.doc_tokens=0", r"infmem\.bootstrap\.doc_tokens: expected an integer >= 1, got 0"),
        ("infmem.bootstrap.model=llama", r"infmem\.bootstrap\.model: expected one of \['tiny_qwen3', 'warm_qwen3'\]"),
        ("+infmem.bootstrap.samples=3", r"infmem\.bootstrap\.samples: unknown key"),
    ],
)
def test_bad_bootstrap_settings_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        bootstrap_settings(make_config("+recipe=smoke", override))


# ------------------------------------------------------------------------------- the report


def _facts(kind: str, index: int, stop: int | None, info: dict) -> dict:
    """A sequence's extra_fields: a two-stage call's turn facts (an answer is one call)."""
    calls = 1 if kind == "answer" else 2
    facts = {"agent": "infmem", "turn_index": index, "turn_kind": kind, "chunk_index": 0, "num_chunks": 4}
    return facts | {"stop_step": stop, "valid": True, "llm_calls": calls, "reward_extra_info": info}


def test_the_step_line_shows_means_over_trajectories_not_sequences():
    # Trajectory 0 stops after 2 chunks (6 sequences, 11 calls), trajectory 1 reads all 4 (5, 9).
    kinds = {
        "u1_0": ["prethink", "write", "prethink", "write", "prethink", "answer"],
        "u1_1": ["write"] * 4 + ["answer"],
    }
    stops = {"u1_0": 2, "u1_1": None}
    infos = {"u1_0": {"acc": 1.0, "outcome": 1.0}, "u1_1": {"acc": 0.0, "outcome": 0.0}}
    scores = {"u1_0": 0.9, "u1_1": 0.1}
    keys = [f"{t}_{i}" for t, ks in kinds.items() for i in range(len(ks))]
    extra = [_facts(k, i, stops[t], infos[t]) for t, ks in kinds.items() for i, k in enumerate(ks)]
    row_scores = [scores[k.rsplit("_", 1)[0]] for k in keys]
    rows = trajectory_rows(keys, extra, row_scores, [100] * len(keys), [10] * len(keys))
    metrics = summarize([row["values"] for row in rows])
    assert metrics["infmem/trajectories"] == 2
    assert metrics["infmem/reward"] == pytest.approx(0.5) and metrics["infmem/acc"] == pytest.approx(0.5)
    assert metrics["infmem/chunks_read"] == pytest.approx(3.0) and metrics["infmem/llm_calls"] == pytest.approx(10.0)
    assert metrics["infmem/stopped"] == pytest.approx(0.5) and metrics["infmem/stop_step"] == 2
    line = step_line(3, 5, metrics | {"actor/optimizer_steps": 2, "timing_s/step": 12.5}, ["outcome"])
    assert line.startswith("[infmem] step 3/5 | reward 0.500 (outcome 0.500) | acc 0.500 | chunks read 3.0/4.0")
    assert "stopped 1/2 at step 2.0 | llm calls 10.0/traj | optimizer steps 2" in line and line.endswith("| 12.5s")
    # infmem_sync (verl's workers) measures the count itself; the line shows that one.
    measured = step_line(3, 5, metrics | {"infmem/optimizer_steps": 4.0, "actor/optimizer_steps": 2}, ["outcome"])
    assert "| optimizer steps 4 |" in measured
    val = validation_line({"val-core/hotpot/acc/mean@2": 0.25, "val-aux/hotpot/reward/mean@2": 0.5}, ["reward", "acc"])
    assert val == "[infmem] validation | reward 0.500 | acc 0.250"


# ------------------------------------------------------------ the contract with verl's trainer

# What verl's trainer calls on the objects the CPU trainer replaces, and what stands in for each.
# A verl release that calls something new (or stops calling something) fails this test, which is
# the point: the stand-ins must be reviewed against it.
VERL_CALLS = {
    # verl's _balance_batch asks the worker group for its data-parallel layout once, then caches
    # it in _dispatch_info; CPUActorRolloutRef pre-fills the cache (one rank).
    ("self.actor_rollout_wg", "worker_group"): {
        "compute_log_prob",
        "update_actor",
        "init_model",
        "load_checkpoint",
        "save_checkpoint",
        "start_profile",
        "stop_profile",
        "_dispatch_info",
        "_query_dispatch_info",
    },
    ("self.ref_policy_wg",): {"compute_ref_log_prob", "init_model", "start_profile", "stop_profile"},
    ("self.checkpoint_manager",): {"update_weights", "sleep_replicas"},
}
# Calls the CPU backend never reaches: profiling is a GPU feature (global_profiler), init_model is
# part of the GPU _setup that InfMemCPUTrainer replaces.
NOT_REACHED = {
    "init_model",
    "start_profile",
    "stop_profile",
    "_query_dispatch_info",
}
# Attributes verl's _setup builds that the CPU trainer does not, and every verl method that reads
# them as ``self.<name>`` (_rollout_server_managers reads llm_server_manager with a getattr default).
GPU_ONLY_READERS = {
    "llm_server_manager": {"_setup", "get_llm_client"},
    "resource_pool_manager": {"_setup", "_init_resource_pool_mgr", "_get_n_gpus_for_throughput"},
    # Only with a critic, which the pre-flight checks refuse (preflight.check_algorithm).
    "critic_wg": {
        "_setup",
        "_compute_values",
        "_update_critic",
        "_load_checkpoint",
        "_save_checkpoint",
        "_start_profiling",
        "_stop_profiling",
    },
}


def _verl_trainer_sources() -> dict[str, ast.FunctionDef]:
    from verl.trainer.ppo.v1 import trainer_base, trainer_sync

    methods = {}
    for module in (trainer_base, trainer_sync):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.ClassDef) and node.name in ("PPOTrainer", "PPOTrainerSync"):
                methods.update({f.name: f for f in node.body if isinstance(f, ast.FunctionDef)})
    return methods


def _attributes_of(tree: ast.AST, owners: tuple[str, ...]) -> set[str]:
    return {
        node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and ast.unparse(node.value) in owners
    }


def _assigned(tree: ast.AST) -> set[str]:
    """Attributes assigned as ``self.<name> = ...`` in ``tree``."""
    return {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self"
    }


def _source_tree(function) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(function)))


def _members(cls) -> set[str]:
    """Methods and class attributes of ``cls``, and the attributes its ``__init__`` sets."""
    return set(dir(cls)) | _assigned(_source_tree(cls.__init__))


def test_verl_trainer_calls_only_what_the_cpu_stand_ins_provide():
    from infmem_verl.cpu.trainer import InfMemCPUTrainer
    from infmem_verl.cpu.workers import CPUActorRolloutRef, WeightSync

    methods = _verl_trainer_sources()
    everything = ast.Module(body=list(methods.values()), type_ignores=[])
    stand_ins = {
        ("self.actor_rollout_wg", "worker_group"): CPUActorRolloutRef,
        ("self.ref_policy_wg",): CPUActorRolloutRef,
        ("self.checkpoint_manager",): WeightSync,
    }
    for owners, expected in VERL_CALLS.items():
        assert _attributes_of(everything, owners) == expected, f"verl now uses other members of {owners}"
        missing = expected - _members(stand_ins[owners])
        assert missing == expected & NOT_REACHED, f"{owners}: the CPU stand-in lacks {sorted(missing - NOT_REACHED)}"

    for attribute, readers in GPU_ONLY_READERS.items():
        found = {name for name, node in methods.items() if attribute in _attributes_of(node, ("self",))}
        assert found == readers, f"verl methods reading self.{attribute} changed: {sorted(found)}"
    # Of those readers, the CPU trainer overrides each one a CPU run reaches.
    assert {"_setup", "get_llm_client", "_get_n_gpus_for_throughput"} <= set(vars(InfMemCPUTrainer))

    # The CPU _setup calls verl's own _setup helpers and sets every attribute verl's _setup sets,
    # except the GPU-only ones.
    ours = _source_tree(InfMemCPUTrainer._setup)
    called = {n.func.attr for n in ast.walk(ours) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert {"_init_tokenizer", "_init_dataloader", "_init_dump_executor", "_load_checkpoint"} <= called & set(methods)
    assert _assigned(methods["_setup"]) - _assigned(ours) == {"resource_pool_to_cls", "critic_wg", "llm_server_manager"}
