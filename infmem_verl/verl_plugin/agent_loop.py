"""verl agent loops ``infmem_agent`` and ``memagent_agent``: the agent core inside verl's rollout.

Each sample runs one agent trajectory through a :class:`VerlServerPolicy` over the worker's
``LLMServerClient`` and returns one ``AgentLoopOutput`` per LLM call (answer last). verl's v1
worker scores the trajectory once (our ``infmem`` reward manager gets all its sequences), copies
the reward to every sequence and stores them in TransferQueue; GRPO then broadcasts the final
sequence's advantage to the others (multi-conversation training).

The question is the last user message of the prompt column; the document is resolved from the
reference column (``infmem.documents.ref_key``) so it never travels with the sequences. Each
sequence's ``extra_fields`` carries its :class:`~infmem_verl.agent.facts.TurnFacts`.

With ``infmem.cost.score_in_agent_loop`` (the default) the loop scores the trajectory itself with
the ``infmem`` reward manager's components and code (:func:`~infmem_verl.reward.manager.score_trajectory`)
and sets ``reward_score`` and ``reward_extra_info`` on the final output: verl then skips the remote
reward call, which would pad and ship five token tensors of every sequence through Ray, and copies
the score to the earlier outputs itself. A ``reward.custom_reward_function`` keeps the remote call.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.utils.model import get_generation_config

from infmem_verl.agent.cache import DocumentCache
from infmem_verl.agent.config import AgentConfig
from infmem_verl.agent.loops import AgentLoop, build_agent
from infmem_verl.agent.trajectory import Trajectory
from infmem_verl.cost import scores_in_agent_loop
from infmem_verl.policy.transformers import end_token_ids
from infmem_verl.policy.verl_server import VerlServerPolicy
from infmem_verl.reward.components import Component, load_components
from infmem_verl.reward.manager import build_record, score_trajectory
from infmem_verl.data import documents
from infmem_verl.agent.facts import turn_facts
from infmem_verl.settings import DocumentSettings, agent_settings, document_settings

# A sequence is one single-turn conversation: the user prompt and the assistant response.
TURNS_PER_SEQUENCE = 2


@dataclass
class _Runtime:
    """What every trajectory of one worker process shares: config, agents, document cache."""

    cfg: AgentConfig
    documents: DocumentSettings
    eos_ids: list[int]
    agents: dict[str, AgentLoop]
    reward: list[Component] | None  # components to score with in the loop; None: verl's remote call


_RUNTIMES: dict[tuple[str, str, int], _Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def _runtime(config, tokenizer) -> _Runtime:
    """The process-wide runtime for this config and tokenizer (built once: agents are reused).

    verl instantiates an agent loop per sample, so the prompt templates, the document cache
    (shared by the n rollouts of a document) and the agents must not be built per sample.
    """
    cfg, docs = agent_settings(config), document_settings(config)
    key = (repr(cfg), repr(docs), id(tokenizer))
    with _RUNTIMES_LOCK:
        runtime = _RUNTIMES.get(key)
        if runtime is None:
            if not cfg.record_token_ids:
                raise ValueError("infmem.agent.record_token_ids: must be true for training (verl trains on the ids)")
            cache = DocumentCache(tokenizer, cfg.document, cfg.retrieval, cfg.retrieval.cache_size)
            model = config.actor_rollout_ref.model
            generation = get_generation_config(model.get("hf_config_path") or model.path)
            runtime = _Runtime(
                cfg=cfg,
                documents=docs,
                eos_ids=end_token_ids(tokenizer, generation),
                agents={name: build_agent(name, cfg, tokenizer, cache) for name in ("infmem", "memagent")},
                reward=in_loop_reward(config),
            )
            _RUNTIMES[key] = runtime
        return runtime


def in_loop_reward(config) -> list[Component] | None:
    """The reward components the agent loop scores with, or None when verl's reward call must run:
    the lever is off, another reward manager is configured, or a custom reward function is set."""
    return load_components(config.infmem.reward.components) if scores_in_agent_loop(config) else None


def score_outputs(outputs: list[AgentLoopOutput], components: list[Component], sample: dict, tokenizer) -> None:
    """Score the trajectory of ``outputs`` as the ``infmem`` reward manager would, onto the final output."""
    final = outputs[-1]
    record = build_record([o.extra_fields for o in outputs], sample, final.response_ids, tokenizer)
    result = score_trajectory(
        components, record, [len(o.prompt_ids) for o in outputs], [len(o.response_ids) for o in outputs]
    )
    final.reward_score = result["reward_score"]
    final.extra_fields["reward_extra_info"] = result["reward_extra_info"]


def group_routing_key(sample: dict[str, Any]) -> str | None:
    """The request id every call of the sample's n rollouts is sent with: its prompt's ``uid``.

    verl's router is sticky by request id (``GlobalRequestLoadBalancer``: a new id goes to the least
    loaded replica, a known one to the replica it went to), and its v1 agent-loop worker gives all
    n sessions of a prompt the same ``uid``. One id per prompt group keeps the group on one vLLM
    replica, so the ``chunk_first`` Writes of its rollouts share the chunk in that replica's prefix
    cache; a trajectory's two-stage continuation stays with it too. The id reaching vLLM is a new
    one per call (``LLMServerClient._vllm_request_id``; with ``rollout.full_determinism`` it is this
    key, as verl's own loops then send ``det-<priority>`` for all n sessions). None (a fresh id per
    trajectory) for a sample without a ``uid``.
    """
    uid = sample.get("uid")
    return None if uid is None else f"group-{uid}"


def question_from_prompt(raw_prompt: Any) -> str:
    """The text of the last user message of verl's ``raw_prompt`` (the dataset's prompt column)."""
    messages = list(raw_prompt) if raw_prompt is not None else []
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user" and isinstance(message.get("content"), str):
            return message["content"]
    raise ValueError(f"prompt: expected chat messages with a user message holding the question, got {raw_prompt!r}")


def trajectory_outputs(trajectory: Trajectory, prompt_length: int, response_length: int) -> list[AgentLoopOutput]:
    """One ``AgentLoopOutput`` per turn (answer last), with its facts in ``extra_fields``.

    A turn longer than verl's rollout lengths would be cut by verl's padding and train on a
    different sequence than was sampled, so it is an error (the entry point derives the lengths).
    Turns without tokens (an aborted call) carry nothing to train on and are left out.
    """
    outputs = []
    for index, turn in enumerate(trajectory.turns):
        if turn.prompt_ids is None or turn.response_ids is None or turn.response_mask is None:
            raise ValueError("infmem.agent.record_token_ids: turns have no token ids; it must be true for training")
        if len(turn.prompt_ids) > prompt_length or len(turn.response_ids) > response_length:
            raise ValueError(
                f"{turn.kind} turn of {len(turn.prompt_ids)} prompt / {len(turn.response_ids)} response tokens exceeds "
                f"actor_rollout_ref.rollout.prompt_length={prompt_length} / response_length={response_length}"
            )
        if len(turn.response_ids) == 0:
            continue
        facts = turn_facts(trajectory, index, turn)
        outputs.append(
            AgentLoopOutput(
                prompt_ids=turn.prompt_ids.tolist(),
                response_ids=turn.response_ids.tolist(),
                response_mask=turn.response_mask.astype(int).tolist(),
                response_logprobs=turn.log_probs.tolist() if turn.log_probs is not None else None,
                num_turns=TURNS_PER_SEQUENCE,
                metrics=AgentLoopMetrics(
                    generate_sequences=turn.latency_s, num_preempted=int(turn.extra.get("num_preempted", -1))
                ),
                extra_fields=facts.to_dict(),
            )
        )
    if not outputs or trajectory.turns[-1].kind != "answer" or len(trajectory.turns[-1].response_ids) == 0:
        raise ValueError("trajectory: the answer turn produced no tokens (was the rollout aborted?)")
    return outputs


class MemoryAgentLoop(AgentLoopBase):
    """Base of our two registered loops; ``agent_name`` picks the agent of the core."""

    agent_name: str

    def __init__(self, trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs):
        super().__init__(trainer_config, server_manager, tokenizer, processor, dataset_cls, data_config, **kwargs)
        self.runtime = _runtime(self.config, tokenizer)

    def _document_ref(self, sample: dict[str, Any]) -> str:
        key = self.runtime.documents.ref_key
        if key not in sample:
            raise KeyError(
                f"infmem.documents.ref_key: dataset column {key!r} (the document reference) is missing; "
                f"columns: {sorted(sample)}"
            )
        return sample[key]

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> list[AgentLoopOutput]:
        started = time.perf_counter()
        settings = self.runtime.documents
        question = question_from_prompt(kwargs.get("raw_prompt"))
        ref = self._document_ref(kwargs)
        document = await self.loop.run_in_executor(None, documents.resolve, ref, settings.root, settings.cache_size)
        policy = VerlServerPolicy(
            self.server_manager, sampling_params, self.runtime.eos_ids, request_id=group_routing_key(kwargs)
        )
        trajectory = await self.runtime.agents[self.agent_name].run(policy, question, document)
        trajectory.rollout_s = time.perf_counter() - started  # the document's resolution included
        outputs = trajectory_outputs(trajectory, self.rollout_config.prompt_length, self.rollout_config.response_length)
        if self.runtime.reward is not None:
            score_outputs(outputs, self.runtime.reward, kwargs, self.tokenizer)
        return outputs


@register("infmem_agent")
class InfMemAgentLoop(MemoryAgentLoop):
    """InfMem: PreThink (retrieve or stop) -> Retrieve -> Write per chunk, then Answer."""

    agent_name = "infmem"


@register("memagent_agent")
class MemAgentAgentLoop(MemoryAgentLoop):
    """MemAgent baseline: Write per chunk, then Answer."""

    agent_name = "memagent"
