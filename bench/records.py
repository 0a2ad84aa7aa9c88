"""etcd records per page against one record per commit batch: what each layout costs etcd and the metaserver, measured
against one real etcd in one run (a design input for issue 17 item 5 and issue 18's warm copies; the batch layout is
not built: nothing in the metaserver writes it).

- ``page`` (today, ``metaserver/store/persist.py``): one record per page, ``{prefix}/pages/{ns}/{hex key}`` ->
  msgpack([node, offset, size, gen, parent]); the writer's transactions carry 128 of them (``BatchWriter``).
- ``batch``: one record per commit of 128 pages, ``{prefix}/batches/{id}`` -> msgpack of the 128 records
  [key, node, offset, size, gen, parent]; a transaction carries one.

For each layout, N pages of the same records (digest keys, one namespace), four transactions in flight as the
metaserver's writer keeps them:
- put: pages/s, and CPU per page of this process (protobuf and gRPC, as the leader pays it) and of etcd;
- watch: a watch from the first revision replayed to the end, each value unpacked: this process's CPU per page (a
  warm copy's share before it files anything);
- scan: every record read back and unpacked, in ranges of ``LOAD_PAGE`` records (page layout) or of 300 (batch
  layout: 38,400 pages, 2.7 MB, under gRPC's 4 MiB answer limit) (a cold load's share before it files anything);
- delete: every record deleted (128 keys a transaction, or one batch record a transaction): pages/s.
- ``segment`` (what the metaserver writes now, ``metaserver/table/records.py``): ``SEGMENT_PAGES`` = 1,024 pages a
  record as little-endian columns (group commit fills them), a transaction carries one; watch and scan parse each
  with ``records.unpack_segment`` (no object a page).
The batch layout's deletes are the easy case (whole batches); evicting one page of a batch would rewrite or mark its
record, which is what the layout's design has to answer.

``--evict`` (issue 44's eviction target): the metaserver's own table and batch writer (``TableDirectory``,
``BatchWriter``) against the same etcd: a pool of ``--pages`` pages committed 128 a COMMIT (segments of 1,024),
then emptied by eviction with dead lists (the one way a removal reaches etcd; the rewrites of before, a record
rewritten each time a page left it, were measured beside them until that path was removed:
docs/benchmarks/records.md keeps both). Two orders: ``lru``
(``evict_bytes`` passes, least recently used first: commit order, so records die whole) and ``scattered``
(removals of pages at random, as reads that refresh recency leave them: most deaths leave records with pages).
Each pass evicts ``--round`` pages and waits, as the ALLOC that made it would, for the removal barrier
(``removals_durable``). Prints etcd operations (puts and deletes in transactions, the dead lists' deletes
included) and etcd CPU per evicted page, and etcd CPU per committed page of the fill. Nothing asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402

import numpy as np  # noqa: E402

from metaserver.store.persist import LOAD_PAGE, EtcdStore  # noqa: E402
from metaserver.table.records import SEGMENT_PAGES, pack_segment, unpack_segment  # noqa: E402
from umbp.launcher import find_etcd, free_port  # noqa: E402
from metaserver.store.batcher import BatchWriter  # noqa: E402
from metaserver.table.directory import TableDirectory  # noqa: E402
from metaserver.table.entry import Effects  # noqa: E402

PER_COMMIT = 128
INFLIGHT = 4


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def records(n: int) -> list[list]:
    """n page records as a commit path holds them: [raw 32-byte key, node, offset, size, gen, parent]."""
    out, parent = [], None
    for i in range(n):
        key = i.to_bytes(8, "little") * 4
        out.append([key, f"host{i % 32:02d}", 4096 + (i // 32) * 2625536, 2621440, (1 << 40) + i, parent])
        parent = key if i % 512 else None
    return out


def page_items(store: EtcdStore, recs: list[list]) -> list[list[tuple[bytes, bytes]]]:
    """Transactions of the page layout: 128 (etcd key, value) each."""
    pack = msgpack.Packer(use_bin_type=True).pack
    base = store._pages + b"ns/"
    items = [(base + r[0].hex().encode(), pack(r[1:])) for r in recs]
    return [items[i:i + PER_COMMIT] for i in range(0, len(items), PER_COMMIT)]


def batch_items(store: EtcdStore, recs: list[list]) -> list[list[tuple[bytes, bytes]]]:
    """Transactions of the batch layout: one (etcd key, value of 128 records) each."""
    base = store.prefix.encode() + b"/batches/"
    return [[(base + b"%016x" % i, msgpack.packb(recs[i:i + PER_COMMIT], use_bin_type=True))]
            for i in range(0, len(recs), PER_COMMIT)]


def segment_items(store: EtcdStore, recs: list[list]) -> list[list[tuple[bytes, bytes]]]:
    """Transactions of the segment layout: one (etcd key, segment of SEGMENT_PAGES records) each."""
    base = store._pages + b"ns/+1."
    out = []
    for i in range(0, len(recs), SEGMENT_PAGES):
        part = recs[i:i + SEGMENT_PAGES]
        nodes = sorted({r[1] for r in part})
        nix = {x: j for j, x in enumerate(nodes)}
        parents = [r[5] for r in part]
        out.append([(base + b"%x" % i, pack_segment(
            ["ns"], None, nodes, np.array([nix[r[1]] for r in part]), np.array([r[2] >> 12 for r in part]),
            [part[0][3]], None, np.array([r[4] for r in part], np.uint64), b"".join(r[0] for r in part), 32,
            parents=parents if any(p is not None for p in parents) else None))])
    return out


def count_page(value: bytes) -> int:
    return 1


def count_batch(value: bytes) -> int:
    return len(msgpack.unpackb(value, raw=False))


def count_segment(value: bytes) -> int:
    seg = unpack_segment(value)
    seg.digests()
    return seg.n


async def in_flight(txns: list, op) -> None:
    it = iter(txns)

    async def worker():
        for t in it:
            await op(t)
    await asyncio.gather(*(worker() for _ in range(INFLIGHT)))


async def measure(store: EtcdStore, etcd_pid: int, txns: list, n: int, count) -> dict:
    out = {}
    start_rev = await store.revision() + 1
    c0, e0, t0 = time.process_time(), proc_cpu(etcd_pid), time.perf_counter()
    await in_flight(txns, store.write)
    wall = time.perf_counter() - t0
    out["put_pages_s"] = n / wall
    out["put_cpu_us"] = (time.process_time() - c0) / n * 1e6
    out["put_etcd_cpu_us"] = (proc_cpu(etcd_pid) - e0) / n * 1e6

    seen, c0 = 0, time.process_time()
    async for evs in store.watch(start_rev):
        for ev in evs:
            seen += count(ev.kv.value)
        if seen >= n:
            break
    out["watch_cpu_us"] = (time.process_time() - c0) / n * 1e6

    seen, c0, t0 = 0, time.process_time(), time.perf_counter()
    prefix = txns[0][0][0].rsplit(b"/", 1)[0] + b"/"
    async for kvs in store.scan(prefix, page=300 if count is not count_page else LOAD_PAGE):  # (under 4 MiB)
        for kv in kvs:
            seen += count(kv.value)
    assert seen == n, (seen, n)
    out["scan_cpu_us"] = (time.process_time() - c0) / n * 1e6
    out["scan_wall_us"] = (time.perf_counter() - t0) / n * 1e6

    t0 = time.perf_counter()
    await in_flight([[(k, None) for k, _ in t] for t in txns], store.write)
    out["delete_pages_s"] = n / (time.perf_counter() - t0)
    return out


async def run(addr: str, etcd_pid: int, n: int) -> dict:
    store = EtcdStore(addr, "/umbp-bench")
    await store.wait_ready(20.0)
    recs = records(n)
    res = {}
    for name, build, count in (("page", page_items, count_page), ("batch", batch_items, count_batch),
                               ("segment", segment_items, count_segment)):
        res[name] = await measure(store, etcd_pid, build(store, recs), n, count)
    await store.close()
    return res


NODES = 4
PAGE_BYTES = 5000  # payload: an 8 KiB extent


def _submit(w: BatchWriter, fx: Effects, wait: bool = False):
    recs = [(r.name, r) for r in fx.recs] + [(r.name, r) for r in dict.fromkeys(fx.batches)]
    return w.submit(recs, [], wait=wait) if recs else None


async def evict_run(store: EtcdStore, etcd_pid: int, n: int, order: str, rnd: int, tag: int) -> dict:
    """Fill a table of ``n`` pages through the writer, then empty it by eviction (``order``), ``rnd`` pages a pass."""
    w = BatchWriter(store)
    w.start()
    d = TableDirectory()
    seq = iter(range(1, 1 << 40))
    d.commits.namer = lambda ns: b"%sev%d/+%x.%x" % (store._pages, tag, 7, next(seq))
    per_node = -(-n // NODES) * 8192
    for i in range(NODES):
        d.add_space(f"host{i}", per_node)
    keys = [(i + (tag << 40)).to_bytes(8, "little") * 4 for i in range(n)]
    e0 = proc_cpu(etcd_pid)
    waits = []
    for i in range(0, n, PER_COMMIT):
        ks = keys[i:i + PER_COMMIT]
        items, fx = d.alloc("ns", ks, [PAGE_BYTES] * len(ks), None, 1000 + i, 1.0)
        _submit(w, fx)
        _, fx = d.commit("ns", ks, [it[4] for it in items], 2.0)
        f = _submit(w, fx, wait=True)
        if f is not None:
            waits.append(f)
        if len(waits) >= 64:
            await asyncio.gather(*waits)
            waits = []
    await asyncio.gather(*waits)
    await w.flush(120)
    out = {"commit_etcd_cpu_us": (proc_cpu(etcd_pid) - e0) / n * 1e6}
    ops0, e0, t0 = w.ops, proc_cpu(etcd_pid), time.perf_counter()
    evicted = 0
    rng = np.random.default_rng(tag)
    shuffled = [keys[i] for i in rng.permutation(n).tolist()] if order == "scattered" else None
    while evicted < n:
        if order == "lru":
            fx = Effects()
            k, _ = d.evict_bytes(1 << 62, rnd, fx)
        else:
            part = shuffled[evicted:evicted + rnd]
            ok, fx = d.remove("ns", part)
            k = sum(ok)
        if not k:
            break
        evicted += k
        _submit(w, fx)
        b = w.removals_durable()  # the ALLOC that evicted waits for it
        if b is not None:
            await asyncio.shield(b)
    for _ in range(8):  # dead lists' deletes follow the compactions they wait for
        await w.flush(120)
        await asyncio.sleep(0.01)
    out["evict_ops"] = (w.ops - ops0) / max(1, evicted)
    out["evict_etcd_cpu_us"] = (proc_cpu(etcd_pid) - e0) / max(1, evicted) * 1e6
    out["evict_wall_us"] = (time.perf_counter() - t0) / max(1, evicted) * 1e6
    out["dead_pages"] = d.commits.dead_pages / max(1, evicted)
    left = [kv async for kvs in store.scan(store._pages + b"ev%d/" % tag) for kv in kvs]
    out["left"] = len(left)
    await w.close()
    return out


async def evict_main(addr: str, etcd_pid: int, n: int, rounds: list[int]) -> list[tuple]:
    store = EtcdStore(addr, "/umbp-bench")
    await store.wait_ready(20.0)
    res = []
    tag = 0
    for order in ("lru", "scattered"):
        for rnd in rounds:
            tag += 1
            res.append((order, rnd, await evict_run(store, etcd_pid, n, order, rnd, tag)))
    await store.close()
    return res


def print_evict(pages: int, res: list[tuple]) -> None:
    print(f"eviction of a full pool of {pages:,} pages ({NODES} nodes, {PER_COMMIT} a COMMIT, segments of "
          f"{SEGMENT_PAGES}), a pass of R pages waits for the removal barrier; cores {os.cpu_count()}")
    print(f"{'order':<10} {'R':>5} {'etcd ops/page':>14} {'etcd CPU us/page':>17} "
          f"{'wall us/page':>13} {'dead-listed':>11} {'fill: etcd CPU us/committed page':>34} keys left")
    for order, rnd, o in res:
        print(f"{order:<10} {rnd:>5} {o['evict_ops']:>14.4f} "
              f"{o['evict_etcd_cpu_us']:>17.2f} {o['evict_wall_us']:>13.1f} {o['dead_pages']:>11.0%} "
              f"{o['commit_etcd_cpu_us']:>34.2f} {o['left']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=200_000)
    ap.add_argument("--evict", action="store_true", help="eviction through dead lists (module docstring)")
    ap.add_argument("--round", default="16,256", help="--evict: pages a pass evicts, comma-separated")
    a = ap.parse_args()
    exe = find_etcd()
    if exe is None:
        raise SystemExit("bench/records.py: no etcd on PATH (make etcd)")
    port, peer = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="umbp-records-etcd-") as tmp:
        proc = subprocess.Popen([exe, "--data-dir", tmp, "--listen-client-urls", f"http://127.0.0.1:{port}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{port}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                 "--quota-backend-bytes", str(8 << 30),  # requests: etcd's default limit, as deployed
                                 "--max-txn-ops", "1024"],  # as ``umbp up`` and the deploy base run it (batcher.py)
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            if a.evict:
                ev = asyncio.run(evict_main(f"127.0.0.1:{port}", proc.pid, a.pages,
                                            [int(x) for x in a.round.split(",")]))
            else:
                res = asyncio.run(run(f"127.0.0.1:{port}", proc.pid, a.pages))
        finally:
            proc.terminate()
            proc.wait(30)
    if a.evict:
        print_evict(a.pages, ev)
        return
    p, b, g = res["page"], res["batch"], res["segment"]
    print(f"{a.pages:,} pages, {PER_COMMIT} per commit, {INFLIGHT} transactions in flight; cores {os.cpu_count()}")
    rows = (("put pages/s", "put_pages_s", True), ("put: our CPU us/page", "put_cpu_us", False),
            ("put: etcd CPU us/page", "put_etcd_cpu_us", False), ("watch replay: our CPU us/page", "watch_cpu_us",
                                                                    False),
            ("scan: our CPU us/page", "scan_cpu_us", False), ("scan: wall us/page", "scan_wall_us", False),
            ("delete pages/s", "delete_pages_s", True))
    for label, k, higher in rows:
        ratio = g[k] / b[k] if higher else b[k] / g[k]
        print(f"{label:<32} page {p[k]:>11,.2f} | batch of {PER_COMMIT} {b[k]:>11,.2f} | segment of {SEGMENT_PAGES} "
              f"{g[k]:>11,.2f} | segment better than batch by {ratio:5.1f}x")


if __name__ == "__main__":
    main()
