"""Cost model: prompt tokens recomputed and KV bytes loaded -> simulated prefill seconds on one DP rank.

The replay moves real (small) pages through the real pool, but an H200 running a 70B-class model is not here,
so prefill time is computed, not measured:

    compute_s = FLOPs / (gpu_tflops * 1e12 * mfu * gpus_per_rank)
    FLOPs     = 2 * params * n                      (the matmuls, per computed token)
              + 2 * layers * attn_dim * (b^2 - a^2)  (causal attention of tokens a..b over everything before)
    load_s    = pool_tokens * kv_bytes_per_token / (load_gbps * 1e9)
    prefill_s = compute_s + load_s, or max(compute_s, load_s) with ``overlap`` (layer-wise loading)

HBM hits cost nothing. Token counts are divided by the trace's ``scale`` first, so a trace shrunk 100x is
priced as the full-size workload. Defaults, and where they come from:

- ``params`` 70e9, ``layers`` 80, ``attn_dim`` 8192 (64 query heads x 128): Llama-3-70B's config.
- ``kv_bytes_per_token`` 327,680: Llama-3-70B KV in bf16 = 80 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes.
- ``gpu_tflops`` 989: H200 SXM dense BF16 tensor peak (NVIDIA's H200 datasheet lists 1,979 with sparsity).
- ``mfu`` 0.5: the fraction of peak a long prefill typically sustains (large GEMMs, FlashAttention).
- ``load_gbps`` 50: one 400 Gb/s RDMA NIC per GPU (ConnectX-7 line rate); PCIe Gen5 x16 host-to-device
  (about 55 GB/s in practice) bounds a same-host load similarly.
- ``tpot_s`` 0.025: decode time per output token; it paces a session's turns, it is not part of TTFT.

What it approximates: no batching effects, no kernel launch or scheduling overhead, attention at full efficiency,
loads at line rate. It is a ranking device for routers and pool settings, not a latency prediction.
Cost: O(1) per call.
"""

from __future__ import annotations

from dataclasses import dataclass

from umbp.errors import ConfigError


@dataclass(frozen=True)
class CostModel:
    params: float = 70e9
    layers: int = 80
    attn_dim: int = 8192
    kv_bytes_per_token: int = 327_680
    gpu_tflops: float = 989.0
    mfu: float = 0.5
    gpus_per_rank: int = 1
    load_gbps: float = 50.0
    overlap: bool = False
    tpot_s: float = 0.025

    def __post_init__(self) -> None:
        for f in ("params", "layers", "attn_dim", "kv_bytes_per_token", "gpu_tflops", "gpus_per_rank",
                  "load_gbps"):
            if not getattr(self, f) > 0:
                raise ConfigError("costmodel", f"{f} must be positive, got {getattr(self, f)}")
        if not 0 < self.mfu <= 1 or self.tpot_s < 0:
            raise ConfigError("costmodel", "mfu must be within (0, 1] and tpot_s >= 0")

    @property
    def flops_per_s(self) -> float:
        return self.gpu_tflops * 1e12 * self.mfu * self.gpus_per_rank

    def compute_s(self, cached: float, total: float) -> float:
        """Seconds to prefill tokens ``cached..total`` (full-scale positions) with the first ``cached`` in HBM."""
        n = max(0.0, total - cached)
        flops = 2 * self.params * n + 2 * self.layers * self.attn_dim * (total * total - cached * cached)
        return flops / self.flops_per_s

    def load_s(self, tokens: float) -> float:
        """Seconds to bring ``tokens`` tokens of KV from the pool into HBM."""
        return tokens * self.kv_bytes_per_token / (self.load_gbps * 1e9)

    def prefill_s(self, hbm: int, pool: int, prompt: int, scale: float = 1.0) -> float:
        """Simulated prefill seconds of a prompt of ``prompt`` tokens whose first ``hbm`` tokens are in HBM and
        next ``pool`` tokens come from the pool (all in the trace's scaled tokens)."""
        k = 1.0 / scale
        comp = self.compute_s((hbm + pool) * k, prompt * k)
        load = self.load_s(pool * k)
        return max(comp, load) if self.overlap else comp + load

    def decode_s(self, output: int, scale: float = 1.0) -> float:
        return output / scale * self.tpot_s
