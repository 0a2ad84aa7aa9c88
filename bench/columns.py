"""The columnar page table (``metaserver/columns.py``) against the metaserver's ``Directory`` (lru), same workload,
same run, each in a fresh child process: what issue 17 item 3's targets measure at the directory level.

Workload: one namespace, keys of 32 random bytes (SGLang's digests as ``umbp.keys.normalize_key`` sends them), one
payload size, 32 nodes sized to hold exactly ``--pages`` pages, requests of 1,000 keys as msgpack would hand them
over (fresh bytes objects). Figures:

- memory per page: VmRSS after building N pages minus before, after ``gc.collect()``, divided by N; then the same
  after glibc's ``malloc_trim(0)`` (the build's freed temporaries handed back; the metaserver does not trim);
- alloc+commit keys per CPU-second at N (a full pool: every new key evicts the least recently used page of its node);
- lookup+release keys per CPU-second (1,000 consecutive keys of the build order: a prompt's prefix, all hits);
- exists keys per CPU-second on the same batches;
- wire lookup keys per CPU-second: a LOOKUP and its RELEASE through the service's per-request work minus sockets
  (``bench/servicepath.py`` for the directory: decode, validate, the directory call, a keyed tag per key and a
  capability per node of a closed pool, encode); for the table the same around the call ``dataplane.lookup`` makes
  with ``--directory table`` (``TableDirectory.lookup_granted``: tags kept in a column from a row's first LOOKUP on,
  capabilities packed from the columns), twice over the same prefixes: the first pass pays the tags of rows
  looked up for the first time, the second reads them. The table is driven as the metaserver drives it
  (``metaserver.tabledir.TableDirectory``: ALLOC and COMMIT with their commit records);
- full load CPU seconds (a takeover without a warm copy), each in a fresh child of its own: the N pages of
  ``bench/scale.py``'s workload (``page_rows``: three models, keys of 32 and 33 bytes, three namespaces, parents,
  its 32 nodes, each node's pages at consecutive offsets) handed over as a scan's parse leaves them (not timed:
  ``bench/scale.py`` times the parse), then, timed, for the directory ``metaserver.fullload.fill`` as
  ``Metaserver._load`` runs it (``scale.load_directory``: per node a sort by revision and
  ``Directory.load_entries``, which also links parents), for the table the same per node with
  ``metaserver.tableload.load_pages`` (room reserved once, ``tableload.reserve``; no parent links: the table keeps
  none). The table is handed each node's columns as Python lists, so their conversion to arrays is in its time.

The collector is frozen after the build and disabled while timing, in both children (the metaserver's GC policy
handles its cost apart: ``metaserver/gcpolicy.py``). Rates are CPU seconds of the child (``time.process_time``).
Nothing asserts; the last column is the table's figure over the directory's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from transport import wire  # noqa: E402
from transport.wire import object_size  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself
from scale import load_capacity, load_directory, page_rows, rss  # noqa: E402
from scaleworkload import NODES as LOAD_NODES  # noqa: E402
from servicepath import ServicePath, Wire  # noqa: E402

NODES = 32
BATCH = 1000
PLEN = 64 * 61 * 656  # an MLA page of 64 tokens (DeepSeek-V3), as bench/scale.py's model


def malloc_trim() -> bool:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``); False where there is no such call.
    A build frees big temporaries (a dict's old table, grown lists and arrays) inside the heap, which RSS still
    counts until they are trimmed."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def fresh(keys: list[bytes]) -> list[bytes]:
    """The keys as new objects, the way a request's msgpack decode hands them to the handler."""
    return Wire.keys("kv", keys)["keys"]


class Subject:
    """The calls a request makes, on the directory or on the table as the metaserver runs it (``--directory
    table``: ``metaserver.tabledir.TableDirectory``, with ``Directory``'s signatures)."""

    def __init__(self, kind: str, pages: int):
        per_node = -(-pages // NODES) * object_size(PLEN)
        self.kind = kind
        from metaserver.directory import NEW, Directory
        from metaserver.tabledir import TableDirectory
        self.d = Directory(policy="lru") if kind == "directory" else TableDirectory()  # the table grows as it fills
        for i in range(NODES):
            self.d.add_space(f"node-{i}", per_node)
        self.new = NEW
        self.svc = ServicePath(self.d if kind == "directory" else None, [f"node-{i}" for i in range(NODES)])
        self.tokens = self.svc.tokens

    def put(self, keys: list[bytes], gen: int) -> tuple[int, float]:
        """ALLOC and COMMIT of one request: (keys placed, CPU seconds of the two calls, their etcd effects
        included)."""
        d = self.d
        t0 = time.process_time()
        now = time.monotonic()
        items, _ = d.alloc("kv", keys, [PLEN] * len(keys), None, gen, now)
        new = [(k, it[4]) for k, it in zip(keys, items) if it[0] == self.new]
        d.commit("kv", [k for k, _ in new], [g for _, g in new], now)
        return len(new), time.process_time() - t0

    def lookup_release(self, keys: list[bytes]) -> int:
        lease, locs = self.d.lookup("kv", keys, time.monotonic())
        self.d.release(lease)
        return len(locs) - locs.count(None)  # at C speed: the count is not what is measured

    def exists(self, keys: list[bytes]) -> int:
        return self.d.exists("kv", keys).count(True)

    def wire_lookup(self, frame: bytes) -> bytes:
        """A LOOKUP and its RELEASE the way the service handles them (``bench/servicepath.py``: decode, validate,
        the directory call, tags and capabilities of a closed pool, encode). On the table, the service's own
        columnar call (``TableDirectory.lookup_granted``, what ``dataplane.lookup`` runs with ``--directory table``):
        tags from the column (computed at a row's first LOOKUP: the first pass over the pages pays them), each
        node's capability packed from the columns."""
        if self.kind == "directory":
            return self.svc.lookup(frame)
        ns, keys = self.svc.keys_of(frame)
        return self.svc.answer_lookup(self.d, self.d.lookup_granted(ns, keys, time.monotonic(), None, self.tokens,
                                                                    self.svc.members.get, None, True))


def run(kind: str, pages: int, ops: int, seed: int) -> dict:
    rng = random.Random(seed)
    keys = [rng.randbytes(32) for _ in range(pages)]
    gc.collect()
    base = rss()
    s = Subject(kind, pages)
    gen = 1
    build_s = 0.0
    for i in range(0, pages, BATCH):
        build_s += s.put(fresh(keys[i:i + BATCH]), gen)[1]
        gen += BATCH
    if kind != "directory":  # what the metaserver's tick would run meanwhile: a key index resize drained (timed)
        t0 = time.process_time()
        while s.d.step(1 << 16):
            pass
        build_s += time.process_time() - t0
    gc.collect()
    per_page = (rss() - base) / pages
    trimmed = (rss() - base) / pages if malloc_trim() else None
    gc.freeze()
    gc.disable()
    out = {"kind": kind, "pages": pages, "rss_per_page": per_page, "rss_trimmed_per_page": trimmed,
           "build_keys_per_s": pages / build_s}
    starts = [rng.randrange(0, pages - BATCH) for _ in range(ops // BATCH)]
    batches = [fresh(keys[a:a + BATCH]) for a in starts]
    t0 = time.process_time()
    found = sum(s.lookup_release(b) for b in batches)
    out["lookup_keys_per_s"] = len(batches) * BATCH / (time.process_time() - t0)
    out["lookup_found"] = found
    t0 = time.process_time()
    found = sum(s.exists(b) for b in batches)
    out["exists_keys_per_s"] = len(batches) * BATCH / (time.process_time() - t0)
    frames = [msgpack.packb({"ns": "kv", "keys": keys[a:a + BATCH]}, use_bin_type=True)
              for a in [rng.randrange(0, pages - BATCH) for _ in range(ops // BATCH)]]
    t0 = time.process_time()
    answers = [s.wire_lookup(f) for f in frames]
    out["wire_lookup_keys_per_s"] = len(frames) * BATCH / (time.process_time() - t0)
    out["wire_lookup_found"] = sum(sum(loc is not None for loc in wire.unpack_locs(msgpack.unpackb(a), "bench")["locs"])
                                   for a in answers)
    t0 = time.process_time()
    for f in frames:  # the same prefixes again: the table's tags are in its column now
        s.wire_lookup(f)
    out["wire_lookup_again_keys_per_s"] = len(frames) * BATCH / (time.process_time() - t0)
    new = [fresh([rng.randbytes(32) for _ in range(BATCH)]) for _ in range(ops // BATCH)]
    placed, put_s = 0, 0.0
    for b in new:
        n, dt = s.put(b, gen)
        placed += n
        put_s += dt
        gen += BATCH
    out["put_at_n_keys_per_s"] = len(new) * BATCH / put_s
    out["put_at_n_placed"] = placed
    out["evictions"] = s.d.evictions
    return out


def run_load(kind: str, pages: int, seed: int) -> dict:
    """A full load of ``page_rows(pages, seed)`` into a ``Directory`` (kind "directory") or a ``PageTable``: the CPU
    seconds of the load (module docstring) and the pages it holds after. The records are made first, as a scan's
    parse would leave them: ``persist.PageRecords`` for the directory, each node's columns (lists, in scan order)
    for the table."""
    from metaserver.fullload import gc_paused

    names: dict[bytes, str] = {}  # one str per namespace, as the parse interns them
    recs = [(rev, node, names.setdefault(ns, ns.decode()), k, off, plen, rev, p, None)
            for ns, k, node, off, plen, rev, p in page_rows(pages, seed)]
    if kind == "directory":
        from metaserver.records import PageRecords

        parsed = PageRecords.of(recs)
        del recs
        gc.collect()
        with gc_paused():
            d, load_s = load_directory("lru", parsed, pages)
        return {"kind": kind, "load_s": load_s, "load_objects": d.objects}
    from metaserver.columns import PageTable
    from metaserver.tableload import load_pages, reserve

    groups: dict[str, tuple[list, ...]] = {}
    for rev, node, ns, k, off, plen, gen, _parent, _ekey in recs:
        g = groups.get(node)
        if g is None:
            g = groups[node] = ([], [], [], [], [], [])
        for col, v in zip(g, (ns, k, off, plen, gen, rev)):
            col.append(v)
    del recs
    gc.collect()
    with gc_paused():
        t0 = time.process_time()
        t = PageTable()
        cap = load_capacity(pages)
        for i in range(LOAD_NODES):
            t.add_node(f"host{i:02d}", cap)
            t.set_placeable(f"host{i:02d}", False)  # as fill: placeable once the node registers again
        reserve(t, pages, len(groups))
        for node_id in list(groups):
            ns, keys, offs, plens, gens, revs = groups.pop(node_id)
            offs, plens, gens = np.asarray(offs, np.int64), np.asarray(plens, np.int64), np.asarray(gens, np.uint64)
            revs = np.asarray(revs, np.int64)
            if not (revs[1:] >= revs[:-1]).all():  # commit order: one sort by revision, as fill's
                order = np.argsort(revs, kind="stable")
                ns, keys = list(map(ns.__getitem__, order.tolist())), list(map(keys.__getitem__, order.tolist()))
                offs, plens, gens = offs[order], plens[order], gens[order]
            rejected = load_pages(t, node_id, ns, keys, offs, plens, gens, stamps=revs)  # recency: commit order
            assert not rejected, (node_id, len(rejected))
        load_s = time.process_time() - t0
    return {"kind": kind, "load_s": load_s, "load_objects": t.objects}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--ops", type=int, default=200_000, help="keys looked up and keys put at size N")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, _, load = a.child.partition("-")
        print(json.dumps(run_load(kind, a.pages, a.seed) if load else run(kind, a.pages, a.ops, a.seed)))
        return
    res = {}
    for kind in ("directory", "columns", "directory-load", "columns-load"):
        r = subprocess.run([sys.executable, __file__, "--child", kind, "--pages", str(a.pages), "--ops", str(a.ops),
                            "--seed", str(a.seed)], capture_output=True, text=True, check=True)
        res[kind] = json.loads(r.stdout.strip().splitlines()[-1])
    d, c = res["directory"], res["columns"]
    print(f"{a.pages:,} pages on {NODES} nodes, {a.ops:,} keys per figure, 1,000-key requests; CPU seconds")
    print(f"{'figure':34s} {'Directory':>12s} {'table':>12s} {'ratio':>7s}  issue 17 target")
    rows = [("RSS bytes per page", "rss_per_page", "<= 200 B"),
            ("  the same after malloc_trim(0)", "rss_trimmed_per_page", ""),
            ("build alloc+commit keys/s", "build_keys_per_s", ""),
            ("alloc+commit at N keys/s", "put_at_n_keys_per_s", ">= 150k"),
            ("lookup+release keys/s", "lookup_keys_per_s", ">= 2 M"),
            ("exists keys/s", "exists_keys_per_s", ">= 3 M"),
            ("wire lookup keys/s (see docstring)", "wire_lookup_keys_per_s", ">= 500k"),
            ("  the same prefixes again", "wire_lookup_again_keys_per_s", ">= 500k")]
    for name, k, target in rows:
        print(f"{name:34s} {d[k]:12,.0f} {c[k]:12,.0f} {c[k] / d[k]:6.2f}x  {target}")
    dl, cl = res["directory-load"], res["columns-load"]
    print(f"{'full load CPU seconds (docstring)':34s} {dl['load_s']:12.3f} {cl['load_s']:12.3f} "
          f"{cl['load_s'] / dl['load_s']:6.2f}x  (lower is better)")
    print(f"{'full load pages/s':34s} {a.pages / dl['load_s']:12,.0f} {a.pages / cl['load_s']:12,.0f} "
          f"{dl['load_s'] / cl['load_s']:6.2f}x")
    d["load_objects"], c["load_objects"] = dl["load_objects"], cl["load_objects"]
    for k in ("lookup_found", "put_at_n_placed", "evictions", "wire_lookup_found", "load_objects"):
        print(f"{k:34s} {d[k]:12,} {c[k]:12,}")


if __name__ == "__main__":
    main()
