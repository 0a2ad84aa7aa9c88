"""The pool's one form of a page key (``digest_key``), applied by the client before it sends a key
(``umbp.keys.normalize_key``) and by the metaserver to whatever it receives (``metaserver/validate.py``), and read
back from etcd's page names (``metaserver/table/records.py``); ``PackedKeys``, a batch of keys of one length carried
as one bytes value (a keyed request's packed ``keys``: ``transport/wire.py`` ``pack_keys``); ``digests``, a
batch's 32-byte key digests as the metaserver's key index files them and a partitioned pool's slot rule reads them
(``transport/slotrules.py``); and ``digest_blob``, a client's digests of its keys, remembered, as it routes them and
sends a LOOKUP's keys (``wire.pack_keys(digests=True)``).
"""

from __future__ import annotations

import hashlib
from binascii import unhexlify

import numpy as np

KEY32 = 32  # a digest key's length (SGLang's page hash): the keys a packed batch carries


def digest_key(key: bytes) -> bytes:
    """The pool's one form of a digest key: 64 lowercase hex characters become their 32 raw bytes, and a rank key
    ``{64 hex}_{rank}`` (rank 0..255, no leading zeros) the 32 bytes plus one rank byte; every other key is
    returned as it is. So the hex text, its bytes and its raw digest name the same page (a 32- or 33-byte binary
    key is the digest form of its hex text). The client sends this form (``normalize_key``) and the metaserver
    applies it again to whatever it receives (``metaserver/validate.py``): one rule, here, for both sides, so the
    directory keeps 32-byte keys (33 with a rank): 32 bytes less a page than the hex text, and half the bytes on the
    wire. Cost: ~0.3 us for a key of 64..68 bytes, a length check for others."""
    n = len(key)
    if n < 64 or n > 68:
        return key
    if n == 64:
        rank = b""
    elif key[64] == 95 and key[65:].isdigit() and (n == 66 or key[65] != 48) and int(key[65:]) < 256:  # "_"
        rank = bytes((int(key[65:]),))
    else:
        return key
    try:
        raw = unhexlify(key[:64])
    except ValueError:
        return key
    return raw + rank if raw.hex().encode() == key[:64] else key


def digest_forms(keys: list[bytes], lens: list[int]) -> list[bytes]:
    """``[digest_key(k) for k in keys]`` given the keys' lengths, with ``digest_key`` called only for a key that may
    be a digest key's text: 64 bytes, or 65..68 ending in a digit (a rank key, ``{64 hex}_{rank}``). SGLang's page
    names, ``{hash}_{tag}_k``, end in a letter and are their own form: 0.08 against 0.2 us a key."""
    return [digest_key(k) if n == 64 or (64 < n <= 68 and 48 <= k[-1] <= 57) else k for k, n in zip(keys, lens)]


class PackedKeys:
    """``n`` page keys of ``width`` bytes each, back to back in one bytes value ``blob``: how a keyed request carries a
    batch of keys of one length (32: SGLang's page hashes; 67-68: SGLang's page names ``{hash}_{tag}_k``) when its
    sender and the metaserver both speak the packed form (``transport/wire.py`` ``pack_keys``). The same keys as the
    list ``[blob[w * i:w * i + w] for i in range(n)]``, in that order, and a read-only sequence of them (``len``,
    indexing, slices, iteration), so code that reads a list of keys reads this unchanged; ``digests`` is a batch of
    32-byte keys as the directory's key index takes it, an (n, 4) u64 view of ``blob``, with no Python object a key.
    Invariant: ``len(blob) == width * n``, ``width >= 1``.

    Costs: ``digests`` O(1) (a view); a slice O(its bytes) (one bytes slice, still packed); an item or iteration makes
    the key objects once (``tolist``: one numpy call, about 20 ns a key), kept for the next read."""

    __slots__ = ("blob", "n", "width", "_list")

    def __init__(self, blob: bytes, width: int = KEY32):
        if type(blob) is not bytes or type(width) is not int or width < 1 or len(blob) % width:
            raise ValueError(f"packed keys must be bytes of a multiple of their width ({width!r})")
        self.blob = blob
        self.width = width
        self.n = len(blob) // width
        self._list: list[bytes] | None = None

    def __len__(self) -> int:
        return self.n

    def tolist(self) -> list[bytes]:
        """The keys as a list of bytes (made once)."""
        if self._list is None:  # (void items of the width read back as bytes, every byte kept: 2.4 us for 128 keys
            self._list = np.frombuffer(self.blob, (np.void, self.width)).tolist()  # of 32, where slicing took 10-17)
        return self._list

    def __iter__(self):
        return iter(self.tolist())

    def __getitem__(self, i):
        if type(i) is slice:
            a, b, step = i.indices(self.n)
            if step != 1:
                return self.tolist()[i]
            w = self.width
            return PackedKeys(self.blob[w * a:w * max(a, b)], w)
        return self.tolist()[i]

    def pick(self, at: list[int]) -> list[bytes]:
        """``[self[i] for i in at]`` without a method call a key."""
        kl = self.tolist()
        return [kl[i] for i in at]

    def may_hold_digest_text(self) -> bool:
        """Whether a key may be a digest key's text, ``digest_forms``' rule for the batch at once: keys of 64 bytes,
        or of 65..68 with one ending in a digit (one look at the last bytes, a strided view of ``blob``)."""
        w = self.width
        if w == 64:
            return True
        if not 64 < w <= 68:  # (32-byte digests, a LOOKUP's usual keys: no look at the bytes)
            return False
        last = np.frombuffer(self.blob, np.uint8)[w - 1::w]
        return bool(np.count_nonzero((last - 48) < 10))  # (u8: below '0' wraps past 9)

    def digests(self) -> np.ndarray:
        """Keys of 32 bytes as an (n, 4) uint64 array (read-only, a view of ``blob``): each key its own digest."""
        if self.width != KEY32:
            raise ValueError(f"keys of {self.width} bytes are not their own digests")
        return np.frombuffer(self.blob, np.uint64).reshape(self.n, 4)

    def __repr__(self) -> str:
        return f"PackedKeys({self.n} keys of {self.width} bytes)"


def joined_keys(batches: list) -> "list[bytes] | PackedKeys":
    """The keys of several requests as one batch, in turn: ``PackedKeys`` of one blob where every batch is packed
    keys of one width (no key becomes an object), else one list."""
    widths = {k.width for k in batches if type(k) is PackedKeys}
    if len(widths) == 1 and all(type(k) is PackedKeys for k in batches):
        return PackedKeys(b"".join([k.blob for k in batches]), widths.pop())
    out: list[bytes] = []
    for k in batches:
        out += k.tolist() if type(k) is PackedKeys else k
    return out


def pick(keys, at: list[int]) -> list[bytes]:
    """``[keys[i] for i in at]`` of a list of keys or ``PackedKeys`` (whose item is a method call: 0.2 us a key)."""
    if type(keys) is PackedKeys:
        return keys.pick(at)
    return [keys[i] for i in at]


_DIGEST_PERSON = b"umbp-keyindex"
_DIGEST0 = hashlib.blake2b(digest_size=32, person=_DIGEST_PERSON)  # no input yet: ``digests`` copies it a long key


_MEMO: dict[bytes, bytes] = {}  # a key (not of 32 bytes) -> its digest, for ``digest_blob``
MEMO_KEYS = 1 << 16  # keys ``digest_blob`` remembers at most: about 13 MB at keys of 66 bytes
_FULL = [False, 0, 0]  # whether the memory has refused a key in this window; in it: keys found in the memory, long
# keys passed over (no room to remember them). A window ends after 4 x MEMO_KEYS keys passed over.


def digest_blob(keys: list[bytes]) -> bytes:
    """The 32-byte digests (``digests``) of ``keys`` back to back: what a client sends for a LOOKUP's keys
    (``wire.pack_keys(digests=True)``) and routes them by (``umbp/slotrouter.py``). A client asks for the same pages
    turn after turn (a session's prefix), so each long key's blake2b is remembered, up to ``MEMO_KEYS`` keys: a batch
    of remembered keys costs a dict look-up a key (64 keys: about 5 against 30 us to hash them).

    A full memory keeps what it holds and takes no more: a working set larger than the memory, asked for in turn,
    would otherwise be forgotten and refilled on every batch (a memory cleared when full cost 73 us a batch of 64
    short keys over 24,576 keys asked in turn, 2-core VM). Keys it cannot take are hashed all the same and not kept,
    so a LOOKUP carries digests whatever the memory holds: the metaserver, whose CPU every client shares, hashes
    none (keys sent as themselves made it hash each: twice its CPU for a LOOKUP of 1,024 short keys, 2-core VM). It is
    forgotten when, of the keys asked while it was full, the ones it could not take reach four times its size and
    outnumber eight times the ones found in it (the working set moved on; a cycle over more keys than it holds finds
    its keys again)."""
    memo, full = _MEMO, _FULL
    out = list(map(memo.get, keys))
    if None not in out:
        if full[0]:
            full[1] += len(out)
        return b"".join(out)
    miss = [i for i, d in enumerate(out) if d is None]
    longs = sum(len(keys[i]) != 32 for i in miss)  # (a 32-byte key is its own digest: nothing to hash or keep)
    keep = len(memo) + longs <= MEMO_KEYS
    if not keep:
        full[0] = True
        full[1] += len(keys) - len(miss)
        full[2] += longs
        if full[2] > 4 * MEMO_KEYS:  # a window's end: forget the memory if it serves another working set now
            if 8 * full[1] < full[2]:
                memo.clear()
                keep = longs <= MEMO_KEYS
            full[:] = False, 0, 0
    raw = digests([keys[i] for i in miss])[0].tobytes()
    for j, i in enumerate(miss):
        k, d = keys[i], raw[32 * j:32 * j + 32]
        out[i] = d
        if keep and len(k) != 32:
            memo[k] = d
    return b"".join(out)


def memory_stats() -> dict[str, int]:
    """``digest_blob``'s memory as a client's STATS shows it (``umbp.Client.stats``): the keys it holds and may hold,
    and, while full, the keys found in it and the long keys passed over since its window began."""
    full = _FULL
    return {"digest_keys": len(_MEMO), "digest_keys_limit": MEMO_KEYS, "digest_found_full": full[1],
            "digest_passed_full": full[2]}


def digests(keys: list[bytes]) -> tuple[np.ndarray, list[tuple[int, bytes]]]:
    """(n, 4) uint64 digests of ``keys`` and the (position, key) of those that are not 32 bytes long: a 32-byte key is
    its own digest, any other its blake2b from a copy of ``_DIGEST0`` (0.26 us a key of 68 bytes, where a new blake2b
    with its personalisation took 0.43). TypeError where a key is not bytes."""
    if type(keys) is PackedKeys:  # (a request's packed keys: of 32 bytes each its own digest, else all long)
        if keys.width == 32:
            return keys.digests(), []
        keys = keys.tolist()
    n = len(keys)
    joined = b"".join(keys)
    if n and len(joined) == 32 * n and min(map(len, keys)) == 32:  # all 32 bytes (SGLang's digests), at C speed
        return np.frombuffer(joined, np.uint64).reshape(n, 4), []
    copy, raw, longs = _DIGEST0.copy, [], []
    put, mark = raw.append, longs.append
    for i, k in enumerate(keys):
        if len(k) != 32:
            mark((i, k))
            h = copy()
            h.update(k)
            k = h.digest()
        put(k)
    return np.frombuffer(b"".join(raw), np.uint64).reshape(n, 4), longs
