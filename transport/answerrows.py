"""The packed rows some requests and answers carry in their meta, one little-endian numpy record a key or object, so a
batch is encoded and decoded with one array call: a LOOKUP answer's ``LOC_ROW`` and an ALLOC answer's ``ALLOC_ROW``
(wire VERSION 12), and a DEMOTE/PROMOTE request's ``TIER_ROW``. No I/O; the frames around them are
``transport/wire.py``'s. Costs: packing and unpacking a fixed number of numpy calls a batch (the list forms of
VERSION 11, ``items`` and ``locs``, a Python tuple a key when read).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from transport.wire import MAX_VEC_OPS, AllocState
from umbp.errors import BadRequest, ProtocolError

# DEMOTE / PROMOTE rows: the object's tag, generation and payload length (checked against the source header), its
# DRAM offset and disk offset (plain, within each arena), and ``regen``: when not 0 the copy's header carries this
# generation instead (a promoted copy in a closed pool needs a fresh one: umbp/node/ledger.py refuses older ones).
TIER_ROW = np.dtype([("tag", "<u8"), ("gen", "<u8"), ("len", "<u8"), ("dram", "<u8"), ("disk", "<u8"),
                     ("regen", "<u8")])




def pack_tier_rows(tags, gens, lens, drams, disks, regens=0) -> bytes:
    """A DEMOTE/PROMOTE request's ``rows``, one a column (sequences or numpy arrays of one length)."""
    rows = np.zeros(len(tags), TIER_ROW)
    for name, col in (("tag", tags), ("gen", gens), ("len", lens), ("dram", drams), ("disk", disks),
                      ("regen", regens)):
        rows[name] = col
    return rows.tobytes()


def unpack_tier_rows(meta: Any, component: str) -> np.ndarray:
    """A DEMOTE/PROMOTE request's rows (1..MAX_VEC_OPS of them); BadRequest when malformed."""
    raw = meta.get("rows") if type(meta) is dict else None
    if not isinstance(raw, bytes) or not raw or len(raw) % TIER_ROW.itemsize or \
            len(raw) // TIER_ROW.itemsize > MAX_VEC_OPS:
        raise BadRequest(component, f"tier move: meta must be {{'rows': 1..{MAX_VEC_OPS} packed TIER_ROWs}}")
    return np.frombuffer(raw, TIER_ROW)


# ---------------------------------------------------------------------------------------------------------------
# A LOOKUP answer's rows (VERSION 12): one ``LOC_ROW`` a key, in key order: the object header's words after its
# magic/version/flags (a reader compares them with the header it reads), the object's arena offset, and the index of
# its node in the answer's ``nodes`` (and of its capability in ``caps``), ``NO_NODE`` for a miss.
LOC_ROW = np.dtype([("tag", "<u8"), ("gen", "<u8"), ("len", "<u8"), ("off", "<u8"), ("node", "<u4"), ("pad", "<u4")])
NO_NODE = 0xFFFFFFFF


# An ALLOC answer's rows: ``LOC_ROW``'s with the key's ``AllocState`` in the padding; a row not NEW: NO_NODE, zeros
ALLOC_ROW = np.dtype(LOC_ROW.descr[:5] + [("state", "<u4")])


def pack_allocs(state, new, tags, gens, lens, offs, nodes) -> bytes:
    """An ALLOC answer's ``rows``: one a key of ``state``, the columns given for the NEW keys at ``new``, in order."""
    n, m = len(state), len(new)
    rows = np.zeros(n, ALLOC_ROW)
    got = rows if m == n else np.zeros(m, ALLOC_ROW)  # m == n: every key NEW, in order
    for name, col in (("tag", tags), ("gen", gens), ("len", lens), ("off", offs), ("node", nodes)):
        got[name] = col
    if m != n:
        rows["node"] = NO_NODE
        rows[new] = got
        rows["state"] = state
    return rows.tobytes()


def _rows(answer: Any, dtype: np.dtype, unpack: Callable, what: str, component: str) -> tuple | None:
    """(rows as ``dtype``, node list) of a packed answer, its ``parts`` unpacked first; None without rows."""
    if type(answer) is not dict:
        return None
    for part in answer.get("parts") or ():
        unpack(part, component)
    raw = answer.pop("rows", None)
    nodes = answer.get("nodes")
    if raw is not None and (not isinstance(raw, bytes) or len(raw) % dtype.itemsize or not isinstance(nodes, list)):
        raise ProtocolError(component, f"malformed {what} answer: rows must be bytes of whole rows with a node list")
    return None if raw is None else (np.frombuffer(raw, dtype), nodes)


def unpack_allocs(answer: Any, component: str, items: bool = True) -> Any:
    """``unpack_locs`` for an ALLOC answer: its rows checked and kept as ``alloc_rows`` (the put path's array form,
    umbp/putbatch.py), and (``items``) its ``items`` list, ``[NEW, node_id, off, payload_len, gen, tag, node index]``
    or ``[state, None, None, None, None]`` a key (``alloc_items``; the client makes it only when it is read)."""
    got = _rows(answer, ALLOC_ROW, lambda part, c: unpack_allocs(part, c, items), "ALLOC", component)
    if got is None:
        return answer
    rows, nodes = got
    answer["alloc_rows"] = rows
    node, state = rows["node"], rows["state"]
    new = state == AllocState.NEW
    if (state > AllocState.IN_FLIGHT).any() or (new & (node >= len(nodes))).any() or (~new & (node != NO_NODE)).any():
        raise ProtocolError(component, f"malformed ALLOC answer: a row's state or node (of {len(nodes)}) is invalid")
    if items:
        answer["items"] = alloc_items(rows, nodes)
    return answer


def alloc_items(rows: np.ndarray, nodes: list) -> list:
    """An ALLOC answer's checked ``alloc_rows`` as its per-key ``items`` list (``unpack_allocs``)."""
    node, state = rows["node"], rows["state"]
    new = state == AllocState.NEW
    names = np.array(nodes + [None], dtype=object)[np.where(new, node, len(nodes))].tolist()
    return [[0, n, o, ln, g, t, i] if n is not None else [s, None, None, None, None] for s, n, o, ln, g, t, i
            in zip(state.tolist(), names, *(rows[f].tolist() for f in ("off", "len", "gen", "tag", "node")))]


def pack_locs(hit, tags, gens, lens, offs, nodes) -> bytes:
    """A LOOKUP answer's ``rows``: one a key of the bool mask ``hit``, the columns given for the hits in order
    (``nodes`` may be one int: every hit on one node). The hits' rows are filled compact, then put in place with one
    masked assignment (none when every key hit) rather than one a column."""
    n, m = len(hit), len(gens)
    rows = np.zeros(n, LOC_ROW)
    if not m:
        rows["node"] = NO_NODE
        return rows.tobytes()
    got = rows if m == n else np.zeros(m, LOC_ROW)  # m == n: every key hit
    got["tag"] = tags
    got["gen"] = gens
    got["len"] = lens
    got["off"] = offs
    got["node"] = nodes
    if m != n:
        rows["node"] = NO_NODE
        rows[hit] = got
    return rows.tobytes()


def unpack_locs(answer: Any, component: str) -> Any:
    """A LOOKUP answer (and its ``parts``) with packed ``rows`` given the ``locs`` list callers read: ``[node_id, off,
    payload_len, gen, tag, node index] | None`` a key, one ``frombuffer`` and a ``tolist`` a column. Malformed rows
    are a ProtocolError; an answer without rows (VERSION 11) is returned as is."""
    got = _rows(answer, LOC_ROW, unpack_locs, "LOOKUP", component)
    if got is None:
        return answer
    rows, nodes = got
    node = rows["node"]
    hit = node != NO_NODE
    if (hit & (node >= len(nodes))).any():
        raise ProtocolError(component, f"malformed LOOKUP answer: a row names a node beyond the {len(nodes)} given")
    names = np.array(nodes + [None], dtype=object)[np.where(hit, node, len(nodes))].tolist()
    answer["locs"] = [None if n is None else [n, o, ln, g, t, i] for n, o, ln, g, t, i in zip(
        names, rows["off"].tolist(), rows["len"].tolist(), rows["gen"].tolist(), rows["tag"].tolist(),
        node.tolist())]
    return answer
