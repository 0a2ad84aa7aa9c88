"""Worker side of the vLLM connector: layer-wise loads into vLLM's paged KV cache, saves out of it, delayed frees.

One ``WorkerSide`` per vLLM worker (one TP rank). ``register`` wraps vLLM's per-layer KV tensors as the engine
loader's ``PagedKV`` (``blocks.paged_layers``: aliasing views, no copy) and opens two clients, one per direction, so
a save in flight never waits on a load (each ``LayerwiseLoader`` runs one operation at a time).

- Loads (``start_load``): every load of the step is one ``LayerwiseLoader.load`` of rank-keyed pages into their
  blocks. ``wait_layer(name)`` consumes ready layer groups up to that layer's (CPU: memmove by the loader's thread;
  CUDA: the gather kernel on the loader's stream, made visible to the model's stream by ``ReadyGroup.wait``). The
  load is settled at the latest by ``load_errors`` (vLLM asks after every forward): blocks after the leading run
  that arrived are reported there, and vLLM recomputes them.
- Saves (``save``, from ``wait_for_save`` after the forward wrote every layer): a page object holds all layers, so
  a block is saved once per step it became full, by one background thread (``LayerwiseLoader.store`` with
  ``skip_existing``: pages already in the pool move no bytes). MLA KV (replicated on TP ranks) is saved by rank 0
  only and keyed without rank; MHA KV by every rank under its rank key.
- Delayed frees: the scheduler keeps a request's blocks after it finishes when any save was planned for it; this
  side reports it in ``finished_sending`` once that request's saves are done (failed saves too: the pool is a cache,
  a lost save is a later miss). ``handle_preemptions`` waits for every save in flight before vLLM reuses blocks.

Contracts: ``wait_layer`` and ``load_errors`` block until the bytes they promise are in place, bounded by the
client deadline per layer group; ``close`` waits for saves in flight (bounded likewise) and closes the clients.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from umbp import keys as umbp_keys
from umbp.engine.layout import PagedKV
from umbp.engine.loader import LayerLoad, LayerwiseLoader
from umbp.errors import UmbpError
from umbp.integrations.vllm.blocks import paged_layers
from umbp.integrations.vllm.plan import StepPlan

log = logging.getLogger("umbp.vllm")


@dataclass(frozen=True)
class PoolSettings:
    """How the connector reaches the pool (``kv_connector_extra_config``: metaserver, token, transport,
    layer_group_size)."""

    metaserver: str
    namespace: str
    token: str | None = None
    transport: str | None = None
    layer_group_size: int = 1

    def client(self):
        from umbp.client import Client

        return Client(metaserver=self.metaserver, namespace=self.namespace, token=self.token,
                      transport=self.transport)


class WorkerSide:
    def __init__(self, pool: PoolSettings, num_blocks: int, tp_rank: int, replicated: bool,
                 layer_order: Sequence[str] = ()):
        self.pool = pool
        self.num_blocks = num_blocks
        self.tp_rank = tp_rank
        self.replicated = replicated
        self.layer_order = list(layer_order)
        self.kv: PagedKV | None = None
        self.layer_index: dict[str, int] = {}
        self._clients: list[Any] = []
        self._loader: LayerwiseLoader | None = None
        self._saver: LayerwiseLoader | None = None
        self._exec: cf.ThreadPoolExecutor | None = None
        self._load: LayerLoad | None = None
        self._load_slots: list[int] = []
        self._groups_done = -1
        self._errors: set[int] = set()
        self._saves: dict[str, list[cf.Future]] = {}
        self._finishing: set[str] = set()
        self.counters = {"blocks_loaded": 0, "blocks_failed": 0, "blocks_saved": 0, "blocks_existing": 0,
                         "save_errors": 0}

    # ---- setup

    def register(self, kv_caches: dict[str, Any]) -> None:
        names, parts = paged_layers(kv_caches, self.num_blocks, self.layer_order)
        self.kv = PagedKV(parts)
        ident = {}
        for i, n in enumerate(names):
            t = kv_caches[n]
            ident[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))] = i
        for n, t in kv_caches.items():  # layers sharing another's KV wait on that layer's group
            self.layer_index[n] = ident[(t.data_ptr(), tuple(t.shape), tuple(t.stride()))]
        load_client, save_client = self.pool.client(), self.pool.client()
        self._clients = [load_client, save_client]
        self._loader = LayerwiseLoader(load_client, self.kv, self.pool.layer_group_size)
        self._saver = LayerwiseLoader(save_client, self.kv, self.pool.layer_group_size)
        self._loader.prepare()
        self._exec = cf.ThreadPoolExecutor(1, thread_name_prefix="umbp-vllm-save")

    def _rank_keys(self, keys: Sequence[str]) -> list[str]:
        return [umbp_keys.rank_key(k, None if self.replicated else self.tp_rank) for k in keys]

    # ---- loads

    def start_load(self, plan: StepPlan) -> None:
        self._settle_load()
        for ld in plan.loads:  # blocks vLLM counts as computed that no page fills: recomputed, never read unfilled
            self._errors.update(ld.block_ids[len(ld.keys):])
        keys = [k for ld in plan.loads for k in self._rank_keys(ld.keys)]
        slots = [b for ld in plan.loads for b in ld.block_ids[:len(ld.keys)]]
        if not keys or self._loader is None:
            return
        self._load_slots = slots
        self._groups_done = -1
        self._load = self._loader.load(keys, slots)

    def wait_layer(self, layer_name: str) -> None:
        if self._load is None:
            return
        i = self.layer_index.get(layer_name)
        if i is None:
            return
        group = i // self.pool.layer_group_size
        try:
            while self._groups_done < group:
                ready = next(self._load)
                ready.wait()
                self._groups_done = ready.index
        except StopIteration:
            self._settle_load()
        except UmbpError as e:
            log.warning("umbp vllm: load failed, its blocks will be recomputed: %s", e)
            self._settle_load(failed=True)

    def _settle_load(self, failed: bool = False) -> None:
        """Finish the running load (every group in place, or stopped) and record the blocks that did not arrive."""
        ld, self._load = self._load, None
        if ld is None:
            return
        pages = 0
        if not failed:
            try:
                pages = ld.wait_all()
            except UmbpError as e:
                log.warning("umbp vllm: load failed, its blocks will be recomputed: %s", e)
        ld.close()
        if failed:
            pages = 0
        bad = self._load_slots[pages:]
        self._errors.update(bad)
        self.counters["blocks_loaded"] += pages
        self.counters["blocks_failed"] += len(bad)
        self._load_slots = []

    def load_errors(self) -> set[int]:
        self._settle_load()
        out, self._errors = self._errors, set()
        return out

    # ---- saves

    def save(self, plan: StepPlan) -> None:
        for sv in plan.saves:
            futs = self._saves.setdefault(sv.req_id, [])
            if self.replicated and self.tp_rank != 0:
                continue  # one copy across TP ranks: rank 0 writes it
            keys = self._rank_keys(sv.keys)
            parents = umbp_keys.parents_of(keys, self._rank_keys([sv.parent])[0] if sv.parent else None)
            futs.append(self._exec.submit(self._store, keys, list(sv.block_ids), parents))

    def _store(self, keys: list[str], slots: list[int], parents: list) -> None:
        try:
            res = self._saver.store(keys, slots, parents, skip_existing=True)
            stored = sum(1 for r in res if r)
            self.counters["blocks_saved"] += stored
            self.counters["blocks_existing"] += len(res) - stored
        except UmbpError as e:
            self.counters["save_errors"] += 1
            log.warning("umbp vllm: save of %d blocks failed (a later miss, nothing else): %s", len(keys), e)

    def drain_saves(self) -> None:
        """Wait for every save in flight (vLLM is about to reuse blocks)."""
        for futs in list(self._saves.values()):
            cf.wait(futs)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose delayed free may happen now: finished, with every save of theirs done."""
        self._finishing.update(r for r in finished_req_ids if r in self._saves)
        done = {r for r in self._finishing if all(f.done() for f in self._saves[r])}
        for r in done:
            self._finishing.discard(r)
            del self._saves[r]
        return done

    def close(self) -> None:
        self._settle_load()
        if self._exec is not None:
            self._exec.shutdown(wait=True)
        for ld in (self._loader, self._saver):
            if ld is not None:
                ld.close()
        for c in self._clients:
            c.close()
        self._clients = []
