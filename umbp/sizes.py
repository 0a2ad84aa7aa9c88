"""Parsing and printing byte sizes: ``512MiB``, ``4GiB``, ``1.5GB``, plain bytes.

Binary suffixes (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB) powers of 1000; ``K``, ``M``,
``G``, ``T`` alone are read as binary, which is what operators writing ``--capacity 4G`` mean. A leaf module.
"""

from __future__ import annotations

import re

from umbp.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 1000,
    "m": 1 << 20, "mib": 1 << 20, "mb": 1000 ** 2,
    "g": 1 << 30, "gib": 1 << 30, "gb": 1000 ** 3,
    "t": 1 << 40, "tib": 1 << 40, "tb": 1000 ** 4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int, what: str = "size") -> int:
    """Return the number of bytes ``text`` names; raise ConfigError naming ``what`` if it is not a size."""
    if isinstance(text, bool):
        raise ConfigError("config", f"{what}: expected a size like 512MiB, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError("config", f"{what}: size must not be negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError("config", f"{what}: expected a size like 512MiB, 4GiB or plain bytes, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int | float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
