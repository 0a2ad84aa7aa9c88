"""The pool's one form of a page key (``digest_key``), applied by the client before it sends a key
(``umbp.keys.normalize_key``) and by the metaserver to whatever it receives (``metaserver/validate.py``), and read
back from etcd's page names (``metaserver/table/records.py``).
"""

from __future__ import annotations

from binascii import unhexlify


def digest_key(key: bytes) -> bytes:
    """The pool's one form of a digest key: 64 lowercase hex characters become their 32 raw bytes, and a rank key
    ``{64 hex}_{rank}`` (rank 0..255, no leading zeros) the 32 bytes plus one rank byte; every other key is
    returned as it is. So the hex text, its bytes and its raw digest name the same page (a 32- or 33-byte binary
    key is the digest form of its hex text). The client sends this form (``normalize_key``) and the metaserver
    applies it again to whatever it receives (``metaserver/validate.py``): one rule, here, for both sides, so the directory keeps 32-byte keys
    (33 with a rank): 32 bytes less a page than the hex text, and half the bytes on the wire. Cost: ~0.3 us for a
    key of 64..68 bytes, a length check for others."""
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
