"""Transports: the sans-I/O wire format (``wire``) and the ways bytes move between a client and a node's arena.

``shm`` (same host: map the arena), ``rdma`` (pyverbs one-sided READ/WRITE), ``tcp`` (uvloop server on the node,
``recv_into`` on the client). All three implement ``transport.base.Transport``; ``transport.select`` picks one per
peer in that order.
"""
