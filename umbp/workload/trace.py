"""Agentic request traces: the JSONL format, its loader and writer, token expansion, and trace statistics.

A trace is a list of requests grouped into sessions. A request's prompt is a prefix of an earlier request's
*context* (that request's prompt followed by its output) plus new tokens, so a file stays small: it stores how
many tokens are reused and the new tokens as *runs*, never a 142K-token prompt.

Format (one JSON object per line; ``#`` lines and blank lines are skipped)::

    {"format": "umbp-trace/1", "scale": 0.01, "vocab": 128256, ...}           optional header, first line only
    {"id": "s3/t5", "session": "s3", "turn": 5, "arrival_s": 812.4, "think_s": 3.1,
     "parent": "s3/t4", "reuse": 1734, "append": [["s3/t5/in", 31]], "output": [["s3/t5/out", 4]]}

- ``id``: unique; ``session``: the conversation it belongs to; ``root`` (default ``session``): the top-level
  session, which holds one concurrency slot in a replay (subagent sessions carry their spawner's root);
  ``turn``: 1-based within the session.
- ``arrival_s``: when the request arrived in the recording (a root session's first request is admitted no earlier);
  ``think_s``: the gap between the end of what it waits for and this request (tool time, user time).
- ``parent``: the request whose context this prompt extends (``null``: none); ``reuse``: how many leading tokens
  of the parent's context the prompt starts with (default: all of it). A parent in another session is a *fork*.
- ``append``: the new tokens after the reused prefix; ``output``: the tokens the model answered. Each item is
  either a run ``["RUN_ID", N]`` (N tokens expanded from the string RUN_ID, see ``run_tokens``) or a literal
  token id (an int), so a user's trace can carry real ids. Equal run ids give equal tokens in any request:
  that is how sessions share a system prompt.
- ``after``: session ids whose last request must finish before this one starts (a spawner waiting for subagents).
- A request waits for the previous request of its session, its parent and its ``after`` sessions; each must
  appear earlier in the file.

Invariants after ``load_trace``/``Trace(...)``: ids unique, parents and ``after`` sessions defined earlier, reuse
within the parent's context, every prompt at least one token. ``prompt_len``/``context_len`` are exact.

Costs: loading is O(lines); ``run_tokens`` is vectorised (about 20 ns per token); expanding a prompt from
scratch walks its parent chain, so replays expand incrementally from the parent's context instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from umbp.errors import ConfigError

FORMAT = "umbp-trace/1"
DEFAULT_VOCAB = 128_256  # Llama 3's vocabulary: ids stay realistic for any 4-byte-id hash
MAX_LINE = 16 << 20

Item = tuple[str, int] | int  # a run (id, n) or one literal token id


# ----------------------------------------------------------------------------------------------------------------
# tokens


def run_tokens(run_id: str, n: int, vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """The N token ids of run ``run_id``: splitmix64 over a counter seeded by sha256("umbp-run\\0" + id), mod
    ``vocab``. Pure integer arithmetic, so the ids (and hence the page keys) are identical on every machine and
    numpy version."""
    if n < 0:
        raise ConfigError("trace", f"run {run_id!r}: negative length {n}")
    seed = int.from_bytes(hashlib.sha256(b"umbp-run\0" + run_id.encode()).digest()[:8], "little")
    with np.errstate(over="ignore"):
        x = np.uint64(seed) + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z % np.uint64(vocab)).astype(np.int64)


def items_len(items: Sequence[Item]) -> int:
    return sum(1 if isinstance(it, int) else it[1] for it in items)


def expand_items(items: Sequence[Item], vocab: int = DEFAULT_VOCAB) -> np.ndarray:
    """The token ids of a list of runs and literals, concatenated."""
    parts = []
    literal: list[int] = []
    for it in items:
        if isinstance(it, int):
            literal.append(it)
            continue
        if literal:
            parts.append(np.asarray(literal, dtype=np.int64))
            literal = []
        parts.append(run_tokens(it[0], it[1], vocab))
    if literal:
        parts.append(np.asarray(literal, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------------
# requests


@dataclass(frozen=True)
class Request:
    id: str
    session: str
    turn: int
    append: tuple[Item, ...]
    output: tuple[Item, ...]
    parent: str | None = None
    reuse: int = 0
    root: str = ""
    arrival_s: float = 0.0
    think_s: float = 0.0
    after: tuple[str, ...] = ()
    prompt_len: int = 0  # this and the rest: filled in by Trace
    output_len: int = 0
    parent_session: str = ""

    @property
    def context_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def is_fork(self) -> bool:
        """True when the parent is in another session: a subagent forking from its spawner's context."""
        return self.parent is not None and self.parent_session != self.session

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "session": self.session, "turn": self.turn,
                             "arrival_s": round(self.arrival_s, 3), "think_s": round(self.think_s, 3)}
        if self.root != self.session:
            d["root"] = self.root
        d["parent"] = self.parent
        if self.parent is not None:
            d["reuse"] = self.reuse
        d["append"] = [it if isinstance(it, int) else [it[0], it[1]] for it in self.append]
        d["output"] = [it if isinstance(it, int) else [it[0], it[1]] for it in self.output]
        if self.after:
            d["after"] = list(self.after)
        return d


def _parse_items(v: Any, where: str, vocab: int) -> tuple[Item, ...]:
    if not isinstance(v, list):
        raise ConfigError("trace", f"{where}: expected a list of runs [\"ID\", N] and token ids")
    out: list[Item] = []
    for it in v:
        if isinstance(it, bool):
            raise ConfigError("trace", f"{where}: {it!r} is not a token id or a run")
        if isinstance(it, int):
            if not 0 <= it < vocab:
                raise ConfigError("trace", f"{where}: token id {it} outside 0..{vocab - 1}")
            out.append(it)
        elif (isinstance(it, list) and len(it) == 2 and isinstance(it[0], str) and isinstance(it[1], int)
              and not isinstance(it[1], bool) and it[1] >= 0):
            out.append((it[0], it[1]))
        else:
            raise ConfigError("trace", f"{where}: {it!r} is neither a token id nor a run [\"ID\", N>=0]")
    return tuple(out)


def request_from_json(d: Any, where: str, vocab: int = DEFAULT_VOCAB) -> Request:
    if not isinstance(d, dict):
        raise ConfigError("trace", f"{where}: expected an object")
    known = {"id", "session", "root", "turn", "arrival_s", "think_s", "parent", "reuse", "append", "output", "after"}
    extra = set(d) - known
    if extra:
        raise ConfigError("trace", f"{where}: unknown fields {sorted(extra)}")
    for f in ("id", "session"):
        if not isinstance(d.get(f), str) or not d[f]:
            raise ConfigError("trace", f"{where}: field {f!r} must be a non-empty string")
    turn = d.get("turn", 1)
    if not isinstance(turn, int) or isinstance(turn, bool) or turn < 1:
        raise ConfigError("trace", f"{where}: turn must be an integer >= 1")
    nums = {}
    for f in ("arrival_s", "think_s"):
        x = d.get(f, 0.0)
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not x >= 0:
            raise ConfigError("trace", f"{where}: {f} must be a number >= 0")
        nums[f] = float(x)
    parent = d.get("parent")
    if parent is not None and not isinstance(parent, str):
        raise ConfigError("trace", f"{where}: parent must be a request id or null")
    reuse = d.get("reuse", -1 if parent is not None else 0)
    if not isinstance(reuse, int) or isinstance(reuse, bool) or (parent is None and reuse != 0) or reuse < -1:
        raise ConfigError("trace", f"{where}: reuse must be an integer >= 0 (and 0 without a parent)")
    after = d.get("after", [])
    if not isinstance(after, list) or not all(isinstance(s, str) for s in after):
        raise ConfigError("trace", f"{where}: after must be a list of session ids")
    root = d.get("root", d["session"])
    if not isinstance(root, str) or not root:
        raise ConfigError("trace", f"{where}: root must be a non-empty string")
    return Request(id=d["id"], session=d["session"], turn=turn, root=root, parent=parent, reuse=reuse,
                   append=_parse_items(d.get("append", []), f"{where}: append", vocab),
                   output=_parse_items(d.get("output", []), f"{where}: output", vocab),
                   after=tuple(after), **nums)


# ----------------------------------------------------------------------------------------------------------------
# traces


@dataclass
class Trace:
    """Validated requests in file order plus the header. ``requests[i]`` may depend only on earlier ones."""

    requests: list[Request]
    header: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.header = {"format": FORMAT, "scale": 1.0, "vocab": DEFAULT_VOCAB, **self.header}
        self.vocab = int(self.header["vocab"])
        self.scale = float(self.header["scale"])
        if not 0 < self.scale <= 1:
            raise ConfigError("trace", f"header: scale must be within (0, 1], got {self.scale}")
        self.by_id: dict[str, Request] = {}
        self.last_of_session: dict[str, str] = {}
        fixed = []
        for i, r in enumerate(self.requests):
            where = f"request {i + 1} ({r.id})"
            if r.id in self.by_id:
                raise ConfigError("trace", f"{where}: duplicate id")
            reuse = r.reuse
            psess = ""
            if r.parent is not None:
                p = self.by_id.get(r.parent)
                if p is None:
                    raise ConfigError("trace", f"{where}: parent {r.parent!r} is not defined before it")
                reuse = p.context_len if reuse < 0 else reuse
                if reuse > p.context_len:
                    raise ConfigError("trace", f"{where}: reuse {reuse} exceeds the parent's context of "
                                               f"{p.context_len} tokens")
                psess = p.session
            for s in r.after:
                if s not in self.last_of_session:
                    raise ConfigError("trace", f"{where}: waits for session {s!r}, which has no earlier request")
            plen = reuse + items_len(r.append)
            if plen < 1:
                raise ConfigError("trace", f"{where}: empty prompt")
            r = Request(**{**r.__dict__, "reuse": reuse, "prompt_len": plen, "output_len": items_len(r.output),
                           "parent_session": psess})
            fixed.append(r)
            self.by_id[r.id] = r
            self.last_of_session[r.session] = r.id
        self.requests = fixed

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def roots(self) -> list[str]:
        """Root sessions in order of their first request's arrival (ties: file order)."""
        first: dict[str, tuple[float, int]] = {}
        for i, r in enumerate(self.requests):
            first.setdefault(r.root, (r.arrival_s, i))
        return sorted(first, key=lambda s: first[s])

    def context_tokens(self, req: Request, parent_context: np.ndarray | None = None) -> np.ndarray:
        """Prompt followed by output of ``req``. ``parent_context`` (the parent's context tokens), when given,
        avoids walking the parent chain."""
        return np.concatenate([self.prompt_tokens(req, parent_context), expand_items(req.output, self.vocab)])

    def prompt_tokens(self, req: Request, parent_context: np.ndarray | None = None) -> np.ndarray:
        if req.parent is None:
            head = np.zeros(0, dtype=np.int64)
        else:
            if parent_context is None:
                parent_context = self.context_tokens(self.by_id[req.parent])
            head = parent_context[:req.reuse]
        return np.concatenate([head, expand_items(req.append, self.vocab)])


def dump_trace(trace: Trace, path: str | os.PathLike) -> None:
    with open(path, "w") as fh:
        fh.write(json.dumps(trace.header, sort_keys=True) + "\n")
        for r in trace.requests:
            fh.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def json_lines(lines: Iterable[str], name: str = "trace", max_line: int = MAX_LINE) -> Iterator[tuple[int, Any]]:
    """(line number, decoded JSON) of each line that is neither blank nor a ``#`` comment; ConfigError naming the
    line for one longer than ``max_line`` bytes or not JSON. Shared by this format and Mooncake's."""
    for n, line in enumerate(lines, 1):
        if len(line) > max_line:
            raise ConfigError("trace", f"{name}:{n}: line longer than {max_line} bytes")
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            yield n, json.loads(s)
        except ValueError as e:
            raise ConfigError("trace", f"{name}:{n}: not JSON ({e})") from None


def parse_lines(lines: Iterable[str], name: str = "trace") -> Trace:
    header: dict[str, Any] = {}
    raw: list[tuple[int, Any]] = []
    for n, d in json_lines(lines, name):
        if isinstance(d, dict) and "format" in d and "id" not in d:
            if raw or header:
                raise ConfigError("trace", f"{name}:{n}: a header may only be the first line")
            if d["format"] != FORMAT:
                raise ConfigError("trace", f"{name}:{n}: format {d['format']!r}, expected {FORMAT!r}")
            header = d
            continue
        raw.append((n, d))
    vocab = int(header.get("vocab", DEFAULT_VOCAB))
    reqs = [request_from_json(d, f"{name}:{n}", vocab) for n, d in raw]
    if not reqs:
        raise ConfigError("trace", f"{name}: no requests")
    return Trace(reqs, header)


def load_trace(path: str | os.PathLike) -> Trace:
    try:
        with open(path) as fh:
            return parse_lines(fh, os.path.basename(str(path)))
    except OSError as e:
        raise ConfigError("trace", f"cannot read {path}: {e.strerror or e}") from e


# ----------------------------------------------------------------------------------------------------------------
# statistics


def trace_stats(trace: Trace) -> dict[str, Any]:
    """The numbers the generator is calibrated on, in full-scale tokens (divided by the trace's scale).

    ``prefix_share``: tokens of each prompt taken from its parent's context, over all prompts with a parent in
    the same session (token weighted); ``prefix_share_min_p05``: the 5th percentile of that share per turn."""
    s = trace.scale
    prompts = np.array([r.prompt_len for r in trace.requests], dtype=np.float64)
    outputs = np.array([r.output_len for r in trace.requests], dtype=np.float64)
    main_turns: dict[str, int] = {}
    for r in trace.requests:
        if r.session == r.root:
            main_turns[r.session] = main_turns.get(r.session, 0) + 1
    cont = [r for r in trace.requests if r.parent is not None and not r.is_fork]
    shares = np.array([r.reuse / r.prompt_len for r in cont]) if cont else np.zeros(0)
    forks = [r for r in trace.requests if r.is_fork]
    sessions = {r.session for r in trace.requests}
    turns = np.array(list(main_turns.values()), dtype=np.float64)
    return {
        "requests": len(trace.requests),
        "sessions": len(main_turns),
        "subagent_sessions": len(sessions) - len(main_turns),
        "forks": len({r.parent for r in forks}),
        "turns_per_session_mean": float(turns.mean()) if len(turns) else 0.0,
        "turns_per_session_median": float(np.median(turns)) if len(turns) else 0.0,
        "prompt_tokens_median": float(np.median(prompts)) / s,
        "prompt_tokens_mean": float(prompts.mean()) / s,
        "output_tokens_median": float(np.median(outputs)) / s if len(outputs) else 0.0,
        "prompt_tokens_total": int(prompts.sum()),
        "prefix_share": float(sum(r.reuse for r in cont) / max(1, sum(r.prompt_len for r in cont))),
        "prefix_share_p05": float(np.percentile(shares, 5)) if len(shares) else 0.0,
        "scale": s,
    }
