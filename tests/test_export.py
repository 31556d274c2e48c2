"""``python -m infmem_verl.export``: checkpoints of both backends become Hugging Face folders.

The GPU backend's checkpoint is real: verl's ``FSDPCheckpointManager`` saving an FSDP2 model
sharded over two Gloo CPU ranks (tests/fsdp_checkpoint.py). The export must load back into
transformers and give the same log-probs as the checkpoint's own weights on real text (in
bfloat16, the precision verl's merger writes), must not be the untrained model, and must be
served by vLLM (the CPU build, ``.venv-vllm``) with the log-probs transformers gives it.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from infmem_verl.agent.policy import SamplingParams
from infmem_verl.assets import wiki_paragraphs
from infmem_verl.export import ExportError, export_checkpoint, find_actor_checkpoint, main
from infmem_verl.policy.openai import OpenAIPolicy
from infmem_verl.policy.transformers import TransformersPolicy, end_token_ids

TESTS = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A run folder holding one real two-rank FSDP checkpoint (step 1) and the full weights."""
    run_dir = tmp_path_factory.mktemp("fsdp_run")
    script = TESTS / "fsdp_checkpoint.py"
    command = [sys.executable, str(script), str(tiny_model_dir), str(run_dir), "2", str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def text_ids(tokenizer, count: int = 160) -> torch.Tensor:
    """``count`` tokens of real Wikipedia text."""
    text = "\n\n".join(p["text"] for p in wiki_paragraphs()[:20])
    return torch.tensor(tokenizer(text)["input_ids"][:count])


@torch.no_grad()
def log_probs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Per-token log-probs of ``ids[1:]`` given the tokens before each, in float32."""
    logits = model.float()(input_ids=ids.unsqueeze(0)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, ids[1:].unsqueeze(1)).squeeze(1)


def model_with(config_dir: Path, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.float32)
    result = model.load_state_dict(state, strict=False)
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys  # lm_head is tied
    model.tie_weights()
    return model.eval()


def test_fsdp_checkpoint_exports_to_a_folder_transformers_loads_with_the_same_log_probs(
    fsdp_run, tmp_path, tokenizer, tiny_model_dir, capsys
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    assert main([str(fsdp_run), str(out)]) == 0  # the run folder: its latest step
    actor = fsdp_run / "global_step_1" / "actor"
    assert f"{actor} (step 1) -> {out}" in capsys.readouterr().out
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }

    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.dtype == torch.bfloat16 and exported.config.tie_word_embeddings
    assert AutoTokenizer.from_pretrained(out)("Paris")["input_ids"] == tokenizer("Paris")["input_ids"]
    trained = torch.load(fsdp_run / "full_state.pt")
    ids = text_ids(tokenizer)

    ours = log_probs(exported, ids)
    expected = log_probs(model_with(actor / "huggingface", {k: v.bfloat16().float() for k, v in trained.items()}), ids)
    assert torch.equal(ours, expected)  # the checkpoint's weights exactly, at bfloat16
    full_precision = log_probs(model_with(actor / "huggingface", trained), ids)
    assert (ours - full_precision).abs().max() < 0.05
    untrained = log_probs(AutoModelForCausalLM.from_pretrained(tiny_model_dir).bfloat16(), ids)
    assert (ours - untrained).abs().max() > 1e-3  # the trained step made it into the export

    assert main([str(actor), str(out)]) == 2  # OUT now holds a model
    assert "folder is not empty; pass --overwrite" in capsys.readouterr().err


def test_vllm_serves_the_export_with_the_log_probs_transformers_gives(fsdp_run, tmp_path, tokenizer, tiny_model_dir):
    from vllm_server import SERVED_NAME, VLLMServer

    out = tmp_path / "hf"
    export_checkpoint(fsdp_run, out)
    prompt = text_ids(tokenizer, 120).tolist()
    server = VLLMServer(out, tmp_path / "server.log").start()  # float32, from the bfloat16 files

    async def generate():
        async with OpenAIPolicy([server.url], end_token_ids(tokenizer), SERVED_NAME) as policy:
            return await policy.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))

    try:
        generation = asyncio.run(asyncio.wait_for(generate(), 240))
    finally:
        server.stop()
    exported = TransformersPolicy.from_pretrained(out).compute_log_probs(prompt, generation.token_ids, temperature=0.0)
    np.testing.assert_allclose(generation.log_probs, exported, atol=1e-3)
    untrained = TransformersPolicy.from_pretrained(tiny_model_dir)
    assert np.abs(untrained.compute_log_probs(prompt, generation.token_ids, temperature=0.0) - exported).max() > 1e-3


def _actor(tmp_path: Path, world_size: int = 1, ranks: int = 1, hf: bool = True) -> Path:
    actor = tmp_path / "run" / "global_step_3" / "actor"
    actor.mkdir(parents=True)
    (actor / "fsdp_config.json").write_text(f'{{"FSDP_version": 2, "world_size": {world_size}}}')
    for rank in range(ranks):
        (actor / f"model_world_size_{world_size}_rank_{rank}.pt").write_bytes(b"x")
    if hf:
        (actor / "huggingface").mkdir()
        (actor / "huggingface" / "config.json").write_text("{}")
    return actor


def test_a_checkpoint_is_found_from_the_run_the_step_or_the_actor_folder(tmp_path):
    actor = _actor(tmp_path)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("3\n")
    for path in (tmp_path / "run", actor.parent, actor):
        found = find_actor_checkpoint(path)
        assert (found.path, found.global_step, found.world_size) == (actor, 3, 1)


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda t: t / "nowhere", r"no such file or folder"),
        (lambda t: t, r"expected a verl checkpoint - a run folder with latest_checkpointed_iteration\.txt"),
        (lambda t: _actor(t, world_size=2, ranks=1), r"missing for world size 2: \['model_world_size_2_rank_1\.pt'\]"),
        (lambda t: _actor(t, hf=False), r"huggingface: expected the model config"),
        (lambda t: _tracker(t, "7"), r"names step 7, but .*global_step_7 does not exist"),
        (lambda t: _tracker(t, "latest"), r"expected the number of the latest saved step, got 'latest'"),
        (lambda t: _megatron(t), r"Megatron checkpoint; export it with `python -m verl\.model_merger merge --backend megatron"),
    ],
)
def test_what_is_not_an_exportable_checkpoint_is_named(tmp_path, setup, message):
    with pytest.raises(ExportError, match=message):
        export_checkpoint(setup(tmp_path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _tracker(tmp_path: Path, content: str) -> Path:
    _actor(tmp_path)
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text(content)
    return tmp_path / "run"


def _megatron(tmp_path: Path) -> Path:
    actor = tmp_path / "global_step_1" / "actor"
    (actor / "model" / "dist_ckpt").mkdir(parents=True)
    return actor
