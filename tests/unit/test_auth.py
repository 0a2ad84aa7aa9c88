"""Unit tests of umbp/auth.py's tokens file (strict validation, quotas) and the client's refusal of a downgrade."""

from __future__ import annotations

import os

import numpy as np
import pytest

from transport import objformat
from umbp.auth import ClientAuth, Tokens, rank_tags, token_id, with_caps
from umbp.errors import AuthError, ConfigError, ProtocolError

SECRET = "cluster-secret-0123456789"
A = "tenant-a-secret-0123456789"
B = "tenant-b-secret-0123456789"


def load(tmp_path, text: str | bytes, token: str | None = None) -> Tokens:
    path = tmp_path / "tokens.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return Tokens.load(token, str(path), "metaserver")


def test_a_good_file_loads_scopes_and_quotas(tmp_path):
    t = load(tmp_path, f'''cluster_secret = "{SECRET}"
[[tokens]]
name = "a"
secret = "{A}"
namespaces = {{ "tenant-a" = "rw" }}
[[tokens]]
name = "ops"
secret = "{B}"
admin = true
[quotas]
"tenant-a" = "512MiB"
"tenant-b" = 4096
"big" = "1.5GiB"
''')
    assert t.closed and t.quotas == {"tenant-a": 512 << 20, "tenant-b": 4096, "big": 3 << 29}
    scope_a = t._by_id[token_id(A.encode())][1]
    scope_ops = t._by_id[token_id(B.encode())][1]
    assert (scope_a.name, scope_a.admin, scope_a.right("tenant-a"), scope_a.right("x")) == ("a", False, "rw", "")
    assert (scope_ops.name, scope_ops.admin) == ("ops", True)


def test_no_quotas_table_and_open_pools_have_none(tmp_path):
    assert load(tmp_path, f'cluster_secret = "{SECRET}"\n').quotas == {}
    assert Tokens.load(None, None, "node").quotas == {}
    assert Tokens.load(SECRET, None, "node").quotas == {}


@pytest.mark.parametrize("admin", ['"false"', '"true"', "1", "0", '""'])
def test_admin_must_be_a_boolean(tmp_path, admin):
    """``admin = "false"`` granted admin (a non-empty string is true)."""
    with pytest.raises(ConfigError, match=r"tokens\[0\] \(name 'x'\): admin must be a boolean"):
        load(tmp_path, f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = "x"\nsecret = "{A}"\nadmin = {admin}\n')


def test_admin_false_is_not_admin(tmp_path):
    t = load(tmp_path, f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = "x"\nsecret = "{A}"\nadmin = false\n')
    assert t._by_id[token_id(A.encode())][1].admin is False


def test_duplicate_secret_is_an_error_naming_both_entries(tmp_path):
    """A duplicate secret silently took the later entry's scope (a read token became rw *)."""
    text = f'''cluster_secret = "{SECRET}"
[[tokens]]
name = "reader"
secret = "{A}"
namespaces = {{ "a" = "r" }}
[[tokens]]
name = "writer"
secret = "{A}"
namespaces = {{ "*" = "rw" }}
'''
    with pytest.raises(ConfigError, match=r"tokens\[1\] \(name 'writer'\): its secret is the same as tokens\[0\]'s"):
        load(tmp_path, text)


def test_a_token_equal_to_the_cluster_secret_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tokens\[0\] \(name 'r'\): its secret is the same as cluster_secret's"):
        load(tmp_path, f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = "r"\nsecret = "{SECRET}"\n'
                       f'namespaces = {{ "a" = "r" }}\n')


def test_duplicate_name_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"tokens\[1\] \(name 'x'\): name 'x' is already used by tokens\[0\]"):
        load(tmp_path, f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = "x"\nsecret = "{A}"\n'
                       f'[[tokens]]\nname = "x"\nsecret = "{B}"\n')


@pytest.mark.parametrize("text,match", [
    (f'cluster_secret = "{SECRET}"\n[[token]]\nname = "x"\nsecret = "{A}"\n', r"unknown top-level keys \['token'\]"),
    (f'cluster_secret = "{SECRET}"\nquota = {{ a = 1 }}\n', r"unknown top-level keys \['quota'\]"),
    (f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = "x"\nsecret = "{A}"\nnamespace = {{ a = "rw" }}\n',
     r"tokens\[0\] \(name 'x'\): unknown fields \['namespace'\]"),
    (f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = "x"\nsecret = "{A}"\nadmn = true\n',
     r"tokens\[0\] \(name 'x'\): unknown fields \['admn'\]"),
    (f'cluster_secret = "{SECRET}"\ntokens = "x"\n', r"tokens must be an array of tables"),
    (f'cluster_secret = "{SECRET}"\n[[tokens]]\nname = 3\nsecret = "{A}"\n', r"tokens\[0\]: name must be"),
    (f'cluster_secret = "{SECRET}"\n[quotas]\na = "lots"\n', r"quotas.'a': expected a size like 512MiB"),
    (f'cluster_secret = "{SECRET}"\n[quotas]\na = -1\n', r"quotas.'a': size must not be negative"),
    (f'cluster_secret = "{SECRET}"\n[quotas]\na = true\n', r"quotas.'a': expected a size"),
    (f'cluster_secret = "{SECRET}"\nquotas = 5\n', r"quotas must be a table"),
])
def test_unknown_keys_and_bad_values_are_errors(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        load(tmp_path, text)
    assert str(e.value).startswith("metaserver: ") and "tokens.toml" in str(e.value)


def test_non_utf8_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"metaserver: cannot read tokens file .*tokens.toml: not UTF-8"):
        load(tmp_path, b'cluster_secret = "\xff\xfe-0123456789abcdef"\n')


def test_client_with_a_token_refuses_an_open_server():
    """The downgrade: auth false (or missing) from the server is refused by a client holding a token."""
    for hello in ({"server": "metaserver", "auth": False, "nonce": os.urandom(32)}, {"server": "node"}, None,
                  {"auth": 1}):
        with pytest.raises(AuthError, match=r"did not ask for authentication .* \(downgrade"):
            ClientAuth(A, "client").auth_meta(hello)
    # without a token an open server is fine; a closed one needs the token
    assert ClientAuth(None, "client").auth_meta({"auth": False}) is None
    with pytest.raises(AuthError, match="requires a token"):
        ClientAuth(None, "client").auth_meta({"auth": True, "nonce": os.urandom(32)})
    meta = ClientAuth(A, "client").auth_meta({"auth": True, "nonce": os.urandom(32)})
    assert set(meta) == {"id", "proof"} and meta["id"] == token_id(A.encode())


def test_tags_are_wire_key_hash_in_an_open_pool_and_keyed_in_a_closed_one():
    keys = [b"a", b"\xff" * 32, "k".encode() * 64]
    open_pool, closed = Tokens(None, {}), Tokens(b"cluster-secret-0123456789", {})
    assert open_pool.tags("ns", keys) == [objformat.key_hash("ns", k) for k in keys]
    assert [open_pool.tag("ns", k) for k in keys] == open_pool.tags("ns", keys)
    tagged = closed.tags("ns", keys)
    assert tagged == [closed.tag("ns", k) for k in keys]
    assert not set(tagged) & {objformat.key_hash("ns", k) for k in keys}  # not computable from public fields
    assert closed.tags("other", keys) != tagged  # the namespace is part of it


def test_rank_tags_differ_per_rank_from_plain_tags_and_come_from_the_shard_bases():
    keys = [b"\x01" * 32, b"\x02" * 32, b"k" * 40]
    for tokens in (Tokens(None, {}), Tokens(b"cluster-secret-0123456789", {})):
        plain = tokens.tags("ns", keys)
        per_rank = [tokens.tags("ns", keys, r) for r in range(8)]
        every = set(plain).union(*per_rank)
        assert len(every) == 9 * len(keys)  # no two (key, rank) and no plain key share a tag
        bases = np.array(tokens.shard_bases("ns", keys), np.uint64)
        assert all(per_rank[r] == rank_tags(bases, r).tolist() for r in range(8))
        assert not set(bases.tolist()) & every  # the base itself is never handed out as a tag
        assert tokens.tags("other", keys, 3) != per_rank[3]
    assert rank_tags(np.array([2**64 - 1], np.uint64), 255).dtype == np.uint64  # wraps, never overflows


def test_with_caps_puts_each_rows_capability_in_place_and_refuses_an_index_naming_none():
    caps = [b"cap-node-a", b"cap-node-b"]
    items = [[0, "a", 0, 10, 7, 99, 1], [1], [0, "b", 4096, 10, 8, 98, 0], None]
    rows = list(items)
    assert with_caps(items, caps, 6) is items
    assert items == [[0, "a", 0, 10, 7, 99, b"cap-node-b"], [1], [0, "b", 4096, 10, 8, 98, b"cap-node-a"], None]
    assert all(a is b for a, b in zip(items, rows))  # the decoded lists themselves, no copies
    assert with_caps([[0, "a", 0, 10, 7, 99, 0]], [], 6) == [[0, "a", 0, 10, 7, 99, 0]]  # open pool: kept
    for bad in (2, -3, "x", None):
        with pytest.raises(ProtocolError, match="capability index"):
            with_caps([["a", 0, 10, 7, 99, bad]], caps, 5)
