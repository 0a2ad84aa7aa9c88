"""Live views of a pool for ``umbp stats --watch SECONDS`` and ``umbp top``: one STATS call per refresh, rendered
as rich tables; rates are differences between two consecutive STATS answers divided by the time between them.

What each refresh shows: the pool (leader, capacity and fill, objects, hit rate over the last interval and since
the leader started, puts, looked-up keys and evictions per second, etcd writes per second and queued), then one
row per node: a capacity bar, used and capacity, objects, the change of used bytes per second (pages written net
of evictions: the metaserver sees placement, not traffic; a node's own TCP bytes are on its ``/metrics``,
``umbp_node_transport_bytes_total``), transports, pid and state.

Cost: one STATS request per refresh (O(nodes) on the metaserver). Blocks until ``count`` refreshes are shown or
Ctrl-C; a failed STATS call (failover in progress) shows the error in place of the table and is retried at the next
refresh. On a terminal the table is redrawn in place (``top``: full screen); otherwise each refresh is printed.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from umbp.errors import UmbpError
from umbp.sizes import format_size

BAR = 16


def _bar(used: int, cap: int) -> Text:
    frac = used / cap if cap else 0.0
    full = min(BAR, round(frac * BAR))
    style = "green" if frac < 0.8 else "yellow" if frac < 0.95 else "red"
    return Text("█" * full, style=style) + Text("░" * (BAR - full), style="dim") + Text(f" {100 * frac:5.1f}%")


def _rate(cur: dict | None, prev: dict | None, key: str, dt: float) -> float | None:
    if cur is None or prev is None or dt <= 0 or key not in cur or key not in prev:
        return None
    d = cur[key] - prev[key]
    return d / dt if d >= 0 else None  # a counter reset (new leader): no rate this round


def _fmt_rate(v: float | None, unit: str = "/s", size: bool = False) -> str:
    if v is None:
        return "-"
    return f"{format_size(int(v))}/s" if size else f"{v:,.0f}{unit}"


def render(s: dict, prev: dict | None, dt: float, title: str = "UMBP pool") -> Group:
    """The pool summary and the per-node table for STATS answer ``s`` (``prev``: the answer ``dt`` seconds
    before, for rates; None on the first refresh)."""
    cap, used = s.get("capacity_bytes", 0), s.get("used_bytes", 0)
    hits, misses = s.get("hits", 0), s.get("misses", 0)
    head = Table(title=title, show_header=False, box=None, pad_edge=False)
    head.add_column(style="bold")
    head.add_column()
    nodes = s.get("nodes", [])
    alive = sum(1 for n in nodes if n.get("alive"))
    head.add_row("leader", f"{s.get('leader') or '-'}" + ("" if s.get("is_leader", True) else " (not leading)"))
    head.add_row("capacity", Text(f"{format_size(used)} of {format_size(cap)}  ") + _bar(used, cap)
                 + Text(f"  {alive} of {len(nodes)} nodes alive"))
    head.add_row("objects", f"{s.get('objects', 0):,} ready, {s.get('pending', 0):,} pending, "
                            f"{s.get('pinned', 0):,} leased")
    dh, dm = _rate(s, prev, "hits", dt), _rate(s, prev, "misses", dt)
    interval = f"{100 * dh / (dh + dm):.1f}% now" if dh is not None and dm is not None and dh + dm > 0 else "- now"
    total = f"{100 * hits / (hits + misses):.1f}% since the leader started" if hits + misses else "no lookups yet"
    head.add_row("hit rate", f"{interval}, {total} ({hits:,} hits, {misses:,} misses)")
    lookups = None if dh is None or dm is None else dh + dm
    head.add_row("rates", f"puts {_fmt_rate(_rate(s, prev, 'puts', dt))}, keys looked up {_fmt_rate(lookups)}, "
                          f"evictions {_fmt_rate(_rate(s, prev, 'evictions', dt))}")
    head.add_row("etcd", f"{_fmt_rate(_rate(s, prev, 'etcd_ops', dt))} ops, {s.get('etcd_pending_ops', 0):,} queued, "
                         f"{s.get('etcd_retries', 0):,} retries")

    t = Table(title="nodes", expand=False)
    for col, kw in (("node", {}), ("address", {}), ("capacity", {"min_width": BAR + 7}),
                    ("used / capacity", {"justify": "right"}), ("objects", {"justify": "right"}),
                    ("written/s (net)", {"justify": "right"}), ("transports", {}), ("pid", {"justify": "right"}),
                    ("state", {})):
        t.add_column(col, **kw)
    before = {n.get("node_id"): n for n in (prev or {}).get("nodes", [])}
    for n in sorted(nodes, key=lambda n: (not n.get("alive"), -n.get("used_bytes", 0), str(n.get("node_id")))):
        ncap, nused = n.get("capacity_bytes", 0), n.get("used_bytes", 0)
        p = before.get(n.get("node_id"))
        d = (nused - p.get("used_bytes", 0)) / dt if p is not None and dt > 0 else None
        written = "-" if d is None else (f"{format_size(int(d))}/s" if d >= 0 else f"-{format_size(int(-d))}/s")
        state = ("draining" if n.get("draining") else "provisional" if n.get("provisional") else "alive") \
            if n.get("alive") else "DEAD"
        t.add_row(str(n.get("node_id")), f"{n.get('host')}:{n.get('port')}", _bar(nused, ncap),
                  f"{format_size(nused)} / {format_size(ncap)}", f"{n.get('objects', 0):,}", written,
                  ",".join(n.get("transports", [])), str(n.get("pid", "")),
                  Text(state, style="red bold" if state == "DEAD" else "yellow" if state != "alive" else "green"))
    return Group(head, t)


def watch(fetch: Callable[[], dict], interval: float, count: int = 0, screen: bool = False,
          console: Console | None = None, title: str = "UMBP pool") -> int:
    """Refresh every ``interval`` seconds until ``count`` refreshes (0: until Ctrl-C). Returns 0."""
    con = console or Console(width=None if sys.stdout.isatty() else 120)
    prev: dict | None = None
    t_prev = 0.0
    rounds = 0

    def frame() -> Any:
        nonlocal prev, t_prev
        now = time.monotonic()
        try:
            s = fetch()
        except UmbpError as e:
            return Text(f"{title}: {e} (retrying every {interval:g}s)", style="red")
        out = render(s, prev, now - t_prev if prev is not None else 0.0,
                     f"{title} · every {interval:g}s · {time.strftime('%H:%M:%S')}")
        prev, t_prev = s, now
        return out

    try:
        if con.is_terminal:
            with Live(frame(), console=con, screen=screen, auto_refresh=False, transient=False) as live:
                rounds = 1
                while not count or rounds < count:
                    time.sleep(interval)
                    live.update(frame(), refresh=True)
                    rounds += 1
        else:
            while True:
                con.print(frame())
                rounds += 1
                if count and rounds >= count:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0
