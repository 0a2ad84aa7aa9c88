"""Request handlers of one slot's service, by family: ``dataplane`` (LOOKUP/ALLOC/COMMIT/RELEASE), ``admin``
(stats, nodes, drains), ``ownership`` (read leases and their release), ``rejoin`` (a node back with its pages),
``membership`` (nodes, heartbeats, liveness), ``metrics`` (Prometheus), ``kvevents`` (the KV event stream).
Imports the table and the store; nothing of ``metaserver.ha``.
"""
