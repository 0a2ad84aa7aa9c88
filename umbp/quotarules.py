"""Quota groups: which namespaces share one byte quota and one optional reservation, read from the tokens file
(umbp/auth.py parses it; the metaserver enforces it: metaserver/table/quotas.py). Sans-I/O; a leaf module.

A *group* is a set of namespaces whose use (object sizes of their READY and PENDING pages) is counted together
against one quota. Groups come from two places of the tokens file:

- ``[quotas]``: key = an exact namespace or an fnmatch pattern -> size. Each key is one group, named by the key: the
  namespaces a pattern matches share its quota (``"tenant-q/*" = "1GiB"`` caps them together, not each).
- a token's ``quota = SIZE``: one group, named ``token:<name>``, of every namespace the token may write (its rw
  patterns). An admin token takes no quota (it may write everything: a ConfigError).

Which group a namespace belongs to (``group_of``): an exact name first (a ``[quotas]`` key before a token's rw name),
then the patterns in order: the ``[quotas]`` patterns in file order, then the rw patterns of the tokens with a quota,
tokens in file order; none: no quota. A namespace's group
follows from its name alone, whoever writes it: a token with a quota cannot escape it through a pattern grant (every
namespace it may write is in some group), and pages another token writes into a namespace of the group count against
that group (give tokens with a quota patterns of their own).

Reservations (``[reservations]``: key -> size, optional): a floor for the group the key names, a ``[quotas]`` key or
one of the rw patterns of a token with a quota (that token's group); a key that names no group, or a reservation
above its group's quota, is a ConfigError. Global eviction (another group's ALLOC into a full pool, the background
watermark pass, an operator's EVICT of bytes) passes over a group's pages while taking one would leave the group
below its reservation; the group's own quota eviction and an operator's ``EVICT --all`` do not. The sum of the
reservations cannot be checked against the pool's capacity when the file is read (nodes come and go), so it is
clamped where it is enforced: a directory honours reservations up to half its capacity in total, each scaled down in
proportion when they add up to more (``floor``).

Partitioned pools (``shared(parts)``): each slot leader counts its own slot's pages and enforces ``quota // parts``
and ``reservation // parts`` of every group. What it approximates: a group's keys hash uniformly over the slots, so
the pool-wide use stays at most the quota (each slot at most its share), but a group is refused in a slot whose share
is full while another slot still has room in its share; with many slots and a small quota a share may hold fewer
pages than one batch. Exact pool-wide counting would take a cross-slot round per ALLOC; not built.

Costs: ``group_of`` one dict probe for a namespace seen before (a bounded cache), else one fnmatch per pattern.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace

from umbp.errors import ConfigError
from umbp.sizes import parse_size

RESOLVED_CACHE = 65536  # namespaces whose group is remembered (the cache is emptied when full)
RESERVE_SHARE = 0.5  # at most this share of a directory's capacity is held back by reservations in total
_WILD = frozenset("*?[")


@dataclass(frozen=True, eq=False)
class QuotaGroup:
    """One quota group. ``quota``/``reserve``: pool-wide bytes; ``limit``/``floor``: this directory's share of them
    (a partitioned pool's slot: divided by the slots)."""

    name: str
    quota: int
    reserve: int = 0
    patterns: tuple[str, ...] = ()
    limit: int = field(default=-1)
    floor: int = field(default=-1)

    def __post_init__(self):
        if self.limit < 0:
            object.__setattr__(self, "limit", self.quota)
        if self.floor < 0:
            object.__setattr__(self, "floor", self.reserve)


class QuotaRules:
    """Namespace -> quota group (see the module docstring). Falsy when there are no groups; iterating yields the
    group names."""

    def __init__(self, groups: list[QuotaGroup], parts: int = 1):
        self.groups = list(groups)
        self.parts = parts
        self.by_name = {g.name: g for g in self.groups}
        self._exact: dict[str, QuotaGroup] = {}
        self._patterns: list[tuple[str, QuotaGroup]] = []
        for g in self.groups:
            for p in g.patterns:
                if _WILD.isdisjoint(p):
                    self._exact.setdefault(p, g)
                else:
                    self._patterns.append((p, g))
        self.reserved = sum(g.floor for g in self.groups)  # this directory's reservations, before clamping
        self._cache: dict[str, QuotaGroup | None] = {}

    @classmethod
    def of(cls, quotas: "QuotaRules | dict[str, int] | None") -> "QuotaRules":
        """Rules from rules (as they are) or a plain ``[quotas]``-like dict (key -> bytes: a group per key)."""
        if isinstance(quotas, QuotaRules):
            return quotas
        return cls([QuotaGroup(k, q, patterns=(k,)) for k, q in (quotas or {}).items()])

    def __bool__(self) -> bool:
        return bool(self.groups)

    def __iter__(self):
        return iter(self.by_name)

    def __len__(self) -> int:
        return len(self.groups)

    def exact_names(self) -> set[str]:
        """The namespaces some group names exactly (not by a pattern)."""
        return set(self._exact)

    def group_of(self, ns: str) -> QuotaGroup | None:
        """The group namespace ``ns`` belongs to (None: no quota)."""
        c = self._cache
        try:
            return c[ns]
        except KeyError:
            pass
        g = self._exact.get(ns)
        if g is None:
            for p, pg in self._patterns:
                if fnmatch.fnmatchcase(ns, p):
                    g = pg
                    break
        if len(c) >= RESOLVED_CACHE:
            c.clear()
        c[ns] = g
        return g

    def floor(self, g: QuotaGroup, capacity: int) -> int:
        """Group ``g``'s reservation in a directory of ``capacity`` bytes: its ``floor``, scaled down in proportion
        when the floors add up to more than RESERVE_SHARE of the capacity."""
        cap = int(capacity * RESERVE_SHARE)
        if self.reserved <= cap:
            return g.floor
        return g.floor * cap // self.reserved

    def shared(self, parts: int) -> "QuotaRules":
        """These rules for one of ``parts`` slot leaders: every limit and floor divided by ``parts``."""
        if parts <= 1:
            return self
        return QuotaRules([replace(g, limit=g.quota // parts, floor=g.reserve // parts) for g in self.groups], parts)


def quota_size(value: object, what: str, component: str) -> int:
    """A size of the tokens file (``"512MiB"`` or an int of bytes); a ConfigError whose message starts with ``what``."""
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ConfigError(component, f"{what}: expected a size like \"512MiB\" or an integer of bytes, got {value!r}")
    try:
        return parse_size(value, what)
    except ConfigError as e:
        raise ConfigError(component, e.detail) from None


def _table(table: object, name: str, tokens_file: str, component: str) -> dict[str, int]:
    if not isinstance(table, dict):
        raise ConfigError(component, f"{tokens_file}: {name} must be a table ([{name}]) of namespace = size")
    out = {}
    for ns, size in table.items():
        if not ns or len(ns.encode()) > 128:
            raise ConfigError(component, f"{tokens_file}: {name}: namespace {ns!r} must be 1..128 bytes")
        out[ns] = quota_size(size, f"{tokens_file}: {name}.{ns!r}", component)
    return out


def parse_quotas(table: object, tokens_file: str, component: str) -> dict[str, int]:
    """``[quotas]``: namespace or fnmatch pattern -> size (``"512MiB"`` or an int of bytes)."""
    return _table(table, "quotas", tokens_file, component)


def build_rules(quotas: dict[str, int], token_quotas: list[tuple[str, int, tuple[str, ...]]],
                reservations: object, tokens_file: str, component: str) -> QuotaRules:
    """The groups of a tokens file: ``quotas`` (``parse_quotas``), ``token_quotas`` (token name, bytes, its rw
    patterns) in file order, ``reservations`` the raw ``[reservations]`` table. ConfigError for a reservation that
    names no group or exceeds its group's quota."""
    groups = {k: QuotaGroup(k, q, patterns=(k,)) for k, q in quotas.items()}
    by_pattern = dict(groups)
    for name, q, patterns in token_quotas:
        gname = f"token:{name}"
        groups[gname] = QuotaGroup(gname, q, patterns=patterns)
        for p in patterns:
            by_pattern.setdefault(p, groups[gname])
    for key, r in _table(reservations, "reservations", tokens_file, component).items():
        g = by_pattern.get(key)
        if g is None:
            raise ConfigError(component, f"{tokens_file}: reservations.{key!r}: names no quota group (a reservation "
                                         f"is for a [quotas] key, or an rw pattern of a token with a quota)")
        if r > g.quota:
            raise ConfigError(component, f"{tokens_file}: reservations.{key!r}: {r} bytes is more than the quota of "
                                         f"its group {g.name!r} ({g.quota} bytes)")
        if g.reserve:
            raise ConfigError(component, f"{tokens_file}: reservations.{key!r}: group {g.name!r} already has a "
                                         f"reservation")
        groups[g.name] = replace(g, reserve=r, floor=-1)
        for p in groups[g.name].patterns:
            if by_pattern.get(p) is g:
                by_pattern[p] = groups[g.name]
    return QuotaRules(list(groups.values()))
