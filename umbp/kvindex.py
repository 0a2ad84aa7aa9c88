"""The subscriber side of KV events: vLLM-format event streams (``umbp metaserver --kv-events``, vLLM engines'
``--kv-events-config``) into an index of which source holds which blocks, for a router (``umbp.routing.PoolPrefix``).

- ``BlockIndex``: per source (one per publisher: a metaserver, an engine), the set of block hashes it holds;
  ``apply(source, events)`` takes decoded events (``decode``), ``prefix(source, keys)`` answers how many leading
  keys of a chain the source holds. Keys may be given as the pool names them (``umbp.keys`` 64-hex strings): they
  are compared in the pool's form (``normalize_key``: 32 raw bytes), the form the metaserver publishes.
- ``Subscriber``: a SUB socket on one publisher and a DEALER on its replay socket. It asks for a replay from the
  next expected seq when it starts and whenever seq jumps (a batch lost in between), so the index stays exact as
  long as the publisher's replay buffer still holds what was missed; a seq lower than expected (a restarted
  publisher) is taken as is (its first batch is ``AllBlocksCleared``).

Not thread-safe: one thread polls and routes. Costs: ``apply`` O(hashes); ``prefix`` O(matched keys).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import msgpack

from umbp.keys import normalize_key

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode(payload: bytes) -> tuple[float, list[dict], int | None]:
    """(ts, events, data_parallel_rank) of a msgpack ``KVEventBatch``; events as dicts tagged ``"type"``."""
    d = msgpack.unpackb(payload, raw=False)
    return d[0], d[1], d[2] if len(d) > 2 else None


class BlockIndex:
    def __init__(self) -> None:
        self.blocks: dict[str, set] = {}

    def apply(self, source: str, events: Iterable[dict]) -> None:
        held = self.blocks.setdefault(source, set())
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                held.update(ev["block_hashes"])
            elif kind == "BlockRemoved":
                held.difference_update(ev["block_hashes"])
            elif kind == "AllBlocksCleared":
                held.clear()

    def prefix(self, source: str | Sequence[str], keys: Sequence[Any]) -> int:
        """Leading ``keys`` held by ``source``, or by any of several (the metaservers of a partitioned pool: one
        source per publisher, since each stream's ``AllBlocksCleared`` speaks for that stream only)."""
        sets = [h for s in ((source,) if isinstance(source, str) else source) if (h := self.blocks.get(s))]
        if not sets:
            return 0
        n = 0
        for k in keys:
            k = k if type(k) is bytes else normalize_key(k)
            if not any(k in h for h in sets):
                break
            n += 1
        return n


class Subscriber:
    """One publisher's stream into ``index`` under ``source`` (see the module docstring). ``poll(timeout_ms)``
    applies what arrived within the timeout and returns how many batches it applied; ``close()`` closes the
    sockets (the context is the caller's, or this object's own)."""

    def __init__(self, index: BlockIndex, source: str, endpoint: str, replay_endpoint: str | None = None,
                 topic: bytes = b"", ctx: Any = None):
        import zmq

        self._zmq = zmq
        self._own = ctx is None
        self.ctx = ctx or zmq.Context()
        self.index, self.source = index, source
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = None
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.DEALER)
            self.replay.connect(replay_endpoint)
        self.next_seq = 0
        self.replays = 0
        self.lost = 0  # batches missed for good (the replay buffer no longer held them)
        self._replaying = False
        if self.replay is not None:
            self._ask(0)

    def _ask(self, seq: int) -> None:
        self.replay.send_multipart((b"", seq.to_bytes(8, "big")))
        self._replaying = True
        self.replays += 1

    def _take(self, seq: int, payload: bytes, replayed: bool = False) -> bool:
        if seq < self.next_seq and not (seq == 0 and not self._replaying):
            return False  # seen already (a replay overlapping the live stream)
        if seq > self.next_seq and replayed:
            self.lost += seq - self.next_seq  # older than the publisher's buffer: gone; the index may be stale
        elif seq > self.next_seq and self.replay is not None:
            if not self._replaying:
                self._ask(self.next_seq)  # a gap: the missed batches come from the replay socket
            return False
        self.index.apply(self.source, decode(payload)[1])
        self.next_seq = seq + 1
        return True

    def poll(self, timeout_ms: int = 0) -> int:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        applied = 0
        for _ in range(1_000_000):  # bounded: a batch per iteration
            ready = dict(poller.poll(timeout_ms))
            if not ready:
                return applied
            timeout_ms = 0
            if self.replay is not None and self.replay in ready:
                frames = self.replay.recv_multipart()
                if frames[2] == END_SEQ:
                    self._replaying = False
                else:
                    applied += self._take(int.from_bytes(frames[2], "big"), frames[3], replayed=True)
            if self.sub in ready:
                _, seq, payload = self.sub.recv_multipart()
                applied += self._take(int.from_bytes(seq, "big"), payload)
        return applied

    def close(self) -> None:
        self.sub.close(0)
        if self.replay is not None:
            self.replay.close(0)
        if self._own:
            self.ctx.term()
