"""Page keys: SGLang's chained page hashes, plus the namespace and TP-rank naming around them.

A page key is ``sha256(parent_digest || tokens_of_page)`` as 64 hex characters, so a key names the whole prefix up
to and including its page: two requests share a key exactly when they share that prefix. This is byte for byte
SGLang 0.5.23's ``get_hash_str`` (``sglang/srt/mem_cache/utils.py`` and its native ``hash_binding.cpp``):

- the parent enters as the *raw 32 bytes* of its digest (``bytes.fromhex(parent)``), nothing for the first page;
- each token id enters as 4 bytes little-endian unsigned; a tuple token (EAGLE bigram pages) feeds each element;
- a page holding any id above 2**32-1 is hashed "wide": a 0xff tag byte, then every id as 8 bytes little-endian;
- storage chains may be seeded by ``storage_namespace_seed(extra_key, cache_salt)`` (SGLang's
  ``get_storage_hash_str``), so LoRA adapters or per-tenant salts never share pages.

So a router that computes keys here finds the pages an SGLang engine wrote, and the other way round. Unlike SGLang,
``chain_keys`` gives no key to a trailing partial page: a partial page is not shareable until it is full.

KV that every TP rank holds in full (MLA latents, DSA indexer KV) is keyed without a rank: all ranks share one copy
and ``alloc`` answers EXISTS to all but the first writer (dedup). KV sharded across TP ranks (MHA heads) carries the
rank: ``{key}_{rank}``. Cost: one sha256 over 4 bytes per token, about 1 µs per 64-token page.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Iterable, Sequence

from transport.keyform import digest_forms, digest_key
from transport.wire import MAX_KEY_BYTES
from umbp.errors import InvalidArgument

_U32_MAX = 0xFFFFFFFF


def namespace(model: str, layout: str, page_size: int, dtype: str = "bf16") -> str:
    """A namespace naming everything that changes the bytes of a page: model, KV layout, page size, dtype."""
    return f"{model}/{layout}/p{page_size}/{dtype}"


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None) -> str:
    """SGLang's chain seed for a request namespace (``""`` when both parts are None: an unseeded chain)."""
    if extra_key is None and cache_salt is None:
        return ""
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def _flat_ids(token_ids: Sequence) -> list[int]:
    if token_ids and isinstance(token_ids[0], tuple):
        return [int(e) for t in token_ids for e in t]
    return [int(t) for t in token_ids]


def page_key(parent: str, token_ids: Sequence) -> str:
    """The key of one page whose parent page has key ``parent`` (``""`` for the first page of a chain)."""
    h = hashlib.sha256(bytes.fromhex(parent) if parent else b"")
    ids = _flat_ids(token_ids)
    if any(t < 0 for t in ids):
        raise InvalidArgument("keys", "token ids must be non-negative")
    if ids and max(ids) > _U32_MAX:
        h.update(b"\xff")
        h.update(struct.pack(f"<{len(ids)}Q", *ids))
    else:
        h.update(struct.pack(f"<{len(ids)}I", *ids))
    return h.hexdigest()


def chain_keys(token_ids: Sequence, page_size: int, parent: str = "", *, extra_key: str | None = None,
               cache_salt: str | None = None) -> list[str]:
    """Keys of every full page of ``token_ids``, each chained on the previous one; the first page chains on
    ``parent`` (the key of the page before ``token_ids[0]``), or, when that is empty, on SGLang's namespace seed of
    ``extra_key``/``cache_salt``. A trailing partial page has no key."""
    if page_size <= 0:
        raise InvalidArgument("keys", f"page_size must be positive, got {page_size}")
    if not parent:
        parent = storage_namespace_seed(extra_key, cache_salt)
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


def normalize_key(key: Any) -> bytes:
    """A pool key as bytes (str is UTF-8 encoded; a digest key in its raw form, ``digest_key``); InvalidArgument
    unless 1..MAX_KEY_BYTES bytes."""
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:
        return digest_key(key) if 64 <= len(key) <= 68 else key
    if isinstance(key, str):
        key = key.encode()
    elif isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    elif not isinstance(key, bytes):
        raise InvalidArgument("client", f"key must be str or bytes, got {type(key).__name__}")
    if not key or len(key) > MAX_KEY_BYTES:
        raise InvalidArgument("client", f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return digest_key(key) if 64 <= len(key) <= 68 else key


def normalize_keys(keys: Iterable[Any]) -> list[bytes]:
    """``[normalize_key(k) for k in keys]`` in a few passes over the batch when every key is str, or every key bytes,
    of 1..MAX_KEY_BYTES bytes (the usual batch): encoded by ``map``, the digest forms by ``digest_forms`` (a call
    only for a key that may be a digest key's text). Any other batch goes key by key, with the same bytes and the
    same errors. 128 str names of 68 bytes: 37 -> 27 us against key by key (2-core VM)."""
    if not isinstance(keys, (list, tuple)):
        keys = list(keys)
    kinds = set(map(type, keys))
    if kinds == {str}:
        kb = list(map(str.encode, keys))
    elif kinds == {bytes}:
        kb = list(keys)
    else:
        return [normalize_key(k) for k in keys]
    if not kb:
        return kb
    lens = list(map(len, kb))
    if min(lens) == 0 or max(lens) > MAX_KEY_BYTES:
        return [normalize_key(k) for k in kb]  # the first bad key's error
    if max(lens) < 64:
        return kb
    return digest_forms(kb, lens)
