"""Transports: the sans-I/O wire format (``wire``) and the ways bytes move between a client and a node's arena.

``shm`` (same host: map the arena), ``rdma`` (pyverbs one-sided READ/WRITE), ``tcp`` (uvloop server on the node,
``recv_into`` on the client). All three implement ``transport.base.Transport``; the client (``umbp.client.Client._transport_for``)
picks one per node in that order: shm when the node runs on the same boot of the same host, rdma when both ends
have a device, else tcp.
"""
