"""The storage node's write ledger: per 4 KiB block of the arena, the newest generation a write capability wrote.

Why. In a closed pool a write capability (umbp/auth.py) names one allocation: (offset, payload length, generation).
The node must refuse any write that touches bytes the capability no longer owns, wherever the object headers lie:
a capability kept past its allocation's abort could otherwise write across the smaller objects placed in the freed
extent since (their headers are not at the capability's offset), and a client must not be able to block a slot by
writing a huge generation into a header (headers are bytes a client wrote; they prove nothing). So the authority
is this ledger, which only the node writes, from the generations of capabilities it verified.

Invariant. Generations are handed out in increasing order (metaserver/store/generations.py: across restarts and
takeovers; a partitioned pool's slots own disjoint regions of the arena, each with its own increasing counter), and a
block is given to a new allocation only after the previous one that held it was freed. So every legitimate write of
a block carries a newer generation than every earlier write of it. A write of generation ``g`` over blocks
``[b0, b1)`` is admitted only when every one of them holds less than ``g``, and then records ``g`` in all of them:
a capability writes its extent once, and never after any newer allocation wrote any byte of it.

Persistence. For an arena that outlives the process (``--node-id``) the ledger lives in a file next to it
(``{arena}.ledger``: the arena id, then one little-endian u64 per block) and is mapped, so a restarted node keeps it
with its arena; a ledger of another arena (or of another size) is started afresh. Open pools keep none (anyone may
write anything there). Cost: 8 bytes per 4 KiB of arena (0.2 %); one numpy max and one fill per object written.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from transport import objformat
from umbp.errors import AuthError, ConfigError

_HEAD = 16  # bytes before the block words: the arena id


class WriteLedger:
    """Newest generation written per block of the data region ``[data_start, data_start + blocks * ALIGN)``."""

    def __init__(self, arena_id: bytes, data_start: int, capacity: int, path: str = "", component: str = "node"):
        self.component = component
        self.data_start = data_start
        self.path = path
        nblocks = -(-capacity // objformat.ALIGN)
        self._map = None
        if not path:
            self.gens = np.zeros(nblocks, dtype=np.uint64)
            return
        size = _HEAD + 8 * nblocks
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise ConfigError(component, f"cannot open the write ledger {path}: {e.strerror}") from e
        try:
            keep = os.fstat(fd).st_size == size and os.pread(fd, _HEAD, 0) == arena_id[:_HEAD].ljust(_HEAD, b"\0")
            if not keep:  # new, or another arena's: start afresh (a fresh arena holds nothing to protect)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
                os.pwrite(fd, arena_id[:_HEAD].ljust(_HEAD, b"\0"), 0)
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ConfigError(component, f"cannot map the write ledger {path}: {e.strerror}") from e
        finally:
            os.close(fd)
        self.gens = np.frombuffer(self._map, dtype="<u8", count=nblocks, offset=_HEAD)

    def admit(self, offset: int, nbytes: int, gen: int) -> None:
        """Record a verified capability's write of generation ``gen`` over ``[offset, offset + nbytes)``; AuthError
        when any block of it was written at ``gen`` or a newer generation (the capability wrote once already, or a
        newer allocation owns part of these bytes now). The range was checked to lie in the data region."""
        b0 = (offset - self.data_start) // objformat.ALIGN
        b1 = -(-(offset + nbytes - self.data_start) // objformat.ALIGN)
        seg = self.gens[b0:b1]
        if not 0 <= gen < 1 << 64:
            raise AuthError(self.component, f"write of generation {gen}: not a generation")
        newest = int(seg.max()) if b1 > b0 else 0
        if newest >= gen:
            raise AuthError(self.component, f"the extent {offset}+{nbytes} already holds generation {newest}: a "
                                            f"write capability of generation {gen} writes its own allocation once, "
                                            f"never bytes a newer allocation owns (allocate again)")
        seg.fill(gen)

    def close(self, remove: bool = False) -> None:
        if self._map is not None:
            self.gens = np.zeros(0, dtype=np.uint64)
            try:
                self._map.close()
            except BufferError:  # a view still exported (a test holding ``gens``): left to the garbage collector
                pass
            self._map = None
        if remove and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
