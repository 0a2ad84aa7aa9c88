"""Scale benchmark: what one metaserver's page directory costs at rack size (10 M pages by default).

The metaserver's page table (``metaserver.table.directory.TableDirectory``, its one directory core) is driven directly,
through its real methods, the way the request handlers drive it, minus the network: every request is a msgpack map packed and unpacked as on the wire, so keys, parents,
sizes and the namespace are fresh objects per request exactly as the metaserver receives them (nothing is shared
that a real request would not share). The workload (``bench/scaleworkload.py``) is a rack serving three models
from one pool:

- ``llama-3.1-70b/mha-tp8``: MHA heads sharded over 8 TP ranks, so every page has one key per rank
  (``{sha256 hex}_{rank}``, ``umbp.keys.rank_key``), 2.5 MiB per rank-page (64 tokens x 80 layers x K,V x 1 KV
  head x 128 x bf16), 50% of the pages;
- ``deepseek-v3/mla``: MLA latents replicated on every rank, one key per page (SGLang's ``get_hash_str``, sent as
  its raw 32-byte digest as ``umbp.keys.normalize_key`` does; ``--key-form hex``: the 64 hex characters), 64 tokens x 61 layers x 656 bytes (fp8 latent + rope + scales), 30%;
- ``qwen3-8b/mha-tp1``: 64 tokens x 36 layers x K,V x 8 KV heads x 128 x bf16 = 9 MiB, 20%.

Pages come in agentic chains as engines send them: each session's chain descends from its model's shared
system-prompt chain (32 pages) and runs 32..512 pages (2k..32k tokens), every page naming its parent; puts are
batches of 1,000 keys (a rank sends its own keys). The pool is 32 nodes (a 32-host rack) sized to hold exactly the
pages built, so the build evicts nothing and the steady-state puts afterwards evict one old page per new one.

Figures, per eviction policy (``lru``, ``prefix-lru``), each policy in its own fresh process:

- memory per page: VmRSS (``/proc/self/status``) after the build minus before it, both after ``gc.collect()``,
  divided by the pages; and, in a separate smaller run (``--trace-pages``), tracemalloc's traced bytes per page
  (what Python and numpy asked the allocator for; the key index's anonymous mmaps, ``metaserver/table/index.py``, are
  not seen, so it is below RSS by them);
- alloc+commit/s while building (growing table) and at size N (full pool: every new page evicts one);
- lookup+release keys/s (a get's metaserver work: the service's call, ``TableDirectory.lookup_granted(...,
  packed=True)``: locations, a read lease, tags and capabilities, packed rows; then its release) and exists keys/s
  at N, in 1,000-key batches taken as prompt prefixes of random chains (hits); the lookups twice, as a row's first
  look computes its tag and keeps it in the table (the wire path below reads them kept);
- load: the records of N pages as etcd returns them (commit records, one per 128 pages of a COMMIT, the
  metaserver's layout; ``--records page``: a record per page, the layout before) parsed by the metaserver's
  own ``persist.PageRecords.add`` (what ``EtcdStore.load`` runs on each response), then ``TableDirectory.load`` (what
  ``Metaserver._load`` runs: per node a sort by revision and ``tableload.load_pages``, parents linked under
  ``prefix-lru``), the collector paused as there (``fullload.gc_paused``), with the parse and the load timed apart
  (``bench/scaleload.py``);
- the same at N through the metaserver's per-request work minus I/O ("wire path", ``bench/servicepath.py``):
  msgpack in and out, the request's validation (``metaserver.validate``), the table's call, and what the service adds
  in a closed pool (a LOOKUP's tags from the table's column and one capability per node, its locations as packed
  rows: ``TableDirectory.lookup_granted(..., packed=True)``; an ALLOC's tag and capability per key,
  ``metaserver.table.grants``; a COMMIT's commit records encoded, ``TableRecord.value``): one metaserver process's
  CPU-bound ceiling, with the etcd round trips and sockets left out;
- optionally (``--etcd-pages``), the time for ``EtcdStore.load`` to read that many page records from a real etcd
  (started here from the ``etcd`` on PATH) and what N would take at that rate (an extrapolation, labelled so).

Nothing asserts. Rates are keys per CPU-second of this process (``time.process_time``): the work is CPU-bound,
single-threaded Python, and CPU time does not count what other processes on a shared machine take; the per-key cost
is printed next to each rate so it can be scaled to another CPU. ``--quick`` runs 200k pages.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import time
import tracemalloc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from metaserver.table.entry import NEW  # noqa: E402
from metaserver.table.directory import TableDirectory  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ itself, for the helpers below
import scaleworkload as workload  # noqa: E402
from scaleworkload import (BATCH, CHAIN_MAX, CHAIN_MIN, NODES, ROOT_PAGES, Model, chain_pages, models,  # noqa: E402
                           new_directory, page_hex, rank_keys, rank_keys_opt)
import scaleload  # noqa: E402
from bench.common import cpu, rss  # noqa: E402
from scaleload import run_etcd, run_load  # noqa: E402
from servicepath import ServicePath, Wire  # noqa: E402

POLICIES = ("lru", "prefix-lru")



class Driver:
    """Builds the table through alloc+commit and times the table's calls only."""

    def __init__(self, d: TableDirectory, ms: list[Model], seed: int):
        self.d = d
        self.ms = ms
        self.rng = random.Random(seed)
        self.gen = 1 << 20
        self.put_s = 0.0
        self.put_keys = 0
        self.new_keys = 0
        self.tick = None  # called after each put (timed with it): the GC policy's step when it is due

    def put_batch(self, ns: str, keys: list[bytes], size: int, parents: list) -> int:
        req = Wire.put(ns, keys, [size] * len(keys), parents)
        d = self.d
        t0 = cpu()
        now = time.monotonic()
        items, _fx = d.alloc(req["ns"], req["keys"], req["sizes"], req["parents"], self.gen, now)
        news = [(k, it[4]) for k, it in zip(req["keys"], items) if it[0] == NEW]
        d.commit(req["ns"], [k for k, _ in news], [g for _, g in news], now)
        if self.tick is not None:
            self.tick()
        self.put_s += cpu() - t0
        self.gen += len(keys)
        self.put_keys += len(keys)
        self.new_keys += len(news)
        return len(news)

    def put_chains(self, m: Model, chains: list[tuple[int, int, int]]) -> None:
        """Write pages [start, stop) of each chain, 1,000-key batches per rank, every page with its parent."""
        hexes: list[bytes] = []
        parents: list = []
        for c, start, stop in chains:
            h, p = chain_pages(m, c, start, stop)
            hexes += h
            parents += p
        for rk, rp in zip(rank_keys(m, hexes), rank_keys_opt(m, parents)):
            for i in range(0, len(rk), BATCH):
                m.pages += self.put_batch(m.ns, rk[i:i + BATCH], m.payload, rp[i:i + BATCH])

    def build(self, n_pages: int) -> None:
        for m in self.ms:
            self.put_chains(m, [(-1, 0, ROOT_PAGES)])
        total = sum(m.pages for m in self.ms)
        while total < n_pages:
            m = min(self.ms, key=lambda m: m.pages / m.share)
            per_page = m.ranks or 1
            chains, logical = [], 0
            left = (n_pages - total) // per_page + 1
            while logical < min(BATCH, left):
                n = self.rng.randint(CHAIN_MIN, CHAIN_MAX)
                c = len(m.lengths)
                m.lengths.append(n)
                chains.append((c, ROOT_PAGES, ROOT_PAGES + n))
                logical += n
            before = m.pages
            self.put_chains(m, chains)
            total += m.pages - before

    def prompt(self, m: Model) -> list[bytes]:
        """A 1,000-key lookup: a session's prompt prefix (system prompt and its own pages), for one rank."""
        c = self.rng.randrange(len(m.lengths))
        n = min(BATCH, ROOT_PAGES + m.lengths[c])
        keys = rank_keys(m, [page_hex(m, c, p) for p in range(n)])
        return keys[self.rng.randrange(len(keys))]


# ---- child: build, memory, rates ------------------------------------------------------------------------------

@contextlib.contextmanager
def collector(mode: str, drv: Driver):
    """The collector during the churn at N; yields the list its pauses are appended to (seconds). ``default``:
    CPython's own, its full (generation 2) collections timed through ``gc.callbacks``; ``policy``: the
    metaserver's (``metaserver/store/gcpolicy.py``, as ``metaserver/server.py`` installs it), its step run once a second
    of wall time as the server runs it, each step timed."""
    pauses: list[float] = []
    if mode == "default":
        started = []

        def cb(phase, info):
            if info["generation"] == 2:
                if phase == "start":
                    started.append(time.perf_counter())
                elif started:
                    pauses.append(time.perf_counter() - started.pop())

        gc.callbacks.append(cb)
        try:
            yield pauses
        finally:
            gc.callbacks.remove(cb)
        return
    from metaserver.store.gcpolicy import GcPolicy

    pol = GcPolicy().install()
    gc.freeze()  # as a load leaves it (fullload.gc_paused under the policy)
    due = [time.perf_counter() + pol.every_s]

    def tick():
        if time.perf_counter() >= due[0]:
            pauses.append(pol.step())
            due[0] = time.perf_counter() + pol.every_s

    drv.tick = tick
    try:
        yield pauses
    finally:
        drv.tick = None
        pol.uninstall()
        gc.unfreeze()


def run_build(policy: str, n_pages: int, ops: int, seed: int, trace: bool, gc_mode: str = "policy") -> dict:
    ms = models()
    d = new_directory(policy, ms, n_pages)
    gc.collect()
    if trace:
        tracemalloc.start()
    before = rss()
    traced0 = tracemalloc.get_traced_memory()[0] if trace else 0
    drv = Driver(d, ms, seed)
    t0 = time.perf_counter()
    drv.build(n_pages)
    build_wall = time.perf_counter() - t0
    # What the metaserver's tick would have done meanwhile: a key index resize under way drained.
    while d.step(1 << 16):
        pass
    gc.collect()
    pages = d.objects
    out = {"policy": policy, "pages": pages, "build_wall_s": round(build_wall, 1),
           "build_put_keys_s": drv.put_keys / drv.put_s}
    if trace:
        out["traced_per_page"] = (tracemalloc.get_traced_memory()[0] - traced0) / pages
        tracemalloc.stop()
        return out
    out["rss_per_page"] = (rss() - before) / pages
    out["rss_gib"] = rss() / 2**30

    # exists and lookup+release at N: prompt prefixes of random chains
    reqs = []
    for _ in range(max(1, ops // BATCH)):
        m = drv.rng.choices(ms, weights=[m.share for m in ms])[0]
        reqs.append(Wire.keys(m.ns, drv.prompt(m)))
    n_keys = sum(len(r["keys"]) for r in reqs)
    t = cpu()
    hits = 0
    for r in reqs:
        hits += sum(d.exists(r["ns"], r["keys"]))
    out["exists_keys_s"] = n_keys / (cpu() - t)
    svc = ServicePath(d)
    for figure in ("first_lookup_keys_s", "lookup_keys_s"):
        t = cpu()
        for r in reqs:
            ans = d.lookup_granted(r["ns"], r["keys"], time.monotonic(), None, svc.tokens, svc.members.get, None,
                                   True)
            d.release(ans["lease"])
        out[figure] = n_keys / (cpu() - t)
    out["lookup_hit_ratio"] = hits / n_keys

    # The pause CPython's own collector makes at N: one full collection walks every tracked object.
    t = time.perf_counter()
    gc.collect()
    out["gc_full_s"] = time.perf_counter() - t

    # alloc+commit at N: new sessions into the full pool (each new page evicts one), under the collector chosen
    drv.put_s, drv.put_keys, drv.new_keys = 0.0, 0, 0
    ev0 = d.evictions
    target = sum(m.pages for m in ms) + ops
    with collector(gc_mode, drv) as pauses:
        drv.build(target)
    out["gc_mode"] = gc_mode
    out["gc_pauses"] = len(pauses)
    out["gc_pause_max_s"] = max(pauses, default=0.0)
    out["put_keys_s"] = drv.put_keys / drv.put_s
    out["put_evictions"] = d.evictions - ev0
    out["pages_after"] = d.objects

    # the same through the service's per-request work (minus sockets and etcd)
    frames = [Wire.frame({"ns": r["ns"], "keys": list(r["keys"])}) for r in reqs]
    t = cpu()
    for f in frames:
        svc.lookup(f)
    out["wire_lookup_keys_s"] = n_keys / (cpu() - t)
    t = cpu()
    for f in frames:
        svc.exists(f)
    out["wire_exists_keys_s"] = n_keys / (cpu() - t)
    put_frames = []
    while sum(len(f[1]) for f in put_frames) < ops:
        m = min(ms, key=lambda m: m.pages / m.share)
        c = len(m.lengths)
        n = drv.rng.randint(CHAIN_MIN, CHAIN_MAX)
        m.lengths.append(n)
        hexes, parents = chain_pages(m, c, ROOT_PAGES, ROOT_PAGES + n)
        for rk, rp in zip(rank_keys(m, hexes), rank_keys_opt(m, parents)):
            for i in range(0, len(rk), BATCH):
                ks = rk[i:i + BATCH]
                put_frames.append((Wire.frame({"ns": m.ns, "keys": ks, "sizes": [m.payload] * len(ks),
                                               "parents": rp[i:i + BATCH]}), ks))
                m.pages += len(ks)
    t = cpu()
    for f, _ks in put_frames:
        svc.put(f)
    out["wire_put_keys_s"] = sum(len(ks) for _f, ks in put_frames) / (cpu() - t)
    return out


# ---- parent: run the children, print the table ------------------------------------------------------------------

def child(args: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child"] + args
    res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if res.returncode != 0:
        return {"error": f"exit {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f} M/s" if x >= 1e6 else f"{x / 1e3:.0f} k/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=10_000_000, help="directory size N (default 10 M)")
    ap.add_argument("--policy", choices=POLICIES + ("both",), default="both")
    ap.add_argument("--ops", type=int, default=200_000, help="keys looked up and keys put at size N")
    ap.add_argument("--trace-pages", type=int, default=1_000_000,
                    help="pages of the tracemalloc run (0: skip; it does not see the key index's mmaps)")
    ap.add_argument("--etcd-pages", type=int, default=0, help="also time EtcdStore.load of this many records")
    ap.add_argument("--no-load", action="store_true", help="skip the load (takeover) figures")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="200k pages, 100k ops")
    ap.add_argument("--key-form", choices=("raw", "hex"), default="raw",
                    help="digest keys as clients send them now (raw 32 bytes) or as before (64 hex characters)")
    ap.add_argument("--gc", choices=("policy", "default"), default="policy",
                    help="the collector during the churn at N: the metaserver's (metaserver/store/gcpolicy.py) or CPython's")
    ap.add_argument("--records", choices=("segment", "commit", "page"), default="segment",
                    help="the etcd layout the load reads: segments (the metaserver's), msgpack commit records or a "
                         "record per page (both before)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    workload.HEX_KEYS = a.key_form == "hex"
    scaleload.RECORDS = a.records
    if a.child:
        kind, policy, n = a.child[0], a.child[1], int(a.child[2])
        if kind == "build":
            res = run_build(policy, n, a.ops, a.seed, trace=False, gc_mode=a.gc)
        elif kind == "trace":
            res = run_build(policy, n, a.ops, a.seed, trace=True)
        elif kind == "load":
            res = run_load(policy, n, a.seed)
        else:
            res = run_etcd(n, a.seed)
        print(json.dumps(res))
        return
    if a.quick:
        a.pages, a.ops, a.trace_pages = 200_000, 100_000, min(a.trace_pages, 200_000)
    pols = POLICIES if a.policy == "both" else (a.policy,)
    n = a.pages
    print(f"scale: {n:,} pages, {NODES} nodes, batches of {BATCH} keys; python {sys.version.split()[0]}")
    print("target (issue 44): <= 100 bytes of metaserver memory per page at 10 M pages")
    common = ["--ops", str(a.ops), "--seed", str(a.seed), "--key-form", a.key_form, "--gc", a.gc,
              "--records", a.records]
    print(f"keys: {'64-hex text' if workload.HEX_KEYS else 'raw 32-byte digests (plus a rank byte)'}")
    for pol in pols:
        b = child(["build", pol, str(n)] + common)
        if "error" in b:
            print(f"{pol:>10}: build failed ({b['error']})")
            continue
        tr = child(["trace", pol, str(min(a.trace_pages, n))] + common) if a.trace_pages else {}
        print(f"{pol:>10}: RSS {b['rss_per_page']:.0f} B/page ({b['rss_gib']:.2f} GiB in all at "
              f"{b['pages']:,} pages)"
              + (f", tracemalloc {tr['traced_per_page']:.0f} B/page at {tr['pages']:,}" if "traced_per_page" in tr
                 else "")
              + f"  [target 100 B/page: {'met' if b['rss_per_page'] <= 100 else 'not met'}]")
        print(f"{'':>10}  lookup+release {fmt_rate(b['lookup_keys_s'])} keys ({1e6 / b['lookup_keys_s']:.2f} us/key; "
              f"first look, tags made: {fmt_rate(b['first_lookup_keys_s'])}), "
              f"exists {fmt_rate(b['exists_keys_s'])} keys, hit ratio {b['lookup_hit_ratio']:.2f}")
        print(f"{'':>10}  alloc+commit {fmt_rate(b['put_keys_s'])} keys at N ({1e6 / b['put_keys_s']:.2f} us/key, "
              f"{b['put_evictions']:,} evictions for {a.ops:,} new keys); "
              f"{fmt_rate(b['build_put_keys_s'])} while building ({b['build_wall_s']:.0f} s wall incl. key "
              f"generation and msgpack)")
        print(f"{'':>10}  gc: a full collection at N {b['gc_full_s'] * 1e3:.0f} ms (CPython's collector makes one "
              f"every ~N/4 new objects); during the churn at N ({b['gc_mode']}): {b['gc_pauses']} "
              f"{'full collections' if b['gc_mode'] == 'default' else 'steps'}, longest "
              f"{b['gc_pause_max_s'] * 1e3:.0f} ms")
        print(f"{'':>10}  wire path at N (decode, validate, table, tags and capabilities, etcd records, encode; "
              f"no sockets, no etcd): lookup+release {fmt_rate(b['wire_lookup_keys_s'])} keys "
              f"({1e6 / b['wire_lookup_keys_s']:.2f} us/key), exists {fmt_rate(b['wire_exists_keys_s'])} keys, "
              f"alloc+commit {fmt_rate(b['wire_put_keys_s'])} keys "
              f"({1e6 / b['wire_put_keys_s']:.2f} us/key)"
              + ("  [NOT COMPARABLE with --key-form hex: the metaserver converts hex keys to the raw form, so they "
                 "miss a table built with hex keys]" if workload.HEX_KEYS else ""))
        if not a.no_load:
            ld = child(["load", pol, str(n)] + common)
            if "error" in ld:
                print(f"{'':>10}  load failed ({ld['error']})")
            else:
                print(f"{'':>10}  load {ld['pages']:,} pages ({a.records} records): parse {ld['parse_s']:.1f} s + "
                      f"load {ld['load_s']:.1f} s = {ld['parse_s'] + ld['load_s']:.1f} s "
                      f"({(ld['parse_s'] + ld['load_s']) / ld['pages'] * 1e6:.2f} us/page; "
                      f"peak RSS {ld['peak_rss_gib']:.1f} GiB)")
    if a.etcd_pages:
        e = child(["etcd", "-", str(a.etcd_pages)] + common)
        if "etcd_error" in e or "error" in e:
            print(f"etcd: {e.get('etcd_error') or e.get('error')}")
        else:
            rate = e["etcd_pages"] / e["etcd_load_s"]
            print(f"etcd: EtcdStore.load read {e['etcd_pages']:,} page records in {e['etcd_load_s']:.1f} s "
                  f"({fmt_rate(rate)}; {e['etcd_load_cpu_s']:.1f} CPU-s in this process, the rest is etcd's; "
                  f"written in {e['etcd_write_s']:.0f} s in 128-op transactions); "
                  f"EXTRAPOLATED to {n:,}: {n / rate:.0f} s")


if __name__ == "__main__":
    main()
