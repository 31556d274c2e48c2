"""``python -m infmem_verl.sft``: see :mod:`infmem_verl.sft.launch`."""

from infmem_verl.cli import run_hydra
from infmem_verl.sft.launch import main

run_hydra(main, "sft")
