"""The Hydra config: every recipe composes and passes our checks and verl's validate_config; bad
names, budgets and dataset files fail before any worker starts, with the offending key named."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.main import prepare_config, run
from infmem_verl.data.documents import write_store
from infmem_verl.settings import agent_settings

RECIPES = sorted(p.stem for p in (conf_dir() / "recipe").glob("*.yaml"))


def make_config(*overrides: str):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose("infmem_trainer", overrides=list(overrides))


def test_all_recipes_exist():
    assert RECIPES == [
        "demo",
        "infmem_1p7b",
        "infmem_4b",
        "infmem_qwen25_7b",
        "memagent_1p7b",
        "memagent_4b",
        "memagent_qwen25_7b",
        "smoke",
        "smoke_verl",
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe, capsys):
    config = make_config(f"+recipe={recipe}", "dry_run=true")
    prepared = run(config)  # prepare_config + verl's validate_config, no workers
    assert "All configuration checks passed" in capsys.readouterr().out
    assert config.recipe_name == recipe
    expected_loop = "memagent_agent" if recipe.startswith("memagent") else "infmem_agent"
    assert prepared.agent_loop == expected_loop
    cfg = agent_settings(config)
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.prompt_length, rollout.response_length) == (cfg.max_prompt_tokens(), cfg.max_response_tokens())
    if recipe.startswith("memagent"):
        assert prepared.reward_components == {"outcome": 1.0}


def test_infmem_4b_follows_the_reference_hyperparameters():
    config = make_config("+recipe=infmem_4b")
    prepare_config(config)
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert config.algorithm.adv_estimator == "grpo" and config.algorithm.norm_adv_by_std_in_grpo is False
    assert (rollout.n, config.data.train_batch_size, config.infmem.train.optimizer_steps_per_rl_step) == (4, 128, 16)
    assert (actor.optim.lr, actor.optim.lr_warmup_steps, actor.optim.lr_scheduler_type) == (1e-6, 20, "constant")
    assert (actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (True, 0.001, "low_var_kl")
    assert (actor.entropy_coeff, actor.clip_ratio_high, actor.loss_agg_mode) == (0, 0.2, "token-mean")
    assert (rollout.temperature, rollout.val_kwargs.n, rollout.val_kwargs.temperature, rollout.val_kwargs.top_p) == (
        1.0,
        4,
        1.0,
        0.7,
    )
    assert config.actor_rollout_ref.model.enable_gradient_checkpointing and actor.use_dynamic_bsz
    # FSDP2 for actor and reference: the strategy verl's workers run with on CPU (tests/verl_cpu_rl.py;
    # FSDP1 cannot run there).
    assert actor.strategy == config.actor_rollout_ref.ref.strategy == "fsdp2"
    # Not the reference's offload: a 4B model's FSDP-8 state fits (infmem_4b.yaml gives the counts).
    assert not actor.fsdp_config.param_offload and not actor.fsdp_config.optimizer_offload
    assert rollout.gpu_memory_utilization == 0.75
    seven_b = make_config("+recipe=memagent_qwen25_7b").actor_rollout_ref
    assert seven_b.rollout.gpu_memory_utilization == 0.6 and not seven_b.actor.fsdp_config.param_offload
    assert (config.infmem.agent.document.chunk_tokens, config.infmem.agent.memory_tokens, rollout.response_length) == (
        5000,
        1024,
        1536,
    )
    assert config.trainer.v1.trainer_mode == "infmem_sync" and config.trainer.use_v1


def test_every_agent_field_is_a_documented_override():
    """conf/infmem_trainer.yaml lists every AgentConfig field, so each is a one-line override."""

    def names(cls) -> dict:
        out = {}
        for f in dataclasses.fields(cls):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
            out[f.name] = names(type(sub)) if dataclasses.is_dataclass(sub) else None
        return out

    def keys(node) -> dict:
        return {k: keys(v) if hasattr(v, "keys") else None for k, v in node.items()}

    assert keys(make_config().infmem.agent) == names(AgentConfig)


@pytest.mark.parametrize(
    "override, check",
    [
        ("infmem.agent.stop_votes=3", lambda c, a: a.stop_votes == 3),
        ("infmem.agent.retrieval.top_k_max=4", lambda c, a: a.retrieval.top_k_max == 4),
        ("infmem.agent.retrieval.scope=read_prefix", lambda c, a: a.retrieval.scope == "read_prefix"),
        # The Write prompt budget follows the chunk size (null: derived).
        (
            "infmem.agent.document.chunk_tokens=8000",
            lambda c, a: a.write.prompt_tokens == 8000 + 1024 + 2500 + 1024 + 512,
        ),
        ("infmem.agent.memory_tokens=512", lambda c, a: a.memory_tokens == 512),
        ("infmem.agent.write_layout=memory_first", lambda c, a: a.write_layout == "memory_first"),
        (
            "infmem.reward.components.early_stop.weight=0",
            lambda c, a: c.infmem.reward.components.early_stop.weight == 0,
        ),
        ("infmem.agent.thinking=false", lambda c, a: c.actor_rollout_ref.rollout.response_length == 1024),
        ("infmem.train.loss_normalization=trajectory", lambda c, a: c.infmem.train.loss_normalization == "trajectory"),
        # A user's own component, by dotted path, next to the preset's.
        (
            "+infmem.reward.components.mine={_target_:infmem_verl.reward.components.protocol,weight:0.1}",
            lambda c, a: list(c.infmem.reward.components) == ["outcome", "early_stop", "protocol", "mine"],
        ),
    ],
)
def test_ablation_knobs_are_one_override_each(override, check):
    config = make_config("+recipe=infmem_4b", override)
    prepare_config(config)
    assert check(config, agent_settings(config))


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["+recipe=infmem_9b"], MissingConfigException, r"recipe/infmem_9b.*Available options in 'recipe'.*infmem_4b"),
        (["agent=infmemx"], MissingConfigException, r"agent/infmemx.*Available options in 'agent'.*memagent"),
        (["reward_fn=em"], MissingConfigException, r"reward_fn/em.*Available options in 'reward_fn'.*outcome_f1"),
        (["recipe=infmem_4b"], ConfigCompositionException, r"use \+recipe=infmem_4b"),
    ],
)
def test_unknown_group_names_list_what_is_available(overrides, error, message):
    with pytest.raises(error, match=f"(?s){message}"):
        make_config(*overrides)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "actor_rollout_ref.rollout.agent.default_agent_loop=infmem",
            r"default_agent_loop: 'infmem' is not registered; available: \[.*'infmem_agent', 'memagent_agent'",
        ),
        (
            "reward.reward_manager.name=infmem2",
            r"reward\.reward_manager\.name: 'infmem2' is not registered; available: \[.*'infmem'",
        ),
        (
            "trainer.v1.trainer_mode=fast",
            r"trainer\.v1\.trainer_mode: 'fast' is not registered; available: \[.*'infmem_sync'",
        ),
        (
            "infmem.reward.components.protocol._target_=my_rewards.protocol",
            r"components\.protocol\._target_: cannot import module 'my_rewards'",
        ),
        (
            "reward.custom_reward_function.path=/nonexistent/reward.py",
            r"custom_reward_function\.path: file '/nonexistent/reward.py' not found",
        ),
        (
            "infmem.agent.retrieval.top_k_default=9",
            r"infmem\.agent\.retrieval\.top_k_default: expected an integer in \[1, 8\]",
        ),
        ("infmem.agent.memory_tokens=2048", r"infmem\.agent\.write\.output_tokens: expected >= memory_tokens=2048"),
        ("actor_rollout_ref.rollout.response_length=1024", r"rollout\.response_length: expected an integer >= 1536"),
        ("trainer.use_v1=false", r"trainer\.use_v1: expected true"),
        ("infmem.train.optimizer_steps_per_rl_step=0", r"optimizer_steps_per_rl_step: expected an integer >= 1"),
        ("infmem.records.trajectories=sometimes", r"infmem\.records\.trajectories: expected true or false"),
    ],
)
def test_bad_settings_fail_before_any_worker_with_the_key_named(override, message):
    with pytest.raises(ConfigError, match=message):
        prepare_config(make_config("+recipe=infmem_4b", override))


def _write_parquet(path: Path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_dataset_columns_are_checked_before_any_worker(tmp_path):
    prompt = [[{"role": "user", "content": "Who?"}]]
    write_store(tmp_path / "s.parquet", [("1", "The text.")])
    good = _write_parquet(
        tmp_path / "good.parquet",
        {"prompt": prompt, "reward_model": [{"ground_truth": ["x"]}], "document_ref": [f"{tmp_path}/s.parquet#1"]},
    )
    inline = _write_parquet(
        tmp_path / "inline.parquet", {"prompt": prompt, "reward_model": [{"ground_truth": ["x"]}], "context": ["text"]}
    )
    config = make_config("+recipe=infmem_4b", f"data.train_files={good}", f"data.val_files={good}")
    assert prepare_config(config).checked_files == [good, good]
    config = make_config("+recipe=infmem_4b", f"data.train_files={good}", f"data.val_files={inline}")
    with pytest.raises(
        ConfigError,
        match=r"dataset columns \(data\.val_files\): .*inline\.parquet lacks column\(s\) \['document_ref'\]; "
        r"it has \['prompt', 'reward_model', 'context'\]; documents must be passed by reference",
    ):
        prepare_config(config)


def test_a_real_run_refuses_missing_data_files():
    with pytest.raises(ConfigError, match=rf"not found: \['{os.getcwd()}/data/hotpotqa_train_32k.parquet'"):
        run(make_config("+recipe=infmem_4b"))


def test_configs_live_in_the_top_level_conf_and_a_user_recipe_folder_joins_them(tmp_path):
    """conf/ is read from a checkout wherever the command runs; a user's own recipe folder is added
    through hydra.searchpath (verl's config package stays on it) and builds on ours."""
    assert conf_dir() == Path(__file__).resolve().parents[1] / "conf"
    mine = tmp_path / "my_conf" / "recipe"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - infmem_4b\n  - _self_\nrecipe_name: mine\ninfmem:\n  agent:\n    stop_votes: 3\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "infmem_verl.main", f"hydra.searchpath=[pkg://verl.trainer.config,file://{tmp_path / 'my_conf'}]",
         "+recipe=mine", "dry_run=true", "--cfg", "job"],  # fmt: skip
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "recipe_name: mine" in done.stdout and "stop_votes: 3" in done.stdout
    assert "chunk_tokens: 5000" in done.stdout  # infmem_4b's settings underneath


def test_a_regular_install_ships_every_config(tmp_path):
    """The wheel setup.py builds holds conf/ inside the package, where conf_dir() looks outside a checkout."""
    import zipfile

    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(repo),
                           "-w", str(tmp_path)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    [wheel] = tmp_path.glob("*.whl")
    shipped = {n.removeprefix("infmem_verl/conf/") for n in zipfile.ZipFile(wheel).namelist() if n.startswith("infmem_verl/conf/")}
    assert shipped == {str(p.relative_to(repo / "conf")) for p in (repo / "conf").rglob("*.yaml")}
