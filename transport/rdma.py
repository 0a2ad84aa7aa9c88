"""transport rdma: one-sided RDMA READ/WRITE over reliable-connected (RC) queue pairs, through pyverbs.

Three pieces, used the same way by the node and the client:

- ``rdma_available()`` says whether verbs can run here and why not (pyverbs missing, no device); it never raises,
  so ``transport="auto"`` can fall back to TCP on hosts without RDMA.
- ``RdmaContext`` opens the device and one protection domain per process and registers memory with narrow access:
  the node's arena ``ARENA_ACCESS`` (local write, remote read, remote write), client buffers ``CLIENT_ACCESS``
  (local write only: nothing remote can touch a client).
- ``RcEndpoint`` is one CQ + one RC QP. Peers swap ``local_info()`` dicts (msgpack-able; the node's TCP control
  port carries them as ``RDMA_CONNECT``) and each calls ``connect(remote)``. Only the client posts work; the node's
  endpoint just answers in hardware. ``post_reads``/``post_writes`` queue requests and return their ids; ``poll``
  posts queued work as the window allows and reaps completions; ``transfer`` does both until a batch is done.

Invariants and contracts:

- At most ``depth`` work requests are outstanding per QP. Requests queue beyond that and are posted as completions
  free room, many per doorbell (one ``ibv_post_send`` of a linked ``SendWR`` list). Only every ``SIGNAL_EVERY``-th
  and the last WR of a doorbell is signaled: RC completes in order, so a good completion vouches for every WR
  posted before it.
- Requests whose remote ranges are contiguous (same rkey, each starting where the previous ended) are coalesced
  into one WR whose local side is a scatter-gather list (up to the device's ``max_sge``). A request may also bring
  its own list of local segments for one remote range. Results stay per request.
- The first error completion breaks the QP: the failed request reports its ibv status name (e.g.
  ``IBV_WC_REM_ACCESS_ERR`` for a revoked rkey, ``IBV_WC_RETRY_EXC_ERR`` for a dead peer), every request posted
  or queued after it reports ``IBV_WC_WR_FLUSH_ERR``, and further posts raise ``TransportError`` until ``reset()``.
  A request never reports success unless the device completed it, so bytes of a failed read are never vouched for.
- ``transfer`` holds one deadline for the whole batch. On expiry the QP is moved to the error state (the device
  stops touching the caller's buffers once it flushes), marked broken, and ``DeadlineExceeded`` is raised.
- Every pyverbs exception is translated here into ``TransportError("transport rdma: ...")`` with ``from``.
- Not thread-safe: one endpoint belongs to one thread. ``poll`` busy-polls the CQ, then backs off with sleeps
  (50 us growing to 1 ms), so a blocked poll costs little CPU but adds up to 1 ms latency after a quiet spell.

Costs: a request is a few Python objects (SGE, SendWR) plus its share of one syscall-free doorbell (rxe's doorbell
is a syscall); a batch of N contiguous requests becomes ceil(N / max_sge) WRs. Registration pins memory: register
the arena and long-lived client buffers once, not per transfer.

Dead peer detection follows RC retransmission: ``timeout`` (4.096 us * 2**timeout per try) times ``retry_cnt``
retries, by default about 7 * 0.27 s ~ 2 s. ``retry_cnt`` must stay below 7: rxe (like some HCAs) treats 7 as
"retry forever", and a dead peer would then never be reported.
"""

from __future__ import annotations

import ctypes
import ipaddress
import mmap
import os
import random
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from umbp.errors import DeadlineExceeded, TransportError

COMPONENT = "transport rdma"

try:  # pyverbs exists only for Debian's /usr/bin/python3 (or a venv that sees its dist-packages)
    import pyverbs.enums as _e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context, get_device_list
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.pyverbs_error import PyverbsError
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR

    _IMPORT_ERROR: str | None = None
except Exception as exc:  # noqa: BLE001 -- ImportError, or a broken install raising anything at import
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
    PyverbsError = OSError  # type: ignore[misc,assignment]  # keeps the except clauses below valid

if _IMPORT_ERROR is None:
    ARENA_ACCESS = _e.IBV_ACCESS_LOCAL_WRITE | _e.IBV_ACCESS_REMOTE_READ | _e.IBV_ACCESS_REMOTE_WRITE
    CLIENT_ACCESS = _e.IBV_ACCESS_LOCAL_WRITE
else:  # the numeric values of ibv_access_flags, so callers can name them on hosts without pyverbs
    ARENA_ACCESS = 1 | 4 | 2
    CLIENT_ACCESS = 1

# ibv_wc_status, in enum order (verbs.h); pyverbs' enum names mix statuses with opcodes, so spell them out.
WC_STATUS = (
    "IBV_WC_SUCCESS", "IBV_WC_LOC_LEN_ERR", "IBV_WC_LOC_QP_OP_ERR", "IBV_WC_LOC_EEC_OP_ERR", "IBV_WC_LOC_PROT_ERR",
    "IBV_WC_WR_FLUSH_ERR", "IBV_WC_MW_BIND_ERR", "IBV_WC_BAD_RESP_ERR", "IBV_WC_LOC_ACCESS_ERR",
    "IBV_WC_REM_INV_REQ_ERR", "IBV_WC_REM_ACCESS_ERR", "IBV_WC_REM_OP_ERR", "IBV_WC_RETRY_EXC_ERR",
    "IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR", "IBV_WC_REM_ABORT_ERR",
    "IBV_WC_INV_EECN_ERR", "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR", "IBV_WC_RESP_TIMEOUT_ERR",
    "IBV_WC_GENERAL_ERR", "IBV_WC_TM_ERR", "IBV_WC_TM_RNDV_INCOMPLETE",
)
FLUSHED = "IBV_WC_WR_FLUSH_ERR"
TIMED_OUT = "UMBP_DEADLINE"  # a request cancelled because ``transfer``'s deadline passed
POST_FAILED = "UMBP_POST_SEND_FAILED"  # ibv_post_send refused the doorbell carrying the request

DEFAULT_DEPTH = 128
SIGNAL_EVERY = 16
MAX_WR_BYTES = 1 << 30  # cap on a coalesced WR (rxe's max_msg_sz is 2 GiB)
PORT = 1

_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def status_name(status: int) -> str:
    return WC_STATUS[status] if 0 <= status < len(WC_STATUS) else f"IBV_WC_STATUS_{status}"


def _fail(what: str, exc: BaseException) -> TransportError:
    return TransportError(COMPONENT, f"{what}: {exc}")


def rdma_available(device_name: str | None = None) -> tuple[bool, str]:
    """(True, "device NAME") when pyverbs imports and an RDMA device is present, else (False, why). Never raises."""
    if _IMPORT_ERROR is not None:
        return False, f"{COMPONENT}: pyverbs not importable ({_IMPORT_ERROR})"
    try:
        names = [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in get_device_list()]
    except Exception as exc:  # noqa: BLE001 -- PyverbsRDMAError("Failed to get devices list") without RDMA
        return False, f"{COMPONENT}: no RDMA device ({getattr(exc, 'args', [exc])[0] if exc.args else exc})"
    if not names:
        return False, f"{COMPONENT}: no RDMA device (empty device list)"
    if device_name is not None and device_name not in names:
        return False, f"{COMPONENT}: no RDMA device named {device_name!r} (have {', '.join(names)})"
    return True, f"device {device_name or names[0]}"


# ------------------------------------------------------------------------------------------------ memory regions

def _address_of(buffer: Any) -> tuple[int, int, Any]:
    """(address, length, holder) of a C-contiguous buffer; ``holder`` keeps the buffer exported (and alive)."""
    mv = memoryview(buffer)
    if not mv.c_contiguous:
        raise TransportError(COMPONENT, "cannot register a non-contiguous buffer")
    mv = mv.cast("B")
    if not mv.readonly:
        holder = (ctypes.c_char * mv.nbytes).from_buffer(mv)
        return ctypes.addressof(holder), mv.nbytes, (holder, mv)
    import numpy  # read-only buffers (bytes): ctypes cannot export them, numpy can give their address

    arr = numpy.frombuffer(mv, dtype=numpy.uint8)
    return int(arr.ctypes.data), mv.nbytes, (arr, mv)


class MemoryRegion:
    """A registered buffer. ``addr``/``rkey`` go to peers (``remote_info``); ``lkey`` to local SGEs.

    While registered the buffer is pinned and exported (an mmap cannot be closed under it); ``close`` (or
    ``RdmaContext.deregister``) revokes the rkey at once: later remote access fails with IBV_WC_REM_ACCESS_ERR."""

    __slots__ = ("_holder", "access", "addr", "length", "lkey", "mr", "rkey", "view")

    def __init__(self, mr: Any, addr: int, length: int, access: int, holder: Any):
        self.mr = mr
        self.addr = addr
        self.length = length
        self.lkey = mr.lkey
        self.rkey = mr.rkey
        self.access = access
        self._holder = holder
        self.view: memoryview = holder[1]

    def remote_info(self) -> dict:
        return {"addr": self.addr, "rkey": self.rkey, "length": self.length}

    @property
    def closed(self) -> bool:
        return self.mr is None

    def close(self) -> None:
        if self.mr is not None:
            try:
                self.mr.close()
            except PyverbsError as exc:
                raise _fail("deregister", exc) from exc
            finally:
                self.mr = None
                self._holder = None  # drops the ctypes/numpy export of ``view``
                try:
                    self.view.release()
                except BufferError:  # someone still exports the view; it goes when they do
                    pass


class RdmaContext:
    """An open RDMA device with one protection domain. Create one per process (``default()`` caches it per pid:
    verbs objects do not survive fork). Chooses the GID to use unless ``gid_index`` is given: RoCE v2 first, then
    IPv4-mapped, then global IPv6, then link-local (link-local on ``lo`` cannot route; on a real link it can)."""

    _default: tuple[int, RdmaContext] | None = None

    def __init__(self, device_name: str | None = None, gid_index: int | None = None):
        ok, why = rdma_available(device_name)
        if not ok:
            raise TransportError(COMPONENT, why.removeprefix(f"{COMPONENT}: "))
        try:
            name = device_name or next(iter(get_device_list())).name
            name = name.decode() if isinstance(name, bytes) else name
            self.ctx = Context(name=name)
            self.name = name
            self.device_attr = self.ctx.query_device()
            self.port_attr = self.ctx.query_port(PORT)
            self.gid_index = self._pick_gid() if gid_index is None else gid_index
            self.gid = self.ctx.query_gid(PORT, self.gid_index).gid
            self.pd = PD(self.ctx)
        except TransportError:
            raise
        except (PyverbsError, StopIteration) as exc:
            raise _fail(f"open device {device_name or '(first)'}", exc) from exc
        self.regions: set[MemoryRegion] = set()

    @classmethod
    def default(cls) -> RdmaContext:
        if cls._default is None or cls._default[0] != os.getpid():
            cls._default = (os.getpid(), cls())
        return cls._default[1]

    def _pick_gid(self) -> int:
        best: tuple[tuple, int] | None = None
        for idx in range(self.port_attr.gid_tbl_len):
            try:
                gid = self.ctx.query_gid(PORT, idx).gid
                gtype = self.ctx.query_gid_type(PORT, idx)
            except PyverbsError:
                continue
            ip = ipaddress.IPv6Address(gid)
            if ip.is_unspecified:
                continue
            v2 = gtype in (_e.IBV_GID_TYPE_SYSFS_ROCE_V2, _e.IBV_GID_TYPE_ROCE_V2)
            rank = (not v2, ip.ipv4_mapped is None, ip.is_link_local, idx)
            if best is None or rank < best[0]:
                best = (rank, idx)
        if best is None:
            raise TransportError(COMPONENT, f"device {self.name} port {PORT} has no usable GID")
        return best[1]

    def register(self, buffer: Any, access: int = CLIENT_ACCESS) -> MemoryRegion:
        """Pin and register ``buffer`` (anything with the buffer protocol, C-contiguous). Read-only buffers can
        only be registered for local reads (``access=0``), i.e. as sources of RDMA WRITEs."""
        addr, length, holder = _address_of(buffer)
        if length == 0:
            raise TransportError(COMPONENT, "cannot register an empty buffer")
        if memoryview(buffer).readonly and access & CLIENT_ACCESS:
            raise TransportError(COMPONENT, "a read-only buffer can only be registered with access=0")
        try:
            mr = MR(self.pd, length, access, address=addr)
        except PyverbsError as exc:
            raise _fail(f"register {length} bytes", exc) from exc
        region = MemoryRegion(mr, addr, length, access, holder)
        self.regions.add(region)
        return region

    def alloc(self, length: int, access: int = CLIENT_ACCESS) -> MemoryRegion:
        """Register a fresh page-aligned anonymous mapping of ``length`` bytes (staging buffers, tests)."""
        return self.register(mmap.mmap(-1, length), access)

    def deregister(self, region: MemoryRegion) -> None:
        self.regions.discard(region)
        region.close()

    def close(self) -> None:
        for region in list(self.regions):
            self.deregister(region)
        try:
            self.pd.close()
            self.ctx.close()
        except PyverbsError as exc:
            raise _fail("close device", exc) from exc


# ----------------------------------------------------------------------------------------------------- endpoint

@dataclass(slots=True)
class _Wr:
    seq: int  # wr_id
    opcode: int
    sges: list  # [(addr, length, lkey)]
    remote_addr: int
    rkey: int
    nbytes: int
    req_ids: list


Request = tuple  # (local_mr, local_off, length, remote_addr, rkey) or ([(mr, off, len), ...], remote_addr, rkey)


class RcEndpoint:
    """One RC queue pair and its completion queue. Lifecycle: create -> ``local_info()`` to the peer ->
    ``connect(peer_info)`` -> post/poll/transfer ... -> on error ``reset()`` (new QP: swap infos and connect again)
    -> ``close()``. ``remote_access=True`` lets the peer READ/WRITE MRs of this PD through this QP (the node side);
    a client endpoint leaves it False."""

    def __init__(self, ctx: RdmaContext, *, depth: int = DEFAULT_DEPTH, remote_access: bool = False,
                 timeout: int = 16, retry_cnt: int = 6, max_sge: int | None = None):
        self.ctx = ctx
        attr = ctx.device_attr
        self.depth = max(1, min(depth, attr.max_qp_wr))
        self.max_sge = max(1, min(max_sge or 32, attr.max_sge))
        self.rd_atomic = max(1, min(16, attr.max_qp_rd_atom, attr.max_qp_init_rd_atom))
        self.remote_access = remote_access
        self.timeout = timeout
        self.retry_cnt = retry_cnt
        self.broken: str | None = None  # why the QP is unusable, until reset()
        self.connected = False
        self._seq = 0
        self._next_req = 0
        self._queue: deque[_Wr] = deque()  # built, not yet posted
        self._inflight: deque[_Wr] = deque()  # posted, in post order
        self._done: list[tuple[int, str | None]] = []
        self.stats = {"wrs": 0, "doorbells": 0, "bytes": 0, "requests": 0}
        self.cq = self.qp = None
        self._create()

    # -- setup
    def _create(self) -> None:
        try:
            self.cq = CQ(self.ctx.ctx, 2 * self.depth + 16)
            cap = QPCap(max_send_wr=self.depth, max_recv_wr=1, max_send_sge=self.max_sge, max_recv_sge=1)
            self.qp = QP(self.ctx.pd, QPInitAttr(qp_type=_e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap,
                                                 sq_sig_all=0))
        except PyverbsError as exc:
            raise _fail("create queue pair", exc) from exc
        self.psn = random.getrandbits(24)
        self.broken = None
        self.connected = False

    def local_info(self) -> dict:
        """What the peer needs to connect to this QP (msgpack-able: ints and one str)."""
        if self.qp is None:
            raise TransportError(COMPONENT, "endpoint is closed")
        return {"qpn": self.qp.qp_num, "psn": self.psn, "gid": self.ctx.gid, "lid": self.ctx.port_attr.lid,
                "mtu": int(self.ctx.port_attr.active_mtu), "gid_index": self.ctx.gid_index,
                "rd_atomic": self.rd_atomic}

    def connect(self, remote: dict) -> None:
        """Move the QP INIT -> RTR -> RTS towards ``remote`` (the peer's ``local_info()``). Does not block."""
        try:
            qpn, psn, gid = int(remote["qpn"]), int(remote["psn"]), str(remote["gid"])
            mtu = min(int(remote["mtu"]), int(self.ctx.port_attr.active_mtu))
            rd = max(1, min(self.rd_atomic, int(remote.get("rd_atomic", 1))))
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(COMPONENT, f"bad peer queue-pair info {remote!r}") from exc
        access = _e.IBV_ACCESS_LOCAL_WRITE
        if self.remote_access:
            access |= _e.IBV_ACCESS_REMOTE_READ | _e.IBV_ACCESS_REMOTE_WRITE
        try:
            a = QPAttr()
            a.qp_state = _e.IBV_QPS_INIT
            a.pkey_index = 0
            a.port_num = PORT
            a.qp_access_flags = access
            self.qp.modify(a, _e.IBV_QP_STATE | _e.IBV_QP_PKEY_INDEX | _e.IBV_QP_PORT | _e.IBV_QP_ACCESS_FLAGS)

            gr = GlobalRoute(dgid=GID(gid), sgid_index=self.ctx.gid_index, hop_limit=64)
            a = QPAttr()
            a.qp_state = _e.IBV_QPS_RTR
            a.path_mtu = mtu
            a.dest_qp_num = qpn
            a.rq_psn = psn
            a.max_dest_rd_atomic = self.rd_atomic
            a.min_rnr_timer = 12
            a.ah_attr = AHAttr(gr=gr, is_global=1, dlid=int(remote.get("lid", 0)), port_num=PORT)
            self.qp.modify(a, _e.IBV_QP_STATE | _e.IBV_QP_AV | _e.IBV_QP_PATH_MTU | _e.IBV_QP_DEST_QPN
                           | _e.IBV_QP_RQ_PSN | _e.IBV_QP_MAX_DEST_RD_ATOMIC | _e.IBV_QP_MIN_RNR_TIMER)

            a = QPAttr()
            a.qp_state = _e.IBV_QPS_RTS
            a.timeout = self.timeout
            a.retry_cnt = self.retry_cnt
            a.rnr_retry = 7
            a.sq_psn = self.psn
            a.max_rd_atomic = rd
            self.qp.modify(a, _e.IBV_QP_STATE | _e.IBV_QP_TIMEOUT | _e.IBV_QP_RETRY_CNT | _e.IBV_QP_RNR_RETRY
                           | _e.IBV_QP_SQ_PSN | _e.IBV_QP_MAX_QP_RD_ATOMIC)
        except PyverbsError as exc:
            self.broken = f"connect failed: {exc}"
            raise _fail(f"connect to qpn {qpn} gid {gid}", exc) from exc
        self.connected = True

    # -- posting
    def post_reads(self, reqs: Iterable[Request]) -> list[int]:
        """Queue RDMA READs (remote -> local); returns one request id per request. Does not block."""
        return self._submit(_e.IBV_WR_RDMA_READ, reqs)

    def post_writes(self, reqs: Iterable[Request]) -> list[int]:
        """Queue RDMA WRITEs (local -> remote); returns one request id per request. Does not block."""
        return self._submit(_e.IBV_WR_RDMA_WRITE, reqs)

    def _check_usable(self) -> None:
        if self.qp is None:
            raise TransportError(COMPONENT, "endpoint is closed")
        if self.broken:
            raise TransportError(COMPONENT, f"queue pair {self.qp.qp_num} is broken ({self.broken}); reset() it")
        if not self.connected:
            raise TransportError(COMPONENT, "queue pair is not connected")

    def _submit(self, opcode: int, reqs: Iterable[Request]) -> list[int]:
        self._check_usable()
        ids: list[int] = []
        last: _Wr | None = self._queue[-1] if self._queue else None
        for req in reqs:
            if len(req) == 5:
                mr, off, length, raddr, rkey = req
                segs = [(mr, off, length)]
            elif len(req) == 3:
                segs, raddr, rkey = req
            else:
                raise TransportError(COMPONENT, f"bad request {req!r}")
            sges, nbytes = [], 0
            for mr, off, length in segs:
                if mr.closed or off < 0 or length <= 0 or off + length > mr.length:
                    raise TransportError(COMPONENT, f"local range [{off}, {off}+{length}) outside registered "
                                                    f"region of {mr.length} bytes (or region closed)")
                sges.append((mr.addr + off, length, mr.lkey))
                nbytes += length
            if len(sges) > self.max_sge:
                raise TransportError(COMPONENT, f"request has {len(sges)} segments, max_sge is {self.max_sge}")
            rid = self._next_req
            self._next_req += 1
            ids.append(rid)
            if (last is not None and last.opcode == opcode and last.rkey == rkey
                    and last.remote_addr + last.nbytes == raddr and len(last.sges) + len(sges) <= self.max_sge
                    and last.nbytes + nbytes <= MAX_WR_BYTES):
                last.sges.extend(sges)  # coalesce: one WR, a longer scatter-gather list
                last.nbytes += nbytes
                last.req_ids.append(rid)
                continue
            self._seq += 1
            last = _Wr(self._seq, opcode, sges, raddr, rkey, nbytes, [rid])
            self._queue.append(last)
        self.stats["requests"] += len(ids)
        self._pump()
        return ids

    def _pump(self) -> None:
        """Post queued WRs up to the window, as one linked list per doorbell."""
        room = self.depth - len(self._inflight)
        if room <= 0 or not self._queue or self.broken:
            return
        batch = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
        wrs = []
        for i, w in enumerate(batch):
            signaled = (i == len(batch) - 1) or (i % SIGNAL_EVERY == SIGNAL_EVERY - 1)
            sgl = [SGE(a, n, k) for a, n, k in w.sges]
            wr = SendWR(wr_id=w.seq, opcode=w.opcode, num_sge=len(sgl), sg=sgl,
                        send_flags=_e.IBV_SEND_SIGNALED if signaled else 0)
            wr.set_wr_rdma(w.rkey, w.remote_addr)
            if wrs:
                wrs[-1].next_wr = wr
            wrs.append(wr)
        try:
            self.qp.post_send(wrs[0])
        except PyverbsError as exc:
            # Which WRs of the list got posted is unknown: the QP is unusable. Report this doorbell as failed
            # (through poll, like any failure) and everything after it as flushed.
            self._queue.extendleft(reversed(batch))
            self._break(f"post_send failed: {exc}", {w.seq for w in batch}, POST_FAILED)
            return
        self._inflight.extend(batch)
        self.stats["wrs"] += len(batch)
        self.stats["doorbells"] += 1

    # -- completion
    def pending(self) -> int:
        """Requests posted or queued and not yet reported by ``poll``."""
        return sum(len(w.req_ids) for w in self._inflight) + sum(len(w.req_ids) for w in self._queue)

    def poll(self, deadline: float) -> list[tuple[int, str | None]]:
        """Reap completions; returns ``(request_id, None)`` for each finished request or ``(request_id, status)``
        (an ibv status name) for each failed one. Blocks until at least one request finishes or ``deadline``
        (``time.monotonic()``) passes; returns [] at the deadline, and at once when nothing is pending.
        Never raises for a failed request: the QP is marked broken and the failures are in the list."""
        spins, nap = 0, 50e-6
        while True:
            self._reap()
            self._pump()
            if self._done or not (self._inflight or self._queue):
                done, self._done = self._done, []
                return done
            now = time.monotonic()
            if now >= deadline:
                return []
            spins += 1
            if spins > 64:
                time.sleep(min(nap, deadline - now))
                nap = min(nap * 2, 1e-3)

    def _reap(self) -> None:
        try:
            n, wcs = self.cq.poll(num_entries=self.depth)
        except PyverbsError as exc:
            self._break(f"poll_cq failed: {exc}", ())
            return
        for wc in wcs[:n] if n > 0 else ():
            if wc.status == _e.IBV_WC_SUCCESS:
                while self._inflight and self._inflight[0].seq <= wc.wr_id:
                    w = self._inflight.popleft()
                    self.stats["bytes"] += w.nbytes
                    self._done.extend((rid, None) for rid in w.req_ids)
            elif not self.broken or any(w.seq == wc.wr_id for w in self._inflight):
                while self._inflight and self._inflight[0].seq < wc.wr_id:
                    w = self._inflight.popleft()
                    self.stats["bytes"] += w.nbytes
                    self._done.extend((rid, None) for rid in w.req_ids)
                name = status_name(wc.status)
                self._break(f"{name} on wr {wc.wr_id}", {wc.wr_id} if name != FLUSHED else (), name)

    def _break(self, why: str, failed: Iterable[int], status: str = FLUSHED) -> None:
        """Mark broken; report the WRs ``failed`` (wr ids) with ``status``, everything else pending as flushed."""
        if not self.broken:
            self.broken = why
        failed = set(failed)
        for w in list(self._inflight) + list(self._queue):
            st = status if w.seq in failed else FLUSHED
            self._done.extend((rid, st) for rid in w.req_ids)
        self._inflight.clear()
        self._queue.clear()

    def abort(self, why: str, status: str = TIMED_OUT) -> None:
        """Cancel everything pending: the QP goes to the error state (the device flushes and stops touching local
        buffers), pending requests are reported with ``status`` by the next ``poll``, and the QP is broken."""
        try:
            a = QPAttr()
            a.qp_state = _e.IBV_QPS_ERR
            self.qp.modify(a, _e.IBV_QP_STATE)
        except PyverbsError:
            pass  # already dead; reset() recreates it either way
        self._break(why, (), status)
        for i, (rid, st) in enumerate(self._done):
            if st == FLUSHED:
                self._done[i] = (rid, status)

    def transfer(self, opcode: str, reqs: Sequence[Request], deadline: float) -> int:
        """Post ``reqs`` (``opcode`` "read" or "write") and wait until every one finished; returns bytes moved.
        Blocks until then or ``deadline``. Raises ``TransportError`` naming the root failure's ibv status, or
        ``DeadlineExceeded`` when the deadline passes first (the QP is aborted, and everything pending on it is
        dropped). Results of requests posted earlier with ``post_*`` are kept for the next ``poll``."""
        ids = (self.post_reads if opcode == "read" else self.post_writes)(reqs)
        want = set(ids)
        failed: list[tuple[int, str]] = []
        others: list[tuple[int, str | None]] = []
        while want:
            for rid, st in self.poll(deadline):
                if rid not in want:
                    others.append((rid, st))
                    continue
                want.discard(rid)
                if st is not None:
                    failed.append((rid, st))
            if want and time.monotonic() >= deadline:
                self.abort(f"deadline passed with {len(want)} of {len(ids)} requests unfinished")
                self._done.clear()
                raise DeadlineExceeded(COMPONENT, f"{opcode} of {len(ids)} requests: {len(want)} unfinished at "
                                                  f"the deadline; queue pair aborted")
        self._done[:0] = others
        if failed:
            failed.sort()
            root = next((st for _, st in failed if st != FLUSHED), failed[0][1])
            raise TransportError(COMPONENT, f"{opcode} failed: {root} ({len(failed)} of {len(ids)} requests "
                                            f"failed; queue pair {self.qp.qp_num} broken: {self.broken})")
        return sum(r[2] if len(r) == 5 else sum(s[2] for s in r[0]) for r in reqs)

    def reset(self) -> None:
        """Destroy the QP and CQ and make new ones (new qpn and psn). Everything pending is dropped unreported.
        The peer must reconnect too: swap ``local_info()`` again and ``connect``."""
        self._queue.clear()
        self._inflight.clear()
        self._done.clear()
        self._close_verbs()
        self._create()

    def _close_verbs(self) -> None:
        for obj in (self.qp, self.cq):
            if obj is not None:
                try:
                    obj.close()
                except PyverbsError:
                    pass
        self.qp = self.cq = None

    def close(self) -> None:
        self._close_verbs()
        self.broken = "closed"
