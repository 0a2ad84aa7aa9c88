#!/usr/bin/env bash
# The engines venv: one virtualenv (inside the main one) holding the engine code the integration tests drive.
#
# Usage: scripts/install-engines.sh ENGINES_VENV      (make test passes .venv/sglang-linker; the name is historical:
#        tests/test_sglang_linker.py and tests/test_vllm*.py both look for it there)
# Environment: PYTHON (default python3), SGLANG_VERSION (default 0.5.23), VLLM_VERSION (default 0.33.0).
#
# What goes in, and why one venv serves both engines:
# - torch 2.14.1 + torchvision 0.29.1 (a CUDA build that also runs on CPU; wheels on local disk here). SGLang's
#   linker modules import its memory pools, hence its model configs: transformers and torchvision, whose wheels need
#   the torch they were built with, which the main venv's CPU torch is not.
# - SGLang 0.5.23 --no-deps plus the `sglang-linker` extra.
# - vLLM 0.33.0 --no-deps plus the `vllm` extra: what its scheduler, KV connector factory and config import on CPU.
#   vLLM pins torch==2.14.0; only 2.14.1 and 2.13.0 lie on this machine's disk and pip is capped at torch<=2.14.1,
#   so vLLM runs on 2.14.1 here (its scheduler and connector paths import and pass the tests on it). Its wheel is
#   336 MB from PyPI; the CUDA kernels in it are never loaded by the tests.
# About 2 minutes and 7 GB on a fresh machine. Failure is not fatal: the tests that need this venv skip with the
# reason, loudly. Installs pass --no-warn-conflicts (see install-venv.sh: engines' unmet pins are deliberate).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
EV="${1:?usage: install-engines.sh ENGINES_VENV}"
PYTHON="${PYTHON:-python3}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
ENGINES_TORCH=2.14.1

log() { echo "install-engines: $*"; }
version_is() {  # is distribution $1 at version $2 in the engines venv?
    "$EV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null
}

# A function with explicit `|| return`: `set -e` does not apply inside a command tested by `if`.
build() {
    [[ -x "$EV/bin/python" ]] || "$PYTHON" -m venv "$EV" || return 1
    local INSTALL=("$EV/bin/python" -m pip --disable-pip-version-check install -q --no-compile --no-warn-conflicts)
    if ! "$EV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$ENGINES_TORCH')" \
            2>/dev/null; then
        log "installing torch==$ENGINES_TORCH and torchvision (CPU-capable CUDA build)"
        "${INSTALL[@]}" "torch==$ENGINES_TORCH" "torchvision==0.29.1" || return 1
    fi
    log "installing umbp (editable) with test, sglang-linker and vllm extras"
    "${INSTALL[@]}" -e '.[test,sglang-linker,vllm]' || return 1
    version_is sglang "$SGLANG_VERSION" || "${INSTALL[@]}" --no-deps "sglang==$SGLANG_VERSION" || return 1
    if ! version_is vllm "$VLLM_VERSION"; then
        log "installing vllm==$VLLM_VERSION without its dependencies (336 MB download)"
        "${INSTALL[@]}" --no-deps "vllm==$VLLM_VERSION" || return 1
    fi
}
if build; then
    log "ok: engines venv at $EV"
else
    log "WARNING: could not build the engines venv at $EV; the SGLang linker's and vLLM's tests will be SKIPPED" >&2
fi
# What imports is checked separately, so one engine failing does not hide the other's state.
"$EV/bin/python" -c "import sglang.srt.mem_cache.unified_cache.linker_factory" >/dev/null 2>&1 \
    && log "ok: SGLang's linker factory imports" \
    || log "WARNING: SGLang's linker factory does not import in $EV; its tests will be SKIPPED" >&2
"$EV/bin/python" -c "import vllm.distributed.kv_transfer.kv_connector.factory, vllm.v1.core.sched.scheduler" \
    >/dev/null 2>&1 \
    && log "ok: vLLM's connector factory and scheduler import" \
    || log "WARNING: vLLM's connector factory does not import in $EV; its tests will be SKIPPED" >&2
exit 0
