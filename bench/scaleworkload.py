"""The workload of ``bench/scale.py``: a rack serving three models from one pool, as chains of page keys.

- ``llama-3.1-70b/mha-tp8``: MHA heads sharded over 8 TP ranks, one key per rank (``umbp.keys.rank_key``), 50 % of
  the pages; ``deepseek-v3/mla``: MLA latents replicated on every rank, one key per page, 30 %;
  ``qwen3-8b/mha-tp1``: 20 %. Each session's chain descends from its model's shared system-prompt chain.
- Keys are the raw 32-byte digests clients send (``umbp.keys.normalize_key``), or with ``HEX_KEYS`` (``--key-form
  hex``) the 64 hex characters clients sent before.
- ``new_directory`` makes the 32-node page table (``metaserver.table.directory.TableDirectory``, the metaserver's directory)
  that holds exactly N pages of the mix.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metaserver.table.directory import TableDirectory  # noqa: E402
from transport.objformat import object_size  # noqa: E402
from umbp.keys import namespace  # noqa: E402

NODES = 32
BATCH = 1000
ROOT_PAGES = 32  # each model's shared system prompt, in pages
CHAIN_MIN, CHAIN_MAX = 32, 512  # a session's own pages (64-token pages: 2k..32k tokens)
POLICIES = ("lru", "prefix-lru")


class Model:
    __slots__ = ("tag", "ns", "share", "payload", "ranks", "lengths", "pages")

    def __init__(self, tag: str, ns: str, share: float, payload: int, ranks: int | None):
        self.tag = tag.encode()
        self.ns = ns
        self.share = share
        self.payload = payload
        self.ranks = ranks  # None: one key per page (replicated KV); n: one key per TP rank
        self.lengths = array("H")  # own pages of each session chain
        self.pages = 0  # keys written (all ranks)


def models() -> list[Model]:
    return [
        Model("llama", namespace("llama-3.1-70b", "mha-tp8", 64), 0.5, 64 * 80 * 2 * 1 * 128 * 2, 8),
        Model("dsv3", namespace("deepseek-v3", "mla", 64, "fp8"), 0.3, 64 * 61 * 656, None),
        Model("qwen", namespace("qwen3-8b", "mha-tp1", 64), 0.2, 64 * 36 * 2 * 8 * 128 * 2, None),
    ]


HEX_KEYS = False  # --key-form hex: keys as the 64-character hex text (what clients sent before umbp.keys.digest_key)


def page_hex(m: Model, chain: int, pos: int) -> bytes:
    """The key of page ``pos`` of session ``chain`` (chain -1: the model's shared system prompt) as a client sends
    it: the raw 32-byte digest (``umbp.keys.normalize_key`` of the 64-hex text), or the hex text with --key-form
    hex."""
    if chain >= 0 and pos < ROOT_PAGES:
        chain = -1
    h = hashlib.sha256(b"%s:%d:%d" % (m.tag, chain, pos))
    return h.hexdigest().encode() if HEX_KEYS else h.digest()


def _ranked(key: bytes, r: int) -> bytes:
    """``umbp.keys.rank_key`` in the form a client sends: a rank byte after the raw digest (``_{rank}`` after hex)."""
    return key + (b"_%d" % r if HEX_KEYS else bytes((r,)))


def rank_keys(m: Model, hexes: list[bytes]) -> list[list[bytes]]:
    if m.ranks is None:
        return [hexes]
    return [[_ranked(h, r) for h in hexes] for r in range(m.ranks)]


def chain_pages(m: Model, chain: int, start: int, stop: int) -> tuple[list[bytes], list[bytes | None]]:
    """Keys (rank-less) of pages [start, stop) of a session chain and of their parents."""
    hexes = [page_hex(m, chain, p) for p in range(max(0, start - 1), stop)]
    if start == 0:
        return hexes, [None] + hexes[:-1]
    return hexes[1:], hexes[:-1]


def rank_keys_opt(m: Model, parents: list) -> list[list]:
    if m.ranks is None:
        return [parents]
    return [[_ranked(p, r) if p is not None else None for p in parents] for r in range(m.ranks)]


def node_capacity(ms: list[Model], n_pages: int, slack: float) -> int:
    """Arena bytes per node for NODES nodes to hold n_pages of the workload's mix (``slack``: a factor on top)."""
    per_key = sum(m.share * object_size(m.payload) for m in ms)
    return int(per_key * (n_pages + 2000) / NODES * slack) + 4 * object_size(max(m.payload for m in ms))


def new_directory(policy: str, ms: list[Model], n_pages: int, slack: float = 1.001) -> TableDirectory:
    """A page table over NODES nodes holding exactly n_pages of the workload's mix (a little slack per node); its
    columns grow as it fills."""
    d = TableDirectory(policy=policy)
    cap = node_capacity(ms, n_pages, slack)
    for i in range(NODES):
        d.add_space(f"host{i:02d}", cap)
    return d
