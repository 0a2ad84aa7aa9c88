"""A LOOKUP answer as the client keeps it: the packed rows (wire VERSION 12, ``answerrows.LOC_ROW``) as one numpy array.

``answer_rows`` turns a decoded answer's ``rows`` bytes into ``LookupAnswer["rows"]``, a read-only ``LOC_ROW`` array
(one ``frombuffer``, node indices checked against ``nodes`` with one compare); the per-key ``locs`` list that older
callers read (``[node_id, off, size, gen, tag, node index] | None``, ``answerrows.unpack_locs``) is built only when asked
for (``answer["locs"]``: ``LookupAnswer.__missing__``), so the array read path (``umbp/readbatch.py``) never pays a
Python object per key for it. A multi-slot answer's parts become LookupAnswers too; ``merge`` joins parts in key
order with one index scatter a part (``umbp/slotrouter.py``), and ``merge_allocs`` a partitioned pool's ALLOC answers
the same way (``AllocAnswer``: packed ``alloc_rows``, ``items`` made only when read). An answer without rows
(VERSION 11: a ``locs`` list already) is left as it is; ``rows_of`` gives its rows the slow way (a Python loop over
its keys).

Invariants: ``rows["node"]`` is ``answerrows.NO_NODE`` (a miss) or an index into ``nodes``; ``caps`` is empty (open pool)
or parallel to ``nodes`` (the read capability of each node's objects of this answer).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from transport import answerrows
from umbp.errors import ProtocolError


class LookupAnswer(dict):
    """A LOOKUP answer dict whose ``"locs"`` is made from ``"rows"`` on first access."""

    def __missing__(self, key: str) -> Any:
        if key != "locs" or "rows" not in self:
            raise KeyError(key)
        rows = self["rows"]
        locs = answerrows.unpack_locs({"rows": rows.tobytes(), "nodes": self.get("nodes") or []}, "client")["locs"]
        self["locs"] = locs
        return locs


class AllocAnswer(dict):
    """An ALLOC answer dict whose ``"items"`` list is made from its checked ``"alloc_rows"`` on first access: the
    array put path (umbp/putbatch.py) never reads it."""

    def __missing__(self, key: str) -> Any:
        if key != "items" or "alloc_rows" not in self:
            raise KeyError(key)
        items = self["items"] = answerrows.alloc_items(self["alloc_rows"], self.get("nodes") or [])
        return items


def alloc_rows(answer: Any, component: str) -> Any:
    """A decoded ALLOC answer with its rows checked (``answerrows.unpack_allocs``) and its ``items`` made when read; an
    answer without rows (VERSION 11) is left as it is."""
    if type(answer) is not dict:
        return answerrows.unpack_allocs(answer, component)
    parts = answer.get("parts")
    if answer.get("rows") is None and type(parts) is not list:  # VERSION 11: items already
        return answerrows.unpack_allocs(answer, component)
    out = answerrows.unpack_allocs(answer, component, items=False)
    if type(parts) is list:  # a multi-slot answer's parts: rows kept, items made only when read
        out["parts"] = [AllocAnswer(p) if type(p) is dict and "alloc_rows" in p else p for p in parts]
    return out if out.get("alloc_rows") is None else AllocAnswer(out)


def answer_rows(answer: Any, component: str) -> Any:
    """A decoded LOOKUP answer (and its multi-slot ``parts``) with ``rows`` as a ``LOC_ROW`` array; malformed rows
    are a ProtocolError (``answerrows.unpack_locs``'s checks); an answer without rows is returned as it is."""
    if type(answer) is not dict:
        return answer
    parts = answer.get("parts")
    if type(parts) is list:
        answer["parts"] = [answer_rows(p, component) for p in parts]
    raw = answer.get("rows")
    if raw is None:
        return answer
    nodes = answer.get("nodes")
    if not isinstance(raw, bytes) or len(raw) % answerrows.LOC_ROW.itemsize or not isinstance(nodes, list):
        raise ProtocolError(component, "malformed LOOKUP answer: rows must be bytes of whole rows with a node list")
    rows = np.frombuffer(raw, answerrows.LOC_ROW)
    node = rows["node"]
    if len(node) and ((node != answerrows.NO_NODE) & (node >= len(nodes))).any():
        raise ProtocolError(component, f"malformed LOOKUP answer: a row names a node beyond the {len(nodes)} given")
    out = LookupAnswer(answer)
    out["rows"] = rows
    return out


def rows_of(answer: dict) -> tuple[np.ndarray, list, list]:
    """(rows, nodes, caps per node or []) of a LOOKUP answer, with or without packed rows (VERSION 11: built from
    its ``locs``, whose last field indexes ``caps``)."""
    if "rows" in answer:
        return answer["rows"], answer.get("nodes") or [], answer.get("caps") or []
    locs, caps = answer["locs"], answer.get("caps") or []
    rows = np.zeros(len(locs), answerrows.LOC_ROW)
    rows["node"] = answerrows.NO_NODE
    nodes: list = []
    ncaps: list = []
    index: dict = {}
    for i, loc in enumerate(locs):
        if loc is None:
            continue
        node_id, off, size, gen, tag, cap = loc[:6]
        j = index.get(node_id)
        if j is None:
            j = index[node_id] = len(nodes)
            nodes.append(node_id)
            ncaps.append(caps[cap] if caps and type(cap) is int and 0 <= cap < len(caps) else cap)
        rows[i] = (tag, gen, size, off, j, 0)
    return rows, nodes, ncaps if caps else []


def merge(parts: list[tuple[list[int], dict]], n: int) -> dict:
    """One answer of ``n`` keys from the parts' answers ``(key indices, answer)``: rows scattered into key order, node
    lists (and caps) concatenated, each part's node indices shifted past the nodes before it."""
    rows, nodes, caps = _scatter([(idx, rows_of(a)) for idx, a in parts], n, answerrows.LOC_ROW)
    return LookupAnswer({"rows": rows, "nodes": nodes, "caps": caps})


def merge_allocs(parts: list[tuple[list[int], dict]], n: int) -> dict:
    """``merge`` for ALLOC answers with packed rows (``alloc_rows``, ``answerrows.ALLOC_ROW``): one answer of ``n`` keys the
    put path writes as arrays (``umbp/putbatch.py``), its ``items`` made only when read; a row not NEW keeps its
    state and ``NO_NODE``. ``write_until_ms``: the earliest part's (every part's places are written by then)."""
    rows, nodes, caps = _scatter([(idx, (a["alloc_rows"], a.get("nodes") or [], a.get("caps") or []))
                                  for idx, a in parts], n, answerrows.ALLOC_ROW)
    out = AllocAnswer({"alloc_rows": rows, "nodes": nodes, "caps": caps})
    until = [a["write_until_ms"] for _idx, a in parts if a.get("write_until_ms")]
    if until:
        out["write_until_ms"] = min(until)
    return out


def _scatter(parts: list[tuple[list[int], tuple]], n: int, dtype: np.dtype) -> tuple[np.ndarray, list, list]:
    """(rows, nodes, caps) of ``n`` keys from parts ``(key indices, (rows, nodes, caps per node or []))``: one index
    scatter a part, each part's node indices shifted past the nodes before it (its ``NO_NODE`` rows kept)."""
    out = np.zeros(n, dtype)
    out["node"] = answerrows.NO_NODE
    nodes: list = []
    caps: list = []
    any_caps = any(pcaps for _idx, (_r, _n, pcaps) in parts)
    for idx, (rows, pnodes, pcaps) in parts:
        if len(pnodes) and nodes:
            rows = rows.copy()
            hit = rows["node"] != answerrows.NO_NODE
            rows["node"][hit] += len(nodes)
        out[np.asarray(idx, np.int64)] = rows
        nodes.extend(pnodes)
        if any_caps:
            caps.extend(pcaps if pcaps else [b""] * len(pnodes))
    return out, nodes, caps
