"""The InfMem and MemAgent loops against a scripted policy (exact call sequences, stop rule,
budgets, malformed-output fallbacks) and end to end with the tiny model."""

from __future__ import annotations

import asyncio
import json
import platform
import threading
import time

import numpy as np
import pytest

from infmem_verl.agent.cache import DocumentCache, release_free_memory
from infmem_verl.agent.config import agent_config
from infmem_verl.agent.document import text_digest
from infmem_verl.agent.loops import build_agent
from infmem_verl.agent.trajectory import (
    FLAG_INVALID_ACTION,
    FLAG_MEMORY_KEPT,
    FLAG_MEMORY_TRUNCATED,
    FLAG_THINK_CLOSED_BY_LOOP,
    FLAG_THINK_UNCLOSED,
    FLAG_TOPK_CLAMPED,
)
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.policy.scripted import ScriptedPolicy

# Distinct budgets per call kind let the scripted policy tell the kinds apart by max_tokens
# alone, without depending on prompt wording.
THINK = {"prethink": 30, "write": 40, "answer": 50}
OUTPUT = {"prethink": 60, "write": 70, "answer": 80}
KIND_BY_BUDGET = {v: k for k, v in THINK.items()} | {v: k for k, v in OUTPUT.items()}
RARE = "zorblax"  # a word planted in exactly one chunk


def small_cfg(**overrides):
    base = {
        "document": {"chunk_tokens": 400, "unit_tokens": 100, "unit_overlap": 20},
        "memory_tokens": 70,
        "prethink": {"prompt_tokens": 2048, "thinking_tokens": THINK["prethink"], "output_tokens": OUTPUT["prethink"]},
        "write": {"prompt_tokens": 2048, "thinking_tokens": THINK["write"], "output_tokens": OUTPUT["write"]},
        "answer": {"prompt_tokens": 2048, "thinking_tokens": THINK["answer"], "output_tokens": OUTPUT["answer"]},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            base.setdefault(key, {}).update(value)
        else:
            base[key] = value
    return agent_config(base)


@pytest.fixture(scope="module")
def document() -> str:
    paragraphs = [f"{p['title']}\n{p['text']}" for p in wiki_paragraphs()[:14]]
    paragraphs[9] = paragraphs[9] + f" The hidden codeword is {RARE}."
    return "\n\n".join(paragraphs)


def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def thought(output: str, thinking: str = "I consider the memory.") -> str:
    return f"<think>\n{thinking}\n</think>\n\n{output}"


class Script:
    """Responds by call kind; ``actions`` is the controller's output per PreThink call."""

    def __init__(self, actions: list[str], memory: str = "Notes so far.", answer: str = "\\boxed{Paris}"):
        self.actions = list(actions)
        self.memory = memory
        self.answer = answer
        self.kinds: list[str] = []
        self.writes = 0

    def __call__(self, prompt_ids: np.ndarray, params) -> str:
        kind = KIND_BY_BUDGET[params.max_tokens]
        self.kinds.append(kind)
        if kind == "prethink":
            return thought(self.actions.pop(0) if self.actions else tool_call("stop"))
        if kind == "write":
            self.writes += 1
            return thought(f"{self.memory} (write {self.writes})")
        return thought(self.answer)


def run(agent, policy, question, document):
    return asyncio.run(agent.run(policy, question, document))


def test_infmem_retrieves_then_stops(tokenizer, document):
    script = Script([tool_call("retrieve", query=f"codeword {RARE}", top_k=2), tool_call("retrieve", query="music"), tool_call("stop")])
    policy = ScriptedPolicy(tokenizer, script)
    agent = build_agent("infmem", small_cfg(), tokenizer)
    traj = run(agent, policy, "What is the hidden codeword?", document)

    assert script.kinds == ["prethink", "write", "prethink", "write", "prethink", "answer"]
    assert [t.kind for t in traj.turns] == script.kinds
    assert traj.stop_step == 2 and traj.chunks_read == 2
    summary = traj.summary()
    assert summary.stopped_early and summary.retrieval_calls == 2 and summary.invalid_turns == 0
    assert traj.prediction == "Paris"
    first = traj.turns[0]
    assert first.action.kind == "retrieve" and first.action.top_k == 2
    prepared = asyncio.run(agent.cache.get(document))
    unit_texts = prepared.document.unit_texts()
    assert first.retrieved_units and RARE in unit_texts[first.retrieved_units[0]]
    # The Write that follows sees the retrieved unit's tokens in its prompt.
    unit_ids = prepared.document.unit_ids(first.retrieved_units[0])
    write_prompt = traj.turns[1].prompt_ids
    assert any(np.array_equal(write_prompt[i : i + len(unit_ids)], unit_ids) for i in range(len(write_prompt) - len(unit_ids)))
    # The second controller call sees the first query in its history.
    assert RARE in tokenizer.decode(traj.turns[2].prompt_ids)


def test_stop_rule_needs_consecutive_votes(tokenizer, document):
    stop, retrieve = tool_call("stop"), tool_call("retrieve", query="classical music")
    script = Script([stop, retrieve, stop, stop, stop])
    agent = build_agent("infmem", small_cfg(stop_votes=3), tokenizer)
    traj = run(agent, ScriptedPolicy(tokenizer, script), "Who?", document)
    # Votes below k still write (with nothing retrieved): chunks 0..3 are written, stop at 4.
    assert traj.stop_step == 4 and traj.chunks_read == 4
    assert script.kinds == ["prethink", "write"] * 4 + ["prethink", "answer"]
    assert [t.retrieved_units != [] for t in traj.turns if t.kind == "write"] == [False, True, False, False]


def test_stop_inside_thinking_and_malformed_actions(tokenizer, document):
    hostile = [
        "STOP",  # no tool call: invalid
        tool_call("retrieve", query="x", top_k=4.5),  # non-integer top_k: invalid
        tool_call("retrieve", query="music", top_k=99),  # integer out of range: clamped, valid
    ]
    script = Script(hostile)
    # The first PreThink also mentions STOP inside its thinking; that never counts as an action.
    original = script.__call__

    def respond(prompt_ids, params):
        text = original(prompt_ids, params)
        return text.replace("I consider the memory.", "Should I STOP? <tool_call>{}</tool_call>", 1)

    agent = build_agent("infmem", small_cfg(), tokenizer)
    traj = run(agent, ScriptedPolicy(tokenizer, respond), "Who?", document)
    prethinks = [t for t in traj.turns if t.kind == "prethink"]
    assert [t.valid for t in prethinks[:3]] == [False, False, True]
    assert all(FLAG_INVALID_ACTION in t.flags for t in prethinks[:2])
    assert prethinks[0].action.kind == "continue" and prethinks[2].action.clamped
    assert FLAG_TOPK_CLAMPED in prethinks[2].flags and prethinks[2].action.top_k == 8
    assert traj.stop_step == 3  # the scripted stop after the three hostile outputs


def test_invalid_action_can_fall_back_to_question_retrieval(tokenizer, document):
    question = f"Which codeword is {RARE}?"
    agent = build_agent("infmem", small_cfg(invalid_action="retrieve_question"), tokenizer)
    traj = run(agent, ScriptedPolicy(tokenizer, Script(["garbage"])), question, document)
    first = traj.turns[0]
    assert not first.valid and first.action.kind == "retrieve" and first.action.query == question
    assert first.retrieved_units


def test_two_stage_closes_unfinished_thinking(tokenizer, document):
    endless = "hmm " * 200

    def respond(prompt_ids, params):
        if params.max_tokens in THINK.values():
            return "<think>\n" + endless  # never closes within the thinking budget
        kind = KIND_BY_BUDGET[params.max_tokens]
        return {"prethink": tool_call("stop"), "write": "memory", "answer": "\\boxed{x}"}[kind]

    policy = ScriptedPolicy(tokenizer, respond)
    agent = build_agent("infmem", small_cfg(), tokenizer)
    traj = run(agent, policy, "Who?", document)
    first = traj.turns[0]
    assert FLAG_THINK_CLOSED_BY_LOOP in first.flags and first.llm_calls == 2
    assert first.action.kind == "stop" and first.valid
    injected = agent.builder.close_think_ids
    n1 = THINK["prethink"]
    assert first.response_mask[:n1].all() and not first.response_mask[n1 : n1 + len(injected)].any()
    assert np.array_equal(first.response_ids[n1 : n1 + len(injected)], injected)
    assert first.log_probs.shape == first.response_ids.shape
    # The second generate call continued from prompt + stage-1 tokens + injected closing tag.
    second_call = policy.calls[1]
    assert np.array_equal(second_call.prompt_ids, np.concatenate([first.prompt_ids, first.response_ids[: n1 + len(injected)]]))
    assert traj.prediction == "x"


def test_single_pass_unclosed_thinking_keeps_memory(tokenizer, document):
    def respond(prompt_ids, params):
        return "<think>\n" + "hmm " * 300  # never closes

    agent = build_agent("memagent", small_cfg(thinking_mode="single_pass"), tokenizer)
    traj = run(agent, ScriptedPolicy(tokenizer, respond), "Who?", document)
    writes = [t for t in traj.turns if t.kind == "write"]
    assert all(FLAG_THINK_UNCLOSED in t.flags and FLAG_MEMORY_KEPT in t.flags and not t.valid for t in writes)
    assert all(t.memory_text == "" for t in writes) and traj.prediction is None


def test_memory_is_capped(tokenizer, document):
    cfg = small_cfg(memory_tokens=20)
    long_memory = " ".join(f"fact{i}" for i in range(200))
    agent = build_agent("memagent", cfg, tokenizer)
    traj = run(agent, ScriptedPolicy(tokenizer, Script([], memory=long_memory)), "Who?", document)
    writes = [t for t in traj.turns if t.kind == "write"]
    assert all(t.memory_tokens == 20 and FLAG_MEMORY_TRUNCATED in t.flags and not t.valid for t in writes)


def test_memagent_overwrites_memory_every_chunk(tokenizer, document):
    script = Script([])
    agent = build_agent("memagent", small_cfg(), tokenizer)
    traj = run(agent, ScriptedPolicy(tokenizer, script), "Who?", document)
    num_chunks = traj.num_chunks
    assert num_chunks > 3
    assert script.kinds == ["write"] * num_chunks + ["answer"]
    assert traj.stop_step is None and traj.chunks_read == num_chunks
    third_prompt = tokenizer.decode(traj.turns[2].prompt_ids)
    assert "(write 2)" in third_prompt and "(write 1)" not in third_prompt
    assert traj.turns[-1].kind == "answer" and "(write %d)" % num_chunks in tokenizer.decode(traj.turns[-1].prompt_ids)


def test_prompts_respect_budgets_and_short_documents(tokenizer, document):
    agent = build_agent("infmem", small_cfg(), tokenizer)
    script = Script([tool_call("retrieve", query="world century music language people known", top_k=8)] * 40)
    traj = run(agent, ScriptedPolicy(tokenizer, script), "Who?", document)
    for turn in traj.turns:
        assert turn.prompt_tokens <= getattr(agent.cfg, turn.kind).prompt_tokens
    short = run(agent, ScriptedPolicy(tokenizer, Script([tool_call("stop")])), "Who?", "A single short sentence.")
    assert short.num_chunks == 1


def test_bad_input_names_the_field(tokenizer, document):
    agent = build_agent("infmem", small_cfg(), tokenizer)
    policy = ScriptedPolicy(tokenizer, Script([]))
    with pytest.raises(ValueError, match="question"):
        run(agent, policy, "", document)
    with pytest.raises(ValueError, match="question"):
        run(agent, policy, None, document)
    with pytest.raises(ValueError, match="document"):
        run(agent, policy, "Who?", "   ")
    with pytest.raises(ValueError, match="agent"):
        build_agent("nope", small_cfg(), tokenizer)


def test_rollouts_of_one_document_share_one_index(tokenizer, document):
    agent = build_agent("infmem", small_cfg(), tokenizer)

    async def group():
        policies = [ScriptedPolicy(tokenizer, Script([tool_call("stop")])) for _ in range(4)]
        return await asyncio.gather(*(agent.run(p, "Who?", document) for p in policies))

    trajectories = asyncio.run(group())
    assert len(trajectories) == 4 and agent.cache.builds == 1
    # The cache is keyed by the same content hash the prepared document records.
    prepared = asyncio.run(agent.cache.get(document))
    assert agent.cache.builds == 1
    digest = agent.cache.key(document, with_index=True).split(":")[0]
    assert digest == prepared.document.content_hash == text_digest(document)
    assert agent.cache.key(document, with_index=False) != agent.cache.key(document, with_index=True)


class GatedCache(DocumentCache):
    """A real cache whose index build starts only once the first LLM call has started (or after
    ``timeout`` seconds): a rollout that waited for the index would make the build wait out the
    timeout, so the order of the two is what the test reads."""

    def __init__(self, *args, timeout: float = 30.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.first_call, self.timeout = threading.Event(), timeout
        self.gate_opened_by_call: bool | None = None
        self.index_done: float | None = None

    def build_index(self, document):
        self.gate_opened_by_call = self.first_call.wait(self.timeout)
        index = super().build_index(document)
        self.index_done = time.perf_counter()
        return index


class IndexFirstCache(DocumentCache):
    """The cache as it was: the rollout starts only once the index is built."""

    async def get(self, text, with_index=True):
        prepared = await super().get(text, with_index)
        if with_index:
            await prepared.ready_index()
        return prepared


class StartRecordingPolicy:
    """Forwards to a policy; records when each call starts and opens ``gate`` at the first."""

    def __init__(self, inner, gate: threading.Event | None = None):
        self.inner, self.gate, self.starts = inner, gate, []

    async def generate(self, prompt_ids, params):
        self.starts.append(time.perf_counter())
        if self.gate is not None:
            self.gate.set()
        return await self.inner.generate(prompt_ids, params)


def _cache(cls, cfg, tokenizer, **kwargs):
    return cls(tokenizer, cfg.document, cfg.retrieval, cfg.retrieval.cache_size, **kwargs)


def test_the_first_call_is_made_while_the_index_builds(tokenizer, document):
    """The first PreThink needs the chunks, not the index: DocumentCache.get returns with the
    document, the index builds in a thread meanwhile, and the first search waits for it. The
    trajectories (prompts, retrieved units, answer) are those of the index-first cache."""
    cfg = small_cfg()
    actions = [tool_call("retrieve", query=f"codeword {RARE}", top_k=2), tool_call("retrieve", query="music"), tool_call("stop")]
    cache = _cache(GatedCache, cfg, tokenizer)
    agent = build_agent("infmem", cfg, tokenizer, cache)
    policies = [StartRecordingPolicy(ScriptedPolicy(tokenizer, Script(actions)), cache.first_call) for _ in range(2)]

    async def group(agent, policies):
        return await asyncio.gather(*(agent.run(p, "What is the hidden codeword?", document) for p in policies))

    background = asyncio.run(group(agent, policies))
    assert cache.gate_opened_by_call is True, "the index build waited for a call that never came"
    assert min(p.starts[0] for p in policies) < cache.index_done
    assert cache.builds == 1  # one build shared by both rollouts, the index included

    reference_agent = build_agent("infmem", cfg, tokenizer, _cache(IndexFirstCache, cfg, tokenizer))
    reference = asyncio.run(group(reference_agent, [ScriptedPolicy(tokenizer, Script(actions)) for _ in range(2)]))
    for got, want in zip(background, reference):
        assert [t.kind for t in got.turns] == [t.kind for t in want.turns]
        assert [t.retrieved_units for t in got.turns] == [t.retrieved_units for t in want.turns]
        assert all(np.array_equal(a.prompt_ids, b.prompt_ids) for a, b in zip(got.turns, want.turns))
        assert got.prediction == want.prediction == "Paris"
    assert background[0].turns[0].retrieved_units  # the first search found units (it waited for the index)


class FailingIndexCache(DocumentCache):
    """A real cache whose first ``failures`` index builds raise."""

    def __init__(self, *args, failures: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        self.failures = failures

    def build_index(self, document):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("index build failed on purpose")
        return super().build_index(document)


def test_a_failed_index_build_reaches_its_waiters_and_is_built_again(tokenizer, document):
    cfg = small_cfg()
    cache = _cache(FailingIndexCache, cfg, tokenizer, failures=2)
    agent = build_agent("infmem", cfg, tokenizer, cache)
    retrieve = [tool_call("retrieve", query="music"), tool_call("stop")]

    async def group():
        policies = [ScriptedPolicy(tokenizer, Script(retrieve)) for _ in range(3)]
        return await asyncio.gather(*(agent.run(p, "Who?", document) for p in policies), return_exceptions=True)

    failed = asyncio.run(group())
    assert all(isinstance(r, RuntimeError) and "on purpose" in str(r) for r in failed), failed
    assert cache.builds == 1  # the three rollouts shared the one that failed
    # The failure did not stay cached: the next request builds again (and this build fails too).
    with pytest.raises(RuntimeError, match="on purpose"):
        asyncio.run(agent.cache.get(document)).index  # noqa: B018 (the property raises the build's error)
    assert cache.builds == 2
    again = asyncio.run(group())  # another event loop again
    assert all(r.turns[0].retrieved_units for r in again) and cache.builds == 3
    # A MemAgent rollout of the same document never waits for an index (none is built for it).
    memagent = build_agent("memagent", cfg, tokenizer, cache)
    prepared = asyncio.run(memagent.cache.get(document, with_index=False))
    assert prepared.pending is None and prepared.index is None


def test_the_index_property_refuses_to_block_an_event_loop(tokenizer, document):
    cache = _cache(GatedCache, small_cfg(), tokenizer, timeout=5.0)

    async def peek():
        prepared = await cache.get(document)
        with pytest.raises(RuntimeError, match="ready_index"):
            prepared.index  # noqa: B018
        cache.first_call.set()
        return (await prepared.ready_index()) is prepared.index

    assert asyncio.run(peek())


def test_free_memory_is_handed_back_on_glibc():
    # Every build ends with it; on glibc it must actually run (elsewhere it is a no-op).
    assert release_free_memory() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


@pytest.mark.parametrize("scope,exclude", [("read_prefix", False), ("document", True)])
def test_retrieval_scope_and_exclusion(tokenizer, document, scope, exclude):
    cfg = small_cfg(retrieval={"scope": scope, "exclude_current_chunk": exclude})
    agent = build_agent("infmem", cfg, tokenizer)
    script = Script([tool_call("retrieve", query="world century music language people known", top_k=8)] * 40)
    traj = run(agent, ScriptedPolicy(tokenizer, script), "Who?", document)
    prepared = asyncio.run(agent.cache.get(document))
    checked = 0
    for turn in traj.turns:
        if turn.kind == "prethink" and turn.retrieved_units:
            chunks = prepared.document.unit_chunk[turn.retrieved_units]
            if scope == "read_prefix":
                assert (chunks <= turn.chunk_index).all()
            if exclude:
                assert (chunks != turn.chunk_index).all()
            checked += 1
    assert checked >= 2


def test_end_to_end_with_tiny_model(tokenizer, tiny_model_dir, document):
    from infmem_verl.policy.transformers import TransformersPolicy

    cfg = small_cfg(
        prethink={"thinking_tokens": 8, "output_tokens": 8},
        write={"thinking_tokens": 8, "output_tokens": 16},
        answer={"thinking_tokens": 8, "output_tokens": 8},
        memory_tokens=16,
    )
    text = "\n\n".join(document.split("\n\n")[:5])
    policy = TransformersPolicy.from_pretrained(tiny_model_dir, seed=0)

    async def both():
        agents = [build_agent(name, cfg, tokenizer) for name in ("infmem", "memagent")]
        return await asyncio.gather(*(a.run(policy, "Who wrote it?", text) for a in agents))

    infmem, memagent = asyncio.run(both())
    for traj in (infmem, memagent):
        assert traj.turns[-1].kind == "answer"
        for turn in traj.turns:
            assert turn.response_ids.shape == turn.response_mask.shape == turn.log_probs.shape
            assert turn.generated_tokens == int(turn.response_mask.sum()) > 0
            assert np.all(turn.log_probs[turn.response_mask == 1] <= 0)
    assert memagent.chunks_read == memagent.num_chunks
    assert infmem.summary().llm_calls >= len(infmem.turns)


@pytest.mark.parametrize("model", ["minilm", "static"])
def test_rollouts_of_a_document_share_one_embedding_pass(tokenizer, document, model):
    """n concurrent rollouts of one document: one preparation, and the dense stage embeds once
    for all of them: MiniLM the candidates of their (identical) query, in one batch; the static
    embedder every unit of the document."""
    # MiniLM eager: compiling it (test_retrieval.py checks that path) would add ~25 s here.
    retrieval = {"rerank": True, "rerank_model": model, "rerank_candidates": 4, "rerank_compile": False}
    agent = build_agent("infmem", small_cfg(retrieval=retrieval), tokenizer)
    query = tool_call("retrieve", query="classical music of the twentieth century", top_k=2)

    async def rollouts():
        policies = [ScriptedPolicy(tokenizer, Script([query, tool_call("stop")])) for _ in range(4)]
        return await asyncio.gather(*(agent.run(p, "Who?", document) for p in policies))

    trajectories = asyncio.run(rollouts())
    prepared = asyncio.run(agent.cache.get(document))
    embeddings = prepared.index.embeddings
    pool = prepared.index.search("classical music of the twentieth century", top_k=4)
    assert agent.cache.builds == 1
    embedded = len(pool) if model == "minilm" else prepared.index.num_units
    assert embeddings.passes == 1 and embeddings.num_embedded == embedded and len(pool) == 4
    retrieved = [t.turns[0].retrieved_units for t in trajectories]
    assert len(retrieved[0]) == 2 and all(r == retrieved[0] for r in retrieved)
    assert set(retrieved[0]) <= {h.unit for h in pool}
