"""Packed keys (``transport.keyform.PackedKeys``, ``transport.wire.pack_keys``): a keyed request's 32-byte keys carried
as one bytes value. They must name exactly the pages the list form names, and a client must pack them only for a
metaserver that said it takes them (its HELLO answer), since an older one refuses them."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import numpy as np
import pytest

from metaserver import validate as v
from metaserver.ha import multislot
from transport import slotrules, wire
from transport.keyform import PackedKeys, digests, pick
from transport.wire import HEADER, HEADER_SIZE, Flag, Op
from umbp.metaclient import MetaClient

KEYS = [bytes(32), b"\x00" * 31 + b"\x01", b"\x01" + bytes(31)] + [os.urandom(32) for _ in range(13)]


def test_packed_keys_read_as_the_list_they_pack():
    p = PackedKeys(b"".join(KEYS))
    assert len(p) == len(KEYS) and list(p) == KEYS and p.tolist() == KEYS  # NUL bytes kept, at either end
    assert [p[i] for i in range(-len(KEYS), len(KEYS))] == KEYS + KEYS
    with pytest.raises(IndexError):
        p[len(KEYS)]
    for a, b in ((0, 5), (3, 16), (7, 2), (-4, None), (None, None)):
        part = p[a:b]
        assert type(part) is PackedKeys and list(part) == KEYS[a:b]
    assert p[1:12:3] == KEYS[1:12:3]
    assert pick(p, [5, 0, 5]) == [KEYS[5], KEYS[0], KEYS[5]] == pick(KEYS, [5, 0, 5])
    dig, longs = digests(p)
    assert longs == [] and np.array_equal(dig, digests(KEYS)[0])  # the key index reads the same digests
    with pytest.raises(ValueError):
        PackedKeys(b"x" * 33)


def test_packed_keys_of_another_width_read_as_their_list_and_hash_as_it():
    names = [(os.urandom(32).hex() + "__k").encode() for _ in range(9)] + [b"\x00" * 67]  # SGLang's MLA page names
    p = PackedKeys(b"".join(names), 67)
    assert len(p) == 10 and list(p) == names and list(p[2:7]) == names[2:7] and p[2:7].width == 67
    assert not p.may_hold_digest_text()  # SGLang's names end in a letter: their own form
    assert PackedKeys(b"".join(n[:64] + b"_7" for n in names[:9]), 66).may_hold_digest_text()  # rank keys' text
    assert PackedKeys(b"a" * 128, 64).may_hold_digest_text() and not PackedKeys(b"a9" * 50, 100).may_hold_digest_text()
    dig, longs = digests(p)
    want, want_longs = digests(names)
    assert np.array_equal(dig, want) and longs == want_longs == list(enumerate(names))
    with pytest.raises(ValueError, match="not their own digests"):
        p.digests()
    with pytest.raises(ValueError):
        PackedKeys(b"x" * 68, 67)


def test_pack_keys_packs_only_batches_of_32_byte_keys_and_leaves_the_callers_meta():
    meta = {"ns": "a", "keys": list(KEYS), "sizes": [1] * len(KEYS)}
    packed = wire.pack_keys(meta)
    assert packed is not meta and meta["keys"] == KEYS  # the caller's meta as it was (it may be sent again)
    assert packed == {"ns": "a", "keys": b"".join(KEYS), "sizes": [1] * len(KEYS)}  # 32 bytes: no width said
    names = [b"n" * 67, b"m" * 67]
    assert wire.pack_keys({"ns": "a", "keys": names}) == {"ns": "a", "keys": b"".join(names), "key_width": 67}
    for keys in ([], KEYS[:3] + [b"k" * 31, b"k" * 33], [b"k" * 33, b"k" * 32], KEYS[:2] + ["x" * 32], [b""],
                 [b"k" * (wire.MAX_KEY_BYTES + 1)]):
        m = {"ns": "a", "keys": keys}
        assert wire.pack_keys(m) is m, keys
    assert wire.pack_keys({"lease": 3}) == {"lease": 3} and wire.pack_keys(None) is None


def test_pack_keys_sends_a_finding_requests_keys_as_their_digests_only_when_asked_and_valid():
    """``digests``: keys of any lengths (1..MAX_KEY_BYTES) go as the 32-byte digests of their digest forms, which
    the directory files them by; a batch of 32-byte keys is its own digests; keys the metaserver must refuse by name
    (empty, too long, not bytes) go as before. The metaclient asks for digests for LOOKUP, EXISTS and PREFIX only,
    and only of a metaserver that said ``digest_keys``."""
    from umbp import metaclient

    hexes = [os.urandom(32).hex().encode() for _ in range(3)]
    keys = [b"s1", b"a" * 66, b"b" * 200, hexes[0], hexes[1] + b"_12", KEYS[0]]
    forms = [b"s1", b"a" * 66, b"b" * 200, bytes.fromhex(hexes[0].decode()), bytes.fromhex(hexes[1].decode()) + b"\x0c",
             KEYS[0]]
    meta = {"ns": "a", "keys": list(keys)}
    got = wire.pack_keys(meta, digests=True)
    assert got == {"ns": "a", "keys": digests(forms)[0].tobytes()} and meta["keys"] == keys
    assert got["keys"][32 * 3:32 * 4] == forms[3] and got["keys"][-32:] == KEYS[0]  # own digests: themselves
    assert wire.pack_keys({"keys": list(KEYS)}, digests=True) == {"keys": b"".join(KEYS)}
    for bad in ([b"ok", b""], [b"ok", b"k" * (wire.MAX_KEY_BYTES + 1)], [b"ok", "str"]):
        m = {"ns": "a", "keys": bad}
        assert wire.pack_keys(m, digests=True) is m, bad

    class Conn:
        packed_keys, digest_keys = True, True

    for op, dig in ((Op.LOOKUP, True), (Op.EXISTS, True), (Op.PREFIX, True), (Op.ALLOC, False), (Op.REMOVE, False),
                    (Op.COMMIT, False)):
        assert metaclient._packed(Conn, op, {"keys": [b"k" * 40]}) == (
            {"keys": digests([b"k" * 40])[0].tobytes()} if dig else {"keys": b"k" * 40, "key_width": 40}), op
    Conn.digest_keys = False  # a metaserver that did not say digest_keys: its tags would come from the digests
    assert metaclient._packed(Conn, Op.LOOKUP, {"keys": [b"k" * 40]}) == {"keys": b"k" * 40, "key_width": 40}


def test_digest_blob_is_the_digests_remembered_within_its_bound(monkeypatch):
    """``keyform.digest_blob``: the digests of any keys back to back, the same whether remembered or not; a long
    key's is remembered (a 32-byte key is its own) while there is room. A full memory keeps what it holds: keys it
    cannot take are hashed but not kept, and a LOOKUP's packing still carries digests (the metaserver hashes none);
    it is forgotten only once the keys it could not take far outnumber those found in it."""
    from transport import keyform

    monkeypatch.setattr(keyform, "MEMO_KEYS", 8)
    monkeypatch.setattr(keyform, "_MEMO", {})
    monkeypatch.setattr(keyform, "_FULL", [False, 0, 0])
    keys = [b"k%d" % i for i in range(5)] + [KEYS[3]]
    want = digests(keys)[0].tobytes()
    assert keyform.digest_blob(keys) == want and sorted(keyform._MEMO) == sorted(keys[:5])
    assert keyform.digest_blob(keys[::-1]) == digests(keys[::-1])[0].tobytes()  # remembered, in the order asked
    more = [b"m%d" % i for i in range(4)]
    assert keyform.digest_blob(keys[:2] + more) == digests(keys[:2] + more)[0].tobytes()
    assert sorted(keyform._MEMO) == sorted(keys[:5])  # 5 + 4 > 8: hashed, not kept; the memory kept as it was
    # a LOOKUP's packing: digests, remembered or not (keys the memory cannot take hashed all the same)
    assert wire.pack_keys({"keys": keys[:5]}, True) == {"keys": digests(keys[:5])[0].tobytes()}
    assert wire.pack_keys({"keys": more}, True) == {"keys": digests(more)[0].tobytes()}
    assert sorted(keyform._MEMO) == sorted(keys[:5])
    fill = [b"r%d" % i for i in range(3)]  # room for 3 more: taken
    assert keyform.digest_blob(fill) == digests(fill)[0].tobytes() and len(keyform._MEMO) == 8
    # found again and again: kept, however many keys pass it by
    for i in range(40):
        assert keyform.digest_blob(keys[:5]) == digests(keys[:5])[0].tobytes()
        assert keyform.digest_blob([b"p%d" % i]) == digests([b"p%d" % i])[0].tobytes()
    assert sorted(keyform._MEMO) == sorted(keys[:5] + fill)
    # the working set moved on: forgotten once 4 x 8 keys it could not take outnumber 8 x those found in it
    for i in range(100):
        got = keyform.digest_blob([b"q%d" % i])
        assert got == digests([b"q%d" % i])[0].tobytes()
        if b"q%d" % i in keyform._MEMO:
            break
    assert 30 < i < 100 and list(keyform._MEMO) == [b"q%d" % i]
    keyform._MEMO[b"k0"] = bytes(32)  # (a remembered digest is the one sent: the memory is read, not hashed again)
    assert keyform.digest_blob([b"k0"]) == bytes(32)


def test_the_metaserver_unpacks_whole_keys_only_and_keeps_the_key_limit():
    m = {"ns": "a", "keys": b"".join(KEYS)}
    v.unpack_keys(m)
    assert type(m["keys"]) is PackedKeys and list(v.keys(m, 100)) == KEYS
    with pytest.raises(v.Reject, match="more than the limit of 10"):
        v.keys(m, 10)
    with pytest.raises(v.Reject, match="packed keys of 32 bytes each: 33 bytes is not a whole number of them"):
        v.unpack_keys({"ns": "a", "keys": b"k" * 33})
    for bad in (0, 513, "5", None):
        with pytest.raises(v.Reject, match="key_width must be an integer 1..512"):
            v.unpack_keys({"ns": "a", "keys": b"k" * 10, "key_width": bad})
    listed = {"ns": "a", "keys": list(KEYS), "key_width": 5}
    v.unpack_keys(listed)
    assert listed["keys"] == KEYS and listed["key_width"] == 5  # a list stays a list (the width left for refusal)


@pytest.mark.parametrize("width", [64, 66, 67, 68])
def test_packed_keys_that_may_be_digest_text_take_the_digest_form_a_listed_key_takes(width):
    hexes = [os.urandom(32).hex() for _ in range(6)]
    tail = {64: "", 66: "_7", 67: "__k", 68: "_200"}[width]
    keys = [(h + tail).encode() for h in hexes]
    keys[1] = keys[1].upper()  # not a digest's text (upper case): kept as it is, packed or listed
    m = {"ns": "a", "keys": b"".join(keys), "key_width": width}
    v.unpack_keys(m)
    want = v.keys({"ns": "a", "keys": list(keys)}, 100)
    assert list(v.keys(m, 100)) == want
    assert (type(m["keys"]) is PackedKeys) == (width == 67)  # ends in a letter: the name is its own form
    if width != 67:
        assert want[0] == bytes.fromhex(hexes[0]) + (bytes((int(tail[1:]),)) if tail else b"") and want[1] == keys[1]


def test_a_multi_slot_request_with_packed_keys_splits_as_its_list_and_checks_each_keys_slot():
    slots = 4
    by_slot: dict[int, list[bytes]] = {}
    for k, s in zip(KEYS, slotrules.slots_of("ns", KEYS, slots).tolist()):
        by_slot.setdefault(s, []).append(k)
    order = sorted(by_slot)
    keys = [k for s in order for k in by_slot[s]]
    meta = {"ns": "ns", "keys": keys, "sizes": list(range(len(keys))), "parts": [[s, len(by_slot[s])] for s in order]}
    want = multislot.split(meta, slots)
    packed = dict(meta)
    packed["keys"] = b"".join(keys)
    v.unpack_keys(packed)
    got = multislot.split(packed, slots)
    assert [(s, list(m["keys"]), m["sizes"]) for s, m in got] == [(s, m["keys"], m["sizes"]) for s, m in want]
    assert all(type(m["keys"]) is PackedKeys for _, m in got)
    # an ALLOC part holding a key of another slot is refused, packed as listed (an entry lives in its key's slot)
    wrong = dict(packed, parts=[[order[0], len(keys)]])
    with pytest.raises(v.Reject, match=f"is not of slot {order[0]}"):
        multislot.split(wrong, slots)


class _ScriptedMetaserver:
    """A peer on a real loopback socket that answers HELLO (saying it takes packed keys, or not) and EXISTS (every
    key present), and keeps each EXISTS meta as it arrived."""

    def __init__(self, packed: bool):
        self.packed = packed
        self.seen: list = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(10)
        conn, _ = self.sock.accept()
        with conn:
            conn.settimeout(10)
            for _ in range(10):  # HELLO and a few requests at most
                head = self._exactly(conn, HEADER_SIZE)
                if head is None:
                    return
                _m, _ver, op, _fl, _st, rid, meta_len, _dl = HEADER.unpack(head)
                meta = msgpack.unpackb(self._exactly(conn, meta_len), raw=False)
                if op == Op.HELLO:
                    ans = {"server": "metaserver", "version": wire.VERSION, "auth": False, "nonce": bytes(32)}
                    if self.packed:
                        ans[wire.PACKED_KEYS] = True
                else:
                    self.seen.append(meta)
                    keys = meta["keys"]
                    n = len(keys) // meta.get("key_width", 32) if type(keys) is bytes else len(keys)
                    ans = {"exists": [True] * n}
                conn.sendall(wire.encode(op, rid, ans, flags=Flag.RESPONSE))

    @staticmethod
    def _exactly(conn: socket.socket, n: int) -> bytes | None:
        out = bytearray()
        while len(out) < n:
            chunk = conn.recv(n - len(out))
            if not chunk:
                return None
            out += chunk
        return bytes(out)


@pytest.mark.parametrize("packed", [True, False])
def test_a_client_packs_keys_only_for_a_metaserver_that_said_it_takes_them(packed):
    peer = _ScriptedMetaserver(packed)
    mc = MetaClient([peer.addr], "test")
    deadline = time.monotonic() + 10
    meta = {"ns": "a", "keys": list(KEYS)}
    assert mc.call(Op.EXISTS, meta, deadline) == {"exists": [True] * len(KEYS)}
    assert mc.call(Op.EXISTS, {"ns": "a", "keys": [b"short", b"longer"]}, deadline) == {"exists": [True, True]}
    names = [(os.urandom(32).hex() + "__k").encode() for _ in range(5)]
    assert mc.call(Op.EXISTS, {"ns": "a", "keys": names}, deadline) == {"exists": [True] * 5}
    mc.close()
    assert meta["keys"] == KEYS  # the caller's request untouched
    assert peer.seen[2] == ({"ns": "a", "keys": b"".join(names), "key_width": 67} if packed
                            else {"ns": "a", "keys": names})
    assert peer.seen[0]["keys"] == (b"".join(KEYS) if packed else KEYS)
    assert peer.seen[1]["keys"] == [b"short", b"longer"]  # not of one length: a list either way
