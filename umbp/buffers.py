"""Turning caller values and destination buffers into flat byte memoryviews, without copying.

Accepted: anything with the buffer protocol (bytes, bytearray, memoryview, mmap, array), numpy arrays, and torch
tensors. They must be C-contiguous: a strided view would need a gather, and silently copying it would hide a
slow path, so it is refused with a clear error. CPU torch tensors are viewed through ``tensor.view(torch.uint8)``
(works for bfloat16 and float8, which numpy cannot represent). A CUDA tensor is not host memory: values are staged
to the host with one copy, and outs are filled through a host buffer and copied up (``CudaOut``); the zero-copy GPU
path is the gather in ``umbp.engine.gather``.
"""

from __future__ import annotations

import sys
from typing import Any

from umbp.errors import InvalidArgument


def _torch_view(t: Any, writable: bool) -> memoryview:
    if not t.is_contiguous():
        raise InvalidArgument("client", f"torch tensor of shape {tuple(t.shape)} is not contiguous")
    if t.device.type != "cpu":
        raise InvalidArgument("client", "internal: CUDA tensors go through CudaOut/staging")
    import torch

    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _is_torch(obj: Any) -> bool:
    mod = sys.modules.get("torch")
    return mod is not None and isinstance(obj, mod.Tensor)


def _flat_view(obj: Any, what: str, writable: bool) -> memoryview:
    try:
        mv = memoryview(obj)
    except TypeError:
        raise InvalidArgument("client", f"{what} of type {type(obj).__name__} does not support the buffer "
                                        f"protocol (use bytes, bytearray, memoryview, numpy arrays or tensors)") from None
    if writable and mv.readonly:
        raise InvalidArgument("client", f"{what} is read-only (bytes?); pass a bytearray, numpy array or tensor")
    if not mv.c_contiguous:
        raise InvalidArgument("client", f"{what} is not C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def as_bytes_view(value: Any, what: str = "value") -> memoryview:
    """A read-only flat byte view of ``value`` (a CUDA tensor is copied to the host first)."""
    if _is_torch(value):
        if value.device.type != "cpu":
            value = value.detach().to("cpu")
        return _torch_view(value, writable=False)
    return _flat_view(value, what, writable=False)


class CudaOut:
    """A destination on a CUDA device: filled through a host buffer, copied up by ``flush``."""

    def __init__(self, tensor: Any):
        import torch

        if not tensor.is_contiguous():
            raise InvalidArgument("client", "CUDA out tensor is not contiguous")
        self.tensor = tensor
        self.host = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8, pin_memory=True)
        self.view = memoryview(self.host.numpy()).cast("B")

    def flush(self, nbytes: int) -> None:
        import torch

        dst = self.tensor.reshape(-1).view(torch.uint8)
        dst[:nbytes].copy_(self.host[:nbytes], non_blocking=False)


def as_writable_view(out: Any, what: str = "out") -> memoryview | CudaOut:
    """A writable flat byte view of ``out``, or a ``CudaOut`` for a CUDA tensor."""
    if _is_torch(out):
        if out.device.type != "cpu":
            return CudaOut(out)
        return _torch_view(out, writable=True)
    return _flat_view(out, what, writable=True)
