"""SFT samples from distilled turns, and the parquet file verl's SFT trainer reads.

One sample per LLM call: the call's prompt ids followed by its response ids, with a loss mask
that is 0 on every prompt token and on the tokens the loop injected, 1 on what the teacher
generated (its end token included, so the student learns to stop); a response whose thinking was
rewritten (:mod:`infmem_verl.sft.shorten`) is trained whole. The ids are the agent core's
own (see :mod:`infmem_verl.sft.records`), so the student is trained on exactly the prompts it will
see in RL and evaluation, and never on the 5K-token document chunks (spec §8.2 item 10: the
reference trained on the whole sequence).

The parquet rows carry the token columns our dataset class serves
(:class:`infmem_verl.sft.dataset.TokenSFTDataset`, selected through verl's ``data.custom_cls``)
and a ``messages`` column with the same call as chat messages, so verl's stock
``MultiTurnSFTDataset`` and other tools can read the file too (lossy: they re-render the text,
see the dataset module).

Answer up-weighting (an option the reference used, spec §5.1): the answer sample of a trajectory
is written ``answer_copies`` times; ``"reference"`` gives the reference's
``1 + floor((calls - 1) / 2)``. Duplicates are whole rows, so every trainer weights them the same.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_prep.io import ParquetRowWriter
from infmem_verl.data.identity import IdLedger

from .records import TurnRecord

AnswerCopies = int | Literal["reference"]
# Rows per row group: a row is up to ~12K token ids, so a group stays near 10 MB.
ROW_GROUP_SIZE = 256
# Schema-metadata key holding what the token ids were made with (checked against the model).
METADATA_KEY = b"infmem_sft"
_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"

# The columns our dataset class trains from (the rest of SFT_SCHEMA describes the samples).
TOKEN_COLUMNS = ("input_ids", "loss_mask")

SFT_SCHEMA = pa.schema(
    [
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("enable_thinking", pa.bool_()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("num_trained", pa.int32()),
        ("sample_id", pa.string()),
        ("source", pa.string()),
        ("turn", pa.int32()),
        ("kind", pa.string()),
        ("copy", pa.int32()),
        ("shortened", pa.bool_()),
    ]
)


@dataclass
class SFTSample:
    """One training sequence: a call's prompt and response ids, and which of them are trained."""

    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8, 1 on trained tokens
    prompt_tokens: int
    kind: str
    turn: int  # index of the call in its trajectory
    copy: int = 0  # > 0 for the duplicates of answer up-weighting
    shortened: bool = False


def turn_sample(turn: TurnRecord, index: int) -> SFTSample:
    """The sample of one call: prompt (never trained) + response (trained where generated)."""
    if turn.short_response_ids is not None:
        response = turn.short_response_ids
        mask = np.ones(len(response), dtype=np.int8)  # the rewrite, closing tag included, is the target
    else:
        response, mask = turn.response_ids, turn.response_mask
    prompt = np.asarray(turn.prompt_ids, dtype=np.int32)
    return SFTSample(
        input_ids=np.concatenate([prompt, np.asarray(response, dtype=np.int32)]),
        loss_mask=np.concatenate([np.zeros(len(prompt), dtype=np.int8), np.asarray(mask, dtype=np.int8)]),
        prompt_tokens=len(prompt),
        kind=turn.kind,
        turn=index,
        shortened=turn.short_response_ids is not None,
    )


def answer_copy_count(setting: AnswerCopies, calls: int) -> int:
    """How many times a trajectory of ``calls`` LLM calls writes its answer sample."""
    if setting == "reference":
        return 1 + (calls - 1) // 2
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"answer_copies: expected an integer >= 1 or 'reference', got {setting!r}")
    return setting


def trajectory_samples(turns: Sequence[TurnRecord], answer_copies: AnswerCopies) -> list[SFTSample]:
    """Every call of a trajectory as a sample, the answer written ``answer_copies`` times."""
    samples = []
    for index, turn in enumerate(turns):
        sample = turn_sample(turn, index)
        samples.append(sample)
        if turn.kind == "answer":
            copies = answer_copy_count(answer_copies, len(turns))
            samples += [_duplicate(sample, number) for number in range(1, copies)]
    return samples


def _duplicate(sample: SFTSample, number: int) -> SFTSample:
    return SFTSample(sample.input_ids, sample.loss_mask, sample.prompt_tokens, sample.kind, sample.turn, number, sample.shortened)


def chat_messages(prompt_text: str, response_text: str) -> list[dict[str, str]]:
    """The chat messages of a ChatML prompt (rendered with its special tokens) and a response.

    The prompt ends with the assistant header the chat template added; the response becomes that
    assistant message's content. Raises ValueError for a prompt that is not ChatML (our models,
    Qwen3 and Qwen2.5, all are).
    """
    parts = prompt_text.split(_IM_START)
    if parts[0].strip() or len(parts) < 3:
        raise ValueError("prompt: expected a ChatML prompt (<|im_start|>role ... <|im_end|>), got other text")
    messages = []
    for part in parts[1:-1]:
        role, _, rest = part.partition("\n")
        content, closed, _ = rest.partition(_IM_END)
        if not closed:
            raise ValueError(f"prompt: the {role!r} message of the ChatML prompt is not closed")
        messages.append({"role": role, "content": content})
    role, _, pending = parts[-1].partition("\n")
    if role != "assistant":
        raise ValueError(f"prompt: expected the ChatML prompt to end with the assistant header, got {role!r}")
    # Qwen3 with thinking off puts an empty think block in the generation prompt: keep it with
    # the response, as the chat template renders an assistant message.
    messages.append({"role": "assistant", "content": pending + response_text})
    return messages


@dataclass(frozen=True)
class TokenizerStamp:
    """What the token ids were made with; a model with another chat template or vocabulary would
    be trained on prompts it never sees (checked by the SFT entry point)."""

    name: str
    vocab_size: int
    chat_template_sha256: str

    @classmethod
    def of(cls, tokenizer: Any) -> TokenizerStamp:
        template = getattr(tokenizer, "chat_template", None) or ""
        return cls(
            name=str(getattr(tokenizer, "name_or_path", "")),
            vocab_size=len(tokenizer),
            chat_template_sha256=hashlib.sha256(template.encode("utf-8")).hexdigest(),
        )

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "vocab_size": self.vocab_size, "chat_template_sha256": self.chat_template_sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TokenizerStamp:
        return cls(data["name"], int(data["vocab_size"]), data["chat_template_sha256"])

    def differences(self, other: TokenizerStamp) -> list[str]:
        """What of ``other`` would give other token ids: ``"chat template"``, ``"vocabulary"`` (the
        name is not compared: one tokenizer has many paths)."""
        differ = []
        if self.chat_template_sha256 != other.chat_template_sha256:
            differ.append("chat template")
        if self.vocab_size != other.vocab_size:
            differ.append("vocabulary")
        return differ


def check_columns(path: str | os.PathLike, columns: Iterable[str]) -> None:
    """ValueError naming the first of ``columns`` (of :data:`SFT_SCHEMA`) the parquet at ``path`` lacks."""
    names = pq.read_schema(os.fspath(path)).names
    for column in columns:
        if column not in names:
            raise ValueError(
                f"{path}: lacks column {column!r} (it has {names}); build SFT files with `python -m infmem_verl.distill`"
            )


def read_stamp(path: str | os.PathLike) -> TokenizerStamp | None:
    """The tokenizer stamp of an SFT parquet, or None for a file written by someone else."""
    metadata = pq.read_schema(os.fspath(path)).metadata or {}
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    return TokenizerStamp.from_json(json.loads(raw))


class SFTWriter:
    """Streams samples of one tokenizer into an SFT parquet (see :data:`SFT_SCHEMA`).

    ``path`` is written as given; callers wanting an all-or-nothing file write to a temporary path
    and rename (see :func:`data_prep.io.atomic_outputs`).
    """

    def __init__(self, path: str | os.PathLike, tokenizer: Any, thinking: bool) -> None:
        self.tokenizer = tokenizer
        self.thinking = thinking
        stamp = json.dumps(TokenizerStamp.of(tokenizer).to_json()).encode("utf-8")
        self._rows = ParquetRowWriter(path, SFT_SCHEMA.with_metadata({METADATA_KEY: stamp}), ROW_GROUP_SIZE)
        self._rows_written = IdLedger("sample_id, turn, copy")

    def write(self, sample: SFTSample, sample_id: str, source: str) -> None:
        """Write one row; a second row of the same sample, turn and copy is refused (two
        trajectories under one sample id would be trained twice, one of them unnamed)."""
        self._rows_written.claim((sample_id, sample.turn, sample.copy), f"{self._rows.path}: row {len(self._rows_written)}")
        prompt = sample.input_ids[: sample.prompt_tokens]
        response = sample.input_ids[sample.prompt_tokens :]
        prompt_text = self.tokenizer.decode(prompt.tolist(), skip_special_tokens=False)
        response_text = self.tokenizer.decode(response.tolist(), skip_special_tokens=True)
        self._rows.write(
            {
                "messages": chat_messages(prompt_text, response_text),
                "enable_thinking": self.thinking,
                "input_ids": sample.input_ids.tolist(),
                "loss_mask": sample.loss_mask.tolist(),
                "num_tokens": len(sample.input_ids),
                "num_trained": int(sample.loss_mask.sum()),
                "sample_id": sample_id,
                "source": source,
                "turn": sample.turn,
                "kind": sample.kind,
                "copy": sample.copy,
                "shortened": sample.shortened,
            }
        )

    def close(self) -> None:
        self._rows.close()


def split_of(sample_id: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for a trajectory, stable across runs: whole trajectories go to
    one side, so no validation call shares its prompt prefix with a training call."""
    if val_fraction <= 0:
        return "train"
    digest = hashlib.sha256(sample_id.encode("utf-8")).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def longest_sample(paths: Iterable[str | os.PathLike]) -> int:
    """The most tokens of any sample in ``paths`` (from the ``num_tokens`` column)."""
    longest = 0
    for path in paths:
        column = pq.read_table(os.fspath(path), columns=["num_tokens"]).column("num_tokens")
        if len(column):
            longest = max(longest, int(pc.max(column).as_py()))
    return longest


def sft_paths(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Where the SFT files of a distillation folder live, by split."""
    out_dir = Path(out_dir)
    return {"train": out_dir / "sft_train.parquet", "val": out_dir / "sft_val.parquet"}
