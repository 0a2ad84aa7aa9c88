"""A partitioned pool across hosts survives a network cut of one metaserver host.

The rack (``tests/netns.py``): etcd, three metaserver hosts each running one process of a partitioned pool
(``--slots 8``), two storage node hosts and two client hosts (``Agent``s), each host a network namespace of its own
on one bridge; the test process is the operator's box on the bridge. Processes run from the built image when
``tests/image.py`` can build it, else from the checkout (said loudly), as in ``tests/test_multihost.py``, whose
harness pieces (``HostEtcd``, ``MultiHost``) this reuses.

What it shows: pages put from c1; the host of the process leading the most slots loses its link (``Host.cut()``:
no RST, a black hole); within the election TTL plus a round the surviving processes serve its slots (the slot map
read with LEADER from a survivor is the rendezvous ranking over the survivors and names the cut address nowhere),
c2 reads every committed page byte-exactly (sha256 from the agent), c1 puts again and c2 reads those; no client
call takes longer than its deadline. Then the link comes back: the cut process joins again, its slots are handed
back (the map is the ranking over all three again) and every page is still read byte-exactly. How long each step
took after the cut is printed at the end and written to ``build/multihost-slots-timings.json``.

Skipped, loudly, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

import netns
from test_multihost import PAGE, WAIT_S, MultiHost, rack_pool  # where it skips, this module does too
from cluster import HarnessError, eventually
from metaserver.ha.slots import leaders
from test_failover import raw
from transport import slotrules
from transport.wire import Op
from umbp.errors import NotLeader, TransportError, UmbpError, Unavailable

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[1]
MS_HOSTS = ("ms1", "ms2", "ms3")
NODE_HOSTS = ("n1", "n2")
HOSTS = ["etcd", *MS_HOSTS, *NODE_HOSTS, "c1", "c2"]
SLOTS = 8
ELECTION_TTL = 2  # the process lease: a cut process's slots move about this long after its last keep-alive
AGENT_TIMEOUT_S = 5.0  # the agents' umbp.Client timeout (every call's deadline)
NS = "default"
TIMINGS: dict[str, float | str] = {}

# run inside a host: EXISTS per key (argv[2:]) at argv[1], on one connection; prints the outcome per key
_PROBE = r"""
import json, sys, time
from transport.framed import FramedSocket
from transport.wire import Op
from umbp.errors import UmbpError
s = FramedSocket(sys.argv[1], "probe", time.monotonic() + 3)
out = []
for k in sys.argv[2:]:
    try:
        s.request(Op.EXISTS, {"ns": "default", "keys": [k.encode()]}, time.monotonic() + 3)
        out.append("answer")
    except UmbpError as e:
        out.append(type(e).__name__)
print(json.dumps(out))
"""


class SlotRack(MultiHost):
    """``MultiHost`` with three metaserver hosts of one partitioned pool and two node hosts."""

    MS_HOSTS, NODE_HOSTS, MS_FLAGS = MS_HOSTS, NODE_HOSTS, {"slots": SLOTS}
    START_LABEL = "pool start (etcd, 3 metaservers of 8 slots, 2 nodes in 6 hosts) s"

    @property
    def timings(self) -> dict:
        return TIMINGS

    def agent(self, host: str) -> netns.Agent:
        return netns.Agent(self.rack[host], self.ms_addrs, self.harness.workdir, timeout_s=AGENT_TIMEOUT_S)

    @property
    def ms_addrs(self) -> str:
        return ",".join(self.addr(h) for h in MS_HOSTS)

    def addr(self, host: str) -> str:
        return f"{self.rack[host].ip}:7700"

    def host_of(self, addr: str) -> str:
        return next(h for h in MS_HOSTS if self.addr(h) == addr)

    # --- the slot map

    def leader_info(self, hosts) -> dict:
        """LEADER (slot map, members) from the first of ``hosts`` that answers; HarnessError when none does."""
        errors = []
        for host in hosts:
            try:
                return raw(self.addr(host), Op.LEADER, timeout=1.0)
            except (UmbpError, OSError) as e:
                errors.append(f"{host}: {e}")
        raise HarnessError(f"multihost-slots: no metaserver of {list(hosts)} answered LEADER: {errors}")

    def settled(self, hosts) -> dict | None:
        """The LEADER answer when the map is the balanced ranking over exactly ``hosts``' processes (each slot
        led by its first-ranked one, the membership role too) as every one of them reports it, else None."""
        want = sorted(self.addr(h) for h in hosts)
        expect = leaders(SLOTS, want)
        info = None
        for host in hosts:  # every process agrees, not only the first to answer
            info = self.leader_info([host])
            if info["map"] != expect or sorted(info["members"]) != want or info["leader"] not in want:
                return None
        return info

    def exists(self, addr: str, key: str) -> bool:
        """EXISTS for one key asked of exactly the process at ``addr``; HarnessError while it cannot answer (not
        serving the slot yet, unreachable), so ``wait`` polls on."""
        try:
            return raw(addr, Op.EXISTS, {"ns": NS, "keys": [key.encode()]}, timeout=2.0) == {"exists": [True]}
        except (Unavailable, NotLeader, TransportError) as e:
            raise HarnessError(f"multihost-slots: EXISTS {key} at {addr}: {e}") from None

    def exists_inside(self, host: str, keys: list[str]) -> list[str]:
        """EXISTS for each key asked of ``host``'s own metaserver from inside that host (reachable while its link is
        cut): per key the answer's error class, or "answer" when it answered."""
        env_path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(REPO)) if p)
        r = self.rack[host].exec("env", f"PYTHONPATH={env_path}", sys.executable, "-c", _PROBE, self.addr(host), *keys)
        return json.loads(r.stdout)

    # --- timed client calls

    def timed(self, what: str, fn):
        """Run one agent call; its wall time is checked against the client's deadline (a client must never hang on
        a black-holed process longer than that). Returns fn's result; agent errors propagate (NetnsError)."""
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            took = time.monotonic() - t0
            TIMINGS["slowest client call during the cut s"] = max(TIMINGS.get("slowest client call during the cut s",
                                                                              0.0), round(took, 2))
            assert took <= AGENT_TIMEOUT_S + 2.0, f"{what} took {took:.2f}s, past the client's {AGENT_TIMEOUT_S}s"


@pytest.fixture(scope="module")
def sr(etcd_binary, request):
    with rack_pool("multihost-slots", "multi-host partitioned-pool", HOSTS, SlotRack, TIMINGS, request) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _logs_on_failure(request, sr):
    request.node._umbp_harness = sr.harness  # conftest attaches the processes' log tails to a failure


def test_metaserver_host_cut_moves_its_slots_and_loses_no_page(sr):
    t_settle = sr.wait("the slot map settles on the three processes", lambda: sr.settled(MS_HOSTS))
    TIMINGS["slot map settled on 3 processes after the start s"] = round(t_settle, 2)
    info = sr.settled(MS_HOSTS)
    assert info is not None, "the slot map changed again after it settled, with no fault"
    led = {h: [s for s, a in enumerate(info["map"]) if a == sr.addr(h)] for h in MS_HOSTS}
    # the membership leader's host when it leads slots too (its role moves as well), else the one leading the most
    membership = sr.host_of(info["leader"])
    victim = membership if led[membership] else max(MS_HOSTS, key=lambda h: len(led[h]))
    survivors = [h for h in MS_HOSTS if h != victim]
    victim_addr = sr.addr(victim)
    TIMINGS["cut host, its slots (of 8), membership leader"] = f"{victim} {led[victim]}, {membership}"

    keys = [f"mhs-a-{i}" for i in range(48)]
    assert sr.put("c1", keys, seed=11) == [True] * len(keys)
    on_victim = [k for k in keys if slotrules.slot_of(NS, k, SLOTS) in led[victim]]
    assert on_victim, f"none of {len(keys)} keys falls in {victim}'s slots {led[victim]}: the cut would test nothing"
    got, exact, _ = sr.get("c2", keys)
    assert got == [PAGE] * len(keys) and all(exact)

    t0 = time.monotonic()
    sr.rack[victim].cut()
    try:
        def moved():
            info = sr.settled(survivors)
            return info is not None and victim_addr not in info["map"] and victim_addr not in info["members"]

        sr.wait(f"{victim}'s slots {led[victim]} led by {survivors}", moved)
        TIMINGS[f"{victim} cut: its slots mapped to the survivors after s"] = round(time.monotonic() - t0, 2)
        # Served, not only mapped: an EXISTS for each slot the victim led answers at its new leader (a slot still
        # loading there answers UNAVAILABLE: polled).
        after = sr.settled(survivors)
        probe = {slotrules.slot_of(NS, k, SLOTS): k for k in on_victim}
        sr.wait(f"slots {sorted(probe)} served at their new leaders",
                lambda: all(sr.exists(after["map"][s], k) for s, k in probe.items()))
        TIMINGS[f"{victim} cut: its slots served by the survivors after s"] = round(time.monotonic() - t0, 2)
        # No split brain: the cut process, its lease gone by its own clock, answers for none of its old slots.
        seen = sr.exists_inside(victim, list(probe.values()))
        TIMINGS[f"{victim} cut: what it answers itself for its old slots"] = ", ".join(sorted(set(seen)))
        assert "answer" not in seen and set(seen) <= {"Unavailable", "NotLeader"}, (
            f"{victim} still answers for slots it lost while cut off: {dict(zip(probe, seen))}")

        def reads_ok():
            got, exact, _ = sr.timed("c2 get", lambda: sr.get("c2", keys))
            return got == [PAGE] * len(keys) and all(exact)

        # The clients' maps still name the cut process: one call waits at most half its deadline on it, re-reads
        # the map from a survivor and resends (umbp/slotrouter.py); two calls' worth of time is the bound here.
        sr.wait("c2 reads every committed page", reads_ok, timeout=2 * AGENT_TIMEOUT_S + 2)
        TIMINGS[f"{victim} cut: c2 reads every committed page after s"] = round(time.monotonic() - t0, 2)
        keys_b = [f"mhs-b-{i}" for i in range(32)]
        sr.wait("c1 puts again", lambda: sr.timed("c1 put", lambda: sr.put("c1", keys_b, seed=12))
                == [True] * len(keys_b), timeout=2 * AGENT_TIMEOUT_S + 2)
        TIMINGS[f"{victim} cut: c1 puts again after s"] = round(time.monotonic() - t0, 2)
        assert any(slotrules.slot_of(NS, k, SLOTS) in led[victim] for k in keys_b)
        got, exact, _ = sr.timed("c2 get", lambda: sr.get("c2", keys_b))
        assert got == [PAGE] * len(keys_b) and all(exact), "pages put after the cut read back byte-exact"

        def nodes_registered_with_survivors():
            return all(sr.readyz(n)[0] == 200 and sr.readyz(n)[1].startswith(f"node {n}: registered with ")
                       and victim_addr not in sr.readyz(n)[1] for n in NODE_HOSTS)

        sr.wait("every node registered with a surviving process", nodes_registered_with_survivors)
        TIMINGS[f"{victim} cut: every node registered with a survivor after s"] = round(time.monotonic() - t0, 2)
    finally:
        sr.rack[victim].restore()

    t1 = time.monotonic()
    sr.wait(f"{victim} rejoins and its slots are handed back", lambda: sr.settled(MS_HOSTS))
    TIMINGS[f"{victim} link restored: slots handed back after s"] = round(time.monotonic() - t1, 2)
    assert sr.cluster.metaservers[MS_HOSTS.index(victim)].alive, "the cut process itself never stopped"

    every = keys + keys_b

    def all_read():
        got, exact, _ = sr.get("c2", every)
        return got == [PAGE] * len(every) and all(exact)

    sr.wait("c2 reads every page after the handback", all_read)
    TIMINGS[f"{victim} link restored: c2 reads every page (before and during the cut) after s"] = round(
        time.monotonic() - t1, 2)
    # the process that came back serves its slots itself: what it answers for them is what was committed
    back = eventually(lambda: sr.settled(MS_HOSTS), WAIT_S, "the slot map settled after the handback")
    for k in every:
        s = slotrules.slot_of(NS, k, SLOTS)
        if back["map"][s] == victim_addr:
            assert sr.exists(victim_addr, k), f"{victim} serves slot {s} again and must know {k}"
    keys_c = [f"mhs-c-{i}" for i in range(16)]
    assert sr.put("c1", keys_c, seed=13) == [True] * len(keys_c)
    got, exact, _ = sr.get("c2", keys_c + every)
    assert all(exact), "the pool is whole again: puts and reads across all three processes"
