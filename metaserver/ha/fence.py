"""FENCE: a partitioned pool's new slot leader kills the writes of the slot's earlier terms on every node before it
places on it (``fence_nodes``): their capabilities in a closed pool, and in any pool every write of a generation
below the term's first, also one whose data is still arriving (an open pool's FENCE is ``{epoch, slots}``, no MAC, for
nodes that say ``acks_floor``; older nodes are left unfenced and placed on as before).

Why: a node cannot order S slot leaders' terms with one epoch, so it keeps one floor per slot (per region of its
arena: ``umbp.floors.SlotFloors``). A slot leader's capabilities carry ``slotrules.SLOT_EPOCH | g``, g the slot's
generation floor at its takeover (``(s << 52) + counter``, increasing across the slot's terms). The new leader sends
each node a ``auth.fence_token`` (epoch, slot count, MAC under the node's ``cap_key``; the node needs no AUTH for it:
only a holder of the cluster secret can make one) on a short connection of its own; the node raises the slot's floor
and answers it. A node that cannot be reached within ``FENCE_TIMEOUT_S`` stays out of the slot's placement until a
later fence reaches it (``SlotServer``), so the new term never hands out bytes a deposed leader's grant may still
write.

Imports the wire module and the shared leaves only. Costs: one connection, one frame each way per node, all nodes
in parallel.
"""

from __future__ import annotations

import asyncio
import ssl

from transport import wire
from transport.wire import Op
from umbp.auth import fence_token
from umbp.errors import UmbpError
from umbp.tls import client_context

FENCE_TIMEOUT_S = 1.0  # connect + answer, per node


async def fence_node(host: str, port: int, token: bytes, tls: ssl.SSLContext | None,
                     timeout: float = FENCE_TIMEOUT_S) -> int:
    """Send one FENCE to the node at host:port; returns the floor it answers. UmbpError (the node refused: a bad
    token, an open pool), OSError or TimeoutError otherwise."""
    comp = f"metaserver: fence {host}:{port}"

    async def go() -> int:
        reader, writer = await asyncio.open_connection(host, port, ssl=tls,
                                                       server_hostname=host if tls is not None else None)
        try:
            writer.write(wire.encode(Op.FENCE, 1, token))
            await writer.drain()
            head = await reader.readexactly(wire.HEADER_SIZE)
            op, flags, status, rid, meta_len, data_len = wire.decode_header(head, comp, max_meta=1 << 16,
                                                                              max_data=0)
            meta = wire.unpack_meta(await reader.readexactly(meta_len), comp) if meta_len else None
            wire.raise_for_status(wire.Frame(op, flags, status, rid, meta, None, 0), comp)
            if type(meta) is not dict or type(meta.get("floor")) is not int:
                raise UmbpError(f"{comp}: malformed FENCE answer {meta!r}")
            return meta["floor"]
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


async def fence_nodes(nodes: list, epoch: int, slots: int, tls_ca: str) -> dict[str, str]:
    """FENCE every node of ``nodes`` (members with ``node_id``, ``host``, ``port``, ``cap_key``) at ``epoch``, in
    parallel. Returns {node_id: why} for those not fenced (empty: all were)."""
    tls = client_context(tls_ca, "metaserver") if tls_ca else None

    async def one(n) -> str:
        token = fence_token(n.cap_key, epoch, slots) if n.cap_key is not None else {"epoch": epoch, "slots": slots}
        try:
            floor = await fence_node(n.host, n.port, token, tls)
        except (UmbpError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            return f"{type(e).__name__}: {e}"
        return "" if floor >= epoch else f"the node answered floor {floor:#x} below {epoch:#x}"

    targets = [n for n in nodes if (n.cap_key is not None or n.acks_floor) and n.host and n.port]
    res = await asyncio.gather(*(one(n) for n in targets))
    return {n.node_id: why for n, why in zip(targets, res) if why}
