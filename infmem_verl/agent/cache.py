"""Prepared documents (tokens, chunks, units, BM25 index), shared by the rollouts of a document.

GRPO runs n rollouts of every document at once; tokenizing and indexing a 1M-token document n
times would dominate the CPU cost of a step. The cache is keyed by the document's content hash
and the settings that shape the preparation, bounded in size (least recently used entries go),
and concurrent requests for the same document wait for a single build.

A build runs in a worker thread, and glibc serves each thread from an arena of its own that keeps
the pages freed by the build's temporaries (several times the text) mapped: every worker thread
that ever prepared a document would hold one build's peak. After each build the free pages are
therefore handed back to the system (:func:`release_free_memory`, glibc only, best effort).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import hashlib
import sys
from collections import OrderedDict
from dataclasses import astuple, dataclass
from typing import Callable

from .config import DocumentConfig, RetrievalConfig
from .document import Document, text_digest
from .retrieval import BM25Index


@dataclass
class PreparedDocument:
    document: Document
    index: BM25Index | None  # None for agents that never retrieve (MemAgent)


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

    def prepare(self, text: str, with_index: bool) -> PreparedDocument:
        """Build without caching (synchronous; runs in a worker thread when called via :meth:`get`)."""
        document = Document.from_text(text, self.tokenizer, self.doc_cfg)
        # The tokenizer's own threads freed its encodings into their arenas, where the index
        # build (on this thread) cannot reuse them: hand them back before building.
        release_free_memory()
        index = BM25Index.of_document(document, self.retrieval_cfg) if with_index else None
        self.builds += 1
        release_free_memory()
        return PreparedDocument(document, index)

    async def get(self, text: str, with_index: bool = True) -> PreparedDocument:
        key = self.key(text, with_index)
        loop = asyncio.get_running_loop()
        future = self._entries.get(key)
        if future is not None and future.done():
            self._entries.move_to_end(key)
            return future.result()
        if future is not None and future.get_loop() is loop:
            self._entries.move_to_end(key)
            return await asyncio.shield(future)
        # A miss, or a build still pending on another (finished) event loop: build here.
        future = loop.create_future()
        self._entries[key] = future
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        try:
            prepared = await asyncio.to_thread(self.prepare, text, with_index)
        except BaseException as exc:
            # A failed build must not poison the cache: waiters get the error, later calls retry.
            self._entries.pop(key, None)
            future.set_exception(exc)
            future.exception()  # mark retrieved so asyncio does not log it when nobody waits
            raise
        future.set_result(prepared)
        return prepared


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
