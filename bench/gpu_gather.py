"""GPU gather benchmark: scattered pages in pinned host memory <-> scattered slots of a device KV buffer.

Default: 4,096 pages of 64 KiB (256 MiB) scattered over a pinned host buffer twice that size, gathered into random
slots of a device buffer of 8,192 slots, by the zero-copy kernel (``umbp.engine.gather``, a CuPy RawKernel reading
host memory over PCIe). Printed next to the contiguous pinned copy of the same bytes in the same run (the ceiling)
and their ratio; then the offload direction (device slots -> scattered pinned host pages) next to the contiguous
device->host copy; then the same pages split into layer rows (the layer-wise case), a /dev/shm file mapped like a
node arena and registered with cudaHostRegister, and the staged/torch fallbacks for reference. Every variant's bytes
are checked. Times are CUDA-event times, median of ``--iters`` runs after a warm-up.

    python3 bench/gpu_gather.py [--pages 4096] [--page-kib 64] [--iters 20] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from umbp.node.arena import arena_dir_with_room  # noqa: E402


def rows_at(arr: np.ndarray, offs: np.ndarray, n: int) -> np.ndarray:
    """``arr[o:o+n]`` for each offset, stacked (no int64 index array of pages x bytes)."""
    return np.stack([arr[o:o + n] for o in offs.tolist()])


def timed(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs (CUDA events), after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=32, help="layer rows per page for the layer-wise variant")
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args()

    import torch

    from umbp.engine import gather
    from umbp.engine.gather import HostPages
    from umbp.engine.layout import PagedKV

    if not torch.cuda.is_available():
        print("gpu_gather: no CUDA on this machine; run it on the GPU machine", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    n, pb = args.pages, args.page_kib * 1024
    total = n * pb
    gb = total / 1e9
    rng = np.random.default_rng(0)
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"cupy {'yes' if gather.cupy_available() else 'MISSING'}")
    print(f"{n} pages x {pb // 1024} KiB = {total / 2**20:.0f} MiB per move")

    host = torch.from_numpy(rng.integers(0, 256, 2 * total, dtype=np.uint8)).pin_memory()
    host_np = host.numpy()
    src_off = rng.choice(2 * n, n, replace=False).astype(np.int64) * pb
    kv_t = torch.zeros(2 * n, pb, dtype=torch.uint8, device=dev)
    kv = PagedKV([kv_t])
    slots = rng.choice(2 * n, n, replace=False).astype(np.int64)
    slots_t = torch.as_tensor(slots, device=dev)
    results: dict = {"pages": n, "page_bytes": pb, "device": torch.cuda.get_device_name(0)}

    def check_kv(kvt: torch.Tensor, offs: np.ndarray, what: str) -> None:
        got = kvt.index_select(0, slots_t).cpu().numpy()
        want = rows_at(host_np, offs, pb)
        if not np.array_equal(got, want):
            raise SystemExit(f"gpu_gather: {what}: bytes differ")

    # 1. contiguous pinned copy of the same bytes: the ceiling
    contig_h = torch.empty(total, dtype=torch.uint8).pin_memory()
    contig_d = torch.empty(total, dtype=torch.uint8, device=dev)
    t_h2d = timed(lambda: contig_d.copy_(contig_h, non_blocking=True), args.iters)
    t_d2h = timed(lambda: contig_h.copy_(contig_d, non_blocking=True), args.iters)

    # 2. the gather kernel, host -> device (plan once, as an engine reuses a load's plan; and end to end)
    hp = HostPages.from_locs([host], [(0, int(o)) for o in src_off])
    plan = gather.plan(kv, slots, hp)
    t_kernel = timed(lambda: gather.run_kernel(plan, dev), args.iters)
    check_kv(kv_t, src_off, "kernel gather")
    t_kernel_e2e = timed(lambda: gather.to_kv(kv, slots, hp, method="kernel"), args.iters)
    results.update(contiguous_h2d_gbs=gb / t_h2d, gather_h2d_gbs=gb / t_kernel, gather_h2d_e2e_gbs=gb / t_kernel_e2e,
                   contiguous_d2h_gbs=gb / t_d2h)
    print(f"\nload  (host -> device) contiguous pinned copy : {gb / t_h2d:6.1f} GB/s")
    print(f"load  gather kernel, scattered -> scattered    : {gb / t_kernel:6.1f} GB/s  "
          f"ratio {t_h2d / t_kernel:.3f}  (with planning + table upload: {gb / t_kernel_e2e:.1f} GB/s)")

    # 3. offload: device slots -> scattered pinned host pages
    out = torch.zeros(2 * total, dtype=torch.uint8).pin_memory()
    dst_off = rng.choice(2 * n, n, replace=False).astype(np.int64) * pb
    op = HostPages.from_locs([out], [(0, int(o)) for o in dst_off], writable=True)
    oplan = gather.plan(kv, slots, op, to_kv=False)
    t_off = timed(lambda: gather.run_kernel(oplan, dev), args.iters)
    torch.cuda.synchronize()
    on = out.numpy()
    if not np.array_equal(rows_at(on, dst_off, pb), rows_at(host_np, src_off, pb)):
        raise SystemExit("gpu_gather: offload: bytes differ")
    results.update(gather_d2h_gbs=gb / t_off)
    print(f"\noffload (device -> host) contiguous pinned copy: {gb / t_d2h:6.1f} GB/s")
    print(f"offload scatter kernel, scattered -> scattered : {gb / t_off:6.1f} GB/s  ratio {t_d2h / t_off:.3f}")

    # 4. the layer-wise shape: each page split into layer rows of separate per-layer tensors
    L = args.layers
    if pb % L == 0:
        row = pb // L
        layer_t = torch.zeros(L, 2 * n, row, dtype=torch.uint8, device=dev)
        lkv = PagedKV(layer_t)
        lplan = gather.plan(lkv, slots, hp)
        t_layers = timed(lambda: gather.run_kernel(lplan, dev), args.iters)
        got = layer_t[:, slots_t].permute(1, 0, 2).reshape(n, pb).cpu().numpy()
        if not np.array_equal(got, rows_at(host_np, src_off, pb)):
            raise SystemExit("gpu_gather: layer rows: bytes differ")
        grp = max(1, L // 8)
        gplan = gather.plan(lkv, slots, HostPages.from_locs([host], [(0, int(o)) for o in src_off]), range(0, grp))
        t_group = timed(lambda: gather.run_kernel(gplan, dev), args.iters)
        results.update(layer_rows=L, layer_row_bytes=row, gather_layers_gbs=gb / t_layers,
                       group_layers=grp, gather_group_gbs=(n * grp * row / 1e9) / t_group)
        print(f"\nlayer rows: {L} x {row} B per page into {L} layer tensors: {gb / t_layers:6.1f} GB/s "
              f"({len(lplan)} segments)")
        print(f"one group of {grp} layers ({grp * row} B per page)         : "
              f"{n * grp * row / 1e9 / t_group:6.1f} GB/s")

    # 5. a /dev/shm file mapped like a node arena, registered with cudaHostRegister
    size = 2 * total + 4096
    d = arena_dir_with_room(size)
    fd, path = tempfile.mkstemp(dir=d, prefix="umbp-bench-arena-")
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        arena = memoryview(m)
        np.frombuffer(arena, np.uint8)[4096:] = host_np
        try:
            buf = gather.register_host(arena)
        except gather.GatherUnavailable as e:
            print(f"\narena: cudaHostRegister refused ({e}); the loader would fall back to staging")
            results["arena_registered"] = False
            buf = None
        if buf is not None:
            ap_ = HostPages.from_locs([arena], [(0, int(o) + 4096) for o in src_off])
            aplan = gather.plan(kv, slots, ap_)
            kv_t.zero_()
            t_arena = timed(lambda: gather.run_kernel(aplan, dev), args.iters)
            check_kv(kv_t, src_off, "arena gather")
            results.update(arena_registered=True, gather_arena_gbs=gb / t_arena)
            where = d or tempfile.gettempdir()
            print(f"\narena ({where} mapping, cudaHostRegister-ed) -> device: {gb / t_arena:6.1f} GB/s  "
                  f"ratio {t_h2d / t_arena:.3f}")
            gather.unregister_host(buf)
            del buf, ap_
        arena.release()
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)

    # 6. fallbacks, for reference (one pass each: they are slow)
    kv_t.zero_()
    t_staged = timed(lambda: gather.to_kv(kv, slots, hp, method="staged"), 2)
    check_kv(kv_t, src_off, "staged")
    real = gather.cupy_available
    gather.cupy_available = lambda: False
    try:
        kv_t.zero_()
        t_torch = timed(lambda: gather.to_kv(kv, slots, hp, method="staged"), 2)
        check_kv(kv_t, src_off, "torch staged")
    finally:
        gather.cupy_available = real
    per_page = timed(lambda: [kv_t[int(s)].copy_(host[int(o):int(o) + pb], non_blocking=True)
                              for s, o in zip(slots[:512], src_off[:512])], 2)
    results.update(staged_gbs=gb / t_staged, torch_staged_gbs=gb / t_torch,
                   copy_per_page_gbs=(512 * pb / 1e9) / per_page)
    print(f"\nstaged (memmove to pinned staging + kernel)    : {gb / t_staged:6.1f} GB/s")
    print(f"torch only (memmove + copy_ + index_copy_)     : {gb / t_torch:6.1f} GB/s")
    print(f"one copy_ per page (512 pages)                 : {512 * pb / 1e9 / per_page:6.1f} GB/s")
    print("\nbytes checked: kernel gather, offload, layer rows, arena, staged, torch staged")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
