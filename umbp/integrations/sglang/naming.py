"""Pool object names and namespaces for SGLang pages: which objects one SGLang page becomes, and under which name.

One SGLang page key (``get_storage_hash_str``: 64 hex characters, identical to ``umbp.keys.chain_keys``) becomes
one or more pool objects, named the way SGLang's built-in external stores (Mooncake, the original UMBP) name them, so
a router that knows SGLang's scheme finds them:

- KV replicated on every TP rank (MLA latents, DSA): one object ``{hash}_{tag}_k`` with ``tag`` empty, or the PP
  rank when pipeline parallelism is on (``{hash}__k``, ``{hash}_1_k``). Every TP rank names the same object, so the
  pool stores it once: the second writer's ALLOC answers EXISTS (dedup).
- KV sharded across TP ranks (MHA heads): two objects per page, ``{hash}_{tp}_k`` and ``{hash}_{tp}_v``
  (``{tp}_{pp}`` with PP). Heterogeneous TP (``should_split_heads``: a rank holds the heads of several smaller-TP
  ranks) names one K/V pair per covered rank, so a TP-4 writer and a TP-8 reader agree.
- KV sharded across TP ranks with shared entries (``shared``; the backend's ``tp_shared_entries``): the logical
  objects ``{hash}_k`` and ``{hash}_v`` (``{hash}_{pp}_k`` with PP), the same name on every rank; each rank's client
  (``shard=(tp_rank, tp_size)``) writes and reads its part, and the pool keeps ONE entry per object for all ranks
  (``metaserver/shared.py``). Side pools drop the rank the same way (``{hash}_{pool}``). Heterogeneous TP keeps
  per-rank names (a rank covers several smaller-TP ranks' heads: not one part of one layout).
- Context parallelism adds ``_cp{rank}`` to the tag (each CP rank holds a disjoint slice of every page).
- Side pools of the v2 interface (``PoolName``: swa, mamba, indexer, ...): ``{hash}_{tag}_{pool}`` for a pool with
  one component, ``..._{pool}_k`` / ``_v`` for an unpacked pool with two. Mamba state is TP-sharded even when the
  KV is replicated.

The namespace separates everything that changes the bytes of an object without changing its name: model, host
layout (``layer_first`` stores a page layer-major, ``page_first`` token-major), page size, dtype, and for sharded
KV the TP size (rank 0 of TP 2 and rank 0 of TP 4 hold different heads). It is ``umbp.keys.namespace`` shortened to
the pool's 128-byte limit by hashing an overlong model name.

Pure functions of the configuration: no SGLang import, no I/O. Cost: string formatting, O(pages x objects).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence

from umbp import keys as umbp_keys

MAX_NAMESPACE_BYTES = 128


@dataclass(frozen=True)
class ObjectNaming:
    """The object names of one rank. ``split_ranks``: the ranks whose heads this rank holds under heterogeneous TP
    (empty: just ``tp_rank``)."""

    rank_replicated: bool
    tp_rank: int = 0
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    split_ranks: tuple[int, ...] = field(default=())
    shared: bool = False  # TP-sharded objects named without the rank: one shared entry per object (tp_shared_entries)

    def _extra(self) -> str:
        return f"_cp{self.attn_cp_rank}" if self.attn_cp_size > 1 else ""

    def sharded_tag(self, rank: int | None = None) -> str:
        if self.shared:
            return (f"{self.pp_rank}" if self.pp_size > 1 else "") + self._extra()
        rank = self.tp_rank if rank is None else rank
        tag = f"{rank}_{self.pp_rank}" if self.pp_size > 1 else f"{rank}"
        return tag + self._extra()

    def replicated_tag(self) -> str:
        return (f"{self.pp_rank}" if self.pp_size > 1 else "") + self._extra()

    @property
    def ranks(self) -> tuple[int, ...]:
        return self.split_ranks or (self.tp_rank,)

    def kv_suffixes(self) -> tuple[str, ...]:
        """Suffixes of the objects one page of the KV pool becomes, in the order of the host pool's buffer meta."""
        if self.rank_replicated:
            return (f"_{self.replicated_tag()}_k",)
        if self.shared:
            return tuple(_suffix(self.sharded_tag(), c) for c in ("k", "v"))
        return tuple(f"_{self.sharded_tag(r)}_{c}" for r in self.ranks for c in ("k", "v"))

    def kv_objects(self, page_keys: Sequence[str]) -> list[str]:
        """Object names of ``page_keys``, page-major: page 0's objects, then page 1's."""
        suffixes = self.kv_suffixes()
        return [f"{k}{s}" for k in page_keys for s in suffixes]

    def flat_piece_order(self) -> list[int]:
        """For a page handed over as one flat tensor (SGLang's non-zero-copy path: ``get_data_page``), which equal
        piece of it each KV object is. The flat page is component-major (all K, then all V), and under split heads
        each component is ordered by head group, while objects are ordered rank-major (K, V of rank 0, then ...)."""
        if self.rank_replicated:
            return [0]
        n = len(self.ranks)
        return [c * n + r for r in range(n) for c in range(2)]

    def pool_suffixes(self, pool: str, components: int, packed: bool = True, sharded: bool | None = None
                      ) -> tuple[str, ...]:
        """Suffixes of a v2 side pool's objects. ``components``: how many buffers a page of it has (1, or 2 for a
        K/V pair); a packed pair is one object. ``sharded`` defaults to the KV's (Mamba passes True)."""
        if sharded is None:
            sharded = not self.rank_replicated
        tag = self.sharded_tag() if sharded else self.replicated_tag()
        if self.shared and sharded:
            if components == 2 and not packed:
                return (_suffix(tag, f"{pool}_k"), _suffix(tag, f"{pool}_v"))
            return (_suffix(tag, pool),)
        if components == 2 and not packed:
            return (f"_{tag}_{pool}_k", f"_{tag}_{pool}_v")
        return (f"_{tag}_{pool}",)


def _suffix(tag: str, rest: str) -> str:
    """``_{tag}_{rest}``, or ``_{rest}`` for an empty tag (shared entries' names: ``{hash}_k``)."""
    return f"_{tag}_{rest}" if tag else f"_{rest}"


def parents_for(objects_per_page: int, page_objects: Sequence[str], prefix_objects: Sequence[str] | None
                ) -> list[str | None]:
    """The parent of each object for prefix-aware eviction: the same-suffix object of the previous page, and for
    the first page the last prefix page's (``prefix_objects``: the previous page's objects, or None)."""
    out: list[str | None] = []
    for i in range(len(page_objects)):
        j = i - objects_per_page
        if j >= 0:
            out.append(page_objects[j])
        elif prefix_objects:
            out.append(prefix_objects[i])
        else:
            out.append(None)
    return out


def namespace_for(model: str | None, layout: str, page_size: int, dtype: str, tp_size: int | None = None,
                  kind: str = "hicache") -> str:
    """``umbp.keys.namespace`` of an SGLang pool: ``kind`` keeps HiCache objects and linker objects (different byte
    layouts of the same page) apart; ``tp_size`` is given for TP-sharded KV only."""
    layout_tag = f"{kind}-{layout}" + (f"-tp{tp_size}" if tp_size else "")
    model = (model or "model").strip("/") or "model"
    ns = umbp_keys.namespace(model, layout_tag, page_size, dtype)
    if len(ns.encode()) <= MAX_NAMESPACE_BYTES:
        return ns
    digest = hashlib.sha256(model.encode()).hexdigest()[:16]
    short = model.encode()[:40].decode("utf-8", "ignore") + "~" + digest
    return umbp_keys.namespace(short, layout_tag, page_size, dtype)


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` -> ``bf16`` style names (anything unknown: its ``str`` without ``torch.``)."""
    text = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4m3",
            "float8_e5m2": "fp8e5m2", "uint8": "u8", "int8": "i8"}.get(text, text)
