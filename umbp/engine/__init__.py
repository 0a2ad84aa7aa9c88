"""Engine helpers: the path an inference engine uses to move KV pages between the pool and its paged KV buffer.

- ``layout``: page-first page objects (``PageLayout``) and the engine's paged KV buffer (``PagedKV``);
- ``gather``: scattered pages in host memory <-> scattered KV slots, CPU (memmove) or CUDA (one kernel reading
  pinned/registered host memory directly);
- ``loader``: layer-wise loads (group g+1 moves while the caller computes with group g) and offload;
- ``tp``: tensor-parallel groups: replicated (MLA) KV stored once, loaded 1/N per rank and exchanged through
  ``torch.distributed``; sharded (MHA) KV per rank.

Layering: they never import ``umbp.client``: the loader and the TP group take a client by duck typing and call only
its public methods (``batch_get_ranges_into``, ``batch_put_ranges``, ``batch_exists``, ``mapped``,
``local_arenas``), so a test double serves as well; they import ``umbp.keys``, ``umbp.errors`` and the device copy
kernel (``umbp.devkernel``, which the client's CUDA path shares). Nothing below imports them
(``tests/unit/test_layers.py``).
"""

from umbp.engine.layout import PagedKV, PageLayout

__all__ = ["PagedKV", "PageLayout"]
