"""Scheduler side of the vLLM connector: prefix lookups in the pool, and the per-step plans (``plan.Planner``).

``matched_tokens`` asks the metaserver for the leading run of a request's pages (keyed by its token ids and vLLM's
extra block-hash keys: ``plan``) (``prefix_hits``: no lease, no
bytes; for TP-sharded KV every rank's keys, the shortest run counts) and answers vLLM with the tokens beyond its
own prefix cache. Loads are synchronous from vLLM's point of view (the worker fills the blocks layer by layer in the
same step), so the answer's second element is always False. A pool that cannot be reached answers 0 (the request is
computed), logged once per failure streak: a cache outage slows vLLM down, it never stops it.

Cost: one PREFIX round trip per rank per admitted request (vLLM may ask again for a request it could not schedule;
the keys are cached per request).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from umbp import keys as umbp_keys
from umbp.errors import UmbpError
from umbp.integrations.vllm.plan import Extras, Planner, StepPlan
from umbp.integrations.vllm.worker import PoolSettings

log = logging.getLogger("umbp.vllm")


class SchedulerSide:
    def __init__(self, pool: PoolSettings, block_size: int, tp_size: int, replicated: bool, save: bool = True,
                 load: bool = True):
        self.pool = pool
        self.planner = Planner(block_size, save=save)
        self.tp_size = tp_size
        self.replicated = replicated
        self.load = load
        self._client: Any = None
        self._failing = False
        self.counters = {"lookups": 0, "hit_blocks": 0, "lookup_errors": 0}

    def _pool(self):
        if self._client is None:
            self._client = self.pool.client()
        return self._client

    def matched_tokens(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       extras: Extras | None = None) -> int:
        """Tokens beyond ``num_computed_tokens`` the pool holds for this request; ``extras``: its extra keys per
        block (``plan.Extras``; None: keyed by its token ids alone)."""
        keys = self.planner.lookup_keys(req_id, token_ids, extras)
        if not self.load or len(keys) * self.planner.block_size <= num_computed_tokens:
            return self.planner.matched(req_id, 0, num_computed_tokens)
        self.counters["lookups"] += 1
        try:
            ranks = [None] if self.replicated else list(range(self.tp_size))
            hits = min(self._pool().prefix_hits([umbp_keys.rank_key(k, r) for k in keys]) for r in ranks)
            self._failing = False
        except (UmbpError, OSError) as e:
            self.counters["lookup_errors"] += 1
            if not self._failing:
                log.warning("umbp vllm: pool lookup failed, computing instead: %s", e)
            self._failing = True
            hits = 0
        self.counters["hit_blocks"] += hits
        return self.planner.matched(req_id, hits, num_computed_tokens)

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.planner.allocated(req_id, block_ids, num_external_tokens)

    def build(self, scheduler_output: Any) -> StepPlan:
        """The step plan from vLLM's ``SchedulerOutput`` (read only)."""
        n_sched = scheduler_output.num_scheduled_tokens
        new = [(r.req_id, r.block_ids[0], r.num_computed_tokens, n_sched.get(r.req_id, 0))
               for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        resumed = getattr(c, "resumed_req_ids", set()) or set()
        cached = [(rid, (c.new_block_ids[i] or (None,))[0], rid in resumed, c.num_computed_tokens[i],
                   n_sched.get(rid, 0)) for i, rid in enumerate(c.req_ids)]
        return self.planner.step(new, cached)

    def finished(self, req_id: str) -> bool:
        return self.planner.finished(req_id)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
