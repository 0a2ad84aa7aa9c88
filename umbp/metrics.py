"""Health and Prometheus metrics over HTTP for the metaserver and the storage node (``--metrics-listen HOST:PORT``).

Endpoints, on a port of their own (never the data or control port):

- ``GET /metrics``: the process's registry in the Prometheus text format (``prometheus_client.generate_latest``);
- ``GET /healthz``: 200 ``ok`` while the process's event loop answers and its main duties run (liveness);
- ``GET /readyz``: 200 when it can do its job (metaserver: serving as the leader, or a standby that knows the
  leader; node: registered with a metaserver), else 503 with the reason in the body (readiness).
  ``HEAD`` works on all three; anything else is 404/405.

The server is a tiny asyncio HTTP/1.1 responder on the component's own event loop, not a thread: a scrape reads the
directory or the node's counters between two requests, so collectors need no locks, and a wedged loop shows up as a
failing ``/healthz`` (which is what a liveness probe should see). Every connection answers one request and closes.

Invariants and bounds: a request head larger than ``MAX_HEAD`` or slower than ``REQUEST_TIMEOUT_S`` is dropped; at
most ``MAX_CONNECTIONS`` are open at once (more are closed unanswered), so a scraper storm costs bounded memory.
Metric values are read at scrape time (custom collectors) except request latencies, which are histograms observed
where requests finish (``RequestMetrics``: one dict probe and one ``observe``, about 1-2 us per request).

Costs: a metaserver scrape is O(nodes) plus the histograms (a few hundred series: a millisecond or two); nothing
here walks the directory.

A shared leaf like ``umbp.config``: it imports ``prometheus_client``, ``umbp.errors`` and (inside ``MetricsServer``,
to parse its listen address) ``umbp.config``, both leaves themselves, so the metaserver may use it. The metaserver's collector lives in ``metaserver/handlers/metrics.py``; the node's is below (``NodeCollector``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from umbp.errors import StartupError

MAX_HEAD = 8192
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
# Request latency buckets: 50 us (a metaserver EXISTS batch) .. 10 s (a COMMIT stuck behind an etcd election).
LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)

Probe = Callable[[], "tuple[bool, str]"]


def new_registry() -> CollectorRegistry:
    """A registry of its own per component instance (never the global one: tests run several in one process),
    with the standard ``process_*`` metrics (CPU, resident memory, open fds) included."""
    reg = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=reg)
    return reg


class RequestMetrics:
    """``<prefix>_request_seconds{op}`` (a histogram: its ``_count`` is the request count) and
    ``<prefix>_request_errors_total{op,status}``. ``name`` maps an opcode to its label; unknown opcodes share one
    label so a fuzzing peer cannot blow up the series count."""

    def __init__(self, registry: CollectorRegistry, prefix: str, name: Callable[[int], str | None],
                 what: str = "requests", status_name: Callable[[int], str | None] = lambda s: None):
        self._name = name
        self._status_name = status_name
        self.latency = Histogram(f"{prefix}_request_seconds", f"Time to answer {what}, by opcode",
                                 ["op"], registry=registry, buckets=LATENCY_BUCKETS)
        self.errors = Counter(f"{prefix}_request_errors", f"{what.capitalize()} answered with an error, by opcode "
                                                          "and status", ["op", "status"], registry=registry)
        self._children: dict[int, Any] = {}

    def _label(self, op: int) -> str:
        return self._name(op) or "other"

    def observe(self, op: int, seconds: float) -> None:
        child = self._children.get(op)
        if child is None:
            child = self._children[op] = self.latency.labels(self._label(op))
        child.observe(seconds)

    def since(self, op: int, t0: float) -> None:
        """Observe ``perf_counter() - t0``."""
        self.observe(op, time.perf_counter() - t0)

    def error(self, op: int, status: int) -> None:
        self.errors.labels(self._label(op), self._status_name(status) or str(status)).inc()


# ------------------------------------------------------------------------------------------------------ HTTP side

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


class MetricsServer:
    """The HTTP endpoint. ``start()`` binds (raises StartupError when it cannot) and returns at once; requests are
    served on the running loop until ``close()``. ``url`` is ``http://HOST:PORT/metrics`` with the bound port."""

    def __init__(self, component: str, registry: CollectorRegistry, healthy: Probe, ready: Probe):
        self.component = component
        self.registry = registry
        self.healthy = healthy
        self.ready = ready
        self.host = ""
        self.port = 0
        self.scrapes = 0
        self._server: asyncio.AbstractServer | None = None
        self._open = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    async def start(self, listen: str) -> "MetricsServer":
        from umbp.config import split_host_port

        host, port = split_host_port(listen, self.component)
        try:
            self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEAD, reuse_address=True)
        except OSError as e:
            raise StartupError(self.component, f"cannot listen for metrics on {listen}: {e.strerror or e}") from e
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > MAX_CONNECTIONS:
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError,
                    ValueError):
                return
            status, ctype, body, head_only = self._answer(head)
            reason = _REASONS.get(status, "")
            writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode("latin-1") + (b"" if head_only else body))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            self._open -= 1
            writer.close()

    def _answer(self, head: bytes) -> tuple[int, str, bytes, bool]:
        text = "text/plain; charset=utf-8"
        try:
            method, target, _version = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        except ValueError:
            return 400, text, b"bad request line\n", False
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz", "/readyz"):
            return 404, text, b"not found: try /metrics, /healthz or /readyz\n", method == "HEAD"
        if method not in ("GET", "HEAD"):
            return 405, text, b"only GET and HEAD\n", False
        head_only = method == "HEAD"
        try:
            if path == "/metrics":
                self.scrapes += 1
                return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry), head_only
            ok, why = (self.healthy if path == "/healthz" else self.ready)()
        except Exception as e:  # noqa: BLE001 - a broken collector or probe is an answer, never a dead endpoint
            return 500, text, f"{self.component}: {type(e).__name__}: {e}\n".encode(), head_only
        return (200 if ok else 503), text, f"{why}\n".encode(), head_only


async def start_endpoint(component: str, listen: str, registry: CollectorRegistry, healthy: Probe,
                         ready: Probe) -> MetricsServer:
    return await MetricsServer(component, registry, healthy, ready).start(listen)


# ------------------------------------------------------------------------------------------------- the node's side

class NodeCollector(Collector):
    """A storage node's metrics, read at scrape time from ``NodeServer`` and its ``MetaLink`` (duck-typed: this
    module does not import the node). Every series carries ``node_id``.

    Bytes are counted where the node's CPU sees them: TCP reads (out) and writes (in). shm copies (same-host
    clients map the arena) and RDMA READ/WRITE (one-sided) never pass through the node process; the metaserver's
    ``umbp_pool_*`` metrics count those pages."""

    def __init__(self, node: Any, link: Any = None):
        self.node = node
        self.link = link

    def describe(self) -> Iterable[Metric]:
        return []  # collect() reads live state, only at scrape time

    def collect(self) -> Iterable[Metric]:
        n = self.node
        nid = [n.node_id]
        s = n.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["node_id"])
            g.add_metric(nid, value)
            return g

        info = GaugeMetricFamily("umbp_node_info", "Constant 1: the node's identity and transports",
                                 labels=["node_id", "addr", "transports", "arena"])
        info.add_metric([n.node_id, f"{n.host}:{n.port}", ",".join(n.transports()),
                         "reopened" if n.arena.reopened else "new"], 1)
        yield info
        yield gauge("umbp_node_capacity_bytes", "Arena capacity", n.config.capacity)
        registered = self.link is not None and self.link.leader is not None
        yield gauge("umbp_node_registered", "1 while registered with a metaserver (heartbeating)", int(registered))
        req = CounterMetricFamily("umbp_node_requests", "Data requests served, by operation",
                                  labels=["node_id", "op"])
        req.add_metric(nid + ["read"], s.get("reads", 0))
        req.add_metric(nid + ["write"], s.get("writes", 0))
        yield req
        err = CounterMetricFamily("umbp_node_request_errors", "Data requests answered with an error",
                                  labels=["node_id"])
        err.add_metric(nid, s.get("errors", 0))
        yield err
        tb = CounterMetricFamily("umbp_node_transport_bytes", "Payload bytes through the node's CPU, by transport "
                                 "and direction (in: written into the arena, out: read from it)",
                                 labels=["node_id", "transport", "direction"])
        tb.add_metric(nid + ["tcp", "in"], s.get("bytes_written", 0))
        tb.add_metric(nid + ["tcp", "out"], s.get("bytes_read", 0))
        yield tb
        disk = getattr(n, "disk", None)
        if disk is not None:  # the disk tier (umbp/node/disk.py, umbp/node/tiering.py)
            yield gauge("umbp_node_disk_capacity_bytes", "Disk tier capacity", disk.capacity)
            db = CounterMetricFamily("umbp_node_disk_bytes", "Bytes the disk tier read and wrote (client reads, "
                                     "demotions, promotions)", labels=["node_id", "direction"])
            db.add_metric(nid + ["read"], disk.stats["bytes_read"])
            db.add_metric(nid + ["write"], disk.stats["bytes_written"])
            yield db
            ts = n.tier.stats
            mv = CounterMetricFamily("umbp_node_tier_moves", "Pages moved between the node's tiers, by direction "
                                     "and result", labels=["node_id", "move", "result"])
            mv.add_metric(nid + ["demote", "ok"], ts["demotions"])
            mv.add_metric(nid + ["demote", "failed"], ts["demote_failures"])
            mv.add_metric(nid + ["promote", "ok"], ts["promotions"])
            mv.add_metric(nid + ["promote", "failed"], ts["promote_failures"])
            yield mv
            dr = CounterMetricFamily("umbp_node_disk_reads", "Objects served from the disk tier (READV_DISK)",
                                     labels=["node_id"])
            dr.add_metric(nid, ts["disk_reads"])
            yield dr


def node_endpoint_parts(node: Any, link: Any) -> tuple[CollectorRegistry, Probe, Probe]:
    """Registry and probes for a storage node: ready once registered with a metaserver."""
    reg = new_registry()
    reg.register(NodeCollector(node, link))

    def healthy() -> tuple[bool, str]:
        return True, f"{node.component}: ok"

    def ready() -> tuple[bool, str]:
        if link.leader is None:
            return False, f"{node.component}: not registered with a metaserver"
        return True, f"{node.component}: registered with {link.leader}"

    return reg, healthy, ready
