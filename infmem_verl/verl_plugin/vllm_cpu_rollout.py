"""verl's weight sync into vLLM's CPU build: its rollout classes with one worker extension swapped.

Why verl's own sync fails there: vLLM's CPU build packs every unquantized linear layer's weight
for its oneDNN/SGL kernels once the weights are loaded (``UnquantizedLinearMethod.
process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``):
the packed copy lives in a closure (``layer.cpu_linear``) and ``layer.weight`` becomes an empty
Parameter without a ``weight_loader``. verl's ``vLLMColocateWorkerExtension.update_weights_from_ipc``
calls ``model.load_weights`` on that model, which fails with ``'Parameter' object has no
attribute 'weight_loader'``; and even a load that succeeded would leave the kernels on the old
packed copies (the embedding and a tied LM head pack a copy too, ``remove_weight=False``).

vLLM's own answer for reloading a processed model in place is its layerwise reload
(``vllm.model_executor.model_loader.reload``; ``GPUModelRunner.reload_weights``, which the CPU
model runner inherits, and vLLM's IPC/NCCL weight-transfer engines use it):
``initialize_layerwise_reload`` puts every layer's original parameters back (on the meta device,
with their ``weight_loader``\\ s, from the metadata ``initialize_model`` recorded for every
loader, the dummy one included), ``load_weights`` buffers each layer's tensors until the layer is
complete, then re-runs the layer's ``process_weights_after_loading`` (the CPU packing) and
copies the result into the tensors the engine holds; ``finalize_layerwise_reload`` restores the
layers nothing was loaded into and processes attention layers. :class:`CPUWeightSyncExtension`
runs verl's plain (full-weight) sync inside that lifecycle.

What is not verl's own, and why each piece is as thin as it is:

* :class:`CPUWeightSyncExtension` overrides only ``update_weights_from_ipc``, for the plain path
  (no LoRA, no quantization, no MTP drafter: refused with an error naming the setting). It
  receives with verl's ``BucketedWeightReceiver`` and loads with verl's ``_update_weights``,
  exactly as verl does, with three differences: (1) the lifecycle around the buckets; (2) each
  bucket's tensors are cloned, because the layerwise reload keeps the loader's arguments until a
  layer is complete (a fused ``qkv_proj`` may take its q, k and v from different buckets) while
  the receiver reuses one shared-memory bucket for the next and closes it at the end (verl's
  views into it would then raise ``BufferError: cannot close exported pointers exist``); (3) it
  does not run verl's step 3, ``process_weights_after_loading`` over the whole model: the
  lifecycle has already processed every layer once, and a second pass meets the linear layers'
  empty 1-D placeholder weights, which ``dispatch_cpu_unquantized_gemm`` sends to its conv-weight
  packing on AVX-512-BF16 CPUs (``weight.size(2)`` of a 1-D tensor raises). Overriding
  ``_update_weights`` alone could not do (1) or (3).
* **Tied embeddings** (the tiny stand-ins, small Qwen3s) need nothing more, measured: vLLM lists
  tied parameters as a limitation of its reload (they reflect one parent's processing), and the
  LM head's oneDNN kernel holds a packed copy that an in-place change of the weight does not
  reach; yet after a sync the served log-probs of a tied tiny Qwen3 are those of the new weights
  (3.1e-3 from transformers on them, 13.6 nats from the old ones; tests/test_verl_vllm_server.py
  asserts it). vLLM logs "RotaryEmbedding: Failed to load weights" at each sync: its cos/sin
  cache is no checkpoint weight, so the reload puts the engine's own back, which is right.
* :class:`CPUvLLMHttpServer` is verl's ``vLLMHttpServer`` whose ``_get_worker_extension_cls``
  (verl's hook for it) names the extension; :class:`CPUvLLMReplica` is verl's ``vLLMReplica``
  whose ``server_class`` is that server. :mod:`infmem_verl.verl_plugin.vllm_cpu_replica`
  registers the replica as ``vllm`` in verl's ``RolloutReplicaRegistry`` when the ``cpu``
  platform is active; on any other platform verl's own classes are used.
"""

from __future__ import annotations

import ray
import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

EXTENSION = f"{__name__}.CPUWeightSyncExtension"


def unsupported_sync(extension: vLLMColocateWorkerExtension, peft_config: dict | None) -> str | None:
    """The setting that takes a sync off the plain path this extension implements, or None."""
    vllm_config = extension.model_runner.vllm_config
    if peft_config:
        return "LoRA (actor_rollout_ref.model.lora_rank > 0)"
    if getattr(vllm_config, "quant_config", None) is not None:
        return f"a quantized rollout (quant_config {type(vllm_config.quant_config).__name__})"
    if extension._use_mtp_drafter_weight_sync():
        return "an MTP drafter (actor_rollout_ref.rollout.mtp)"
    return None


class CPUWeightSyncExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension, whose full-weight sync runs inside vLLM's layerwise
    reload (see the module docstring for why, and for what is refused)."""

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        unsupported = unsupported_sync(self, peft_config)
        if unsupported is not None:
            raise NotImplementedError(
                f"weight sync into vLLM's CPU build: {unsupported} is not supported "
                "(infmem_verl.verl_plugin.vllm_cpu_rollout implements the plain full-weight sync only)"
            )
        if self.device is None:
            self.device = torch.device("cpu")
        model = self.model_runner.model
        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)

        def on_bucket_received(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            owned = [(name, tensor.clone()) for name, tensor in weights]  # see the module docstring, (2)
            self._update_weights(owned, peft_config=None, base_sync_done=base_sync_done)

        # A receive that fails midway leaves layers on the meta device (as verl's own path leaves
        # them half-loaded): the next forward pass fails instead of serving mixed weights.
        initialize_layerwise_reload(model)
        receiver.receive_weights(on_bucket_received=on_bucket_received)
        finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)


class CPUvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server with :class:`CPUWeightSyncExtension` as its workers' extension."""

    def _get_worker_extension_cls(self) -> str:
        return EXTENSION


class CPUvLLMReplica(vLLMReplica):
    """verl's vLLM replica, serving through :class:`CPUvLLMHttpServer`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CPUvLLMHttpServer)
