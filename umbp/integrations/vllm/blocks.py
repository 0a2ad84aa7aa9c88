"""vLLM's KV cache as the engine loader sees it: per layer, block rows; and the pool namespace of a vLLM instance.

vLLM 0.33 hands connectors one tensor per attention layer, a view shaped ``[B, H, N, C]`` (blocks, KV heads, tokens
of a block, content: K and V, or the MLA latent) whose memory order is the cache's layout (``LBNHC``: ``[B, N, H,
C]``, ``LBHNC``, ...). ``block_parts`` turns one such tensor into the parts ``umbp.engine.PagedKV`` accepts:

- if a block's elements form one contiguous run (``LBNHC``, ``LBHNC``, ``BLHNC``, ``BLNHC``: the usual case), one
  part ``[num_blocks, run]`` that aliases the tensor: a block's row is its physical bytes, in memory order;
- else the longest dense run from the innermost dim up is a part's row, and every other dim gets one part per index,
  in dim order: ``LHBNC`` (head groups outside B) and ``BHLNC`` (``[B, H, L, N, C]``: within a block each head's
  ``[N, C]`` run is followed by the other layers' runs of that head) give one part per head, rows of ``N x C``.
A page object is then the rows of every layer in layer order (within a layer, part by part), so two vLLM instances
with the same model, layout, block size, dtype (and, for MHA, TP size) exchange pages byte for byte, with no
repacking on either side. A layout whose block lies in more than ``MAX_PARTS`` runs per layer is refused.

Names: ``namespace`` is ``umbp.keys.namespace`` of the model, ``vllm-{layout}`` (plus ``-tp{N}`` for TP-sharded KV),
block size and dtype; MLA KV is keyed without a rank (stored once across TP ranks), MHA KV per rank
(``umbp.keys.rank_key``). Cost: O(layers x dims) at registration, nothing per step.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from umbp.errors import InvalidArgument
from umbp.integrations.sglang.naming import dtype_name, namespace_for

COMPONENT = "vllm connector"
MAX_PARTS = 1024  # runs per block and layer: one part each, and one copy per part and page


def _check_disjoint(t: Any, name: str) -> None:
    """InvalidArgument when two elements of ``t`` (blocks included) may share memory: sorted by stride, each dim
    must step past everything the smaller ones span."""
    dims = sorted((t.stride(d), t.shape[d]) for d in range(t.dim()) if t.shape[d] > 1)
    span = 1
    for stride, size in dims:
        if stride < span:
            raise InvalidArgument(COMPONENT, f"{name}: elements overlap (shape {tuple(t.shape)}, strides "
                                             f"{tuple(t.stride())})")
        span = stride * size


def block_parts(t: Any, num_blocks: int, name: str = "layer") -> tuple[Any, ...]:
    """The parts of one layer's KV tensor (blocks at dim 0), each ``[num_blocks, elems]`` with contiguous rows
    aliasing ``t``. Raises InvalidArgument when dim 0 is not the block dim, elements overlap, or a block lies in
    more than ``MAX_PARTS`` runs."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise InvalidArgument(COMPONENT, f"{name}: expected a KV tensor [num_blocks, ...], got "
                                         f"{getattr(t, 'shape', type(t).__name__)}")
    if int(t.shape[0]) != num_blocks:
        raise InvalidArgument(COMPONENT, f"{name}: dim 0 has {t.shape[0]} entries, the KV cache has {num_blocks} "
                                         f"blocks (kernel block sizes other than the manager's are not supported)")
    sized = [d for d in range(1, t.dim()) if t.shape[d] > 1]
    # the run: the dims that tile one dense run from stride 1 up, smallest stride first; every other dim (outside
    # B in memory, or inside B but not adjacent to the run: BHLNC's heads, the block's other layers between them)
    # is split, one part per index
    run, dense = 1, []
    for d in sorted(sized, key=t.stride):
        if t.stride(d) != run:
            break
        dense.append(d)
        run *= t.shape[d]
    split = [d for d in sized if d not in dense]
    _check_disjoint(t, name)
    count = 1
    for d in split:
        count *= t.shape[d]
    if count > MAX_PARTS:
        raise InvalidArgument(COMPONENT, f"{name}: a block of shape {tuple(t.shape)} with strides "
                                         f"{tuple(t.stride())} lies in {count} runs of {run} elements (at most "
                                         f"{MAX_PARTS} per layer): use a layout with [N, C] innermost, e.g. LBNHC")
    parts = []
    for idx in itertools.product(*(range(t.shape[d]) for d in split)):
        sub = t
        for d, i in sorted(zip(split, idx), reverse=True):
            sub = sub.select(d, i)
        parts.append(torch.as_strided(sub, (num_blocks, run), (t.stride(0), 1), sub.storage_offset()))
    return tuple(parts)


def paged_layers(kv_caches: dict[str, Any], num_blocks: int, order: Sequence[str] = ()
                 ) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Layer names in page order (``order`` first, e.g. the KV cache group's layer list, then any others in dict
    order) and each layer's parts. Layers that alias another layer's tensor (vLLM's KV sharing) are left out:
    their bytes are the other layer's."""
    names = [n for n in order if n in kv_caches] + [n for n in kv_caches if n not in order]
    seen: set[tuple[int, tuple, tuple]] = set()
    out_names, out_parts = [], []
    for n in names:
        t = kv_caches[n]
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:
            continue
        seen.add(ident)
        out_names.append(n)
        out_parts.append(block_parts(t, num_blocks, n))
    if not out_parts:
        raise InvalidArgument(COMPONENT, "no KV cache tensors to register")
    return out_names, out_parts


def namespace(model: str | None, layout: str | None, block_size: int, dtype: Any, tp_size: int,
              replicated: bool) -> str:
    """The pool namespace of a vLLM instance's pages (see the module docstring)."""
    return namespace_for(model, str(layout or "default"), block_size, dtype_name(dtype),
                         None if replicated else tp_size, kind="vllm")
