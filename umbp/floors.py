"""A storage node's slot floors (partitioned pools): per slot, the newest epoch of a slot leader seen, raised by a
leader's FENCE and by newer capabilities of that slot. A write capability of an older epoch of its slot is refused
(a takeover: the deposed leader's grants die), and so is one for bytes outside its slot's region of the arena (slot
leaders never grant another slot's bytes). Kept next to the arena (``{arena}.floors``, JSON, replaced whole) so a node
restarted with the same arena keeps them: a deposed leader's capabilities stay dead across the restart, not only once
the slot leaders re-fence the node. Raised once per slot term per node, so written rarely; O(1) per check.

A floor is also a generation floor (``gen_floor``): a slot leader's epoch carries the first generation of its term,
so a write of a lower generation in the slot, open pools included (they FENCE too, without a MAC), was granted by a
deposed leader. A one-slot pool has one such floor, ``reg``, the REGISTER answer's epoch. The node refuses those
writes (``umbp/node/server.py``), one whose data is still arriving when a floor rises lands no further byte
(``umbp/node/writewatch.py``), and every floor is published in the arena's superblock page (``publish``) for the
writers the node does not see, same-host shm and RDMA, to compare before they write (``objformat.stale_gens``)."""

from __future__ import annotations

import json
import os
import sys

from transport import objformat, slotrules
from umbp.errors import AuthError, BadRequest


class SlotFloors:
    def __init__(self, arena, capacity: int, component: str):
        self.arena_id = arena.arena_id
        self.view = arena.view  # the superblock's page holds the published floors (``publish``)
        self.capacity = capacity
        self.component = component
        self.floors: dict[int, int] = {}
        self.slots = 0  # from a FENCE: maps a capability's offsets to slot regions
        self.version = 0  # bumped whenever a floor rises: a write in flight looks at its generations again
        # A one-slot pool's generation floor: the first generation of the term this node registered in (REGISTER's
        # answer; 0 from a partitioned pool's membership leader, whose slots FENCE their own). A reopened arena keeps
        # its last run's until this run registers.
        self.reg = int(objformat.floor_words(self.view)[0]) if arena.reopened else 0
        self.path = "" if arena.remove_on_close else arena.path + ".floors"
        if arena.reopened:
            self._load()

    def check(self, slot: int, epoch: int, offset: int, nbytes: int) -> None:
        """A partitioned pool's capability, of slot ``slot``'s leader at ``epoch``: refused when the slot has been
        fenced (or written) at a newer epoch since, or when the object is outside the slot's region of this arena;
        else it raises the slot's floor. AuthError naming the stale epoch."""
        floor = self.floors.get(slot, 0)
        if epoch < floor:
            raise AuthError(self.component, f"write capability of slot {slot} at stale epoch {epoch:#x}: the slot "
                                            f"was taken over at epoch {floor:#x} (fenced), its earlier grants are dead")
        if self.slots:
            base, size = slotrules.slot_region(slot, self.slots, self.capacity)
            if offset < base or offset + nbytes > base + size:
                raise AuthError(self.component, f"write capability of slot {slot} for {offset}+{nbytes}: outside "
                                                f"the slot's region [{base}, {base + size})")
        if epoch > floor:
            self.floors[slot] = epoch
            self.version += 1
            self._save()
            self.publish()

    def fence(self, epoch: int, slots: int) -> int:
        """A verified FENCE at ``epoch`` of a ``slots``-slot pool: the slot's floor rises to it. Returns the floor;
        BadRequest when the epoch names no slot of such a pool."""
        slot = slotrules.epoch_slot(epoch)
        if slot is None or not 1 < slots <= 1024 or slot >= slots:
            raise BadRequest(self.component, f"FENCE: epoch {epoch:#x} names no slot of a {slots}-slot pool")
        changed = slots != self.slots or epoch > self.floors.get(slot, 0)
        self.slots = slots
        floor = max(self.floors.get(slot, 0), epoch)
        self.floors[slot] = floor
        if changed:
            self.version += 1
            self._save()
            self.publish()
        return floor

    def gen_floor(self, gen: int) -> int:
        """The first generation the current term of ``gen``'s slot hands out (0: no term known): a write of a lower
        generation was granted by a deposed leader of the slot. A slot leader's epoch is ``SLOT_EPOCH | g``."""
        if self.reg:
            return self.reg
        f = self.floors.get(gen >> slotrules.SLOT_GEN_SHIFT)
        return f & ~slotrules.SLOT_EPOCH if f else 0

    def register(self, floor: int) -> None:
        """REGISTER's answer: the one-slot floor of the term this node registered in (0: a partitioned pool)."""
        self.reg = floor
        self.version += 1
        self.publish()

    def publish(self) -> None:
        """The generation floors into the superblock's page (``objformat.floor_words``), where a same-host shm writer or
        an RDMA writer compares its generations before it writes (``objformat.stale_gens``): raised before the node acks
        them, so no new term's page is placed here before a deposed term's writer would be refused."""
        w = objformat.floor_words(self.view)
        w[0] = self.reg
        for slot, epoch in self.floors.items():
            if slot < objformat.ARENA_FLOOR_SLOTS:
                w[1 + slot] = epoch & ~slotrules.SLOT_EPOCH

    def _load(self) -> None:
        """The floors an earlier run of this node kept for this same arena (none for an unreadable file: the slot
        leaders re-fence a node whose pid changed)."""
        if not self.path:
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                rec = json.load(f)
            if rec.get("arena_id") != self.arena_id.hex():
                return
            slots, floors = int(rec["slots"]), {int(k): int(v) for k, v in rec["floors"].items()}
        except FileNotFoundError:
            return
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            print(f"{self.component}: WARNING: ignoring unreadable slot floors {self.path} ({e})", file=sys.stderr,
                  flush=True)
            return
        self.slots, self.floors = slots, floors

    def _save(self) -> None:
        """Write the floors next to the arena (a new file renamed over the old one). A failure is logged: the floors
        in memory still hold for this run."""
        if not self.path:
            return
        rec = {"arena_id": self.arena_id.hex(), "slots": self.slots,
               "floors": {str(k): v for k, v in self.floors.items()}}
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(rec, f)
            os.replace(tmp, self.path)
        except OSError as e:
            print(f"{self.component}: WARNING: cannot keep slot floors in {self.path}: {e}", file=sys.stderr,
                  flush=True)
