"""Self-contained runs: build the inputs a recipe needs when they are absent (``infmem.bootstrap``).

The smoke recipe must run on a fresh machine with no model hub and no dataset: with
``infmem.bootstrap`` set, a null ``actor_rollout_ref.model.path`` becomes the tiny random Qwen3
(real Qwen3 tokenizer) built locally, or (``model: warm_qwen3``) that model warmed up to follow
the protocol by distillation and SFT (:mod:`infmem_verl.cpu.warmup`), and missing train/val parquet files are written with
synthetic two-hop questions over real Wikipedia text (documents by reference, as
``python -m infmem_verl.verl_plugin.dataset --synthetic`` writes them). A file it wrote carries a
``<file>.bootstrap.json`` of the settings it was written with and is written again when those
change (``doc_tokens``, the sample count or the seed); any other existing file is used as it is.
Relative data paths are made absolute, since Ray workers need not share the launcher's
working directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from omegaconf import DictConfig, OmegaConf, open_dict

from infmem_verl.agent.errors import ConfigError
from infmem_verl.settings import read_settings, section

# Validation samples are drawn from another seed than training ones, so the two never overlap.
VAL_SEED_OFFSET = 1000


@dataclass(frozen=True)
class BootstrapSettings:
    """``infmem.bootstrap``: what to build when missing."""

    model: Literal["tiny_qwen3", "warm_qwen3"] = "tiny_qwen3"  # used when actor_rollout_ref.model.path is null
    train_samples: int = 4  # synthetic questions written to data.train_files when absent
    val_samples: int = 2  # and to data.val_files (drawn from seed + 1000)
    doc_tokens: int = 16000  # length of each synthetic document
    seed: int = 0  # of the training questions and their documents
    # How the documents' invented names are made (infmem_verl.data.synthetic.NameStyle): "roles"
    # (single tokens of the small vocabulary, one kind per role) is what the demo's student copies.
    names: str = "syllables"
    # tiny_qwen3 over the small-vocabulary tokenizer of this many tokens (infmem_verl/small_vocab.py,
    # Qwen3's special tokens and template; the data is then measured in its tokens); 0: Qwen3's.
    vocab_size: int = 0

    def validate(self, path: str) -> BootstrapSettings:
        for name in ("train_samples", "val_samples", "doc_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.names not in ("syllables", "list", "roles"):
            raise ConfigError(f"{path}.names: expected 'syllables', 'list' or 'roles', got {self.names!r}")
        if self.vocab_size and self.model != "tiny_qwen3":
            raise ConfigError(f"{path}.vocab_size: only the tiny_qwen3 model is built here over the small vocabulary, got model {self.model!r}")
        return self


def bootstrap_settings(config: DictConfig) -> BootstrapSettings | None:
    """The validated ``infmem.bootstrap``, or None when the recipe does not bootstrap."""
    path = "infmem.bootstrap"
    if section(config, path, required=False) is None:
        return None
    return read_settings(BootstrapSettings, config, path)


def _single_file(config: DictConfig, key: str) -> str:
    files = OmegaConf.select(config, key)
    if not isinstance(files, str):
        raise ConfigError(f"{key}: infmem.bootstrap writes one parquet file; expected a path, got {files!r}")
    return os.path.abspath(os.path.expanduser(files))


def bootstrap_inputs(config: DictConfig) -> list[str]:
    """Build what is missing (in place: fills the model path, makes data paths absolute).

    Returns one line per input it provided, for the launcher to print; nothing without
    ``infmem.bootstrap``.
    """
    settings = bootstrap_settings(config)
    if settings is None:
        return []
    provided = []
    with open_dict(config):
        if config.actor_rollout_ref.model.path is None:
            path, what = _model(config, settings)  # built once, then cached
            config.actor_rollout_ref.model.path = path
            provided.append(f"model: {what} at {path}")
        # Qwen3's, unless the model (built here, or a given one such as the demo's warmed student)
        # has its own: documents are then measured in its tokens.
        tokenizer = _own_tokenizer(str(config.actor_rollout_ref.model.path))
        for key, count, seed in (
            ("data.train_files", settings.train_samples, settings.seed),
            ("data.val_files", settings.val_samples, settings.seed + VAL_SEED_OFFSET),
        ):
            path = _single_file(config, key)
            OmegaConf.update(config, key, path)
            # Documents are measured in the model's tokens, as the warm-up's held-out check measures them.
            wanted = {"samples": count, "doc_tokens": settings.doc_tokens, "seed": seed}
            if tokenizer is not None:
                wanted["vocab_size"] = len(_tokenizer(tokenizer))
            if settings.names != "syllables":
                wanted["names"] = settings.names
            marker = Path(f"{path}.bootstrap.json")
            written = _marker(marker)
            if os.path.isfile(path) and written in (None, wanted):
                continue  # the user's own file, or ours with these settings
            marker.unlink(missing_ok=True)  # until the new file is complete
            _write_synthetic(path, count, settings.doc_tokens, seed, tokenizer, settings.names)
            marker.write_text(json.dumps(wanted) + "\n")
            documents = f"{settings.doc_tokens}-token documents"
            provided.append(f"{key}: wrote {count} synthetic two-hop questions over {documents} to {path}")
    return provided


def _marker(marker: Path) -> dict | None:
    """The settings our earlier write recorded; None when there is no marker (a user's file).

    A marker cut short or edited by hand still says the file is ours: it reads as no settings
    ({}), so the caller writes the file again rather than fail on a JSON error.
    """
    if not marker.is_file():
        return None
    try:
        return json.loads(marker.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _model(config: DictConfig, settings: BootstrapSettings) -> tuple[str, str]:
    if settings.model == "warm_qwen3":
        from infmem_verl.cpu.warmup import launch_command, warm_qwen3_dir

        path = warm_qwen3_dir(config, *launch_command(config))
        return str(path), "tiny Qwen3 warmed up on the oracle's calls (infmem.warmup)"
    from infmem_verl.assets import tiny_qwen3_dir

    if not settings.vocab_size:
        return str(tiny_qwen3_dir(seed=settings.seed)), "tiny random Qwen3 with the real Qwen3 tokenizer"
    from infmem_verl.small_vocab import small_vocab_dir

    try:
        tokenizer = small_vocab_dir(settings.vocab_size)
    except ValueError as err:
        raise ConfigError(f"infmem.bootstrap.{err}") from None
    path = tiny_qwen3_dir(seed=settings.seed, tokenizer_dir=tokenizer)
    return str(path), f"tiny random Qwen3 over the {settings.vocab_size}-token small vocabulary"


def _own_tokenizer(model: str) -> Path | None:
    """The small-vocabulary tokenizer of a local model folder made with one; None for Qwen3's
    (and for a model that is not a local folder: a hub name is read by verl, not here)."""
    from transformers import AutoConfig

    from infmem_verl.assets import QWEN3_VOCAB

    if not os.path.isfile(os.path.join(model, "config.json")):
        return None
    return None if AutoConfig.from_pretrained(model).vocab_size == QWEN3_VOCAB else Path(model)


def _write_synthetic(path: str, count: int, doc_tokens: int, seed: int, tokenizer: Path | None, names: str) -> None:
    from infmem_verl.data.synthetic import make_dataset
    from infmem_verl.verl_plugin.dataset import write_verl_dataset

    write_verl_dataset(make_dataset(count, doc_tokens, _tokenizer(tokenizer), seed=seed, names=names), path)


def _tokenizer(path: Path | None):
    from infmem_verl.assets import load_tokenizer

    return load_tokenizer(None if path is None else str(path))
