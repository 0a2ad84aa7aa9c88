"""vLLM's KV cache as the engine loader sees it: per layer, block rows; and the pool namespace of a vLLM instance.

vLLM 0.33 hands connectors one tensor per attention layer, a view shaped ``[B, H, N, C]`` (blocks, KV heads, tokens
of a block, content: K and V, or the MLA latent) whose memory order is the cache's layout (``LBNHC``: ``[B, N, H,
C]``, ``LBHNC``, ...). ``block_parts`` turns one such tensor into the parts ``umbp.engine.PagedKV`` accepts:

- if a block's elements form one contiguous run (every layout with B outermost in the layer: the usual case), one
  part ``[num_blocks, run]`` that aliases the tensor: a block's row is its physical bytes, in memory order;
- if some dims lie outside B in memory (e.g. ``LHBNC``: head groups outermost), one part per index of those dims.
A page object is then the rows of every layer in layer order, so two vLLM instances with the same model, layout,
block size, dtype (and, for MHA, TP size) exchange pages byte for byte, with no repacking on either side.

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


def block_parts(t: Any, num_blocks: int, name: str = "layer") -> tuple[Any, ...]:
    """The parts of one layer's KV tensor (blocks at dim 0), each ``[num_blocks, elems]`` with contiguous rows
    aliasing ``t``. Raises InvalidArgument when dim 0 is not the block dim or a block is not addressable in runs."""
    import torch

    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        raise InvalidArgument(COMPONENT, f"{name}: expected a KV tensor [num_blocks, ...], got "
                                         f"{getattr(t, 'shape', type(t).__name__)}")
    if int(t.shape[0]) != num_blocks:
        raise InvalidArgument(COMPONENT, f"{name}: dim 0 has {t.shape[0]} entries, the KV cache has {num_blocks} "
                                         f"blocks (kernel block sizes other than the manager's are not supported)")
    stride_b = t.stride(0)
    outer = [d for d in range(1, t.dim()) if t.shape[d] > 1 and t.stride(d) > stride_b]
    inner = [d for d in range(1, t.dim()) if d not in outer]
    parts = []
    for idx in itertools.product(*(range(t.shape[d]) for d in outer)):
        sub = t
        for d, i in sorted(zip(outer, idx), reverse=True):
            sub = sub.select(d, i)
        # the remaining dims (inner, in their order) must tile one dense run per block, in some memory order
        dims = [(sub.stride(k), sub.shape[k]) for k in range(1, sub.dim()) if sub.shape[k] > 1]
        run, expect = 1, 1
        for stride, size in sorted(dims):
            if stride != expect:
                raise InvalidArgument(COMPONENT, f"{name}: a block of shape {tuple(t.shape)} with strides "
                                                 f"{tuple(t.stride())} is not dense within its dims {inner}")
            expect *= size
        run = expect
        if num_blocks > 1 and sub.stride(0) < run:
            raise InvalidArgument(COMPONENT, f"{name}: blocks overlap (stride {sub.stride(0)} < {run} elements)")
        parts.append(torch.as_strided(sub, (num_blocks, run), (sub.stride(0), 1), sub.storage_offset()))
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
