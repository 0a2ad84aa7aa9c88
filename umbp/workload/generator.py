"""A seeded generator of agentic coding sessions with the published AgentX shape, scaled to fit a laptop.

The shape it is calibrated on (full scale, before ``scale``): about 43 turns per session, a median prompt of
about 142K tokens, a median output of 444 tokens, each prompt keeping over 96% of its tokens from the previous
turn's context, subagents forking from a shared prefix, sessions arriving over time. How a session is built:

- turn 1: a system prompt shared by every session (one run id, so one set of pages for the whole trace), a
  repository context shared by the sessions of the same repository, and a context of the session's own;
- turn t > 1: the whole previous context (prompt + output) plus new tokens (tool results, user text), drawn
  log-normal and capped at ``max_new_share`` of the prompt, so every prompt keeps at least 96% from the last turn;
- with probability ``fork_prob`` a turn spawns 1..``subagents_max`` subagents: each starts from the spawner's full
  context (the prefix the siblings share) plus its own task, runs a few turns, and the spawner's next turn waits
  for all of them and appends their results;
- sessions arrive as a Poisson process; between turns a tool/user think time is drawn log-normal.

``scale`` multiplies every token count (at least one token per run), so ``scale=0.01`` makes a 142K-token prompt
1.4K tokens; times are not scaled (the replay's cost model scales tokens back up). Same config and seed, same
trace, byte for byte. What it approximates: the distributions are parametric guesses that reproduce the published
summary statistics (tests check them), not a fit to the raw AgentX data; there is no context compaction.

Cost: O(requests) Python work; a 48-session trace (about 2,600 requests) takes well under a second.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from umbp.errors import ConfigError
from umbp.workload.trace import DEFAULT_VOCAB, FORMAT, Request, Trace


@dataclass(frozen=True)
class AgentXShape:
    """Generator parameters. Token counts are full scale; ``scale`` shrinks them all."""

    sessions: int = 48
    seed: int = 0
    scale: float = 0.01
    turns_mean: float = 43.0  # main-agent turns per session (gamma distributed)
    turns_shape: float = 6.0
    turns_min: int = 8
    system_tokens: int = 14_000  # shared by every session
    repos: int = 8  # sessions are spread over this many repositories ...
    repo_tokens: int = 40_000  # ... whose context the sessions of one repository share
    own_context_median: int = 25_000  # per-session context in turn 1 (task, files read up front)
    own_context_sigma: float = 0.5
    new_tokens_median: int = 1_700  # tool results + user text appended per turn
    new_tokens_sigma: float = 0.9
    max_new_share: float = 0.04  # appended tokens never exceed this share of a prompt (prefix >= 96%)
    output_median: int = 444
    output_sigma: float = 0.6
    fork_prob: float = 0.03  # chance a main turn spawns subagents
    subagents_max: int = 3
    subagent_turns_mean: float = 4.0
    subagent_task_tokens: int = 1_000
    subagent_result_tokens: int = 1_500
    interarrival_s: float = 2.0  # mean gap between session arrivals
    think_median_s: float = 3.0  # tool/user time between turns
    think_sigma: float = 0.8
    nominal_tpot_s: float = 0.025  # only for the recorded arrival_s of later turns
    vocab: int = DEFAULT_VOCAB

    def __post_init__(self) -> None:
        c = "generator"
        if not 1 <= self.sessions <= 1_000_000:
            raise ConfigError(c, f"sessions must be within 1..1000000, got {self.sessions}")
        if not 0 < self.scale <= 1:
            raise ConfigError(c, f"scale must be within (0, 1], got {self.scale}")
        if not 0 < self.max_new_share < 1 or not 0 <= self.fork_prob <= 1:
            raise ConfigError(c, "max_new_share must be within (0, 1) and fork_prob within [0, 1]")
        if self.turns_mean < 1 or self.turns_shape <= 0 or self.repos < 1 or self.subagents_max < 1:
            raise ConfigError(c, "turns_mean, turns_shape, repos and subagents_max must be positive")


class _Builder:
    def __init__(self, cfg: AgentXShape):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.requests: list[Request] = []

    def n(self, tokens: float) -> int:
        return max(1, int(round(tokens * self.cfg.scale)))

    def lognormal(self, median: float, sigma: float) -> float:
        return float(median * math.exp(sigma * self.rng.standard_normal()))

    def think(self) -> float:
        return self.lognormal(self.cfg.think_median_s, self.cfg.think_sigma)

    def capped_new(self, prev_context: int, want: int) -> int:
        """New tokens for a prompt extending ``prev_context``: at most max_new_share of the resulting prompt."""
        cap = int(prev_context * self.cfg.max_new_share / (1 - self.cfg.max_new_share))
        return max(1, min(want, cap))

    def add(self, **kw) -> Request:
        r = Request(**kw)
        self.requests.append(r)
        return r

    def turn(self, sid: str, root: str, t: int, arrival: float, parent: Request, ctx: int,
             extra: list, after: tuple[str, ...] = ()) -> tuple[Request, int, float]:
        """One continuing turn: the parent's whole context plus ``extra`` runs plus capped new tokens."""
        c = self.cfg
        rid = f"{sid}/t{t}"
        extra_n = sum(x[1] for x in extra)
        new = self.capped_new(ctx, self.n(self.lognormal(c.new_tokens_median, c.new_tokens_sigma)) + extra_n)
        if new <= extra_n:  # the cap bites: shrink the extra runs proportionally, keep at least one token each
            keep = max(len(extra), new)
            extra = [(x[0], max(1, x[1] * keep // max(1, extra_n))) for x in extra]
            append = list(extra)
        else:
            append = list(extra) + [(f"{rid}/in", new - extra_n)]
        out = self.n(self.lognormal(c.output_median, c.output_sigma))
        think = self.think()
        r = self.add(id=rid, session=sid, root=root, turn=t, arrival_s=arrival + think, think_s=think,
                     parent=parent.id, reuse=ctx, append=tuple(append), output=((f"{rid}/out", out),), after=after)
        plen = ctx + sum(x[1] for x in append)
        return r, plen + out, arrival + think + out / c.scale * c.nominal_tpot_s

    def session(self, idx: int, arrival: float) -> None:
        c = self.cfg
        sid = f"s{idx}"
        repo = int(self.rng.integers(c.repos))
        turns = max(c.turns_min, int(round(self.rng.gamma(c.turns_shape, c.turns_mean / c.turns_shape))))
        first = [("system", self.n(c.system_tokens)), (f"repo{repo}", self.n(c.repo_tokens)),
                 (f"{sid}/ctx", self.n(self.lognormal(c.own_context_median, c.own_context_sigma)))]
        out = self.n(self.lognormal(c.output_median, c.output_sigma))
        prev = self.add(id=f"{sid}/t1", session=sid, root=sid, turn=1, arrival_s=arrival, think_s=0.0,
                        append=tuple(first), output=((f"{sid}/t1/out", out),))
        ctx = sum(x[1] for x in first) + out
        now = arrival + out / c.scale * c.nominal_tpot_s
        pending: tuple[str, ...] = ()
        results: list = []
        for t in range(2, turns + 1):
            prev, ctx_next, now = self.turn(sid, sid, t, now, prev, ctx, results, pending)
            ctx, pending, results = ctx_next, (), []
            if t < turns and self.rng.random() < c.fork_prob:
                pending, results, now = self.fork(sid, prev, ctx, now)

    def fork(self, sid: str, spawner: Request, ctx: int, now: float) -> tuple[tuple[str, ...], list, float]:
        """Subagents of ``spawner``: each starts from its full context (``ctx`` tokens) plus a task."""
        c = self.cfg
        k = int(self.rng.integers(1, c.subagents_max + 1))
        names, results, end = [], [], now
        for j in range(k):
            sub = f"{spawner.id}/a{j}"
            turns = max(2, int(round(self.rng.gamma(3.0, c.subagent_turns_mean / 3.0))))
            task = self.n(c.subagent_task_tokens)
            out = self.n(self.lognormal(c.output_median, c.output_sigma))
            think = self.think()
            prev = self.add(id=f"{sub}/t1", session=sub, root=spawner.root, turn=1, arrival_s=now + think,
                            think_s=think, parent=spawner.id, reuse=ctx, append=((f"{sub}/task", task),),
                            output=((f"{sub}/t1/out", out),))
            sctx, t_end = ctx + task + out, now + think + out / c.scale * c.nominal_tpot_s
            for t in range(2, turns + 1):
                prev, sctx, t_end = self.turn(sub, spawner.root, t, t_end, prev, sctx, [])
            names.append(sub)
            results.append((f"{sub}/result", self.n(c.subagent_result_tokens)))
            end = max(end, t_end)
        return tuple(names), results, end


def generate(cfg: AgentXShape | None = None) -> Trace:
    """A trace of ``cfg.sessions`` sessions (and their subagents), requests in dependency order."""
    cfg = cfg or AgentXShape()
    b = _Builder(cfg)
    arrival = 0.0
    for i in range(cfg.sessions):
        b.session(i, arrival)
        arrival += float(b.rng.exponential(cfg.interarrival_s))
    header = {"format": FORMAT, "scale": cfg.scale, "vocab": cfg.vocab, "generator": "umbp agentx",
              "params": asdict(cfg)}
    return Trace(b.requests, header)
