"""Page layouts and the engine-side view of a paged KV buffer: ranges, groups, slot rows (no pool, no GPU)."""

from __future__ import annotations

import pytest
import torch

from umbp.engine.layout import PagedKV, PageLayout
from umbp.errors import InvalidArgument


def test_uniform_layout_ranges_and_groups():
    lay = PageLayout.uniform(num_layers=10, layer_bytes=4096, group_size=4)
    assert lay.page_bytes == 40960
    assert lay.num_groups == 3
    assert [lay.group_layers(g) for g in range(3)] == [range(0, 4), range(4, 8), range(8, 10)]
    assert lay.group_ranges() == [(0, 16384), (16384, 16384), (32768, 8192)]
    assert lay.layer_range(7) == (7 * 4096, 4096)
    # the groups tile the page exactly
    assert sum(n for _, n in lay.group_ranges()) == lay.page_bytes


def test_uneven_layers():
    lay = PageLayout((100, 200, 300), group_size=2)
    assert lay.group_ranges() == [(0, 300), (300, 300)]
    assert lay.layers_range(range(1, 3)) == (100, 500)
    assert lay.with_group_size(3).group_ranges() == [(0, 600)]


@pytest.mark.parametrize("bad", [dict(layer_bytes=()), dict(layer_bytes=(1, 0)), dict(layer_bytes=(8,), group_size=0)])
def test_layout_rejects_bad_shapes(bad):
    with pytest.raises(InvalidArgument, match="engine layout"):
        PageLayout(**bad)


def test_layout_rejects_out_of_range():
    lay = PageLayout.uniform(4, 16, 2)
    with pytest.raises(InvalidArgument):
        lay.group_range(2)
    with pytest.raises(InvalidArgument):
        lay.layer_range(4)


def test_paged_kv_forms_agree():
    stacked = torch.zeros(6, 32, 16, 8, dtype=torch.bfloat16)  # [layers, slots, tokens, dim]
    kv = PagedKV(stacked)
    assert kv.num_layers == 6 and kv.num_slots == 32
    assert kv.layer_bytes == (16 * 8 * 2,) * 6
    per_layer = PagedKV([stacked[i] for i in range(6)])
    assert per_layer.layer_bytes == kv.layer_bytes
    # MHA: K and V parts per layer; the layer's bytes are K then V
    k = torch.zeros(3, 32, 16, 4, 8, dtype=torch.float16)
    v = torch.zeros(3, 32, 16, 4, 8, dtype=torch.float16)
    mha = PagedKV([(k[i], v[i]) for i in range(3)])
    row = 16 * 4 * 8 * 2
    assert mha.layer_bytes == (2 * row,) * 3
    segs = mha.segments(range(1, 3))
    assert [(s[0], s[1]) for s in segs] == [(0, row), (row, row), (2 * row, row), (3 * row, row)]
    assert segs[0][2] == k[1].data_ptr() and segs[1][2] == v[1].data_ptr()


def test_token_indexed_buffer_through_a_page_view():
    page = 16
    buf = torch.zeros(4096, 2, 64, dtype=torch.bfloat16)  # SGLang-style [tokens, heads, dim]
    kv = PagedKV([buf.view(4096 // page, page, 2, 64)])
    assert kv.num_slots == 256 and kv.layer_bytes == (page * 2 * 64 * 2,)


def test_paged_kv_rejects_mismatches():
    with pytest.raises(InvalidArgument, match="slots"):
        PagedKV([torch.zeros(4, 8), torch.zeros(5, 8)])
    with pytest.raises(InvalidArgument, match="not contiguous"):
        PagedKV([torch.zeros(8, 4, 4).transpose(1, 2)])
    kv = PagedKV([torch.zeros(4, 8)])
    with pytest.raises(InvalidArgument, match="slot index"):
        kv.check_slots([0, 4])


def test_strided_slot_rows_are_fine():
    # slots padded apart (stride0 > row) still have contiguous rows
    base = torch.zeros(8, 32, dtype=torch.uint8)
    kv = PagedKV([base[:, :16]])
    assert kv.layer_bytes == (16,) and kv.part_strides[0] == (32,)
