"""Page layouts: where each layer of a KV page lives inside a pool object, and where it lives in an engine's KV buffer.

A pool page object is *page-first*: one object holds every layer of one page (``page_size`` tokens), layer ``l`` at
byte offset ``sum(layer_bytes[:l])`` of the payload. A layer's bytes are everything that layer keeps for the page's
tokens, in the order of the engine buffer's parts: K then V for MHA (two parts), the latent for MLA (one part).
A *layer group* ``g`` of size ``G`` is layers ``[g*G, min((g+1)*G, L))``: one contiguous byte range of the payload,
so fetching a group is one ranged read per page.

``PageLayout`` is the pool side (offsets and ranges, plain integers). ``PagedKV`` is the engine side: per layer, the
part tensors shaped ``[num_slots, ...]`` whose slot rows a page's bytes land in; it derives its ``PageLayout`` from
the tensors, so both sides agree by construction.

Invariants: every layer and every part row holds at least one byte; a part's slot row ``s`` is the contiguous byte
range ``[data_ptr + s*stride0, + row_bytes)`` of its tensor (checked on construction), so gathers can address rows by
pointer arithmetic. Cost: construction is O(layers x parts); ranges and row addresses are O(1) per item (numpy
vectorised over slots).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from umbp.errors import InvalidArgument

COMPONENT = "engine layout"


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one page-first page object: ``layer_bytes[l]`` bytes per layer, layers grouped by
    ``group_size`` for layer-wise loading."""

    layer_bytes: tuple[int, ...]
    group_size: int = 1

    def __post_init__(self) -> None:
        lb = tuple(int(b) for b in self.layer_bytes)
        object.__setattr__(self, "layer_bytes", lb)
        if not lb or any(b <= 0 for b in lb):
            raise InvalidArgument(COMPONENT, f"layer_bytes must be a non-empty list of positive sizes, got {lb[:8]}")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise InvalidArgument(COMPONENT, f"group_size must be a positive integer, got {self.group_size!r}")
        offsets = [0]
        for b in lb:
            offsets.append(offsets[-1] + b)
        object.__setattr__(self, "_offsets", tuple(offsets))

    @classmethod
    def uniform(cls, num_layers: int, layer_bytes: int, group_size: int = 1) -> "PageLayout":
        """Every layer the same size: ``layer_bytes = page_size_tokens * bytes_per_token_of_one_layer``."""
        if num_layers <= 0:
            raise InvalidArgument(COMPONENT, f"num_layers must be positive, got {num_layers}")
        return cls((layer_bytes,) * num_layers, group_size)

    def with_group_size(self, group_size: int) -> "PageLayout":
        return PageLayout(self.layer_bytes, group_size)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)

    @property
    def page_bytes(self) -> int:
        return self._offsets[-1]  # type: ignore[attr-defined]

    @property
    def num_groups(self) -> int:
        return -(-self.num_layers // self.group_size)

    def layer_range(self, layer: int) -> tuple[int, int]:
        """``(offset, length)`` of one layer within the page payload."""
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(COMPONENT, f"layer {layer} outside 0..{self.num_layers - 1}")
        return self._offsets[layer], self.layer_bytes[layer]  # type: ignore[attr-defined]

    def group_layers(self, group: int) -> range:
        if not 0 <= group < self.num_groups:
            raise InvalidArgument(COMPONENT, f"group {group} outside 0..{self.num_groups - 1}")
        start = group * self.group_size
        return range(start, min(start + self.group_size, self.num_layers))

    def layers_range(self, layers: range) -> tuple[int, int]:
        """``(offset, length)`` of consecutive layers ``layers`` (one contiguous range of the payload)."""
        if layers.step != 1 or len(layers) == 0 or layers.start < 0 or layers.stop > self.num_layers:
            raise InvalidArgument(COMPONENT, f"layers {layers} are not a non-empty run within 0..{self.num_layers}")
        off = self._offsets[layers.start]  # type: ignore[attr-defined]
        return off, self._offsets[layers.stop] - off  # type: ignore[attr-defined]

    def group_range(self, group: int) -> tuple[int, int]:
        """``(offset, length)`` of layer group ``group``: the one ranged read per page that fetches it."""
        return self.layers_range(self.group_layers(group))

    def group_ranges(self) -> list[tuple[int, int]]:
        return [self.group_range(g) for g in range(self.num_groups)]


def _row_bytes(t: Any, what: str) -> tuple[int, int]:
    """(row_bytes, stride0_bytes) of a part tensor shaped [num_slots, ...] whose rows are each contiguous."""
    if t.dim() < 1:
        raise InvalidArgument(COMPONENT, f"{what}: a part tensor needs a slot dimension, got a scalar")
    es = t.element_size()
    expect = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:]))):
        if size != 1 and stride != expect:
            raise InvalidArgument(COMPONENT, f"{what}: slot rows of shape {tuple(t.shape)} with strides "
                                             f"{tuple(t.stride())} are not contiguous")
        expect *= size
    row = expect * es
    stride0 = t.stride(0) * es
    if row <= 0:
        raise InvalidArgument(COMPONENT, f"{what}: empty slot rows (shape {tuple(t.shape)})")
    if t.shape[0] > 1 and stride0 < row:
        raise InvalidArgument(COMPONENT, f"{what}: slot rows overlap (stride {stride0} < row {row} bytes)")
    return row, stride0


class PagedKV:
    """An engine's paged KV buffer as the loader sees it: per layer, one or more part tensors ``[num_slots, ...]``.

    Accepted forms:
    - one tensor ``[num_layers, num_slots, ...]`` (all layers, one part each: MLA latents);
    - a list with one tensor ``[num_slots, ...]`` per layer;
    - a list with, per layer, a tuple of part tensors (``(k[l], v[l])`` for MHA, K before V in the page bytes).
    A token-indexed buffer (SGLang's ``[num_tokens, heads, dim]``) is passed as its page view
    ``t.view(num_tokens // page_size, page_size, heads, dim)``: a slot is then one page.
    Every part shares one device and slot count; all slot rows of a layer together are that layer's page bytes.
    """

    def __init__(self, layers: Any):
        import torch

        if isinstance(layers, torch.Tensor):
            if layers.dim() < 2:
                raise InvalidArgument(COMPONENT, f"a stacked KV tensor is [num_layers, num_slots, ...], got shape "
                                                 f"{tuple(layers.shape)}")
            per_layer: list = [(layers[i],) for i in range(layers.shape[0])]
        else:
            per_layer = [(x,) if isinstance(x, torch.Tensor) else tuple(x) for x in layers]
        if not per_layer or any(not parts for parts in per_layer):
            raise InvalidArgument(COMPONENT, "a KV buffer needs at least one layer and one part per layer")
        first = per_layer[0][0]
        self.device = first.device
        self.num_slots = int(first.shape[0])
        self.parts: list[tuple[Any, ...]] = []
        self.part_rows: list[tuple[int, ...]] = []
        self.part_strides: list[tuple[int, ...]] = []
        for li, parts in enumerate(per_layer):
            rows, strides = [], []
            for pi, t in enumerate(parts):
                if not isinstance(t, torch.Tensor):
                    raise InvalidArgument(COMPONENT, f"layer {li} part {pi}: expected a tensor, got {type(t).__name__}")
                if t.device != self.device:
                    raise InvalidArgument(COMPONENT, f"layer {li} part {pi} is on {t.device}, layer 0 on {self.device}")
                if int(t.shape[0]) != self.num_slots:
                    raise InvalidArgument(COMPONENT, f"layer {li} part {pi} has {t.shape[0]} slots, layer 0 has "
                                                     f"{self.num_slots}")
                r, s = _row_bytes(t, f"layer {li} part {pi}")
                rows.append(r)
                strides.append(s)
            self.parts.append(tuple(parts))
            self.part_rows.append(tuple(rows))
            self.part_strides.append(tuple(strides))
        self.layer_bytes = tuple(sum(r) for r in self.part_rows)

    @property
    def num_layers(self) -> int:
        return len(self.parts)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def layout(self, group_size: int = 1) -> PageLayout:
        return PageLayout(self.layer_bytes, group_size)

    @property
    def page_bytes(self) -> int:
        return sum(self.layer_bytes)

    def check_slots(self, slots: Any) -> np.ndarray:
        """``slots`` as an int64 array, every entry within ``[0, num_slots)`` (raises otherwise)."""
        arr = np.asarray(slots, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.num_slots):
            raise InvalidArgument(COMPONENT, f"slot index outside 0..{self.num_slots - 1} "
                                             f"(got {int(arr.min())}..{int(arr.max())})")
        return arr

    def segments(self, layers: range) -> list[tuple[int, int, int, int]]:
        """For consecutive ``layers``: ``(rel_offset, length, part_base_addr, stride0)`` of every part in page-byte
        order, ``rel_offset`` counted from the first of ``layers``."""
        out, rel = [], 0
        for li in layers:
            for t, row, stride in zip(self.parts[li], self.part_rows[li], self.part_strides[li]):
                out.append((rel, row, t.data_ptr(), stride))
                rel += row
        return out

    def rows(self, layer: int, slot: int) -> list[Any]:
        """The part rows of one layer of one slot, as tensors (views, no copy), in page-byte order."""
        return [t[slot] for t in self.parts[layer]]
