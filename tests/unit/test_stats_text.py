"""``umbp stats``' text for a partitioned pool (``umbp.cli._print_stats``): the slot map's rows, and the note a pool
made with many slots a metaserver gets (each slot a request's keys fall in costs its leader a table pass)."""

from __future__ import annotations

from umbp import cli


def _stats(slots: int, processes: int) -> dict:
    addrs = [f"10.0.0.{i + 1}:7700" for i in range(processes)]
    slot_map = [addrs[s % processes] for s in range(slots)]
    return {"capacity_bytes": 1 << 30, "used_bytes": 1 << 20, "objects": 10, "slots": slots, "slot_rule": 2,
            "slot_map": slot_map,
            "leader": addrs[0], "metaservers": [{"addr": a, "slots_led": [s for s, x in enumerate(slot_map) if x == a],
                                                 "objects": 3, "used_bytes": 1 << 18, "warm_copies": {}}
                                                for a in addrs]}


def test_a_pool_of_many_slots_a_metaserver_is_told_their_cost(capsys):
    cli._print_stats(_stats(64, 3))
    out = capsys.readouterr().out
    assert "64 slots over 3 metaservers (rule 2: the key digest's bits)" in out
    assert "21 slots a metaserver" in out and "table pass" in out, out


def test_a_pool_of_few_slots_a_metaserver_gets_no_note(capsys):
    for slots, processes in ((6, 3), (12, 3), (1, 1)):
        stats = _stats(slots, processes)
        if slots == 1:  # an unpartitioned pool: no slot rows at all
            stats.pop("slot_map")
        cli._print_stats(stats)
        out = capsys.readouterr().out
        assert "slots a metaserver" not in out, out
        assert (f"{slots} slots over {processes} metaservers" in out) == (slots > 1), out
