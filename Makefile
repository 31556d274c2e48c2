# One-command entry points. `make smoke` and `make test` install everything they need first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := true

.PHONY: install smoke test bench clean

install: $(STAMP)

$(STAMP): requirements/cpu.txt setup.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install -r requirements/cpu.txt
	$(VPY) -m pip install --no-deps -e .
	$(VPY) -c "import torch, transformers, verl, ray, rank_bm25, Stemmer, scipy; print('install ok: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

smoke: $(STAMP)
	$(VPY) -m infmem_verl.smoke

test: $(STAMP)
	$(VPY) -m pytest -q tests

bench: $(STAMP)
	$(VPY) -m bench.agent_core
	$(VPY) -m bench.retrieval

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
