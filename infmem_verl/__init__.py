"""infmem-verl: bounded-memory agents for question answering over ultra-long documents, on verl."""

from pathlib import Path

__version__ = "0.1.0"


def conf_dir() -> Path:
    """The Hydra configs and recipes: the top-level ``conf/`` of a checkout (an editable install, or
    a Ray job's uploaded working directory), else the copy a regular install ships in the package."""
    checkout = Path(__file__).resolve().parent.parent / "conf"
    return checkout if (checkout / "infmem_trainer.yaml").is_file() else Path(__file__).resolve().parent / "conf"
