"""A READV or READV_DISK request's ops checked, one function for both (umbp/node/server.py serves READV from the
arena, umbp/node/tiering.py READV_DISK from the disk tier): the list's shape, each op's place, capability and
payload range. What is served, and each served object's header check, stays with the server of each.

A malformed list (not a list of 1..``wire.MAX_VEC_OPS`` ops, an op not ``[addr, start, length, tag, gen,
payload_len, capability]`` with integers but the capability) refuses the whole frame (BadRequest); an op whose
place, capability or range does not check out fails alone (``[index, status, message]``). An op's capability b""
is the previous op's (a batch's capability crosses the wire once per frame).

Costs: O(ops), about 0.5 us an op in CPython (one capability MAC per batch: ``auth.CapCache``).
"""

from __future__ import annotations

from typing import Any, Callable

from transport import wire
from umbp.errors import BadRequest, RemoteError

HS = wire.OBJ_HEADER_SIZE


def check_ops(meta: Any, what: str, comp: str, check_cap: Callable | None, lo: int, hi: int,
              disk_check: Callable[[int, int], str | None] | None = None) -> tuple[list, list]:
    """The ops of one READV (``disk_check`` None: arena offsets, each object within [lo, hi) and aligned) or
    READV_DISK (``disk_check(offset, object bytes)``: why a disk extent is not readable, or None; addresses carry
    ``wire.DISK_BIT``), ``check_cap`` the connection's ``CapCache.read`` (None: an open pool). Returns (rows,
    failures): rows ``(index, offset, start, length, tag, gen, payload_len)`` of the ops that passed, in order
    (the offset without DISK_BIT), failures ``[index, status, message]``."""
    if type(meta) is not list or not 0 < len(meta) <= wire.MAX_VEC_OPS:
        raise BadRequest(comp, f"{what}: meta must be a list of 1..{wire.MAX_VEC_OPS} [{_ADDR[disk_check is None]}, "
                               f"start, length, tag, gen, payload_len, capability]")
    rows: list = []
    failures: list = []
    prev = b""
    align, bit = wire.ALIGN, wire.DISK_BIT
    for i, m in enumerate(meta):
        if type(m) is not list or len(m) != 7:
            raise BadRequest(comp, f"{what}: op {i} must be [{_ADDR[disk_check is None]}, start, length, tag, gen, "
                                   f"payload_len, capability]")
        addr, start, length, khash, gen, plen, cap = m
        if not (type(addr) is int and type(start) is int and type(length) is int and type(khash) is int
                and type(gen) is int and type(plen) is int):
            raise BadRequest(comp, f"{what}: op {i}: {_ADDR[disk_check is None]}, start, length, tag, gen and "
                                   f"payload_len must be integers")
        if cap == b"":
            cap = prev
        prev = cap
        try:
            if disk_check is None:
                off = addr
                if off < lo or off % align or plen < 0 or off + HS + plen > hi:
                    raise BadRequest(comp, f"{what}: range {off}+{HS + plen} outside the data region [{lo}, {hi}) "
                                           f"or unaligned")
            else:
                off = addr ^ bit
                why = None if addr & bit and plen >= 0 else "not a disk address"
                why = why or disk_check(off, wire.object_size(plen))
                if why:
                    raise BadRequest(comp, f"{what}: {why}")
            if check_cap is not None:
                check_cap(cap, addr, plen, gen, comp)
            if start < 0 or length < 0 or start + length > plen:
                raise BadRequest(comp, f"{what}: range {start}+{length} outside the payload of {plen}")
        except RemoteError as e:
            failures.append([i, e.code or wire.Status.BAD_REQUEST, str(e)])
            continue
        rows.append((i, off, start, length, khash, gen, plen))
    return rows, failures


_ADDR = {True: "offset", False: "disk_addr"}  # what an op's first field is (keyed by "arena")
