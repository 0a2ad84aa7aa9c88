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
record, which is what the layout's design has to answer. Nothing asserts.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=200_000)
    a = ap.parse_args()
    exe = find_etcd()
    if exe is None:
        raise SystemExit("bench/records.py: no etcd on PATH (make etcd)")
    port, peer = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="umbp-records-etcd-") as tmp:
        proc = subprocess.Popen([exe, "--data-dir", tmp, "--listen-client-urls", f"http://127.0.0.1:{port}",
                                 "--advertise-client-urls", f"http://127.0.0.1:{port}",
                                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                                 "--quota-backend-bytes", str(8 << 30)],  # requests: etcd's default limit, as deployed
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            res = asyncio.run(run(f"127.0.0.1:{port}", proc.pid, a.pages))
        finally:
            proc.terminate()
            proc.wait(30)
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
