"""Document tokenization, reading chunks and retrieval units, on the real Qwen3 tokenizer."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random

import numpy as np
import pytest
from tokenizers import pre_tokenizers

from infmem_verl.agent import document as document_module
from infmem_verl.agent.config import DocumentConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.document import Document, UnitTexts, paragraph_heading, split_safe, text_digest, tokenize_document
from infmem_verl.assets import wiki_paragraphs


def _render(paragraphs) -> list[str]:
    return [f"{p['title']}\n{p['text']}" for p in paragraphs]


@pytest.fixture(scope="module")
def wiki_text() -> str:
    """~40k tokens of real Wikipedia paragraphs, blank-line separated."""
    return "\n\n".join(_render(wiki_paragraphs()[:300]))


def _reference_ids(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def _hostile_fuzz(seed: int, length: int) -> str:
    """Random text from fragments that stress the pre-tokenizer's whitespace and letter rules."""
    fragments = [
        "\n", "\n\n", "\r\n", "\r", " ", "  ", "\t", " \n", "\n ", "\u00a0", "\u2028", "\u3000", "\x1c",
        "a", "The", " word", "'s", "'LL", "123", "4", ".", "!?", "...", "(", ")", "--", "\u0301", "e\u0301",
        "\u00e9", "\u65e5\u672c\u8a9e", "\u0645\u0631\u062d\u0628\u0627", "\U0001f600", "\u200d", "<|im_end|>",
        "<think>", "\ufeff", "\u180e", "Zo\u0308e",
    ]
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < length:
        out.append(rng.choice(fragments))
        size += len(out[-1])
    return "".join(out)


def test_qwen_tokenizer_takes_the_parallel_split_path(tokenizer):
    # Otherwise every equality test below would pass through the trivial single-call fallback.
    assert document_module._split_safe(document_module._backend(tokenizer))
    assert split_safe(tokenizer)


def test_tokenization_identical_on_wikipedia_text(tokenizer, wiki_text):
    ids = tokenize_document(wiki_text, tokenizer)
    assert ids.dtype == np.int32
    assert ids.size > 30_000
    np.testing.assert_array_equal(ids, _reference_ids(tokenizer, wiki_text))


@pytest.mark.parametrize(
    "name",
    ["no_newlines", "only_newlines", "crlf", "unicode", "padded", "special_strings"],
)
def test_tokenization_identical_on_hostile_text(tokenizer, wiki_text, name, monkeypatch):
    # Small pieces put a cut every few dozen characters, so every cut rule is exercised often.
    monkeypatch.setattr(document_module, "_PIECE_CHARS", 48)
    body = wiki_text[:20_000]
    texts = {
        "no_newlines": body.replace("\n", " "),
        "only_newlines": "\n" * 5000,
        "crlf": body.replace("\n", "\r\n") + "\r\n\r\n  \r\n",
        # Decomposed accents (NFC composes them), combining marks right after cuts, CJK.
        "unicode": body.replace("e", "e\u0301").replace(" a", " \u00e4\u0308").replace("\n", "\n\u0301")
        + " \u65e5\u672c" * 500,
        "padded": "   \n \n  " + body.replace("\n\n", " \n \t\n  ") + "  \n\n   ",
        "special_strings": body.replace("\n\n", "\n<|im_end|>\n\n<think>") + "<|endoftext|>",
    }
    text = texts[name]
    np.testing.assert_array_equal(tokenize_document(text, tokenizer), _reference_ids(tokenizer, text))


@pytest.mark.parametrize("seed", range(4))
def test_tokenization_identical_on_random_hostile_text(tokenizer, seed, monkeypatch):
    # A piece size of 1 cuts at every safe position the rules allow.
    monkeypatch.setattr(document_module, "_PIECE_CHARS", [1, 7, 48, 4096][seed])
    text = _hostile_fuzz(seed=seed, length=20_000)
    np.testing.assert_array_equal(tokenize_document(text, tokenizer), _reference_ids(tokenizer, text))


@pytest.mark.parametrize("batch_chars", [1, 3000, 50_000])
def test_tokenization_identical_across_encode_batches(tokenizer, wiki_text, batch_chars, monkeypatch):
    # Pieces are encoded in batches of about _BATCH_CHARS characters: ids and paragraph starts
    # must not depend on where one batch ends (1: every piece its own batch).
    monkeypatch.setattr(document_module, "_PIECE_CHARS", 2000)
    text = wiki_text[:120_000]
    whole = Document.from_text(text, tokenizer, DocumentConfig(paragraph_units=True))
    monkeypatch.setattr(document_module, "_BATCH_CHARS", batch_chars)
    batched = Document.from_text(text, tokenizer, DocumentConfig(paragraph_units=True))
    np.testing.assert_array_equal(batched.ids, _reference_ids(tokenizer, text))
    np.testing.assert_array_equal(batched.paragraph_starts, whole.paragraph_starts)
    assert batched.paragraph_starts.size == text.count("\n\n") + 1


def test_unknown_pre_tokenizer_falls_back_to_one_call(tokenizer, wiki_text):
    # A real tokenizer with a different (GPT-2 style) pre-tokenizer: cut rules are not proven
    # for it, so the whole text must be encoded at once, and paragraphs still found.
    other = copy.deepcopy(tokenizer)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    assert not document_module._split_safe(document_module._backend(other))
    assert not split_safe(other)
    text = wiki_text[:8000]
    doc = Document.from_text(text, other, DocumentConfig(paragraph_units=True))
    np.testing.assert_array_equal(doc.ids, _reference_ids(other, text))
    assert doc.paragraph_starts.size == text.count("\n\n") + 1


def _check_chunks(doc: Document, cfg: DocumentConfig) -> None:
    edges = doc.chunk_edges
    assert edges[0] == 0 and edges[-1] == doc.num_tokens
    sizes = np.diff(edges)
    assert (sizes[:-1] == cfg.chunk_tokens).all() and 0 < sizes[-1] <= cfg.chunk_tokens
    covered = np.zeros(doc.num_tokens, dtype=np.int64)
    for i in range(doc.num_chunks):
        start, end = doc.chunk_bounds(i)
        covered[start:end] += 1
        assert doc.chunk_ids(i).size == end - start
    assert (covered == 1).all()


def _check_units(doc: Document) -> None:
    """Each unit lies in one chunk, units are ordered and cover each chunk without gaps."""
    bounds, unit_chunk = doc.unit_bounds, doc.unit_chunk
    assert (bounds[:, 1] > bounds[:, 0]).all()
    assert (np.diff(unit_chunk) >= 0).all()
    for i in range(doc.num_chunks):
        start, end = doc.chunk_bounds(i)
        mine = bounds[unit_chunk == i]
        assert mine.size, f"chunk {i} has no unit"
        assert mine[0, 0] == start and mine[-1, 1] == end
        assert (mine[:, 0] >= start).all() and (mine[:, 1] <= end).all()
        assert (mine[1:, 0] <= mine[:-1, 1]).all(), "gap between consecutive units"
        assert (np.diff(mine[:, 0]) > 0).all()


@pytest.mark.parametrize("num_tokens", [1, 15, 37, 499, 500, 951, 5000, 5001, 12_345])
@pytest.mark.parametrize(
    "cfg",
    [
        DocumentConfig(),
        DocumentConfig(chunk_tokens=5000, unit_tokens=500, unit_overlap=0),
        DocumentConfig(chunk_tokens=37, unit_tokens=10, unit_overlap=3),
        DocumentConfig(chunk_tokens=16, unit_tokens=16, unit_overlap=15),
    ],
    ids=["default", "no_overlap", "tiny", "unit_is_chunk"],
)
def test_chunks_and_units_cover_every_token(tokenizer, num_tokens, cfg):
    ids = np.random.default_rng(num_tokens).integers(0, 150_000, size=num_tokens)
    doc = Document.from_ids(ids, tokenizer, cfg)
    assert doc.ids.dtype == np.int32 and doc.num_tokens == num_tokens
    assert doc.num_chunks == -(-num_tokens // cfg.chunk_tokens)
    _check_chunks(doc, cfg)
    _check_units(doc)
    stride = cfg.unit_tokens - cfg.unit_overlap
    for i in range(doc.num_chunks):
        start, _ = doc.chunk_bounds(i)
        mine = doc.unit_bounds[doc.unit_chunk == i]
        # Exact stride and overlap; only the last unit of a chunk may differ in length, and it
        # never exceeds a unit plus the overlap it absorbed.
        np.testing.assert_array_equal(mine[:, 0], start + stride * np.arange(len(mine)))
        assert (mine[:-1, 1] - mine[:-1, 0] == cfg.unit_tokens).all()
        assert mine[-1, 1] - mine[-1, 0] <= cfg.unit_tokens + max(cfg.unit_overlap - 1, 0)
        if len(mine) >= 2:
            assert mine[-1, 1] - mine[-2, 1] >= cfg.unit_overlap, "a tail shorter than the overlap was kept"


def test_unit_windows_and_tail_absorption_exact(tokenizer):
    cfg = DocumentConfig(chunk_tokens=1000, unit_tokens=500, unit_overlap=100)
    full = Document.from_ids(np.arange(1000), tokenizer, cfg)
    # The tail beyond [400, 900) is 100 tokens, not shorter than the overlap: it stays a unit.
    assert full.unit_bounds.tolist() == [[0, 500], [400, 900], [800, 1000]]
    absorbed = Document.from_ids(np.arange(1950), tokenizer, cfg)
    # Second chunk [1000, 1950): the 50-token tail beyond [1400, 1900) joins that unit.
    assert absorbed.unit_bounds.tolist() == [[0, 500], [400, 900], [800, 1000], [1000, 1500], [1400, 1950]]
    assert absorbed.unit_chunk.tolist() == [0, 0, 0, 1, 1]
    reference = Document.from_ids(np.arange(10_000), tokenizer, DocumentConfig(unit_tokens=500, unit_overlap=0))
    assert reference.num_units == 20  # the reference's ten 500-token units per 5000-token chunk


def test_views_masks_and_unit_texts(tokenizer, wiki_text):
    cfg = DocumentConfig(chunk_tokens=4000, unit_tokens=400, unit_overlap=50)
    doc = Document.from_text(wiki_text, tokenizer, cfg)
    _check_chunks(doc, cfg)
    _check_units(doc)
    chunk = doc.chunk_ids(2)
    assert np.shares_memory(chunk, doc.ids) and not chunk.flags.writeable
    with pytest.raises(ValueError):
        chunk[0] = 1
    mask = doc.units_mask(1, 3)
    assert mask.dtype == bool and mask.sum() == np.isin(doc.unit_chunk, [1, 2, 3]).sum()
    assert (doc.unit_bounds[mask, 0] >= doc.chunk_bounds(1)[0]).all()
    assert (doc.unit_bounds[mask, 1] <= doc.chunk_bounds(3)[1]).all()
    texts = doc.unit_texts()
    assert len(texts) == doc.num_units
    for j in (0, doc.num_units // 2, doc.num_units - 1):
        assert texts[j] == tokenizer.decode(doc.unit_ids(j).tolist())
    assert doc.content_hash == hashlib.sha256(wiki_text.encode("utf-8")).hexdigest()
    assert doc.content_hash == text_digest(wiki_text)
    same_ids = Document.from_ids(doc.ids, tokenizer, cfg)
    assert same_ids.content_hash == hashlib.sha256(doc.ids.astype("<i4").tobytes()).hexdigest()
    assert same_ids.content_hash != doc.content_hash


def test_unit_texts_are_decoded_on_demand(tokenizer, wiki_text):
    # Many more units than one decode batch, so iteration crosses batches.
    doc = Document.from_text(wiki_text, tokenizer, DocumentConfig(unit_tokens=60, unit_overlap=10))
    texts = doc.unit_texts()
    assert isinstance(texts, UnitTexts) and len(texts) == doc.num_units > 2 * document_module._DECODE_UNITS
    expected = [tokenizer.decode(doc.unit_ids(j).tolist()) for j in range(doc.num_units)]
    assert list(texts) == expected
    edges = (0, 63, 64, 65, 255, 256, doc.num_units - 1)
    assert [texts[j] for j in edges] == [expected[j] for j in edges]
    assert texts[-1] == expected[-1] and texts[np.int64(3)] == expected[3]
    assert texts[250:260] == expected[250:260] and texts[::97] == expected[::97] and texts[5:5] == []
    assert expected[300] in texts and texts.index(expected[300]) == expected.index(expected[300])
    # Nothing is kept: the document holds no decoded text.
    assert not any(isinstance(v, (list, tuple, UnitTexts)) for v in vars(doc).values())
    with pytest.raises(IndexError, match=f"unit index: expected an index in \\[-{doc.num_units}, {doc.num_units}\\)"):
        texts[doc.num_units]
    with pytest.raises(TypeError, match="unit index: expected an integer or a slice"):
        texts["0"]


def test_text_digest_hashes_the_whole_utf8_text(monkeypatch):
    # Slices of a few characters: multi-byte characters and a surrogate pair cut in half
    # (lone surrogates are passed through) must hash as the whole encoding does.
    text = "caf\u00e9 \u65e5\u672c \U0001f600 \ud83d\ude00 \udc80 end" * 3
    whole = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()
    for size in (1, 2, 3, 5, 1 << 18):
        monkeypatch.setattr(document_module, "_HASH_CHARS", size)
        assert text_digest(text) == whole
    assert text_digest("") == hashlib.sha256(b"").hexdigest()


def test_from_ids_copies_once_and_leaves_the_input_alone(tokenizer):
    ids = np.arange(1000, dtype=np.int32)
    doc = Document.from_ids(ids, tokenizer, DocumentConfig(chunk_tokens=400, unit_tokens=100, unit_overlap=10))
    assert ids.flags.writeable and not doc.ids.flags.writeable
    assert not np.shares_memory(ids, doc.ids) and doc.ids.dtype == np.int32
    ids[0] = 7  # the caller's array stays its own
    assert doc.ids[0] == 0
    big_endian = Document.from_ids(np.arange(1000, dtype=">i8"), tokenizer, DocumentConfig())
    np.testing.assert_array_equal(big_endian.ids, np.arange(1000))
    assert big_endian.content_hash == hashlib.sha256(np.arange(1000, dtype="<i4").tobytes()).hexdigest()


def test_paragraph_starts_are_exact(tokenizer):
    parts = _render([p for p in wiki_paragraphs()[:400] if "\n" not in p["text"]][:150])
    text = "\n\n".join(parts)
    doc = Document.from_text(text, tokenizer, DocumentConfig(paragraph_units=True))
    starts = doc.paragraph_starts
    assert starts.size == len(parts)
    ends = [*starts[1:].tolist(), doc.num_tokens]
    for i, (a, b) in enumerate(zip(starts.tolist(), ends)):
        expected = parts[i] + ("\n\n" if i + 1 < len(parts) else "")
        assert tokenizer.decode(doc.ids[a:b].tolist()) == expected


def test_paragraph_units_respect_paragraphs(tokenizer, wiki_text):
    cfg = DocumentConfig(chunk_tokens=1500, unit_tokens=200, unit_overlap=40, paragraph_units=True, merge_paragraphs=True)
    doc = Document.from_text(wiki_text, tokenizer, cfg)
    _check_chunks(doc, cfg)
    _check_units(doc)
    starts = set(doc.paragraph_starts.tolist())
    chunk_starts = set(doc.chunk_edges.tolist())
    boundaries = starts | chunk_starts
    long_windows = 0
    for (a, b), chunk in zip(doc.unit_bounds.tolist(), doc.unit_chunk.tolist()):
        inner = [p for p in starts if a < p < b]
        if inner:
            # Merged short paragraphs: whole paragraphs only, within the unit budget.
            assert a in boundaries and (b in boundaries or b == doc.num_tokens)
            assert b - a <= cfg.unit_tokens
        elif a not in boundaries:
            long_windows += 1  # a window inside a paragraph longer than a unit
            assert b - a < cfg.unit_tokens + cfg.unit_overlap
    assert long_windows > 0, "the test text should contain paragraphs longer than a unit"
    # Most paragraphs (~130 tokens) are too long to merge in pairs: they begin their own unit.
    assert len(set(doc.unit_bounds[:, 0].tolist()) & starts) > len(starts) // 2


def test_paragraph_units_from_ids(tokenizer):
    cfg = DocumentConfig(chunk_tokens=100, unit_tokens=30, unit_overlap=5, paragraph_units=True, merge_paragraphs=True)
    doc = Document.from_ids(np.arange(250), tokenizer, cfg, paragraph_starts=[10, 20, 90, 180])
    assert doc.paragraph_starts.tolist() == [0, 10, 20, 90, 180]
    # Chunk 0: [0,10)+[10,20) merge; [20,90) is long: windows 20,45 then the 15-token tail
    # is not shorter than the overlap; [90,100) alone. Chunk 2: [200,230) then tail [225,250).
    assert doc.unit_bounds.tolist() == [
        [0, 20], [20, 50], [45, 75], [70, 90], [90, 100],
        [100, 130], [125, 155], [150, 180], [180, 200],
        [200, 230], [225, 250],
    ]
    # Unmerged, the two short paragraphs of chunk 0 are units of their own; nothing else changes.
    unmerged = Document.from_ids(np.arange(250), tokenizer, dataclasses.replace(cfg, merge_paragraphs=False), [10, 20, 90, 180])
    assert unmerged.unit_bounds.tolist() == [[0, 10], [10, 20], *doc.unit_bounds.tolist()[1:]]


@pytest.mark.parametrize(
    "paragraph,heading",
    [
        ("Document 12:\nStanley Kubrick\nStanley Kubrick was an American film director.", "Stanley Kubrick"),
        ("Macau\nMacau is a special administrative region of China.", "Macau"),
        ("Macau is a special administrative region of China.", ""),  # one line: no heading
        ("Macau is a special administrative region of China, on the western side of the Pearl River Delta.\nMore.", ""),
        ("Part one\nChapter 3\nIt was a dark night.", "Part one Chapter 3"),
        ("Document 3:\nMacau", ""),  # the last line may be cut short: never taken
    ],
)
def test_paragraph_heading_is_its_leading_short_lines(paragraph, heading):
    assert paragraph_heading(paragraph) == heading


def test_every_unit_carries_the_heading_of_its_paragraph(tokenizer):
    """Titles reach the windows of a long article, and its part past a chunk boundary; paragraphs
    without a title line, and documents without known paragraphs, have none."""
    italy = next(p for p in wiki_paragraphs() if p["title"] == "Italy")
    milan = next(p for p in wiki_paragraphs() if p["title"] == "Milan")
    plain = "A paragraph without a title line, which starts with its first sentence at once."
    text = f"Document 1:\nItaly\n{italy['text']}\n\nDocument 2:\nMilan\n{milan['text']}\n\n{plain}"
    cfg = DocumentConfig(chunk_tokens=128, unit_tokens=40, unit_overlap=8)
    doc = Document.from_text(text, tokenizer, cfg)
    headings = doc.unit_headings()
    starts = doc.paragraph_starts.tolist()
    owner = [sum(s <= a for s in starts) - 1 for a in doc.unit_bounds[:, 0].tolist()]
    assert headings == [["Italy", "Milan", ""][p] for p in owner]
    texts = doc.unit_texts()
    untitled = [u for u, p in enumerate(owner) if p == 0 and "Italy\n" not in texts[u]]
    assert len(untitled) >= 3 and doc.unit_chunk[untitled[-1]] >= 1  # windows past the title and the chunk edge
    unknown = Document.from_ids(doc.ids, tokenizer, cfg)  # no paragraph starts: fixed windows, no headings
    assert unknown.unit_headings() == [""] * unknown.num_units


def test_one_million_token_document(tokenizer):
    # The whole Wikipedia pool is ~1.1M Qwen3 tokens: a real 1M-token build, end to end.
    text = "\n\n".join(_render(wiki_paragraphs()))
    doc = Document.from_text(text, tokenizer, DocumentConfig())
    assert doc.num_tokens > 1_000_000
    assert doc.num_chunks == -(-doc.num_tokens // 5000)
    _check_units(doc)
    texts = doc.unit_texts()
    assert len(texts) == doc.num_units and all(texts)
    assert doc.content_hash == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_short_document_is_one_chunk(tokenizer):
    doc = Document.from_text("Paris is the capital of France.", tokenizer, DocumentConfig())
    assert doc.num_chunks == 1 and doc.num_units == 1
    assert doc.chunk_bounds(0) == (0, doc.num_tokens)


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t \r\n"])
def test_empty_document_rejected(tokenizer, text):
    with pytest.raises(ValueError, match="^document: "):
        Document.from_text(text, tokenizer, DocumentConfig())


def test_bad_inputs_name_the_field(tokenizer):
    doc = Document.from_ids(np.arange(100), tokenizer, DocumentConfig(chunk_tokens=40, unit_tokens=10, unit_overlap=2))
    with pytest.raises(ValueError, match="^document: "):
        Document.from_ids([], tokenizer, DocumentConfig())
    with pytest.raises(ValueError, match="^document: "):
        Document.from_ids(np.zeros((2, 3), dtype=np.int64), tokenizer, DocumentConfig())
    with pytest.raises(ValueError, match="^document: "):
        Document.from_ids([5, -1], tokenizer, DocumentConfig())
    with pytest.raises(ValueError, match="^paragraph_starts: "):
        Document.from_ids(np.arange(100), tokenizer, DocumentConfig(), paragraph_starts=[5, 100])
    with pytest.raises(ConfigError, match="document.unit_overlap"):
        Document.from_ids(np.arange(100), tokenizer, DocumentConfig(unit_tokens=10, unit_overlap=10))
    with pytest.raises(ValueError, match="^chunk: "):
        doc.chunk_bounds(3)
    with pytest.raises(ValueError, match="^unit: "):
        doc.unit_ids(-1)
    with pytest.raises(ValueError, match="^last_chunk: "):
        doc.units_mask(2, 1)
