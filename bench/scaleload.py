"""The load (takeover) figures of ``bench/scale.py``, each run in a child of its own: the records of its workload's N
pages as a metaserver writes them to etcd (``etcd_records``: segments, or with ``--records`` the msgpack layouts of
before; ``page_rows`` places the pages as the metaserver would), parsed as ``EtcdStore.load`` parses a scan's answers
and loaded by ``TableDirectory.load`` (``run_load``, also ``bench/columns.py``'s cold load), and the same records
written to and read back from a real etcd (``run_etcd``). ``RECORDS`` is the layout, set from ``--records``.

Costs: the records are made on the fly (a generator), so what is held at the end is what a takeover holds: the parsed
records and the table built from them.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import tempfile
import time

import msgpack
import numpy.random  # noqa: F401 - a metaserver has it before any load (its first table's key index, made at start)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself, for the helpers below

import scaleworkload as workload  # noqa: E402
from bench.common import cpu, hwm  # noqa: E402
from metaserver.table.directory import TableDirectory  # noqa: E402
from scaleworkload import (CHAIN_MAX, CHAIN_MIN, NODES, ROOT_PAGES, chain_pages, models, node_capacity,  # noqa: E402
                           rank_keys, rank_keys_opt)
from transport.keyform import digest_key  # noqa: E402
from transport.objformat import object_size  # noqa: E402

RECORDS = "segment"  # the etcd layout of the load's records (--records)
SCAN_COMMIT_RECORDS = 320  # commit records of 128 pages in one range answer: about what EtcdStore.scan asks for


def _segment(ns: bytes, cur: list, parents: bool) -> bytes:
    """The segment (``records.pack_segment``) of pages (key, node, offset, payload_len, gen, parent) of ``ns``."""
    from metaserver.table.records import pack_segment
    nodes = sorted({c[1] for c in cur})
    nix = {x: i for i, x in enumerate(nodes)}
    codes = sorted({c[3] for c in cur})
    cix = {x: i for i, x in enumerate(codes)}
    keys = [c[0] for c in cur]
    lens = None if all(len(k) == 32 for k in keys) else [len(k) for k in keys]
    par = [c[5] for c in cur] if parents else None
    from transport.keyform import digests
    return pack_segment([ns.decode()], None, nodes, [nix[c[1]] for c in cur], [c[2] >> 12 for c in cur], codes,
                        [cix[c[3]] for c in cur], [c[4] for c in cur], b"".join(keys), 32, lens,
                        None if par is None or all(p is None for p in par) else par,
                        digs=None if lens is None else digests(keys)[0])


def etcd_records(n_pages: int, seed: int, prefix: bytes = b"/umbp/pages/", parents: bool = True):
    """Yield (etcd key, value, revision) of the records of n_pages pages as a metaserver writes them (``RECORDS``):
    segments (``records.SEGMENT_PAGES`` consecutive pages of one namespace each, what the metaserver writes now;
    parents only with ``parents``: under lru it names none), msgpack commit records (``persist.BATCH_PAGES`` each,
    the layout before) or, with ``--records page``, a record per page (the layout before them)."""
    if RECORDS == "segment":
        from metaserver.table.records import SEGMENT_PAGES
        cur, cur_ns, n = [], None, 0
        for ns, k, node, off, payload, rev, p in page_rows(n_pages, seed):
            if (ns != cur_ns or len(cur) >= SEGMENT_PAGES) and cur:
                n += 1
                yield b"%s%s/+1.%x" % (prefix, cur_ns, n), _segment(cur_ns, cur, parents), rev
                cur = []
            cur_ns = ns
            cur.append((k, node, off, payload, rev, p))
        if cur:
            yield b"%s%s/+1.%x" % (prefix, cur_ns, n + 1), _segment(cur_ns, cur, parents), rev + 1
        return
    if RECORDS == "page":
        for ns, k, node, off, payload, rev, p in page_rows(n_pages, seed):
            yield (prefix + ns + b"/" + k.hex().encode(),
                   msgpack.packb([node, off, payload, rev, p], use_bin_type=True), rev)
        return
    from metaserver.store.persist import BATCH_PAGES
    cur: list = []
    cur_ns = None
    n = 0
    for ns, k, node, off, payload, rev, p in page_rows(n_pages, seed):
        if (ns != cur_ns or len(cur) >= BATCH_PAGES) and cur:
            n += 1
            yield (b"%s%s/+1.%x" % (prefix, cur_ns, n), msgpack.packb(cur, use_bin_type=True), rev)
            cur = []
        cur_ns = ns
        cur.append((k, node, off, payload, rev, p))
    if cur:
        yield (b"%s%s/+1.%x" % (prefix, cur_ns, n + 1), msgpack.packb(cur, use_bin_type=True), rev + 1)


def page_rows(n_pages: int, seed: int):
    """Yield (ns, key, node, offset, payload_len, gen, parent) of n_pages pages as a metaserver placed them: the
    workload's keys and parents at consecutive offsets, each session chain (all its ranks) on one node, the least
    filled one when it starts (placement keeps a chain on its parent's node), the system prompts on the first."""
    ms = models()
    per_node_off = [4096] * NODES
    rev = 1000
    rng = random.Random(seed)
    total = 0
    while total < n_pages:
        m = min(ms, key=lambda m: m.pages / m.share)
        c = len(m.lengths)
        n = rng.randint(CHAIN_MIN, CHAIN_MAX)
        m.lengths.append(n)
        hexes, parents = chain_pages(m, c, 0 if c == 0 else ROOT_PAGES, ROOT_PAGES + n)
        size = object_size(m.payload)
        node = per_node_off.index(min(per_node_off))
        for rk, rp in zip(rank_keys(m, hexes), rank_keys_opt(m, parents)):
            for k, p in zip(rk, rp):
                off = per_node_off[node]
                per_node_off[node] += size
                rev += 1
                if workload.HEX_KEYS:  # the metaserver keeps (and persists) a digest key in its raw form (keyform.digest_key)
                    k, p = digest_key(k), digest_key(p) if p is not None else None
                yield (m.ns.encode(), k, f"host{node:02d}", off, m.payload, rev, p)
                m.pages += 1
                total += 1
                if total >= n_pages:
                    return


def load_capacity(n_pages: int) -> int:
    """Arena bytes of each of the NODES nodes that ``page_rows(n_pages)`` fills: room for the chains' imbalance
    across nodes (whole chains are placed at once)."""
    return node_capacity(models(), n_pages, slack=1.0 + 0.05 + 2e4 * CHAIN_MAX / max(n_pages, 1))


def load_directory(policy: str, pages, n_pages: int) -> tuple[TableDirectory, float]:
    """The table half of ``Metaserver._load`` (metaserver/ha/service.py): ``TableDirectory.load`` itself (group by node,
    sort by revision, ``tableload.load_pages`` per node) into a table of NODES nodes. Returns the table and the CPU
    seconds it took."""
    t = cpu()
    d = TableDirectory(policy=policy)
    cap = load_capacity(n_pages)
    stale, rejected = d.load({f"host{i:02d}": ({"capacity": cap}, 0) for i in range(NODES)}, pages)
    assert not stale and not rejected, (len(stale), len(rejected))
    return d, cpu() - t


def run_load(policy: str, n_pages: int, seed: int) -> dict:
    """Records are made as etcd returns them (protobuf KeyValues, a range response of LOAD_PAGE page records or
    SCAN_COMMIT_RECORDS commit records: what ``EtcdStore.scan`` asks for, about 4 MB) and parsed as
    ``EtcdStore.load`` parses them while it scans (``PageRecords.add``, timed), so what is held at the end is what
    a takeover holds: the parsed records, then the table built from them (``TableDirectory.load``). The collector
    is paused as ``Metaserver._load`` pauses it (``gc_paused``)."""
    import aetcd.rpc
    from metaserver.store.persist import LOAD_PAGE
    from metaserver.table.snapshot import PageRecords
    from metaserver.store.fullload import gc_paused
    parse_s = 0.0
    with gc_paused():
        pages = PageRecords(b"/umbp/pages/")
        resp = aetcd.rpc.RangeResponse()
        for key, value, rev in etcd_records(n_pages, seed, parents=policy != "lru"):
            resp.kvs.add(key=key, value=value, mod_revision=rev, create_revision=rev)
            if len(resp.kvs) == (LOAD_PAGE if RECORDS == "page" else SCAN_COMMIT_RECORDS // 8 if RECORDS == "segment"
                                 else SCAN_COMMIT_RECORDS):
                kvs = list(resp.kvs)
                t = cpu()
                pages.add(kvs)
                parse_s += cpu() - t
                resp = aetcd.rpc.RangeResponse()
        kvs = list(resp.kvs)
        t = cpu()
        pages.add(kvs)
        parse_s += cpu() - t
        del kvs, resp
        d, load_s = load_directory(policy, pages, n_pages)
    return {"policy": policy, "pages": d.objects, "parse_s": parse_s, "load_s": load_s,
            "peak_rss_gib": hwm() / 2**30}


# ---- a real etcd: EtcdStore.load of the records -----------------------------------------------------------------

async def _fill_and_read(addr: str, n_pages: int, seed: int) -> dict:
    from metaserver.store.persist import EtcdStore
    store = EtcdStore(addr, "/umbp")
    await store.wait_ready(20.0)
    t = time.perf_counter()
    batch, inflight = [], []
    sem = asyncio.Semaphore(16)

    async def txn(ops):
        async with sem:
            await store.txn(ops)

    for key, value, _rev in etcd_records(n_pages, seed, store._pages):
        batch.append(store.op_put(key, value))
        if len(batch) == (128 if RECORDS == "page" else 8):  # 8 commit records: about 100 KB
            inflight.append(asyncio.create_task(txn(batch)))
            batch = []
            if len(inflight) >= 64:
                await asyncio.gather(*inflight)
                inflight = []
    if batch:
        inflight.append(asyncio.create_task(txn(batch)))
    await asyncio.gather(*inflight)
    write_s = time.perf_counter() - t
    from metaserver.store.fullload import gc_paused
    t, c = time.perf_counter(), cpu()
    with gc_paused():  # as Metaserver._load reads
        _nodes, _arenas, pages = await store.load()
    read_s, read_cpu = time.perf_counter() - t, cpu() - c
    await store.close()
    return {"etcd_pages": len(pages), "etcd_write_s": write_s, "etcd_load_s": read_s, "etcd_load_cpu_s": read_cpu}


def run_etcd(n_pages: int, seed: int) -> dict:
    from umbp.launcher import find_etcd, free_port
    exe = find_etcd()
    if exe is None:
        return {"etcd_error": "no etcd on PATH"}
    port, peer = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="umbp-scale-etcd-") as tmp:
        proc = subprocess.Popen([exe, "--data-dir", tmp, "--listen-client-urls", f"http://127.0.0.1:{port}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{port}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                 "--quota-backend-bytes", str(8 << 30), "--max-request-bytes", str(8 << 20)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return asyncio.run(_fill_and_read(f"127.0.0.1:{port}", n_pages, seed))
        finally:
            proc.terminate()
            proc.wait(30)
