"""The UMBP metaserver: page directory, per-node space allocation, eviction, leases and membership, persisted to
etcd. Entry points: ``metaserver.server.run(config)`` (blocking) and ``metaserver.server.serve(config)``."""
