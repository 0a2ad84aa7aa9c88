"""A shm write past its deadline (``WriteOp.until_ms``, the ALLOC answer's ``write_until_ms``): the client copies into
the mapped arena itself, so it looks at the clock before each page's copy (``ShmTransport.start_write``,
``transport.base.write_rows_to_arena``) and copies nothing after it: the pages not copied whole in time fail with
an UNAVAILABLE error naming the deadline and get no header; the ones copied in time are written. No processes: an
arena file in tmp_path, a clock the tests move."""

from __future__ import annotations

import os
import time
import types
import uuid

import numpy as np
import pytest

from transport import base, objformat, shm
from transport.base import WriteOp, write_rows_to_arena
from transport.shm import ShmTransport, boot_id
from umbp import copies, putbatch
from umbp.errors import Unavailable

PAGE = 64 << 10
UNTIL_MS = 2_000_000_000_000  # the writes' deadline; the fake clock reads just before or just after it


class Clock:
    """``time`` for transport.base and transport.shm: ``time()`` reads before the deadline for the first ``calls``
    reads, after it from then on; ``monotonic`` is the real one."""

    def __init__(self, calls: int):
        self.calls = calls
        self.monotonic = time.monotonic

    def time(self) -> float:
        self.calls -= 1
        return UNTIL_MS / 1000 + (1.0 if self.calls < 0 else -1.0)


@pytest.fixture
def transport(tmp_path):
    size = 32 << 20  # room for a batch the copy threads take (copies.SERIAL_BYTES)
    aid = uuid.uuid4().bytes
    path = os.path.join(tmp_path, "arena")
    with open(path, "wb") as fh:
        # the superblock's page as a node leaves it (no generation floor published), the data region filled
        fh.write(objformat.pack_superblock(aid, size, 0).ljust(objformat.ARENA_DATA_START, b"\0").ljust(size, b"\xee"))
    t = ShmTransport("n0", path, aid, boot_id())
    yield t
    t.close()


def _pages(n: int, plen: int = PAGE) -> tuple[list[WriteOp], list[bytes]]:
    payloads = [bytes([i + 1]) * plen for i in range(n)]
    ops = [WriteOp(4096 + i * (plen + 4096), objformat.pack_object_header(i + 7, 1, plen), [memoryview(p)], plen, 1, b"",
                   UNTIL_MS) for i, p in enumerate(payloads)]
    return ops, payloads


def _written(t: ShmTransport, op: WriteOp, payload: bytes) -> bool:
    o, hs = op.offset, objformat.OBJ_HEADER_SIZE
    return bytes(t.arena[o:o + hs]) == op.header and bytes(t.arena[o + hs:o + hs + op.nbytes]) == payload


def _untouched(t: ShmTransport, op: WriteOp) -> bool:
    o = op.offset
    return bytes(t.arena[o:o + objformat.OBJ_HEADER_SIZE + op.nbytes]) == b"\xee" * (objformat.OBJ_HEADER_SIZE + op.nbytes)


@pytest.mark.parametrize("plen", [PAGE, 4 << 20])  # copied on this thread; by copy threads (4 x 4 MiB)
def test_start_write_copies_nothing_past_the_deadline(transport, monkeypatch, plen):
    ops, payloads = _pages(4, plen)
    monkeypatch.setattr(shm, "time", Clock(0))
    res = transport.finish(transport.start_write(ops, time.monotonic() + 5), time.monotonic() + 5)
    assert all(isinstance(r, Unavailable) and "deadline" in str(r) and "n0" in str(r) for r in res), res
    assert all(_untouched(transport, op) for op in ops)
    monkeypatch.setattr(shm, "time", Clock(1 << 30))  # in time
    assert transport.finish(transport.start_write(ops, time.monotonic() + 5), time.monotonic() + 5) == [None] * 4
    assert all(_written(transport, op, p) for op, p in zip(ops, payloads))


def test_start_write_fails_the_pages_not_copied_before_the_deadline(transport, monkeypatch):
    ops, payloads = _pages(4)
    # reads: one for the batch's stream bound (none here), one per op before its header is invalidated, then one
    # per part before its copy: the deadline passes after the first two pages' copies
    assert copies.threads_for(sum(op.nbytes for op in ops)) == 1
    monkeypatch.setattr(shm, "time", Clock(4 + 2))
    res = transport.start_write(ops, time.monotonic() + 5).results
    assert res[:2] == [None, None] and all(isinstance(r, Unavailable) for r in res[2:]), res
    assert _written(transport, ops[0], payloads[0]) and _written(transport, ops[1], payloads[1])
    for op in ops[2:]:  # no header: a reader sees no object there
        assert bytes(transport.arena[op.offset:op.offset + 4]) == b"\0\0\0\0"
        assert bytes(transport.arena[op.offset + 64:op.offset + 64 + op.nbytes]) == b"\xee" * op.nbytes


@pytest.mark.parametrize("plen", [PAGE, 4 << 20])
def test_write_rows_leaves_the_pages_past_the_deadline_to_the_transport(transport, monkeypatch, plen):
    ops, payloads = _pages(4, plen)
    off = np.array([op.offset for op in ops], np.uint64)
    lens = np.full(4, plen, np.uint64)
    heads = np.frombuffer(b"".join(op.header for op in ops), np.uint8).reshape(4, 64)
    src = [memoryview(p) for p in payloads]
    rows = putbatch.arena_rows(transport)
    monkeypatch.setattr(base, "time", Clock(0))
    status = write_rows_to_arena(rows, transport.arena, off, lens, heads, src, time.monotonic() + 5, UNTIL_MS / 1000)
    assert status.tolist() == [1] * 4 and all(_untouched(transport, op) for op in ops)
    if plen == PAGE:  # on this thread: one read up front, one before each page's copy
        monkeypatch.setattr(base, "time", Clock(1 + 2))
        status = write_rows_to_arena(rows, transport.arena, off, lens, heads, src, time.monotonic() + 5,
                                     UNTIL_MS / 1000)
        assert status.tolist() == [0, 0, 1, 1]
        assert _written(transport, ops[0], payloads[0]) and _written(transport, ops[1], payloads[1])
        assert bytes(transport.arena[ops[2].offset:ops[2].offset + 4]) == b"\0\0\0\0"
    monkeypatch.setattr(base, "time", Clock(1 << 30))
    status = write_rows_to_arena(rows, transport.arena, off, lens, heads, src, time.monotonic() + 5, UNTIL_MS / 1000)
    assert status.tolist() == [0] * 4 and all(_written(transport, op, p) for op, p in zip(ops, payloads))


def test_the_array_path_fails_late_shm_pages_as_failed_writes(transport, monkeypatch):
    """``putbatch._shm``: what ``write_rows_to_arena`` leaves past the deadline goes to ``start_write``, which fails
    each page with the deadline's error (the put aborts them: ``Puts._settle``)."""
    ops, payloads = _pages(3)
    r = np.zeros(3, [("off", "<u8"), ("len", "<u8"), ("gen", "<u8")])
    r["off"], r["len"], r["gen"] = [op.offset for op in ops], PAGE, 1
    heads = np.frombuffer(b"".join(op.header for op in ops), np.uint8).reshape(3, 64)
    clock = types.SimpleNamespace(time=lambda: UNTIL_MS / 1000 + 1.0, monotonic=time.monotonic)
    monkeypatch.setattr(base, "time", clock)
    monkeypatch.setattr(shm, "time", clock)
    res = putbatch._shm(transport, [[memoryview(p)] for p in payloads], [0, 1, 2], r, np.arange(3), heads,
                        b"".join(op.header for op in ops), time.monotonic() + 5, UNTIL_MS)
    assert all(isinstance(x, Unavailable) and "deadline" in str(x) for x in res), res
    assert all(_untouched(transport, op) for op in ops)
