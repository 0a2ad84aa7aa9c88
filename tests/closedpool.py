"""Helpers for tests against a closed pool (umbp/auth.py): a tokens file from a table of tokens, a cluster whose
metaserver and nodes share it, clients that use exactly the token they are given (never the environment), and TLS
test certificates."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from umbp.client import Client
from umbp.config import ClientConfig, resolve

SECRET = "cluster-secret-0123456789"
OPS = "ops-admin-secret-0123456789"


def tokens_toml(tokens: dict[str, tuple[str, dict[str, str]]], admin: dict[str, str] | None = None,
                quotas: dict[str, int | str] | None = None, cluster_secret: str = SECRET) -> str:
    """A tokens file: ``tokens`` maps a name to (secret, {namespace pattern: "r" | "rw"}); ``admin`` maps admin
    token names to secrets (default: "ops" with ``OPS``); ``quotas`` namespace -> bytes or a size string."""
    out = [f'cluster_secret = "{cluster_secret}"']
    for name, (secret, namespaces) in tokens.items():
        nss = ", ".join(f'"{ns}" = "{right}"' for ns, right in namespaces.items())
        out += ["[[tokens]]", f'name = "{name}"', f'secret = "{secret}"', f"namespaces = {{ {nss} }}"]
    for name, secret in (admin if admin is not None else {"ops": OPS}).items():
        out += ["[[tokens]]", f'name = "{name}"', f'secret = "{secret}"', "admin = true"]
    if quotas:
        out.append("[quotas]")
        out += [f'"{ns}" = {q if isinstance(q, int) else repr(q)}' for ns, q in quotas.items()]
    return "\n".join(out) + "\n"


def closed_cluster(make_cluster, tmp_path, monkeypatch, text: str, nodes: int = 2, env: dict | None = None,
                   metaserver_flags: dict | None = None, node_flags: dict | None = None, **kw: Any):
    """A cluster whose metaserver and nodes read tokens file ``text`` (``env`` for both); the harness's own CLI calls
    use the cluster secret while it starts, then the environment forgets it so clients say which token they use."""
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    monkeypatch.setenv("UMBP_TOKEN", SECRET)
    extra = {"env": env} if env else {}
    cluster = make_cluster(nodes=nodes, metaserver_flags={"tokens": str(path), **extra, **(metaserver_flags or {})},
                           node_flags={"tokens": str(path), **extra, **(node_flags or {})}, **kw)
    monkeypatch.delenv("UMBP_TOKEN")
    return cluster


def scoped_client(addrs: str, token: str | None, ns: str, **kw: Any) -> Client:
    """A client that uses exactly ``token`` (the environment is not consulted)."""
    cfg = resolve(ClientConfig, {"metaserver": addrs, "namespace": ns, "token": token, "timeout_s": 10.0, **kw},
                  env={})
    return Client(config=cfg)


def make_certs(d: Path) -> dict[str, str] | None:
    """In ``d``: a CA, a server certificate for 127.0.0.1 (subjectAltName IP:127.0.0.1) it signed, and an unrelated
    CA; their paths ({"ca", "other", "cert", "key"}), or None when there is no ``openssl`` command."""
    if shutil.which("openssl") is None:
        return None

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    for ca in ("ca", "other"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days",
                "2", "-subj", f"/CN=umbp test {ca}")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj",
            "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName = IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            "server.pem", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": str(d / "ca.pem"), "other": str(d / "other.pem"), "cert": str(d / "server.pem"),
            "key": str(d / "server.key")}
