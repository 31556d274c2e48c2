"""A tokenized document: reading chunks and the retrieval units cut inside them.

The agent reads a document as consecutive, non-overlapping windows of ``chunk_tokens`` tokens
(spec 1.1) and retrieves over units of ``unit_tokens`` tokens cut *inside* each chunk (spec 2.4),
so every unit belongs to exactly one chunk and "units of chunks read so far" is a simple mask.

Tokenization is the dominant CPU cost for 1M-token documents, so the text is cut into pieces at
positions where Qwen's byte-level BPE pre-tokenizer splits anyway and the pieces are encoded as
one batch: the Rust tokenizer encodes a batch on all cores and the ids are identical to encoding
the whole text at once. The cut points also give the token start of every paragraph for free.

Memory matters as much as speed: training keeps many 1M-token documents in flight at once.
Pieces are therefore encoded in bounded batches whose ids become int32 arrays at once (a
tokenizer ``Encoding`` holds each token's string too, tens of bytes per token), and unit texts
are decoded on demand (:class:`UnitTexts`) instead of being kept beside the ids.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np

from .config import DocumentConfig

# Split regexes of byte-level BPE pre-tokenizers whose whitespace alternatives are
# ``\s*[\r\n]+|\s+(?!\S)|\s+`` and whose other alternatives contain a space only as their first
# character (Qwen2/2.5/3; Llama 3 differs only in ``\p{N}{1,3}``). For these, three kinds of
# positions always separate pre-tokens:
#   * right after the last line break of a whitespace run (no pre-token continues past a line
#     break into non-line-break characters of the same run, nor into a non-space character);
#   * right before a space that is followed by an ASCII letter (the space can only start the
#     pre-token `` word``; every alternative that could end with it needs a space after it);
#   * right before a line break that follows a letter or digit (a pre-token ending in a letter
#     or digit is a letter, digit or contraction run, none of which takes a line break, and a
#     whitespace pre-token starts at the first whitespace character). The document uses the
#     first two; the prompt builder's search-history lines the third.
# NFC (their normalizer) never composes across any of them: line breaks and spaces are
# starters that compose with nothing.
_SPLIT_SAFE_PATTERNS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)

# Python's ``\s`` is a superset of the Unicode White_Space class the tokenizer's regex uses
# (it adds U+001C..U+001F), so a run that Python sees as "whitespace without a further line
# break" is never one the tokenizer would continue: the cut positions below stay safe.
_SAFE_CUT = re.compile(r"(?<=[\r\n])(?![^\S\r\n]*[\r\n])|(?= [A-Za-z])")
# A blank line: two or more line breaks with only whitespace between them. The match ends right
# after the last line break of its whitespace run, which is where the next paragraph starts.
_LINE_BREAK = r"(?:\r\n?|\n)"
_PARAGRAPH_BREAK = re.compile(rf"{_LINE_BREAK}(?:[^\S\r\n]*{_LINE_BREAK})+")

# Target piece length for batch encoding: long enough that per-piece overhead is negligible,
# short enough that a single-paragraph document still spreads over all cores.
_PIECE_CHARS = 16_384
# Characters encoded per batch of pieces: enough pieces to keep every core busy, few enough that
# the batch's ``Encoding`` objects (far larger than the ids) stay small next to the text.
_BATCH_CHARS = 1 << 18
# Characters of text hashed per step, so hashing never holds a UTF-8 copy of the whole text.
_HASH_CHARS = 1 << 18
# Words a byte-level BPE model keeps merged in its word cache. tokenizers' default (10,000)
# fills on the first long document to 5.5-6.6 MiB and never lets go (it stops inserting when
# full): 1.3-1.5x the text of a 1M-token document, all of it in the first sample's peak memory.
# Emptied and bounded to this before each document: 0.7-0.8 MiB, for 5-14% more tokenization
# CPU (measured on a 1M-token document, docs/experiments/2026-12-04-retrieval-cost.md).
BPE_CACHE_WORDS = 1000
# Units decoded per batch when unit texts are iterated. The decoder takes lists of Python ints
# (32 bytes per token), so a batch of 64 500-token units costs about 1 MiB while it is decoded.
_DECODE_UNITS = 64
# A paragraph's heading is read from its first this many tokens, and holds at most this many words.
_HEADING_TOKENS = 48
HEADING_WORDS = 16


def text_digest(text: str) -> str:
    """SHA-256 hex digest of ``text`` as UTF-8 (lone surrogates passed through), hashed in slices.

    The one content hash of a text: :class:`Document` records it and the document cache keys by
    it. Slicing gives the digest of the whole encoding: with ``surrogatepass`` every code point
    encodes on its own, so no byte sequence spans two slices.
    """
    digest = hashlib.sha256()
    for start in range(0, len(text), _HASH_CHARS):
        digest.update(text[start : start + _HASH_CHARS].encode("utf-8", errors="surrogatepass"))
    return digest.hexdigest()


def tokenize_document(text: str, tokenizer) -> np.ndarray:
    """Token ids (int32, no special tokens) of ``text``, identical to ``tokenizer(text)``.

    Encodes split-safe pieces of the text as one parallel batch when the tokenizer's
    pre-tokenizer allows it, the whole text at once otherwise.
    """
    return tokenize_paragraphs(text, tokenizer)[0]


def tokenize_paragraphs(text: str, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``text`` (as :func:`tokenize_document`) and the token index where each of its
    paragraphs starts (``Document.from_ids``'s ``paragraph_starts``)."""
    if not isinstance(text, str):
        raise ValueError(f"text: expected a str, got {type(text).__name__}")
    paragraph_chars = [m.end() for m in _PARAGRAPH_BREAK.finditer(text) if m.end() < len(text)]
    if split_safe(tokenizer):
        return _tokenize_pieces(text, _backend(tokenizer), paragraph_chars)
    return _tokenize_whole(text, tokenizer, paragraph_chars)


def split_safe(tokenizer) -> bool:
    """Whether ``tokenizer`` encodes text cut at line breaks piece by piece to the ids of the whole.

    True for the byte-level BPE tokenizers this module recognises (Qwen2/2.5/3, Llama 3), for
    cuts right after the last line break of a whitespace run and right before a line break that
    follows a letter or digit: no pre-token spans either position (see
    :data:`_SPLIT_SAFE_PATTERNS`).
    """
    backend = _backend(tokenizer)
    return backend is not None and _split_safe(backend)


def _backend(tokenizer) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind a fast tokenizer, configured like ``tokenizer()``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    # transformers sets this flag on every call from ``split_special_tokens``; mirror it so a
    # direct backend call treats special-token strings in the text exactly as ``tokenizer()``.
    split_special = bool(getattr(tokenizer, "split_special_tokens", False))
    if backend.encode_special_tokens != split_special:
        backend.encode_special_tokens = split_special
    return backend


def _split_safe(backend) -> bool:
    """Whether cutting at :data:`_SAFE_CUT` positions leaves this tokenizer's output unchanged."""
    normalizer = json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None
    if normalizer is not None and normalizer.get("type") != "NFC":
        return False
    pre = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else {}
    steps = pre.get("pretokenizers", [])
    if pre.get("type") != "Sequence" or len(steps) != 2:
        return False
    split, byte_level = steps
    if split.get("type") != "Split" or split.get("pattern", {}).get("Regex") not in _SPLIT_SAFE_PATTERNS:
        return False
    if byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True):
        return False
    # Added tokens are matched on the raw text before pre-tokenization; one holding whitespace
    # or stripping it from its neighbours could straddle a cut.
    return not any(
        tok.lstrip or tok.rstrip or any(ch.isspace() for ch in tok.content)
        for tok in backend.get_added_tokens_decoder().values()
    )


def _piece_starts(text: str, paragraph_chars: Sequence[int]) -> list[int]:
    """Char offsets where pieces start: every paragraph start, plus safe cuts in long paragraphs."""
    starts: list[int] = []
    edges = [0, *paragraph_chars, len(text)]
    for seg_start, seg_end in zip(edges[:-1], edges[1:]):
        starts.append(seg_start)
        pos = seg_start + _PIECE_CHARS
        while pos < seg_end:
            cut = _SAFE_CUT.search(text, pos, seg_end)
            if cut is None or cut.start() >= seg_end:  # a cut at the segment end adds no piece
                break
            starts.append(cut.start())
            pos = cut.start() + _PIECE_CHARS
    return starts


def _tokenize_pieces(text: str, backend, paragraph_chars: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    starts = _piece_starts(text, paragraph_chars)
    ends = [*starts[1:], len(text)]
    # ``encode_batch_fast`` skips offset tracking (about twice as fast); older tokenizers lack it.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    model = backend.model
    if hasattr(model, "_resize_cache") and hasattr(model, "_clear_cache"):  # tokenizers >= 0.21
        model._resize_cache(BPE_CACHE_WORDS)  # a smaller capacity keeps the entries already there
        model._clear_cache()
    # The ids go into one growing buffer as each piece is encoded, not into an array per piece
    # joined at the end: that held every id twice at the end of tokenization, and the pieces'
    # arrays, interleaved in the heap with the tokenizer's word cache, left ~4 MiB of pages
    # that malloc_trim could not hand back after a first 1M-token document.
    buffer, lengths = array.array("i"), array.array("q")
    first = 0
    while first < len(starts):
        # Pieces starting within _BATCH_CHARS of this batch's first piece (at least one piece).
        stop = max(first + 1, bisect.bisect_left(starts, starts[first] + _BATCH_CHARS, lo=first))
        pieces = [text[a:b] for a, b in zip(starts[first:stop], ends[first:stop])]
        for encoding in encode(pieces, add_special_tokens=False):
            piece_ids = encoding.ids
            lengths.append(len(piece_ids))
            buffer.extend(piece_ids)
        first = stop
    ids = np.frombuffer(buffer, dtype=np.int32) if len(buffer) else np.zeros(0, dtype=np.int32)
    lengths = np.frombuffer(lengths, dtype=np.int64)
    piece_token_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    is_paragraph = np.isin(np.asarray(starts, dtype=np.int64), np.asarray([0, *paragraph_chars], dtype=np.int64))
    return ids, _unique_starts(piece_token_starts[is_paragraph], len(ids))


def _tokenize_whole(text: str, tokenizer, paragraph_chars: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Fallback for tokenizers whose pre-tokenizer is unknown: one call, paragraphs via offsets."""
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoding["input_ids"], dtype=np.int32)
    token_char_starts = np.asarray([start for start, _ in encoding["offset_mapping"]], dtype=np.int64)
    # A paragraph starts at the first token that begins at or after its first character.
    para_tokens = np.searchsorted(token_char_starts, np.asarray(paragraph_chars, dtype=np.int64), side="left")
    return ids, _unique_starts(np.concatenate([[0], para_tokens]), len(ids))


def _unique_starts(starts: np.ndarray, num_tokens: int) -> np.ndarray:
    """Sorted distinct token starts inside the document (drops starts at or past its end)."""
    starts = np.unique(np.asarray(starts, dtype=np.int64))
    return starts[starts < num_tokens]


def _windows(start: int, end: int, size: int, overlap: int) -> np.ndarray:
    """Windows ``[k*stride, k*stride + size)`` over ``[start, end)``, the last one ending at ``end``.

    A tail shorter than ``overlap`` beyond the previous window is absorbed by extending that
    window, so no unit is a sliver that mostly repeats its neighbour. Returns [n, 2] int64.
    """
    length = end - start
    stride = size - overlap
    n = 1 if length <= size else 1 + -(-(length - size) // stride)
    starts = start + stride * np.arange(n, dtype=np.int64)
    ends = np.minimum(starts + size, end)
    if n >= 2 and end - (starts[-2] + size) < overlap:
        starts, ends = starts[:-1], ends[:-1]
        ends[-1] = end
    return np.stack([starts, ends], axis=1)


def _paragraph_windows(
    start: int, end: int, para_starts: np.ndarray, size: int, overlap: int, merge: bool = True
) -> np.ndarray:
    """Units over ``[start, end)`` aligned to paragraphs.

    With ``merge``, consecutive paragraphs are merged while the group stays within ``size``
    tokens; without, every paragraph is a unit of its own. A paragraph longer than ``size``
    becomes windows of its own (:func:`_windows`).
    """
    inner = para_starts[(para_starts > start) & (para_starts < end)]
    edges = [start, *inner.tolist(), end]
    if not merge:
        return np.concatenate([_windows(a, b, size, overlap) for a, b in zip(edges[:-1], edges[1:])])
    units: list[np.ndarray] = []
    group_start = group_end = None
    for p_start, p_end in zip(edges[:-1], edges[1:]):
        if group_start is not None and (p_end - p_start > size or p_end - group_start > size):
            units.append(np.array([[group_start, group_end]], dtype=np.int64))
            group_start = None
        if p_end - p_start > size:
            units.append(_windows(p_start, p_end, size, overlap))
            continue
        group_start = p_start if group_start is None else group_start
        group_end = p_end
    if group_start is not None:
        units.append(np.array([[group_start, group_end]], dtype=np.int64))
    return np.concatenate(units)


def _readonly(array: np.ndarray) -> np.ndarray:
    """Freeze an array so views handed out (``chunk_ids``) cannot corrupt a shared document."""
    array.flags.writeable = False
    return array


@dataclass(eq=False)
class Document:
    """Token ids of one document with its reading chunks and retrieval units.

    ``chunk_edges`` has ``num_chunks + 1`` entries: chunk ``i`` is tokens
    ``[chunk_edges[i], chunk_edges[i+1])``. ``unit_bounds[j]`` is unit ``j``'s token
    ``[start, end)`` and ``unit_chunk[j]`` the chunk holding it; units are ordered by position.
    """

    ids: np.ndarray
    chunk_edges: np.ndarray
    unit_bounds: np.ndarray
    unit_chunk: np.ndarray
    # Token index where each paragraph starts (always includes 0), or None when unknown.
    paragraph_starts: np.ndarray | None
    content_hash: str
    tokenizer: Any = field(repr=False)

    @classmethod
    def from_text(cls, text: str, tokenizer, cfg: DocumentConfig) -> "Document":
        """Tokenize ``text`` once and cut it; paragraphs are blank-line separated blocks."""
        if not isinstance(text, str) or not text.strip():
            got = repr(text[:40]) if isinstance(text, str) else type(text).__name__
            raise ValueError(f"document: expected a text with at least one non-whitespace character, got {got}")
        ids, paragraph_starts = tokenize_paragraphs(text, tokenizer)
        return cls._build(ids, tokenizer, cfg, paragraph_starts, text_digest(text))

    @classmethod
    def from_ids(
        cls,
        ids: Sequence[int] | np.ndarray,
        tokenizer,
        cfg: DocumentConfig,
        paragraph_starts: Sequence[int] | None = None,
    ) -> "Document":
        """Cut already tokenized ids (copied once, never aliased: the document freezes its ids).

        ``paragraph_starts`` (token indices) enables paragraph units; without it a config asking
        for them gets fixed windows, as a document of one paragraph would.
        """
        array = np.asarray(ids)
        if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(
                f"document: expected a non-empty 1-D sequence of integer token ids, got shape {array.shape} "
                f"dtype {array.dtype}"
            )
        if array.min() < 0 or array.max() > np.iinfo(np.int32).max:
            raise ValueError(f"document: expected token ids in [0, 2**31), got min {array.min()} max {array.max()}")
        array = np.array(array, dtype="<i4", order="C")  # the one copy
        starts = None if paragraph_starts is None else _checked_paragraph_starts(paragraph_starts, array.size)
        digest = hashlib.sha256(memoryview(array).cast("B")).hexdigest()
        return cls._build(array, tokenizer, cfg, starts, digest)

    @classmethod
    def _build(
        cls, ids: np.ndarray, tokenizer, cfg: DocumentConfig, paragraph_starts: np.ndarray | None, digest: str
    ) -> "Document":
        cfg.validate("document")
        n = int(ids.size)
        chunk_edges = np.append(np.arange(0, n, cfg.chunk_tokens, dtype=np.int64), n)
        use_paragraphs = cfg.paragraph_units and paragraph_starts is not None
        units = _paragraph_units if use_paragraphs else _fixed_units
        unit_bounds, unit_chunk = units(
            chunk_edges, cfg.unit_tokens, cfg.unit_overlap, paragraph_starts, merge=cfg.merge_paragraphs
        )
        return cls(
            ids=_readonly(ids),
            chunk_edges=_readonly(chunk_edges),
            unit_bounds=_readonly(unit_bounds),
            unit_chunk=_readonly(unit_chunk),
            paragraph_starts=None if paragraph_starts is None else _readonly(paragraph_starts),
            content_hash=digest,
            tokenizer=tokenizer,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.ids.size)

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_edges.size - 1)

    @property
    def num_units(self) -> int:
        return int(self.unit_bounds.shape[0])

    def chunk_bounds(self, i: int) -> tuple[int, int]:
        """Token ``(start, end)`` of chunk ``i``."""
        _check_index(i, self.num_chunks, "chunk")
        return int(self.chunk_edges[i]), int(self.chunk_edges[i + 1])

    def chunk_ids(self, i: int) -> np.ndarray:
        """Token ids of chunk ``i`` (a read-only view, no copy)."""
        start, end = self.chunk_bounds(i)
        return self.ids[start:end]

    def unit_ids(self, j: int) -> np.ndarray:
        """Token ids of retrieval unit ``j`` (a read-only view, no copy)."""
        _check_index(j, self.num_units, "unit")
        start, end = self.unit_bounds[j]
        return self.ids[start:end]

    def unit_texts(self) -> "UnitTexts":
        """The units' texts as a lazy sequence, decoded on access and never stored (see
        :class:`UnitTexts`): building the BM25 index reads each once, a reranker a few."""
        return UnitTexts(self)

    def unit_headings(self) -> list[str]:
        """Per unit, the heading of the paragraph it starts in (:func:`paragraph_heading`), ``""``
        where that paragraph has none or paragraphs are unknown.

        A unit cut from the middle of a long article, or from its part past a chunk boundary,
        holds none of the article's title; retrieval scores the title for it all the same
        (``retrieval.heading_weight``). Decoded from each paragraph's first tokens, not kept.
        """
        if self.paragraph_starts is None:
            return [""] * self.num_units
        starts = self.paragraph_starts
        ends = np.minimum(np.append(starts[1:], self.num_tokens), starts + _HEADING_TOKENS)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        decode = backend.decode_batch if backend is not None else self.tokenizer.batch_decode
        headings: list[str] = []
        # A batch of paragraphs at a time: the decoder takes lists of Python ints, and all of a
        # 1M-token document's paragraph heads at once (9,000 x 48 tokens) were 16 MiB of them,
        # the largest spike of a first sample's peak memory (3.7x its text).
        batch = _DECODE_UNITS * 8
        for first in range(0, len(starts), batch):
            seqs = [self.ids[a:b].tolist() for a, b in zip(starts[first : first + batch], ends[first : first + batch])]
            headings += [paragraph_heading(text) for text in decode(seqs, skip_special_tokens=False)]
        owner = np.searchsorted(starts, self.unit_bounds[:, 0], side="right") - 1
        return [headings[p] for p in owner]

    def units_mask(self, first_chunk: int, last_chunk: int) -> np.ndarray:
        """Boolean mask over units lying in chunks ``first_chunk..last_chunk`` (inclusive)."""
        _check_index(first_chunk, self.num_chunks, "first_chunk")
        _check_index(last_chunk, self.num_chunks, "last_chunk")
        if last_chunk < first_chunk:
            raise ValueError(f"last_chunk: expected >= first_chunk={first_chunk}, got {last_chunk}")
        return (self.unit_chunk >= first_chunk) & (self.unit_chunk <= last_chunk)


def paragraph_heading(text: str) -> str:
    """The heading of a paragraph: its leading short lines when more text follows, else ``""``.

    Lines are taken while the words taken stay within :data:`HEADING_WORDS`; a line ending in
    ``:`` is a label, not part of the heading. So the training documents' ``"Document 12:\\n
    Stanley Kubrick\\nStanley Kubrick was..."`` has the heading ``"Stanley Kubrick"`` (a number
    from the label would otherwise match years and counts in queries), a title line over an
    article's text is its heading, and a paragraph of one line, or starting with a sentence, has
    none. Only the last line may be cut short, so it is never taken.
    """
    lines = text.split("\n")[:-1]
    heading: list[str] = []
    words = 0
    for line in lines:
        line = line.strip()
        if line.endswith(":") and not heading:
            continue
        words += len(line.split())
        if not line or words > HEADING_WORDS:
            break
        heading.append(line)
    return " ".join(heading)


class UnitTexts(Sequence[str]):
    """Decoded texts of a document's retrieval units, decoded on every access, nothing kept.

    Kept texts would take about twice the ids' memory for as long as the document is cached,
    while only the BM25 build (one pass, :meth:`__iter__` decodes in batches) and an optional
    reranker (a few candidate units) read them. Indexing decodes one unit, a slice its units.
    """

    def __init__(self, document: Document) -> None:
        self._document = document

    def __len__(self) -> int:
        return self._document.num_units

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return self._decode(range(len(self))[index])
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"unit index: expected an integer or a slice, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"unit index: expected an index in [-{len(self)}, {len(self)}), got {index}")
        return self._decode([int(index) % len(self)])[0]

    def __iter__(self) -> Iterator[str]:
        for start in range(0, len(self), _DECODE_UNITS):
            yield from self._decode(range(start, min(start + _DECODE_UNITS, len(self))))

    def _decode(self, units: Sequence[int]) -> list[str]:
        """Texts of ``units``, decoded as one batch, special tokens kept (as ``tokenizer.decode``)."""
        doc = self._document
        seqs = [doc.ids[a:b].tolist() for a, b in doc.unit_bounds[list(units)]]
        backend = getattr(doc.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode_batch(seqs, skip_special_tokens=False)
        return doc.tokenizer.batch_decode(seqs, skip_special_tokens=False)


def _fixed_units(
    chunk_edges: np.ndarray,
    size: int,
    overlap: int,
    paragraph_starts: np.ndarray | None = None,
    merge: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Fixed windows in every chunk: ``(unit_bounds [n, 2], unit_chunk [n])``.

    Every full chunk has the same window pattern, so it is computed once and shifted; a
    1M-token document cut into tiny chunks costs no Python loop. ``paragraph_starts`` and
    ``merge`` are ignored.
    """
    starts, ends = chunk_edges[:-1], chunk_edges[1:]
    full_len = int(ends[0] - starts[0])
    num_full = int(np.count_nonzero(ends - starts == full_len))
    pattern = _windows(0, full_len, size, overlap)
    parts = [(pattern[None, :, :] + starts[:num_full, None, None]).reshape(-1, 2)]
    if num_full < len(starts):
        parts.append(_windows(int(starts[-1]), int(ends[-1]), size, overlap))
    counts = [len(pattern)] * num_full + [len(parts[-1])] * (len(starts) - num_full)
    return np.concatenate(parts), np.repeat(np.arange(len(starts), dtype=np.int64), counts)


def _paragraph_units(
    chunk_edges: np.ndarray, size: int, overlap: int, paragraph_starts: np.ndarray, merge: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Paragraph-aligned units in every chunk: ``(unit_bounds [n, 2], unit_chunk [n])``."""
    per_chunk = [
        _paragraph_windows(int(a), int(b), paragraph_starts, size, overlap, merge)
        for a, b in zip(chunk_edges[:-1], chunk_edges[1:])
    ]
    counts = [len(u) for u in per_chunk]
    return np.concatenate(per_chunk), np.repeat(np.arange(len(per_chunk), dtype=np.int64), counts)


def _checked_paragraph_starts(paragraph_starts: Sequence[int], num_tokens: int) -> np.ndarray:
    starts = np.asarray(paragraph_starts)
    if starts.ndim != 1 or (starts.size and not np.issubdtype(starts.dtype, np.integer)):
        raise ValueError(f"paragraph_starts: expected a 1-D sequence of token indices, got {paragraph_starts!r}")
    if starts.size and (starts.min() < 0 or starts.max() >= num_tokens):
        raise ValueError(
            f"paragraph_starts: expected token indices in [0, {num_tokens}), got min {starts.min()} max {starts.max()}"
        )
    return _unique_starts(np.append(starts, 0), num_tokens)


def _check_index(i: int, size: int, name: str) -> None:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < size:
        raise ValueError(f"{name}: expected an integer index in [0, {size}), got {i!r}")
