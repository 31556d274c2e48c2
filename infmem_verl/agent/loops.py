"""The two agents: InfMem (PreThink -> Retrieve -> Write per chunk, Stop, Answer) and MemAgent
(Write per chunk, Answer), as async code over a :class:`Policy`.

Both share the reader: the document is prepared once (shared through :class:`DocumentCache`),
read chunk by chunk into a bounded memory, and answered from the memory alone. No model output
makes a loop raise: malformed outputs become flagged turns with a configured fallback.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from .cache import DocumentCache, PreparedDocument
from .config import AgentConfig
from .memory import Memory, update_memory
from .policy import Policy
from .protocol import HistoryEntry, PromptBuilder, ThinkSplit, decide_action, parse_answer
from .trajectory import FLAG_INVALID_ACTION, FLAG_NO_ANSWER, FLAG_TOPK_CLAMPED, Action, Trajectory, Turn
from .turns import TurnRunner


class AgentLoop:
    """What both agents share: preparation, the Write turn and the Answer turn."""

    name: str
    uses_retrieval: bool

    def __init__(self, cfg: AgentConfig, tokenizer, cache: DocumentCache | None = None):
        self.cfg = cfg.validate()
        self.tokenizer = tokenizer
        self.builder = PromptBuilder(tokenizer, cfg)
        self.cache = cache or DocumentCache(tokenizer, cfg.document, cfg.retrieval, cfg.retrieval.cache_size)
        self.think_end_id = self.builder.think_end_id
        if cfg.thinking and self.think_end_id is None:
            raise ValueError("thinking: the tokenizer has no '</think>' token; set thinking=false for this model")

    def _question_ids(self, question: object) -> np.ndarray:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question: expected a non-empty string, got {question!r}")
        return self.builder.encode(question.strip())

    async def run(self, policy: Policy, question: str, document: str) -> Trajectory:
        started = time.perf_counter()
        question_ids = self._question_ids(question)
        if not isinstance(document, str) or not document.strip():
            raise ValueError("document: expected a non-empty string")
        prepared = await self.cache.get(document, with_index=self.uses_retrieval)
        runner = TurnRunner(policy, self.builder, self.cfg, self.think_end_id)
        turns: list[Turn] = []
        memory, stop_step = await self._read(runner, prepared, question, question_ids, turns)
        chunks_read = sum(1 for t in turns if t.kind == "write")
        answer_turn, prediction = await self._answer(runner, question_ids, memory, chunks_read)
        turns.append(answer_turn)
        return Trajectory(
            agent=self.name,  # type: ignore[arg-type]
            question=question,
            turns=turns,
            num_chunks=prepared.document.num_chunks,
            stop_step=stop_step,
            answer_text=answer_turn.text,
            prediction=prediction,
            rollout_s=time.perf_counter() - started,
        )

    async def _read(self, runner, prepared, question, question_ids, turns) -> tuple[Memory, int | None]:
        raise NotImplementedError

    async def _write(
        self,
        runner: TurnRunner,
        question_ids: np.ndarray,
        memory: Memory,
        prepared: PreparedDocument,
        chunk: int,
        evidence: list[np.ndarray] | None,
    ) -> tuple[Turn, Memory]:
        prompt = self.builder.write(question_ids, memory.ids, prepared.document.chunk_ids(chunk), evidence)
        result = await runner.call("write", self.cfg.write, prompt, chunk)
        update = update_memory(
            memory,
            result.split.output,
            result.split.closed,
            result.finished,
            self.cfg.memory_tokens,
            self.builder.encode,
            self.builder.decode,
        )
        turn = result.turn
        turn.valid = update.valid
        turn.flags.extend(update.flags)
        turn.reason = update.reason
        turn.memory_text = update.memory.text
        turn.memory_tokens = len(update.memory)
        return turn, update.memory

    async def _answer(self, runner: TurnRunner, question_ids: np.ndarray, memory: Memory, chunk: int) -> tuple[Turn, str | None]:
        prompt = self.builder.answer(question_ids, memory.ids)
        result = await runner.call("answer", self.cfg.answer, prompt, chunk)
        prediction = parse_answer(result.split.output, self.cfg.answer_format) if result.split.closed else None
        turn = result.turn
        turn.memory_tokens = len(memory)
        if prediction is None:
            turn.valid = False
            turn.flags.append(FLAG_NO_ANSWER)
            turn.reason = "no final answer found" if result.split.closed else "thinking never closed"
        return turn, prediction


class MemAgent(AgentLoop):
    """The MemAgent baseline: overwrite the memory after every chunk, then answer."""

    name = "memagent"
    uses_retrieval = False

    async def _read(self, runner, prepared, question, question_ids, turns):
        memory = Memory.empty()
        for chunk in range(prepared.document.num_chunks):
            turn, memory = await self._write(runner, question_ids, memory, prepared, chunk, None)
            turns.append(turn)
        return memory, None


class InfMemAgent(AgentLoop):
    """InfMem: before each chunk a controller retrieves evidence or stops reading."""

    name = "infmem"
    uses_retrieval = True

    def _allowed_units(self, prepared: PreparedDocument, chunk: int) -> np.ndarray:
        unit_chunk = prepared.document.unit_chunk
        retrieval = self.cfg.retrieval
        allowed = unit_chunk <= chunk if retrieval.scope == "read_prefix" else np.ones(unit_chunk.shape[0], dtype=bool)
        if retrieval.exclude_current_chunk:
            allowed &= unit_chunk != chunk
        return allowed

    def _decide(self, split: ThinkSplit, question: str) -> Action:
        retrieval = self.cfg.retrieval
        action = decide_action(split, self.cfg)
        if not action.valid and self.cfg.invalid_action == "retrieve_question":
            return Action("retrieve", query=question, top_k=retrieval.top_k_default, valid=False, reason=action.reason)
        return action

    async def _read(self, runner, prepared, question, question_ids, turns):
        memory = Memory.empty()
        history: list[HistoryEntry] = []
        num_chunks = prepared.document.num_chunks
        votes = 0
        for chunk in range(num_chunks):
            prompt = self.builder.prethink(question_ids, memory.ids, history, chunk, num_chunks)
            result = await runner.call("prethink", self.cfg.prethink, prompt, chunk)
            action = self._decide(result.split, question)
            turn = result.turn
            turn.action = action
            turn.valid = action.valid
            turn.reason = action.reason
            turn.memory_tokens = len(memory)
            if not action.valid:
                turn.flags.append(FLAG_INVALID_ACTION)
            if action.clamped:
                turn.flags.append(FLAG_TOPK_CLAMPED)
            turns.append(turn)
            if action.kind == "stop":
                votes = 1 if action.restarts_votes else votes + 1
                if votes >= self.cfg.stop_votes:
                    return memory, chunk
            else:
                votes = 0
            evidence: list[np.ndarray] = []
            if action.kind == "retrieve":
                started = time.perf_counter()
                # The index builds behind the first calls (DocumentCache.get): wait here if it must.
                index, allowed = await prepared.ready_index(), self._allowed_units(prepared, chunk)
                if index.rerank:
                    # In a worker thread: the dense stage may embed candidates for seconds, and the
                    # other rollouts on this event loop must not wait for it.
                    hits = await asyncio.to_thread(index.search, action.query, action.top_k, allowed)
                else:
                    # BM25 alone takes 0.2-5 ms (32K-1M tokens): less than the hop to a worker
                    # thread and back costs on busy cores, which delays this rollout's next call.
                    hits = index.search(action.query, action.top_k, allowed)
                turn.retrieval_s = time.perf_counter() - started
                turn.retrieved_units = [hit.unit for hit in hits]
                evidence = [prepared.document.unit_ids(hit.unit) for hit in hits]
                history.append(HistoryEntry(query=action.query, top_k=action.top_k))
            write_turn, memory = await self._write(runner, question_ids, memory, prepared, chunk, evidence)
            write_turn.retrieved_units = list(turn.retrieved_units)
            turns.append(write_turn)
        return memory, None


AGENTS: dict[str, type[AgentLoop]] = {"infmem": InfMemAgent, "memagent": MemAgent}


def build_agent(name: str, cfg: AgentConfig, tokenizer, cache: DocumentCache | None = None) -> AgentLoop:
    """The agent called ``name`` (``"infmem"`` or ``"memagent"``)."""
    if name not in AGENTS:
        raise ValueError(f"agent: unknown agent {name!r}; available: {sorted(AGENTS)}")
    return AGENTS[name](cfg, tokenizer, cache)
