"""SFT on a machine without a GPU: verl's SFT pieces in one process, for smoke runs and tests.

verl 0.9.1's ``SFTTrainer`` cannot start without CUDA: it initialises an NCCL process group and
asks ``torch.cuda`` for memory figures before building anything. This loop keeps every piece that
decides *what* is trained and swaps only the FSDP engine:

* the dataset comes from verl's ``create_sft_dataset`` (so ``data.custom_cls`` selects
  :class:`~infmem_verl.sft.dataset.TokenSFTDataset`, as on GPUs);
* batches go through verl's ``SFTTensorCollator`` (``no_padding``: nested tensors);
* the loss is verl's ``sft_loss`` on a ``TensorDict`` built by verl's ``tensordict_utils``, with
  ``batch_num_tokens`` and ``dp_size`` set as verl's FSDP engine sets them, so a step's loss is
  the token mean over the global batch and the loss mask's alignment is verl's;
* the optimizer is verl's ``build_optimizer`` on ``optim`` and the learning-rate schedule is the
  FSDP engine's (:func:`infmem_verl.cpu.engine.build_lr_scheduler`);
* the step count is the one :mod:`infmem_verl.sft.launch` derived and printed before the run
  (passed in, so this module never imports the launcher that imports it).

What differs: one process, float32, micro-batches run as right-padded batches of the Hugging Face
model, cut from each batch by length (:func:`length_groups`; verl's engine packs the rows instead,
with no padding; log-probs are only computed where the mask trains, the rest are zeros that the mask drops),
and the checkpoint is the Hugging Face folder verl writes under ``global_step_N/huggingface``.
Each step's loss and learning rate are also appended to ``sft_losses.jsonl`` in
``trainer.default_local_dir`` (flushed per step: the warm-up's progress bar and its loss curve
read it).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from omegaconf import DictConfig
from tensordict import TensorDict

from infmem_verl.cpu.engine import build_lr_scheduler, load_model


LOSS_LOG = "sft_losses.jsonl"
# What one more micro-batch costs, in padded tokens: the demo curriculum's steps were about as fast
# at 256 and 512 and slower at 64 and 0 (a call per length); 2026-12-07 log.
MICRO_BATCH_OVERHEAD_TOKENS = 256

@dataclass
class CPUTrainResult:
    """What a CPU SFT run did: per-step losses, the loss over the data before and after (NaN with
    ``sft.data_loss`` off), and the checkpoint folder (a Hugging Face model, the RL recipes' ``model.path``)."""

    steps: int
    losses: list[float] = field(default_factory=list)
    loss_before: float = math.nan
    loss_after: float = math.nan
    checkpoint: Path | None = None
    seconds: float = 0.0


def train_on_cpu(config: DictConfig, steps: int) -> CPUTrainResult:
    """Run ``steps`` optimizer steps of the SFT ``config`` describes (verl's ``sft_trainer_engine``
    keys) on the CPU."""
    from verl.trainer.sft_trainer import create_sft_dataset
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.dataset.dataset_utils import SFTTensorCollator
    from verl.workers.config.optimizer import build_optimizer

    from infmem_verl.assets import load_tokenizer

    started = time.perf_counter()
    torch.manual_seed(int(config.trainer.seed))
    tokenizer = load_tokenizer(str(config.model.get("tokenizer_path") or config.model.path))
    model = load_model(str(config.model.path))
    dataset = create_sft_dataset(config.data.train_files, config.data, tokenizer, None, config.data.get("train_max_samples", -1))
    collate = SFTTensorCollator(config.data.pad_mode)
    batch_size = int(config.data.train_batch_size)
    generator = torch.Generator().manual_seed(int(config.trainer.seed))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, collate_fn=list, generator=generator)
    optim = omega_conf_to_dataclass(config.optim)
    optim.total_training_steps = steps
    optimizer = build_optimizer(model.parameters(), optim)
    scheduler = build_lr_scheduler(optimizer, optim, key="optim")
    micro = int(config.data.micro_batch_size_per_gpu)
    pad_id = tokenizer.pad_token_id or 0

    result = CPUTrainResult(steps=steps)
    data_loss = bool(config.sft.get("data_loss", True))
    if data_loss:
        result.loss_before = dataset_loss(model, dataset, collate, micro, pad_id)
    model.train()
    root = Path(config.trainer.default_local_dir)
    root.mkdir(parents=True, exist_ok=True)
    loss_log = (root / LOSS_LOG).open("w")
    step = 0
    while step < steps:
        for items in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(model, items, collate, micro, pad_id, backward=True)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=optim.clip_grad)
            optimizer.step()
            scheduler.step()
            step += 1
            result.losses.append(loss)
            lr = scheduler.get_last_lr()[0]
            print(f"[sft-cpu] step {step}/{steps} loss {loss:.4f} lr {lr:.3g}")
            loss_log.write(json.dumps({"step": step, "loss": loss, "lr": lr}) + "\n")
            loss_log.flush()
            if step >= steps:
                break
    loss_log.close()
    if data_loss:
        result.loss_after = dataset_loss(model, dataset, collate, micro, pad_id)
    result.checkpoint = _save(model, tokenizer, root, step)
    result.seconds = time.perf_counter() - started
    if data_loss:
        print(f"[sft-cpu] loss over the data {result.loss_before:.4f} -> {result.loss_after:.4f}")
    print(f"[sft-cpu] model: {result.checkpoint}")
    return result


def batch_loss(model, items: list[dict[str, Any]], collate, micro: int, pad_id: int, backward: bool) -> float:
    """verl's token-mean SFT loss of one global batch, accumulated over micro-batches."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import sft_loss

    # As verl's FSDP engine: the loss of every micro-batch is divided by the batch's trained tokens.
    batch_tokens = sum(int(item["loss_mask"].sum()) for item in items)
    total = 0.0
    for group in length_groups([len(item["input_ids"]) for item in items], micro):
        data = tu.get_tensordict(tensor_dict=collate([items[i] for i in group]), non_tensor_dict={"pad_mode": "no_padding"})
        tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=max(batch_tokens, 1))
        with torch.set_grad_enabled(backward):
            loss, _ = sft_loss(None, {"log_probs": _log_probs(model, data, pad_id)}, data)
            if backward:
                loss.backward()
        total += float(loss.detach())
    return total


def length_groups(lengths: Sequence[int], most_rows: int) -> list[list[int]]:
    """The samples of a batch (their indices) in micro-batches of at most ``most_rows`` rows of
    similar lengths.

    A micro-batch runs right-padded to its longest row, so a batch of short answer calls and long
    Writes in one micro-batch pays for the Writes' length in every row (the demo curriculum's
    MemAgent batches: 73% of the padded tokens are real, its InfMem batches 50%). The split taken
    minimises padded tokens plus :data:`MICRO_BATCH_OVERHEAD_TOKENS` per micro-batch; for that cost
    an optimal split is a run of contiguous stretches of the length order, which a small dynamic
    programme finds. The loss is unchanged: every micro-batch is divided by the whole batch's
    trained tokens, as verl's engine does.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best = [0.0] + [math.inf] * len(order)  # best[end]: the cheapest split of order[:end]
    cut = [0] * (len(order) + 1)  # where that split's last micro-batch starts
    for end in range(1, len(order) + 1):
        for start in range(max(0, end - most_rows), end):
            cost = best[start] + (end - start) * lengths[order[end - 1]] + MICRO_BATCH_OVERHEAD_TOKENS
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def dataset_loss(model, dataset, collate, micro: int, pad_id: int) -> float:
    """Token-mean loss over every sample of ``dataset`` (no gradient)."""
    model.eval()
    with torch.no_grad():
        loss = batch_loss(model, [dataset[i] for i in range(len(dataset))], collate, micro, pad_id, backward=False)
    return loss


def _log_probs(model, data: TensorDict, pad_id: int) -> torch.Tensor:
    """Nested log-probs laid out as verl's engine returns them: ``out[i]`` is the log-prob of
    token ``i + 1`` (the last of each sample pairs with nothing and is masked by ``sft_loss``).

    Only positions whose next token is trained are computed: with Qwen's 152K vocabulary a full
    log-softmax over a long prompt would dominate the run, and the mask zeroes the others anyway.
    Rows are right-padded and attention is causal, so no real token ever sees a pad: no attention
    mask is passed, which lets PyTorch's fused causal attention run (about twice as fast on CPU
    as the masked path, the same values at every real position).
    """
    input_ids, loss_mask = data["input_ids"], data["loss_mask"]
    sequences = list(input_ids.unbind())
    masks = list(loss_mask.unbind())
    lengths = [len(s) for s in sequences]
    width = max(lengths)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    targets = torch.zeros((len(sequences), width), dtype=torch.bool)
    for row, (sequence, mask) in enumerate(zip(sequences, masks)):
        ids[row, : len(sequence)] = sequence
        targets[row, : len(sequence) - 1] = mask[1:].bool()
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    rows, cols = targets.nonzero(as_tuple=True)
    logits = model.get_output_embeddings()(hidden[rows, cols]).float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, ids[rows, cols + 1].unsqueeze(-1)).squeeze(-1)
    dense = torch.zeros((len(sequences), width), dtype=picked.dtype)
    dense = dense.index_put((rows, cols), picked)
    values = torch.cat([dense[row, :length] for row, length in enumerate(lengths)])
    return torch.nested.nested_tensor_from_jagged(values, input_ids.offsets())


def _save(model, tokenizer, root: Path, step: int) -> Path:
    """The model and tokenizer where verl's checkpoint manager puts its Hugging Face copy (written
    aside and renamed: a folder that exists is whole, which the warm-up's resume relies on)."""
    import shutil

    folder = root / f"global_step_{step}" / "huggingface"
    tmp = folder.with_name(f"{folder.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
