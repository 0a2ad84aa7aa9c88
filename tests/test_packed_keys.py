"""Packed keys against real metaservers (``transport.wire.pack_keys``; the metaserver's ``validate.unpack_keys``): a
metaserver says in its HELLO answer that it takes a keyed request's 32-byte keys as one bytes value, answers them
exactly as it answers the same keys listed, refuses a value that is not whole keys with an error naming it (and goes
on serving), and keeps a partitioned pool's rule that an ALLOC's keys belong to the slot it names. Today's clients
pack (tests/unit/test_keyform_packed.py shows they do only for such a metaserver); their puts and gets of digest keys go
through it here, on one slot and on several."""

from __future__ import annotations

import os

import numpy as np
import pytest

from transport import answerrows, slotrules, wire
from transport.wire import Op, Status
from tests.test_wire_compat import Raw

pytestmark = pytest.mark.timeout(180)


def read_all(c, keys: list[bytes], size: int) -> list[bytes | None]:
    """Every key's bytes (None for a miss) by one ``batch_get_into`` (a get batch: one LOOKUP, packed)."""
    outs = [bytearray(size) for _ in keys]
    got = c.batch_get_into(keys, outs)
    return [None if n < 0 else bytes(o[:n]) for n, o in zip(got, outs)]


def hello(raw: Raw) -> dict:
    version, status, answer, _ = raw.exchange(wire.encode(Op.HELLO, 1, {"client": "test", "nonce": os.urandom(32)}))
    assert (version, status) == (wire.VERSION, Status.OK)
    return answer


def ask(raw: Raw, op: int, meta: dict, rid: int = 7) -> tuple[int, dict]:
    _version, status, answer, _ = raw.exchange(wire.encode(op, rid, meta))
    return status, answer


def test_packed_keys_name_the_pages_their_list_names(make_cluster):
    cl = make_cluster(nodes=2)
    keys = [bytes(32), b"\x00" * 31 + b"\x07"] + [os.urandom(32) for _ in range(62)]
    values = {k: os.urandom(5000 + i) for i, k in enumerate(keys)}
    with cl.client(namespace="packed") as c:
        c.batch_put(keys[:48], [values[k] for k in keys[:48]])  # packed by the client (the HELLO said so)
    raw = Raw(cl.metaserver_addr)
    assert hello(raw)[wire.PACKED_KEYS] is True
    blob = b"".join(keys)
    status, listed = ask(raw, Op.EXISTS, {"ns": "packed", "keys": keys})
    assert status == Status.OK and listed == {"exists": [True] * 48 + [False] * 16}
    assert ask(raw, Op.EXISTS, {"ns": "packed", "keys": blob}) == (Status.OK, listed)
    assert ask(raw, Op.PREFIX, {"ns": "packed", "keys": blob}) == (Status.OK, {"hits": 48})

    answers = []
    for form in (keys, blob):
        status, ans = ask(raw, Op.LOOKUP, {"ns": "packed", "keys": form})
        assert status == Status.OK and ans["lease"]
        answers.append(ans)
        assert ask(raw, Op.RELEASE, {"lease": ans["lease"]}) == (Status.OK, {})
    a, b = (np.frombuffer(x["rows"], answerrows.LOC_ROW) for x in answers)
    assert len(a) == 64 and a.tobytes() == b.tobytes()  # the same rows, key by key (node, offset, length, gen, tag)
    assert answers[0]["nodes"] == answers[1]["nodes"]
    assert int(np.count_nonzero(a["node"] != answerrows.NO_NODE)) == 48

    # REMOVE packed: the named pages go, the others stay readable, byte for byte
    assert ask(raw, Op.REMOVE, {"ns": "packed", "keys": b"".join(keys[40:50])}) == (
        Status.OK, {"removed": [True] * 8 + [False] * 2})
    with cl.client(namespace="packed") as c:
        assert read_all(c, keys, 6000) == [values[k] for k in keys[:40]] + [None] * 24


def test_packed_page_names_of_one_length_name_the_pages_their_list_names(make_cluster):
    cl = make_cluster(nodes=1)
    names = [(os.urandom(32).hex() + "__k").encode() for _ in range(20)]  # SGLang's MLA page names: 67 bytes
    ranked = [os.urandom(32).hex().encode() + b"_3" for _ in range(4)]  # rank keys: their digest form, 33 bytes
    values = {k: os.urandom(4000) for k in names + ranked}
    with cl.client(namespace="names") as c:
        c.batch_put(names[:12] + ranked[:2], [values[k] for k in names[:12] + ranked[:2]])
        assert read_all(c, names + ranked, 4000) == [values[k] for k in names[:12]] + [None] * 8 + [
            values[k] for k in ranked[:2]] + [None] * 2
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    for keys, width, want in ((names, 67, [True] * 12 + [False] * 8), (ranked, 66, [True, True, False, False])):
        status, listed = ask(raw, Op.EXISTS, {"ns": "names", "keys": keys})
        assert (status, listed) == (Status.OK, {"exists": want})
        assert ask(raw, Op.EXISTS, {"ns": "names", "keys": b"".join(keys), "key_width": width}) == (Status.OK, listed)
        rows = []
        for form in ({"keys": keys}, {"keys": b"".join(keys), "key_width": width}):
            status, ans = ask(raw, Op.LOOKUP, dict(form, ns="names"))
            assert status == Status.OK
            rows.append(ans["rows"])
            assert ask(raw, Op.RELEASE, {"lease": ans["lease"]}) == (Status.OK, {})
        assert rows[0] == rows[1] and len(rows[0]) == len(keys) * answerrows.LOC_ROW.itemsize


def test_packed_keys_that_are_not_whole_keys_are_refused_by_name_and_the_metaserver_serves_on(make_cluster):
    cl = make_cluster(nodes=1)
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    status, ans = ask(raw, Op.LOOKUP, {"ns": "bad", "keys": b"k" * 33})
    assert status == Status.BAD_REQUEST
    assert "packed keys of 32 bytes each: 33 bytes is not a whole number of them" in ans["error"]
    status, ans = ask(raw, Op.EXISTS, {"ns": "bad", "keys": b"k" * 10, "key_width": 0})
    assert status == Status.BAD_REQUEST and "key_width must be an integer 1..512" in ans["error"]
    status, ans = ask(raw, Op.EXISTS, {"ns": "bad", "keys": [b"k"], "key_width": 1})  # a width without packed keys
    assert status == Status.BAD_REQUEST and "unknown field 'key_width'" in ans["error"]
    assert ans["error"].startswith("metaserver")
    n = 100_001  # one past the metaserver's default max_batch_keys
    status, ans = ask(raw, Op.ALLOC, {"ns": "bad", "keys": bytes(32 * n), "sizes": [1] * n})
    assert status == Status.BAD_REQUEST and "more than the limit" in ans["error"]
    status, ans = ask(raw, Op.COMMIT, {"ns": "bad", "keys": b"k" * 64, "gens": [1]})
    assert status == Status.BAD_REQUEST and "gens has 1 items, keys has 2" in ans["error"]
    key = os.urandom(32)
    with cl.client(namespace="bad") as c:
        c.put(key, b"still serving")
        assert c.get(key) == b"still serving"


def test_a_partitioned_pool_takes_packed_keys_and_keeps_each_alloc_in_its_keys_slot(make_cluster):
    slots = 4
    cl = make_cluster(nodes=2, metaserver_flags={"slots": slots})
    keys = [os.urandom(32) for _ in range(64)]
    values = [os.urandom(3000) for _ in keys]
    with cl.client(namespace="parts") as c:
        c.batch_put(keys, values)  # one request a process, its parts' keys packed
        assert read_all(c, keys, 3000) == values
    of = slotrules.slots_of("parts", keys, slots).tolist()
    s = of[0]
    other = next(k for k, x in zip(keys, of) if x != s)
    raw = Raw(cl.metaserver_addr)
    hello(raw)
    fresh = os.urandom(32)
    while slotrules.slots_of("parts", [fresh], slots)[0] != s:
        fresh = os.urandom(32)
    status, ans = ask(raw, Op.ALLOC, {"ns": "parts", "keys": fresh + other, "sizes": [100, 100], "slot": s})
    assert status == Status.BAD_REQUEST and f"key 1 is not of slot {s}" in ans["error"]
    status, ans = ask(raw, Op.EXISTS, {"ns": "parts", "keys": fresh, "slot": s})
    assert (status, ans) == (Status.OK, {"exists": [False]})  # the refused ALLOC placed nothing
