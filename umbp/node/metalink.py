"""The storage node's link to the metaserver (``MetaLink``): register, heartbeat, follow the leader.

One asyncio connection at a time from the node to whichever metaserver leads: HELLO/AUTH with the cluster secret
(a token-holding node refuses an open metaserver), REGISTER_NODE (its answer carries the node's capability epoch,
the first generation of the leader's term: write capabilities of older epochs and, open pools too, writes of older
generations die at the node from then on, ``NodeServer.check_write``, also while their data is arriving), then a
HEARTBEAT at once and every ``heartbeat_s`` after. The registration says ``acks_floor``: the heartbeats carry the
floor the node holds, and a one-slot leader places nothing on the node before one says it holds this term's (a
deposed leader's writer, still streaming, cannot land over a page of the new term). Any failure closes the connection
and retries with bounded backoff; every step is bounded in time.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from transport import wire
from transport.framed import ask_async, handshake_async
from umbp.config import split_host_port
from umbp.errors import BadRequest, NotFound, NotLeader, ProtocolError, UmbpError
from umbp.tls import client_context

if TYPE_CHECKING:
    from umbp.node.server import NodeServer


class MetaLink:
    """The node's connection to the metaserver: register, then heartbeat; re-register after any failure.

    Convergence after a failover: the node cycles through its ``--metaserver`` list plus any leader named in a
    NOT_LEADER answer, first retry after RETRY_FIRST_S and doubling to at most RETRY_MAX_S, so it is registered with
    a new leader well within a second of that leader serving. Each attempt is bounded (connect, REGISTER) so a
    frozen metaserver costs a couple of seconds, not a lease_ttl. A NOT_FOUND heartbeat answer (the metaserver does
    not know this registration, e.g. it just took over) re-registers on the same address at once."""

    RETRY_FIRST_S = 0.05
    RETRY_MAX_S = 0.5

    def __init__(self, node: "NodeServer"):
        self.node = node
        self.addrs = list(node.config.metaserver)
        self.component = f"{node.component} metaserver-link"
        self._rid = 0
        self.announced = False
        self.leader: str | None = None  # the metaserver the node is registered with, while it is
        # a metaserver that refuses the disk tier's fields (one from before it) gets a registration without them
        self.disk_fields = node.disk is not None
        self.acks_floor = True  # False for a metaserver from before ``acks_floor`` (it refuses the field)

    async def _request(self, reader, writer, op: int, meta: Any, timeout: float) -> Any:
        self._rid += 1
        return await ask_async(reader, writer, self._rid, op, meta, timeout, self.component)

    async def _authenticate(self, reader, writer, timeout: float) -> None:
        """HELLO (+ AUTH with the cluster secret when the metaserver is closed); AuthError when refused."""
        await handshake_async(lambda op, meta: self._request(reader, writer, op, meta, timeout),
                              self.node.config.token, self.node.node_id, self.component)

    async def _idle(self, reader, interval: float) -> None:
        """Wait ``interval`` between heartbeats, but notice at once when the metaserver closes the connection (it
        died or stepped down): it never sends unsolicited frames, so anything read here is the end of the link."""
        try:
            got = await asyncio.wait_for(reader.read(1), interval)
        except asyncio.TimeoutError:
            return
        raise ProtocolError(self.component, "metaserver closed the connection" if not got
                            else "unsolicited bytes from the metaserver")

    def registration(self) -> dict:
        n = self.node
        return {"node_id": n.node_id, "host": n.host, "port": n.port, "pid": os.getpid(),
                "capacity": n.config.capacity, "arena_id": n.arena.arena_id, "arena_path": n.arena.path,
                "boot_id": n.boot_id, "hostname": socket.gethostname(), "transports": n.transports(),
                "lease_ttl": n.config.lease_ttl, "rdma": n.rdma.info() if n.rdma is not None else None,
                **(n.disk_info() if self.disk_fields else {}), **({"acks_floor": True} if self.acks_floor else {})}

    async def run(self) -> None:
        """Forever: connect to a metaserver, register, heartbeat until the connection fails; then retry."""
        delay = self.RETRY_FIRST_S
        idx = 0
        ttl = self.node.config.lease_ttl
        step_s = min(2.0, max(1.0, ttl / 3))  # bound on connect and on REGISTER's answer
        quiet = 0  # consecutive failures; log the first few of a streak only
        while True:
            addr = self.addrs[idx % len(self.addrs)]
            writer = None
            try:
                host, port = split_host_port(addr, self.component)
                tls = self.node.config.tls_ca  # TLS to the metaserver, its certificate checked against this CA
                reader, writer = await asyncio.wait_for(asyncio.open_connection(
                    host, port, **({"ssl": client_context(tls, self.component), "server_hostname": host} if tls
                                   else {})), step_s)
                await self._authenticate(reader, writer, step_s)
                reply = await self._request(reader, writer, wire.Op.REGISTER_NODE, self.registration(), step_s)
                delay = self.RETRY_FIRST_S
                quiet = 0
                self.leader = addr
                if not self.announced:
                    self.announced = True
                    n = self.node
                    print(f"node {n.node_id}: serving on {n.host}:{n.port} arena {n.arena.path} "
                          f"({'reopened' if n.arena.reopened else 'new'}, kept {reply.get('kept', 0)} pages)",
                          flush=True)
                else:
                    print(f"{self.component}: registered with {addr} (kept {reply.get('kept', 0)}, dropped "
                          f"{reply.get('dropped', 0)} pages)", file=sys.stderr, flush=True)
                epoch = reply.get("epoch", 0)
                if type(epoch) is int:
                    if epoch > self.node.cap_epoch:
                        self.node.cap_epoch = epoch  # capabilities of an earlier registration or term die here
                    self.node.floors.register(epoch)  # so do writes of its generations (0: slots fence their own)
                interval = float(reply.get("heartbeat_s", ttl / 3))
                beat = {"node_id": self.node.node_id, "arena_id": self.node.arena.arena_id}
                if self.acks_floor:
                    beat["floor"] = self.node.floors.reg
                while True:
                    await self._request(reader, writer, wire.Op.HEARTBEAT, beat, max(interval, 1.0))
                    await self._idle(reader, interval)
            except NotLeader as e:
                self.leader = None
                if e.leader and e.leader != addr:
                    if e.leader not in self.addrs:
                        self.addrs.append(e.leader)
                    idx = self.addrs.index(e.leader)
                    continue  # straight to the named leader; a stale name fails to connect and costs one delay
                idx += 1
            except NotFound:
                self.leader = None  # this metaserver lost our registration (it took over): register again here
            except BadRequest as e:
                self.leader = None
                if self.acks_floor and "'acks_floor'" in str(e):
                    self.acks_floor = False
                    print(f"{self.component}: {addr} does not take acks_floor ({e}): registered without it",
                          file=sys.stderr, flush=True)
                    continue
                if self.disk_fields and "'disk_" in str(e):
                    self.disk_fields = False
                    print(f"{self.component}: {addr} does not know the disk tier ({e}): registered without it; "
                          f"its disk pages go unused", file=sys.stderr, flush=True)
                    continue
                print(f"{self.component}: {addr}: {e}; retrying", file=sys.stderr, flush=True)
                idx += 1
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, UmbpError) as e:
                self.leader = None
                quiet += 1
                if quiet <= 3:
                    print(f"{self.component}: {addr}: {type(e).__name__}: {e}; retrying", file=sys.stderr,
                          flush=True)
                idx += 1
            finally:
                if writer is not None:
                    writer.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.RETRY_MAX_S)
