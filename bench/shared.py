"""What a TP8 MHA page costs the metaserver with per-rank keys (before) and as one shared entry (after,
``metaserver/table/shared.py``): table rows, etcd records, keys sent (ALLOC, COMMIT, LOOKUP), EXISTS keys that tell
whether a page is complete, memory and CPU per logical page; MLA (one replicated key, every rank deduplicated) as the
reference.

The metaserver's page table (``metaserver.table.directory.TableDirectory``, its one directory core) is driven through its
real methods the way the service drives it, minus the network and etcd: each of the 8 ranks sends its own batches
(ALLOC, COMMIT, then LOOKUP+release), and for a closed pool the per-key tags and per-node capabilities are computed
as the service does (``metaserver.table.grants`` for ALLOC; a LOOKUP is the service's columnar call,
``TableDirectory.lookup_granted(..., packed=True)``, its packed rows decoded as a client decodes them). Records per
page are the pages of the commit records the commits return (what the etcd writer would put). Memory is VmRSS after
the build minus before, per logical page; with ``--traced`` also tracemalloc's traced bytes, from a second build in
its own process (tracing every allocation slows the build 3-5x, so the timed build never runs under it): the key
index lives in anonymous mmaps, which tracemalloc does not see, so read the ``rss`` column. Rates are logical pages
per CPU-second of this process (``time.process_time``). Each layout runs in a fresh process.

    python bench/shared.py [--pages 200000] [--ranks 8] [--traced]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metaserver.table.entry import NEW  # noqa: E402
from metaserver.table.grants import grant_alloc  # noqa: E402
from metaserver.table.directory import TableDirectory  # noqa: E402
from transport import answerrows
from transport.objformat import object_size  # noqa: E402
from umbp.auth import Tokens  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself
from scale import rss  # noqa: E402

BATCH = 1000
PART = (2560 << 10) - 64  # a Llama-70B TP8 rank-page: 64 tokens x 80 layers x K,V x 1 head x 128 x bf16 (header in)
NODES = 32


class _Member:
    cap_key = b"k" * 32
    cap_epoch = 1


def fresh(hexes: list[bytes], rank: int | None) -> list[bytes]:
    """A request's keys as the wire delivers them: new bytes objects (per-rank keys: the digest and the rank byte)."""
    if rank is None:
        return [bytes(bytearray(h)) for h in hexes]
    rb = bytes([rank])
    return [h + rb for h in hexes]


def run(layout: str, pages: int, ranks: int, traced: bool = False) -> dict:
    """Build ``pages`` logical pages in ``layout`` (per-rank | shared | mla), then LOOKUP each page from every rank.
    ``traced``: the build runs under tracemalloc (its bytes are the figure; its rates are not)."""
    tokens = Tokens(b"cluster-secret-0123456789", {})
    member = _Member()
    node = {f"n{i}": member for i in range(NODES)}.get
    per_node = -(-pages * ranks * object_size(PART) // NODES) + (64 << 20)
    d = TableDirectory()
    for i in range(NODES):
        d.add_space(f"n{i}", per_node)
    hexes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(pages)]
    counts = {"alloc_keys": 0, "commit_keys": 0, "lookup_keys": 0, "records": 0}
    gen = 1
    gc.collect()
    rss0 = rss()
    if traced:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.process_time()
    for s in range(0, pages, BATCH):  # the ranks put the same batch at about the same time, as TP ranks do
        for rk in range(ranks):
            shard = (rk, ranks) if layout == "shared" else None
            keys = fresh(hexes[s:s + BATCH], rk if layout == "per-rank" else None)
            placed = d.alloc_placed("kv", keys, [PART] * len(keys), None, gen, 0.0, 1 + rk, None, shard)
            gen += len(keys)
            out = grant_alloc(tokens, node, "kv", keys, placed, 1 << 50, packed=False)["items"]  # the service's call
            new = placed.new.tolist()
            counts["alloc_keys"] += len(keys)
            if not new:
                continue  # MLA: every rank after the first is deduplicated (EXISTS), nothing to commit
            ok, fx = d.commit("kv", [keys[i] for i in new], [out[i][4] for i in new], 0.0, shard)
            assert all(ok) and all(out[i][0] == NEW for i in new)
            counts["commit_keys"] += len(new)
            counts["records"] += sum(len(r.rows) for r in fx.recs)  # pages persisted
    build_s = time.process_time() - t0
    gc.collect()
    mem = tracemalloc.get_traced_memory()[0] - base if traced else None
    tracemalloc.stop()
    gc.collect()
    rss_mem = rss() - rss0
    t0 = time.process_time()
    for s in range(0, pages, BATCH):
        for rk in range(ranks):
            shard = (rk, ranks) if layout == "shared" else None
            keys = fresh(hexes[s:s + BATCH], rk if layout == "per-rank" else None)
            ans = answerrows.unpack_locs(d.lookup_granted("kv", keys, 1.0, None, tokens, node, shard, True), "bench")
            lease, locs = ans["lease"], ans["locs"]
            assert all(loc is not None for loc in locs)
            d.release(lease)
            counts["lookup_keys"] += len(keys)
    lookup_s = time.process_time() - t0
    d.check()
    return {"layout": layout, "pages": pages, "entries_per_page": d.objects / pages,
            "records_per_page": counts["records"] / pages,
            "alloc_keys_per_page": counts["alloc_keys"] / pages, "commit_keys_per_page": counts["commit_keys"] / pages,
            "lookup_keys_per_page": counts["lookup_keys"] / pages,
            "exists_keys_per_complete_page": ranks if layout == "per-rank" else 1,
            "policy_members_per_page": d.objects / pages,  # every unpinned READY row is an LRU candidate
            "bytes_per_page": None if mem is None else mem / pages, "rss_per_page": rss_mem / pages, "put_pages_per_cpu_s": pages / build_s,
            "lookup_pages_per_cpu_s": pages / lookup_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=200_000, help="logical pages (default 200k)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--traced", action="store_true",
                    help="also tracemalloc's bytes a page (a second, untimed build per layout)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(run(a.child, a.pages, a.ranks, a.traced)))
        return

    def child(layout: str, traced: bool) -> dict:
        r = subprocess.run([sys.executable, __file__, "--child", layout, "--pages", str(a.pages), "--ranks",
                            str(a.ranks)] + ["--traced"] * traced,
                           capture_output=True, text=True, check=True)
        return json.loads(r.stdout.strip().splitlines()[-1])

    rows = []
    for layout in ("per-rank", "shared", "mla"):
        row = child(layout, False)
        if a.traced:
            row["bytes_per_page"] = child(layout, True)["bytes_per_page"]
        rows.append(row)
    cols = [("entries_per_page", "table rows", "{:.0f}"), ("records_per_page", "etcd records", "{:.0f}"),
            ("policy_members_per_page", "evictable", "{:.0f}"), ("alloc_keys_per_page", "ALLOC keys", "{:.0f}"),
            ("commit_keys_per_page", "COMMIT keys", "{:.0f}"), ("lookup_keys_per_page", "LOOKUP keys", "{:.0f}"),
            ("exists_keys_per_complete_page", "EXISTS keys", "{:.0f}"), ("bytes_per_page", "bytes", "{:.0f}"),
            ("rss_per_page", "rss", "{:.0f}"),
            ("put_pages_per_cpu_s", "puts pg/cpu-s", "{:,.0f}"), ("lookup_pages_per_cpu_s", "gets pg/cpu-s",
                                                                  "{:,.0f}")]
    print(f"TP{a.ranks} page, {a.pages:,} logical pages, TableDirectory, per logical page (closed pool: tags and "
          "capabilities in):")
    print(f"{'layout':10}" + "".join(f"{h:>15}" for _, h, _ in cols))
    for r in rows:
        print(f"{r['layout']:10}" + "".join(f"{'-' if r[k] is None else f.format(r[k]):>15}" for k, _, f in cols))


if __name__ == "__main__":
    main()
