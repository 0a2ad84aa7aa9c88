"""``python -m metaserver --etcd HOST:PORT [--listen HOST:PORT]``: run one metaserver in the foreground.

``add_arguments`` and ``config_from`` are the one definition of the metaserver's flags: ``umbp metaserver``
(umbp/cli.py) uses them too, so the two command lines cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys

from umbp.config import MetaserverConfig, resolve
from umbp.errors import UmbpError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd", default=None, help="etcd HOST:PORT (default $UMBP_ETCD or 127.0.0.1:2379)")
    p.add_argument("--listen", default=None, help="HOST:PORT to serve on (default 127.0.0.1:7700; port 0: any)")
    p.add_argument("--advertise", default=None, help="address clients should use, if not --listen")
    p.add_argument("--etcd-prefix", dest="etcd_prefix", default=None, help="key prefix in etcd (default /umbp)")
    p.add_argument("--eviction-policy", dest="eviction_policy", default=None, choices=("lru", "prefix-lru"))
    p.add_argument("--election-ttl", dest="election_ttl_s", type=int, default=None,
                   help="leader lease seconds: a dead leader is replaced within about this long (default 5)")
    p.add_argument("--commit", default=None, choices=("durable", "async"),
                   help="durable (default): answer a COMMIT once its pages are in etcd; async: at once, before etcd "
                        "(a crash loses the last window's committed pages as misses, never as wrong bytes)")
    p.add_argument("--slots", type=int, default=None,
                   help="slots of a new pool (>1: partitioned among every metaserver of the prefix; fixed at pool "
                        "creation; default: what the pool has, else 1)")
    p.add_argument("--token", default=None, help="the pool's cluster secret (default $UMBP_TOKEN); none: open pool")
    p.add_argument("--tokens", dest="tokens_file", default=None, metavar="FILE",
                   help="scoped tokens and the cluster secret (TOML, see umbp/auth.py)")
    p.add_argument("--metrics-listen", dest="metrics_listen", default=None, metavar="HOST:PORT",
                   help="serve /metrics (Prometheus), /healthz and /readyz on this address (port 0: any)")
    p.add_argument("--gc-freeze-ms", dest="gc_freeze_ms", type=float, default=None, metavar="MS",
                   help="garbage collection: a step whose walk takes this long freezes what survived it, so no "
                        "collection walks the whole directory (default 20; -1: CPython's own collector)")
    p.add_argument("--kv-events", dest="kv_events", default=None, metavar="tcp://HOST:PORT",
                   help="publish the pages stored and dropped as vLLM KV event batches on this ZeroMQ PUB address, "
                        "replays on PORT+1 (port 0: any two, printed); docs/operations/kv-events.md")
    tls_arguments(p)


def tls_arguments(p: argparse.ArgumentParser) -> None:
    """--tls-cert/--tls-key/--tls-ca of a server (metaserver, node; umbp/tls.py)."""
    p.add_argument("--tls-cert", dest="tls_cert", default=None, metavar="PEM",
                   help="serve TLS with this certificate chain (default $UMBP_TLS_CERT; with --tls-key)")
    p.add_argument("--tls-key", dest="tls_key", default=None, metavar="PEM", help="the certificate's private key")
    if "--tls-ca" not in p._option_string_actions:  # `umbp node` has it already, as a client of the metaserver
        p.add_argument("--tls-ca", dest="tls_ca", default=None, metavar="PEM",
                       help="CA bundle to verify the servers this process connects to (default $UMBP_TLS_CA)")


def config_from(args: argparse.Namespace) -> MetaserverConfig:
    return resolve(MetaserverConfig, {k: getattr(args, k) for k in
                                      ("etcd", "listen", "advertise", "etcd_prefix", "eviction_policy",
                                       "election_ttl_s", "commit", "slots", "token", "tokens_file", "metrics_listen", "gc_freeze_ms",
                                       "kv_events", "tls_cert", "tls_key", "tls_ca")})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metaserver", description="UMBP metaserver")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        config = config_from(args)
        from metaserver.server import run
        run(config)
    except UmbpError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
