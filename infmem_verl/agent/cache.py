"""Prepared documents (tokens, chunks, units, BM25 index), shared by the rollouts of a document.

GRPO runs n rollouts of every document at once; tokenizing and indexing a 1M-token document n
times would dominate the CPU cost of a step. The cache is keyed by the document's content hash
and the settings that shape the preparation, bounded in size (least recently used entries go),
and concurrent requests for the same document wait for a single build.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import astuple, dataclass

from .config import DocumentConfig, RetrievalConfig
from .document import Document
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
        digest = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()
        settings = repr((astuple(self.doc_cfg), astuple(self.retrieval_cfg) if with_index else None))
        return f"{digest}:{hashlib.sha1(settings.encode()).hexdigest()[:12]}"

    def prepare(self, text: str, with_index: bool) -> PreparedDocument:
        """Build without caching (synchronous; runs in a worker thread when called via :meth:`get`)."""
        document = Document.from_text(text, self.tokenizer, self.doc_cfg)
        index = BM25Index.build(document.unit_texts(), self.retrieval_cfg) if with_index else None
        self.builds += 1
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
