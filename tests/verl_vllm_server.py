"""verl's own vLLM rollout server on vLLM's CPU build, driven through our Policy adapter.

    VERL_PLATFORM=cpu python tests/verl_vllm_server.py MODEL_DIR WORK_DIR

Run by tests/test_verl_vllm_server.py in the verl + vLLM environment (``.venv-vllm``). The path is
a GPU run's: verl's ``LLMServerManager`` starts a standalone ``vLLMReplica`` (its
``CheckpointEngineWorker`` on a Ray GPU slot, then the ``vLLMHttpServer`` actor running vLLM's
``AsyncLLM``) on the ``cpu`` platform, verl's load balancer and ``LLMServerClient`` route the
calls, and :class:`~infmem_verl.policy.verl_server.VerlServerPolicy` reads what comes back.

The model served is MODEL_DIR's tiny Qwen3 re-initialised with larger weights (initializer range
0.3: at the default 0.02 greedy decoding repeats one token forever), and it ends its responses
at a token it really emits: its generation config lists, besides ``<|im_end|>``, the token that
greedy decoding of the prompt (by transformers) first produces at position :data:`STOP_AT` or
later. That is how Qwen3 itself lists a second end token (``<|endoftext|>``), and what the agent
loop reads (``end_token_ids``).
Then a trainer's weight update reaches it the way verl's rollout ``ServerAdapter`` sends one
(:func:`push_weights`: the same architecture re-initialised from another seed, over two buckets
split inside a layer), and the server answers the greedy call again.
Writes WORK_DIR/result.json with what the server returned, before and after the update, and the
transformers log-probs of it (after the update: on the new weights and on the old).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

STOP_AT = 3  # the greedy token at this position (0-based) becomes an end token
# verl's weight-sync bucket: just over the embedding (151,936 x 64 float32 = 37.1 MiB), so a sync
# takes two buckets (see sync_order).
BUCKET_MB = 38
SYNC_TIMEOUT_S = 60  # a sync of this model takes 0.2-0.3 s
PROMPT = "The river flows past the old mill and"


def greedy_tokens(model, prompt_ids: list[int], count: int) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=count, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


def token_log_probs(model, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1).tolist()


def random_model(source: Path, seed: int):
    """MODEL_DIR's architecture re-initialised at initializer range 0.3 from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    config.initializer_range = 0.3
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def served_model(source: Path, work: Path) -> tuple[Path, list[int], int, list[int]]:
    """The served model (see the module docstring); the prompt ids, its extra end token, and the
    greedy tokens."""
    from transformers import AutoTokenizer, GenerationConfig

    target = work / "model"
    model = random_model(source, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    greedy = greedy_tokens(model, prompt_ids, 16)
    stop = next(t for i, t in enumerate(greedy) if i >= STOP_AT and t not in greedy[:i])
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>"), stop])
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target, prompt_ids, stop, greedy


def rollout_config(model_dir: Path):
    from hydra import compose, initialize_config_dir

    from infmem_verl import conf_dir

    rollout = "actor_rollout_ref.rollout"
    with initialize_config_dir(str(conf_dir()), version_base=None):
        return compose(
            "infmem_trainer",
            overrides=[
                "+recipe=smoke",
                f"actor_rollout_ref.model.path={model_dir}",
                f"{rollout}.load_format=auto",  # the real weights: no trainer syncs them here
                f"{rollout}.dtype=float32",
                f"{rollout}.enforce_eager=true",
                f"{rollout}.free_cache_engine=false",
                f"+{rollout}.enable_sleep_mode=false",
                f"{rollout}.max_model_len=2048",
                f"{rollout}.n_gpus_per_node=1",
                f"{rollout}.nnodes=1",
                f"{rollout}.calculate_log_probs=true",
                f"{rollout}.checkpoint_engine.update_weights_bucket_megabytes={BUCKET_MB}",
            ],
        )


def sync_order(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """``state`` in an order whose bucket boundary falls inside a layer, as it does somewhere in
    any model larger than one bucket: layer 0's ``q_proj`` and the (tied) ``lm_head`` fill the
    first bucket, the embedding opens the second, and layer 0's ``k_proj`` / ``v_proj``, which vLLM
    fuses with ``q_proj`` into one ``qkv_proj``, follow in it."""
    first = ["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    return [(name, state[name]) for name in first] + [(n, t) for n, t in state.items() if n not in first]


def push_weights(replica, weights: list[tuple[str, torch.Tensor]]) -> float:
    """Send ``weights`` (Hugging Face names, as verl's FSDP actor exports them) to the replica's
    vLLM server the way a trainer rank does after an update: verl's rollout ``ServerAdapter``
    (``update_weights``: verl's bucketed sender over shared memory, on this platform, to the vLLM
    worker's ``update_weights_from_ipc``). Returns the seconds it took."""
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    os.environ.setdefault("RANK", "0")  # this process stands for trainer rank 0 of one
    os.environ.setdefault("RAY_LOCAL_WORLD_SIZE", "1")
    adapter = ServerAdapter(
        config=replica.config, model_config=replica.model_config, device_mesh=None, replica_rank=replica.replica_rank
    )
    started = time.monotonic()
    # In a thread, bounded: when the vLLM worker fails the sync (verl's own extension on this
    # build), verl's sender blocks in a ZMQ receive forever, which no asyncio timeout interrupts.
    done: list[BaseException | None] = []

    def send() -> None:
        try:
            asyncio.run(adapter.update_weights(iter(weights), global_steps=1))
            done.append(None)
        except BaseException as error:
            done.append(error)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(SYNC_TIMEOUT_S)
    if not done:
        raise TimeoutError(f"verl's weight sync got no reply from the vLLM worker in {SYNC_TIMEOUT_S} s")
    if done[0] is not None:
        raise done[0]
    return time.monotonic() - started


async def calls(client, prompt_ids: list[int], eos_ids: list[int]) -> dict:
    from infmem_verl.agent.policy import SamplingParams
    from infmem_verl.policy.verl_server import VerlServerPolicy

    # What verl's agent-loop worker passes (validation settings: greedy), with log-probs on.
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}
    policy = VerlServerPolicy(client, sampling, eos_ids)
    ended = await policy.generate(prompt_ids, SamplingParams(max_tokens=16))
    cut = await policy.generate(prompt_ids, SamplingParams(max_tokens=STOP_AT))
    return {
        name: {"token_ids": g.token_ids, "log_probs": g.log_probs, "finish_reason": g.finish_reason}
        for name, g in (("ended", ended), ("cut", cut))
    }


def main(source: Path, work: Path) -> None:
    from infmem_verl.cpu.backend import cpu_ray_init, select_cpu_platform

    select_cpu_platform()  # as the verl-cpu launchers do, before verl is asked for its platform
    started = time.monotonic()
    model_dir, prompt_ids, stop, greedy = served_model(source, work)

    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.model import get_generation_config
    from verl.workers.rollout.llm_server import LLMServerManager

    from infmem_verl.policy.transformers import end_token_ids
    from infmem_verl.ray_start import start_ray_retrying

    config = rollout_config(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos_ids = end_token_ids(tokenizer, get_generation_config(str(model_dir)))
    start_ray_retrying(lambda: ray.init(**cpu_ray_init(1)))  # one Ray GPU slot: the replica's rank (see verl_plugin.platform)
    try:
        ray_s = time.monotonic() - started
        manager = LLMServerManager.create(config)
        server_s = time.monotonic() - started
        served = asyncio.run(calls(manager.get_client(), prompt_ids, eos_ids))
        # A trainer's update: other weights (another seed), through verl's weight sync.
        updated = random_model(source, seed=1)
        try:
            sync_s = push_weights(manager.rollout_replicas[0], sync_order(updated.state_dict()))
            served_after = asyncio.run(calls(manager.get_client(), prompt_ids, eos_ids))["ended"]
            sync_error = None
        except Exception as error:  # reported to the sync test; the server checks above still stand
            sync_s, served_after, sync_error = None, None, f"{type(error).__name__}: {error}"
    finally:
        ray.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for call in served.values():
        call["reference_log_probs"] = token_log_probs(model, prompt_ids, call["token_ids"])
    after = {"error": sync_error, "call": served_after, "greedy": greedy_tokens(updated, prompt_ids, 16)}
    if served_after is not None:
        served_after["reference_log_probs"] = token_log_probs(updated, prompt_ids, served_after["token_ids"])
        served_after["old_weights_log_probs"] = token_log_probs(model, prompt_ids, served_after["token_ids"])
    result = {
        "stop_token": stop,
        "greedy": greedy,
        "eos_ids": eos_ids,
        "calls": served,
        "after_sync": after,
        "seconds": {"ray_up": ray_s, "server_up": server_s, "sync": sync_s, "total": time.monotonic() - started},
    }
    (work / "result.json").write_text(json.dumps(result))
    print(json.dumps(result["seconds"]))
    if sync_error is not None:
        sys.stdout.flush()
        os._exit(0)  # a timed-out sender thread still blocks in ZMQ, which a normal exit waits for


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
