"""The ``infmem_cpu`` trainer mode: verl's sync trainer (with ``infmem_sync``'s changes) on CPU.

Registered with verl's ``register_trainer``; the CPU backend selects it
(``trainer.v1.trainer_mode=infmem_cpu``) and verl's own ``TaskRunnerV1`` runs it like any mode:
verl's ``fit`` loop, dataloaders, replay buffer, batch balancing and padding, old/ref log-prob
passes, GRPO advantage over multi-sequence trajectories, actor update call, validation, metrics
and logging are all verl's code. Only :meth:`InfMemCPUTrainer._setup` differs (with the two
members that would read what it replaces: ``get_llm_client``, ``_get_n_gpus_for_throughput``):
where verl starts GPU worker groups, vLLM replicas and a checkpoint engine, it builds

* the generation actor (:mod:`.server`) behind verl's real load balancer and ``LLMServerClient``,
* the single-process engine and frozen reference behind verl's worker-group calls (:mod:`.workers`),
* the weight sync behind verl's checkpoint-manager calls,

and keeps verl's ``RewardLoopManager`` (rule-based reward workers need no GPU).

On top, each step prints one summary line (:mod:`.report`) of the per-trajectory metrics that
``infmem_sync`` logs (:mod:`infmem_verl.metrics`), and logs the fingerprints of the weights the
generation actor served (``cpu/weights/*``), which show that rollouts always use exactly the
last update. Checkpoints are verl's own save and resume
(``trainer.save_freq``, ``trainer.resume_mode``), in verl's FSDP layout (:mod:`.checkpoint`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ray
import torch
from transfer_queue import KVBatchMeta
from verl.experimental.reward_loop import RewardLoopManager
from verl.trainer.ppo.v1 import register_trainer
from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.rollout.llm_server import LLMServerClient

from infmem_verl.cpu.backend import check_cpu_support, cpu_settings
from infmem_verl.cpu.report import step_line, validation_line
from infmem_verl.verl_plugin.trainer import InfMemSyncTrainer

WEIGHTS = "cpu/weights"
# How long a liveness ping may wait on a busy actor before the poll goes on (it is alive then).
PING_TIMEOUT_S = 5.0
# The pings' pace: the buffer polls every REPLAY_POLL_S (0.2 s), a dead actor needs no such haste.
WATCH_INTERVAL_S = 2.0


class WatchedReplayBuffer(ReplayBuffer):
    """verl's sync replay buffer, which also checks between its polls that the actors filling it
    are alive (``watch`` raises when one is dead).

    verl's agent-loop workers put finished trajectories into TransferQueue from background tasks,
    and the replay buffer polls for them: a worker killed mid-rollout leaves its samples
    "running" forever, and the run would wait for them without end.
    """

    watch: Callable[[], None]
    last_watch: float = 0.0

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        if time.monotonic() - self.last_watch >= WATCH_INTERVAL_S:
            self.watch()
            self.last_watch = time.monotonic()
        return super()._wait_for_next_poll(partition_id, last_debug_time)


# Per-trajectory statistics shown in the validation line, besides the reward components.
VALIDATION_NAMES = ("reward", "acc", "chunks_read", "stopped_early", "llm_sequences")


@register_trainer("infmem_cpu")
class InfMemCPUTrainer(InfMemSyncTrainer):
    """verl's sync trainer with the GPU pieces replaced by CPU ones (see the module docstring)."""

    def _setup(self) -> None:
        """verl's ``_setup`` steps in verl's order, with CPU stand-ins for the GPU components."""
        # Imported here, not at the top: the plugin imports this module whenever verl is imported,
        # also while one of these submodules is the one importing verl (half-initialised).
        from infmem_verl.cpu.engine import TorchEngine, load_model
        from infmem_verl.cpu.server import start_cpu_router, torch_threads
        from infmem_verl.cpu.workers import CPUActorRolloutRef, WeightSync

        config = self.config
        check_cpu_support(config)
        settings = cpu_settings(config)
        self._init_tokenizer()
        self._init_dataloader()  # also sets actor.optim.total_training_steps, read by the engine
        self._init_dump_executor()

        # The generation actor first: its process boots (seconds of imports) while this one loads
        # the engine and the reward workers start.
        model_path = config.actor_rollout_ref.model.path
        self.generation_server, self.load_balancer = start_cpu_router(
            model_path,
            seed=config.actor_rollout_ref.rollout.seed,
            max_batch=settings.max_batch,
            threads=settings.threads,
        )
        torch.set_num_threads(torch_threads(settings.threads))
        policy = TorchEngine(model_path, omega_conf_to_dataclass(config.actor_rollout_ref.actor))
        reference = load_model(model_path).eval() if self.use_reference_policy else None
        self.actor_rollout_wg = CPUActorRolloutRef(policy, reference, self.tokenizer)
        self.ref_policy_wg = self.actor_rollout_wg
        self.ref_in_actor = False

        self.reward_loop_manager = RewardLoopManager(config=config, rm_resource_pool=None)
        self.teacher_model_manager = None
        self.distillation_config = None

        self.checkpoint_manager = WeightSync(policy, self.generation_server)
        self.checkpoint_manager.sleep_replicas()
        self._load_checkpoint()
        self._weight_metrics: dict[str, int] = {}

    def _build_replay_buffer(self) -> ReplayBuffer:
        """verl's replay buffer, watching the agent-loop workers and the generation actor.

        verl builds it with arguments only its own classes take, so the sync mode's buffer is
        turned into its subclass rather than built again; a custom sampler is left unwatched.
        """
        buffer = super()._build_replay_buffer()
        if type(buffer) is ReplayBuffer:
            buffer.__class__ = WatchedReplayBuffer
            buffer.watch = self._check_actors_alive
        return buffer

    def _check_actors_alive(self) -> None:
        """Ping the agent-loop workers and the generation actor: a dead one's ping raises Ray's
        ``ActorDiedError`` naming it (the launcher reports it, :mod:`infmem_verl.actor_faults`)."""
        actors = [*self.agent_loop_manager.agent_loop_workers, self.generation_server]
        pings = [actor.__ray_ready__.remote() for actor in actors]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=PING_TIMEOUT_S)
        ray.get(answered)

    def get_llm_client(self) -> LLMServerClient:
        """verl's client over verl's load balancer, which knows one server: the generation actor."""
        return LLMServerClient(self.config, load_balancer_handle=self.load_balancer)

    def _get_n_gpus_for_throughput(self) -> int:
        return 1  # throughput figures are per training process

    # ----------------------------------------------------- what the generation actor served

    def _served(self) -> int:
        return ray.get(self.generation_server.weights_digest.remote())

    def on_step_begin(self) -> None:
        super().on_step_begin()
        self._weight_metrics = {f"{WEIGHTS}/before_rollout": self._served()}

    def on_sample_end(self) -> None:
        super().on_sample_end()  # rollout is complete once the replay buffer handed out the batch
        self._weight_metrics[f"{WEIGHTS}/after_rollout"] = self._served()

    def _update_actor(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        from infmem_verl.cpu.server import weights_digest  # see _setup for why not at the top

        batch = super()._update_actor(batch, metrics)
        self._weight_metrics[f"{WEIGHTS}/engine_after_update"] = weights_digest(self.actor_rollout_wg.engine.model)
        return batch

    def on_step_end(self) -> None:
        super().on_step_end()  # verl's sync mode: update_weights -> WeightSync
        self._weight_metrics[f"{WEIGHTS}/after_sync"] = self.checkpoint_manager.last_digest

    # ------------------------------------------------------------------------------ reports

    def _compute_metrics(
        self, batch: KVBatchMeta, metrics: dict, timing_raw: dict, global_steps: int, epoch: int
    ) -> None:
        metrics.update(self._weight_metrics)  # before the base class records the step
        super()._compute_metrics(batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        print(step_line(global_steps, self.total_training_steps, metrics, self._components()), flush=True)

    def _validate(self) -> dict[str, float]:
        metrics = super()._validate()
        print(validation_line(metrics, [*VALIDATION_NAMES, *self._components()]), flush=True)
        return metrics

    def _components(self) -> list[str]:
        return list(self.config.infmem.reward.components)
