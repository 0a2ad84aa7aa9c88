"""Capabilities: the grants a metaserver hands out for node writes and reads (``write_capability``,
``read_capability`` and their packed forms, one a node of a batch), a slot leader's FENCE (``fence_token``), the
node's checks of them (``CapCache``, ``check_write_capability``, ``check_read_capability``, ``open_fence``) and the
client's attaching of them to an answer's rows (``with_caps``). Sans-I/O (keyed blake2b and tables only). A node's
``cap_key`` is ``umbp.auth.Tokens.cap_key``; tokens, the handshake and object tags are umbp/auth.py's, which
re-exports these names.

Capabilities. In a closed pool the metaserver grants capabilities per node per batch, not per key: with an ALLOC
answer one ``write_capability`` per node that got places, covering that node's slots of the batch (offset,
payload_len, generation each), the metaserver's term (``epoch``, its election revision) and a deadline
``write_cap_ttl_s`` away; with a LOOKUP answer one ``read_capability`` per node holding hits, covering those objects.
A capability is its slot list in the clear plus a keyed blake2b MAC (16 bytes) over it under ``cap_key``, so the node
checks it once per batch per connection (``CapCache``: verified capabilities by their MAC, bounded) and then each
object of it by a dict look-up, while the batch's writes may arrive in several WRITE/WRITEV frames. The node checks
them before touching its arena, so a connection can only write the slots it was granted and read the objects it
looked up (namespace rights are checked at the metaserver). A write capability dies with its allocation: (1) each
extent is written once: the node refuses a write when any 4 KiB of its extent was written at its generation or a
newer one (the node's own write ledger, umbp/node/ledger.py, never a header a client wrote); (2) it dies at its
deadline and at a takeover (the node refuses epochs older than the term it registered with or saw in a newer
capability); (3) until its deadline nobody else can be given its bytes: the metaserver holds an extent freed within
``write_cap_ttl_s`` + skew of its allocation (abort, remove, eviction of a young page) in quarantine until the
deadline has passed. So a capability kept after its keys were removed writes only free, quarantined space, and never
another allocation's. ``cap_key`` is derived from the cluster secret, the node id and the arena id: both sides
compute it, nothing about it crosses the wire, and a capability of one node (or arena) is worthless at another.

What this does not cover: a process that can map an arena file (same host, file permissions) or holds a node's RDMA
rkey can read and write that arena directly, any slot, any time: capabilities bind TCP writes only, and one-sided
RDMA never involves the node's CPU (memory windows per allocation would be the fix; not built). The arena path and
id are only told to admin tokens and the cluster secret (a node's ARENA_INFO, the metaserver's node maps: a scoped
token, rw or not, gets what TCP needs), the rkey to authenticated clients; run RDMA on a network only trusted hosts
reach. The quarantine and deadlines assume the metaserver's and nodes' clocks agree within ``CLOCK_SKEW_S`` (NTP
does much better).

Costs: per key 24 bytes of slot list; per node per batch one MAC (a copy of a keyed blake2b state kept per key).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from itertools import chain

from umbp.errors import AuthError, ProtocolError

_SLOT = struct.Struct("<QQQ")  # one object of a capability: offset, payload_len, gen
_CAP_HEAD = struct.Struct("<QQ")  # epoch, expires_ms (0, 0 in a read capability): in the clear, covered by the MAC
CAP_MAC = 16  # bytes of keyed blake2b closing a capability
CAP_MIN = _CAP_HEAD.size + _SLOT.size + CAP_MAC  # a capability of one object
WRITE_CAP_SIZE = CAP_MIN  # kept for callers: the size of a one-object write capability
CAP_CACHE = 64  # verified capabilities a node keeps per connection (a batch's frames hit it; oldest dropped)
_WRITE, _READ = b"umbp-wcap-v5", b"umbp-rcap-v5"  # blake2b personalisation: a read grant never passes as a write
_FENCE = b"umbp-fence-v6"  # a slot leader's FENCE (never passes as a capability, nor one as it)
_FENCE_BODY = struct.Struct("<QQ")  # epoch, slots
CLOCK_SKEW_S = 2.0  # metaserver vs node clocks: extents freed young stay held this much past a deadline


def _cap(cap_key: bytes, person: bytes, slots: list, epoch: int, expires_ms: int) -> bytes:
    return _cap_packed(cap_key, person, struct.pack(f"<{3 * len(slots)}Q", *chain.from_iterable(slots)), epoch,
                       expires_ms)


def _cap_packed(cap_key: bytes, person: bytes, packed: bytes, epoch: int, expires_ms: int) -> bytes:
    body = _CAP_HEAD.pack(epoch, expires_ms) + packed
    return body + hashlib.blake2b(body, digest_size=CAP_MAC, key=cap_key, person=person).digest()


def write_capability(cap_key: bytes | None, slots: list, epoch: int, expires_ms: int) -> bytes:
    """The grant to write a batch's allocations on one node: ``epoch | expires_ms | (offset, payload_len, gen) per
    slot | blake2b(cap_key)[:16]``; b"" when the pool is open. ``epoch`` is the issuing metaserver's term (its election
    revision), ``expires_ms`` a wall-clock deadline in ms since the epoch (the metaserver's clock)."""
    if cap_key is None:
        return b""
    return _cap(cap_key, _WRITE, slots, epoch, expires_ms)


_WRITE_MACS: dict[bytes, object] = {}  # cap_key -> its keyed blake2b before any input (copied for each capability)


def write_capabilities_packed(cap_keys: list, epochs: list, packed: bytes, bounds: list, expires_ms: int
                              ) -> list[bytes]:
    """``write_capability`` of each node's run of ``packed`` (slots as little-endian u64 triples): node j (key
    ``cap_keys[j]``, None: b"", epoch ``epochs[j]``) gets the slots in bytes ``bounds[j]`` to ``bounds[j + 1]``. An
    ALLOC makes one a node of its batch, each from a copy of a keyed blake2b state kept per key (keying one is a
    compression block of its own). The same bytes as ``write_capability``."""
    out = []
    macs = _WRITE_MACS
    heads: dict[int, bytes] = {}  # by epoch (a pool's nodes share one, as a rule)
    for key, epoch, a, b in zip(cap_keys, epochs, bounds, bounds[1:]):
        if key is None:
            out.append(b"")
            continue
        mac = macs.get(key)
        if mac is None:
            if len(macs) >= 4096:  # keys of nodes long gone pile up: start again
                macs.clear()
            mac = macs[key] = hashlib.blake2b(digest_size=CAP_MAC, key=key, person=_WRITE)
        head = heads.get(epoch)
        if head is None:
            head = heads[epoch] = _CAP_HEAD.pack(epoch, expires_ms)
        body = head + packed[a:b]
        h = mac.copy()
        h.update(body)
        out.append(body + h.digest())
    return out


def read_capability(cap_key: bytes | None, slots: list) -> bytes:
    """The grant to read a batch's objects on one node (``(offset, payload_len, gen)`` each); b"" when open."""
    if cap_key is None:
        return b""
    return _cap(cap_key, _READ, slots, 0, 0)


def read_capability_packed(cap_key: bytes | None, packed: bytes) -> bytes:
    """``read_capability`` of slots already packed as little-endian u64 triples (a columnar caller packs them in one
    step); the same bytes for the same slots."""
    return read_capabilities_packed([cap_key], packed, [0, len(packed)])[0]


_READ_HEAD = _CAP_HEAD.pack(0, 0)
_READ_MACS: dict[bytes, object] = {}  # cap_key -> its keyed blake2b before any input, copied for each capability
_READ_MACS_MAX = 4096  # node keys kept (a pool's members; cleared past this, as keys of nodes long gone pile up)


def read_capabilities_packed(cap_keys: list, packed: bytes, bounds: list) -> list[bytes]:
    """``read_capability_packed`` of each node's run of ``packed``: node j (its key ``cap_keys[j]``, None for an open
    pool: b"") gets the slots in bytes ``bounds[j]`` to ``bounds[j + 1]``. A LOOKUP makes one a node of its batch;
    each copies a keyed blake2b state kept per key (0.5 us on the 2-core VM) instead of keying a new one (1.3 us:
    the key is a compression block of its own). The same bytes as ``read_capability``."""
    out = []
    macs = _READ_MACS
    for key, a, b in zip(cap_keys, bounds, bounds[1:]):
        if key is None:
            out.append(b"")
            continue
        mac = macs.get(key)
        if mac is None:
            if len(macs) >= _READ_MACS_MAX:
                macs.clear()
            mac = macs[key] = hashlib.blake2b(digest_size=CAP_MAC, key=key, person=_READ)
        body = _READ_HEAD + packed[a:b]
        h = mac.copy()
        h.update(body)
        out.append(body + h.digest())
    return out


def _open(cap_key: bytes, cap: object, person: bytes) -> tuple[int, int, dict] | None:
    """(epoch, expires_ms, {offset: (payload_len, gen)}) of a genuine capability, None for anything else."""
    if type(cap) is not bytes or len(cap) < CAP_MIN or (len(cap) - CAP_MIN) % _SLOT.size:
        return None
    body = cap[:-CAP_MAC]
    if not hmac.compare_digest(cap[-CAP_MAC:], hashlib.blake2b(body, digest_size=CAP_MAC, key=cap_key,
                                                               person=person).digest()):
        return None
    epoch, expires_ms = _CAP_HEAD.unpack_from(body)
    return epoch, expires_ms, {off: (plen, gen) for off, plen, gen in _SLOT.iter_unpack(body[_CAP_HEAD.size:])}


def _check_write(grant: tuple | None, offset: int, payload_len: int, gen: int, min_epoch: int, now_ms: int,
                 component: str) -> int:
    if grant is None or grant[2].get(offset) != (payload_len, gen):
        raise AuthError(component, f"no valid capability to write to the object at {offset}")
    epoch, expires_ms, _ = grant
    if epoch < min_epoch:
        raise AuthError(component, f"stale capability to write to the object at {offset}: issued in metaserver term "
                                   f"{epoch}, before the takeover of term {min_epoch}")
    if now_ms > expires_ms:
        raise AuthError(component, f"expired capability to write to the object at {offset} (expired "
                                   f"{(now_ms - expires_ms) / 1000:.1f}s ago): allocate again")
    return epoch


def fence_token(cap_key: bytes, epoch: int, slots: int) -> bytes:
    """A partitioned pool's new slot leader's FENCE for one node: ``epoch | slots | blake2b(cap_key)[:16]``. The node
    raises the floor of the epoch's slot (``slotrules.epoch_slot``) to ``epoch``, so capabilities of the slot's earlier
    terms die at the takeover; ``slots`` lets it map capability offsets to that slot's region."""
    body = _FENCE_BODY.pack(epoch, slots)
    return body + hashlib.blake2b(body, digest_size=CAP_MAC, key=cap_key, person=_FENCE).digest()


def open_fence(cap_key: bytes, token: object, component: str) -> tuple[int, int]:
    """(epoch, slots) of a genuine FENCE token for this node; AuthError for anything else."""
    if type(token) is not bytes or len(token) != _FENCE_BODY.size + CAP_MAC or not hmac.compare_digest(
            token[-CAP_MAC:], hashlib.blake2b(token[:-CAP_MAC], digest_size=CAP_MAC, key=cap_key,
                                              person=_FENCE).digest()):
        raise AuthError(component, "FENCE: not a fence of this node's metaserver")
    return _FENCE_BODY.unpack_from(token)


def check_write_capability(cap_key: bytes | None, cap: object, offset: int, payload_len: int, gen: int,
                           min_epoch: int, now_ms: int, component: str) -> int:
    """Check that ``cap`` grants writing exactly this allocation; returns its epoch (0 in an open pool). Raises
    AuthError when it is forged, of another node, does not cover this slot and generation, was issued by a metaserver
    term older than ``min_epoch`` (a takeover since), or is past its deadline. Whether the slot was written already
    is the node's check (``NodeServer.check_write``). Stateless: a node checks through ``CapCache``."""
    if cap_key is None:
        return 0
    return _check_write(_open(cap_key, cap, _WRITE), offset, payload_len, gen, min_epoch, now_ms, component)


def check_read_capability(cap_key: bytes | None, cap: object, offset: int, payload_len: int, gen: int,
                          component: str) -> None:
    """Check that ``cap`` grants reading exactly this object (stateless; a node checks through ``CapCache``)."""
    if cap_key is None:
        return
    grant = _open(cap_key, cap, _READ)
    if grant is None or grant[2].get(offset) != (payload_len, gen):
        raise AuthError(component, f"no valid capability to read the object at {offset}")


def with_caps(rows: list, caps: list | None, at: int, component: str = "client") -> list:
    """An ALLOC answer's items (``at`` 6) or a LOOKUP answer's locations (``at`` 5) with each capability index
    replaced by the capability itself: one bytes object per node, so a transport sends it once per frame. Rows
    without one (None, a non-NEW item) are kept. The rows are the answer's own decoded lists, changed in place (a
    new list a row cost a put or get a microsecond a page); an index that names no capability is a ProtocolError."""
    if not caps:
        return rows
    try:
        for r in rows:
            if r is not None and len(r) > at:
                r[at] = caps[r[at]]
    except (IndexError, TypeError) as e:
        raise ProtocolError(component, f"malformed answer: a capability index names none of {len(caps)}") from e
    return rows


class CapCache:
    """One connection's verified capabilities, by their MAC: a batch's capability is verified (MAC, slot list
    parsed) the first time one of its frames arrives, then each object is a dict look-up. A hit also compares the
    whole capability with the verified one, so only bytes that were verified are ever trusted. At most ``limit``
    of each kind are kept (the oldest dropped: it is verified again if it comes back)."""

    __slots__ = ("cap_key", "limit", "_w", "_r", "verified")

    def __init__(self, cap_key: bytes | None, limit: int = CAP_CACHE):
        self.cap_key = cap_key
        self.limit = limit
        self._w: dict[bytes, tuple] = {}
        self._r: dict[bytes, tuple] = {}
        self.verified = 0  # MACs computed (tests: one per batch, not one per object)

    def _grant(self, cap: object, person: bytes, table: dict) -> tuple | None:
        if type(cap) is not bytes or len(cap) < CAP_MIN:
            return None
        mac = cap[-CAP_MAC:]
        hit = table.get(mac)
        if hit is not None and hit[0] == cap:
            return hit[1]
        self.verified += 1
        grant = _open(self.cap_key, cap, person)
        if grant is not None:
            if len(table) >= self.limit:
                del table[next(iter(table))]
            table[mac] = (cap, grant)
        return grant

    def write(self, cap: object, offset: int, payload_len: int, gen: int, min_epoch: int, now_ms: int,
              component: str) -> int:
        """``check_write_capability`` through the cache; returns the epoch (0 in an open pool)."""
        if self.cap_key is None:
            return 0
        return _check_write(self._grant(cap, _WRITE, self._w), offset, payload_len, gen, min_epoch, now_ms,
                            component)

    def read(self, cap: object, offset: int, payload_len: int, gen: int, component: str) -> None:
        """``check_read_capability`` through the cache."""
        if self.cap_key is None:
            return
        grant = self._grant(cap, _READ, self._r)
        if grant is None or grant[2].get(offset) != (payload_len, gen):
            raise AuthError(component, f"no valid capability to read the object at {offset}")
