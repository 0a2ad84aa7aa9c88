"""``UmbpConnector``: the pool as a vLLM 0.33 KV connector (``KVConnectorBase_V1``), loaded by vLLM's factory.

    --kv-transfer-config '{"kv_connector": "UmbpConnector",
                           "kv_connector_module_path": "umbp.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"metaserver": "HOST:PORT"}}'

``kv_connector_extra_config``: ``metaserver`` (required; comma-separated for HA), ``namespace`` (default: derived
from model, layout, block size, dtype and, for MHA, TP size: ``blocks.namespace``), ``token``, ``transport``,
``layer_group_size`` (layers per load step, default 1). ``kv_role``: ``kv_both`` loads and saves, ``kv_producer``
only saves, ``kv_consumer`` only loads.

Pool keys: the token-id chain of ``umbp.keys``, forked by vLLM's own extra block-hash keys (``block_extras``: LoRA,
multimodal inputs, ``cache_salt``, prompt embeddings), so two requests share pool pages exactly where vLLM's block
hashes would let them share blocks (``plan``).

vLLM makes one instance per role: the scheduler's (``SchedulerSide``: lookups, plans) and one per worker
(``WorkerSide``: bytes). The step plan travels as ``UmbpConnectorMetadata``. One KV cache group only (no hybrid
allocator), one vLLM block per pool page, synchronous loads (filled layer by layer inside the step that needs
them), asynchronous saves with delayed frees. See docs/integrations/vllm.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from umbp.errors import ConfigError, InvalidArgument
from umbp.integrations.vllm.blocks import COMPONENT, namespace
from umbp.integrations.vllm.plan import Extras, LoadSpec, SaveSpec, StepPlan, extra_digest
from umbp.integrations.vllm.scheduler import SchedulerSide
from umbp.integrations.vllm.worker import PoolSettings, WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass
class UmbpConnectorMetadata(KVConnectorMetadata):
    """One step's plan, scheduler to workers."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: bool = False

    def plan(self) -> StepPlan:
        return StepPlan(self.loads, self.saves)


def _settings(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> tuple[PoolSettings, bool, int]:
    """Pool settings, whether the KV is replicated on TP ranks (MLA), and the block size."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(COMPONENT, f"one KV cache group is supported, this model has {len(groups)} "
                                     f"(start vLLM with --disable-hybrid-kv-cache-manager)")
    spec = groups[0].kv_cache_spec
    replicated = type(spec).__name__.startswith("MLA") or bool(getattr(vllm_config.model_config, "use_mla", False))
    block_size = int(spec.block_size)
    metaserver = extra.get("metaserver")
    if not metaserver:
        raise ConfigError(COMPONENT, "kv_connector_extra_config needs 'metaserver': 'HOST:PORT'")
    tp = vllm_config.parallel_config.tensor_parallel_size
    ns = extra.get("namespace") or namespace(vllm_config.model_config.model,
                                             getattr(vllm_config.cache_config, "kv_cache_layout", None),
                                             block_size, spec.dtype, tp, replicated)
    try:
        group = int(extra.get("layer_group_size", 1))
    except (TypeError, ValueError):
        group = 0
    if group < 1:
        raise ConfigError(COMPONENT, f"layer_group_size must be a positive integer, got "
                                     f"{extra.get('layer_group_size')!r}")
    return (PoolSettings(str(metaserver), ns, extra.get("token"), extra.get("transport"), group), replicated,
            block_size)


def block_extras(request: Any, block_size: int) -> Extras:
    """Block ``i`` of ``request`` -> the digest of vLLM's own extra block-hash keys for it (LoRA name and path,
    multimodal hashes and offsets, ``cache_salt`` on block 0, prompt-embedding hashes; None when it has none), so
    pool keys differ wherever vLLM's block hashes do. vLLM's function is called rather than copied, so extra keys a
    later vLLM adds are keyed too."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    def extras(i: int) -> bytes | None:
        try:
            keys, _ = generate_block_hash_extra_keys(request, i * block_size, (i + 1) * block_size, 0)
        except Exception as e:  # noqa: BLE001 - any failure: this request is not pooled (plan.Planner.keys_for)
            raise InvalidArgument(COMPONENT, f"vLLM's extra block-hash keys of block {i}: "
                                             f"{type(e).__name__}: {e}") from e
        return extra_digest(keys)

    return extras


class UmbpConnector(KVConnectorBase_V1):
    """The pool as vLLM's KV connector (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        pool, replicated, block_size = _settings(vllm_config, kv_cache_config)
        kv_role = self._kv_transfer_config.kv_role
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.pool = pool
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(pool, block_size, tp, replicated, save=kv_role != "kv_consumer",
                                           load=kv_role != "kv_producer")
        else:
            rank = 0
            if tp > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
            self.worker = WorkerSide(pool, kv_cache_config.num_blocks, rank, replicated,
                                     kv_cache_config.kv_cache_groups[0].layer_names)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss

    # ---- worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UmbpConnectorMetadata)
        self.worker.start_load(meta.plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # a page object holds every layer: the step's blocks are saved together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, UmbpConnectorMetadata)
        self.worker.save(meta.plan())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if getattr(kv_connector_metadata, "preempted", False):
            self.worker.drain_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.finished(finished_req_ids) or None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        if self.scheduler is not None:
            self.scheduler.close()

    # ---- scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request.request_id, request.all_token_ids, num_computed_tokens,
                                             block_extras(request, self.scheduler.planner.block_size)), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler.allocated(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        plan = self.scheduler.build(scheduler_output)
        return UmbpConnectorMetadata(plan.loads, plan.saves, bool(getattr(scheduler_output, "preempted_req_ids",
                                                                          None)))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.finished(request.request_id), None
