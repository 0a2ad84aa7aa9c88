#!/usr/bin/env bash
# Create (or bring up to date) the project virtualenv: torch first, then umbp in editable mode.
#
# Usage: scripts/install-venv.sh [--test] [VENV_DIR]          (default .venv, relative to the repository root)
#   (no flag)  what `make demo` needs: torch (CPU wheel) and umbp with its runtime dependencies, nothing else.
#   --test     what `make test` needs on top: the test extras, SGLang's storage interface (SGLang --no-deps) and the
#              engines venv (scripts/install-engines.sh: SGLang's linker modules and vLLM's scheduler/connector).
# Environment: PYTHON (interpreter that creates the venv, default python3), TORCH_VERSION (default 2.13.0);
# UMBP_ENGINES_VENV=0 (or the older UMBP_SGLANG_LINKER_VENV=0) skips the engines venv and its tests skip, saying so.
#
# Idempotent: an existing venv is reused and pip skips what is already satisfied. torch is pinned (in the same
# pip call as umbp for the demo, before anything else for the tests) because `torch>=2.2` left to the resolver
# would pull a multi-GB CUDA build; the pinned version is a CPU wheel that pip finds on local disk (find-links).
# On a Debian box without the venv module (python3-venv), root with apt installs it.
#
# Engines installed --no-deps (SGLang here, vLLM in the engines venv) leave their own pins unmet on purpose; pip would
# then print a red "dependency conflicts" block after every later install into that venv. Those installs pass
# --no-warn-conflicts: the pins that matter are the extras in pyproject.toml, and the tests check what imports.
#
# --no-compile: pip would byte-compile every installed module (torch's thousands: about half of a fresh install's
# time here); Python compiles what it imports on first use instead (the Makefile lets it write those caches even
# where PYTHONDONTWRITEBYTECODE is set).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PROFILE=demo
if [[ "${1:-}" == --test ]]; then PROFILE=test; shift; fi
VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

log() { echo "install-venv: $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    if ! "$PYTHON" -m venv "$VENV"; then
        # Debian splits ensurepip into python3-venv; a half-made venv is removed so the retry starts clean.
        rm -rf "$VENV"
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null; then
            pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
            log "python -m venv failed; installing python${pyver}-venv with apt"
            export DEBIAN_FRONTEND=noninteractive
            apt-get update -q
            apt-get install -y -q --no-install-recommends "python${pyver}-venv" || apt-get install -y -q python3-venv
            "$PYTHON" -m venv "$VENV"
        else
            log "error: '$PYTHON -m venv' failed; install your distribution's venv package (Debian: python3-venv)" >&2
            exit 1
        fi
    fi
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check install --no-compile)
if [[ $PROFILE == demo ]]; then
    # one resolver run: the pin is part of the request, so `torch>=2.2` resolves to the local CPU wheel
    log "installing torch==$TORCH_VERSION (CPU wheel) and umbp (editable) with its runtime dependencies"
    "${PIP[@]}" -q "torch==$TORCH_VERSION" -e .
    "$VENV/bin/python" -c "import torch, umbp; print('install-venv: ok: torch', torch.__version__, '| umbp', umbp.__version__)"
    exit 0
fi

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION (CPU wheel) before the project's dependencies"
    "${PIP[@]}" -q "torch==$TORCH_VERSION"
fi

SGLANG_VERSION=0.5.23
# The `sglang` extra brings the few packages SGLang's storage interface imports, for the HiCache backend's tests;
# SGLang itself then goes in without its dependencies (it pins a CUDA torch, flashinfer, ...).
log "installing umbp (editable) with test and sglang extras"
"${PIP[@]}" -q --no-warn-conflicts -e '.[test,sglang]'
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" \
        2>/dev/null; then
    log "installing sglang==$SGLANG_VERSION without its dependencies (storage interface only)"
    "${PIP[@]}" -q --no-deps --no-warn-conflicts "sglang==$SGLANG_VERSION"
fi
"$VENV/bin/python" -c "import torch, umbp, pytest; print('install-venv: ok: torch', torch.__version__, '| umbp', umbp.__version__)"

if [[ "${UMBP_ENGINES_VENV:-${UMBP_SGLANG_LINKER_VENV:-1}}" != 0 ]]; then
    PYTHON="$PYTHON" SGLANG_VERSION="$SGLANG_VERSION" bash scripts/install-engines.sh "$VENV/sglang-linker"
else
    log "UMBP_ENGINES_VENV=0: no engines venv; the SGLang linker's and vLLM's tests will be SKIPPED"
fi
