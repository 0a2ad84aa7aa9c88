"""The pool across hosts: etcd, two metaservers, three storage nodes and two clients, each in a host of its own
(a network namespace with its own address, hostname and /dev/shm: ``tests/netns.py``), joined by a bridge.

What it shows, in order (one rack for the module; each test leaves it whole again):

1. pages put from one client host are read byte-exactly from the other, over TCP (no shared memory across hosts),
   spread over all three node hosts;
2. a lossy link (packet loss, plus delay where the kernel has ``tc netem``) to one node host: everything is still
   read byte-exactly; then a black hole (100% loss): that host's pages, and only those, are lost once its lease
   expires, while the others keep serving reads and taking puts; the host rejoins when the link heals;
3. a pulled cable (link down) on another node host: the same, and when it comes back with its arena intact it gets
   its pages back (the metaserver keeps a dead node's pages for a grace period);
4. the leader metaserver's host is cut off: the standby takes over, nodes re-register with it, clients follow it,
   every committed page is still read byte-exactly; the old leader comes back as a standby.

The node and metaserver processes run from the built image's filesystem when ``tests/image.py`` can build it
(buildah, ``--isolation chroot``, debootstrap base), else from the checkout, said loudly. Timings (detection,
rejoin, failover, reads over the impaired link) are printed at the end of the module and written to
``build/multihost-timings.json``.

Skipped, loudly, where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import pytest

import netns
from cluster import Cluster, Etcd, Harness, HarnessError, NotYet, eventually
from netns import Agent, Host, Rack, digest, page_bytes
from umbp.errors import UmbpError

_ok, _why = netns.support()
if not _ok:
    _msg = (f"SKIPPING THE MULTI-HOST TESTS: network namespaces cannot be made here ({_why}). They need root and "
            "iproute2 (`ip netns`, veth, bridge); run `make test` as root on Linux to include them.")
    print(f"\n*** {_msg}", file=sys.stderr)
    warnings.warn(_msg)
    pytest.skip(_msg, allow_module_level=True)

# the first run on a machine builds the image (debootstrap base about a minute, the image about 30 s)
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[1]
HOSTS = ["etcd", "ms1", "ms2", "n1", "n2", "n3", "c1", "c2"]
NODE_HOSTS = ["n1", "n2", "n3"]
LEASE_TTL = 3.0  # node lease: a cut host's pages go about this long after its last heartbeat
ELECTION_TTL = 2  # leader lease
PAGE = 64 * 1024 + 123
CAPACITY = "64MiB"
WAIT_S = 60.0
TIMINGS: dict[str, float | str] = {}
DEBUG = bool(os.environ.get("UMBP_MULTIHOST_DEBUG"))  # print every poll of wait()


class HostEtcd(Etcd):
    """etcd listening on its host's address (the harness's Etcd binds 127.0.0.1)."""

    def __init__(self, host: Host, workdir: Path):
        super().__init__(workdir, name="etcd")
        self.ip = host.ip
        self.client_port, self.peer_port = 2379, 2380
        self.wrap = host.wrap()

    @property
    def url(self) -> str:
        return f"{self.ip}:{self.client_port}"

    def _argv(self) -> list[str]:
        argv = super()._argv()
        return [a.replace("127.0.0.1", self.ip) for a in argv]

    def owns_port(self, port: int) -> bool:
        return True  # its socket lives in another namespace's /proc/net; a fresh namespace has no stray listener


class MultiHost:
    def __init__(self, harness: Harness, rack: Rack, image_root: str | None):
        self.harness = harness
        self.rack = rack
        self.image_root = image_root
        self.cluster = Cluster(harness, nodes=0)
        self.agents: dict[str, Agent] = {}
        self.seeds: dict[str, int] = {}  # key -> seed its bytes were made with

    @property
    def ms_addrs(self) -> str:
        return ",".join(f"{self.rack[h].ip}:7700" for h in ("ms1", "ms2"))

    # what a subclass changes: its metaserver and node hosts, the metaservers' flags, its timings and agents
    MS_HOSTS: tuple[str, ...] = ("ms1", "ms2")
    NODE_HOSTS: tuple[str, ...] = tuple(NODE_HOSTS)
    MS_FLAGS: dict = {}
    START_LABEL = "pool start (etcd, 2 metaservers, 3 nodes in 6 hosts) s"

    @property
    def timings(self) -> dict:
        return TIMINGS

    def agent(self, host: str) -> Agent:
        return Agent(self.rack[host], self.ms_addrs, self.harness.workdir)

    def start(self) -> "MultiHost":
        h, rack = self.harness, self.rack
        t0 = time.monotonic()
        etcd = HostEtcd(rack["etcd"], h.workdir)
        h._track(etcd)
        etcd.start()
        self.cluster.etcd = etcd
        for name in self.MS_HOSTS:  # one at a time: in a partitioned pool the first creates it, the others join
            ip = rack[name].ip
            m = h.metaserver(etcd.url, start=False, name=name, listen=f"{ip}:7700", advertise=f"{ip}:7700",
                             election_ttl=ELECTION_TTL, metrics_listen=f"{ip}:9100", **self.MS_FLAGS)
            self._place(m, rack[name])
            m.start()
            self.cluster.metaservers.append(m)
        nodes = []
        for name in self.NODE_HOSTS:
            ip = rack[name].ip
            n = h.node(self.ms_addrs, start=False, node_id=name, capacity=CAPACITY, lease_ttl=LEASE_TTL,
                       listen=f"{ip}:7800", metrics_listen=f"{ip}:9100")
            n.extra_env["UMBP_ARENA_DIR"] = "/dev/shm"  # the host's own /dev/shm (netns.Host)
            self._place(n, rack[name])
            nodes.append(n)
        for n in nodes:
            n.launch()
        for n in nodes:
            n.wait_ready()
        self.cluster.nodes = nodes
        self.cluster.wait_nodes(alive=list(self.NODE_HOSTS))
        self.timings[self.START_LABEL] = round(time.monotonic() - t0, 2)
        t0 = time.monotonic()
        for name in ("c1", "c2"):
            self.agents[name] = self.agent(name)
        self.timings["client agents start s"] = round(time.monotonic() - t0, 2)
        return self

    def _place(self, p, host: Host) -> None:
        p.wrap = host.wrap(self.image_root)
        if self.image_root:
            p.umbp = ["umbp"]

    def close(self) -> None:
        for a in self.agents.values():
            a.close()
        self.rack.close()

    # --- helpers

    def node(self, name: str):
        return self.cluster.node(name)

    def put(self, client: str, keys: list[str], seed: int) -> list[bool]:
        r = self.agents[client].call("put", keys=keys, seed=seed, size=PAGE)
        for k, stored in zip(keys, r["stored"]):
            if stored:
                self.seeds[k] = seed
        return r["stored"]

    def get(self, client: str, keys: list[str]) -> tuple[list[int], list[bool], float]:
        """Read ``keys`` on ``client``: (lengths, byte-exact flags, seconds)."""
        r = self.agents[client].call("get", keys=keys, seed=0, size=PAGE)
        exact = [g == PAGE and sha == digest(page_bytes(k, self.seeds[k], PAGE))
                 for k, g, sha in zip(keys, r["got"], r["sha256"])]
        return r["got"], exact, r["seconds"]

    def placement(self) -> dict[str, str]:
        """key -> node id, from `umbp ls`."""
        r = self.cluster.cli_json("ls", "--limit", "100000")
        out = {}
        for ns, key, size, node, state in r["objects"]:
            if state == "READY":
                out[key if isinstance(key, str) else str(key)] = node
        return out

    def leader(self) -> str:
        """Host name of the metaserver that serves as leader (from its /metrics)."""
        for name in ("ms1", "ms2"):
            try:
                with urllib.request.urlopen(f"http://{self.rack[name].ip}:9100/readyz", timeout=2) as r:
                    if r.read().decode().startswith("metaserver: leader"):
                        return name
            except OSError:
                continue
        raise HarnessError("multihost: no metaserver says it leads")

    def readyz(self, host: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://{self.rack[host].ip}:9100/readyz", timeout=2) as r:
                return r.status, r.read().decode().strip()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode().strip()
        except OSError as e:
            return 0, str(e)

    def wait(self, what: str, cond, timeout: float = WAIT_S, step: float = 0.1) -> float:
        """Poll ``cond()`` until truthy; returns the seconds it took. Fails with ``what`` after ``timeout``."""
        t0 = time.monotonic()

        def attempt() -> bool:
            t1 = time.monotonic()
            try:
                if cond():
                    return True
                why = "not yet"
            except (netns.NetnsError, HarnessError) as e:  # a host or process that does not answer yet
                why = str(e).splitlines()[0][:200]
            if DEBUG:
                print(f"  wait {what}: +{t1 - t0:.2f}s try took {time.monotonic() - t1:.2f}s: {why}", flush=True)
            raise NotYet(why)

        eventually(attempt, timeout, f"multihost: {what} not reached", interval=step, details=self.harness.tails)
        return time.monotonic() - t0

    def nodes_state(self) -> dict[str, bool]:
        """node id -> alive, as the leading metaserver sees it ({} while none leads). Asks the leader directly: a
        fresh client given both addresses spends its first attempt on a black-holed one (see the leader-cut test).
        In-process (``Cluster.ask``: what `umbp nodes --json` prints), as the waits poll it."""
        try:
            leader = self.leader()
        except HarnessError:
            return {}
        try:
            listing = self.cluster.ask("nodes", metaserver=f"{self.rack[leader].ip}:7700", timeout=10.0)
        except (UmbpError, OSError):
            return {}
        return {d["node_id"]: bool(d.get("alive")) for d in listing}


@contextlib.contextmanager
def rack_pool(name: str, label: str, hosts, make_pool, timings: dict, request):
    """The pool of a multi-host test module, started on a Rack of ``hosts`` by ``make_pool(harness, rack, root)``,
    its processes run from the image (else from the checkout, said loudly); on exit stopped, and ``timings``
    written to build/{name}-timings.json and to the terminal."""
    import image

    root, note = image.rootfs_for_tests()
    timings["processes run from"] = note
    if root is None:
        msg = f"{label.upper()} TEST RUNS THE CHECKOUT, NOT THE IMAGE: {note}"
        print(f"\n*** {msg}", file=sys.stderr)
        warnings.warn(msg)
    harness = Harness(name)
    pool = make_pool(harness, Rack(harness, hosts), root)
    try:
        pool.start()
        yield pool
    finally:
        pool.close()
        image.release()
        out = REPO / "build" / f"{name}-timings.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(timings, indent=2) + "\n")
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("")
            tr.write_line(f"{label} timings ({out.relative_to(REPO)}):")
            for k, v in timings.items():
                tr.write_line(f"  {k}: {v}")


@pytest.fixture(scope="module")
def mh(etcd_binary, request):
    with rack_pool("multihost", "multi-host", HOSTS, MultiHost, TIMINGS, request) as pool:
        yield pool


@pytest.fixture(autouse=True)
def _logs_on_failure(request, mh):
    request.node._umbp_harness = mh.harness  # conftest attaches the processes' log tails to a failure


KEYS_A = [f"mh-a-{i}" for i in range(30)]


def test_cross_host_round_trip_over_tcp(mh):
    if mh.image_root:  # the servers are the image's processes: their root is the image, their Python its venv's
        for p in mh.cluster.metaservers + mh.cluster.nodes:
            assert os.readlink(f"/proc/{p.pid}/root") == mh.image_root, p.name
            assert os.readlink(f"/proc/{p.pid}/exe").startswith(f"{mh.image_root}/usr/bin/python3"), p.name
            with open(f"/proc/{p.pid}/cmdline", "rb") as fh:
                assert fh.read().split(b"\0")[1] == b"/opt/umbp/bin/umbp", p.name
    assert mh.agents["c1"].call("ping")["hostname"] == "c1" and mh.agents["c2"].call("ping")["hostname"] == "c2"
    assert mh.put("c1", KEYS_A, seed=1) == [True] * len(KEYS_A)
    got, exact, secs = mh.get("c2", KEYS_A)
    assert got == [PAGE] * len(KEYS_A) and all(exact)
    TIMINGS["c2 reads 30 pages of 64 KiB put by c1 s"] = secs
    for c in ("c1", "c2"):
        tr = mh.agents[c].call("transports")["transports"]
        assert tr == {n: "tcp" for n in NODE_HOSTS}, f"{c} must reach every node over TCP only: {tr}"
    where = mh.placement()
    assert {where[k] for k in KEYS_A} == set(NODE_HOSTS), f"pages should spread over all nodes: {where}"
    # the nodes' own counters agree: every page read went out of some node over TCP
    out = 0
    for n in NODE_HOSTS:
        with urllib.request.urlopen(f"http://{mh.rack[n].ip}:9100/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("umbp_node_transport_bytes_total") and 'direction="out"' in line:
                    out += float(line.rsplit(" ", 1)[1])
    assert out >= len(KEYS_A) * PAGE


def test_lossy_link_then_black_hole_loses_only_that_host(mh):
    host = mh.rack["n2"]
    caps = mh.rack.caps
    lossy = dict(loss=10.0, delay_ms=20) if caps.get("netem") else dict(loss=10.0)
    if not caps.get("netem"):
        msg = ("tc netem is not available on this kernel (no sch_netem): the lossy link uses iptables' statistic "
               "match for loss and has NO added delay")
        warnings.warn(msg)
        print(f"\n*** {msg}", file=sys.stderr)
    TIMINGS["impairment"] = "; ".join(host.impair(**lossy))
    try:
        secs, rounds = 0.0, 0
        while host.dropped() < 20 and rounds < 50:  # read until the link has really lost packets under us
            got, exact, s = mh.get("c2", KEYS_A)
            assert got == [PAGE] * len(KEYS_A) and all(exact), "a lossy link slows reads down, never corrupts them"
            secs, rounds = secs + s, rounds + 1
        assert host.dropped() >= 20, f"only {host.dropped()} packets dropped in {rounds} rounds of reads"
        TIMINGS["lossy n2: packets dropped under the reads"] = host.dropped()
        TIMINGS["lossy n2: c2 reads of 30 pages, rounds / mean s"] = f"{rounds} / {secs / rounds:.4f}"
        keys_b = [f"mh-b-{i}" for i in range(12)]
        assert mh.put("c1", keys_b, seed=2) == [True] * len(keys_b)
        assert mh.nodes_state().get("n2") is True
    finally:
        host.clear()

    keys = KEYS_A + keys_b
    where = mh.placement()
    on_n2 = [k for k in keys if where[k] == "n2"]
    assert on_n2, "n2 should hold some pages"
    t0 = time.monotonic()
    host.impair(loss=100.0)
    try:
        # while its lease runs the others still serve
        others = [k for k in keys if where[k] != "n2"]
        got, exact, _ = mh.get("c2", others)
        assert all(exact), "pages on the other hosts stay readable while n2 is black-holed"
        mh.wait("n2 declared dead", lambda: mh.nodes_state().get("n2") is False)
        TIMINGS["black hole (100% loss) to n2 declared dead s"] = round(time.monotonic() - t0, 2)
        got, exact, _ = mh.get("c2", keys)
        lost = [k for k, g in zip(keys, got) if g == -1]
        assert sorted(lost) == sorted(on_n2), "exactly n2's pages are gone"
        assert all(e for k, e in zip(keys, exact) if k not in on_n2)
        keys_c = [f"mh-c-{i}" for i in range(12)]
        assert mh.put("c2", keys_c, seed=3) == [True] * len(keys_c), "the pool keeps taking puts"
        where = mh.placement()
        assert {where[k] for k in keys_c} <= {"n1", "n3"}
    finally:
        host.clear()
    t1 = time.monotonic()
    mh.wait("n2 alive again", lambda: mh.nodes_state().get("n2") is True)
    TIMINGS["n2 rejoined after its link healed s"] = round(time.monotonic() - t1, 2)
    got, exact, _ = mh.get("c2", keys + keys_c)
    assert all(exact), "n2 kept its arena (its process never stopped): its parked pages are served again"


def test_link_down_and_rejoin_with_arena_intact(mh):
    host = mh.rack["n3"]
    keys = [f"mh-d-{i}" for i in range(24)]
    assert mh.put("c1", keys, seed=4) == [True] * len(keys)
    where = mh.placement()
    on_n3 = [k for k in keys if where[k] == "n3"]
    assert on_n3 and len(on_n3) < len(keys)
    t0 = time.monotonic()
    host.cut()
    try:
        mh.wait("n3 declared dead", lambda: mh.nodes_state().get("n3") is False)
        TIMINGS["link down on n3 to n3 declared dead s"] = round(time.monotonic() - t0, 2)
        got, exact, _ = mh.get("c2", keys)
        assert sorted(k for k, g in zip(keys, got) if g == -1) == sorted(on_n3)
        assert all(e for k, e in zip(keys, exact) if k not in on_n3)
    finally:
        host.restore()
    t1 = time.monotonic()
    mh.wait("n3 alive again", lambda: mh.nodes_state().get("n3") is True)
    TIMINGS["n3 rejoined after link up s"] = round(time.monotonic() - t1, 2)
    got, exact, _ = mh.get("c2", keys)
    assert got == [PAGE] * len(keys) and all(exact), "n3 came back within its grace with its arena: pages back"
    assert mh.node("n3").alive, "the node process itself never stopped"


def test_leader_host_cut_fails_over(mh):
    old = mh.leader()
    new = "ms2" if old == "ms1" else "ms1"
    new_addr = f"{mh.rack[new].ip}:7700"
    keys = [f"mh-e-{i}" for i in range(20)]
    assert mh.put("c1", keys, seed=5) == [True] * len(keys)
    t0 = time.monotonic()
    mh.rack[old].cut()
    try:
        mh.wait(f"{new} leads", lambda: mh.readyz(new)[1].startswith("metaserver: leader"))
        TIMINGS[f"leader host {old} cut: {new} leads after s"] = round(time.monotonic() - t0, 2)

        def registered_with_new():
            return all(mh.readyz(n) == (200, f"node {n}: registered with {new_addr}") for n in NODE_HOSTS)

        mh.wait("every node registered with the new leader", registered_with_new)
        TIMINGS["leader host cut: every node registered with the new leader after s"] = round(
            time.monotonic() - t0, 2)

        def reads_ok():
            got, exact, _ = mh.get("c2", keys)
            return all(exact)

        # c2 still holds a connection to the old leader: its calls (5 s deadline each) fail until one attempt has
        # given up on the black-holed address and moved on (umbp/metaclient.py)
        mh.wait("c2 reads every page through the new leader", reads_ok)
        TIMINGS["leader host cut: c2 reads every committed page again after s"] = round(time.monotonic() - t0, 2)
        keys_f = [f"mh-f-{i}" for i in range(10)]
        mh.wait("c1 puts through the new leader", lambda: mh.put("c1", keys_f, seed=6) == [True] * len(keys_f))
        TIMINGS["leader host cut: c1 puts again after s"] = round(time.monotonic() - t0, 2)
        got, exact, _ = mh.get("c2", keys_f)
        assert all(exact)
        assert all(mh.nodes_state().get(n) for n in NODE_HOSTS)
    finally:
        mh.rack[old].restore()
    mh.wait(f"{old} back as a standby", lambda: mh.readyz(old) == (200, f"metaserver: standby, leader is {new_addr}"))
    assert mh.leader() == new
