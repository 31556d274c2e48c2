"""BM25 retrieval over real Wikipedia paragraphs: analyzer, both backends, masks, ties, rerank."""

from __future__ import annotations

import math
import random
import threading
from collections import Counter

import numpy as np
import pytest
import scipy.sparse

from infmem_verl.agent import retrieval as retrieval_module
from infmem_verl.agent.config import DocumentConfig, RetrievalConfig
from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.document import Document
from infmem_verl.agent.rerank import (
    RRF_K,
    UnitEmbeddings,
    _CompiledMiniLM,
    _encode,
    _encoder,
    embed,
    embed_windows,
    fuse,
    query_encoding,
    reciprocal_rank_fusion,
    window_encoding,
)
from infmem_verl.agent.retrieval import STOPWORDS, Analyzer, BM25Index, Hit, SparseBM25, get_analyzer
from infmem_verl.assets import wiki_paragraphs

ANALYZER_FLAGS = [(False, False), (False, True), (True, False), (True, True)]
# Each backend's config: BM25Okapi scores words only, so it takes no bigram weight.
BACKENDS = {"sparse": RetrievalConfig(), "rank_bm25": RetrievalConfig(backend="rank_bm25", bigram_weight=0, heading_weight=0)}


@pytest.fixture(scope="module")
def units() -> list[str]:
    """400 real Wikipedia paragraphs, each one retrieval unit."""
    rng = random.Random(7)
    paragraphs = list(wiki_paragraphs())
    return [p["text"] for p in rng.sample(paragraphs, 400)]


@pytest.fixture(scope="module")
def index(units) -> BM25Index:
    return BM25Index.build(units, RetrievalConfig())


def _rare_words(units: list[str], count: int) -> list[tuple[str, int]]:
    """Words (alphabetic, 7+ letters, not stopwords) found in exactly one unit, with that unit."""
    analyzer = get_analyzer(stem=True, stopwords=True)
    where: dict[str, set[int]] = {}
    for i, text in enumerate(units):
        for term in set(analyzer.analyze(text)):
            where.setdefault(term, set()).add(i)
    out = []
    for i, text in enumerate(units):
        for word in get_analyzer(stem=False, stopwords=False).words(text):
            if len(word) >= 7 and word.isalpha() and where[analyzer.analyze(word)[0]] == {i}:
                out.append((word, i))
                break
        if len(out) == count:
            break
    return out


@pytest.mark.parametrize("stem,stopwords", ANALYZER_FLAGS)
def test_analyzer_splits_punctuation_and_case(stem, stopwords):
    analyzer = get_analyzer(stem, stopwords)
    assert analyzer.analyze("Paris, FRANCE! (capital)") == analyzer.analyze("paris france capital")
    assert analyzer.words("Seurat's snake_case 3.14") == ["seurat", "s", "snake", "case", "3", "14"]


def test_ascii_text_splits_as_the_unicode_path_splits_it(units):
    # Pure-ASCII text takes a translate-and-split path; one non-ASCII word appended sends the
    # same text through the regex path, which must then find the same words before it.
    analyzer = get_analyzer(stem=False, stopwords=False)
    ascii_units = [u for u in units if u.isascii()] + ["a_b-c'd  3.14\t$x@y.z\n\nEND", ""]
    assert len(ascii_units) > 100
    for text in ascii_units:
        assert analyzer.words(text + " é") == analyzer.words(text) + ["é"]


def test_analyzer_flags_change_terms():
    assert get_analyzer(False, False).analyze("The painted paintings") == ["the", "painted", "paintings"]
    assert get_analyzer(False, True).analyze("The painted paintings") == ["painted", "paintings"]
    assert get_analyzer(True, False).analyze("The painted paintings") == ["the", "paint", "paint"]
    assert get_analyzer(True, True).analyze("The painted paintings") == ["paint", "paint"]
    # Non-Latin scripts are words too; CJK has no spaces, so it becomes unigrams and bigrams.
    assert get_analyzer(False, False).words("Москва 東京都") == ["москва", "東", "京", "都", "東京", "京都"]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_rare_word_finds_its_unit(units, backend):
    index = BM25Index.build(units, BACKENDS[backend])
    rare = _rare_words(units, 20)
    assert len(rare) == 20
    for word, unit in rare:
        hits = index.search(word.upper() + "?", top_k=3)
        assert hits == [Hit(unit, hits[0].score)], word
        assert hits[0].score > 0


def test_glued_punctuation_matches(index, units):
    for query in ("Paris,", "(France)", "Napoleon's"):
        bare = query.strip(",()").replace("'s", "")
        assert index.search(query, top_k=8) == index.search(bare, top_k=8)
        assert len(index.search(query, top_k=8)) > 0
    assert any("Paris," in text for text in units)


def _surface_words(units: list[str]) -> dict[str, str]:
    """One surface word of the text for each analyzer term (stems are not words to re-analyze)."""
    analyzer = get_analyzer(stem=True, stopwords=False)
    out: dict[str, str] = {}
    for text in units:
        for word in analyzer.words(text):
            out.setdefault(analyzer.analyze(word)[0], word)
    return out


def test_every_document_word_scores_where_present(index, units):
    """A word of the document scores > 0 in exactly the units holding its term, however common."""
    analyzer = index.analyzer
    unit_terms = [set(analyzer.analyze(text)) for text in units]
    words = _surface_words(units)
    for term in random.Random(0).sample(sorted(set().union(*unit_terms)), 300):
        holding = np.array([term in terms for terms in unit_terms])
        np.testing.assert_array_equal(index.scores(words[term]) > 0, holding, err_msg=term)


def test_common_words_still_score(units):
    """Units of 40 paragraphs each: words in every unit, or in exactly half, still score > 0.

    BM25Okapi (rank_bm25) gives a word in half the units an idf of exactly 0, so it adds nothing
    to the score; the default backend's idf is positive for every word.
    """
    big_units = ["\n\n".join(units[i : i + 40]) for i in range(0, 400, 40)]
    sparse = BM25Index.build(big_units, RetrievalConfig(stopwords=False))
    okapi = BM25Index.build(big_units, RetrievalConfig(backend="rank_bm25", stopwords=False, bigram_weight=0, heading_weight=0))
    words = _surface_words(big_units)
    unit_terms = [set(sparse.analyzer.analyze(t)) for t in big_units]
    df = Counter(term for terms in unit_terms for term in terms)
    everywhere = [t for t, n in df.items() if n == len(big_units)]
    half = [t for t, n in df.items() if n == len(big_units) // 2]
    assert {"the", "of", "first"} <= set(everywhere) and len(half) >= 10
    for term in everywhere + half:
        holding = np.array([term in terms for terms in unit_terms])
        assert (sparse.scores(words[term])[holding] > 0).all(), term
        assert len(sparse.search(words[term], top_k=len(big_units))) == holding.sum()
    assert all((okapi.scores(words[term]) == 0).all() for term in half)


def _bm25(docs: list[Counter], terms: list[str], k1: float, b: float, lengths: list[int]) -> list[float]:
    """BM25 of ``terms`` over bags ``docs`` (Lucene's idf), written out term by term."""
    avgdl = sum(lengths) / len(lengths)
    scores = []
    for doc, dl in zip(docs, lengths):
        score = 0.0
        for term in terms:
            df = sum(term in d for d in docs)
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            tf = doc[term]
            score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * dl / avgdl))
        scores.append(score)
    return scores


@pytest.mark.parametrize("bigram_weight", [0.0, 0.5])
def test_sparse_scores_match_bm25_formula(units, bigram_weight):
    """Words, plus ``bigram_weight`` times BM25 over adjacent term pairs as strings (normalised
    by the unit's length in terms)."""
    cfg = RetrievalConfig(k1=1.5, b=0.6, bigram_weight=bigram_weight)
    index = BM25Index.build(units, cfg)
    unit_terms = [index.analyzer.analyze(t) for t in units]
    lengths = [len(t) for t in unit_terms]
    query = "the river flows through the capital city of the river delta"
    terms = index.analyzer.analyze(query)
    pairs = [f"{a} {b}" for a, b in zip(terms, terms[1:])]
    unit_pairs = [Counter(f"{a} {b}" for a, b in zip(t, t[1:])) for t in unit_terms]
    words = _bm25([Counter(t) for t in unit_terms], terms, cfg.k1, cfg.b, lengths)
    phrases = _bm25(unit_pairs, pairs, cfg.k1, cfg.b, lengths)
    expected = np.array(words) + bigram_weight * np.array(phrases)
    assert sum(p > 0 for p in phrases) >= 3  # the query's pairs do occur in the paragraphs
    np.testing.assert_allclose(index.scores(query), expected, rtol=1e-5)


def test_heading_field_matches_bm25_formula(units):
    """Words, plus ``heading_weight`` times BM25 over each unit's heading terms, with the body's idf
    and the headings' own length normalisation (b = HEADING_B); units without one add nothing."""
    articles = {p["title"]: p["text"] for p in wiki_paragraphs()}
    docs = [articles["Italy"], articles["Milan"], *units[:58]]
    headings = ["Italy", "Italy", "Renaissance architecture in Italy", "", "Milan", *[""] * 55]
    cfg = RetrievalConfig(k1=1.2, b=0.5, bigram_weight=0, heading_weight=0.75)
    index = BM25Index.build(docs, cfg, headings)
    words = BM25Index.build(docs, RetrievalConfig(k1=1.2, b=0.5, bigram_weight=0, heading_weight=0))
    query = "What is the population of Italy and of Milan?"
    terms = index.analyzer.analyze(query)
    unit_terms = [Counter(index.analyzer.analyze(t)) for t in docs]
    heading_terms = [Counter(index.analyzer.analyze(h)) for h in headings]
    lengths = np.array([sum(h.values()) for h in heading_terms])
    avg = lengths[lengths > 0].mean()
    expected = []
    for heading, length in zip(heading_terms, lengths):
        score = 0.0
        for term in terms:
            df = sum(term in u for u in unit_terms)  # the body's document frequency
            idf = math.log(1 + (len(docs) - df + 0.5) / (df + 0.5))
            tf = heading[term]
            score += idf * tf * (cfg.k1 + 1) / (tf + cfg.k1 * (1 - retrieval_module.HEADING_B + retrieval_module.HEADING_B * length / avg))
        expected.append(score)
    assert all(term in sum(unit_terms, Counter()) for term in ("itali", "milan"))  # the body knows the title words
    np.testing.assert_allclose(index.scores(query), words.scores(query) + 0.75 * np.array(expected), rtol=1e-5)
    # The shorter heading holding "Italy" weighs more than the longer one; no heading, no addition.
    added = index.scores(query) - words.scores(query)
    assert added[0] == added[1] > added[2] > 0 and added[3] == 0 and added[4] > 0
    # Without headings given, the weight changes nothing.
    np.testing.assert_allclose(BM25Index.build(docs, cfg).scores(query), words.scores(query))


def test_headings_rank_the_article_a_question_names_first(tokenizer):
    """On a fixed real case (32K tokens, FanOutQA's human-written sub-questions), the title over an
    article lifts it above the articles that merely mention its subject; every title comes from
    the document itself (``BM25Index.of_document``, the path rollouts take)."""
    from bench.retrieval import REAL_SETS, LengthPlan, article_block, article_token_counts, real_document, real_queries
    from infmem_verl.agent.cache import DocumentCache

    paragraphs = wiki_paragraphs()
    counts = article_token_counts(tokenizer, paragraphs)
    case = real_queries(paragraphs, counts, REAL_SETS["fanoutqa"](paragraphs, tokenizer), LengthPlan("32K", 32000, 1, 24), random.Random(0))
    doc, gold = real_document(tokenizer, case, DocumentConfig(chunk_tokens=2000))
    ranks = {}
    for name, cfg in (
        ("words", RetrievalConfig(heading_weight=0.0)),
        ("headings", RetrievalConfig()),  # the default
        ("headings + MiniLM", RetrievalConfig(rerank=True)),  # the dense stage at its defaults
    ):
        index = BM25Index.of_document(doc, cfg)
        ranks[name] = dict(zip(case.queries, _ranks([[h.unit for h in index.search(q, 8)] for q in case.queries], gold)))
    # The rollouts' document cache prepares the same index from the text.
    text = "\n\n".join(article_block(a) for a in case.articles)
    prepared = DocumentCache(tokenizer, DocumentConfig(chunk_tokens=2000), RetrievalConfig()).prepare(text, with_index=True)
    np.testing.assert_array_equal(prepared.index.scores(case.queries[0]), BM25Index.of_document(doc, RetrievalConfig()).scores(case.queries[0]))
    first = {name: sum(r == 1 for r in by_query.values()) for name, by_query in ranks.items()}
    assert first["headings + MiniLM"] >= first["headings"] >= first["words"] + 3 >= 21, first
    # Here the dense stage, reordering BM25's top 50, keeps every article the headings put in the top 4.
    assert all(ranks["headings + MiniLM"][q] <= 4 for q, r in ranks["headings"].items() if r is not None and r <= 4)
    for query in ("What is the signed form of Hindi called?", "Was Venus discovered after 1700 and if so, who discovered it?",
                  "What is the largest city of United States?"):  # fmt: skip
        assert ranks["words"][query] > 1 and ranks["headings"][query] == 1, query
    # FanOutQA's evidence is wrong here (it names Germany for Greece): neither finds it.
    assert ranks["words"]["Who is the head of state of Greece?"] is ranks["headings"]["Who is the head of state of Greece?"] is None


def test_bigrams_rank_the_words_in_query_order_first(units):
    # Same terms, same lengths: the words alone tie, and the tie goes to the earlier unit.
    scattered = "Tree, fruit and species grow on the hills."
    in_order = "Species of fruit tree grow on the hills."
    docs = units[:20] + [scattered, in_order]
    query = "species of fruit tree"
    words = BM25Index.build(docs, RetrievalConfig(bigram_weight=0)).search(query, 2)
    assert [h.unit for h in words] == [20, 21] and words[0].score == words[1].score
    pairs = BM25Index.build(docs, RetrievalConfig(bigram_weight=0.25)).search(query, 2)
    assert [h.unit for h in pairs] == [21, 20] and pairs[0].score > pairs[1].score
    assert pairs[1].score == pytest.approx(words[1].score)  # no pair of the query: words alone


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_ties_break_by_position(units, backend):
    # Three copies among seven units: BM25Okapi's idf of a word in half the units would be 0.
    dup = units[4]
    tied = [units[0], dup, units[1], dup, units[2], dup, units[3]]
    index = BM25Index.build(tied, BACKENDS[backend])
    word, _ = _rare_words([dup] + units[:4], 1)[0]
    hits = index.search(word, top_k=2)
    assert [h.unit for h in hits] == [1, 3]
    assert hits[0].score == hits[1].score
    assert [h.unit for h in index.search(word, top_k=8)] == [1, 3, 5]
    mask = np.array([True, False, True, True, True, True, True])
    assert [h.unit for h in index.search(word, top_k=8, allowed=mask)] == [3, 5]


def test_results_ordered_positive_and_capped(index):
    for query in ("war in europe", "music of the twentieth century", "largest city river"):
        for top_k in (1, 4, 8):
            hits = index.search(query, top_k=top_k)
            assert 0 < len(hits) <= top_k
            assert all(h.score > 0 for h in hits)
            keys = [(-h.score, h.unit) for h in hits]
            assert keys == sorted(keys)
    assert index.search("zzqxv ,,, !!", top_k=4) == []


def test_allowed_mask_filters_ranking(index):
    rng = np.random.default_rng(3)
    full = index.search("war empire battle army", top_k=index.num_units)
    assert len(full) > 20
    for _ in range(10):
        mask = rng.random(index.num_units) < 0.3
        expected = [h for h in full if mask[h.unit]][:8]
        assert index.search("war empire battle army", top_k=8, allowed=mask) == expected
    assert index.search("war empire battle army", 8, allowed=np.zeros(index.num_units, dtype=bool)) == []


def test_backends_agree_on_clear_queries(units):
    sparse = BM25Index.build(units, RetrievalConfig())
    okapi = BM25Index.build(units, BACKENDS["rank_bm25"])
    rare = _rare_words(units, 30)
    for (w1, u1), (w2, _) in zip(rare, rare[1:]):
        # A query with one paragraph's rare word plus context words from another.
        query = f"What about {w1} and {w2} in {units[u1].split()[0]}?"
        assert sparse.search(query, 1)[0].unit == okapi.search(query, 1)[0].unit, query


def test_bad_input_is_rejected(index):
    with pytest.raises(ValueError, match="unit_texts"):
        BM25Index.build([], RetrievalConfig())
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="top_k"):
            index.search("war", top_k=bad)
    with pytest.raises(ValueError, match="allowed"):
        index.search("war", 4, allowed=np.ones(index.num_units - 1, dtype=bool))
    with pytest.raises(ValueError, match="allowed"):
        index.search("war", 4, allowed=np.ones(index.num_units, dtype=np.int64))
    with pytest.raises(ConfigError, match="retrieval.b"):
        BM25Index.build(["some text"], RetrievalConfig(b=1.5))
    with pytest.raises(ConfigError, match="retrieval.backend"):
        BM25Index.build(["some text"], RetrievalConfig(backend="bm25s"))
    with pytest.raises(ConfigError, match="retrieval.bigram_weight: expected a number >= 0"):
        BM25Index.build(["some text"], RetrievalConfig(bigram_weight=-0.5))
    with pytest.raises(ConfigError, match="retrieval.bigram_weight: expected 0 with backend 'rank_bm25'"):
        BM25Index.build(["some text"], RetrievalConfig(backend="rank_bm25", bigram_weight=0.25, heading_weight=0))
    with pytest.raises(ConfigError, match="retrieval.heading_weight: expected a number >= 0"):
        BM25Index.build(["some text"], RetrievalConfig(heading_weight=-1.0))
    with pytest.raises(ConfigError, match="retrieval.heading_weight: expected 0 with backend 'rank_bm25'"):
        BM25Index.build(["some text"], RetrievalConfig(backend="rank_bm25", bigram_weight=0))
    with pytest.raises(ValueError, match=r"unit_headings: expected one per unit \(2\), got 1"):
        BM25Index.build(["some text", "more text"], RetrievalConfig(), unit_headings=["Some"])
    with pytest.raises(ValueError, match=r"heading_terms: expected one entry per unit \(2\), got 1"):
        SparseBM25([["some"], ["more"]], k1=0.9, b=0.4, heading_terms=[["some"]], heading_weight=1.0)


def _one_pass_sparse(unit_terms: list[list[str]], k1: float, b: float) -> tuple[dict, scipy.sparse.csr_matrix]:
    """The sparse index as first written: every token's term id at once, weights in float64."""
    vocab: dict[str, int] = {}
    lengths = np.array([len(t) for t in unit_terms], dtype=np.int64)
    term_ids = np.array([vocab.setdefault(t, len(vocab)) for terms in unit_terms for t in terms], dtype=np.int32)
    unit_ids = np.repeat(np.arange(len(unit_terms), dtype=np.int32), lengths)
    tf = scipy.sparse.csr_matrix(
        (np.ones(len(term_ids), dtype=np.float32), (term_ids, unit_ids)), shape=(len(vocab), len(unit_terms))
    )
    df = np.diff(tf.indptr)
    idf = np.log1p((len(unit_terms) - df + 0.5) / (df + 0.5))
    norm = k1 * (1.0 - b + b * lengths / max(float(lengths.mean()), 1.0))
    counts = tf.data.astype(np.float64)
    tf.data = (np.repeat(idf, df) * counts * (k1 + 1.0) / (counts + norm[tf.indices])).astype(np.float32)
    return vocab, tf


@pytest.mark.parametrize("block,ingest", [(5, 7), (1 << 16, 256)])
def test_streamed_sparse_index_equals_the_one_pass_build(units, block, ingest, monkeypatch):
    # Same vocabulary (ids in order of first appearance), bit-identical weights and the same
    # term sequence, whatever the blocks units are read in and weights computed in; hence the
    # same scores and hits.
    monkeypatch.setattr(retrieval_module, "_WEIGHT_BLOCK", block)
    monkeypatch.setattr(retrieval_module, "_INGEST_UNITS", ingest)
    analyzer = get_analyzer(stem=True, stopwords=True)
    unit_terms = [analyzer.analyze(t) for t in units] + [[]]  # a unit without terms too
    unit_terms.insert(100, [])  # and one inside a block
    vocab, expected = _one_pass_sparse(unit_terms, k1=1.2, b=0.75)
    streamed = SparseBM25(iter(unit_terms), k1=1.2, b=0.75)
    assert list(streamed.vocab.items()) == list(vocab.items())
    sequence = [i for terms in unit_terms for i in [vocab[t] for t in terms] + [-1]]
    np.testing.assert_array_equal(SparseBM25(iter(unit_terms), k1=1.2, b=0.75, bigram_weight=0.5).term_sequence, sequence)
    got = streamed.weights
    assert got.dtype == np.float32 and got.has_sorted_indices and expected.has_sorted_indices
    for name in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    query = analyzer.analyze("the river flows through the capital city of the empire")
    uniq, counts = np.unique([vocab[t] for t in query if t in vocab], return_counts=True)
    np.testing.assert_array_equal(streamed.scores(query), expected[uniq].T @ counts.astype(np.float32))


def test_a_unit_of_more_than_65535_terms_keeps_its_exact_counts():
    # The build collects term counts as 16-bit integers and widens them for a unit this long.
    unit_terms = [["river"] * 70_000 + ["delta"], ["river", "city"], ["delta"] * 3]
    vocab, expected = _one_pass_sparse(unit_terms, k1=1.2, b=0.75)
    streamed = SparseBM25(iter(unit_terms), k1=1.2, b=0.75)
    assert list(streamed.vocab.items()) == list(vocab.items())
    assert streamed.weights.dtype == np.float32
    for name in ("data", "indices", "indptr"):
        np.testing.assert_array_equal(getattr(streamed.weights, name), getattr(expected, name), err_msg=name)


def test_index_over_lazy_unit_texts_equals_index_over_a_list(tokenizer, units):
    doc = Document.from_text("\n\n".join(units[:120]), tokenizer, DocumentConfig(chunk_tokens=2000))
    lazy = BM25Index.build(doc.unit_texts(), RetrievalConfig(bigram_weight=0.25))
    listed = BM25Index.build(list(doc.unit_texts()), RetrievalConfig(bigram_weight=0.25))
    assert lazy.num_units == listed.num_units == doc.num_units
    assert lazy.scorer.vocab == listed.scorer.vocab
    assert (lazy.scorer.weights != listed.scorer.weights).nnz == 0
    np.testing.assert_array_equal(lazy.scorer.term_sequence, listed.scorer.term_sequence)
    assert (lazy.scorer.term_sequence == -1).sum() == doc.num_units
    for query in ("war between two empires", "famous painter", "river"):
        assert lazy.search(query, 8) == listed.search(query, 8)


def test_stem_cache_is_bounded_and_stems_stay_right(units):
    reference = Analyzer(stem=True, stopwords=True)
    bounded = Analyzer(stem=True, stopwords=True, max_stems=64)
    sizes = []
    for text in units[:100]:
        assert bounded.analyze(text) == reference.analyze(text)
        sizes.append(bounded.num_cached_stems)
    assert max(sizes) <= 64 and sum(size > 0 for size in sizes) > 50
    assert reference.num_cached_stems > 1000  # the bound was what kept it small
    long_text = " ".join(units[:5])  # more distinct words in one call than the cache holds
    assert len(set(bounded.words(long_text))) > 64
    assert bounded.analyze(long_text) == reference.analyze(long_text)
    assert bounded.num_cached_stems <= 64
    with pytest.raises(ValueError, match="max_stems: expected an integer >= 1"):
        Analyzer(stem=True, stopwords=True, max_stems=0)


def test_the_stem_cache_shares_its_strings():
    """A word that is its own stem maps to itself, and words of one stem stored together share
    one string: the cache holds little beyond its keys."""
    analyzer = Analyzer(stem=True, stopwords=False)
    words = "paint painting painted paints river".split()
    assert analyzer.analyze(" ".join(words)) == ["paint", "paint", "paint", "paint", "river"]
    stems = analyzer._stems
    assert stems["river"] is next(w for w in stems if w == "river")
    assert stems["paint"] is next(w for w in stems if w == "paint")
    assert stems["painting"] is stems["painted"] is stems["paints"]


def test_stem_cache_starting_over_is_safe_across_threads(units):
    # Four threads share an analyzer whose tiny cache starts over constantly.
    reference = Analyzer(stem=True, stopwords=False)
    expected = [reference.analyze(t) for t in units]
    shared = Analyzer(stem=True, stopwords=False, max_stems=40)
    results: dict[int, list] = {}

    def work(worker: int) -> None:
        order = list(range(len(units)))
        random.Random(worker).shuffle(order)
        results[worker] = [(i, shared.analyze(units[i])) for i in order]

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4
    for out in results.values():
        assert all(terms == expected[i] for i, terms in out)
    assert shared.num_cached_stems <= 40


def test_stopword_list_is_lowercase_words():
    assert all(w.isalpha() and w == w.lower() for w in STOPWORDS)
    assert {"the", "of", "and", "is", "s", "t"} <= STOPWORDS


def test_rerank_reorders_within_bm25_pool(units):
    cfg = RetrievalConfig(rerank=True, rerank_model="minilm", rerank_candidates=8, fusion="rrf")
    reranked = BM25Index.build(units, cfg)
    plain = BM25Index.build(units, RetrievalConfig())
    queries = ["famous painter of the renaissance", "war between two empires", "largest river of the continent"]
    reordered = 0
    for query in queries:
        pool = [h.unit for h in plain.search(query, top_k=8)]
        hits = reranked.search(query, top_k=4)
        assert len(hits) == 4 and {h.unit for h in hits} <= set(pool)
        assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
        assert all(0 < h.score <= 2 / (RRF_K + 1) for h in hits)
        reordered += [h.unit for h in hits] != pool[:4]
    assert reordered > 0
    # Only units that entered a candidate pool were embedded.
    assert 0 < reranked.num_embedded <= 8 * len(queries)
    assert plain.num_embedded == 0
    # A mask keeps reranking inside the allowed units.
    mask = np.zeros(len(units), dtype=bool)
    mask[::2] = True
    assert all(mask[h.unit] for h in reranked.search(queries[0], top_k=4, allowed=mask))


def test_rerank_sees_the_end_of_long_units(units):
    """A unit's similarity is its best window's, so text past MiniLM's input length still counts."""
    target = "A Sunday Afternoon on the Island of La Grande Jatte"
    painting = next(p["text"] for p in wiki_paragraphs() if p["title"] == target)
    filler = "\n\n".join(units[:5])  # well over 128 word pieces
    embeddings = UnitEmbeddings([filler + "\n\n" + painting, filler + "\n\n" + units[5]])
    query = "Seurat's pointillist painting of a Sunday on an island"
    sims = embeddings.similarities(query, np.array([0, 1]))
    assert sims[0] > sims[1] + 0.2
    # The windows are kept in float16; the cosine matches float32 embeddings to within 1e-3.
    vectors, owner = embed_windows([filler + "\n\n" + painting])
    assert all(w.dtype == np.float16 for w in embeddings._windows.values())
    assert abs(sims[0] - float((vectors[owner == 0] @ embed([query])[0]).max())) < 1e-3


class CountingMiniLM:
    """The stage's own MiniLM, counting its forward passes (the rows of each)."""

    def __init__(self):
        self.model, self.rows, self.threads = _encoder(), [], []
        self.config = self.model.config

    def __call__(self, **batch):
        import torch

        self.rows.append(len(batch["input_ids"]))
        self.threads.append(torch.get_num_threads())
        return self.model(**batch)


def test_a_cold_query_and_its_new_candidates_take_one_pass_and_a_repeated_query_none(units):
    """A query whose candidates are new is embedded in the candidates' pass, not a pass of its
    own; asked again (another rollout's same question) it runs no pass; new candidates beside a
    known query run one pass of the candidates alone."""
    counting = CountingMiniLM()
    embeddings = UnitEmbeddings(units[:7], window_tokens=64, max_windows=1, model=counting)
    query = "Which river flows through the capital?"
    sims = embeddings.similarities(query, np.array([0, 1, 2]))
    assert counting.rows == [4] and embeddings.passes == 1  # three windows and the query
    np.testing.assert_allclose(embeddings.similarities(query, np.array([2, 0])), sims[[2, 0]])
    assert counting.rows == [4]  # cached query and windows: nothing to embed
    embeddings.similarities(query, np.array([3, 4]))
    assert counting.rows == [4, 2] and embeddings.passes == 2
    # A query wider than the windows gets a pass of its own: padding the windows out to it
    # would cost more.
    long_query = " ".join(units[6].split()[:120])
    embeddings.similarities(long_query, np.array([5]))
    assert counting.rows == [4, 2, 1, 1] and embeddings.passes == 3
    # The query's vector from the shared pass is the one it gets alone (bfloat16 on a CPU
    # that computes it natively: within 2e-3 of each other as cosines).
    vectors, _ = embed_windows(units[:3], window_tokens=64, max_windows=1)
    np.testing.assert_allclose(sims, vectors @ embed([query])[0], atol=2e-3)


def test_the_compiled_minilm_embeds_as_the_eager_one(units):
    """``retrieval.rerank_compile`` (the default) runs MiniLM through torch.compile with its
    weights frozen: the similarities of the stage's passes (a pool with its query, one candidate
    with its query, a query alone) stay those of the eager model, within bfloat16's spread
    (cosines within 3e-3, measured up to 2.1e-3)."""
    eager = UnitEmbeddings(units, 64, 1)
    compiled = BM25Index.build(units, RetrievalConfig(rerank=True)).embeddings
    assert compiled.compiled and not eager.compiled
    for query, pool in (
        ("Which river flows through the capital of the empire?", np.arange(30)),
        ("Who painted the portrait?", np.arange(30, 31)),
        ("When was the treaty signed?", np.arange(30)),  # candidates cached: the query alone
    ):
        np.testing.assert_allclose(compiled.similarities(query, pool), eager.similarities(query, pool), atol=3e-3)
    assert compiled.passes == 2 and _encoder(compiled=True).failed is None


def test_one_minilm_per_precision_however_its_arguments_are_spelled():
    # The stage asks with keywords, embed() with none, the benchmarks positionally: each copy is
    # ~45 MiB of bfloat16 weights, and the compiled model must wrap the same one.
    assert _encoder() is _encoder("auto") is _encoder(compiled=False) is _encoder("auto", False)
    assert _encoder(compiled=True) is _encoder("auto", True)
    assert _encoder(compiled=True).model is _encoder()


def test_a_minilm_that_fails_to_compile_warns_and_runs_eagerly(units):
    # No C++ compiler for inductor's kernels: the first pass warns and runs the eager model.
    import copy

    import torch._inductor.config as inductor_config

    model = _CompiledMiniLM(copy.deepcopy(_encoder()))  # a new module: nothing compiled for it yet
    encoding = window_encoding(units[:3], 64, 1)[0]
    with inductor_config.patch({"cpp.cxx": ("no-such-compiler-c++",)}):
        with pytest.warns(RuntimeWarning, match="rerank_compile: torch.compile of MiniLM failed.*no-such-compiler"):
            vectors = _encode(encoding, model)
    assert model.failed
    np.testing.assert_array_equal(vectors, _encode(encoding, model.model))


def test_minilm_tokenizes_for_several_documents_at_once(units):
    # Two documents' searches embed from their own threads; MiniLM's one tokenizer failed with
    # "Already borrowed" when two of them tokenized at once.
    import concurrent.futures

    def encode(i: int) -> None:
        for _ in range(30):
            window_encoding(units[:30], 64, 1) if i % 2 else query_encoding([units[i][:80]])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(encode, range(8)))  # re-raises a thread's error


def test_minilm_passes_run_on_rerank_threads_and_leave_every_other_threads_count(units):
    """``retrieval.rerank_threads`` sets torch's threads for the passes on the searching thread
    only, and puts them back: the caller's count (a policy's, the event loop's) is untouched."""
    import concurrent.futures

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        index = BM25Index.build(units[:8], RetrievalConfig(rerank=True, rerank_threads=1, rerank_window_tokens=64, rerank_windows=1))
        counting = CountingMiniLM()
        index.embeddings.model = counting
        index.search(units[0][:80], top_k=2)  # here
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # and on a worker thread, as rollouts search
            worker_after = pool.submit(lambda: (index.search(units[3][:80], top_k=2), torch.get_num_threads())[1]).result()
        assert counting.threads == [1, 1] and torch.get_num_threads() == 2 and worker_after == 2
        with pytest.raises(ConfigError, match="rerank_threads"):
            RetrievalConfig(rerank_threads=0).validate()
    finally:
        torch.set_num_threads(before)


def test_window_options_embed_only_each_units_first_windows(units):
    """``rerank_windows`` keeps each unit's first windows and ``rerank_window_tokens`` sets their
    length: the windows kept are the full encoding's first ones, piece for piece, and a unit's
    similarity is then its first windows' best, so text past them no longer counts."""
    target = "A Sunday Afternoon on the Island of La Grande Jatte"
    painting = next(p["text"] for p in wiki_paragraphs() if p["title"] == target)
    texts = ["\n\n".join(units[:5]) + "\n\n" + painting, units[6], units[7]]
    every, owner = window_encoding(texts)
    assert np.bincount(owner)[0] > 2  # the long unit has several windows

    def pieces(encoding, row: int) -> list[int]:
        return encoding["input_ids"][row][encoding["attention_mask"][row].bool()].tolist()

    for max_windows in (1, 2):
        kept, kept_owner = window_encoding(texts, max_windows=max_windows)
        assert np.bincount(kept_owner).tolist() == np.minimum(np.bincount(owner), max_windows).tolist()
        firsts = [row for row in range(len(owner)) if (owner[:row] == owner[row]).sum() < max_windows]
        assert [pieces(kept, r) for r in range(len(kept_owner))] == [pieces(every, r) for r in firsts]
    short, short_owner = window_encoding(texts, window_tokens=64, max_windows=1)
    assert short_owner.tolist() == [0, 1, 2] and int(short["attention_mask"].sum(1).max()) <= 64
    for row in range(3):  # the 64-piece window is the start of the 128-piece one
        start = pieces(short, row)[:-1]
        assert len(start) <= 63 and start == pieces(every, int(np.searchsorted(owner, row)))[: len(start)]

    query = "Seurat's pointillist painting of a Sunday on an island"
    all_windows = UnitEmbeddings(texts).similarities(query, np.array([0]))[0]
    first_only = UnitEmbeddings(texts, max_windows=1)
    assert first_only.similarities(query, np.array([0]))[0] < all_windows - 0.2
    vectors, _ = embed_windows(texts[:1], max_windows=1)
    assert abs(first_only.similarities(query, np.array([0]))[0] - float(vectors[0] @ embed([query])[0])) < 1e-3


def test_int8_minilm_stays_close_to_float32_on_real_paragraphs():
    """MiniLM with int8 Linear layers (weights per output channel; what bench.rerank_cost measures
    beside the stage's bfloat16): on 200 Wikipedia paragraphs' first 64-piece windows its vectors
    stay within cosine .95 of float32's (measured .967 at worst, .983 on average), every Linear
    layer is quantized, and every title still finds its own paragraph first, as with float32."""
    import torch

    int8_model = _encoder("int8")
    if int8_model is None:
        pytest.skip("no x86 int8 engine in this torch")
    assert not any(isinstance(m, torch.nn.Linear) for m in int8_model.modules())
    # 6 layers x 6 Linear layers, and the pooler's (which the mean-pooled embeddings do not use).
    assert sum(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in int8_model.modules()) == 37
    paragraphs = random.Random(7).sample(list(wiki_paragraphs()), 200)
    encoding, _ = window_encoding([p["text"] for p in paragraphs], window_tokens=64, max_windows=1)
    exact, int8 = _encode(encoding, _encoder("float32")), _encode(encoding, int8_model)
    cosine = (exact * int8).sum(1)
    assert cosine.min() > 0.95 and cosine.mean() > 0.975
    titles = [p["title"] for p in paragraphs]
    exact_q, int8_q = embed(titles, _encoder("float32")), embed(titles, int8_model)
    assert ((exact_q * int8_q).sum(1)).min() > 0.9
    assert ((exact_q @ exact.T).argmax(1) == np.arange(200)).all()
    assert ((int8_q @ int8.T).argmax(1) == np.arange(200)).all()


def test_the_index_embeds_with_its_window_settings(units):
    cfg = RetrievalConfig(rerank=True, rerank_candidates=6, rerank_windows=1, rerank_window_tokens=64)
    index = BM25Index.build(units, cfg)
    hits = index.search("famous painter of the renaissance", top_k=4)
    assert len(hits) == 4 and index.num_embedded == 6
    assert all(len(w) == 1 for w in index.embeddings._windows.values())
    for field, bad in (("rerank_window_tokens", 8), ("rerank_window_tokens", 1024), ("rerank_windows", -1)):
        with pytest.raises(ConfigError, match=f"retrieval.{field}: expected"):
            RetrievalConfig(**{field: bad}).validate()


def test_reciprocal_rank_fusion():
    fused = reciprocal_rank_fusion(np.array([0, 1, 2]), np.array([2, 1, 0]))
    np.testing.assert_allclose(fused, [1 / (RRF_K + 1) + 1 / (RRF_K + 3), 2 / (RRF_K + 2), 1 / (RRF_K + 1) + 1 / (RRF_K + 3)])
    # An item both rankers put first wins.
    fused = reciprocal_rank_fusion(np.array([1, 0, 2]), np.array([1, 2, 0]))
    assert fused.argmax() == 1 and fused[1] == 2 / (RRF_K + 1)


def test_fusions_against_hand_computed_ranks():
    # A pool of four units in BM25 order (best first) and their MiniLM similarities.
    bm25 = np.array([9.0, 7.0, 4.0, 1.0])
    dense = np.array([0.2, 0.9, 0.5, 0.9])
    # MiniLM ranks items 1 and 3 (tied, BM25's order first), 2, 0: ranks 4, 1, 3, 2; BM25's are 1..4.
    rrf = fuse("rrf", bm25, dense, weight=0.0)
    np.testing.assert_allclose(
        rrf,
        [1 / (RRF_K + 1) + 1 / (RRF_K + 4), 1 / (RRF_K + 2) + 1 / (RRF_K + 1), 2 / (RRF_K + 3), 1 / (RRF_K + 4) + 1 / (RRF_K + 2)],
    )
    assert list(np.argsort(-rrf)) == [1, 0, 3, 2]
    # Min-max scaled: BM25 [1, .75, .375, 0], MiniLM [0, 1, 3/7, 1]; 0.3 / 0.7 of each.
    score = fuse("score", bm25, dense, weight=0.7)
    np.testing.assert_allclose(score, [0.3, 0.3 * 0.75 + 0.7, 0.3 * 0.375 + 0.7 * 3 / 7, 0.7])
    assert list(np.argsort(-score)) == [1, 3, 2, 0]
    np.testing.assert_allclose(fuse("score", bm25, dense, weight=0.0), [1.0, 0.75, 0.375, 0.0])
    np.testing.assert_array_equal(fuse("dense", bm25, dense, weight=0.5), dense)
    # Equal scores scale to 0 rather than dividing by zero.
    np.testing.assert_array_equal(fuse("score", np.ones(3), np.ones(3), weight=0.5), np.zeros(3))
    with pytest.raises(ValueError, match="fusion"):
        fuse("max", bm25, dense, weight=0.5)


@pytest.mark.parametrize("model", ["minilm", "static"])
@pytest.mark.parametrize("fusion,weight", [("rrf", 0.5), ("score", 0.7), ("dense", 1.0)])
def test_search_orders_the_pool_by_the_fusion(units, fusion, weight, model):
    cfg = RetrievalConfig(rerank=True, rerank_model=model, rerank_candidates=6, fusion=fusion, fusion_weight=weight)
    reranked = BM25Index.build(units, cfg)
    query = "famous painter of the renaissance"
    pool = BM25Index.build(units, RetrievalConfig()).search(query, top_k=6)
    pool_units = np.array([h.unit for h in pool])
    fused = fuse(fusion, np.array([h.score for h in pool]), reranked.embeddings.similarities(query, pool_units), weight)
    expected = [int(pool_units[i]) for i in np.lexsort((pool_units, -fused))]
    assert [h.unit for h in reranked.search(query, top_k=6)] == expected


def test_units_of_a_real_document(tokenizer, units):
    """Units cut by ``Document`` (Qwen3 tokens, the default paragraph-aligned units).

    A rare word's top hit holds it, and a read-prefix mask built from ``unit_chunk`` keeps units
    of later chunks out even when they are the best match.
    """
    from infmem_verl.agent.config import DocumentConfig
    from infmem_verl.agent.document import Document

    doc = Document.from_text("\n\n".join(units[:80]), tokenizer, DocumentConfig(chunk_tokens=2000))
    index = BM25Index.build(doc.unit_texts(), RetrievalConfig())
    assert doc.num_chunks > 3
    rare = _rare_words(units[:80], 80)[::4]  # spread over the whole document
    words = get_analyzer(stem=False, stopwords=False)
    for word, _ in rare:
        hits = index.search(word, top_k=2)
        assert hits and word in words.words(doc.unit_texts()[hits[0].unit]), word
    read_prefix = doc.unit_chunk <= 1
    assert any(doc.unit_chunk[index.search(word, top_k=1)[0].unit] > 1 for word, _ in rare)
    for word, _ in rare:
        assert all(doc.unit_chunk[h.unit] <= 1 for h in index.search(word, top_k=8, allowed=read_prefix))
    # Reranking decodes only its candidate units from the document's lazy unit texts.
    reranked = BM25Index.build(doc.unit_texts(), RetrievalConfig(rerank=True, rerank_model="minilm", rerank_candidates=6))
    query = "history of the world and its people"
    pool = {h.unit for h in index.search(query, top_k=6)}
    hits = reranked.search(query, top_k=3)
    assert len(pool) == 6 and len(hits) == 3 and {h.unit for h in hits} <= pool
    assert reranked.num_embedded == len(pool)


def test_rerank_auto_turns_the_dense_stage_on_past_its_length_only(units, tokenizer):
    """``rerank="auto"`` (the default) reranks a document longer than ``rerank_auto_tokens`` and
    leaves a shorter one to BM25 alone; true and false hold at every length."""
    doc = Document.from_text("\n\n".join(units[:40]), tokenizer, DocumentConfig(chunk_tokens=2000))
    query = "history of the world and its people"
    on = BM25Index.of_document(doc, RetrievalConfig(rerank_auto_tokens=doc.num_tokens - 1, rerank_candidates=6))
    off = BM25Index.of_document(doc, RetrievalConfig(rerank_auto_tokens=doc.num_tokens, rerank_candidates=6))
    assert on.rerank and not off.rerank
    bm25 = BM25Index.of_document(doc, RetrievalConfig(rerank=False))
    assert off.search(query, top_k=3) == bm25.search(query, top_k=3) and off.num_embedded == 0
    pool = {h.unit for h in bm25.search(query, top_k=6)}
    assert {h.unit for h in on.search(query, top_k=3)} <= pool and on.num_embedded == len(pool) == 6
    default = RetrievalConfig()
    assert default.rerank == "auto" and default.rerank_enabled(1_000_000) and not default.rerank_enabled(32_768)
    assert not default.rerank_enabled(None)  # an index built without a length: BM25 alone
    assert RetrievalConfig(rerank=True).rerank_enabled(100) and not RetrievalConfig(rerank=False).rerank_enabled(10**7)
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="retrieval.rerank: expected true, false or 'auto'"):
            RetrievalConfig(rerank=bad).validate()


@pytest.fixture(scope="module")
def described_case(tokenizer):
    """A fixed real-query case: ~8K tokens of Wikipedia articles rendered as training documents
    are, 24 of them asked by the short description their editors wrote (the benchmark's set)."""
    from bench.retrieval import LengthPlan, article_token_counts, description_set, real_queries

    paragraphs = wiki_paragraphs()
    counts = article_token_counts(tokenizer, paragraphs)
    return real_queries(paragraphs, counts, description_set(paragraphs), LengthPlan("8K", 8000, 1, 24), random.Random(0))


def _ranks(rankings: list[list[int]], gold: list[np.ndarray]) -> list[int | None]:
    """1-based rank of the first unit holding each query's article, None when not retrieved."""
    return [next((i + 1 for i, u in enumerate(r) if u in g), None) for r, g in zip(rankings, gold)]


def test_recall_of_each_variant_on_real_queries(tokenizer, described_case):
    from bench.retrieval import real_document

    case = described_case
    titles = {q: case.articles[t]["title"] for q, t in zip(case.queries, case.targets)}
    assert titles["American psychologist (1878–1958)"] == "John B. Watson"
    ranks: dict[str, list[int | None]] = {}
    for name, doc_cfg in {
        "fixed": DocumentConfig(chunk_tokens=2000, unit_tokens=500, unit_overlap=100, paragraph_units=False),
        "merged": DocumentConfig(chunk_tokens=2000, merge_paragraphs=True),
        "paragraphs": DocumentConfig(chunk_tokens=2000),  # the default units: one paragraph each, <= 250 tokens
    }.items():
        doc, gold = real_document(tokenizer, case, doc_cfg)
        assert doc.num_units >= 20 and all(len(g) for g in gold)
        words_only = BM25Index.build(doc.unit_texts(), RetrievalConfig(bigram_weight=0))
        pools = [words_only.search(q, 8) for q in case.queries]
        ranks[f"{name} BM25"] = _ranks([[h.unit for h in p] for p in pools], gold)
        if name != "paragraphs":
            continue
        with_pairs = BM25Index.build(doc.unit_texts(), RetrievalConfig(bigram_weight=0.25))
        ranks["paragraphs BM25 + bigrams"] = _ranks([[h.unit for h in with_pairs.search(q, 8)] for q in case.queries], gold)
        for model in ("minilm", "static"):  # BM25's top 8: the dense stage's pool
            embeddings = BM25Index.build(doc.unit_texts(), RetrievalConfig(rerank_model=model)).embeddings
            for fusion, weight in (("rrf", 0.0), ("score", 0.3), ("dense", 1.0)):
                ordered = []
                for query, pool in zip(case.queries, pools):
                    units = np.array([h.unit for h in pool])
                    fused = fuse(fusion, np.array([h.score for h in pool]), embeddings.similarities(query, units), weight)
                    ordered.append([int(units[i]) for i in np.lexsort((units, -fused))])
                ranks[f"{model} {fusion}"] = _ranks(ordered, gold)
            # Each unit embedded once for all fusions: MiniLM the candidates only (one pass per
            # query with new ones), the static stage every unit in one pass.
            if model == "minilm":
                assert embeddings.num_embedded == len({h.unit for p in pools for h in p}) < doc.num_units
            else:
                assert embeddings.num_embedded == doc.num_units and embeddings.passes == 1
    n = len(case.queries)
    recall = {}
    for name, r in ranks.items():
        recall[name] = at = {k: sum(x is not None and x <= k for x in r) / n for k in (1, 4, 8)}
        assert at[1] <= at[4] <= at[8], name
        assert at[1] >= 0.75 and at[8] >= 0.9, (name, at)
    # One article per unit ranks the asked article at least as well as merged neighbours.
    assert recall["paragraphs BM25"][1] >= recall["merged BM25"][1]
    # Fusions only reorder BM25's candidates: what BM25 misses at 8, they miss too.
    missed = {i for i, x in enumerate(ranks["paragraphs BM25"]) if x is None}
    assert all({i for i, x in enumerate(r) if x is None} == missed for name, r in ranks.items() if " BM25" not in name)
    # A description sharing no name with its article ("John B. Watson"): units holding that
    # article alone rank it higher than merged or fixed ones, and either embedder's score fusion
    # lifts it further, to the top; so does the pair "american psychologist", in the words' order.
    watson = case.queries.index("American psychologist (1878–1958)")
    assert ranks["fixed BM25"][watson] > ranks["merged BM25"][watson] > ranks["paragraphs BM25"][watson] > 1
    assert ranks["minilm score"][watson] == ranks["static score"][watson] == ranks["paragraphs BM25 + bigrams"][watson] == 1
    assert recall["paragraphs BM25 + bigrams"][1] >= recall["paragraphs BM25"][1]


@pytest.mark.parametrize("name", ["boolq", "fanoutqa"])
def test_question_sets_hide_their_evidence_once_and_bm25_finds_it(tokenizer, name):
    """The two question sets of registry packages (BoolQ's search questions with their own
    paragraph, FanOutQA's sub-questions with their article), on a fixed ~8K-token case: each
    asked article is inserted exactly once (no package article of the same title stays), the
    haystack keeps its length, and the default retriever ranks almost every article first."""
    from bench.retrieval import REAL_SETS, LengthPlan, article_token_counts, real_document, real_queries

    paragraphs = wiki_paragraphs()
    counts = article_token_counts(tokenizer, paragraphs)
    qset = REAL_SETS[name](paragraphs, tokenizer)
    assert len(qset.asks) == {"boolq": 2938, "fanoutqa": 542}[name]  # distinct paragraphs / (question, article) pairs
    case = real_queries(paragraphs, counts, qset, LengthPlan("8K", 8000, 1, 24), random.Random(0))
    titles = Counter(a["title"].lower() for a in case.articles)
    assert len(case.queries) == 24 and all(titles[case.articles[t]["title"].lower()] == 1 for t in case.targets)
    doc, gold = real_document(tokenizer, case, DocumentConfig(chunk_tokens=2000))
    assert 7000 <= doc.num_tokens <= 8400 and all(len(g) >= 1 for g in gold)
    index = BM25Index.build(doc.unit_texts(), RetrievalConfig())
    ranks = _ranks([[h.unit for h in index.search(q, 8)] for q in case.queries], gold)
    first, top4 = sum(r == 1 for r in ranks), sum(r is not None and r <= 4 for r in ranks)
    assert first >= 21 and top4 == 24, ranks
    if name == "boolq":
        # A search question naming its article another way ("district of columbia" for
        # Washington, D.C.) comes second by words; MiniLM alone over BM25's top 8 puts it first.
        dc = case.queries.index("is district of columbia a state in the usa")
        assert ranks[dc] == 2
        pool = index.search(case.queries[dc], 8)
        units = np.array([h.unit for h in pool])
        sims = BM25Index.build(doc.unit_texts(), RetrievalConfig(rerank_model="minilm")).embeddings.similarities(case.queries[dc], units)
        assert units[np.argmax(sims)] in gold[dc]


def test_an_inserted_set_keeps_two_paragraphs_of_one_title_apart(tokenizer):
    """BoolQ holds several paragraphs of one article: asked together, each is inserted and each
    question's target is its own paragraph; the package's article of that title leaves."""
    from bench.retrieval import Ask, LengthPlan, QuerySet, article_token_counts, real_queries

    paragraphs = wiki_paragraphs()
    counts = article_token_counts(tokenizer, paragraphs)
    title = paragraphs[0]["title"]
    asks = (Ask("first question", None, title, "One paragraph of it.", 6), Ask("second question", None, title, "Another paragraph.", 5))
    case = real_queries(paragraphs, counts, QuerySet("two", "two", asks, insert=True), LengthPlan("8K", 8000, 1, 2), random.Random(0))
    by_query = {q: case.articles[t]["text"] for q, t in zip(case.queries, case.targets)}
    assert by_query == {"first question": "One paragraph of it.", "second question": "Another paragraph."}
    assert sum(a["title"] == title for a in case.articles) == 2


def test_static_embeddings_are_idf_weighted_piece_sums():
    """A unit is the idf-weighted sum of its word pieces' distilled vectors (sublinear counts),
    normalised; a query is compared by cosine. Checked by hand on three tiny units."""
    from infmem_verl.agent.rerank import _load_minilm
    from infmem_verl.agent.static_embed import StaticEmbeddings, load_table

    tokenizer, _ = _load_minilm()
    table = load_table()
    assert table.shape == (tokenizer.vocab_size, 384)
    np.testing.assert_allclose(table.mean(0), 0.0, atol=1e-4)  # centred
    cat, dog, river = (tokenizer.convert_tokens_to_ids(w) for w in ("cat", "dog", "river"))
    embeddings = StaticEmbeddings(["cat cat dog", "dog", "river"])
    # idf over the 3 units: cat and river in 1 (ln(1 + 2.5/1.5)), dog in 2 (ln(1 + 1.5/2.5)).
    rare, common = math.log(1 + 2.5 / 1.5), math.log(1 + 1.5 / 2.5)
    unit0 = (1 + math.log(2)) * rare * table[cat] + common * table[dog]
    query = rare * table[cat]
    expected = unit0 @ query / (np.linalg.norm(unit0) * np.linalg.norm(query))
    sims = embeddings.similarities("Cat", np.array([0, 1, 2]))
    np.testing.assert_allclose(sims[0], expected, rtol=1e-5)
    np.testing.assert_allclose(sims[1:], [table[dog] @ table[cat], table[river] @ table[cat]] / (np.linalg.norm(table[[dog, river]], axis=1) * np.linalg.norm(table[cat])), rtol=1e-5)
    assert embeddings.passes == 1 and embeddings.num_embedded == 3
    embeddings.similarities("dog", np.array([2, 0]))
    assert embeddings.passes == 1  # one pass per document, whatever the queries
    # A query of pieces the document never holds still embeds (idf is positive for all pieces).
    assert np.all(np.isfinite(embeddings.similarities("zebra", np.array([0, 1, 2]))))
