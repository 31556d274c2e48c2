"""SFT samples and their training: token-exact samples, verl's dataset and loss on our parquet,
the stock verl dataset's failure on Qwen3 thinking, records, and the SFT recipes.

Samples come from a scripted-teacher distillation through the real agent core (see
``test_distill.py``) whose Writes overrun their thinking budget, so the loop injects closing tags.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from omegaconf import OmegaConf

from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.policy import Generation, SamplingParams
from infmem_verl.distill import DistillConfig, distill
from infmem_verl.policy.source import ModelSource, OpenedModel
from infmem_verl.sft.launch import prepare_sft_config
from infmem_verl.sft.records import RecordError, TurnRecord, TurnStore, pack_ids, read_turns, unpack_ids
from infmem_verl.sft.samples import chat_messages, sft_paths

from test_distill import OVERRIDES, scripted_teacher

RECIPES = ("sft_4b", "sft_1p7b", "sft_qwen25_7b", "sft_smoke")


@dataclass
class Call:
    prompt: np.ndarray
    generation: Generation


class RecordingPolicy:
    """Records every prompt a policy is sent and what it returned (works over any policy)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[Call] = []

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generation:
        generation = await self.inner.generate(prompt_ids, params)
        self.calls.append(Call(np.asarray(prompt_ids, dtype=np.int32), generation))
        return generation

    async def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            await close()


def samples_from_calls(calls: list[Call], injected: np.ndarray) -> Counter:
    """The (input ids, loss mask) of every protocol call, rebuilt from the generate calls alone.

    A call whose prompt is an earlier call's prompt + generation (+ the injected closing tag) is
    that call's second stage. Each turn trains on what was generated, never on the prompt or on
    the injected tokens.
    """
    by_continuation = {np.concatenate([c.prompt, c.generation.token_ids]).astype(np.int32).tobytes(): c for c in calls}
    second: dict[int, tuple[Call, bool]] = {}
    for call in calls:
        for cut, was_injected in ((len(call.prompt) - len(injected), True), (len(call.prompt), False)):
            first = by_continuation.get(call.prompt[:cut].tobytes())
            if first is not None and (not was_injected or np.array_equal(call.prompt[cut:], injected)):
                second[id(first)] = (call, was_injected)
                break
    stage_two = {id(call) for call, _ in second.values()}
    expected: Counter = Counter()
    for call in calls:
        if id(call) in stage_two:
            continue
        ids = [call.prompt, np.asarray(call.generation.token_ids, dtype=np.int32)]
        mask = [np.zeros(len(call.prompt)), np.ones(len(call.generation.token_ids))]
        if id(call) in second:
            follow, was_injected = second[id(call)]
            tag = injected if was_injected else np.zeros(0, dtype=np.int32)
            ids += [tag, np.asarray(follow.generation.token_ids, dtype=np.int32)]
            mask += [np.zeros(len(tag)), np.ones(len(follow.generation.token_ids))]
        expected[(np.concatenate(ids).astype(np.int64).tobytes(), np.concatenate(mask).astype(np.int64).tobytes())] += 1
    return expected


def sft_config(*overrides: str):
    with initialize_config_dir(str(conf_dir() / "sft"), version_base=None):
        return compose("sft_trainer", overrides=list(overrides))


def close_think_ids(tokenizer) -> np.ndarray:
    return np.asarray(tokenizer.encode("\n</think>\n\n", add_special_tokens=False), dtype=np.int32)


@pytest.fixture(scope="module")
def distilled(tokenizer, tmp_path_factory):
    """A distillation whose Writes think past their budget (the loop closes their thinking)."""
    from infmem_verl.data.synthetic import make_dataset
    from data_prep.training import TrainingWriter

    samples = make_dataset(2, 2048, tokenizer, seed=8)
    root = tmp_path_factory.mktemp("sft")
    data = root / "train.parquet"
    writer = TrainingWriter(data, root / "docs.parquet", root / "docs.parquet", "infmem_agent", inline_context=True)
    for sample in samples:
        writer.write(sample)
    writer.close()

    def special(kind: str, text: str) -> str | None:
        if kind == "write" and text.endswith("</think>\n\n"):  # the second stage, after the injected tag
            return "The sculptor trained under a master."
        if kind == "write":
            return "<think>\n" + "The chunk names a sculptor and a town, and a master. " * 8
        return None

    scripted = scripted_teacher(tokenizer, samples, special=special)
    recorder = RecordingPolicy(scripted.policy)
    out = root / "out"
    cfg = DistillConfig(out=out, data=data, recipe="smoke", overrides=OVERRIDES, source=ModelSource(concurrency=2), progress=False)
    report = asyncio.run(distill(cfg, OpenedModel(recorder, tokenizer, "scripted")))
    assert report.kept == 2
    return out, recorder.calls


def test_each_sample_trains_exactly_the_generated_ids_of_one_call(tokenizer, distilled):
    out, calls = distilled
    table = pq.read_table(sft_paths(out)["train"]).to_pylist()
    written = Counter(
        (np.asarray(r["input_ids"], dtype=np.int64).tobytes(), np.asarray(r["loss_mask"], dtype=np.int64).tobytes()) for r in table
    )
    assert written == samples_from_calls(calls, close_think_ids(tokenizer))
    injected_rows = [r for r in table if r["kind"] == "write"]
    assert injected_rows, "the fixture's Writes have a closing tag injected by the loop"
    for row in injected_rows:
        ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
        # Untrained: the prompt, then (last) the tag the loop injected; the end token is trained.
        assert tokenizer.decode(ids[mask == 0][-3:].tolist()) == "\n</think>\n\n"
        assert ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>") and mask[-1] == 1


@pytest.mark.parametrize("pad_mode", ["no_padding", "right"])
def test_verl_sft_dataset_loads_our_parquet_with_the_mask_token_by_token(tokenizer, distilled, pad_mode):
    from verl.trainer.sft_trainer import create_sft_dataset

    from infmem_verl.sft.dataset import TokenSFTDataset

    out, _ = distilled
    path = str(sft_paths(out)["train"])
    config = sft_config("+recipe=sft_smoke", f"data.train_files={path}", f"data.pad_mode={pad_mode}")
    dataset = create_sft_dataset(config.data.train_files, config.data, tokenizer, None)
    assert isinstance(dataset, TokenSFTDataset)
    stored = {entry["sample_id"]: entry for _, entry in TurnStore(out).entries()}
    table = pq.read_table(path).to_pylist()
    assert len(dataset) == len(table)
    for index, row in enumerate(table):
        item = dataset[index]
        entry = stored[row["sample_id"]]
        turn = read_turns(entry, len(entry["turns"]), "infmem", "entry")[row["turn"]]
        expected_ids = np.concatenate([turn.prompt_ids, turn.response_ids])
        expected_mask = np.concatenate([np.zeros(len(turn.prompt_ids)), turn.response_mask])
        length = len(expected_ids)
        np.testing.assert_array_equal(item["input_ids"][:length].numpy(), expected_ids)
        np.testing.assert_array_equal(item["loss_mask"][:length].numpy(), expected_mask)
        if pad_mode == "right":
            assert item["input_ids"].shape[0] == config.data.max_length
            assert int(item["attention_mask"].sum()) == length and not item["loss_mask"][length:].any()


def test_verl_sft_loss_reads_the_mask_as_we_write_it(tokenizer, distilled):
    """verl's loss shifts the mask by one: with log-prob -1 at every position whose next token we
    mark trained and -1000 elsewhere, a correctly read mask gives a loss of exactly 1."""
    from verl.trainer.sft_trainer import create_sft_dataset
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import SFTTensorCollator
    from verl.workers.utils.losses import sft_loss

    out, _ = distilled
    config = sft_config("+recipe=sft_smoke", f"data.train_files={sft_paths(out)['train']}")
    dataset = create_sft_dataset(config.data.train_files, config.data, tokenizer, None)
    items = [dataset[i] for i in range(len(dataset))]
    data = tu.get_tensordict(tensor_dict=SFTTensorCollator("no_padding")(items), non_tensor_dict={"pad_mode": "no_padding"})
    trained = sum(int(item["loss_mask"].sum()) for item in items)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=trained)
    values = torch.cat([torch.where(torch.roll(item["loss_mask"], -1).bool(), -1.0, -1000.0) for item in items])
    log_probs = torch.nested.nested_tensor_from_jagged(values, data["input_ids"].offsets())
    loss, _ = sft_loss(None, {"log_probs": log_probs}, data)
    assert float(loss) == pytest.approx(1.0)


def test_stock_verl_dataset_would_drop_qwen3_thinking(tokenizer, distilled):
    """Why recipes select our dataset class: verl's MultiTurnSFTDataset re-renders each message
    alone, and Qwen3's template then leaves the thinking out of the assistant message."""
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    out, _ = distilled
    path = str(sft_paths(out)["train"])
    base = {"max_length": 8192, "pad_mode": "no_padding", "truncation": "error"}
    with pytest.raises(AssertionError, match="apply_chat_template to each turn separately"):
        MultiTurnSFTDataset(path, tokenizer, OmegaConf.create(base))[0]
    stock = MultiTurnSFTDataset(path, tokenizer, OmegaConf.create(base | {"ignore_input_ids_mismatch": True}))
    row = pq.read_table(path).slice(0, 1).to_pylist()[0]
    ours = np.asarray(row["input_ids"])[np.asarray(row["loss_mask"]) == 1]
    theirs = stock[0]["input_ids"][stock[0]["loss_mask"].bool()].tolist()
    assert "<think>" in tokenizer.decode(ours.tolist()) and "<think>" not in tokenizer.decode(theirs)
    # The messages column is the same call as text: the stock class reads our file at all.
    assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["content"].startswith("<think>")


def test_chat_messages_split_a_chatml_prompt():
    prompt = "<|im_start|>system\nTools here<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"
    assert chat_messages(prompt, "<think>\nx\n</think>\n\nA") == [
        {"role": "system", "content": "Tools here"},
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<think>\nx\n</think>\n\nA"},
    ]
    with pytest.raises(ValueError, match="ChatML"):
        chat_messages("User: Q?\nAssistant:", "A")


def test_records_round_trip_and_damaged_records_name_the_field():
    ids = np.array([151644, 872, 198, 3, 151645], dtype=np.int32)
    np.testing.assert_array_equal(unpack_ids(pack_ids(ids), "x"), ids)
    turn = TurnRecord("answer", 2, ids, ids[:3], np.array([1, 0, 1], dtype=np.int8), "stop", ["think_closed_by_loop"])
    back = TurnRecord.from_json(json.loads(json.dumps(turn.to_json())), "t")
    assert back.kind == "answer" and back.flags == turn.flags and back.response_mask.tolist() == [1, 0, 1]
    with pytest.raises(RecordError, match=r"t\.prompt: packed token ids are damaged"):
        TurnRecord.from_json(turn.to_json() | {"prompt": pack_ids(ids)[:-6]}, "t")
    with pytest.raises(RecordError, match="lacks field 'mask'"):
        TurnRecord.from_json({k: v for k, v in turn.to_json().items() if k != "mask"}, "t")
    with pytest.raises(RecordError, match=r"t\.mask: expected one 0/1 value per response token"):
        TurnRecord.from_json(turn.to_json() | {"mask": pack_ids(np.array([1, 1], dtype=np.int8), "<i1")}, "t")
    write = TurnRecord("write", 0, ids, ids[:2], np.ones(2, dtype=np.int8), "stop").to_json()
    prethink = TurnRecord("prethink", 0, ids, ids[:2], np.ones(2, dtype=np.int8), "stop").to_json()
    entry = {"ref": "r1", "sample_id": "s1", "turns": [prethink, write, turn.to_json()]}
    assert [t.kind for t in read_turns(entry, 3, "infmem", "s1")] == ["prethink", "write", "answer"]
    for broken, reason in (
        (entry | {"turns": [prethink, turn.to_json()]}, r"s1: missing turns \(2 stored, the trajectory had 3\)"),
        (entry | {"turns": [write, prethink, turn.to_json()]}, "write without the PreThink"),
        (entry | {"turns": [prethink, write, write]}, "ends with exactly one answer"),
        (entry | {"turns": None}, "no turn list"),
    ):
        with pytest.raises(RecordError, match=reason):
            read_turns(broken, 3, "infmem", "s1")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_sft_recipe_composes_and_validates(recipe, distilled):
    out, _ = distilled
    config = sft_config(f"+recipe={recipe}", f"data.train_files={sft_paths(out)['train']}", "data.train_batch_size=4")
    prepared = prepare_sft_config(config, gpus=8)
    assert config.data.custom_cls.name == "TokenSFTDataset" and prepared.train_samples >= 4
    assert prepared.backend == "gpu"  # sft_smoke's auto picks the GPUs too
    assert prepared.longest_sample <= config.data.max_length
    if recipe == "sft_smoke":
        assert Path(config.model.path).is_dir() and prepared.tokenizer_check.startswith("matches")
    else:
        assert config.optim.lr == 1e-5 and config.trainer.total_epochs == 1 and config.optim.clip_grad == 0.2
        assert prepared.tokenizer_check.startswith("not checked")  # a hub name, not a local folder
    assert "hf_model" in config.checkpoint.save_contents, "the RL recipes load the Hugging Face copy"
    assert config.engine.strategy == "fsdp2", "the strategy tests/test_verl_cpu_sft.py runs on verl's workers"


def test_bad_sft_configs_name_the_key(tokenizer, distilled, tmp_path):
    out, _ = distilled
    path = str(sft_paths(out)["train"])
    cases = [
        (["+recipe=sft_4b"], 0, "sft.backend: recipe sft_4b needs GPUs"),
        (["+recipe=sft_smoke", "sft.backend=tpu"], 0, "sft.backend: expected one of"),
        (["+recipe=sft_smoke", "sft.backend=verl-cpu", "engine.strategy=fsdp"], 0, "engine.strategy: .*needs fsdp2"),
        (["+recipe=sft_smoke", "data.max_length=64"], 0, "data.max_length: 64 is less than the longest sample"),
        (["+recipe=sft_smoke", "data.train_batch_size=100000"], 0, "data.train_batch_size"),
        (["+recipe=sft_smoke", f"data.train_files={tmp_path / 'missing.parquet'}"], 0, "data.train_files: .* not found"),
        (["+recipe=sft_smoke", "data.custom_cls.name=Nope"], 0, "data.custom_cls: cannot load Nope"),
        (["+recipe=sft_smoke", "optim.lr_scheduler_type=wavy"], 0, "optim:"),
    ]
    for overrides, gpus, match in cases:
        overrides = [overrides[0], f"data.train_files={path}", *overrides[1:]]
        with pytest.raises(ConfigError, match=match):
            prepare_sft_config(sft_config(*overrides), gpus=gpus)

    plain = tmp_path / "plain.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["input_ids"]), plain)
    with pytest.raises(ConfigError, match="lacks column 'input_ids'"):
        prepare_sft_config(sft_config("+recipe=sft_smoke", f"data.train_files={plain}"), gpus=0)

    other = tmp_path / "other_tokenizer"
    tokenizer.save_pretrained(other)
    config_file = other / "tokenizer_config.json"
    settings = json.loads(config_file.read_text())
    settings["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"
    config_file.write_text(json.dumps(settings))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="chat template differs"):
        prepare_sft_config(sft_config("+recipe=sft_smoke", f"data.train_files={path}", f"model.tokenizer_path={other}"), gpus=0)


def test_truncation_follows_verl_settings(tokenizer, distilled):
    from verl.trainer.sft_trainer import create_sft_dataset

    out, _ = distilled
    path = str(sft_paths(out)["train"])
    full = pq.read_table(path).slice(0, 1).to_pylist()[0]["input_ids"]
    for mode, expected in (("left", full[-100:]), ("right", full[:100])):
        config = sft_config("+recipe=sft_smoke", f"data.train_files={path}", "data.max_length=100", f"data.truncation={mode}")
        assert create_sft_dataset(path, config.data, tokenizer, None)[0]["input_ids"].tolist() == expected
    config = sft_config("+recipe=sft_smoke", f"data.train_files={path}", "data.max_length=100")
    with pytest.raises(ValueError, match="data.max_length: sample 0 has"):
        create_sft_dataset(path, config.data, tokenizer, None)[0]


def test_length_groups_cut_padding_and_keep_the_loss_and_gradient_of_unpadded_rows(tokenizer, distilled, tiny_model_dir):
    """The CPU loop's micro-batches of similar lengths: every sample once, at most the row cap,
    fewer padded tokens than the whole batch in one, and the loss and gradient of every row run
    alone (no padding at all)."""
    from verl.trainer.sft_trainer import create_sft_dataset
    from verl.utils.dataset.dataset_utils import SFTTensorCollator

    from infmem_verl.cpu.engine import load_model
    from infmem_verl.sft.cpu import batch_loss, length_groups

    out, _ = distilled
    config = sft_config("+recipe=sft_smoke", f"data.train_files={sft_paths(out)['train']}")
    dataset = create_sft_dataset(config.data.train_files, config.data, tokenizer, None)
    items = [dataset[i] for i in range(min(len(dataset), 12))]
    lengths = [len(item["input_ids"]) for item in items]
    assert len(set(lengths)) > 2, "the fixture's calls differ in length"

    groups = length_groups(lengths, most_rows=len(items))
    assert sorted(i for group in groups for i in group) == list(range(len(items)))
    padded = sum(len(group) * max(lengths[i] for i in group) for group in groups)
    assert padded < len(items) * max(lengths)
    assert any(len({lengths[i] for i in group}) > 1 for group in groups), "some micro-batch is padded"
    assert all(len(group) <= 3 for group in length_groups(lengths, most_rows=3))
    assert length_groups(lengths, most_rows=1) == [[i] for i in sorted(range(len(items)), key=lengths.__getitem__)]

    model = load_model(str(tiny_model_dir))
    collate, pad_id = SFTTensorCollator("no_padding"), tokenizer.pad_token_id

    def loss_and_grad(micro: int) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss = batch_loss(model, items, collate, micro, pad_id, backward=True)
        return loss, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    alone_loss, alone_grad = loss_and_grad(1)
    grouped_loss, grouped_grad = loss_and_grad(len(items))
    assert grouped_loss == pytest.approx(alone_loss, rel=1e-5)
    torch.testing.assert_close(grouped_grad, alone_grad, rtol=1e-4, atol=1e-6)
