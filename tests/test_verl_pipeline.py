"""A slice of the real verl 0.9.1 training pipeline on CPU, running our plugins.

Real verl objects throughout: the Hydra config composed by our entry point, verl's dataset loader on
our parquet, TransferQueue, the load balancer and ``LLMServerClient``, ``AgentLoopManagerTQ`` with
its workers running our registered loops, ``RewardLoopManager`` running our registered reward
manager, verl's ``ReplayBuffer``, the v1 trainer's advantage step (our ``infmem_sync`` trainer) and
verl's policy loss on a tiny Qwen3. Only the vLLM server is replaced, by a transformers Ray actor
with verl's ``generate`` contract (tests/cpu_server.py). One Ray session for the module.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import torch
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir

from infmem_verl.data.synthetic import make_dataset
from infmem_verl.main import prepare_config
from infmem_verl.cpu.backend import workers_at_driver_priority
from infmem_verl.ray_start import start_ray_retrying
from infmem_verl.verl_plugin.dataset import write_verl_dataset
from infmem_verl.agent.facts import TurnFacts
from infmem_verl.settings import TrainSettings

N = 2  # rollouts per prompt
GLOBAL_STEPS = 3  # the weight version the stand-in server reports
TESTS_DIR = Path(__file__).parent

# A custom outcome (reward.custom_reward_function): the random tiny model never answers, so the
# score is a deterministic function of the sampled answer text, which differs between rollouts and
# gives GRPO non-zero advantages.
REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return {"score": (sum(map(ord, solution_str)) % 997) / 997.0}
"""


@pytest.fixture(scope="module")
def ray_session():
    python_path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": python_path,
    }
    workers_at_driver_priority()  # as the CPU backend's launcher does
    start_ray_retrying(lambda: ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": env}, logging_level="ERROR"))
    yield
    ray.shutdown()


def test_plugin_registers_inside_a_ray_worker(ray_session):
    @ray.remote
    def registrations() -> dict:
        import verl  # noqa: F401  (loads the verl.plugins entry points, as every verl worker does)
        from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
        from verl.experimental.reward_loop.reward_manager.registry import REWARD_MANAGER
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        return {
            "loops": {k: v["_target_"] for k, v in _agent_loop_registry.items()},
            "managers": {k: f"{v.__module__}.{v.__qualname__}" for k, v in REWARD_MANAGER.items()},
            "trainers": sorted(TRAINER_REGISTRY),
            "pid": os.getpid(),
        }

    got = ray.get(registrations.remote())
    assert got["pid"] != os.getpid()
    assert got["loops"]["infmem_agent"] == "infmem_verl.verl_plugin.agent_loop.InfMemAgentLoop"
    assert got["loops"]["memagent_agent"] == "infmem_verl.verl_plugin.agent_loop.MemAgentAgentLoop"
    assert got["managers"]["infmem"] == "infmem_verl.reward.manager.InfMemRewardManager"
    assert "infmem_sync" in got["trainers"]


def _dataset(root: Path, tokenizer) -> tuple[Path, list[str]]:
    """Two synthetic two-hop samples over real Wikipedia text (~700 tokens, 3 chunks), one per
    agent, written with the project's verl row format (documents by reference)."""
    samples = make_dataset(2, 700, tokenizer, seed=0)
    tables = []
    for i, (sample, agent) in enumerate(zip(samples, ("infmem_agent", "memagent_agent"), strict=False)):
        part, _ = write_verl_dataset([sample], root / f"part_{i}.parquet", agent_loop=agent)
        tables.append(pq.read_table(part))
    path = root / "train.parquet"
    pq.write_table(pa.concat_tables(tables), path)
    return path, [s.context for s in samples]


@dataclass
class Rollout:
    config: object
    keys: list[str]
    tags: list[dict]
    partition_id: str
    data: dict  # field -> padded tensor / list, one row per sequence (in `keys` order)
    facts: list[TurnFacts]
    server_calls: int
    documents: list[str]
    batch: object  # the KVBatchMeta the replay buffer sampled


@pytest.fixture(scope="module")
def rollout(ray_session, tiny_model_dir, tokenizer, tmp_path_factory):
    import transfer_queue as tq
    from cpu_server import start_cpu_router
    from verl.experimental.reward_loop import RewardLoopManager
    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.trainer.ppo.v1 import AgentLoopManagerTQ
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.workers.rollout.llm_server import LLMServerClient

    root = tmp_path_factory.mktemp("pipeline")
    reward_file = root / "my_reward.py"
    reward_file.write_text(REWARD_FILE)
    train_file, texts = _dataset(root, tokenizer)
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose(
            "infmem_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={tiny_model_dir}",
                f"data.train_files={train_file}",
                f"data.val_files={train_file}",
                "data.train_batch_size=2",
                "data.dataloader_num_workers=0",
                "data.max_prompt_length=128",
                "data.filter_overlong_prompts=false",  # the questions are short; the filter costs ~6 s
                "data.shuffle=false",
                f"actor_rollout_ref.rollout.n={N}",
                "actor_rollout_ref.rollout.agent.num_workers=1",
                "reward.num_workers=1",
                f"reward.custom_reward_function.path={reward_file}",
                "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
                "infmem.allow_mixed_agents=true",  # one row per agent, on purpose
                "algorithm.norm_adv_by_std_in_grpo=false",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "infmem.agent.document={chunk_tokens:256,unit_tokens:64,unit_overlap:16,paragraph_units:false}",
                "infmem.agent.memory_tokens=24",
                "infmem.agent.retrieval.evidence_tokens=128",
                "infmem.agent.retrieval.top_k_max=2",
                "infmem.agent.retrieval.top_k_default=2",
                "infmem.agent.prethink={prompt_tokens:1024,thinking_tokens:8,output_tokens:12}",
                "infmem.agent.write={prompt_tokens:null,thinking_tokens:8,output_tokens:24}",
                "infmem.agent.answer={prompt_tokens:1024,thinking_tokens:8,output_tokens:12}",
            ],
        )
    prepare_config(config)
    config.transfer_queue.enable = True
    tq.init(config.transfer_queue)
    try:
        server, balancer = start_cpu_router(str(tiny_model_dir), seed=0, global_steps=GLOBAL_STEPS)
        client = LLMServerClient(config, load_balancer_handle=balancer)
        rewards = RewardLoopManager(config)
        manager = AgentLoopManagerTQ.create(
            config=config,
            llm_client=client,
            teacher_client=None,
            reward_loop_worker_handles=rewards.reward_loop_worker_handles,
        )
        dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
        batch_dict = collate_fn([dataset[i] for i in range(len(dataset))])
        batch_dict["uid"] = np.array([uuid.uuid4().hex for _ in range(len(dataset))], dtype=object)
        batch = tu.get_tensordict(batch_dict)
        tu.assign_non_tensor_data(batch, "global_steps", 1)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": 1} for _ in range(len(batch))]
        tq.kv_batch_put(keys=list(batch["uid"]), partition_id="train", tags=tags)
        manager.generate_sequences(batch)
        buffer = ReplayBuffer(
            trainer_mode="sync",
            trainer_config=config.trainer.v1.sync,
            max_off_policy_threshold=None,
            max_off_policy_strategy="drop",
            sampler_kwargs={},
            poll_interval=0.5,
            train_batch_size=2,
            gen_batch_size=2,
        )
        sampled, _ = buffer.sample(global_steps=1, partition_id="train", batch_size=2)
        fields = ["uid", "prompts", "responses", "response_mask", "rm_scores", "rollout_log_probs", "extra_fields"]
        raw = tq.kv_batch_get(keys=sampled.keys, partition_id=sampled.partition_id, select_fields=fields)
        extra = raw.pop("extra_fields").tolist()
        uids = raw.pop("uid").tolist()
        nested = {k: raw[k] for k in ("prompts", "responses")}
        padded = raw.select("response_mask", "rm_scores", "rollout_log_probs").to_padded_tensor()
        data = {
            "uid": uids,
            "extra_fields": extra,
            "prompts": [t.tolist() for t in nested["prompts"].unbind()],
            "responses": [t.tolist() for t in nested["responses"].unbind()],
            **{k: padded[k] for k in padded.keys()},
        }
        yield Rollout(
            config=config,
            keys=list(sampled.keys),
            tags=list(sampled.tags),
            partition_id=sampled.partition_id,
            data=data,
            facts=[TurnFacts.from_dict(e) for e in extra],
            server_calls=ray.get(server.num_calls.remote()),
            documents=texts,
            batch=sampled,
        )
    finally:
        tq.close()


def _sessions(keys: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for row, key in enumerate(keys):
        out.setdefault(key.rsplit("_", 1)[0], []).append(row)
    return out


def test_one_sequence_per_llm_turn_answer_last(rollout):
    sessions = _sessions(rollout.keys)
    assert len(sessions) == 2 * N
    for rows in sessions.values():
        indices = sorted(int(rollout.keys[r].rsplit("_", 1)[1]) for r in rows)
        assert indices == list(range(len(rows)))  # {uid}_{session}_{0..k-1}
        by_index = {int(rollout.keys[r].rsplit("_", 1)[1]): rollout.facts[r] for r in rows}
        kinds = [by_index[i].turn_kind for i in range(len(rows))]
        assert kinds[-1] == "answer" and "answer" not in kinds[:-1]
        assert [by_index[i].turn_index for i in range(len(rows))] == list(range(len(rows)))
        agent = by_index[0].agent
        expected = ["write"] * by_index[0].num_chunks if agent == "memagent" else None
        if expected is not None:
            assert kinds[:-1] == expected  # MemAgent reads every chunk
        else:
            assert kinds[0] == "prethink" and set(kinds[:-1]) <= {"prethink", "write"}
    assert {f.agent for f in rollout.facts} == {"infmem", "memagent"}
    # Every generate call of the server belongs to exactly one stored sequence.
    assert sum(f.llm_calls for f in rollout.facts) == rollout.server_calls


def _custom_outcome(rollout, rows: list[int]) -> float:
    """REWARD_FILE's score of the session's answer sequence, recomputed from the stored tokens."""
    from infmem_verl.assets import load_tokenizer

    answer = max(rows, key=lambda r: int(rollout.keys[r].rsplit("_", 1)[1]))
    text = load_tokenizer().decode(rollout.data["responses"][answer], skip_special_tokens=True)
    return (sum(map(ord, text)) % 997) / 997.0


def test_reward_scored_once_per_trajectory_and_copied_to_every_sequence(rollout):
    scores = rollout.data["rm_scores"].sum(dim=1)
    for rows in _sessions(rollout.keys).values():
        assert torch.allclose(scores[rows], scores[rows[0]].expand(len(rows)))
        infos = [rollout.data["extra_fields"][r]["reward_extra_info"] for r in rows]
        assert all(info == infos[0] for info in infos)
        info = infos[0]  # default preset `infmem`, outcome from the custom reward function
        assert info["acc"] == info["outcome"] == pytest.approx(_custom_outcome(rollout, rows), abs=1e-9)
        weighted = 0.6 * info["outcome"] + 0.6 * info["early_stop"] + 1.0 * info["protocol"]
        assert float(scores[rows[0]]) == pytest.approx(weighted, abs=1e-5)
    keys = {tuple(sorted(e["reward_extra_info"])) for e in rollout.data["extra_fields"]}
    assert len(keys) == 1  # the same reward_extra_info keys for every trajectory


def test_documents_travel_by_reference_only(rollout):
    import transfer_queue as tq

    stored = tq.kv_batch_get(keys=rollout.keys[:1], partition_id=rollout.partition_id)
    text = repr({k: stored[k] for k in stored.keys() if k not in ("prompts", "responses", "input_ids")})
    assert "document_ref" in stored.keys() and ".parquet#" in text
    for document in rollout.documents:
        middle = document[len(document) // 2 :][:60]
        assert len(middle) == 60 and middle not in text


def test_verl_step_fields_are_copied_per_sequence(rollout):
    assert all(f.min_global_steps == f.max_global_steps == GLOBAL_STEPS for f in rollout.facts)
    assert all(tag["min_global_steps"] == GLOBAL_STEPS for tag in rollout.tags)


def _trainer(config, settings: TrainSettings):
    """Our registered trainer, constructed for real (its worker groups are started by ``init()``,
    which the advantage step does not need), with the given ``infmem.train`` settings."""
    from infmem_verl.verl_plugin.trainer import InfMemSyncTrainer

    trainer = InfMemSyncTrainer(config)
    trainer.infmem_train = settings
    return trainer


def _response_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax(logits) of each response token given the prompt (T = 1, the rollout temperature);
    logits only at the response positions, as RL training computes them."""
    logits = model(input_ids=torch.tensor([prompt + response]), logits_to_keep=len(response) + 1).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1).gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


def _recomputed_log_probs(model_dir, prompts: list[list[int]], responses: list[list[int]], width: int) -> torch.Tensor:
    """The old log-probs: every sequence recomputed by the training copy of the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = torch.zeros(len(prompts), width)
    with torch.no_grad():
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            out[row, : len(response)] = _response_log_probs(model, prompt, response)
    return out


@pytest.fixture(scope="module")
def advantages(rollout, tiny_model_dir):
    """Old log-probs written to TransferQueue (what verl's actor step does), then our trainer's
    advantage step, plain and with per-trajectory normalization + per-turn protocol penalty."""
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    mask = rollout.data["response_mask"]
    old = _recomputed_log_probs(tiny_model_dir, rollout.data["prompts"], rollout.data["responses"], mask.shape[1])
    nested_mask = tq.kv_batch_get(keys=rollout.keys, partition_id=rollout.partition_id, select_fields=["response_mask"])
    fields = TensorDict(
        {"old_log_probs": response_to_nested(old, nested_mask["response_mask"])}, batch_size=len(rollout.keys)
    )
    tq.kv_batch_put(keys=rollout.keys, partition_id=rollout.partition_id, fields=fields)

    results = {}
    for name, settings in {
        "plain": TrainSettings(),
        "shaped": TrainSettings(loss_normalization="trajectory", turn_protocol_penalty=0.25),
    }.items():
        metrics: dict = {}
        _trainer(rollout.config, settings)._compute_advantage(rollout.batch, metrics)
        got = tq.kv_batch_get(keys=rollout.keys, partition_id=rollout.partition_id, select_fields=["advantages"])
        results[name] = got["advantages"].to_padded_tensor(padding=0.0)[:, : mask.shape[1]]
    return old, results


def test_grpo_advantage_is_broadcast_to_every_sequence_of_a_trajectory(rollout, advantages):
    _, results = advantages
    adv, mask = results["plain"], rollout.data["response_mask"].bool()
    scores = rollout.data["rm_scores"].sum(dim=1)
    sessions = _sessions(rollout.keys)
    by_uid: dict[str, list[float]] = {}
    for session, rows in sessions.items():
        by_uid.setdefault(session.rsplit("_", 1)[0], []).append(float(scores[rows[0]]))
    assert any(abs(a - b) > 1e-6 for a, b in by_uid.values())  # the rollouts of a prompt differ
    for session, rows in sessions.items():
        group = by_uid[session.rsplit("_", 1)[0]]
        expected = float(scores[rows[0]]) - float(np.mean(group))  # GRPO without std normalization
        for r in rows:
            assert torch.allclose(adv[r][mask[r]], torch.full((int(mask[r].sum()),), expected), atol=1e-5)
            assert torch.all(adv[r][~mask[r]] == 0)


def test_trajectory_normalization_and_per_turn_protocol_penalty(rollout, advantages):
    from infmem_verl.reward.components import breaks_protocol

    _, results = advantages
    plain, shaped, mask = results["plain"], results["shaped"], rollout.data["response_mask"]
    sessions = _sessions(rollout.keys)
    tokens = {s: float(mask[rows].sum()) for s, rows in sessions.items()}
    mean = float(np.mean(list(tokens.values())))
    for session, rows in sessions.items():
        for r in rows:
            penalty = 0.25 if breaks_protocol(rollout.facts[r]) else 0.0
            expected = (plain[r] * mean / tokens[session] - penalty) * mask[r]
            assert torch.allclose(shaped[r], expected, atol=1e-5)
    assert any(breaks_protocol(f) for f in rollout.facts)  # the random model breaks the protocol


def test_recomputed_log_probs_match_rollout_and_policy_loss_trains(rollout, advantages, tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    old, results = advantages
    mask = rollout.data["response_mask"].float()
    rollout_logp = rollout.data["rollout_log_probs"][:, : mask.shape[1]]
    diff = ((old - rollout_logp).abs() * mask).max()
    assert diff < 1e-4, f"max |recomputed - rollout| log-prob = {diff}"
    print(f"\n[pipeline] {len(rollout.keys)} sequences, {rollout.server_calls} server calls, max |dlogp| = {diff:.2e}")

    # One policy-gradient step's loss and gradient through verl's policy loss on the same model.
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    actor_config = omega_conf_to_dataclass(rollout.config.actor_rollout_ref.actor)
    loss_fn = get_policy_loss_fn(actor_config.policy_loss.loss_mode)
    rows = list(range(len(rollout.keys)))
    logp = torch.zeros(len(rows), mask.shape[1])
    for i, r in enumerate(rows):
        response = rollout.data["responses"][r]
        logp[i, : len(response)] = _response_log_probs(model, rollout.data["prompts"][r], response)
    loss, _ = loss_fn(
        old_log_prob=old[rows],
        log_prob=logp,
        advantages=results["plain"][rows],
        response_mask=mask[rows],
        loss_agg_mode=actor_config.loss_agg_mode,
        config=actor_config,
    )
    loss.backward()
    grad = torch.sqrt(sum((p.grad**2).sum() for p in model.parameters() if p.grad is not None))
    assert torch.isfinite(loss) and grad > 0  # non-zero advantages move the policy


# ----------------------------------------------------- one vLLM replica per prompt group


def test_the_n_rollouts_of_a_prompt_go_to_one_replica(ray_session, tiny_model_dir, tokenizer, tmp_path):
    """Our registered loop, instantiated as verl's worker does, over verl's real ``LLMServerClient``
    and sticky load balancer with two generation replicas: the n sessions of one prompt (one
    ``uid``) send every call to the same replica; sessions without a shared key spread over both."""
    import asyncio

    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    from infmem_verl.cpu.server import CPUGenerationServer
    from infmem_verl.data.documents import pack_documents

    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose(
            "infmem_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={tiny_model_dir}",
                "infmem.cost.score_in_agent_loop=false",  # routing only: no reward here
                "infmem.agent.thinking=false",  # one call per turn
                "infmem.agent.document={chunk_tokens:256,unit_tokens:64,unit_overlap:16,paragraph_units:false}",
                "infmem.agent.memory_tokens=24",
                "infmem.agent.retrieval.evidence_tokens=128",
                "infmem.agent.prethink={prompt_tokens:1024,thinking_tokens:8,output_tokens:12}",
                "infmem.agent.write={prompt_tokens:null,thinking_tokens:8,output_tokens:24}",
                "infmem.agent.answer={prompt_tokens:1024,thinking_tokens:8,output_tokens:12}",
            ],
        )
    prepare_config(config)
    sample = make_dataset(1, 512, tokenizer, seed=3)[0]  # two or three chunks: a Write each, then the answer
    (ref,) = pack_documents([sample.context], tmp_path / "docs.parquet")
    actor = ray.remote(num_cpus=1)(CPUGenerationServer)
    servers = {f"replica-{i}": actor.remote(str(tiny_model_dir), seed=i) for i in range(2)}
    client = LLMServerClient(config, load_balancer_handle=get_router_handle(servers=servers))

    def calls() -> list[int]:
        return ray.get([server.num_calls.remote() for server in servers.values()])

    async def group(uid: str | None) -> None:
        loop = hydra.utils.instantiate(
            config=_agent_loop_registry["memagent_agent"], trainer_config=DictConfigWrap(config=config),
            server_manager=client, tokenizer=tokenizer, processor=None, hf_model_type=None, dataset_cls=None,
            data_config=DictConfigWrap(config.data), tools=None,
        )  # fmt: skip
        prompt = {"raw_prompt": [{"role": "user", "content": sample.question}], "document_ref": ref}
        keys = {} if uid is None else {"uid": uid}
        sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
        await asyncio.gather(*(loop.run(dict(sampling), session_id=i, **prompt, **keys) for i in range(N)))

    before = calls()
    asyncio.run(group("prompt-0"))
    grouped = [after - start for after, start in zip(calls(), before, strict=True)]
    assert sum(grouped) >= N * 3 and min(grouped) == 0  # every call of the group on one replica
    before = calls()
    asyncio.run(group(None))
    spread = [after - start for after, start in zip(calls(), before, strict=True)]
    assert min(spread) > 0  # a fresh id per trajectory: the least-loaded replica, so both
