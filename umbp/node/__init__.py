"""The storage node, one per host: a DRAM arena in shared memory served over TCP, RDMA and same-host mapping.

Modules: ``server`` (the process: ``NodeServer``, the data protocol, ``serve``/``run``), ``arena`` (the arena file
that outlives the process), ``ledger`` (the write ledger that decides which capability may write a block),
``metalink`` (registration and heartbeats to whichever metaserver leads). The node keeps no directory: the
metaserver decides which ranges hold which objects; the node checks ranges, capabilities and headers.
"""
