#!/usr/bin/env bash
# Create (or bring up to date) the project virtualenv: torch first, then umbp in editable mode with test extras.
#
# Usage: scripts/install-venv.sh [VENV_DIR]          (default .venv, relative to the repository root)
# Environment: PYTHON (interpreter that creates the venv, default python3), TORCH_VERSION (default 2.13.0).
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
log "installing umbp (editable) with test extras"
"${PIP[@]}" install -e '.[test]'
"$VENV/bin/python" -c "import torch, umbp; print('install-venv: ok: torch', torch.__version__, '| umbp', umbp.__version__)"
