"""Offload from a paged KV buffer to the pool with the device-to-host copy of one chunk overlapping the put of the
previous one: ``PipelinedStore``.

``LayerwiseLoader.store`` moves a batch in two steps that each wait for the other: the gather kernel packs the slots
into pinned host memory (the device's copy engine and PCIe), then ``batch_put_ranges`` writes that memory into the
nodes' arenas (host memcpy threads, ALLOC and COMMIT). Here the batch is cut into chunks of ``chunk_pages`` pages and
handed alternately to two storers (each a ``LayerwiseLoader`` with its own pinned staging and copy stream), each
on its own single worker thread: while one storer's put holds the client, the other's device-to-host copy of the
next chunk runs. The client serialises the puts themselves, so the pages reach the pool in chunk order.

Where the client writes device pages straight into same-host arenas (``Client.direct_device_puts``: the gather
kernel, no pinned staging; ``umbp.puts``) there is no device-to-host copy to overlap: the batch is one ``store``,
whose put pipelines its own ALLOCs and COMMITs around the kernel writes.

Contracts: ``store`` is ``LayerwiseLoader.store``'s (True: stored now, False: it already existed; parents per page),
blocks until every chunk is stored, and raises the first chunk's error after every chunk has finished (no chunk is
left writing from a staging buffer). A batch of one chunk is one plain ``store``; on the CPU the chunks run the
same way (nothing is staged there, the pipelining is for the device).
Cost: one EXISTS, one ALLOC and one COMMIT per chunk (instead of per batch) and two pinned staging buffers of
``chunk_pages`` pages each.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Sequence

from umbp.engine.loader import LayerwiseLoader
from umbp.errors import InvalidArgument

COMPONENT = "offload"
CHUNK_PAGES = 64  # 256 MiB of 4 MiB pages: big enough for the copy threads, small enough to overlap


class PipelinedStore:
    def __init__(self, client: Any, kv: Any, group_size: int = 1, *, method: str = "auto",
                 chunk_pages: int = CHUNK_PAGES):
        if not isinstance(chunk_pages, int) or chunk_pages < 1:
            raise InvalidArgument(COMPONENT, f"chunk_pages must be a positive integer, got {chunk_pages!r}")
        self.chunk_pages = chunk_pages
        self.storers = [LayerwiseLoader(client, kv, group_size, use_mapped=False, method=method) for _ in range(2)]
        self.kv = self.storers[0].kv
        self._workers = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"umbp-offload-{i}") for i in range(2)]

    @property
    def counters(self) -> dict:
        """Both storers' counters, summed."""
        out: dict = {}
        for s in self.storers:
            for k, v in s.counters.items():
                out[k] = out.get(k, 0) + v
        return out

    def store(self, keys: Sequence[Any], slots: Sequence[int], parents: Sequence[Any] | None = None, *,
              skip_existing: bool = False) -> list[bool]:
        keys = list(keys)
        slots = list(slots)
        if len(keys) != len(slots) or (parents is not None and len(parents) != len(keys)):
            raise InvalidArgument(COMPONENT, f"{len(keys)} keys, {len(slots)} slots and "
                                             f"{'no' if parents is None else len(parents)} parents")
        n, step = len(keys), self.chunk_pages
        if n <= step or self._direct():
            return self.storers[0].store(keys, slots, parents, skip_existing=skip_existing)
        futures = []
        for c, lo in enumerate(range(0, n, step)):
            hi = min(n, lo + step)
            futures.append(self._workers[c % 2].submit(
                self.storers[c % 2].store, keys[lo:hi], slots[lo:hi],
                None if parents is None else list(parents[lo:hi]), skip_existing=skip_existing))
        cf.wait(futures)  # every chunk finished (each worker runs its chunks in order) before anything is raised
        out: list[bool] = []
        for f in futures:
            out += f.result()
        return out

    def _direct(self) -> bool:
        """The kernel writes device pages straight into arenas here: one put pipelines its own chunks (ALLOCs ahead,
        COMMITs behind the writes) and there is no host copy to overlap, so the batch is not cut."""
        client = self.storers[0].client
        return self.kv.is_cuda and hasattr(client, "direct_device_puts") and client.direct_device_puts()

    def close(self) -> None:
        for w in self._workers:
            w.shutdown(wait=True)
        for s in self.storers:
            s.close()

    def __enter__(self) -> "PipelinedStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
