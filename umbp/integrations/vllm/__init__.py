"""vLLM 0.33 integration: the pool as a KV connector (v1 interface), loaded by vLLM's own connector factory.

    --kv-transfer-config '{"kv_connector": "UmbpConnector",
                           "kv_connector_module_path": "umbp.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"metaserver": "HOST:PORT"}}'

Modules: ``plan`` (what to load and save, per request and step: pure bookkeeping, no vLLM or torch import),
``blocks`` (vLLM's per-layer KV tensors as the engine loader's block rows; pool namespace and object names),
``scheduler`` and ``worker`` (the two halves of the connector), ``connector`` (the ``KVConnectorBase_V1`` subclass
that vLLM's factory loads; the only module that imports vLLM). Only ``connector`` needs vLLM installed.
"""

CONNECTOR_NAME = "UmbpConnector"
CONNECTOR_MODULE = "umbp.integrations.vllm.connector"
