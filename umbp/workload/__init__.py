"""The main job: agentic traces replayed through the pool by DP ranks behind a router, and what that does.

Modules, bottom up: ``trace`` (the JSONL format, loader, token expansion, statistics), ``generator`` (seeded
AgentX-shaped sessions), ``hbm`` (each rank's prefix cache), ``memorypool`` (an in-process stand-in for ``umbp.Client``, for unit tests), ``replay`` (ranks,
the event loop, token accounting), ``mooncake`` (Mooncake's FAST'25 trace format and its open-loop replay),
``report`` (table, JSON, plots), ``job`` (``umbp demo`` / ``umbp replay``). Routers live in ``umbp.routing``, with
the cost model they price prefills by (``umbp.costmodel``: tokens and bytes to simulated prefill seconds).
Nothing here is imported by the pool itself.
"""
