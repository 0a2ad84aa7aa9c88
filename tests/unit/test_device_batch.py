"""``DeviceBatch`` (umbp/devcopy.py): the segment table of a put's device pages, and ``DeviceCopier.write`` on a plain
host buffer with a kernel double: destinations per segment, one launch per device, bounds refused per place before
any byte moves, a failed launch reported for its device's pages only, headers written last."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from transport import objformat
from umbp.devcopy import DeviceBatch, DeviceCopier
from umbp.errors import CorruptionError, InvalidArgument, TransportError


def test_segments_in_page_order_with_relative_offsets():
    # pages 0 and 2 on the device (2 and 3 segments), page 1 on the host; given out of order
    b = DeviceBatch(3, [2, 0], [3, 2], np.array([1000, 2000, 3000, 10, 20]), np.array([5, 6, 7, 100, 50]),
                    [1, 0], ["d0", "d1"], stager=lambda idxs: ([], lambda: None))
    assert b.on_device.tolist() == [True, False, True] and b.nbytes.tolist() == [150, 0, 18]
    src, dst, lens, dev = b.segments([0, 2], [100_000, 200_000])
    assert src.tolist() == [10, 20, 1000, 2000, 3000]
    assert dst.tolist() == [100_000, 100_100, 200_000, 200_005, 200_011]
    assert lens.tolist() == [100, 50, 5, 6, 7] and dev.tolist() == [0, 0, 1, 1, 1]
    with pytest.raises(InvalidArgument, match="client: device batch"):
        DeviceBatch(2, [0, 0], [1, 1], np.array([1, 2]), np.array([1, 1]), [0, 0], ["d"], lambda i: None)


def test_write_bounds_launch_failure_and_header_last():
    arena = bytearray(8 * objformat.ALIGN)
    arena_mv = memoryview(arena)
    base = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    payloads = [np.full(300, 7, np.uint8), np.full(200, 9, np.uint8), np.full(100, 5, np.uint8)]
    b = DeviceBatch(3, [0, 1, 2], [1, 1, 1], np.array([int(p.ctypes.data) for p in payloads]),
                    np.array([p.size for p in payloads]), [0, 1, 0], ["good", "bad"], lambda i: None)
    launched = []

    def launch(src, dst, lens, device):
        launched.append((device, len(lens)))
        if device == "bad":
            raise RuntimeError("CUDA error (double)")
        for s, d, n in zip(src.tolist(), dst.tolist(), lens.tolist()):
            ctypes.memmove(d, s, n)

    dev = DeviceCopier("client t")
    dev.launch = launch
    a0, a1, a2 = objformat.ARENA_DATA_START, objformat.ARENA_DATA_START + objformat.ALIGN, len(arena) - 64
    for off in (a0, a1):
        arena[off:off + 4] = b"\xff\xff\xff\xff"  # a stale header
    heads = [objformat.pack_object_header(i + 1, 1, p.size) for i, p in enumerate(payloads)]
    res = dev.write(b, [(0, arena_mv, base, a0, heads[0]), (1, arena_mv, base, a1, heads[1]),
                        (2, arena_mv, base, a2, heads[2])])
    assert res[0] is None
    assert isinstance(res[1], TransportError) and "device write on bad failed" in str(res[1])
    assert isinstance(res[2], CorruptionError) and "outside the arena" in str(res[2])
    assert sorted(launched) == [("bad", 1), ("good", 1)]  # the out-of-bounds place never reached a launch
    hs = objformat.OBJ_HEADER_SIZE
    assert bytes(arena[a0:a0 + hs]) == heads[0] and bytes(arena[a0 + hs:a0 + hs + 300]) == bytes([7]) * 300
    assert bytes(arena[a1:a1 + 4]) == b"\0\0\0\0"  # the failed page's header stays invalid
    assert b.via.tolist() == [DeviceBatch.VIA_KERNEL, DeviceBatch.VIA_NONE, DeviceBatch.VIA_NONE]
