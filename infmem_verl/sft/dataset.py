"""verl's multi-turn SFT dataset, serving our stored token ids instead of re-rendered messages.

verl 0.9.1's ``MultiTurnSFTDataset`` tokenizes each chat message on its own through the chat
template and trains on every token of assistant messages. For our distilled calls that is wrong
three ways:

* Qwen3's template renders a lone assistant message without its thinking (the ``<think>`` block
  is only kept after the last user turn, and a lone message has none), so the stock class either
  fails its own consistency check or, with ``ignore_input_ids_mismatch``, trains on the answer
  text with the whole thinking dropped;
* re-tokenized text is not the agent core's ids: the prompt builder concatenates separately
  tokenized slots, which BPE may merge differently when the text is tokenized whole;
* the closing tag a two-stage call injected would be trained as if the model had written it.

:class:`TokenSFTDataset` subclasses it (same config keys, same item layout for verl's collator
and ``sft_loss``) but reads the ``input_ids`` / ``loss_mask`` columns the distillation wrote.
Recipes select it with ``data.custom_cls`` (verl's own extension point).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from verl.utils.dataset.dataset_utils import DatasetPadMode
from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

from .samples import TOKEN_COLUMNS, check_columns


class TokenSFTDataset(MultiTurnSFTDataset):
    """SFT samples as stored token ids and loss masks (see the module docstring).

    Config keys are verl's: ``max_length``, ``truncation`` (``error`` / ``left`` / ``right``),
    ``pad_mode`` (``no_padding`` / ``right``), ``shuffle`` and ``seed`` (which rows
    ``max_samples`` keeps). Items are what the stock class returns for the same pad mode.
    """

    def _read_files_and_process(self) -> None:
        tables = [_token_table(path) for path in self.parquet_files]
        table = pa.concat_tables(tables) if tables else None
        if table is None or table.num_rows == 0:
            raise ValueError(f"data files {list(self.parquet_files)}: expected at least one SFT sample, found none")
        total = table.num_rows
        if 0 < self.max_samples < total:
            # The stock class's selection, so max_samples keeps the same rows in both classes.
            if self.shuffle:
                rng = np.random.default_rng(*((self.seed,) if self.seed is not None else ()))
                indices = rng.choice(total, size=self.max_samples, replace=False)
            else:
                indices = np.arange(self.max_samples)
            table = table.take(pa.array(indices))
        self._input_ids = table.column("input_ids").combine_chunks()
        self._loss_mask = table.column("loss_mask").combine_chunks()

    def __len__(self) -> int:
        return len(self._input_ids)

    def __getitem__(self, item: int) -> dict[str, torch.Tensor]:
        input_ids = torch.from_numpy(self._input_ids[item].values.to_numpy(zero_copy_only=False).astype(np.int64))
        loss_mask = torch.from_numpy(self._loss_mask[item].values.to_numpy(zero_copy_only=False).astype(np.int64))
        input_ids, loss_mask = self._truncate(input_ids, loss_mask, item)
        length = input_ids.shape[0]
        position_ids = torch.arange(length, dtype=torch.long)
        if self.pad_mode == DatasetPadMode.NO_PADDING:
            return {"input_ids": input_ids, "position_ids": position_ids, "loss_mask": loss_mask}
        pad = self.max_length - length
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return {
            "input_ids": F.pad(input_ids, (0, pad), value=pad_id),
            "attention_mask": F.pad(torch.ones(length, dtype=torch.long), (0, pad), value=0),
            "position_ids": F.pad(position_ids, (0, pad), value=0),
            "loss_mask": F.pad(loss_mask, (0, pad), value=0),
        }

    def _truncate(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, item: int) -> tuple[torch.Tensor, torch.Tensor]:
        if input_ids.shape[0] <= self.max_length:
            return input_ids, loss_mask
        if self.truncation == "error":
            raise ValueError(
                f"data.max_length: sample {item} has {input_ids.shape[0]} tokens, more than {self.max_length}; "
                "raise data.max_length or rebuild the SFT file with a smaller --max-length"
            )
        keep = slice(-self.max_length, None) if self.truncation == "left" else slice(None, self.max_length)
        return input_ids[keep], loss_mask[keep]


def _token_table(path: str) -> pa.Table:
    """The token columns of one SFT parquet, checked row by row."""
    check_columns(path, TOKEN_COLUMNS)
    table = pq.read_table(path, columns=list(TOKEN_COLUMNS))
    ids, mask = table.column("input_ids"), table.column("loss_mask")
    same = pc.equal(pc.list_value_length(ids), pc.list_value_length(mask))
    if not pc.all(same).as_py():
        row = pc.index(same, False).as_py()
        raise ValueError(f"{path}: row {row}: input_ids and loss_mask differ in length")
    values = pc.list_flatten(mask)
    if len(values) and not pc.all(pc.is_in(values, value_set=pa.array([0, 1], pa.int8()))).as_py():
        raise ValueError(f"{path}: loss_mask: expected only 0 and 1")
    return table
