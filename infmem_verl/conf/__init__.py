"""Hydra configuration of infmem-verl (a package so tests can compose it by module name)."""
