"""``python -m metaserver --etcd HOST:PORT [--listen HOST:PORT]``: run one metaserver in the foreground."""

from __future__ import annotations

import argparse
import sys

from umbp.config import MetaserverConfig, resolve
from umbp.errors import UmbpError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m metaserver", description="UMBP metaserver")
    p.add_argument("--etcd", help="etcd HOST:PORT (default 127.0.0.1:2379)")
    p.add_argument("--listen", help="HOST:PORT to serve on (port 0: ephemeral)")
    p.add_argument("--advertise", help="address clients should use for this metaserver")
    p.add_argument("--etcd-prefix", dest="etcd_prefix", help="key prefix in etcd (default /umbp)")
    p.add_argument("--eviction-policy", dest="eviction_policy", choices=("lru", "prefix-lru"))
    p.add_argument("--election-ttl", dest="election_ttl_s", type=int,
                   help="leader lease seconds: a dead leader is replaced within about this long (default 5)")
    args = p.parse_args(argv)
    try:
        config = resolve(MetaserverConfig, vars(args))
        from metaserver.server import run
        run(config)
    except UmbpError as e:
        print(str(e), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
