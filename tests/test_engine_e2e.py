"""The end-to-end engine bench's CPU mode (``bench/engine_e2e.py --device cpu``): a tiny Llama with random weights,
writer and reader in separate processes against a real pool; the loaded KV must equal the reader's recompute bit for
bit and the next-token logits exactly, on every path (plain API, SGLang's HiCache backend through its host pool,
layer-wise loader whole and grouped).

transformers lives in the SGLang linker venv (``.venv/sglang-linker``), not in the main one, so the bench runs under
that interpreter when the main one lacks it; with neither, the test skips and says why."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINKER_PY = Path(os.environ.get("UMBP_SGLANG_LINKER_PYTHON", Path(sys.prefix) / "sglang-linker" / "bin" / "python"))


def _python_with_transformers() -> str | None:
    if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None:
        return sys.executable
    if LINKER_PY.exists():
        r = subprocess.run([str(LINKER_PY), "-c", "import transformers, torch"], capture_output=True, timeout=120)
        if r.returncode == 0:
            return str(LINKER_PY)
    return None


def test_engine_e2e_cpu_mode_kv_and_logits_exact():
    py = _python_with_transformers()
    if py is None:
        pytest.skip(f"TRANSFORMERS NOT IMPORTABLE in {sys.executable} nor in the linker venv {LINKER_PY}: the e2e "
                    f"bench's byte and logit checks DID NOT RUN")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # etcd in .venv/bin
    r = subprocess.run([py, str(REPO / "bench" / "engine_e2e.py"), "--device", "cpu", "--iters", "1"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("E2E ")]
    assert lines, f"no E2E line (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    res = json.loads(lines[-1][4:])
    w, rd = res["writer"], res["reader"]
    assert w["stored"] == w["pages"] == 6 and w["first_put_stored"] == 1
    assert rd["prefix_hits"] == 6
    assert rd["kv_bytes"] == 6 * 2 * 2 * 2 * 16 * 16 * 4  # pages x layers x K|V x kv_heads x tokens x dim x fp32
    for path in ("plain", "layerwise", "layerwise_groups", "layerwise_cache_layout"):
        assert rd[path]["kv_exact"] is True, (path, rd[path])
        assert rd[path]["logits_exact"] is True, (path, rd[path])
    assert rd["overlap"]["logits_exact"] is True and rd["overlap"]["same_next_token"] is True, rd["overlap"]
    for path in ("offload_plain", "offload"):  # 6 pages stored per run, read back exact
        assert rd[path]["bytes_exact"] is True and rd[path]["counters"]["pages_stored"] % 6 == 0, (path, rd[path])
    assert rd["plain"]["transports"] == {"node-0": "shm"} or set(rd["plain"]["transports"].values()) == {"shm"}
    assert rd["ok"] is True and r.returncode == 0, r.stdout[-2000:]
    if "skipped" in rd["hicache"]:  # every other path was checked above
        pytest.skip(f"THE HICACHE BACKEND PATH DID NOT RUN under {py}: {rd['hicache']['skipped']}")
    assert w["hicache_stored"] == 6 and w["first_set_stored"] == 1 and rd["hicache"]["pages"] == 6, (w, rd["hicache"])
    assert rd["hicache"]["kv_exact"] is True and rd["hicache"]["logits_exact"] is True, rd["hicache"]
