"""Entry point of the SFT warm-up: verl's SFT trainer on our distilled samples.

    torchrun --standalone --nproc_per_node=8 -m infmem_verl.sft +recipe=sft_4b [key=value ...]
    python -m infmem_verl.sft +recipe=sft_smoke                  # CPU: tiny model, a few steps
    python -m infmem_verl.sft +recipe=sft_smoke sft.backend=verl-cpu trainer.n_gpus_per_node=2
                                                                  # verl's own trainer on 2 gloo ranks
    python -m infmem_verl.sft +recipe=sft_4b dry_run=true        # compose + validate, start nothing

A sibling of ``python -m infmem_verl.main`` rather than a recipe of it: the SFT trainer is a
different verl program (``verl.trainer.sft_trainer``, launched by torchrun, config
``sft_trainer_engine``), so composing it under the PPO config would only bring in keys it does
not read. The config is verl's ``sft_trainer_engine`` composed with the top-level ``conf/sft``.

Before anything starts, :func:`prepare_sft_config` checks what verl would only find out on the
workers, or never: the files exist and hold token columns, the longest sample fits
``data.max_length``, the batch is not larger than the data, the model's chat template is the
one the samples were built with, the dataset class imports and the optimizer settings are
valid. Then verl's ``run_sft`` runs on GPUs; without one, the CPU loop of
:mod:`infmem_verl.sft.cpu`. ``sft.backend=verl-cpu`` runs what a GPU run executes on this CPU
instead: verl's Ray SFT trainer (``verl.trainer.sft_trainer_ray``, the same ``TrainingWorker`` and
FSDP2 engine as ``run_sft``, placed by Ray rather than torchrun) on ``trainer.n_gpus_per_node``
gloo ranks through the ``cpu`` platform (:mod:`infmem_verl.verl_plugin.platform`). verl's torchrun
trainer cannot take that platform: its process-group set-up does not skip the gloo group the
platform creates (docs/experiments/2026-12-03-verl-cpu.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf, open_dict

from infmem_verl import conf_dir
from infmem_verl.agent.errors import ConfigError
from infmem_verl.cli import exit_on_input_error
from infmem_verl.cpu.backend import (
    BACKENDS,
    CPU_MIXED_PRECISION,
    VERL_CPU,
    check_cpu_platform,
    choose_backend,
    cpu_ray_init,
    select_cpu_platform,
    trainer_ranks,
)
from infmem_verl.ray_start import start_ray_retrying

from .samples import TOKEN_COLUMNS, TokenizerStamp, check_columns, longest_sample, read_stamp


@dataclass
class PreparedSFT:
    """What :func:`prepare_sft_config` found and derived, printed before the run."""

    backend: str
    model_path: str
    train_files: list[str]
    val_files: list[str]
    train_samples: int
    longest_sample: int
    steps: int
    tokenizer_check: str
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"backend {self.backend}, model {self.model_path}",
            f"train {self.train_samples} samples in {self.train_files}; val {self.val_files or 'none'}",
            f"longest sample {self.longest_sample} tokens; {self.steps} optimizer steps",
            f"tokenizer: {self.tokenizer_check}",
            *self.notes,
        ]


def prepare_sft_config(config: DictConfig, gpus: int | None = None) -> PreparedSFT:
    """Validate ``config`` (setting ``model.path`` to the tiny model when ``sft.tiny_model``) and
    say what it derives (backend, samples, optimizer steps); ConfigError names the key."""
    backend = select_backend(config, gpus)
    if backend == VERL_CPU and config.engine.strategy != "fsdp2":
        raise ConfigError(
            f"engine.strategy: sft.backend={VERL_CPU} needs fsdp2 (FSDP1 cannot run on a CPU), got {config.engine.strategy!r}"
        )
    if config.sft.tiny_model:
        from infmem_verl.assets import tiny_qwen3_dir

        config.model.path = str(tiny_qwen3_dir())
    if not config.model.path:
        raise ConfigError("model.path: expected the model to fine-tune (a local folder or a hub name such as Qwen/Qwen3-4B)")
    token_level = _dataset_class(config)
    train = _files(config, "data.train_files", required=True)
    val = _files(config, "data.val_files", required=False)
    rows = sum(pq.ParquetFile(path).metadata.num_rows for path in train)
    samples = train_sample_count(config, rows)
    if samples < int(config.data.train_batch_size):
        raise ConfigError(f"data.train_batch_size: {config.data.train_batch_size} is more than the {samples} training samples")
    longest = 0
    if token_level:
        for path in train + val:
            try:
                check_columns(path, (*TOKEN_COLUMNS, "num_tokens"))  # longest_sample reads num_tokens
            except ValueError as err:
                raise ConfigError(f"data: {err}") from None
        longest = longest_sample(train + val)
        if config.data.truncation == "error" and longest > int(config.data.max_length):
            raise ConfigError(
                f"data.max_length: {config.data.max_length} is less than the longest sample ({longest} tokens); "
                "raise it, or distill with --max-length to leave long samples out"
            )
    check = _check_tokenizer(config, train + val)
    _check_optim(config)
    steps = optimizer_steps(config, samples)
    prepared = PreparedSFT(backend, str(config.model.path), train, val, samples, longest, steps, check)
    if samples < rows:
        prepared.notes.append(f"data.train_max_samples: {samples} of the {rows} training samples are used")
    return prepared


def train_sample_count(config: DictConfig, rows: int) -> int:
    """How many of ``rows`` training samples verl's dataset keeps (``data.train_max_samples``, when
    set and smaller)."""
    limit = int(config.data.get("train_max_samples", -1))
    return limit if 0 < limit < rows else rows


def optimizer_steps(config: DictConfig, samples: int) -> int:
    """The optimizer steps of a run over ``samples`` training samples, as verl's SFT trainer counts
    them (and the CPU loop runs them): ``trainer.total_training_steps``, else the full batches of an
    epoch (the loader drops a partial one) times ``trainer.total_epochs``."""
    per_epoch = samples // int(config.data.train_batch_size)
    return int(config.trainer.total_training_steps or per_epoch * int(config.trainer.total_epochs))


def select_backend(config: DictConfig, gpus: int | None = None) -> str:
    """``cpu`` or ``gpu`` for ``sft.backend`` on a machine with ``gpus`` GPUs (default: visible); a
    dry run validates a GPU recipe anywhere (a login node has no GPU)."""
    return choose_backend(
        config,
        "sft.backend",
        gpus,
        lambda: f"recipe {config.recipe_name} needs GPUs and none is visible; "
        "on this machine run `python -m infmem_verl.sft +recipe=sft_smoke`",
        dry_run=bool(config.dry_run),
        names=(*BACKENDS, VERL_CPU),
    ).name


def _dataset_class(config: DictConfig) -> bool:
    """Import ``data.custom_cls``; True when it serves our token columns."""
    from verl.utils.import_utils import load_extern_object

    from .dataset import TokenSFTDataset

    custom = config.data.custom_cls
    if not custom.get("path"):
        return False
    try:
        cls = load_extern_object(custom.path, custom.name)
    except (ImportError, AttributeError, FileNotFoundError, RuntimeError) as err:
        raise ConfigError(f"data.custom_cls: cannot load {custom.name} from {custom.path}: {err}") from None
    return isinstance(cls, type) and issubclass(cls, TokenSFTDataset)


def _files(config: DictConfig, key: str, required: bool) -> list[str]:
    value = OmegaConf.select(config, key)
    files = [] if value is None else [value] if isinstance(value, str) else list(value)
    if required and not files:
        raise ConfigError(f"{key}: expected at least one SFT parquet file")
    paths = [os.path.expanduser(str(f)) for f in files]
    for path in paths:
        if not os.path.isfile(path):
            raise ConfigError(f"{key}: {path} not found; build it with `python -m infmem_verl.distill`")
    return paths


def _check_tokenizer(config: DictConfig, paths: list[str]) -> str:
    """Compare the model's tokenizer with the one every file was built with (local models only)."""
    folder = Path(os.path.expanduser(str(config.model.get("tokenizer_path") or config.model.path)))
    if not folder.is_dir():
        return f"not checked ({folder} is not a local folder)"
    from infmem_verl.assets import load_tokenizer

    mine = TokenizerStamp.of(load_tokenizer(str(folder)))
    for path in paths:
        stamp = read_stamp(path)
        if stamp is None:
            return f"not checked ({path} carries no tokenizer stamp)"
        if mine.differences(stamp):
            raise ConfigError(
                f"model.path: {folder}'s tokenizer (vocabulary {mine.vocab_size}) or chat template differs from "
                f"the one {path} was built with ({stamp.name}, vocabulary {stamp.vocab_size}); distill with "
                "--tokenizer set to the student's tokenizer"
            )
    return "matches the samples' (chat template and vocabulary)"


def _check_optim(config: DictConfig) -> None:
    """Build verl's optimizer config the way its trainer will (its checks are bare asserts)."""
    from hydra.errors import InstantiationException
    from verl.utils.config import omega_conf_to_dataclass

    try:
        omega_conf_to_dataclass(config.optim)
    except (AssertionError, ValueError, TypeError, InstantiationException) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        raise ConfigError(
            f"optim: verl rejects these settings ({type(cause).__name__}: {cause}); e.g. lr_scheduler_type "
            f"must be constant or cosine, got {config.optim.get('lr_scheduler_type')!r}"
        ) from None


def run(config: DictConfig):
    """Prepare ``config``, then train (or, with ``dry_run``, stop after the checks)."""
    if OmegaConf.select(config, "sft.backend") == VERL_CPU and not config.dry_run:
        select_cpu_platform()  # before the checks' verl imports ask verl for its platform
    prepared = prepare_sft_config(config)
    for line in prepared.lines():
        print(f"[sft] {line}")
    if config.dry_run:
        return prepared
    if prepared.backend == "cpu":
        from .cpu import train_on_cpu

        return train_on_cpu(config, prepared.steps)
    if prepared.backend == VERL_CPU:
        return train_on_verl_cpu(config)
    if "RANK" not in os.environ:
        raise ConfigError(
            "launch: verl's SFT trainer runs under torchrun: "
            f"torchrun --standalone --nproc_per_node={config.trainer.n_gpus_per_node} -m infmem_verl.sft +recipe={config.recipe_name}"
        )
    from verl.trainer.sft_trainer import run_sft
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    run_sft(config)
    return prepared


def train_on_verl_cpu(config: DictConfig):
    """verl's Ray SFT trainer on ``trainer.n_gpus_per_node`` gloo ranks of this CPU; returns it
    trained, its workers alive in this process's Ray session (a caller may ask them for their
    state; Ray stops with the process).

    What a CPU needs of the config is set here, not in a recipe: the device, sdpa attention
    (flash-attention is CUDA-only) and float32 compute (:data:`CPU_MIXED_PRECISION`). The strategy
    is the recipes' own, ``fsdp2`` (:func:`prepare_sft_config` refuses FSDP1, which torch cannot
    run on a CPU: it refuses ``sync_module_states`` there).
    """
    import ray
    from verl.trainer.sft_trainer_ray import SFTTrainer

    check_cpu_platform("sft.backend")
    with open_dict(config):
        config.trainer.device = "cpu"
        config.model.override_config.setdefault("attn_implementation", "sdpa")
        config.engine.mixed_precision = CPU_MIXED_PRECISION  # bfloat16: a scalar loop without AVX512-BF16/AMX
    start_ray_retrying(lambda: ray.init(**cpu_ray_init(trainer_ranks(config))))  # a node that timed out starting, again

    trainer = SFTTrainer(config=config)
    trainer.fit()
    return trainer


@hydra.main(config_path=str(conf_dir() / "sft"), config_name="sft_trainer", version_base=None)
def main(config: DictConfig) -> None:
    with exit_on_input_error("sft"):
        run(config)
