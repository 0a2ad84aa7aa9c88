"""The metaserver's Prometheus metrics and probes (served by ``umbp.metrics.MetricsServer`` on
``--metrics-listen``).

What is exported (names are a contract: deploy/grafana/umbp-dashboard.json and the README use them):

- pool, only while this metaserver serves as the leader (a standby's empty directory would read as an empty pool,
  so ``sum()`` over every metaserver is the pool): ``umbp_pool_capacity_bytes``, ``umbp_pool_used_bytes``,
  ``umbp_pool_objects``, ``umbp_pool_pending_objects``, ``umbp_pool_leased_objects``, counters
  ``umbp_pool_hits_total``, ``umbp_pool_misses_total``, ``umbp_pool_evictions_total``, ``umbp_pool_puts_total``
  (they restart from 0 at a takeover: Prometheus' ``rate()`` treats that as a counter reset), per node
  ``umbp_pool_node_capacity_bytes``/``_used_bytes``/``_objects``/``_alive``/``_provisional`` ``{node_id}``; a
  partitioned pool's process (``metaserver/ha/partition.py``) exports them summed over the slots it leads (node
  capacity: its regions of the node), plus ``umbp_metaserver_slots_led``;
- leadership: ``umbp_metaserver_leader`` (1 while serving), ``umbp_metaserver_leader_revision``,
  ``umbp_metaserver_directory_load_seconds`` (the last takeover's load), ``umbp_metaserver_ticks_total``;
- requests: ``umbp_metaserver_request_seconds{op}`` (histogram) and ``umbp_metaserver_request_errors_total
  {op,status}`` (``umbp.metrics.RequestMetrics``, observed in ``metaserver/server.py``);
- etcd: ``umbp_etcd_commit_seconds`` (histogram: a COMMIT's wait until its pages are durable, queueing in the batch
  writer included), ``umbp_etcd_txns_total``, ``umbp_etcd_ops_total``, ``umbp_etcd_retries_total``,
  ``umbp_etcd_pending_ops``, ``umbp_etcd_txn_max_ops`` (the writer's transaction size: below ``persist_batch`` once
  etcd refused one for its size), ``umbp_etcd_dropped_ops_total`` (writes given up after ``persist_retry_s``, over
  every term of the process: each drop makes the leader give its term up, ``service.Metaserver._writes_dropped``);
- the collector (``metaserver/store/gcpolicy.py``, when installed): ``umbp_metaserver_gc_steps_total``,
  ``umbp_metaserver_gc_freezes_total``, ``umbp_metaserver_gc_thaws_total``, ``umbp_metaserver_gc_pause_max_seconds``,
  ``umbp_metaserver_gc_frozen_objects``;
- ``process_*`` (CPU, memory, fds).

Probes: ``/healthz`` fails once a loop the process cannot work without has ended (the election rounds, the process
lease keep-alive: ``metaserver/ha/election.py``): those loops are supervised (every failure logged and retried), so
one that ended is a bug or a fatal error, and only a restart helps.

Everything except the histograms is read from the live state at scrape time, on the event loop, so nothing is
counted twice and the hot path pays nothing. Cost of a scrape: O(nodes).
"""

from __future__ import annotations

from typing import Any, Iterable

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from metaserver.store import gcpolicy
from transport.wire import Op, Status
from umbp.metrics import LATENCY_BUCKETS, RequestMetrics, new_registry
from umbp.slotmap import merge_nodes


def _op_label(op: int) -> str | None:
    try:
        return Op(op).name
    except ValueError:
        return None


def _status_label(status: int) -> str | None:
    try:
        return Status(status).name
    except ValueError:
        return None


class MetaserverMetrics:
    """The registry of one metaserver process (``metaserver.ha.partition.Partition``), its request metrics and its
    probes."""

    def __init__(self, ms: Any):
        self.ms = ms
        self.registry = new_registry()
        self.requests = RequestMetrics(self.registry, "umbp_metaserver", _op_label, "metaserver requests",
                                       _status_label)
        self.etcd_commit = Histogram("umbp_etcd_commit_seconds", "COMMIT: time until the pages are durable in etcd "
                                     "(batch writer queueing plus the transaction)", registry=self.registry,
                                     buckets=LATENCY_BUCKETS)
        self.registry.register(_Collector(ms))

    def healthy(self) -> tuple[bool, str]:
        for attr, what in (("_election", "the election loop"), ("_keep", "the process lease keep-alive")):
            task = getattr(self.ms, attr)
            if task is not None and task.done():
                err = None if task.cancelled() else task.exception()
                return False, f"metaserver: {what} has stopped" + (f" ({err!r})" if err is not None else "")
        return True, "metaserver: ok"

    def ready(self) -> tuple[bool, str]:
        """Ready as the serving leader, or as a standby that knows who leads (so a Service may route to it: it
        answers NOT_LEADER with the leader's address). Not ready while starting, loading or taking over."""
        ms = self.ms
        el = ms.leader
        if ms.serving:
            return True, f"metaserver: leader (revision {el.revision})"
        if not el.first_round.is_set():
            return False, "metaserver: starting (etcd, election, directory load)"
        leader = el.leader_addr
        if leader and leader != el.addr:
            return True, f"metaserver: standby, leader is {leader}"
        return False, "metaserver: no leader known yet (taking over or etcd unreachable)"


class _Collector(Collector):
    def __init__(self, ms: Any):
        self.ms = ms

    def describe(self) -> Iterable[Metric]:
        return []  # collect() reads live state: not at registration, before the metaserver is built

    def collect(self) -> Iterable[Metric]:
        ms = self.ms
        serving = bool(ms.serving)
        yield _gauge("umbp_metaserver_leader", "1 while this metaserver serves as the leader", int(serving))
        yield _gauge("umbp_metaserver_leader_revision", "The fence: create revision of the leader key while leading",
                     ms.leader.revision if serving else 0)
        yield _gauge("umbp_metaserver_directory_load_seconds", "How long the last takeover's directory load took",
                     ms.load_s)
        yield _counter("umbp_metaserver_ticks", "Background ticks run (expiry, node loss, eviction)", ms.ticks)
        turns = [s.lookups for s in ms.servers.values()]
        yield _counter("umbp_metaserver_turn_lookups", "LOOKUPs answered with the others of their event-loop turn "
                       "(metaserver/handlers/turns.py)", sum(t.asked for t in turns))
        yield _counter("umbp_metaserver_turn_passes", "Table passes those LOOKUPs took (fewer than LOOKUPs: "
                       "turns of several)", sum(t.passes for t in turns))
        turns = [s.allocs for s in ms.servers.values()]
        yield _counter("umbp_metaserver_turn_allocs", "ALLOCs answered with the others of their event-loop turn",
                       sum(t.asked for t in turns))
        yield _counter("umbp_metaserver_turn_alloc_passes", "Table passes those ALLOCs took (one a turn's ALLOCs "
                       "where one pass takes them all, else one each)", sum(t.passes for t in turns))
        w = ms.writer
        yield _counter("umbp_etcd_txns", "etcd transactions written by this term's batch writer", w.txns)
        yield _counter("umbp_etcd_ops", "etcd operations (puts and deletes) written", w.ops)
        yield _counter("umbp_etcd_retries", "Failed etcd transactions retried", w.failures)
        yield _gauge("umbp_etcd_pending_ops", "Operations queued for etcd, not yet written", w.pending())
        yield _counter("umbp_etcd_removal_waits", "Waits for removals to be durable before an extent is reused (an "
                       "ALLOC answer or a disk-tier move; docs/design/persistence-and-fencing.md)", w.barrier_waits)
        yield _counter("umbp_etcd_dropped_ops", "etcd operations given up after persist_retry_s (each drop makes "
                       "the leader give its term up)", sum(x.dropped_ops for x in ms.servers.values()))
        yield _gauge("umbp_etcd_txn_max_ops", "Operations a transaction at most: persist_batch, or less once etcd "
                     "refused one for its size (its --max-txn-ops or --max-request-bytes)", w.batch)
        gcp = gcpolicy.installed()
        if gcp is not None:
            yield _counter("umbp_metaserver_gc_steps", "Collection steps run (metaserver/store/gcpolicy.py)", gcp.steps)
            yield _counter("umbp_metaserver_gc_freezes", "Steps that froze their survivors", gcp.freezes)
            yield _counter("umbp_metaserver_gc_thaws", "Dropped directories that unfroze everything", gcp.thaws)
            yield _gauge("umbp_metaserver_gc_pause_max_seconds", "The longest collection step so far", gcp.max_pause_s)
            yield _gauge("umbp_metaserver_gc_frozen_objects", "Objects in the permanent generation", gcp.frozen)
        if not serving:
            return
        # A partitioned pool's process (metaserver/ha/partition.py): the pool gauges are the sums over the slots it
        # leads (its membership role's directory is empty), so sum() over every process is still the pool. A
        # one-slot pool's process exports its slot's, as the unpartitioned metaserver did.
        led = [ms.servers[x] for x in ms.led()] if ms.slots > 1 else None
        if led is None:
            ms = ms.membership
        if led is not None:
            yield _gauge("umbp_metaserver_slots_led", "Slots of a partitioned pool this process leads", len(led))
        dirs = [x.dir for x in led] if led is not None else [ms.dir]

        def total(attr: str) -> int:
            return sum(getattr(d, attr) for d in dirs)

        yield _gauge("umbp_pool_capacity_bytes", "Arena bytes of the live nodes", total("capacity"))
        yield _gauge("umbp_pool_used_bytes", "Arena bytes held by objects (READY, PENDING and leased)", total("used"))
        yield _gauge("umbp_pool_objects", "READY objects", total("objects"))
        yield _gauge("umbp_pool_pending_objects", "Allocated, not yet committed objects", total("pending"))
        yield _gauge("umbp_pool_leased_objects", "Objects pinned by a read lease", total("pinned"))
        yield _gauge("umbp_pool_held_bytes", "Freed arena bytes not yet placeable (write quarantine; open allocations "
                     "of closed connections; aborted failed writes)", sum(d.quarantine.held_bytes for d in dirs))
        yield _counter("umbp_pool_hits", "Keys found by LOOKUP", total("hits"))
        yield _counter("umbp_pool_misses", "Keys not found by LOOKUP", total("misses"))
        yield _counter("umbp_pool_evictions", "Objects evicted (pressure, watermark, admin)", total("evictions"))
        yield _counter("umbp_pool_puts", "Objects committed", total("puts"))
        yield _counter("umbp_pool_dead_listed_pages", "Pages that left a durable commit record named by a dead list "
                       "instead of a rewrite of the record", sum(d.commits.dead_pages for d in dirs))
        tiers = [d.tiers.totals() for d in dirs]  # the nodes' disk tiers (metaserver/table/tiers.py)
        yield _gauge("umbp_pool_disk_capacity_bytes", "Disk-tier bytes of the live nodes", sum(t[2] for t in tiers))
        yield _gauge("umbp_pool_disk_used_bytes", "Disk-tier bytes held by objects", sum(t[3] for t in tiers))
        yield _counter("umbp_pool_demotions", "Objects moved from DRAM to a node's disk tier",
                       sum(d.tiers.demotions for d in dirs))
        yield _counter("umbp_pool_promotions", "Objects moved from a node's disk tier back to DRAM",
                       sum(d.tiers.promotions for d in dirs))
        fams = {name: GaugeMetricFamily(f"umbp_pool_node_{name}", doc, labels=["node_id"]) for name, doc in (
            ("capacity_bytes", "A node's arena capacity"), ("used_bytes", "A node's arena bytes held by objects"),
            ("objects", "Objects on a node"), ("alive", "1 while the node heartbeats within its lease"),
            ("provisional", "1 while a node loaded at a takeover has not re-registered"),
            ("disk_capacity_bytes", "A node's disk-tier capacity (0: none)"),
            ("disk_used_bytes", "A node's disk-tier bytes held by objects"))}
        for info in (merge_nodes([x.admin.node_maps() for x in led]) if led is not None else ms.admin.node_maps()):
            nid = [info["node_id"]]
            fams["capacity_bytes"].add_metric(nid, info["capacity_bytes"])
            fams["used_bytes"].add_metric(nid, info["used_bytes"])
            fams["objects"].add_metric(nid, info["objects"])
            fams["alive"].add_metric(nid, int(bool(info["alive"])))
            fams["provisional"].add_metric(nid, int(bool(info.get("provisional"))))
            fams["disk_capacity_bytes"].add_metric(nid, info.get("disk_capacity_bytes", 0))
            fams["disk_used_bytes"].add_metric(nid, info.get("disk_used_bytes", 0))
        yield from fams.values()


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
