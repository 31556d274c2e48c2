"""Checkpoint disk and start-up host RAM (infmem_verl/footprint.py) against what verl really does:
the composed recipe configs, verl's own FSDPCheckpointManager saving an FSDP2-sharded model over a
Gloo process group, and transformers building the recipes' model shapes on the meta device."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir

from infmem_verl.footprint import GB, dry_run_footprint, footprint, model_size
from infmem_verl.main import prepare_config

# The architecture fields of Qwen3-4B's and Qwen2.5-7B's config.json (only the shapes matter here).
QWEN3_4B = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560, intermediate_size=9728,
    num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    tie_word_embeddings=True,
)  # fmt: skip
QWEN25_7B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
    num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
)  # fmt: skip


def make_config(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=list(overrides))


def config_dir(root: Path, fields: dict) -> str:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(fields))
    return str(root)


def test_model_size_is_the_real_models_parameter_count(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}  # the tied embedding once
    size = model_size(str(tiny_model_dir))
    assert size.parameters == sum(unique.values()) and size.tied_embeddings == model.config.tie_word_embeddings
    assert model_size("no/such-model-offline") is None


def test_checkpoints_are_bounded_by_default():
    for recipe in ("infmem_4b", "memagent_4b", "smoke"):
        config = make_config(f"+recipe={recipe}")
        assert config.trainer.max_actor_ckpt_to_keep == 2 and config.trainer.max_critic_ckpt_to_keep == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("keep", [1, 2])
def test_verls_checkpoint_manager_keeps_what_the_dry_run_sizes(tiny_model_dir, tmp_path, keep):
    """Four saves by verl's FSDPCheckpointManager with the composed bound: the folders left on disk and
    the bytes of one save are what :func:`footprint` says."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    config = make_config(
        "+recipe=infmem_4b", f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.max_actor_ckpt_to_keep={keep}",
        "trainer.total_training_steps=4", "trainer.save_freq=1",
    )  # fmt: skip
    sized = footprint(config, model_size(str(tiny_model_dir)), use_reference=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.arange(100, 116).unsqueeze(0)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()  # AdamW's moments exist from the first step on
        manager = FSDPCheckpointManager(model, optimizer, checkpoint_config=config.actor_rollout_ref.actor.checkpoint)
        on_disk = []
        for step in range(1, 5):
            folder = tmp_path / f"global_step_{step}" / "actor"
            manager.save_checkpoint(str(folder), global_step=step, max_ckpt_to_keep=config.trainer.max_actor_ckpt_to_keep)
            on_disk.append(sorted(p.parent.name for p in tmp_path.glob("global_step_*/actor")))
    finally:
        dist.destroy_process_group()
    assert on_disk[-1] == [f"global_step_{s}" for s in range(5 - keep, 5)]
    assert max(len(names) for names in on_disk) <= sized.saves_on_disk == (2 if keep == 1 else keep)
    saved = sum(f.stat().st_size for f in folder.glob("*.pt") if f.name.startswith(("model_", "optim_")))
    assert saved == pytest.approx(sized.per_save, rel=0.02)


def test_dry_run_sizes_disk_host_ram_and_the_reference_of_the_recipe_shapes(tmp_path):
    four_b = model_size(config_dir(tmp_path / "qwen3_4b", QWEN3_4B))
    seven_b = model_size(config_dir(tmp_path / "qwen25_7b", QWEN25_7B))
    assert 4.0e9 < four_b.parameters < 4.1e9 and 7.5e9 < seven_b.parameters < 7.7e9  # the models' published sizes

    config = make_config("+recipe=infmem_4b", f"actor_rollout_ref.model.path={tmp_path / 'qwen3_4b'}")
    prepare_config(config)
    disk, ram, reference = dry_run_footprint(config, use_reference=True)
    p = four_b.parameters
    assert disk.startswith(f"checkpoints: {12 * p / GB:,.1f} GB a save") and "at most 2 on disk" in disk
    assert f"{24 * p / GB:,.1f} GB in trainer.default_local_dir" in disk
    # Tied embeddings: all 8 ranks load the full fp32 model; the fp32 reference's shards stay on the host.
    assert ram.startswith(f"host RAM at start-up, per node: ~{(8 * 4 * p + 4 * p) / GB:,.0f} GB (8 of 8 ranks")
    assert reference.startswith("reference model: fp32 (ref.fsdp_config.model_dtype)")
    assert f"{4 * p / 8 / GB:,.1f} GB per rank" in reference and "cast to bf16" in reference

    seven = make_config("+recipe=infmem_qwen25_7b", f"actor_rollout_ref.model.path={tmp_path / 'qwen25_7b'}")
    prepare_config(seven)
    _, ram, _ = dry_run_footprint(seven, use_reference=True)
    assert "(1 of 8 ranks load the full model" in ram  # untied: the other ranks build on the meta device
    unbounded = make_config("+recipe=infmem_4b", "trainer.max_actor_ckpt_to_keep=null", "trainer.total_training_steps=200")
    assert footprint(unbounded, four_b, use_reference=True).saves_on_disk == 4  # steps 50, 100, 150, 200
    missing = make_config("+recipe=infmem_4b", "actor_rollout_ref.model.path=no/such-model")
    assert dry_run_footprint(missing, use_reference=True)[0].startswith("checkpoints and host RAM not sized")
