"""PipelinedStore (umbp/engine/offload.py): a batch cut into chunks stored by two alternating storers, bytes exact,
parents and existing pages as LayerwiseLoader.store; CPU KV buffers here, the device path in bench/engine_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the paged KV buffers are torch tensors")

from umbp.engine.offload import PipelinedStore  # noqa: E402
from umbp.errors import InvalidArgument  # noqa: E402


def _kv(slots: int, layers: int = 3):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 256, (slots, 4, 8), dtype=torch.uint8, generator=g),
             torch.randint(0, 256, (slots, 4, 8), dtype=torch.uint8, generator=g)) for _ in range(layers)]


def _page(kv, slot: int) -> bytes:
    return b"".join(t[slot].numpy().tobytes() for k, v in kv for t in (k, v))


def test_pipelined_store_chunks_bytes_exact_and_existing(make_cluster):
    cluster = make_cluster(nodes=1, capacity="64MiB")
    kv = _kv(12)
    keys = [f"off/{i}" for i in range(10)]
    slots = [11 - i for i in range(10)]  # not in page order
    with cluster.client(transport="shm") as c, PipelinedStore(c, kv, 1, chunk_pages=3) as st:
        assert st.store(keys, slots, [None] + keys[:-1], skip_existing=True) == [True] * 10
        assert st.counters["pages_stored"] == 10
        assert all(s.counters["pages_stored"] > 0 for s in st.storers), "one storer did every chunk"
        page = len(_page(kv, 0))
        outs = [np.zeros(page, np.uint8) for _ in keys]
        assert c.batch_get_into(keys, outs) == [page] * 10
        for o, s in zip(outs, slots):
            assert o.tobytes() == _page(kv, s)
        # stored again (two of them new): the existing ones are skipped before anything moves
        more = keys[:8] + ["off/new/0", "off/new/1"]
        assert st.store(more, slots[:8] + [0, 1], skip_existing=True) == [False] * 8 + [True, True]
        assert st.counters["pages_existing"] == 8 and st.counters["pages_stored"] == 12
        assert c.get("off/new/1") == _page(kv, 1)


def test_pipelined_store_refuses_bad_arguments(make_cluster):
    cluster = make_cluster(nodes=1, capacity="16MiB")
    with cluster.client(transport="shm") as c:
        with pytest.raises(InvalidArgument, match="chunk_pages"):
            PipelinedStore(c, _kv(2), 1, chunk_pages=0)
        with PipelinedStore(c, _kv(2), 1, chunk_pages=1) as st:
            with pytest.raises(InvalidArgument, match="2 keys, 1 slots"):
                st.store(["a", "b"], [0])
