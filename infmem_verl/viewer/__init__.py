"""The trajectory viewer: evaluation and training trajectories as one self-contained HTML page
(``python -m infmem_verl.inspect``)."""
