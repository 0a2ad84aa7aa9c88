"""The page directory core: one table of columns a process holds per slot (numpy arrays, a row per page).

``directory.TableDirectory`` is the directory the handlers call; ``columns.PageTable`` its rows; ``index`` the
bucketed key index; ``nodes`` the per-node rows and allocators (``allocator``); ``place`` ALLOC as arrays;
``evict`` watermark eviction; ``leases`` read leases; ``links`` prefix links, prefix-lru and KV events; ``quotas``
quota groups and reservations; ``shared`` replicated (shared) pages; ``commits`` + ``records`` the packed commit
records the table files and reads back; ``load`` cold loads; ``grants``/``quarantine`` write capabilities and the
reuse quarantine; ``entry`` the vocabulary (states, digests) every package uses. Imports nothing else of the
metaserver.
"""
