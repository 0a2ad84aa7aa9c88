"""Pieces the benchmarks share: throwaway TLS certificates (``make_certs``, ``tls_env``), environment variables set for
a pool's processes and restored after (``environ``), and this process's CPU seconds and memory (``cpu``, ``rss``,
``hwm``: the figures of the table benches are CPU-bound, and the machine may be shared while they run). The pool's
measuring helpers (best windows, the raw TCP stream, memcpy baselines) stay in ``bench/pool.py``, which the other
benches import.

Costs: ``make_certs`` runs ``openssl`` four times (two RSA-2048 keys: about a second); ``rss``/``hwm`` read
/proc/self/status; the rest is free."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time


def make_certs(d: str) -> bool:
    """A CA (``ca.pem``) and a server certificate for 127.0.0.1 (``s.pem``, ``s.key``) in ``d``, made with the
    ``openssl`` command; False when there is none."""
    if shutil.which("openssl") is None:
        return False

    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=umbp bench ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "s.key", "-out", "s.csr", "-subj", "/CN=127.0.0.1")
    with open(os.path.join(d, "ext.cnf"), "w") as fh:
        fh.write("subjectAltName = IP:127.0.0.1\n")
    run("x509", "-req", "-in", "s.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", "s.pem",
        "-days", "1", "-extfile", "ext.cnf")
    return True


def tls_env(d: str) -> dict[str, str]:
    """The environment that makes a pool started now serve TLS with ``make_certs(d)``'s certificates."""
    return {"UMBP_TLS_CERT": os.path.join(d, "s.pem"), "UMBP_TLS_KEY": os.path.join(d, "s.key"),
            "UMBP_TLS_CA": os.path.join(d, "ca.pem")}


@contextlib.contextmanager
def environ(env: dict[str, str]):
    """``env`` set in ``os.environ`` (a pool started inside inherits it), each variable as it was after, unset when
    it was unset."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def cpu() -> float:
    """This process's CPU seconds: the figures are CPU-bound, and this machine may be shared while they run."""
    return time.process_time()


def rss() -> int:
    """This process's resident memory now, bytes."""
    return _status("VmRSS:")


def hwm() -> int:
    """This process's peak resident memory so far, bytes."""
    return _status("VmHWM:")


def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0
