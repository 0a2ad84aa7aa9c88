"""Page keys: chained hashes over token pages, under a namespace of model and KV layout.

A page key is ``sha256(parent_key || token_ids_of_page)``, hex encoded, so a key names the whole prefix up to and
including its page: two requests share a key exactly when they share that prefix. The first page's parent is the
empty string. This is the same chaining SGLang's HiCache uses, so keys computed here and there agree when the
namespace and page size match.

KV that every TP rank holds in full (MLA latents, DSA indexer KV) is keyed without a rank: all ranks share one copy
and ``alloc`` answers EXISTS to all but the first writer (dedup). KV sharded across TP ranks (MHA heads) carries the
rank: ``{key}_{rank}``. Cost: one sha256 over 4 bytes per token, about 1 µs per 64-token page.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterable, Sequence


def namespace(model: str, layout: str, page_size: int, dtype: str = "bf16") -> str:
    """A namespace naming everything that changes the bytes of a page: model, KV layout, page size, dtype."""
    return f"{model}/{layout}/p{page_size}/{dtype}"


def page_key(parent: str, token_ids: Sequence[int]) -> str:
    h = hashlib.sha256(parent.encode())
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.hexdigest()


def chain_keys(token_ids: Sequence[int], page_size: int, parent: str = "") -> list[str]:
    """Keys of every full page of ``token_ids``, each chained on the previous one (a trailing partial page has
    no key: it is not shareable until it is full)."""
    keys = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_key(parent, token_ids[start:start + page_size])
        keys.append(parent)
    return keys


def parents_of(keys: Sequence[str], first_parent: str | None = None) -> list[str | None]:
    """The parent of each key in a chain (for ``batch_put(..., parents=...)`` and prefix-aware eviction)."""
    return [first_parent] + list(keys[:-1]) if keys else []


def rank_key(key: str, tp_rank: int | None) -> str:
    """The per-rank key of sharded KV; ``tp_rank=None`` for KV replicated on every rank (stored once)."""
    return key if tp_rank is None else f"{key}_{tp_rank}"


def split_for_ranks(keys: Iterable[str], tp_size: int, tp_rank: int) -> list[int]:
    """Indices of ``keys`` this rank loads when a replicated page set is fetched once, split across ranks
    (round robin by page); the ranks then exchange what they loaded."""
    return [i for i, _ in enumerate(keys) if i % tp_size == tp_rank]
