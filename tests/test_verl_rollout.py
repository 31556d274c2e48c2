"""The pieces of the verl integration that run without Ray: document store, the Policy adapter's
reading of verl's ``TokenOutput``, turning a real agent trajectory into ``AgentLoopOutput`` s, and
the ``infmem_sync`` trainer's mini-batch sizing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.workers.rollout.replica import TokenOutput

from infmem_verl.agent import agent_config, build_agent
from infmem_verl.agent.policy import SamplingParams
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.policy.transformers import TransformersPolicy
from infmem_verl.policy.verl_server import VerlServerPolicy
from infmem_verl.verl_plugin.agent_loop import question_from_prompt, trajectory_outputs
from infmem_verl.verl_plugin.dataset import write_verl_dataset
from infmem_verl.data.documents import DocumentStore, document_id, pack_documents, resolve, split_ref, write_store
from infmem_verl.agent.facts import TurnFacts
from infmem_verl.verl_plugin.trainer import InfMemSyncTrainer

# ------------------------------------------------------------------------------ document store


def test_store_round_trip_reads_one_row_group_and_caches(tmp_path):
    texts = [f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:30]]
    refs = pack_documents(texts + texts[:3], tmp_path / "docs.parquet")  # duplicates stored once
    store = DocumentStore(tmp_path / "docs.parquet", cache_size=2)
    assert len(store) == 30 and store._file.num_row_groups == 4  # row groups of 8 documents
    assert [resolve(ref) for ref in refs] == texts + texts[:3]
    assert store.get(document_id(texts[17])) == texts[17]
    assert len(store._cache) == 1
    for text in texts[:5]:
        store.get(document_id(text))
    assert list(store._cache) == [document_id(texts[3]), document_id(texts[4])]  # least recently used go


def test_relative_store_paths_resolve_against_the_root(tmp_path):
    write_store(tmp_path / "shard" / "docs.parquet", [("d1", "first document"), ("d2", "second document")])
    assert resolve("shard/docs.parquet#d2", root=tmp_path) == "second document"


def test_store_errors_name_what_is_wrong(tmp_path):
    write_store(tmp_path / "docs.parquet", [("d1", "text")])
    with pytest.raises(KeyError, match=r"document 'nope' is not in store .*docs.parquet' \(1 documents\)"):
        resolve(f"{tmp_path}/docs.parquet#nope")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        resolve(f"{tmp_path}/missing.parquet#d1")
    with pytest.raises(ValueError, match=r"expected '<store.parquet>#<doc id>', got 'docs.parquet'"):
        split_ref("docs.parquet")
    with pytest.raises(ValueError, match=r"document 'd2': expected non-empty text"):
        write_store(tmp_path / "bad.parquet", [("d2", "  ")])


# ----------------------------------------------------------------------------- Policy adapter


class TokenOutputServer:
    """Answers generate calls with prepared ``TokenOutput`` s (verl's contract), recording requests."""

    def __init__(self, outputs: list[TokenOutput]):
        self.outputs = outputs
        self.requests: list[tuple] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params):
        self.requests.append((request_id, prompt_ids, sampling_params))
        return self.outputs[len(self.requests) - 1]


async def test_adapter_maps_verl_outputs_to_generations():
    eos = 151645
    server = TokenOutputServer(
        [
            TokenOutput(
                token_ids=[5, 6, eos],
                log_probs=[-0.1, -0.2, -0.3],
                stop_reason="completed",
                extra_fields={"global_steps": 7, "min_global_steps": 7, "max_global_steps": 7},
            ),
            TokenOutput(token_ids=[5, 6, 7, 8], log_probs=[-1.0] * 4, stop_reason="completed", num_preempted=2),
            TokenOutput(token_ids=[], log_probs=[], stop_reason="aborted"),
        ]
    )
    sampling = {"temperature": 1.0, "top_p": 0.7, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    policy = VerlServerPolicy(server, sampling, eos_token_ids=[eos, 151643])
    stop = await policy.generate(np.array([1, 2, 3], dtype=np.int32), SamplingParams(max_tokens=4, temperature=0.2))
    cut = await policy.generate([1, 2], SamplingParams(max_tokens=4))
    aborted = await policy.generate([1], SamplingParams(max_tokens=4))
    assert (stop.finish_reason, cut.finish_reason, aborted.finish_reason) == ("stop", "length", "abort")
    assert stop.token_ids == [5, 6, eos] and stop.log_probs == [-0.1, -0.2, -0.3]
    assert stop.extra == {"global_steps": 7, "min_global_steps": 7, "max_global_steps": 7}
    assert cut.extra == {"num_preempted": 2}
    # verl's sampling wins over the agent's; the agent sets only the budget; one request id per trajectory.
    assert server.requests[0][2] == {**sampling, "max_tokens": 4}
    assert server.requests[0][1] == [1, 2, 3] and len({r[0] for r in server.requests}) == 1


async def test_adapter_rejects_missing_log_probs():
    server = TokenOutputServer([TokenOutput(token_ids=[5, 6], log_probs=None, stop_reason="completed")])
    policy = VerlServerPolicy(server, {"logprobs": True}, eos_token_ids=[0])
    with pytest.raises(ValueError, match=r"returned 0 log-probs for 2 tokens; log-probs were requested"):
        await policy.generate([1], SamplingParams(max_tokens=4))


# ------------------------------------------------------------ trajectory -> AgentLoopOutputs


SMALL_AGENT = {
    "document": {"chunk_tokens": 256, "unit_tokens": 64, "unit_overlap": 16},
    "memory_tokens": 24,
    "retrieval": {"evidence_tokens": 128, "top_k_max": 2, "top_k_default": 2},
    "prethink": {"prompt_tokens": 1024, "thinking_tokens": 8, "output_tokens": 12},
    "write": {"prompt_tokens": 1024, "thinking_tokens": 8, "output_tokens": 24},
    "answer": {"prompt_tokens": 1024, "thinking_tokens": 8, "output_tokens": 12},
}


@pytest.fixture(scope="module")
def trajectory(tiny_model_dir, tokenizer):
    """A real InfMem trajectory: the agent core on the tiny model, over real Wikipedia text."""
    document = "\n\n".join(f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[40:43])

    async def run():
        async with TransformersPolicy.from_pretrained(tiny_model_dir, seed=0) as policy:
            agent = build_agent("infmem", agent_config(SMALL_AGENT), tokenizer)
            return await agent.run(policy, "Which river is mentioned?", document)

    return asyncio.run(run())


def test_one_output_per_turn_with_its_facts(trajectory):
    cfg = agent_config(SMALL_AGENT)
    outputs = trajectory_outputs(trajectory, cfg.max_prompt_tokens(), cfg.max_response_tokens())
    assert len(outputs) == len(trajectory.turns) and trajectory.turns[-1].kind == "answer"
    for index, (output, turn) in enumerate(zip(outputs, trajectory.turns, strict=False)):
        assert output.prompt_ids == turn.prompt_ids.tolist() and output.response_ids == turn.response_ids.tolist()
        assert (
            output.response_mask == turn.response_mask.tolist() and output.response_logprobs == turn.log_probs.tolist()
        )
        facts = TurnFacts.from_dict(output.extra_fields)
        assert (facts.turn_index, facts.turn_kind, facts.chunk_index, facts.llm_calls) == (
            index,
            turn.kind,
            turn.chunk_index,
            turn.llm_calls,
        )
        assert facts.memory_text == (turn.memory_text if turn.kind == "write" else None)
    assert TurnFacts.from_dict(outputs[-1].extra_fields).prediction == trajectory.prediction
    # Two-stage thinking: the closing tag the loop injected is not trained on.
    assert any(0 in o.response_mask for o in outputs)


def test_turns_longer_than_verls_rollout_lengths_are_an_error(trajectory):
    cfg = agent_config(SMALL_AGENT)
    with pytest.raises(ValueError, match=r"exceeds actor_rollout_ref.rollout.prompt_length=16 / response_length="):
        trajectory_outputs(trajectory, 16, cfg.max_response_tokens())


def test_question_is_the_last_user_message():
    messages = np.array([{"role": "system", "content": "s"}, {"role": "user", "content": "Who won?"}], dtype=object)
    assert question_from_prompt(messages) == "Who won?"
    with pytest.raises(ValueError, match="prompt: expected chat messages with a user message"):
        question_from_prompt([{"role": "system", "content": "s"}])


# ------------------------------------------------------------------ infmem_sync mini-batches


class RecordingActorGroup:
    """Stands in for the FSDP actor worker group (GPU-only): records what verl asks it to do."""

    def __init__(self):
        self.extra_info: dict = {}

    def update_actor(self, batch):
        self.extra_info = dict(batch.extra_info)
        # verl's engines: one grad_norm per optimizer step, a step per mini_batch_size rows
        steps = len(batch.keys) // batch.extra_info["mini_batch_size"] * batch.extra_info["epochs"]
        return {"metrics": {"mfu": [0.0], "pg_loss": [0.1], "grad_norm": [1.0] * steps}}


@pytest.mark.parametrize("rows, dp, steps", [(1024, 8, 16), (96, 2, 4)])
def test_an_rl_step_makes_the_configured_number_of_optimizer_steps(rows, dp, steps):
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose(
            "infmem_trainer", overrides=["+recipe=infmem_4b", f"infmem.train.optimizer_steps_per_rl_step={steps}"]
        )
    trainer = InfMemSyncTrainer(config)
    # verl keys sync behaviour on the mode's name; ours must get the sync replay buffer.
    assert trainer.trainer_mode == "sync" and trainer.registered_mode == "infmem_sync"
    assert type(trainer.replay_buffer) is ReplayBuffer and trainer.infmem_train.optimizer_steps_per_rl_step == steps
    trainer.actor_rollout_wg = RecordingActorGroup()
    multiple = trainer._get_required_batch_multiple(dp)
    assert multiple == np.lcm(dp, 4) * steps and rows % multiple == 0
    tags = [{"prompt_len": 100, "response_len": 20} for _ in range(rows)]  # as verl's agent loop tags a sequence
    batch = KVBatchMeta(keys=[f"u{i}_0_0" for i in range(rows)], tags=tags, partition_id="train")
    metrics: dict = {}
    trainer._update_actor(batch, metrics)
    assert trainer.actor_rollout_wg.extra_info["mini_batch_size"] == rows // steps
    assert metrics["infmem/optimizer_steps"] == steps
    assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 8  # restored after the step


# -------------------------------------------------------------------- verl training parquet


def test_training_parquet_loads_in_verl_with_documents_by_reference(tmp_path, tokenizer):
    from verl.trainer.ppo.utils import create_rl_dataset

    from infmem_verl.data.synthetic import make_dataset
    from infmem_verl.main import prepare_config
    from infmem_verl.verl_plugin.dataset import main as dataset_cli

    samples = make_dataset(2, 600, tokenizer, seed=1)
    out, store = write_verl_dataset(samples, tmp_path / "train.parquet")
    assert store == tmp_path / "train_docs.parquet"
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=[f"data.train_files={out}", f"data.val_files={out}"])
    prepared = prepare_config(config)
    assert (prepared.checked_files, prepared.missing_files) == ([str(out)] * 2, [])
    dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, None, is_train=True)
    for i, sample in enumerate(samples):
        row = dataset[i]
        assert row["raw_prompt"] == [{"role": "user", "content": sample.question}]
        assert "context" not in row and resolve(row["document_ref"]) == sample.context
        assert list(row["reward_model"]["ground_truth"]) == sample.answers and row["index"] == i

    dataset_cli(["--synthetic", "1", "--tokens", "600", "--out", str(tmp_path / "cli.parquet")])
    assert (tmp_path / "cli_docs.parquet").is_file()
