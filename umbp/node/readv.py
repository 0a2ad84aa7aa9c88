"""A READV or READV_DISK request's ops checked, one function for both (``check_ops``: the list's shape, each op's
place, capability and payload range), and the arena's READV served (``serve``, for umbp/node/server.py; READV_DISK
is served from the disk tier by umbp/node/tiering.py, with its own header check).

A malformed list (not a list of 1..``wire.MAX_VEC_OPS`` ops, an op not ``[addr, start, length, tag, gen,
payload_len, capability]`` with integers but the capability) refuses the whole frame (BadRequest); an op whose
place, capability or range does not check out fails alone (``[index, status, message]``). An op's capability b""
is the previous op's (a batch's capability crosses the wire once per frame).

``serve`` answers from the arena itself (memoryviews, no copies), each object's header checked once per content: a
header byte-equal to one that passed the full check for the same (offset, tag, generation, length) is not checked
again (``NodeServer.checked``, at most HEADER_MEMO entries, cleared when full).

Costs: O(ops), about 0.5 us an op in CPython (one capability MAC per batch: ``auth.CapCache``), plus 0.35 us a page
served whose header is remembered (1 us one checked in full).
"""

from __future__ import annotations

from typing import Any, Callable

from transport import objformat, wire
from umbp.errors import BadRequest, CorruptionError, RemoteError

HS = objformat.OBJ_HEADER_SIZE
HEADER_MEMO = 65536  # READV headers remembered as checked (NodeServer.checked: about 10 MiB at most)


def check_ops(meta: Any, what: str, comp: str, check_cap: Callable | None, lo: int, hi: int,
              disk_check: Callable[[int, int], str | None] | None = None) -> tuple[list, list]:
    """The ops of one READV (``disk_check`` None: arena offsets, each object within [lo, hi) and aligned) or
    READV_DISK (``disk_check(offset, object bytes)``: why a disk extent is not readable, or None; addresses carry
    ``objformat.DISK_BIT``), ``check_cap`` the connection's ``CapCache.read`` (None: an open pool). Returns (rows,
    failures): rows ``(index, offset, start, length, tag, gen, payload_len)`` of the ops that passed, in order
    (the offset without DISK_BIT), failures ``[index, status, message]``."""
    if type(meta) is not list or not 0 < len(meta) <= wire.MAX_VEC_OPS:
        raise BadRequest(comp, f"{what}: meta must be a list of 1..{wire.MAX_VEC_OPS} [{_ADDR[disk_check is None]}, "
                               f"start, length, tag, gen, payload_len, capability]")
    rows: list = []
    failures: list = []
    prev = b""
    align, bit = objformat.ALIGN, objformat.DISK_BIT
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
                why = why or disk_check(off, objformat.object_size(plen))
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


def serve(conn, frame: wire.Frame) -> None:
    """The arena's READV on ``conn`` (a ``server.DataProtocol``), its answer appended to ``conn._out``: a batch of
    reads, one answer: every object checked first (range, capability, header), then one frame whose data is each
    served object's header and payload range, straight from the arena (no copies), and whose meta lists the failed
    ones. An op's capability b"" is the previous op's. A malformed list fails the whole frame (BadRequest). A header
    byte-equal to one that passed the check for the same (offset, tag, generation, length) passes without the unpack
    and crc (``NodeServer.checked``: 0.35 us a page instead of 1 us, on the path before the answer's first byte goes
    out)."""
    node = conn.node
    meta = frame.meta
    comp = node.component
    rows, failures = check_ops(meta, "READV", comp, None if node.cap_key is None else conn.caps.read,
                               node.data_start, node.data_end)
    refused = len(failures)
    view, hs = node.arena.view, objformat.OBJ_HEADER_SIZE
    check_header = objformat.check_object_header
    memo = node.checked
    bufs: list = []
    total = 0
    for i, off, start, length, khash, gen, plen in rows:
        head = view[off:off + hs]
        ident = (off, khash, gen, plen)
        known = memo.get(ident)
        if known is None or head != known:  # not these very bytes, checked before for this entry
            try:
                check_header(head, comp, khash, gen, plen)
            except CorruptionError as e:
                failures.append([i, wire.Status.CORRUPT, str(e)])
                continue
            if len(memo) >= HEADER_MEMO:
                memo.clear()
            memo[ident] = head.tobytes()
        if start == 0:
            bufs.append(view[off:off + hs + length])
        else:
            bufs.append(view[off:off + hs])
            if length:
                bufs.append(view[off + hs + start:off + hs + start + length])
        total += hs + length
    if refused and len(failures) > refused:
        failures.sort()  # header failures came after the range failures of later ops
    stats = node.stats
    stats["reads"] += len(meta) - len(failures)
    stats["bytes_read"] += total - hs * (len(meta) - len(failures))
    stats["errors"] += len(failures)
    out = conn._out
    out.append(wire.encode(frame.op, frame.request_id, failures or None, flags=wire.Flag.RESPONSE,
                           data_len=total, version=conn.reader.version))
    out.extend(bufs)
