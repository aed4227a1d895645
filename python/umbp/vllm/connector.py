"""`UMBPStoreConnector`: a vLLM V1 KV connector that offloads prefix blocks to UMBP.

vLLM loads this class by name (`"kv_connector": "UMBPStoreConnector"`, registered by the
package's plugin) or by module path (`"kv_connector_module_path": "umbp.vllm.connector"`). It
builds the connector twice, in different processes: once with the scheduler role and once per
worker. This class only validates the options, derives the engine's topology, picks the runtime
of the mode and hands every hook to one of the two sides:

- `umbp.vllm.scheduler.SchedulerSide`: lookups, load planning, store pinning, KV events;
- `umbp.vllm.worker.WorkerSide`: the worker's store, its loads and stores;
- `umbp.vllm.runtime`: where the store, the lookup client and the lookup server come from
  (embedded mode: a private pool per worker, lookups on a Unix socket in `lookup_dir`);
- `umbp.vllm.metadata`: what the two sides send each other every step.

Keys, lookups, range planning and copies happen in Rust (`umbp._native`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from umbp.errors import ConfigError
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.metadata import UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.runtime import runtime_class
from umbp.vllm.scheduler import SchedulerSide
from umbp.vllm.stats import UMBPConnectorStats, UMBPPromMetrics
from umbp.vllm.topology import engine_topology
from umbp.vllm.worker import WorkerSide, local_ranks

# Hooks that not every supported vLLM has: the connector uses them where they exist.
try:  # per-request load failures (the only kind vLLM accepts with several cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]
try:  # the hybrid allocator's marker (several KV cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM
    SupportsHMA = None  # type: ignore[assignment,misc]
try:  # how the engine's KV cache memory is reached (0.34: the extensible KV cache)
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # pragma: no cover - vLLM before 0.34
    KVCacheAccess = None  # type: ignore[assignment,misc]
try:  # cache-hit labels of vLLM's metrics
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]

#: Several cache groups need per-request failure reporting: declare hybrid-allocator support only
#: where vLLM can take it.
_HYBRID_BASES: tuple[type, ...] = (
    (SupportsHMA,) if SupportsHMA is not None and KVConnectorTransferResults is not None else ()
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["UMBPStoreConnector", "UMBPConnectorMetadata", "UMBPWorkerMetadata"]

logger = logging.getLogger("umbp.vllm")


def log_through_vllm() -> None:
    """Sends the `umbp` logger's records through vLLM's own handlers, at vLLM's level, so
    UMBP's start-up lines and warnings sit in the engine's log in its format. Python gives a
    library's logger no handler, and vLLM configures only `vllm`: without this, UMBP's INFO
    lines are dropped. An application that configured `umbp` itself is left alone."""
    ours, theirs = logging.getLogger("umbp"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for h in theirs.handlers:
        ours.addHandler(h)
    ours.setLevel(theirs.level or logging.INFO)
    ours.propagate = theirs.propagate


class UMBPStoreConnector(KVConnectorBase_V1, *_HYBRID_BASES):
    """Offloads prefix KV blocks to UMBP host-DRAM pools and restores them."""

    if CacheHitSource is not None:
        # Restored tokens come from host memory (vLLM's per-tier hit metrics).
        _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Sleep mode unmaps the KV cache (and offloads the weights). `unregister_kv_caches` /
        # `restore_kv_caches` now drain and drop the registrations around it, but no engine
        # has slept and woken with this connector yet: vLLM (0.33 and later) refuses the
        # combination at start-up until one has.
        return False

    if KVCacheAccess is not None:
        _export_logged = False  # kv_cache_access's note, once per process

        @classmethod
        def kv_cache_access(cls, kv_transfer_config: Any) -> KVCacheAccess:
            """How UMBP reaches the KV cache's memory (vLLM 0.34 and later; vLLM asks in the
            process that builds the config, then in every worker, before allocating).

            Embedded mode copies in the worker's own process: any allocation works, vLLM's
            extensible KV cache included (`IN_PROCESS`). Standalone mode hands the memory to
            the server, as option `kv_cache_export` says: `fd` (`auto` on CUDA) declares
            `EXPORTS_FD`, so vLLM keeps its extensible cache and allocates it exportable, one
            physical allocation per layer segment, which the server imports through file
            descriptors; `ipc` (`auto` elsewhere: vLLM refuses `EXPORTS_FD` off CUDA) declares
            `LEGACY_IPC`, so vLLM allocates the cache as 0.33 did. Options that do not parse
            are left for the connector's own start-up to refuse by name."""
            extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
            if not isinstance(extra, dict) or extra.get("mode") != "standalone":
                return KVCacheAccess.IN_PROCESS
            try:
                export = ConnectorConfig.parse(extra).kv_cache_export
            except ConfigError:
                return KVCacheAccess.LEGACY_IPC
            if export == "auto":
                from vllm.platforms import current_platform

                export = "fd" if current_platform.is_cuda() else "ipc"
                if export == "fd" and not cls._export_logged:
                    cls._export_logged = True
                    log_through_vllm()
                    logger.info(
                        "umbp: standalone mode declares EXPORTS_FD: vLLM's extensible KV "
                        "cache stays on and the server imports it through file descriptors. "
                        "Where vLLM refuses that (kv_cache_memory_bytes, "
                        "num_gpu_blocks_override, --no-enable-extensible-kv-cache), set "
                        'kv_connector_extra_config {"kv_cache_export": "ipc"}.'
                    )
            return KVCacheAccess.EXPORTS_FD if export == "fd" else KVCacheAccess.LEGACY_IPC

    if hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes"):

        @classmethod
        def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
            """vLLM 0.34: with EAGLE / MTP drafting, block hashes may cover the tokens after
            their block. The connector keys everything by the request's block hashes as they
            are (the lookahead joins the key namespace), never looks up or stores past them,
            and keeps a hit's last block then, as vLLM's own prefix cache does."""
            return True

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache: a dropped store is only a future miss.
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_through_vllm()
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.parse(ktc.kv_connector_extra_config, ktc.kv_role)
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            # vLLM before 0.33 does not ask `supports_sleep_mode`: refuse here too.
            raise ConfigError(
                "UMBPStoreConnector does not support sleep mode: it unmaps the KV cache while "
                "UMBP may be copying it; unset `enable_sleep_mode` (--enable-sleep-mode) or run "
                "without the connector"
            )
        runtime = runtime_class(self.cfg)  # refuses a mode this release cannot run
        topo = engine_topology(self.cfg, vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self.cfg, topo, runtime(self.cfg, topo), vllm_config)
        else:
            self._worker = WorkerSide(
                self.cfg, topo, runtime(self.cfg, topo), kv_cache_config, local_ranks(topo)
            )
            self._worker.cache_config = vllm_config.cache_config

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        # vLLM 0.33+: before it releases the KV cache's memory (0.34 also outside sleep mode).
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        # vLLM 0.33+: after it mapped the KV cache's memory again, at the same addresses.
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, UMBPConnectorMetadata)
            if meta.loads:
                self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete before the forward pass (sync) or before scheduling (async)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores are submitted once per step, in wait_for_save

    def wait_for_save(self) -> None:
        if self._worker is not None and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, UMBPConnectorMetadata)
            if meta.stores:
                self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished()

    if KVConnectorTransferResults is not None:

        def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
            sending, recving = self.get_finished(finished_req_ids)
            failed = self._worker.take_failed_recving() if self._worker is not None else set()
            return KVConnectorTransferResults(
                finished_sending=set(sending or ()),
                finished_recving=set(recving or ()),
                failed_recving=failed,
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- scheduler side ----------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        if self._scheduler is not None:
            self._scheduler.block_pool = gpu_block_pool

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: Request) -> bool:
        # vLLM 0.34 (`--max-num-inflight-kv-loads`): start likely restores early.
        return self._scheduler is not None and self._scheduler.may_load_async(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Store sources are pinned by the connector itself, so freeing never waits on us.
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # As request_finished: store sources are pinned by the connector itself.
        return False, None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def take_events(self):
        return self._scheduler.take_events() if self._scheduler is not None else ()

    # -- stats (both roles; vLLM sums them per engine and hands them to its loggers) ----------

    def get_kv_connector_stats(self) -> UMBPConnectorStats | None:
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> UMBPConnectorStats:
        return UMBPConnectorStats(data=data) if data else UMBPConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> UMBPPromMetrics:
        return UMBPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None
