# kvray's front door: `make test`, `make generate` and `make serve` (and `make bench`).
# torch is installed first and pinned (a bare `torch` requirement can pull a multi-GB CUDA
# build); CUDA users override TORCH_SPEC, e.g. `make install TORCH_SPEC="torch==2.13.0 --index-url ..."`.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
TRITON_SPEC ?= triton==3.7.1
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.kvray-installed

.PHONY: install test test-fast test-nodes test-ray-up test-models generate serve bench lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_SPEC)
	$(PIP) install -q $(TRITON_SPEC)
	$(PIP) install -q -e ".[test]"
	touch $(STAMP)

# everything but the namespace nodes (faults across nodes, `ray up` over SSH) and the real
# models beyond SmolLM2 (their own targets below, which CI runs too: the suite stays under
# 30 minutes on 2 cores)
test: install
	$(PY) -m pytest -q --durations=30 --ignore=tests/test_ray_up_ssh.py --ignore=tests/test_nodes.py -m "not real_model"

test-fast: install
	$(PY) -m pytest -q -m "not slow"

# several Ray nodes in network namespaces (root): node and network faults under load
test-nodes: install
	$(PY) -m pytest -q tests/test_nodes.py

# Ray's cluster launcher over SSH into namespace nodes (root; installs openssh-server and rsync)
test-ray-up: install
	$(PY) -m pytest -q tests/test_ray_up_ssh.py

# Gemma 3 270M and the Qwen2.5-Coder models against transformers (offline, bf16, tp=2, PD),
# and the 0.5B drafting for the 1.5B (1.9 GB of GGUF to fetch once, 6.2 GB in fp32)
# (the pair in a pytest process of its own: the models before it leave GBs in the parent,
# and the pair's engines take up to 21 GB)
test-models: install
	$(PY) -m pytest -q -m real_model tests/test_models_real.py
	$(PY) -m pytest -q -m real_model tests/test_models_pair.py

generate: install
	$(VENV)/bin/kvray generate

serve: install
	$(VENV)/bin/kvray serve --config configs/smollm2-cpu-pd.yaml $(if $(PORT),--port $(PORT))

bench: install
	$(VENV)/bin/kvray bench offline

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
