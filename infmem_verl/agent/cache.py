"""Prepared documents (tokens, chunks, units, BM25 index), shared by the rollouts of a document.

GRPO runs n rollouts of every document at once; tokenizing and indexing a 1M-token document n
times would dominate the CPU cost of a step. The cache is keyed by the document's content hash
and the settings that shape the preparation, bounded in size (least recently used entries go),
and concurrent requests for the same document wait for a single build.

A preparation has two stages, and a rollout waits only for the first. The :class:`Document`
(tokens, chunks, units) is what the first LLM call needs; the BM25 index (most of the CPU: about
1.2 s of the 1.4 s at 1M tokens) is needed only by the first search. :meth:`DocumentCache.get`
therefore returns as soon as the document is ready and builds the index in a thread of its own
meanwhile; :meth:`PreparedDocument.ready_index` awaits it where a search needs it. With one
rollout per document (an evaluation) nothing else keeps the server busy while a document
prepares: the time before the first call was a quarter of the agent's wall time there, the index
most of it (docs/experiments/2026-12-03-rollout-and-retrieval.md). The index thread holds the GIL
most of the time (the analyzer is Python), so the event loop waits up to a switch interval (5 ms)
each time it takes the GIL back: at 1M tokens the first call went out 1-10 ms after the document
was ready, and the index built no slower beside the loop than alone.

Each build runs in a worker thread, and glibc serves each thread from an arena of its own that
keeps the pages freed by the build's temporaries (several times the text) mapped: every worker
thread that ever prepared a document would hold one build's peak. After each stage the free
pages are therefore handed back to the system (:func:`release_free_memory`, glibc only, best
effort).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import hashlib
import sys
import threading
from collections import OrderedDict
from dataclasses import astuple, dataclass
from typing import Callable

from .config import DocumentConfig, RetrievalConfig
from .document import Document, text_digest
from .retrieval import BM25Index


@dataclass
class PreparedDocument:
    """A document ready to read, and its BM25 index: built, being built, or failed.

    ``pending`` is a :class:`concurrent.futures.Future`, not an asyncio one: the index thread
    belongs to no event loop, so the index serves rollouts on any loop (a process may run one
    ``asyncio.run`` after another over one cache). None for agents that never retrieve (MemAgent).
    """

    document: Document
    pending: concurrent.futures.Future[BM25Index] | None = None

    @classmethod
    def built(cls, document: Document, index: BM25Index | None) -> "PreparedDocument":
        """A preparation whose index (if any) is already there."""
        if index is None:
            return cls(document)
        pending: concurrent.futures.Future[BM25Index] = concurrent.futures.Future()
        pending.set_result(index)
        return cls(document, pending)

    async def ready_index(self) -> BM25Index:
        """The index, once built; raises the build's error if it failed.

        Shielded: a rollout cancelled while it waits leaves the build (shared by the other
        rollouts of the document) alone. A built index costs no await.
        """
        if self.pending is None:
            raise ValueError("with_index: this document was prepared without an index (with_index=False)")
        if self.pending.done():
            return self.pending.result()
        return await asyncio.shield(asyncio.wrap_future(self.pending))

    @property
    def index(self) -> BM25Index | None:
        """The index for synchronous callers (tests, benchmarks), blocking until it is built.

        On an event loop, await :meth:`ready_index` instead: blocking there would stall every
        rollout on the loop, so an index still building raises RuntimeError there.
        """
        if self.pending is None:
            return None
        if not self.pending.done() and _on_event_loop():
            raise RuntimeError("PreparedDocument.index: the index is still building; await ready_index() on an event loop")
        return self.pending.result()

    @property
    def index_failed(self) -> bool:
        return self.pending is not None and self.pending.done() and self.pending.exception() is not None


class DocumentCache:
    """Bounded, asyncio-safe cache of :class:`PreparedDocument` keyed by content hash."""

    def __init__(self, tokenizer, doc_cfg: DocumentConfig, retrieval_cfg: RetrievalConfig, size: int = 16):
        self.tokenizer = tokenizer
        self.doc_cfg = doc_cfg
        self.retrieval_cfg = retrieval_cfg
        self.size = size
        self._entries: OrderedDict[str, asyncio.Future] = OrderedDict()
        self.builds = 0  # how many preparations actually ran (benchmarks and tests read it)

    def key(self, text: str, with_index: bool) -> str:
        """The text's content hash (:func:`~.document.text_digest`, as ``Document.content_hash``)
        and a short hash of the settings that shape the preparation."""
        settings = repr((astuple(self.doc_cfg), astuple(self.retrieval_cfg) if with_index else None))
        return f"{text_digest(text)}:{hashlib.sha1(settings.encode()).hexdigest()[:12]}"

    def prepare_document(self, text: str) -> Document:
        """The first stage: tokens, chunks and units (synchronous; a worker thread via :meth:`get`)."""
        document = Document.from_text(text, self.tokenizer, self.doc_cfg)
        self.builds += 1
        # The tokenizer's own threads freed its encodings into their arenas, where the index
        # build (another thread) cannot reuse them: hand them back before it starts.
        release_free_memory()
        return document

    def build_index(self, document: Document) -> BM25Index:
        """The second stage: the BM25 index of the document's units (synchronous)."""
        index = BM25Index.of_document(document, self.retrieval_cfg)
        release_free_memory()
        return index

    def prepare(self, text: str, with_index: bool) -> PreparedDocument:
        """Both stages, one after the other, without caching (synchronous)."""
        document = self.prepare_document(text)
        return PreparedDocument.built(document, self.build_index(document) if with_index else None)

    async def get(self, text: str, with_index: bool = True) -> PreparedDocument:
        """The prepared document, as soon as its :class:`Document` is ready (the index may still
        be building: :meth:`PreparedDocument.ready_index`)."""
        key = self.key(text, with_index)
        loop = asyncio.get_running_loop()
        future = self._entries.get(key)
        if future is not None and future.done() and not future.result().index_failed:
            self._entries.move_to_end(key)
            return future.result()
        if future is not None and not future.done() and future.get_loop() is loop:
            self._entries.move_to_end(key)
            return await asyncio.shield(future)
        # A miss, an index that failed (its waiters got the error; build again), or a document
        # still pending on another (finished) event loop: build here.
        future = loop.create_future()
        self._entries[key] = future
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        try:
            document = await asyncio.to_thread(self.prepare_document, text)
        except BaseException as exc:
            # A failed build must not poison the cache: waiters get the error, later calls retry.
            self._entries.pop(key, None)
            future.set_exception(exc)
            future.exception()  # mark retrieved so asyncio does not log it when nobody waits
            raise
        prepared = PreparedDocument(document, self._start_index(document) if with_index else None)
        future.set_result(prepared)
        return prepared

    def _start_index(self, document: Document) -> concurrent.futures.Future[BM25Index]:
        """Build the index in a thread of its own (not the loop's executor: it outlives the loop
        that started it, and every loop awaits the same future)."""
        pending: concurrent.futures.Future[BM25Index] = concurrent.futures.Future()

        def build() -> None:
            try:
                pending.set_result(self.build_index(document))
            except BaseException as exc:  # surfaces to every waiter; get() builds again
                pending.set_exception(exc)

        pending.set_running_or_notify_cancel()  # running from now on: nothing can cancel it
        threading.Thread(target=build, name="infmem-bm25-index").start()
        return pending


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def release_free_memory() -> bool:
    """Hand the C allocator's free pages back to the system; False where that is not possible.

    glibc's ``malloc_trim(0)`` releases the free memory of every arena, the calling thread's
    included. Elsewhere (macOS, musl) there is nothing to call and nothing happens.
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` from the running process, or None without glibc."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # no symbol table to open, or a libc without malloc_trim
        return None
