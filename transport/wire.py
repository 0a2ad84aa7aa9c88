"""The UMBP wire format: frames, opcodes, status codes, packed keys. No I/O.

Every connection in UMBP (client -> metaserver, node -> metaserver, client -> node) carries the same frames::

     0        2     3     4        6        8           12          16                      24
     +--------+-----+-----+--------+--------+-----------+-----------+-----------------------+
     | magic  | ver | op  | flags  | status | request_id| meta_len  | data_len              |
     | u16    | u8  | u8  | u16    | u16    | u32       | u32       | u64                   |
     +--------+-----+-----+--------+--------+-----------+-----------+-----------------------+
     | meta: meta_len bytes of msgpack (a map or a list; bytes stay bytes, str stays str)   |
     +--------------------------------------------------------------------------------------+
     | data: data_len raw bytes (page payloads; never msgpack-encoded, never copied twice)   |
     +--------------------------------------------------------------------------------------+

Little-endian. ``flags``: RESPONSE (every answer), NO_REPLY (lease releases). An answer carries its request's id
and opcode; a ``status`` other than OK comes with ``{"error": "<component>: <message>", ...}``. HELLO then AUTH
(``umbp/auth.py``) open a connection; a closed server answers anything else before them with AUTH. A reader
(``FrameReader``) enforces magic, version and size limits (a peer's announcement allocates at most ``buffer_data``,
0 in the metaserver and node); a malformed header poisons the connection, bad meta gets an error answer.

Batched node ops (READV, WRITEV): see ``Op``; only failed objects are listed, so a reader knows the data's layout up
front. The packed rows of LOOKUP, ALLOC, DEMOTE and PROMOTE metas are ``transport/answerrows.py``'s, the object
header and the arena and disk superblocks ``transport/objformat.py``'s: these three modules are the only places that
pack bytes.

Costs: ``encode`` one struct and one msgpack pack; ``FrameReader`` copies header and meta once, payloads not at all
(but bytes that arrive with their frame's header).
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from transport import keyform
from umbp.errors import (AuthError, BadRequest, CorruptionError, FrameTooLarge, NotFound, NotLeader, PoolFull,
                         ProtocolError, QuotaExceeded, RemoteError, Unavailable)

MAGIC = 0x4D55  # b"UM" little-endian
# Versions: docs/operations/upgrades.md (12: LOOKUP and ALLOC answers as packed rows, ``answerrows.LOC_ROW`` and
# ``ALLOC_ROW``). A reader takes VERSION and MIN_VERSION, a server answers a frame in its version
# (tests/test_wire_compat.py). The disk tier's opcodes (READV_DISK, DEMOTE, PROMOTE) are additive within 12: older peers
# never send them, a node without them answers UNKNOWN_OPCODE. A keyed request's keys of one length packed into one
# bytes value (``pack_keys``) are additive within 12 too: a client packs them only for a metaserver whose HELLO answer
# says ``"packed_keys": true``, and such a metaserver takes either form. So are a LOOKUP's, EXISTS' or PREFIX's keys
# sent as their 32-byte digests (``pack_keys(digests=True)``): only to a metaserver whose HELLO answer says
# ``"digest_keys": true`` (an older one would file a long key's read tag from its digest at the first LOOKUP after a
# load: its readers would then miss).
VERSION = 12
MIN_VERSION = VERSION - 1
HEADER = struct.Struct("<HBBHHIIQ")
HEADER_SIZE = HEADER.size  # 24

MAX_META = 16 << 20  # default reader limit for msgpack meta
MAX_DATA = 1 << 30  # default reader limit for raw data
BUFFER_DATA = 1 << 20  # default: frame data up to this size, with no sink memory for it, lands in a fresh buffer
MAX_KEY_BYTES = 512  # a page key, UTF-8 encoded when given as str
MAX_VEC_OPS = 4096  # objects in one READV/WRITEV frame


class Flag(enum.IntFlag):
    NONE = 0
    RESPONSE = 1
    NO_REPLY = 2


# The flags as plain ints, for the per-frame tests: ``frame.flags & Flag.RESPONSE`` (an int and an IntFlag) builds an
# enum value, about 1 us on CPython 3.11 against 40 ns for two ints.
F_RESPONSE, F_NO_REPLY = int(Flag.RESPONSE), int(Flag.NO_REPLY)


class Op(enum.IntEnum):
    """Opcodes. 0x0_: any server; 0x1_/0x2_: metaserver; 0x4_: storage node."""

    HELLO = 0x01  # {"client": str, "nonce": bytes} -> {"server", "version", "auth": bool, "nonce": bytes}
    PING = 0x02  # {} -> {}
    AUTH = 0x03  # {"id": str, "proof": bytes} -> {"scope": str, "proof": bytes}   (umbp/auth.py)
    # metaserver: membership
    REGISTER_NODE = 0x10  # node description -> {"heartbeat_s": float, "kept": int, "dropped": int}
    HEARTBEAT = 0x11  # {"node_id"} -> {} (NOT_FOUND: register again)
    # metaserver: data plane
    ALLOC = 0x12  # {"ns", "keys", "sizes", "parents"?, "token"? (a retry: the same places)} -> {"nodes", "caps":
    #               [write_cap a node], "rows": ALLOC_ROWs} (v11: "items": [[state, node, off, size, gen, tag, cap]]);
    #               within 12, additive: "write_until_ms" (wall-clock ms by which every write of its places must
    #               have landed: sent on as WRITE/WRITEV's until_ms; a shm writer checks it before each copy)
    COMMIT = 0x13  # {"ns", "keys", "gens"} -> {"ok": [bool]}
    ABORT = 0x14  # {"ns", "keys", "gens", "written"?} -> {"aborted": int}
    LOOKUP = 0x15  # {"ns", "keys"} -> {"lease", "lease_ms", "nodes", "caps": [read_cap a node], "rows": LOC_ROWs}
    #                (VERSION 11: "locs": [[node, off, size, gen, tag, cap_index] | None]); within 12, additive:
    #                "release"?: [lease ids] released before the lookup, answered "released": n (a client sends
    #                the field only to a metaserver whose last answer carried "released": umbp/releases.py)
    RELEASE = 0x16  # {"lease": int} -> {} (usually NO_REPLY)
    EXISTS = 0x17  # {"ns", "keys"} -> {"exists": [bool]}
    PREFIX = 0x18  # {"ns", "keys"} -> {"hits": int}
    REMOVE = 0x19  # {"ns", "keys"} -> {"removed": [bool]}
    # metaserver: admin
    STATS = 0x1A  # {} -> stats map (docs/operations/monitoring.md)
    NODES = 0x1B  # {} -> {"nodes": [node map]}
    LIST = 0x1C  # {"ns"?, "limit"?} -> {"objects": [[ns, key, size, node, state]], "truncated": bool}
    EVICT = 0x1D  # {"bytes"?: int} -> {"evicted": int, "freed_bytes": int}
    DRAIN = 0x1E  # {"node_id"} -> {"dropped": int, "pinned": int}
    LEADER = 0x1F  # {} -> {"leader": "host:port" | None, "is_leader": bool} and, from a partitioned pool,
    #               "slots": S, "map": [leader address | None per slot], "members": [metaserver address]
    # storage node
    ARENA_INFO = 0x40  # {} -> arena map (node_id, arena_id, arena_path, capacity, boot_id, host, transports)
    READ = 0x41  # [off, start, length, tag, gen, payload_len, read_cap] -> data: header + payload[start:+length]
    WRITE = 0x42  # [off, gen, write_cap, until_ms?] + data: object header + payload -> {}
    RDMA_CONNECT = 0x43  # queue-pair details -> queue-pair details (transport/rdma.py)
    # Batched: up to MAX_VEC_OPS objects a frame; the answer's meta lists the failed ones ([[index, status, message]])
    READV = 0x44  # [[off, start, length, tag, gen, payload_len, read_cap], ...] -> failures; data: each op that
    #               did not fail, in order: its object header + payload[start:+length] (read_cap b"": the previous's)
    WRITEV = 0x45  # [[off, gen, write_cap, nbytes], ...] + data: the ops' bytes back to back -> failures (a failed
    #                op's bytes are discarded, the others land; write_cap b"": the previous op's); within 12,
    #                additive: a 5th field until_ms (the ALLOC answer's write_until_ms): a node receives no byte
    #                of the frame into its arena past the earliest one (the rest discarded, those ops UNAVAILABLE)
    FENCE = 0x46  # fence token (umbp/auth.py) -> {"floor": int}: a new slot leader raises its slot's write-capability
    #               epoch floor on the node before serving it (no AUTH: only a holder of the cap_key makes one)
    # The disk tier (umbp/node/disk.py, umbp/node/tiering.py). Additive: a node without them answers UNKNOWN_OPCODE
    # (a miss for a reader, a failed batch for the metaserver), so VERSION stays; peers that never send them see no
    # change. READV_DISK is READV's layout, ``off`` a disk address (``DISK_BIT`` | offset in the node's disk file, as
    # capabilities name it too): an old node refuses the opcode instead of reading DRAM at a disk offset.
    READV_DISK = 0x47  # [[disk_addr, start, length, tag, gen, payload_len, read_cap], ...] -> as READV
    # Metaserver only (the cluster secret; anyone in an open pool): copy objects between a node's tiers, TIER_ROWs
    # packed in "rows" (at most MAX_VEC_OPS); each source header is checked before its bytes are copied; the copy's
    # header lands last, so a torn copy never reads as valid. Answer meta: failures as READV's ([[row, status, msg]]).
    DEMOTE = 0x48  # {"rows": TIER_ROWs} DRAM -> disk -> failures | None
    PROMOTE = 0x49  # {"rows": TIER_ROWs} disk -> DRAM -> failures | None


class AllocState(enum.IntEnum):
    """An ALLOC item's state: NEW carries a place ``[NEW, node, off, size, gen]``, the others none."""

    NEW = 0  # allocated for this writer: write the bytes there, then COMMIT
    EXISTS = 1  # someone already stored (or is storing) this key: dedup, nothing to write
    NO_SPACE = 2  # no space even after eviction (everything evictable is leased or pending)
    IN_FLIGHT = 3  # another writer holds this key PENDING: wait for it (READY) or for it to go away, then retry


class Status(enum.IntEnum):
    OK = 0
    BAD_FRAME = 1
    UNKNOWN_OPCODE = 2
    BAD_REQUEST = 3
    TOO_LARGE = 4
    NOT_FOUND = 5
    POOL_FULL = 6
    NOT_LEADER = 7
    UNAVAILABLE = 8
    CORRUPT = 9
    AUTH = 10
    INTERNAL = 11
    QUOTA = 12  # a namespace over its quota (umbp.errors.QuotaExceeded)


_STATUS_ERRORS: dict[int, type[RemoteError]] = {
    Status.BAD_REQUEST: BadRequest, Status.UNKNOWN_OPCODE: BadRequest, Status.TOO_LARGE: BadRequest,
    Status.BAD_FRAME: BadRequest, Status.NOT_FOUND: NotFound, Status.POOL_FULL: PoolFull, Status.NOT_LEADER: NotLeader,
    Status.UNAVAILABLE: Unavailable, Status.AUTH: AuthError, Status.QUOTA: QuotaExceeded}


@dataclass(slots=True)
class Frame:
    op: int
    flags: int
    status: int
    request_id: int
    meta: Any
    data: memoryview | None
    data_len: int


_packer_opts = dict(use_bin_type=True)


def unpack_meta(raw: bytes | memoryview, component: str) -> Any:
    """Decode msgpack meta; a malformed map is a BadRequest naming ``component``."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError, TypeError) as e:
        raise BadRequest(component, f"malformed msgpack meta: {e}", Status.BAD_REQUEST) from e


def encode(op: int, request_id: int, meta: Any = None, *, data_len: int = 0, flags: int = 0,
           status: int = 0, version: int = VERSION) -> bytes:
    """Header plus msgpack meta of one frame; the sender writes ``data_len`` raw bytes after it. ``version``: a
    server's answer carries the version of the request it answers (``FrameReader.version``)."""
    body = b"" if meta is None else msgpack.packb(meta, **_packer_opts)
    return HEADER.pack(MAGIC, version, op, flags, status, request_id & 0xFFFFFFFF, len(body), data_len) + body


PACKED_KEYS = "packed_keys"  # a metaserver's HELLO answer field: true when it takes packed keys (``pack_keys``)
DIGEST_KEYS = "digest_keys"  # and true when its DIGEST_OPS take each key as its digest (``pack_keys(digests=True)``)
DIGEST_OPS = frozenset({Op.LOOKUP, Op.EXISTS, Op.PREFIX})  # keyed requests that only find keys: a digest names one


def pack_keys(meta: Any, digests: bool = False) -> Any:
    """A keyed request's meta with its ``keys`` packed: when every key has one length w (32: SGLang's page hashes;
    67-68: its page names ``{hash}_{tag}_k``), the list becomes one bytes value of them back to back, plus
    ``"key_width": w`` when w is not 32; the metaserver reads it as ``transport.keyform.PackedKeys`` (no msgpack object
    or validation step a key, and for w = 32 no digest step either). Any other ``meta`` is returned as it is. Only for
    a metaserver whose HELLO answer carried ``PACKED_KEYS`` (one that does not would refuse it: BAD_REQUEST). A new
    dict: the caller's meta is left as it was (it may be sent again, to another metaserver).

    ``digests`` (a ``DIGEST_OPS`` request to a metaserver whose HELLO answer carried ``DIGEST_KEYS``): keys of any
    lengths (each 1..MAX_KEY_BYTES bytes) go as their 32-byte digests (``keyform.digest_blob`` of their digest
    forms): the directory files a key by its digest, so the metaserver finds the same rows without a hash a key
    (blake2b: a quarter of its LOOKUP's CPU at keys of 66 bytes), and the bytes sent are 32 a key. Keys the client's
    memory of digests does not hold are hashed here (``digest_blob``), kept or not: the metaserver's CPU is the
    pool's to share, the clients' is each their own."""
    keys = meta.get("keys") if type(meta) is dict else None
    if type(keys) is not list or not keys:
        return meta
    try:
        blob = b"".join(keys)
    except TypeError:
        return meta  # not bytes: sent as a list, refused by the metaserver's validation as before
    lens = list(map(len, keys))
    w, hi = min(lens), max(lens)
    if not 0 < w or hi > MAX_KEY_BYTES:
        return meta  # sent as a list: the metaserver refuses the key by name
    out = dict(meta)
    if digests and not w == hi == 32:
        out["keys"] = keyform.digest_blob(keyform.digest_forms(keys, lens))
        return out
    if w != hi:
        return meta
    out["keys"] = blob
    if w != 32:
        out["key_width"] = w
    return out


def encode_error(op: int, request_id: int, status: int, message: str, *, version: int = VERSION,
                 **extra: Any) -> bytes:
    meta = {"error": message}
    meta.update(extra)
    return encode(op, request_id, meta, flags=Flag.RESPONSE, status=status, version=version)


def decode_header(buf: bytes | memoryview, component: str,
                  max_meta: int = MAX_META, max_data: int = MAX_DATA) -> tuple[int, int, int, int, int, int]:
    """Return (op, flags, status, request_id, meta_len, data_len); ProtocolError when the stream is unframeable."""
    if len(buf) < HEADER_SIZE:
        raise ProtocolError(component, f"frame header of {len(buf)} bytes, expected {HEADER_SIZE}")
    magic, version, op, flags, status, rid, meta_len, data_len = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ProtocolError(component, f"bad frame magic 0x{magic:04x} (expected 0x{MAGIC:04x}): not a UMBP peer?")
    if not MIN_VERSION <= version <= VERSION:
        raise ProtocolError(component, f"unsupported wire version {version} (this side speaks {MIN_VERSION} to "
                                       f"{VERSION}: upgrade metaservers first, then nodes, then clients)")
    if meta_len > max_meta:
        raise FrameTooLarge(component, f"frame meta of {meta_len} bytes exceeds the limit of {max_meta}")
    if data_len > max_data:
        raise FrameTooLarge(component, f"frame data of {data_len} bytes exceeds the limit of {max_data}")
    return op, flags, status, rid, meta_len, data_len


def raise_for_status(frame: Frame, component: str) -> None:
    """Turn an error response into the matching RemoteError subclass (message from the server, named by it)."""
    if frame.status == Status.OK:
        return
    meta = frame.meta if isinstance(frame.meta, dict) else {}
    message = str(meta.get("error", f"error status {frame.status}"))
    if _STATUS_ERRORS.get(frame.status) is NotLeader:
        raise NotLeader(component, message, frame.status, leader=meta.get("leader"))
    raise error_for_status(frame.status, message, component)


def error_for_status(status: int, message: str, component: str) -> RemoteError | CorruptionError:
    """The exception for one error status (a whole answer's, or one op's in a READV/WRITEV answer)."""
    if status == Status.CORRUPT:
        return CorruptionError(component, message)
    return _STATUS_ERRORS.get(status, RemoteError)(component, message, status)


def vec_failures(meta: Any, nops: int, component: str) -> dict[int, RemoteError | CorruptionError]:
    """The failed ops of a READV/WRITEV answer (``meta`` None: none failed), by index. ProtocolError when the
    list is malformed (the stream can then no longer be trusted)."""
    if meta is None:
        return {}
    out = {}
    if isinstance(meta, list):
        for item in meta:
            if (isinstance(item, list) and len(item) == 3 and type(item[0]) is int and 0 <= item[0] < nops
                    and type(item[1]) is int and item[1] != Status.OK):
                out[item[0]] = error_for_status(item[1], str(item[2]), component)
            else:
                break
        else:
            return out
    raise ProtocolError(component, "malformed failure list in a batched answer")


# A sink decides where a frame's data goes: given (op, request_id, meta, data_len) it returns a writable memoryview
# of exactly data_len bytes, None for a fresh buffer, or a scatter list of memoryviews (filled in order) and ints
# (bytes discarded) adding up to data_len; or it raises RemoteError to refuse all of it (reported with the frame).
Sink = Callable[[int, int, Any, int], "memoryview | list | None"]


class FrameReader:
    """Incremental, zero-copy-for-data frame parser for ``asyncio.BufferedProtocol`` or blocking ``recv_into``.

    Use: ``buf = reader.get_buffer()``; receive into it; ``frames = reader.buffer_updated(n)``, ``(frame, error)``
    pairs in stream order. Header and meta land in a staging buffer; data in what ``sink`` returns (the node's arena
    slots), else a fresh buffer when ``data_len <= buffer_data``, else it is discarded by counting (``data=None`` and
    a BadRequest); data that went to a scatter list comes back as ``data=None``.
    Memory: the staging buffer (``bufsize``, doubled only once full of bytes that arrived: a trickle of a huge
    announced meta cannot inflate it) plus at most ``buffer_data`` for one frame.
    """

    def __init__(self, component: str, *, max_meta: int = MAX_META, max_data: int = MAX_DATA,
                 sink: Sink | None = None, bufsize: int = 64 * 1024, buffer_data: int = BUFFER_DATA):
        self.component = component
        self.max_meta = max_meta
        self.max_data = max_data
        self.buffer_data = buffer_data
        self._sink = sink
        self._buf = bytearray(bufsize)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._need = HEADER_SIZE  # bytes needed in staging before the next parse step can make progress
        self._pending: tuple | None = None  # (op, flags, status, rid, meta, data_len) while receiving data
        self._pieces: list = []  # where the data of the frame in progress goes: views and discard counts
        self._pi = 0  # the piece being filled
        self._data: memoryview | None = None  # the piece being filled, when it is memory
        self._data_pos = 0
        self._skip = 0  # bytes of the current (discarded) piece still to drop: no memory is allocated for them
        self._fdata: memoryview | None = None  # the frame's data as handed back (one view; None when scattered)
        self._data_error: Exception | None = None
        self._own = 0  # bytes of the data buffer this reader allocated for the frame in progress
        # a malformed header after good frames of the same read: they are returned, the caller answers this and closes
        self.poisoned: ProtocolError | None = None
        self.version = VERSION  # the wire version of the last frame parsed: a server answers in it

    @property
    def buffered(self) -> int:
        """Bytes of memory this reader holds (staging plus any data buffer of its own)."""
        return len(self._buf) + self._own

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        if self._data is not None:
            return self._data[self._data_pos:]
        if self._skip:
            return _DISCARD[:min(self._skip, len(_DISCARD))]
        if self._start == self._end:
            self._start = self._end = 0
        room = len(self._buf) - self._end
        if room < 4096 or self._start + self._need > len(self._buf):
            # Move the unparsed tail to the front; grow (by doubling) only when the tail fills the buffer.
            tail = self._end - self._start
            if self._need > len(self._buf) and len(self._buf) - tail < 4096:
                newbuf = bytearray(min(max(2 * len(self._buf), 4096), self._need + 4096))
                newbuf[:tail] = self._mv[self._start:self._end]
                self._buf, self._mv = newbuf, memoryview(newbuf)
            else:
                self._mv[:tail] = self._mv[self._start:self._end]
            self._start, self._end = 0, tail
        return self._mv[self._end:]

    def buffer_updated(self, nbytes: int) -> list[tuple[Frame, Exception | None]]:
        """Account for ``nbytes`` received into the last buffer; return the frames completed (with any error)."""
        out: list[tuple[Frame, Exception | None]] = []
        if self._pending is not None:
            if self._data is not None:
                self._data_pos += nbytes
                if self._data_pos < len(self._data):
                    return out
            else:
                self._skip -= nbytes
                if self._skip:
                    return out
            self._pi += 1
            if self._load_piece():
                return out
            out.append(self._finish_data())
        else:
            self._end += nbytes
        try:
            self._parse(out)
        except ProtocolError as e:
            if not out:
                raise
            self.poisoned = e
        return out

    def divert(self) -> int:
        """Send the rest of the data of the frame in progress to scratch, counted as refused data is (a server's
        answer to a write past its deadline: the connection stays in sync, no further byte lands where the sink
        said). Returns the index of the first piece not received whole, or -1 when no frame's data is arriving."""
        if self._pending is None:
            return -1
        i = self._pi
        pieces = [p if type(p) is int else len(p) for p in self._pieces]
        pieces[i] = self._skip if self._data is None else len(self._data) - self._data_pos
        self._pieces, self._fdata = pieces, None
        self._load_piece()
        return i

    def _load_piece(self) -> bool:
        """Make the next non-empty piece current; False when the frame's data is complete."""
        pieces = self._pieces
        while self._pi < len(pieces):
            p = pieces[self._pi]
            if type(p) is int:
                if p:
                    self._data, self._skip = None, p
                    return True
            elif len(p):
                self._data, self._data_pos, self._skip = p, 0, 0
                return True
            self._pi += 1
        self._data, self._skip = None, 0
        return False

    def _finish_data(self) -> tuple[Frame, Exception | None]:
        op, flags, status, rid, meta, data_len = self._pending
        data, err = self._fdata, self._data_error
        self._pending, self._data, self._data_pos, self._skip, self._data_error = None, None, 0, 0, None
        self._pieces, self._pi, self._fdata = [], 0, None
        self._own = 0
        if err is not None:
            data = None
        return Frame(op, flags, status, rid, meta, data, data_len), err

    def _parse(self, out: list) -> None:
        while self._pending is None:
            avail = self._end - self._start
            if avail < HEADER_SIZE:
                self._need = HEADER_SIZE
                return
            op, flags, status, rid, meta_len, data_len = decode_header(
                self._mv[self._start:self._start + HEADER_SIZE], self.component, self.max_meta, self.max_data)
            self.version = self._buf[self._start + 2]
            if avail < HEADER_SIZE + meta_len:
                self._need = HEADER_SIZE + meta_len
                return
            mstart = self._start + HEADER_SIZE
            self._start = mstart + meta_len
            self._need = HEADER_SIZE
            err: Exception | None = None
            meta: Any = None
            if meta_len:
                try:
                    meta = unpack_meta(self._mv[mstart:mstart + meta_len], self.component)
                except BadRequest as e:
                    err = e
            if data_len == 0:
                out.append((Frame(op, flags, status, rid, meta, None, 0), err))
                continue
            target = None
            if err is None and self._sink is not None:
                try:
                    target = self._sink(op, rid, meta, data_len)
                except RemoteError as e:
                    err = e
            if target is None and err is None:
                if data_len <= self.buffer_data:
                    target = memoryview(bytearray(data_len))
                    self._own = data_len
                else:
                    err = BadRequest(self.component, f"opcode {op} does not take {data_len} bytes of data",
                                     Status.TOO_LARGE)
            if target is None:
                pieces = [data_len]
            elif type(target) is list:
                if sum(p if type(p) is int else len(p) for p in target) != data_len:
                    raise ProtocolError(self.component, "sink returned pieces of the wrong total size")
                pieces = target
            else:
                if len(target) != data_len:
                    raise ProtocolError(self.component, "sink returned a buffer of the wrong size")
                pieces = [target]
                self._fdata = target
            self._pending = (op, flags, status, rid, meta, data_len)
            self._data_error = err
            self._pieces, self._pi = pieces, 0
            self._load_piece()
            # Data of this frame already in staging: copy (or drop) it into its pieces, in order.
            pos, left = self._start, min(self._end - self._start, data_len)
            self._start += left
            while left:
                if self._data is not None:
                    n = min(left, len(self._data) - self._data_pos)
                    self._data[self._data_pos:self._data_pos + n] = self._mv[pos:pos + n]
                    self._data_pos += n
                    done = self._data_pos == len(self._data)
                else:
                    n = min(left, self._skip)
                    self._skip -= n
                    done = not self._skip
                pos += n
                left -= n
                if done:
                    self._pi += 1
                    if not self._load_piece():
                        break
            if self._data is None and not self._skip:
                out.append(self._finish_data())


_DISCARD = memoryview(bytearray(1 << 16))  # scratch for refused data, shared: its bytes are never read


# A LOOKUP answer's read lease in ms when it does not say (``lease_ms``: version 11 servers, 10 s by default): a
# tcp/rdma read finished later than this after the LOOKUP counts as a miss (its object may have been rewritten).
DEFAULT_LEASE_MS = 10_000
