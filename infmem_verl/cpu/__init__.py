"""The CPU backend: verl's real GRPO pipeline on a machine without a GPU.

verl 0.9.1 cannot train without GPUs (GPU resource pools, NCCL, vLLM). This package replaces only
those two pieces and keeps everything else verl's own (see README.md next to this file):

* :mod:`.server` - the generation actor: a Ray actor over the agent core's
  :class:`~infmem_verl.policy.transformers.TransformersPolicy` behind verl's rollout ``generate``
  contract, able to load new weights;
* :mod:`.engine` - a single-process torch engine that computes log-probs and runs verl's policy
  loss (with KL) and optimizer steps;
* :mod:`.workers` - the worker-group and weight-sync surfaces verl's trainer calls, over the engine;
* :mod:`.checkpoint` - the engine's checkpoints, in verl's FSDP checkpoint layout;
* :mod:`.trainer` - the ``infmem_cpu`` trainer mode wiring them into verl's sync trainer;
* :mod:`.backend` - automatic CPU/GPU selection; :mod:`.bootstrap` - self-contained smoke inputs;
  :mod:`.report` - the per-step summary.

Submodules are imported explicitly; this package imports nothing. ``.backend``, ``.bootstrap``
and ``.report`` do not load verl (the launcher imports them before verl is asked for anything);
the others do, and any of them may be the first to import verl in a process (the generation
actor's, a test's). verl then loads our plugin, which imports ``.trainer``: that module imports
the verl-side submodules only when it sets a run up, so the plugin never meets one of them
half-initialised.
"""
