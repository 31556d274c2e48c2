"""Hydra configuration of the SFT warm-up (``python -m infmem_verl.sft``); a package so tests can
compose it by module name."""
