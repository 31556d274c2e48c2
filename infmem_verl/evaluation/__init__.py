"""Evaluation of the agents and baselines: methods, data sources, resumable results, reports.

``python -m infmem_verl.eval`` is the entry point; these modules are its parts.
"""
