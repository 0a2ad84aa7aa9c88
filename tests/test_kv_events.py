"""KV events from a real pool (etcd, metaserver ``--kv-events``, nodes on 127.0.0.1).

- With vLLM's own event classes (``vllm.distributed.kv_events.KVEventBatch``, decoded by msgspec as vLLM's
  subscribers do): every page a put committed arrives as ``BlockStored`` (chained, medium ``UMBP``, block size from
  the namespace), every page the pool evicted, removed or lost with a node arrives as ``BlockRemoved``, so the
  subscriber's view equals what the pool answers to EXISTS, key for key; a second subscriber joining late gets the
  whole history from the replay socket. vLLM lives in the engines venv: ``test_kv_events_vllm_suite_in_engines_venv``
  runs that test there (and fails if it fails there, or skips loudly when the venv is missing).
- A cache-aware router (``umbp.routing.PoolPrefix``) over two pools, one per rank, fed by ``umbp.kvindex``
  subscribers: each prompt goes to the rank whose pool holds its longest prefix, and follows the pages when they
  are removed from one pool.
"""

from __future__ import annotations

import re
import signal

import pytest

from umbp.keys import chain_keys, normalize_key, parents_of

from enginesvenv import engine_modules, run_pytest

_ERR, needs_vllm = engine_modules(
    "VLLM DOES NOT IMPORT", "this test runs in the engines venv through test_kv_events_vllm_suite_in_engines_venv",
    "vllm.distributed.kv_events", "msgspec")

NS = "llama3-8b/mha/p16/bf16"
PAGE_BYTES = 4096 - 64  # one 4 KiB object a page
KV_LINE = re.compile(r"^metaserver: kv events on (tcp://\S+), replay on (tcp://\S+)$", re.M)


def kv_endpoints(metaserver) -> tuple[str, str]:
    m = metaserver.wait_for_line(KV_LINE, 10.0, "the kv events line")
    return m.group(1), m.group(2)


def chains(n_chains: int, pages: int, seed: int) -> list[list[str]]:
    return [chain_keys([seed * 1_000_003 + c * 10_007 + i for i in range(pages * 16)], 16) for c in range(n_chains)]


def put_chains(client, keys_by_chain) -> set[str]:
    stored = set()
    for keys in keys_by_chain:
        ok = client.batch_put(keys, [bytes([len(stored) % 251]) * PAGE_BYTES] * len(keys), parents=parents_of(keys))
        stored.update(k for k, o in zip(keys, ok) if o)
    return stored


def test_kv_events_vllm_suite_in_engines_venv(etcd_binary):
    if _ERR is None:
        pytest.skip("already running inside a venv where vLLM imports: the test below runs directly")
    print(run_pytest(["tests/test_kv_events.py", "-k", "vllm_subscriber"], etcd_binary,
                     "the KV events test with vLLM's classes", min_passed=1, no_skips=True)[-600:])


class VllmView:
    """A subscriber built from vLLM's classes: SUB plus a DEALER replay from seq 0, every batch decoded into
    ``KVEventBatch``; ``held`` is what it believes the pool holds."""

    def __init__(self, endpoint: str, replay: str):
        import msgspec
        import zmq
        from vllm.distributed import kv_events as ke

        self.ke, self.zmq = ke, zmq
        self.decoder = msgspec.msgpack.Decoder(type=ke.KVEventBatch)
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.rep = self.ctx.socket(zmq.DEALER)
        self.rep.connect(replay)
        self.rep.send_multipart((b"", (0).to_bytes(8, "big")))
        self.replaying = True
        self.gap = False
        self.next = 0
        self.held: set[bytes] = set()
        self.stored_ever: set[bytes] = set()
        self.removed_ever: set[bytes] = set()
        self.kinds: dict[str, int] = {}
        self.parents: dict[bytes, bytes | None] = {}

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq != self.next:
            self.gap |= seq > self.next  # a live batch ahead of the replay: asked again at the replay's end
            return  # or a replayed batch seen live already
        self.next += 1
        batch = self.decoder.decode(payload)  # raises unless it is a valid KVEventBatch
        assert batch.data_parallel_rank == 0
        for ev in batch.events:
            self.kinds[type(ev).__name__] = self.kinds.get(type(ev).__name__, 0) + 1
            if isinstance(ev, self.ke.BlockStored):
                assert ev.medium == "UMBP" and ev.block_size == 16 and ev.token_ids == [] and ev.lora_id is None
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    self.parents[h] = parent
                    parent = h
                self.held.update(ev.block_hashes)
                self.stored_ever.update(ev.block_hashes)
            elif isinstance(ev, self.ke.BlockRemoved):
                assert ev.medium == "UMBP"
                self.held.difference_update(ev.block_hashes)
                self.removed_ever.update(ev.block_hashes)
            else:
                assert isinstance(ev, self.ke.AllBlocksCleared)
                self.held.clear()

    def drain_until(self, done, timeout_s: float = 15.0) -> None:
        """Apply batches as they come until ``done()`` holds (checked after each quiet 100 ms), at most timeout_s."""
        zmq = self.zmq
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.rep, zmq.POLLIN)
        for _ in range(int(timeout_s * 10)):
            ready = dict(poller.poll(100))
            if self.rep in ready:
                while self.rep.poll(0):
                    f = self.rep.recv_multipart()
                    if f[2] == self.ke.ZmqEventPublisher.END_SEQ:
                        self.replaying = self.gap
                        if self.gap:  # batches went by live while the replay ran: replay from where we are
                            self.gap = False
                            self.rep.send_multipart((b"", self.next.to_bytes(8, "big")))
                    else:
                        self._apply(int.from_bytes(f[2], "big"), f[3])
            if self.sub in ready:
                while self.sub.poll(0):
                    _, seq, payload = self.sub.recv_multipart()
                    self._apply(int.from_bytes(seq, "big"), payload)
            if not ready and not self.replaying and done():
                return
        raise AssertionError(f"the subscriber's view did not settle in {timeout_s}s: next seq {self.next}")

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@needs_vllm
@pytest.mark.cluster(nodes=2, capacity="1MiB", lease_ttl=1.0,
                     metaserver_flags={"kv_events": "tcp://127.0.0.1:0", "eviction_policy": "prefix-lru"})
def test_vllm_subscriber_sees_every_committed_page_stored_and_every_dropped_page_removed(cluster):
    endpoint, replay = kv_endpoints(cluster.metaserver)
    view = VllmView(endpoint, replay)
    try:
        with cluster.client(namespace=NS) as c:
            keys = [k for ch in chains(20, 40, seed=1) for k in ch]  # 800 pages into 2 x 255: evictions
            stored = put_chains(c, [keys[i:i + 40] for i in range(0, len(keys), 40)])
            assert len(stored) == len(keys)
            c.batch_remove(keys[-5:])  # explicit removals

            def pool_view() -> set[bytes]:
                return {normalize_key(k) for k, e in zip(keys, c.batch_exists(keys)) if e}

            view.drain_until(lambda: view.held == pool_view())
            raw = {normalize_key(k) for k in keys}
            assert view.stored_ever == raw  # every committed page was announced
            gone = raw - pool_view()
            assert len(gone) >= 800 - 2 * 255 and gone <= view.removed_ever  # evicted and removed: all withdrawn
            assert {normalize_key(k) for k in keys[-5:]} <= view.removed_ever
            ev = c.stats()["evictions"]
            assert ev > 0 and len(view.removed_ever) >= ev
            # Chained: each page's parent is the previous page of its chain, as the puts said.
            for ch in (keys[i:i + 40] for i in range(0, len(keys), 40)):
                assert [view.parents[normalize_key(k)] for k in ch[1:]] == [normalize_key(k) for k in ch[:-1]]
            # A node lost: its pages are withdrawn once the metaserver drops it.
            before = pool_view()
            cluster.node("node1").kill(signal.SIGKILL)
            view.drain_until(lambda: view.held == pool_view() and len(view.held) < len(before), timeout_s=30.0)
            assert view.held and view.kinds["AllBlocksCleared"] == 1  # the publisher's first batch only
        # A subscriber joining now rebuilds the same view from the replay buffer alone.
        late = VllmView(endpoint, replay)
        try:
            late.drain_until(lambda: late.next == view.next)
            assert late.held == view.held and late.stored_ever == view.stored_ever
        finally:
            late.close()
    finally:
        view.close()


@pytest.mark.cluster(nodes=1, metaserver_flags={"kv_events": "tcp://127.0.0.1:0"})
def test_pool_prefix_router_follows_kv_events_of_two_pools(cluster):
    from umbp.kvindex import BlockIndex, Subscriber
    from umbp.routing import PoolPrefix, RouteRequest

    # A second pool on the same etcd (another prefix), publishing on its own endpoint: rank 0 uses the fixture's
    # pool, rank 1 this one.
    h = cluster.harness
    ms_b = h.metaserver(cluster.etcd.url, name="metaserver-b", etcd_prefix="/pool-b",
                        kv_events="tcp://127.0.0.1:0")
    h.node(ms_b.addr, node_id="node-b", capacity="8MiB")
    a = cluster.metaserver
    index = BlockIndex()
    subs = [Subscriber(index, "rank0", *kv_endpoints(a)), Subscriber(index, "rank1", *kv_endpoints(ms_b))]
    x, y, z = chains(3, 12, seed=7)
    try:
        with cluster.client(namespace=NS) as ca, h_client(ms_b.addr) as cb:
            put_chains(ca, [x, z[:3]])
            put_chains(cb, [y, z[:9]])

            def settle(want) -> None:
                for _ in range(100):  # each poll waits at most 100 ms for a batch
                    for s in subs:
                        s.poll(100 if not want() else 0)
                    if want():
                        return
                raise AssertionError("the router's index did not settle")

            settle(lambda: index.prefix("rank0", z) == 3 and index.prefix("rank1", z) == 9
                   and index.prefix("rank0", x) == 12 and index.prefix("rank1", y) == 12)
            router = PoolPrefix(2, index, ["rank0", "rank1"])

            def route(rid, keys):
                r = router.route(RouteRequest(rid, rid, keys, len(keys) * 16 + 1, 16))
                router.on_finish(rid)
                return r

            assert [route("x", x), route("y", y), route("z", z)] == [0, 1, 1]
            assert router.prefixes(RouteRequest("z", "z", z, len(z) * 16 + 1, 16)) == [3, 9]
            fresh = chains(1, 4, seed=99)[0]
            assert route("new", fresh) == 0  # nobody holds it: the least loaded, lowest index
            cb.batch_remove(z[2:9])  # pool b keeps only z's first 2 pages now
            settle(lambda: index.prefix("rank1", z) == 2)
            assert route("z2", z) == 0
    finally:
        for s in subs:
            s.close()


def h_client(addr: str):
    from umbp.client import Client

    return Client(metaserver=addr, namespace=NS)


def test_umbp_up_passes_kv_events_to_its_metaserver(tmp_path, etcd_binary):
    from test_up import Up  # tests/test_up.py's `umbp up` driver

    from umbp.client import Client
    from umbp.kvindex import BlockIndex, Subscriber

    u = Up(tmp_path, "--nodes", "1", "--port", "0", "--capacity", "16MiB", "--kv-events", "tcp://127.0.0.1:0")
    try:
        (m,) = u.stdout_until(r"^kv events: (tcp://\S+), replay (tcp://\S+) \(metaserver\)$")
        (addr,) = u.stdout_until(r"^metaserver: (\S+)$")
        index = BlockIndex()
        sub = Subscriber(index, "pool", m.group(1), m.group(2))
        try:
            keys = chains(1, 6, seed=3)[0]
            with Client(metaserver=addr.group(1), namespace=NS) as c:
                put_chains(c, [keys])
            for _ in range(100):  # each poll waits at most 100 ms for a batch
                sub.poll(100)
                if index.prefix("pool", keys) == 6:
                    break
            assert index.prefix("pool", keys) == 6 and sub.lost == 0
        finally:
            sub.close()
    finally:
        u.close()


@pytest.mark.cluster(nodes=1, metaserver_flags={"kv_events": "tcp://127.0.0.1:0"})
def test_a_new_term_announces_every_page_it_holds(cluster):
    from umbp.kvindex import BlockIndex, Subscriber

    keys = [k for ch in chains(3, 10, seed=5) for k in ch]
    with cluster.client(namespace=NS) as c:
        put_chains(c, [keys[i:i + 10] for i in range(0, 30, 10)])
        c.batch_remove(keys[25:])
    cluster.metaserver.restart()  # the next term loads the 25 pages from etcd; its publisher starts at seq 0
    index = BlockIndex()
    sub = Subscriber(index, "pool", *kv_endpoints(cluster.metaserver))
    try:
        for _ in range(100):  # each poll waits at most 100 ms for a batch
            sub.poll(100)
            if len(index.blocks.get("pool", ())) == 25:
                break
        assert index.blocks["pool"] == {normalize_key(k) for k in keys[:25]}
        assert [index.prefix("pool", keys[i:i + 10]) for i in (0, 10, 20)] == [10, 10, 5]
    finally:
        sub.close()
