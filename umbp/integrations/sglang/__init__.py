"""SGLang 0.5.23 integration: the pool as SGLang's HiCache L3 storage and as its direct KV-store linker.

Two plug-in points, both loaded by SGLang's own factories from a module path, so SGLang needs no patch:

- ``umbp.integrations.sglang.hicache.UmbpHiCacheStorage``: a ``HiCacheStorage`` for
  ``--hicache-storage-backend dynamic``. Pages move between SGLang's host KV pool (L2) and the pool (L3).
- ``umbp.integrations.sglang.linker.UmbpDirectLinker``: a ``UnifiedCacheLinker`` for
  ``--unified-cache-external-linker-backend dynamic``. Pages move between the GPU KV pools and the pool with no
  per-rank host tier, layer by layer.

This package imports no SGLang module itself: each submodule imports only the part of SGLang it plugs into
(``hicache`` needs SGLang's storage interface, light on dependencies; ``linker`` needs SGLang's memory pools, which
pull in its model configs and ``transformers``). ``naming`` and ``hostmem`` import nothing of SGLang.
"""

HICACHE_MODULE = "umbp.integrations.sglang.hicache"
HICACHE_CLASS = "UmbpHiCacheStorage"
LINKER_MODULE = "umbp.integrations.sglang.linker"
LINKER_CLASS = "UmbpDirectLinker"
