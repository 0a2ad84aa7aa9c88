#!/usr/bin/env bash
# Create (or bring up to date) the project virtualenv: torch first, then umbp in editable mode with test extras.
#
# Usage: scripts/install-venv.sh [VENV_DIR]          (default .venv, relative to the repository root)
# Environment: PYTHON (interpreter that creates the venv, default python3), TORCH_VERSION (default 2.13.0),
# UMBP_SGLANG_LINKER_VENV (default 1; 0 skips the SGLang linker venv below and its tests skip, saying so).
#
# Idempotent: an existing venv is reused and pip skips what is already satisfied. torch is pinned and installed
# before anything else because `torch>=2.2` left to the resolver would pull a multi-GB CUDA build; the pinned
# version is a CPU wheel that pip finds on local disk (find-links). On a Debian box without the venv module
# (python3-venv), root with apt installs it.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
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

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION (CPU wheel) before the project's dependencies"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
SGLANG_VERSION=0.5.23
sglang_present() {  # is sglang==$SGLANG_VERSION installed in venv $1?
    "$1/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" \
        2>/dev/null
}
# SGLang goes in without its dependencies (it pins a CUDA torch, flashinfer, ...); the `sglang` extra then brings
# the few packages its storage interface imports, for the HiCache backend's tests.
if ! sglang_present "$VENV"; then
    log "installing sglang==$SGLANG_VERSION without its dependencies (storage interface only)"
    "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
fi
log "installing umbp (editable) with test and sglang extras"
"${PIP[@]}" install -e '.[test,sglang]'
"$VENV/bin/python" -c "import torch, umbp; print('install-venv: ok: torch', torch.__version__, '| umbp', umbp.__version__)"

# A second venv inside the first, for the SGLang linker's tests: its modules import SGLang's memory pools and model
# configs (transformers, torchvision), and torchvision's wheels need the torch they were built with (2.14.1, a CUDA
# build that also runs on CPU), which the main venv's CPU torch is not. About 2 minutes and 6 GB on a fresh
# machine (torch and its CUDA libraries come from local wheels here). Failure is not fatal: the linker's factory
# tests then skip with the reason, loudly. Measured, not guessed: see README.md, SGLang.
LINKER_VENV="$VENV/sglang-linker"
LINKER_TORCH=2.14.1
if [[ "${UMBP_SGLANG_LINKER_VENV:-1}" != 0 ]]; then
    if ( set -e
         [[ -x "$LINKER_VENV/bin/python" ]] || "$PYTHON" -m venv "$LINKER_VENV"
         LPIP=("$LINKER_VENV/bin/python" -m pip --disable-pip-version-check -q)
         if ! "$LINKER_VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$LINKER_TORCH')" \
                 2>/dev/null; then
             log "sglang linker venv: installing torch==$LINKER_TORCH and torchvision (CPU-capable CUDA build)"
             "${LPIP[@]}" install "torch==$LINKER_TORCH" "torchvision==0.29.1"
         fi
         sglang_present "$LINKER_VENV" || "${LPIP[@]}" install --no-deps "sglang==$SGLANG_VERSION"
         log "sglang linker venv: installing umbp (editable) with test and sglang-linker extras"
         "${LPIP[@]}" install -e '.[test,sglang-linker]'
         "$LINKER_VENV/bin/python" -c "import sglang.srt.mem_cache.unified_cache.linker_factory" 2>/dev/null
       ); then
        log "ok: sglang linker venv at $LINKER_VENV"
    else
        log "WARNING: could not build the sglang linker venv at $LINKER_VENV; its tests will be SKIPPED" >&2
    fi
else
    log "UMBP_SGLANG_LINKER_VENV=0: no sglang linker venv; the linker's factory tests will be SKIPPED"
fi
