"""transport/rdma.py on a host without RDMA: it must say why, never raise from ``rdma_available``, and fail
construction with a TransportError, so ``transport="auto"`` can fall back to TCP."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from transport import rdma
from umbp.errors import TransportError

REPO = Path(__file__).resolve().parents[2]


def test_available_never_raises_and_says_why():
    ok, why = rdma.rdma_available()
    if ok:  # a host with a real (or rxe) device
        assert why.startswith("device ")
        return
    assert why.startswith("transport rdma: ")
    assert "pyverbs not importable" in why or "no RDMA device" in why, why


def test_context_without_device_is_a_transport_error():
    ok, _ = rdma.rdma_available()
    if ok:
        pytest.skip("this host has an RDMA device")
    with pytest.raises(TransportError, match="^transport rdma: "):
        rdma.RdmaContext()


def test_system_python_with_pyverbs_reports_no_device():
    """Debian's python3 has pyverbs; on a host without RDMA the reason is the device list, not the import."""
    py = "/usr/bin/python3"
    if not os.path.exists(py) or subprocess.run([py, "-c", "import pyverbs"], capture_output=True, check=False).returncode:
        pytest.skip("no /usr/bin/python3 with pyverbs here")
    venv_site = REPO / ".venv" / "lib" / "python3.11" / "site-packages"
    env = dict(os.environ, PYTHONPATH=f"{REPO}:{venv_site}")
    code = "import json; from transport.rdma import rdma_available; print(json.dumps(rdma_available()))"
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    ok, why = json.loads(out.stdout)
    if ok:
        pytest.skip("this host has an RDMA device")
    assert why == "transport rdma: no RDMA device (Failed to get devices list)", why
