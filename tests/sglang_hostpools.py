"""Host KV pools laid out as SGLang 0.5.23 lays them out (``memory_pool_host`` / ``pool_host/{mha,mla}.py``), for
tests/test_sglang_hicache.py: ``MhaHostPool`` / ``MlaHostPool`` stand in for SGLang's ``MHATokenToKVPoolHost`` /
``MLATokenToKVPoolHost`` (which import SGLang's model configs: transformers, torchvision) with the same ``kv_buffer``
shapes, ``get_page_buffer_meta`` addresses and flat data pages; ``real_host_pool`` builds the real classes where they
import (the SGLang linker venv), ``real_pools_importable`` says why not elsewhere. Needs torch (the test module
skips without it before importing this)."""

from __future__ import annotations

import torch

DT = torch.bfloat16
L, H, D, PS, PAGES = 3, 2, 8, 4, 8  # layers, heads, head dim, page tokens, host pool pages
MLA_DIM = 12


class MhaHostPool:
    """``MHATokenToKVPoolHost``'s buffer, meta and flat pages, without its device transfer machinery."""

    def __init__(self, layout: str, layers: int = L, heads: int = H, dim: int = D, page_size: int = PS,
                 pages: int = PAGES, dtype=DT):
        self.layout, self.layer_num, self.head_num, self.head_dim = layout, layers, heads, dim
        self.page_size, self.page_num, self.size, self.dtype = page_size, pages, pages * page_size, dtype
        dims = {"layer_first": (2, layers, self.size, heads, dim),
                "page_first": (2, self.size, layers, heads, dim),
                "page_first_direct": (2, pages, layers, page_size, heads, dim),
                "page_head": (2, pages, heads, page_size, layers, dim)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self):
        return [self.k_buffer, self.v_buffer]

    def _elem(self) -> int:
        return self.head_num * self.head_dim * self.dtype.itemsize

    def get_page_buffer_meta(self, indices):
        idx = indices.tolist()
        base = self.kv_buffer.data_ptr()
        v_off = self.layer_num * self.size * self._elem()
        ptrs = []
        if self.layout == "layer_first":
            for i in range(0, len(idx), self.page_size):
                for layer in range(self.layer_num):
                    k = base + idx[i] * self._elem() + layer * self.size * self._elem()
                    ptrs += [k, k + v_off]
            return ptrs, [self.page_size * self._elem()] * len(ptrs)
        for i in range(0, len(idx), self.page_size):
            k = base + idx[i] * self.layer_num * self._elem()
            ptrs += [k, k + v_off]
        return ptrs, [self.layer_num * self.page_size * self._elem()] * len(ptrs)

    def get_split_heads_page_buffer_meta(self, indices, split_factor: int):
        assert self.layout == "page_head"
        idx = indices.tolist()
        base = self.kv_buffer.data_ptr()
        v_off = self.layer_num * self.size * self._elem()
        it = self.dtype.itemsize
        ptrs = []
        for i in range(0, len(idx), self.page_size):
            for head in range(0, self.head_num, self.head_num // split_factor):
                k = (base + idx[i] * self.layer_num * self._elem()
                     + head * self.page_size * self.layer_num * self.head_dim * it)
                ptrs += [k, k + v_off]
        size = self.layer_num * it * self.page_size * self.head_num * self.head_dim // split_factor
        return ptrs, [size] * len(ptrs)

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, :, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        else:
            page = self.kv_buffer[:, index // self.page_size:index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))


class MlaHostPool:
    """``MLATokenToKVPoolHost``'s buffer, meta and flat pages (one latent row of ``kv_cache_dim`` per token)."""

    def __init__(self, layout: str, layers: int = L, dim: int = MLA_DIM, page_size: int = PS, pages: int = PAGES,
                 dtype=DT):
        self.layout, self.layer_num, self.kv_cache_dim = layout, layers, dim
        self.page_size, self.page_num, self.size, self.dtype = page_size, pages, pages * page_size, dtype
        self.logical_page_size = page_size
        dims = {"layer_first": (layers, self.size, 1, dim), "page_first": (self.size, layers, 1, dim),
                "page_first_direct": (pages, layers, page_size, 1, dim)}[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def get_page_buffer_meta(self, indices):
        idx = indices.tolist()[::self.page_size]
        base, row = self.kv_buffer.data_ptr(), self.kv_cache_dim * self.dtype.itemsize
        if self.layout == "layer_first":
            ptrs = [base + i * row + layer * self.size * row for i in idx for layer in range(self.layer_num)]
            return ptrs, [self.page_size * row] * len(ptrs)
        ptrs = [base + i * self.layer_num * row for i in idx]
        return ptrs, [self.layer_num * self.page_size * row] * len(ptrs)

    def get_data_page(self, index, flat: bool = True):
        if self.layout == "layer_first":
            page = self.kv_buffer[:, index:index + self.page_size]
        elif self.layout == "page_first":
            page = self.kv_buffer[index:index + self.page_size]
        else:
            page = self.kv_buffer[index // self.page_size:index // self.page_size + 1]
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self):
        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        target = self.get_data_page(index, flat=False)
        target.copy_(data_page.reshape(target.shape))


def real_host_pool(kind: str, layout: str):
    """SGLang's own host pool class over CPU 'device' buffers (needs the SGLang linker venv)."""
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    n_dev = 64
    cpu = torch.device("cpu")
    if kind == "mha":
        k = tuple(torch.zeros(n_dev, H, D, dtype=DT) for _ in range(L))
        v = tuple(torch.zeros(n_dev, H, D, dtype=DT) for _ in range(L))
        info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                                               v_data_ptrs=torch.tensor([t.data_ptr() for t in v]),
                                               layout=KVBufferLayout.NHD),
                             page_size=PS, head_num=H, head_dim=D, v_head_dim=D, dtype=DT, device=cpu)
        pool = MHATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=n_dev, start_layer=0, end_layer=L,
                                    host_token_capacity=PAGES * PS)
    else:
        kv = tuple(torch.zeros(n_dev, 1, MLA_DIM, dtype=DT) for _ in range(L))
        info = MLABufferInfo(buffers=kv, data_ptrs=torch.tensor([t.data_ptr() for t in kv]),
                             layer_indices=tuple(range(L)), device_layer_num=L, page_size=PS, kv_lora_rank=8,
                             qk_rope_head_dim=4, kv_cache_dim=MLA_DIM, dtype=DT, device=cpu)
        pool = MLATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=n_dev, start_layer=0, end_layer=L, target_layer_num=L,
                                    host_token_capacity=PAGES * PS)
    pool._keepalive = info  # the device buffers the pool's pointer tables refer to
    return pool


def real_pools_importable() -> str | None:
    try:
        import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
        return None
    except Exception as e:  # ImportError, or transformers/torchvision failing at import
        return (f"SGLANG'S REAL HOST POOL CLASSES DO NOT IMPORT HERE ({type(e).__name__}: {e}); they need "
                f"transformers + torchvision, which live in .venv/sglang-linker: this test runs there through "
                f"tests/test_sglang_linker.py::test_full_suite_in_linker_venv")


MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
