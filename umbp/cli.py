"""The ``umbp`` command: run the pool's processes (up, metaserver, node), administer it, and run the demo.

Admin commands (stats, nodes, ls, evict, drain) take ``--metaserver HOST:PORT[,HOST:PORT...]`` or
``UMBP_METASERVER``; they exit 0 on success, 1 with a one-line ``umbp: <component>: <message>`` on an UMBP error,
2 on bad usage. ``--json`` output is one JSON object (stats) or list (nodes) on stdout, nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from umbp.errors import ConfigError, UmbpError
from umbp.sizes import format_size, parse_size


def _metaserver_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metaserver", default=None,
                   help="HOST:PORT of the metaserver (comma-separated for several); default $UMBP_METASERVER")
    _token_arg(p)
    if "--tls-ca" not in p._option_string_actions:
        _tls_ca_arg(p)


def _token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token", default=None, help="the pool's secret or a scoped token (default $UMBP_TOKEN)")


def _tls_ca_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", dest="tls_ca", default=None, metavar="PEM",
                   help="speak TLS, verifying the servers' certificates against this CA bundle "
                        "(default $UMBP_TLS_CA)")


def _admin_client(args):
    from umbp.client import Client
    from umbp.config import ClientConfig, resolve

    cfg = resolve(ClientConfig, {"metaserver": args.metaserver, "timeout_s": 10.0, "token": args.token,
                                 "tls_ca": getattr(args, "tls_ca", None)})
    return Client(config=cfg)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, bytes):
        try:
            return obj.decode()
        except UnicodeDecodeError:
            return obj.hex()
    if isinstance(obj, dict):
        return {str(_jsonable(k)): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


SLOTS_A_METASERVER_NOTE = 4  # more slots a metaserver than this: ``umbp stats`` says what they cost
_SLOT_RULES = {1: "rule 1: a hash of namespace and key", 2: "rule 2: the key digest's bits"}


def _print_stats(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if sys.stdout.isatty() else 110)
    cap, used = s.get("capacity_bytes", 0), s.get("used_bytes", 0)
    hits, misses = s.get("hits", 0), s.get("misses", 0)
    lookups = hits + misses
    t = Table(title="UMBP pool", show_header=False)
    t.add_row("leader", f"{s.get('leader') or '-'} (this is leader: {s.get('is_leader', '?')})")
    t.add_row("capacity", f"{format_size(cap)} in {sum(1 for n in s.get('nodes', []) if n.get('alive'))} live nodes")
    t.add_row("used", f"{format_size(used)} ({100 * used / cap:.1f}%)" if cap else format_size(used))
    t.add_row("objects", f"{s.get('objects', 0)} ready, {s.get('pending', 0)} pending, {s.get('pinned', 0)} leased")
    t.add_row("hit rate", f"{100 * hits / lookups:.1f}% ({hits} hits, {misses} misses)" if lookups else "no lookups yet")
    t.add_row("evictions", str(s.get("evictions", 0)))
    dcap, dused = s.get("disk_capacity_bytes", 0), s.get("disk_used_bytes", 0)
    if dcap:  # the nodes' disk tiers (umbp node --disk)
        t.add_row("disk tier", f"{format_size(dused)} / {format_size(dcap)} ({100 * dused / dcap:.1f}%), "
                               f"{s.get('demotions', 0)} demoted, {s.get('promotions', 0)} promoted")
    if s.get("slot_map"):  # a partitioned pool: which metaserver leads which slots (umbp/slotrouter.py)
        rule = _SLOT_RULES.get(s.get("slot_rule"), "rule -")  # which slot a key is in: transport/slotrules.py
        t.add_row("slots", f"{s.get('slots')} slots over {len(s.get('metaservers') or [])} metaservers ({rule}), "
                           f"membership leader {s.get('leader') or '-'}")
        for m in s.get("metaservers") or []:
            warm = m.get("warm_copies") or {}  # its copies of the slots it would take over: events not applied yet
            t.add_row(f"  {m.get('addr')}", f"slots {_ranges(m.get('slots_led') or [])}: {m.get('objects', 0)} "
                                            f"objects, {format_size(m.get('used_bytes', 0))}; warm copies "
                                            f"{_ranges(sorted(int(x) for x in warm)) if warm else '-'}, "
                                            f"{sum(w.get('lag', 0) for w in warm.values())} events behind")
        vacant = [i for i, a in enumerate(s["slot_map"]) if not a]
        if vacant:
            t.add_row("  no leader", f"slots {_ranges(vacant)}")
        many = (s.get("slots") or 0) / max(1, len(s.get("metaservers") or []))
        if many > SLOTS_A_METASERVER_NOTE:  # a pool made with many slots (64 was `umbp up`'s default): say its cost
            t.add_row("  note", f"{many:.0f} slots a metaserver: each slot a request's keys fall in costs its leader "
                                "a table pass; a pool made with fewer serves more keys a CPU-second "
                                "(docs/operations/partitioned-pool.md)")
    con.print(t)
    usage = s.get("namespace_usage") or {}
    if usage:  # per namespace: objects, use against quota (a scoped token sees its own namespaces only)
        nt = Table(title="namespaces")
        for col in ("namespace", "objects", "used", "quota"):
            nt.add_column(col)
        for ns, u in usage.items():
            q = u.get("quota_bytes")
            nt.add_row(ns, str(u.get("objects", 0)), format_size(u.get("used_bytes", 0)),
                       "-" if q is None else f"{format_size(q)} ({100 * u.get('used_bytes', 0) / q:.1f}%)" if q
                       else format_size(q))
        con.print(nt)
    _print_nodes(s.get("nodes", []))


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, xs = [], sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "-"


def _print_nodes(nodes: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="nodes")
    disk = any(n.get("disk_capacity_bytes") for n in nodes)
    for col in ("node", "address", "pid", "alive", "used / capacity", "objects") + (("disk",) * disk) + ("transports",):
        t.add_column(col)
    for n in nodes:
        cap = n.get("capacity_bytes", 0)
        dcol = (f"{format_size(n.get('disk_used_bytes', 0))} / {format_size(n.get('disk_capacity_bytes', 0))}, "
                f"{n.get('disk_objects', 0)} objects",) if disk else ()
        t.add_row(str(n.get("node_id")), f"{n.get('host')}:{n.get('port')}", str(n.get("pid")),
                  ("draining" if n.get("draining") else "yes") if n.get("alive") else "DEAD",
                  f"{format_size(n.get('used_bytes', 0))} / {format_size(cap)}", str(n.get("objects", "")),
                  *dcol, ",".join(n.get("transports", [])))
    Console(width=None if sys.stdout.isatty() else 110).print(t)


def _stats_fetcher(c):
    """STATS of the pool, with the address of the metaserver that answered (the leader) filled in."""
    from transport.wire import Op

    def fetch() -> dict:
        s = c.admin(Op.STATS)
        s.setdefault("leader", c.leader)
        return s

    return fetch


def cmd_stats(args) -> int:
    with _admin_client(args) as c:
        fetch = _stats_fetcher(c)
        if args.watch and not args.json:  # a live table (umbp/watch.py); --json stays one object per line
            from umbp.watch import watch

            return watch(fetch, args.watch, args.count)
        rounds = 0
        while True:
            s = fetch()
            if args.json:
                print(json.dumps(_jsonable(s), sort_keys=True), flush=True)
            else:
                _print_stats(s)
            rounds += 1
            if not args.watch or (args.count and rounds >= args.count):
                return 0
            time.sleep(args.watch)


def cmd_top(args) -> int:
    """``umbp stats --watch`` full screen, refreshed every --interval seconds (default 1) until Ctrl-C."""
    from umbp.watch import watch

    with _admin_client(args) as c:
        fetch = _stats_fetcher(c)
        return watch(fetch, args.interval, args.count, screen=True, title="umbp top")


def cmd_nodes(args) -> int:
    from transport.wire import Op

    with _admin_client(args) as c:
        nodes = c.admin(Op.NODES)["nodes"]
    if args.json:
        print(json.dumps(_jsonable(nodes), sort_keys=True))
    else:
        _print_nodes(nodes)
    return 0


def cmd_ls(args) -> int:
    from transport.wire import Op

    with _admin_client(args) as c:
        r = c.admin(Op.LIST, {"ns": args.namespace, "limit": args.limit})
    if args.json:
        print(json.dumps(_jsonable(r), sort_keys=True))
        return 0
    for ns, key, size, node, state in r["objects"]:
        print(f"{ns}\t{_jsonable(key)}\t{size}\t{node}\t{state}")
    if r.get("truncated"):
        print(f"(truncated at {args.limit}; use --limit)", file=sys.stderr)
    return 0


def cmd_evict(args) -> int:
    from transport.wire import Op

    meta: dict = {}
    if args.all:
        meta["all"] = True
    elif args.bytes:
        meta["bytes"] = parse_size(args.bytes, "--bytes")
    with _admin_client(args) as c:
        r = c.admin(Op.EVICT, meta)
    print(f"evicted {r['evicted']} objects, freed {format_size(r['freed_bytes'])}")
    return 0


def cmd_drain(args) -> int:
    from transport.wire import Op

    with _admin_client(args) as c:
        r = c.admin(Op.DRAIN, {"node_id": args.node})
    print(f"node {args.node} draining: dropped {r['dropped']} objects, {r['pinned']} still leased")
    return 0


def cmd_metaserver(args) -> int:
    from metaserver.__main__ import config_from
    from metaserver.server import run

    run(config_from(args))
    return 0


def cmd_node(args) -> int:
    from umbp.config import NodeConfig, resolve
    from umbp.node.server import run

    cfg = resolve(NodeConfig, {"metaserver": args.metaserver, "capacity": args.capacity, "listen": args.listen,
                               "advertise": args.advertise, "lease_ttl": args.lease_ttl, "node_id": args.node_id,
                               "token": args.token, "tokens_file": args.tokens,
                               "metrics_listen": args.metrics_listen, "tls_cert": args.tls_cert,
                               "tls_key": args.tls_key, "tls_ca": args.tls_ca, "disk": args.disk,
                               "disk_capacity": args.disk_capacity, "disk_threads": args.disk_threads})
    run(cfg)
    return 0


def cmd_up(args) -> int:
    from umbp.launcher import LocalPool

    parse_size(args.capacity, "--capacity")
    if args.disk_capacity:
        parse_size(args.disk_capacity, "--disk-capacity")
    if args.token:
        if len(args.token) < 16:
            raise ConfigError("up", "--token must be at least 16 characters")
        os.environ["UMBP_TOKEN"] = args.token  # the children (metaserver, nodes) inherit it
    else:
        print("up: WARNING: no --token: the pool is open to anyone who can reach its ports", file=sys.stderr,
              flush=True)
    for flag, name in (("tls_cert", "UMBP_TLS_CERT"), ("tls_key", "UMBP_TLS_KEY"), ("tls_ca", "UMBP_TLS_CA")):
        if getattr(args, flag):
            os.environ[name] = os.path.abspath(getattr(args, flag))  # the children and our own checks inherit it
    pool = LocalPool(nodes=args.nodes, capacity=args.capacity, etcd=args.etcd, port=args.port,
                     lease_ttl=args.lease_ttl, echo=args.verbose, max_restarts=args.max_restarts,
                     metaservers=args.metaservers, slots=args.slots, kv_events=args.kv_events or "",
                     disk=args.disk or "", disk_capacity=args.disk_capacity or 0, arena_root=args.arena_root or "")
    try:
        pool.start()
        print(f"metaserver: {pool.metaserver}", flush=True)
        for name, url in pool.metrics.items():
            print(f"metrics: {url} ({name})", flush=True)
        for name, (pub, replay) in pool.kv_event_endpoints.items():
            print(f"kv events: {pub}, replay {replay} ({name})", flush=True)
        disk = f" + a {args.disk_capacity} disk tier each in {pool.disk}" if pool.disk else ""
        print(f"up: {args.nodes} nodes of {args.capacity}{disk}, etcd {pool.etcd_url}; a process that dies is restarted "
              f"(at most {args.max_restarts} times in 10 minutes); Ctrl-C stops the pool", file=sys.stderr, flush=True)
        return pool.wait()
    finally:
        pool.stop()


def build_parser() -> argparse.ArgumentParser:
    from metaserver.__main__ import tls_arguments

    p = argparse.ArgumentParser(prog="umbp", description="UMBP: a distributed KV-cache page pool")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("up", help="run a local pool (etcd, metaserver, nodes) in the foreground")
    s.add_argument("--nodes", type=int, default=2)
    s.add_argument("--capacity", default="1GiB", help="arena size of each node (512MiB, 4GiB, bytes)")
    s.add_argument("--disk", default=None, metavar="DIR",
                   help="give each node a disk tier: a file in DIR (local NVMe) that pages are demoted to instead of "
                        "dropped; it outlives the pool")
    s.add_argument("--disk-capacity", default=None, metavar="SIZE", help="each node's disk tier (with --disk)")
    s.add_argument("--arena-root", default=None, metavar="DIR",
                   help="make the nodes' arenas under DIR instead of /dev/shm: a tmpfs mounted with huge=within_size "
                        "gives them 2 MiB pages, which same-host reads copy out of faster")
    s.add_argument("--etcd", default=None, help="use this etcd (HOST:PORT) instead of starting one")
    s.add_argument("--port", type=int, default=7700, help="metaserver port (0 = any free port)")
    s.add_argument("--lease-ttl", type=float, default=10.0)
    s.add_argument("--metaservers", type=int, default=1, metavar="N",
                   help="metaserver processes (default 1); more than one partition the directory into slots led by "
                        "all of them (ports --port, --port+1, ...)")
    s.add_argument("--slots", type=int, default=0, help="slots of the partitioned pool (default two a metaserver "
                                                        "with --metaservers > 1)")
    s.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="restart a process that dies (same node id and arena, same ports) at most N times within 10 "
                        "minutes; then leave it down (default 3)")
    s.add_argument("-v", "--verbose", action="store_true", help="echo the children's logs")
    s.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="the metaservers publish vLLM KV events: metaserver i on PORT+2i, replays on PORT+2i+1 "
                        "(port 0: any, printed); docs/operations/kv-events.md")
    _token_arg(s)
    tls_arguments(s)
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("metaserver", help="run a metaserver (several may share one etcd: one leads)")
    from metaserver.__main__ import add_arguments as metaserver_arguments

    metaserver_arguments(s)
    s.set_defaults(func=cmd_metaserver)

    s = sub.add_parser("node", help="run a storage node")
    _metaserver_arg(s)
    s.add_argument("--capacity", default=None, help="arena size (512MiB, 4GiB, bytes)")
    s.add_argument("--listen", default=None, help="HOST:PORT for the data server (default 127.0.0.1:0)")
    s.add_argument("--advertise", default=None, help="routable HOST[:PORT] clients should use")
    s.add_argument("--lease-ttl", type=float, default=None, help="seconds without heartbeat before the node is dead")
    s.add_argument("--node-id", default=None, help="stable name: a restart with it reopens the same arena")
    s.add_argument("--tokens", default=None, metavar="FILE",
                   help="scoped client tokens (TOML, see umbp/auth.py); the same file as the metaservers'")
    s.add_argument("--metrics-listen", default=None, metavar="HOST:PORT",
                   help="serve /metrics (Prometheus), /healthz and /readyz on this address (port 0: any)")
    s.add_argument("--disk", default=None, metavar="PATH", help="a disk tier under the arena: this file (local NVMe)")
    s.add_argument("--disk-capacity", default=None, metavar="SIZE", help="the disk tier's size (with --disk)")
    s.add_argument("--disk-threads", type=int, default=None, help="workers doing the disk tier's I/O (default 4)")
    tls_arguments(s)
    s.set_defaults(func=cmd_node)

    s = sub.add_parser("stats", help="pool statistics")
    _metaserver_arg(s)
    s.add_argument("--json", action="store_true")
    s.add_argument("--watch", type=float, default=0, metavar="SECONDS", help="repeat every SECONDS")
    s.add_argument("--count", type=int, default=0, help="with --watch: stop after this many rounds")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser("top", help="live pool and node view, full screen (Ctrl-C quits)")
    _metaserver_arg(s)
    s.add_argument("--interval", type=float, default=1.0, metavar="SECONDS", help="refresh period (default 1)")
    s.add_argument("--count", type=int, default=0, help="stop after this many refreshes (default: until Ctrl-C)")
    s.set_defaults(func=cmd_top)

    s = sub.add_parser("nodes", help="storage nodes and their state")
    _metaserver_arg(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_nodes)

    s = sub.add_parser("ls", help="list objects")
    _metaserver_arg(s)
    s.add_argument("--namespace", default=None)
    s.add_argument("--limit", type=int, default=1000)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_ls)

    s = sub.add_parser("evict", help="evict unleased objects (default: one pass down to the low watermark)")
    _metaserver_arg(s)
    s.add_argument("--bytes", default=None, help="free at least this much (512MiB, ...)")
    s.add_argument("--all", action="store_true", help="evict every unleased object")
    s.set_defaults(func=cmd_evict)

    s = sub.add_parser("drain", help="stop placing pages on NODE and drop its unleased pages")
    _metaserver_arg(s)
    s.add_argument("node")
    s.set_defaults(func=cmd_drain)

    from umbp.demo import add_subcommands  # demo, replay, bench: the main job and the bandwidth bench

    add_subcommands(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except UmbpError as e:
        print(f"umbp: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
