"""KV events: what the pool stores and drops, published as vLLM's KV event batches (``umbp metaserver --kv-events``).

An external cache-aware router (llm-d's KV-cache manager, Dynamo's KV router, ``umbp.kvindex``) subscribes and keeps
an index of the pages the pool holds. The wire is vLLM's ``ZmqEventPublisher``'s (vllm/distributed/kv_events.py):

- a ZeroMQ PUB socket on ``tcp://HOST:PORT`` sends multipart ``(topic, seq, payload)``: ``seq`` 8 bytes big endian,
  counting from 0 at the publisher's start, one per batch; ``payload`` a msgpack ``KVEventBatch``:
  ``[ts, [event, ...], data_parallel_rank]`` with each event a map tagged ``"type"``:
  ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids`` [], ``block_size``, ``lora_id`` nil,
  ``medium`` ``"UMBP"``, ``lora_name`` nil), ``BlockRemoved`` (``block_hashes``, ``medium``) or ``AllBlocksCleared``;
- a ROUTER socket on ``PORT + 1`` (both ports chosen by the system with port 0; the metaserver prints them) answers
  a replay request ``["", start seq as 8 bytes big endian]`` (a DEALER socket; a REQ one sends the empty frame
  itself but takes one answer only) with every buffered batch from that seq on, each ``["", topic, seq, payload]``,
  then ``["", "", -1 as 8 signed bytes, ""]``. The last ``REPLAY_BATCHES``
  batches are kept, so a subscriber that reconnects or sees a gap in ``seq`` catches up without a snapshot.

What the events say (the page table decides; ``metaserver/table/links.py`` calls the sink):

- ``BlockStored``: pages that became READY (a COMMIT, a lost node's pages filed again when it returns); consecutive
  pages of one chain are one event, ``parent_block_hash`` naming the first one's parent. At the start of every
  leadership term (and of every slot's, in a partitioned pool) all READY pages are sent as ``BlockStored``: a
  subscriber of a new leader learns what it holds.
- ``BlockRemoved``: READY pages that left: removed, evicted (watermark, quota, a full node), drained, or dropped with
  a lost node (in the slices the metaserver drops it in).
- ``AllBlocksCleared``: first batch of every publisher (seq 0: forget what an earlier process of this endpoint said),
  at the end of a term of an unpartitioned metaserver, and after batches were lost to a full queue.

Block hashes are the page keys as the directory holds them: a 64-hex chained key (``umbp.keys``, SGLang's and the
vLLM connector's) is its 32 raw sha256 bytes, as vLLM's own block hashes are (33 with a TP rank byte); any other
key is its bytes. ``block_size`` is the ``p<N>`` part of a namespace made by ``umbp.keys.namespace``, else 0. Each
batch holds one namespace's events and its topic is that namespace (UTF-8): subscribe to ``""`` for all of them
(``seq`` counts every batch of every topic, so a gap is only a gap on an all-topics subscription).

Hook surface (kept small so ``metaserver/`` can be restructured around it): the table has ``kv_sink`` (None: no
events) and calls ``kv_sink.stored_keys(ns, keys, parents)`` once per batch of pages that became READY and
``kv_sink.removed_keys(ns, keys)`` once per batch of READY pages that left (``metaserver/table/links.py``), and lists
what it holds with ``links.snapshot()``; ``Metaserver`` calls ``attach(directory)`` when a term starts serving,
``detach`` when it ends, and ``server.serve`` owns the process's ``Publisher`` (``publisher``/``close``).

Threads and costs: the sink runs on the event loop (a list step per page, a flush per burst of mutations scheduled
with ``call_soon``); encoding and sending run on the publisher's thread, which owns both sockets. A full queue
(``QUEUE_BATCHES``) drops batches rather than blocking the loop, then says ``AllBlocksCleared``. The socket is
unauthenticated: bind it where only routers reach it (keys name what tenants stored).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
import time
from collections import deque
from typing import Any

import msgpack

from umbp.errors import ConfigError, StartupError

log = logging.getLogger("umbp.metaserver")

MEDIUM = "UMBP"
REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's buffer_steps)
QUEUE_BATCHES = 100_000  # batches waiting for the thread; more are dropped (then AllBlocksCleared)
EVENT_PAGES = 4096  # most pages one snapshot event carries
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_PAGE = re.compile(r"(?:^|/)p(\d+)(?:/|$)")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ConfigError otherwise."""
    m = re.fullmatch(r"tcp://(\[[^\]]+\]|[^:/\[\]]+):(\d+)", endpoint or "")
    if not m or not 0 <= int(m.group(2)) <= 65534:
        raise ConfigError("metaserver", f"kv_events must be tcp://HOST:PORT (port 0: any; else PORT and PORT+1), "
                                        f"got {endpoint!r}")
    return m.group(1), int(m.group(2))


def block_size_of(ns: str) -> int:
    m = _PAGE.search(ns)
    return int(m.group(1)) if m else 0


def stored_event(hashes: list, parent: bytes | None, block_size: int) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": [],
            "block_size": block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}


def removed_event(hashes: list) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}


CLEARED = {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict], ts: float | None = None, dp_rank: int = 0) -> bytes:
    """A vLLM ``KVEventBatch`` (array-like: ts, events, data_parallel_rank) in msgpack."""
    return msgpack.packb([time.time() if ts is None else ts, events, dp_rank], use_bin_type=True)


def chain_events(ns: str, keys: list, parents: list, limit: int = EVENT_PAGES) -> list[dict]:
    """``BlockStored`` events of pages (READY, in order; ``parents[i]``: page i's parent key or None): a run of pages
    each the child of the one before is one event, at most ``limit`` pages."""
    out: list[dict] = []
    bs = block_size_of(ns)
    last = None
    cur: list | None = None
    for key, parent in zip(keys, parents):
        if cur is not None and parent is not None and parent == last and len(cur) < limit:
            cur.append(key)
        else:
            cur = [key]
            out.append(stored_event(cur, parent, bs))
        last = key
    return out


class Publisher:
    """The PUB and replay ROUTER sockets of one endpoint and the thread that owns them (see the module docstring).

    ``publish(topic, events)`` and ``snapshot(jobs)`` queue work from any thread and never block; ``close()`` sends
    what is queued (bounded by ``timeout``), then closes the sockets. ``endpoint``/``replay_endpoint``: where they are
    bound (port 0 resolved)."""

    def __init__(self, endpoint: str, replay_batches: int = REPLAY_BATCHES, queue_batches: int = QUEUE_BATCHES):
        import zmq

        host, port = parse_endpoint(endpoint)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._q: queue.Queue = queue.Queue(maxsize=queue_batches)
        self.buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=replay_batches)
        self.seq = 0  # the next batch's
        self.dropped = 0  # batches dropped at a full queue
        self._lost = False
        self.sinks: set["Sink"] = set()
        self._stop = False
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = self.replay_endpoint = ""
        self._thread = threading.Thread(target=self._run, args=(host, port, replay_batches), name="kv-events",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0) or self._error is not None:
            self._stop = True
            raise StartupError("metaserver", f"kv events: cannot bind {endpoint}: {self._error or 'timed out'}")
        self.publish("", [CLEARED])

    # -- the event loop's side ---------------------------------------------------------------------------------
    def publish(self, topic: str, events: list[dict]) -> None:
        self._put(("batch", topic, events))

    def snapshot(self, jobs: list[tuple[str, list, list, bool]]) -> None:
        """Queue ``(namespace, keys, parents, removed)`` jobs: the thread turns each into batches of events (stored
        chains, or removals), in order with everything queued before and after."""
        self._put(("snapshot", jobs))

    def _put(self, item: tuple) -> None:
        try:
            self._q.put_nowait(item)
        except queue.Full:
            self.dropped += 1
            self._lost = True

    def close(self, timeout: float = 5.0) -> None:
        self._stop = True
        try:
            self._q.put(None, timeout=timeout)  # after what is queued: sent first
        except queue.Full:
            pass  # the thread is a daemon: it goes with the process
        self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------------------------------
    def _run(self, host: str, port: int, replay_batches: int) -> None:
        zmq = self._zmq
        pub = self._ctx.socket(zmq.PUB)
        rep = self._ctx.socket(zmq.ROUTER)
        try:
            pub.setsockopt(zmq.SNDHWM, 100_000)
            pub.setsockopt(zmq.LINGER, 1000)
            rep.setsockopt(zmq.SNDHWM, 2 * (replay_batches + 1))  # a whole replay and its end marker
            rep.setsockopt(zmq.LINGER, 0)
            if ":" in host.strip("[]"):
                pub.setsockopt(zmq.IPV6, 1)
                rep.setsockopt(zmq.IPV6, 1)
            if port:
                pub.bind(f"tcp://{host}:{port}")
                rep.bind(f"tcp://{host}:{port + 1}")
            else:
                pub.bind(f"tcp://{host}:0")
                rep.bind(f"tcp://{host}:0")
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.replay_endpoint = rep.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:  # noqa: BLE001 - handed to the constructor
            self._error = e
            pub.close(0)
            rep.close(0)
            self._ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            while True:
                if rep.poll(0):
                    self._replay(rep)
                try:
                    item = self._q.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                try:
                    self._send(pub, item)
                except Exception:  # noqa: BLE001 - one bad batch must not end the stream
                    log.exception("metaserver: kv events: a batch could not be sent")
        finally:
            pub.close()
            rep.close(0)
            self._ctx.term()

    def _send(self, pub: Any, item: tuple) -> None:
        if self._lost:  # batches were dropped: subscribers' views are wrong from here, so they start over
            self._lost = False
            self._emit(pub, "", [CLEARED])
        if item[0] == "batch":
            self._emit(pub, item[1], item[2])
            return
        for ns, keys, parents, removed in item[1]:
            if removed:
                for i in range(0, len(keys), EVENT_PAGES):
                    self._emit(pub, ns, [removed_event(keys[i:i + EVENT_PAGES])])
            else:
                events = chain_events(ns, keys, parents)
                for i in range(0, len(events), 64):
                    self._emit(pub, ns, events[i:i + 64])

    def _emit(self, pub: Any, topic: str, events: list[dict]) -> None:
        t = topic.encode()
        seq = self.seq.to_bytes(8, "big")
        payload = encode_batch(events)
        pub.send_multipart((t, seq, payload))
        self.buffer.append((self.seq, t, payload))
        self.seq += 1

    def _replay(self, rep: Any) -> None:
        frames = rep.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("metaserver: kv events: a replay request of %d frames ignored", len(frames))
            return
        ident, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, topic, payload in list(self.buffer):
            if seq >= first:
                rep.send_multipart((ident, b"", topic, seq.to_bytes(8, "big"), payload))
        rep.send_multipart((ident, b"", b"", END_SEQ, b""))


class Sink:
    """What one directory reports (its ``kv_sink``), gathered per namespace and handed to the publisher as one batch
    per namespace at the end of the burst of mutations (``call_soon``). Order within a namespace is kept."""

    __slots__ = ("pub", "loop", "pending", "scheduled")

    def __init__(self, pub: Publisher, loop: asyncio.AbstractEventLoop | None):
        self.pub = pub
        self.loop = loop
        self.pending: dict[str, list] = {}  # ns -> [["S", keys, parent] | ["R", keys], ...]
        self.scheduled = False

    def stored_keys(self, ns: str, keys: list, parents: list) -> None:
        """Pages of ``ns`` became READY (``parents[i]``: the parent key page i names, or None), in order."""
        ops = self.pending.get(ns)
        if ops is None:
            ops = self.pending[ns] = []
        last = ops[-1] if ops else None
        for key, parent in zip(keys, parents):
            if (last is not None and last[0] == "S" and parent is not None and last[1][-1] == parent
                    and len(last[1]) < EVENT_PAGES):
                last[1].append(key)
            else:
                last = ["S", [key], parent]
                ops.append(last)
        self._schedule()

    def removed_keys(self, ns: str, keys: list) -> None:
        """READY pages of ``ns`` left (evicted, removed, drained, dropped with a lost node)."""
        ops = self.pending.get(ns)
        if ops is None:
            ops = self.pending[ns] = []
        last = ops[-1] if ops and ops[-1][0] == "R" else None
        for key in keys:
            if last is None or len(last[1]) >= EVENT_PAGES:
                last = ["R", []]
                ops.append(last)
            last[1].append(key)
        self._schedule()

    def _schedule(self) -> None:
        if self.scheduled:
            return
        self.scheduled = True
        if self.loop is None:
            self.flush()
        else:
            self.loop.call_soon_threadsafe(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        pending, self.pending = self.pending, {}
        for ns, ops in pending.items():
            bs = block_size_of(ns)
            self.pub.publish(ns, [stored_event(op[1], op[2], bs) if op[0] == "S" else removed_event(op[1])
                                  for op in ops])


# ---- the service's side ---------------------------------------------------------------------------------------

_publishers: dict[str, Publisher] = {}


def publisher(endpoint: str) -> Publisher:
    """The process's publisher of ``endpoint`` (started at the first call; the slots of a partitioned process share
    it)."""
    pub = _publishers.get(endpoint)
    if pub is None:
        pub = _publishers[endpoint] = Publisher(endpoint)
    return pub


def close(endpoint: str) -> None:
    pub = _publishers.pop(endpoint, None)
    if pub is not None:
        pub.close()


def attach(pub: Publisher, directory: Any) -> None:
    """A term starts serving ``directory``: its READY pages are announced (in the publisher's thread) and its
    changes reported from now on."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    sink = Sink(pub, loop)
    pub.sinks.add(sink)
    pub.snapshot([(ns, keys, parents, False) for ns, keys, parents in directory.links.snapshot()])
    directory.kv_sink = sink


def detach(pub: Publisher, directory: Any) -> None:
    """A term stops serving ``directory``: what it reported is withdrawn: ``AllBlocksCleared`` when it is the only
    directory this publisher reports (an unpartitioned metaserver), else a removal of each of its READY pages (a
    slot of a partitioned one; the other slots' pages stay)."""
    sink = getattr(directory, "kv_sink", None)
    if sink is None:
        return
    directory.kv_sink = None
    sink.flush()
    pub.sinks.discard(sink)
    if pub.sinks:
        pub.snapshot([(ns, keys, parents, True) for ns, keys, parents in directory.links.snapshot()])
    else:
        pub.publish("", [CLEARED])
