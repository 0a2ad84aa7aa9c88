"""The engines venv (``.venv/sglang-linker``, built by ``scripts/install-engines.sh``): SGLang's linker modules, vLLM
and transformers import there, not in the main venv. Tests in the main run drive their engine-side files there
through ``run_pytest`` (failing if anything there fails, skipping loudly when the venv is missing)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINES_PY = Path(os.environ.get("UMBP_ENGINES_PYTHON", os.environ.get(
    "UMBP_SGLANG_LINKER_PYTHON", Path(sys.prefix) / "sglang-linker" / "bin" / "python")))


def import_error(*modules: str) -> str | None:
    """Why ``modules`` do not import in this venv ("Type: message"), or None when they all do."""
    try:
        for m in modules:
            importlib.import_module(m)
    except Exception as e:  # noqa: BLE001 - any import failure means: not here
        return f"{type(e).__name__}: {e}"
    return None


def engine_modules(what: str, how: str, *modules: str):
    """``(why, mark)``: why ``modules`` do not import in this venv (None when they do), and a skipif mark whose
    reason says so loudly ("{what} IN THIS VENV (why); {how}")."""
    err = import_error(*modules)
    return err, pytest.mark.skipif(err is not None, reason=f"{what} IN THIS VENV ({err}); {how}")

def run_pytest(args: list[str], etcd_binary: str, what: str, min_passed: int = 1, no_skips: bool = False,
               **env: str) -> str:
    """``pytest -q ARGS`` under the engines venv's Python; returns the output's tail. Skips (saying so) when the venv
    is missing; fails when anything failed there, fewer than ``min_passed`` tests passed, or (``no_skips``) any test
    skipped there."""
    if not ENGINES_PY.exists():
        pytest.skip(f"ENGINES VENV MISSING at {ENGINES_PY} (scripts/install-engines.sh builds it unless "
                    f"UMBP_ENGINES_VENV=0): {what} DID NOT RUN")
    run_env = dict(os.environ, UMBP_TEST_ETCD=etcd_binary, PYTHONPATH=str(REPO), **env)
    r = subprocess.run([str(ENGINES_PY), "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args], cwd=REPO,
                       env=run_env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, f"{what} failed in {ENGINES_PY} (rc {r.returncode}):\n{tail}"
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= min_passed, tail
    summary = [ln for ln in r.stdout.splitlines() if " passed" in ln]
    assert not no_skips or (summary and "skipped" not in summary[-1]), tail
    return tail
