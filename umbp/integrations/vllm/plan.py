"""Scheduler-side bookkeeping of the vLLM connector: which pool pages a request loads and which blocks it saves.

A pool page is one vLLM block (``block_size`` tokens): its key is ``umbp.keys.chain_keys`` over the request's token
ids, so a key names the whole prefix up to and including its block, and a router or another engine computing keys
the same way finds it. Everything else that makes vLLM keep two requests' KV apart enters the chain too: vLLM's
extra block-hash keys (``generate_block_hash_extra_keys``: LoRA name and path, multimodal hashes and offsets,
``cache_salt`` on block 0, prompt-embedding hashes), handed in per block by the connector as ``extra_digest``s. A
block with extra keys chains on ``fold(parent, digest)`` instead of ``parent``, so its key and every later key differ
from any plain chain's and from any other extras'; a request without extra keys keeps the plain chain. A request
whose extra keys cannot be encoded is not pooled at all (no lookup hit, no save).

Per request the tracker keeps the block ids vLLM gave it (new requests: all of them; running ones: the appended
ones; resumed ones: all again) and how many leading blocks are known to be in the pool.

- Loads: ``get_num_new_matched_tokens`` finds the leading run of pages in the pool (``pool_blocks``); the scheduler
  then allocates blocks and ``update_state_after_alloc`` names the ones to fill: blocks
  ``[local_blocks, local_blocks + external_blocks)`` get pages with the same indices.
- Saves: each step, blocks that became full (``num_computed + num_scheduled`` tokens, within the token ids known)
  and are not yet in the pool are saved once; a request with any save scheduled is freed late (vLLM's delayed free:
  ``request_finished`` answers True, and the worker reports it in ``finished_sending`` once its saves are done).

No vLLM, torch or I/O here: plain records, hashes and integer arithmetic. Cost: one sha256 over a block's token ids
when a request's keys grow (``umbp.keys``; with extra keys two more over their encoding), O(blocks) per step
otherwise.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from umbp import keys as umbp_keys
from umbp.errors import InvalidArgument

log = logging.getLogger("umbp.vllm")
EXTRA_DOMAIN = b"umbp-vllm-extra-keys-v1"

Extras = Callable[[int], "bytes | None"]
"""Block index -> ``extra_digest`` of that block's extra keys (None: none); raises InvalidArgument when they cannot
be encoded."""


def _encode(x: Any, h: Any) -> None:
    """Feed ``x`` to ``h`` in a tagged, length-prefixed form: equal encodings only for equal values."""
    if x is None:
        h.update(b"N")
    elif isinstance(x, bool):
        h.update(b"T" if x else b"F")
    elif isinstance(x, (int, str, bytes, bytearray, memoryview)):
        tag, raw = ((b"I", str(x).encode()) if isinstance(x, int) else
                    (b"S", x.encode("utf-8", "surrogatepass")) if isinstance(x, str) else (b"Y", bytes(x)))
        h.update(tag + len(raw).to_bytes(8, "little") + raw)
    elif isinstance(x, (tuple, list)):
        h.update(b"L" + len(x).to_bytes(8, "little"))
        for e in x:
            _encode(e, h)
    else:
        raise InvalidArgument("vllm connector", f"an extra block-hash key of type {type(x).__name__} has no stable "
                                                f"encoding")


def extra_digest(extra: Any) -> bytes | None:
    """The digest of one block's extra keys as vLLM's ``generate_block_hash_extra_keys`` returns them (a tuple of
    tuples of str, int, bytes), or None when there are none."""
    if not extra:
        return None
    h = hashlib.sha256(EXTRA_DOMAIN)
    _encode(extra, h)
    return h.digest()


def fold(parent: str, digest: bytes) -> str:
    """The chain parent of a block with extra keys: a digest of the domain, the real parent's digest (nothing for the
    first block) and the extras' digest. A key is sha256(parent digest || token ids), so a folded chain can meet a
    plain one only through a sha256 collision."""
    return hashlib.sha256(EXTRA_DOMAIN + (bytes.fromhex(parent) if parent else b"") + digest).hexdigest()


@dataclass
class LoadSpec:
    """Fill vLLM blocks ``block_ids[i]`` from pool page ``keys[i]`` (base keys; the worker adds its rank). Fewer
    keys than blocks: the blocks without a key are reported as load errors (vLLM recomputes them)."""

    req_id: str
    keys: list[str]
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Save vLLM blocks ``block_ids[i]`` as pool page ``keys[i]``; ``parent`` is the key of the page before
    ``keys[0]`` (None for the first page of a chain), for prefix-aware eviction."""

    req_id: str
    keys: list[str]
    block_ids: list[int]
    parent: str | None


@dataclass
class StepPlan:
    """What one step's workers do: loads before the forward, saves after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class RequestState:
    """One request as the scheduler side tracks it between steps."""

    req_id: str
    token_ids: Sequence[int]
    keys: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    pool_blocks: int = 0       # leading blocks known to be in the pool (hit at admission, or saved by us)
    local_blocks: int = 0      # blocks vLLM's own cache held at the last lookup: the external run starts there
    load: LoadSpec | None = None
    saved_any: bool = False
    extras: Extras | None = None  # vLLM's extra keys per block (None: the plain token chain)
    poolable: bool = True         # False once its extra keys could not be encoded: never looked up, never saved


class Planner:
    """Per-request state and the step plans built from it. ``block_size``: tokens per vLLM block (= pool page);
    ``save``: whether to save at all (kv_role kv_consumer does not)."""

    def __init__(self, block_size: int, save: bool = True):
        self.block_size = block_size
        self.save = save
        self.requests: dict[str, RequestState] = {}
        self._pending_loads: list[LoadSpec] = []

    def keys_for(self, st: RequestState, num_blocks: int) -> list[str]:
        """The keys of the first ``num_blocks`` blocks of the request (extends the cached chain as needed); none for
        a request that is not poolable."""
        bs = self.block_size
        num_blocks = min(num_blocks, len(st.token_ids) // bs)
        if not st.poolable:
            return []
        if len(st.keys) < num_blocks:
            start = len(st.keys)
            parent = st.keys[-1] if st.keys else ""
            if st.extras is None:
                st.keys.extend(umbp_keys.chain_keys(list(st.token_ids[start * bs:num_blocks * bs]), bs, parent))
            else:
                try:
                    for i in range(start, num_blocks):
                        digest = st.extras(i)
                        parent = umbp_keys.page_key(fold(parent, digest) if digest else parent,
                                                    list(st.token_ids[i * bs:(i + 1) * bs]))
                        st.keys.append(parent)
                except InvalidArgument as e:
                    log.warning("umbp vllm: request %s is not pooled: %s", st.req_id, e)
                    st.poolable, st.keys = False, []
                    return []
        return st.keys[:num_blocks]

    def track(self, req_id: str, token_ids: Sequence[int], extras: Extras | None = None) -> RequestState:
        st = self.requests.get(req_id)
        if st is None:
            st = self.requests[req_id] = RequestState(req_id, token_ids, extras=extras)
        return st

    def lookup_keys(self, req_id: str, token_ids: Sequence[int], extras: Extras | None = None) -> list[str]:
        """Keys a prefix lookup asks the pool about: every full block but the one holding the last prompt token
        (vLLM computes at least one token of every prompt itself). ``extras``: the request's extra keys per block
        (kept with the request for its later blocks)."""
        st = self.track(req_id, token_ids, extras)
        return self.keys_for(st, max(0, (len(token_ids) - 1) // self.block_size))

    def matched(self, req_id: str, pool_blocks: int, num_computed_tokens: int) -> int:
        """Record the pool's leading run for a request; returns the tokens vLLM may load beyond its own
        ``num_computed_tokens`` (a multiple of the block size, or 0)."""
        st = self.requests[req_id]
        st.pool_blocks = max(st.pool_blocks, pool_blocks)
        st.local_blocks = num_computed_tokens // self.block_size
        return max(0, pool_blocks * self.block_size - num_computed_tokens)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """After vLLM allocated ``block_ids`` (all the request's blocks, its local hit first): schedule the load of
        the external ones. They start right after the local blocks of the last lookup, whatever an earlier lookup
        answered (a retried admission after evictions) and however many of the answered tokens vLLM took."""
        st = self.requests.get(req_id)
        if st is None or num_external_tokens <= 0:
            return
        bs = self.block_size
        n_ext = num_external_tokens // bs
        first = st.local_blocks
        keys = self.keys_for(st, first + n_ext)[first:]
        blocks = list(block_ids[first:first + n_ext])
        if len(keys) != n_ext or len(blocks) != n_ext:
            keys = []  # more than we answered: load nothing, and the worker reports the blocks (vLLM recomputes)
        st.load = LoadSpec(req_id, keys, blocks)
        self._pending_loads.append(st.load)

    def step(self, new: Sequence[tuple[str, Sequence[int], int, int]],
             cached: Sequence[tuple[str, Sequence[int] | None, bool, int, int]]) -> StepPlan:
        """Build one step's plan. ``new``: (req_id, block_ids, num_computed_tokens, num_scheduled_tokens) of newly
        scheduled requests; ``cached``: (req_id, new_block_ids, resumed, num_computed_tokens, num_scheduled_tokens)
        of running ones. Pending loads are handed out exactly once."""
        plan = StepPlan(loads=self._pending_loads)
        self._pending_loads = []
        for req_id, block_ids, computed, scheduled in new:
            st = self.requests.get(req_id)
            if st is not None:
                st.block_ids = list(block_ids)
                self._plan_save(st, computed + scheduled, plan)
        for req_id, new_blocks, resumed, computed, scheduled in cached:
            st = self.requests.get(req_id)
            if st is None:
                continue
            if resumed:
                st.block_ids = list(new_blocks or [])
            elif new_blocks:
                st.block_ids.extend(new_blocks)
            self._plan_save(st, computed + scheduled, plan)
        return plan

    def _plan_save(self, st: RequestState, tokens_after_step: int, plan: StepPlan) -> None:
        if not self.save:
            return
        full = min(tokens_after_step, len(st.token_ids)) // self.block_size
        full = min(full, len(st.block_ids))
        if full <= st.pool_blocks:
            return
        keys = self.keys_for(st, full)
        full = len(keys)
        if full <= st.pool_blocks:
            return
        start = st.pool_blocks
        plan.saves.append(SaveSpec(st.req_id, keys[start:full], st.block_ids[start:full],
                                   keys[start - 1] if start else None))
        st.pool_blocks = full
        st.saved_any = True

    def finished(self, req_id: str) -> bool:
        """A request finished: forget it; True if its blocks must outlive it until the worker's saves are done."""
        st = self.requests.pop(req_id, None)
        self._pending_loads = [ld for ld in self._pending_loads if ld.req_id != req_id]
        return bool(st and st.saved_any)
