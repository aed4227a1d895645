"""The worker side of `UMBPStoreConnector` (one per vLLM worker process).

- `register_kv_caches` opens this worker's store through the runtime, registers the KV cache
  memory and every cache group's layout with it, and starts answering the scheduler's lookups;
- `start_load_kv` copies restored blocks in (waiting for synchronous loads before the forward
  pass); `wait_for_save` submits the step's stores after the forward pass;
- `worker_meta` reports finished stores, `get_finished` finished async loads, and
  `take_load_errors` the blocks that could not be restored, which vLLM recomputes under
  `kv_load_failure_policy: recompute`.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

import torch

import umbp
from umbp.errors import ConfigError
from umbp.kv_layout import describe_tensor, register_tensor_layout, summary_line
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.metadata import Transfer, UMBPConnectorMetadata, UMBPWorkerMetadata
from umbp.vllm.runtime import Runtime, Store, TransferHandle
from umbp.vllm.stats import StatsCollector, UMBPConnectorStats
from umbp.vllm.testhook import RestoreCorrupter
from umbp.vllm.topology import Ranks, Topology

logger = logging.getLogger("umbp.vllm")


#: (what, topology field, vLLM's getter) of each rank a worker's keys carry.
_RANK_GROUPS = (
    ("tensor parallel", "tp_size", "get_tp_group"),
    ("prefill context parallel", "pcp_size", "get_pcp_group"),
    ("decode context parallel", "dcp_size", "get_dcp_group"),
)


def local_ranks(topo: Topology) -> Ranks:
    """This worker's TP, PCP and DCP ranks, from vLLM's parallel groups of this process.

    Raises instead of guessing: a worker that took rank 0 for a rank it could not find would
    store its blocks under another rank's keys and answer lookups for that rank, and with a
    pool shared across engines another rank's workers would restore its KV as their own.
    """
    from vllm.distributed import parallel_state as ps

    found = []
    for what, size_field, getter in _RANK_GROUPS:
        size = getattr(topo, size_field)
        get = getattr(ps, getter, None)
        if get is None:
            raise RuntimeError(
                f"UMBPStoreConnector cannot tell this worker's {what} rank: this vLLM has no "
                f"`vllm.distributed.parallel_state.{getter}`; use a supported vLLM (0.32 or newer)"
            )
        try:
            group = get()
            rank, world = int(group.rank_in_group), int(group.world_size)
        except Exception as e:
            raise RuntimeError(
                f"UMBPStoreConnector cannot tell this worker's {what} rank: "
                f"`vllm.distributed.parallel_state.{getter}()` failed ({type(e).__name__}: {e}). "
                "The worker side must be created in a vLLM worker whose parallel groups are "
                "initialised; it does not assume rank 0, which would serve another rank's KV"
            ) from e
        if world != size or not 0 <= rank < size:
            raise RuntimeError(
                f"UMBPStoreConnector: vLLM's {what} group of this worker has rank {rank} of "
                f"{world}, but the engine's configuration says {size_field}={size}; the worker's "
                "keys would not match the scheduler's"
            )
        found.append(rank)
    tp, pcp, dcp = found
    return Ranks(tp=tp, pcp=pcp, dcp=dcp)


#: The standalone server's CUDA staging by default (2 × `--cuda-staging-bytes`).
SERVER_STAGING_BYTES = 2 * (256 << 20)


def gpu_headroom_advice(cache_config: Any, staging_bytes: int, total_bytes: int) -> str | None:
    """A warning when UMBP's CUDA staging (allocated after vLLM sized its KV cache) would
    come out of the margin vLLM keeps, else None.

    vLLM 0.34's extensible KV cache (on by default on CUDA) sizes itself from the memory free
    after warm-up, with `gpu_memory_utilization` defaulting to 1.0, and keeps only its own
    margin and 0.5 GiB for allocations outside torch free. vLLM 0.32 and 0.33 (utilization
    0.9 of the whole device by default) leave gigabytes. The exact setting: a utilization of
    at most 1 - staging / device memory leaves the staging outside vLLM's budget."""
    if not getattr(cache_config, "enable_extensible_kv_cache", False) or staging_bytes <= 0:
        return None
    advice = math.floor(100 * (1 - staging_bytes / total_bytes)) / 100
    used = getattr(cache_config, "gpu_memory_utilization", None)
    if used is not None and used <= advice:
        return None
    return (
        f"umbp: UMBP's CUDA staging takes {staging_bytes >> 20} MiB of GPU memory after vLLM's "
        f"extensible KV cache sized itself (gpu_memory_utilization "
        f"{'unset, i.e. 1.0' if used is None else used}): that comes out of the margin vLLM "
        f"keeps for its own allocations. Set gpu_memory_utilization={advice} "
        "(--gpu-memory-utilization), or lower cuda_staging_bytes (standalone mode: the "
        "server's --cuda-staging-bytes)"
    )


class _Skipped:
    """A store this rank leaves to another rank of its replica group (the keys are shared):
    finished at once, every block "skipped"."""

    done = True
    elapsed_s = None
    object_bytes = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def poll(self) -> list[str]:
        return ["skipped"] * self.n

    def wait(self, timeout_ms: int | None = None) -> list[str]:
        return self.poll()


class _Dropped:
    """A store not made (the KV memory was released): finished at once, every block dropped
    (as a full pool drops them)."""

    done = True
    elapsed_s = None
    object_bytes = 0

    def __init__(self, n: int) -> None:
        self.n = n

    def poll(self) -> list[str]:
        return ["pool_full"] * self.n


def _pool_fields(s: dict[str, Any], remote: dict[str, Any]) -> dict[str, int]:
    """A pool's occupancy and cumulative counts, from its stats (and its remote tier's)."""
    fields = {k: int(s[k]) for k in ("used_bytes", "capacity_bytes", "objects", "evictions")}
    fields["corrupt_detected"] = int(s.get("corrupt_detected", 0))
    if "hits" in remote:
        fields["remote_hits"] = int(remote["hits"])
    return fields


class _PoolPoller:
    """Reads the server's pool every 5 s on a thread of its own, so that a stalled server never
    holds up the engine's step; `take()` hands each new snapshot over once."""

    EVERY_S = 5.0

    def __init__(self, client: Any, pool_id: str) -> None:
        self.client, self.pool_id = client, pool_id
        self._latest: tuple[str, dict[str, int]] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="umbp-pool-stats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = self.client.stats()
                self._latest = (self.pool_id, _pool_fields(s, s.get("remote") or {}))
            except umbp.UmbpError as e:  # the server away: no snapshot this time
                logger.debug("umbp: no snapshot of the server's pool: %s", e)
            self._stop.wait(self.EVERY_S)

    def take(self) -> tuple[str, dict[str, int]] | None:
        latest, self._latest = self._latest, None
        return latest

    def stop(self) -> None:
        self._stop.set()


class WorkerSide:
    """The connector's worker role: this rank's store, its loads and stores, its lookups."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        topo: Topology,
        runtime: Runtime,
        kv_cache_config: Any,
        ranks: Ranks,
    ) -> None:
        self.cfg = cfg
        self.topo = topo
        self.runtime = runtime
        self.kv_cache_config = kv_cache_config
        self.tp, self.pcp, self.dcp = ranks.tp, ranks.pcp, ranks.dcp
        self.ranks = ranks
        self.worker = ranks.worker(topo)
        # Ranks of one replica group (MLA) share their keys: in standalone mode the first of
        # them stores each block and every one loads it; in embedded mode each stores into its
        # own pool and the first alone writes the remote tier's shared objects.
        self.keys = umbp.KeyBuilder(
            topo.namespace, tp=topo.key_tp(self.tp), pcp=self.pcp, dcp=self.dcp
        )
        self.stores_blocks = topo.stores_blocks(self.tp)
        self.store: Store | None = None
        self.server: umbp.LookupServer | None = None
        self.layout = -1
        # Async loads by request: (job, block ids, group) each.
        self.async_loads: dict[str, list[tuple[TransferHandle, list[int], int]]] = {}
        self.load_errors: set[int] = set()
        self.collector = StatsCollector(count_blocks=self.worker == 0)
        self._pool_poller: _PoolPoller | None = None  # standalone: the server's pool
        self.failed_recving: set[str] = set()  # async loads that failed (several groups)
        self.unplanned_loads: set[str] = set()  # async loads the scheduler could not plan
        self.stores: dict[int, TransferHandle] = {}
        self.cuda_device: torch.device | None = None
        self.logged_stream: int | None = None
        # vLLM's cache config (its GPU memory budget), set by the connector.
        self.cache_config: Any = None
        # The KV cache's tensors and their registrations (region ids), kept so that
        # released KV memory can be deregistered and registered again (vLLM 0.34).
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.regions: list[int] = []
        self.released = False
        # A test hook: corrupts restores on purpose (UMBP_TEST_CORRUPT_RESTORES; never set in
        # production).
        self.corrupter = RestoreCorrupter.from_env()

    def _stream(self) -> int | None:
        """The engine's current CUDA stream: copies are ordered after the work queued on it
        (stores copy what the forward pass wrote; loads wait for readers of their blocks)."""
        if self.cuda_device is None:
            return None
        handle = torch.cuda.current_stream(self.cuda_device).cuda_stream
        if handle != self.logged_stream:
            # Once at INFO; a later change of stream (an engine that alternates) at DEBUG.
            log = logger.info if self.logged_stream is None else logger.debug
            self.logged_stream = handle
            log(
                "umbp: transfers ordered after the engine's CUDA stream %#x%s",
                handle,
                " (the legacy default stream)" if handle == 0 else "",
            )
        return handle

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.store = self.runtime.open_store(self.ranks)
        self.kv_caches = dict(kv_caches)
        self._register_memory(kv_caches)
        if self.cuda_device is not None:
            staging = (
                SERVER_STAGING_BYTES
                if self.cfg.mode == "standalone"
                else 2 * self.cfg.cuda_staging_bytes
            )
            total = torch.cuda.get_device_properties(self.cuda_device).total_memory
            note = gpu_headroom_advice(self.cache_config, staging, total)
            if note:
                logger.warning("%s", note)
        self.layout = self._register_layout(kv_caches)
        self.server = self.runtime.serve_lookups(self.store, self.ranks)
        logger.info(
            "umbp: worker %d: %s, %d layers registered; %s",
            self.worker,
            self.runtime.describe_worker(),
            sum(len(g.layer_names) for g in self.kv_cache_config.kv_cache_groups),
            summary_line(self.store.layout_summary(self.layout)),
        )

    def _register_memory(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Registers each backing allocation once (all layers are views into one or a few).
        CUDA tensors go through the GPU copy path (the CUDA driver is loaded only here, in the
        worker, after vLLM has initialised CUDA); CPU tensors through host copies."""
        assert self.store is not None
        seen: set[int] = set()
        for t in kv_caches.values():
            if t.device.type not in ("cpu", "cuda"):
                raise ConfigError(
                    f"UMBPStoreConnector: KV cache on {t.device} is not supported; "
                    "use a CUDA or CPU engine"
                )
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                if t.device.type == "cuda":
                    region = self.store.register_cuda_memory(
                        ptr, storage.nbytes(), t.device.index or 0
                    )
                    self.cuda_device = t.device
                else:
                    region = self.store.register_memory(ptr, storage.nbytes())
                self.regions.append(region)

    def unregister_kv_caches(self) -> None:
        """vLLM is about to release the KV cache's memory (vLLM 0.34: `release_kv_cache_memory`,
        `discard`, a weight update; sleep mode is refused): waits for every transfer still
        using it and drops its registrations, so nothing is copied into memory vLLM no longer
        backs. The pool keeps what was stored. Idempotent; a call that failed part-way
        deregisters the rest when called again."""
        if self.store is None or (self.released and not self.regions):
            return
        pending = len(self.stores) + sum(len(j) for j in self.async_loads.values())
        self.layout, self.released = -1, True  # a step from here copies nothing
        while self.regions:  # each waits for the transfers that use it
            self.store.deregister_memory(self.regions[-1])
            self.regions.pop()
        logger.info(
            "umbp: worker %d: KV cache memory deregistered (vLLM releases it; %d transfers "
            "were in flight); the pool keeps its objects",
            self.worker,
            pending,
        )

    def restore_kv_caches(self) -> None:
        """vLLM mapped the KV cache's memory again, at the same addresses (its contents are
        gone): registers it and its layout again. Idempotent."""
        if not self.released or self.store is None:
            return
        self.unregister_kv_caches()  # what a failed call left registered
        self._register_memory(self.kv_caches)
        self.layout = self._register_layout(self.kv_caches)
        self.released = False
        logger.info("umbp: worker %d: KV cache memory registered again", self.worker)

    def _register_layout(self, kv_caches: dict[str, torch.Tensor]) -> int:
        """Registers every cache group's layers from their tensor views: the store finds the
        runs of a block from each view's strides (one per layer in LBHNC/LBNHC, one per KV head
        in LHBNC/BHLNC) and refuses a view it cannot plan exactly, naming it."""
        assert self.store is not None
        num_blocks = self.kv_cache_config.num_blocks
        groups = []
        for gi, g in enumerate(self.kv_cache_config.kv_cache_groups):
            layers = []
            seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
            for name in g.layer_names:
                t = kv_caches[name]
                view = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                if view in seen:
                    # A layer that reuses another layer's KV cache (cross-layer KV sharing):
                    # its bytes are already in the object.
                    continue
                seen.add(view)
                spec = g.kv_cache_spec
                specs = getattr(spec, "kv_cache_specs", None)
                if isinstance(specs, dict):
                    spec = specs.get(name, spec)
                if getattr(spec, "has_layer_views", True) is False:
                    raise ConfigError(
                        f"UMBPStoreConnector: KV cache group {gi} ({type(spec).__name__}) has "
                        "no per-layer KV views (an engine-internal buffer such as a "
                        "sparse-attention hot cache); models with such layers are not "
                        "supported yet"
                    )
                expected = getattr(spec, "unpadded_page_size_bytes", None)
                layers.append(
                    describe_tensor(
                        name, t, num_blocks, expected if isinstance(expected, int) else None
                    )
                )
            groups.append(layers)
        return register_tensor_layout(
            self.store,
            groups,
            [num_blocks] * len(groups),
            layout_name=getattr(self.kv_cache_config, "kv_cache_layout", None),
        )

    def _keys(self, t: Transfer) -> umbp.Keys:
        return self.keys.keys_packed(t.group, t.hashes, t.hash_len)

    def start_load_kv(self, meta: UMBPConnectorMetadata) -> None:
        assert self.store is not None
        if self.released:
            # No step should run while vLLM has the KV memory released; if one does, nothing
            # is copied: every planned load fails and vLLM recomputes those blocks.
            meta = meta.with_loads_failed()
        for rid, is_async, ids in meta.failed_loads:
            self.collector.failed_loads(len(ids))
            if is_async:
                self.unplanned_loads.add(rid)  # reported finished (and failed) by get_finished
            else:
                self.load_errors.update(ids)
        sync: list[tuple[TransferHandle, list[int], int]] = []
        for t in meta.loads:
            job = self.store.load(
                self.layout, t.group, t.block_ids, self._keys(t), stream=self._stream()
            )
            if t.load_async:
                self.async_loads.setdefault(t.req_id, []).append((job, t.block_ids, t.group))
            else:
                sync.append((job, t.block_ids, t.group))
        for job, ids, group in sync:
            try:
                statuses = job.wait(self.cfg.timeout_ms)
            except umbp.TransferTimeout as e:
                # The blocks may still be written: never let the step use them.
                raise RuntimeError(
                    f"UMBP: a synchronous load of {len(ids)} blocks did not finish within "
                    f"timeout_ms={self.cfg.timeout_ms}; failing the step"
                ) from e
            self.collector.transfer("load", job, statuses)
            self._note_failures(statuses, ids)
            if self.corrupter is not None:
                self.corrupter.after_load(
                    self.kv_caches, self.kv_cache_config, group, ids, statuses
                )

    def _note_failures(self, statuses: list[str], ids: list[int]) -> None:
        failed = [b for s, b in zip(statuses, ids) if s != "done"]
        if failed:
            # A block after a failed one is useless for the prefix too: report the rest.
            first = statuses.index(next(s for s in statuses if s != "done"))
            self.load_errors.update(ids[first:])
            logger.info(
                "umbp: %d of %d restored blocks failed to load; vLLM recomputes them",
                len(ids) - first,
                len(ids),
            )

    def wait_for_save(self, meta: UMBPConnectorMetadata) -> None:
        assert self.store is not None
        if self.released:  # dropped, as a full pool drops stores: a future miss
            for t in meta.stores:
                self.stores[t.store_id] = _Dropped(len(t.block_ids))
            return
        for t in meta.stores:
            if not self.stores_blocks:  # another rank of the replica group stores them
                self.stores[t.store_id] = _Skipped(len(t.block_ids))
                continue
            self.stores[t.store_id] = self.store.store(
                self.layout,
                t.group,
                t.block_ids,
                self._keys(t),
                stream=self._stream(),
                admit_now=t.admit_now,
            )

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        for rid, jobs in list(self.async_loads.items()):
            if all(j.done for j, _, _ in jobs):
                for j, ids, group in jobs:
                    statuses = j.poll() or []
                    self.collector.transfer("load", j, statuses)
                    if self.corrupter is not None:
                        self.corrupter.after_load(
                            self.kv_caches, self.kv_cache_config, group, ids, statuses
                        )
                    if not self.topo.per_request_failures:
                        self._note_failures(statuses, ids)
                    elif any(st != "done" for st in statuses):
                        # Block ids are per group: vLLM takes only whole-request failures.
                        self.failed_recving.add(rid)
                del self.async_loads[rid]
                done.add(rid)
        for rid in self.unplanned_loads - self.async_loads.keys():
            self.unplanned_loads.discard(rid)
            self.failed_recving.add(rid)
            done.add(rid)
        return None, done or None

    def take_failed_recving(self) -> set[str]:
        failed, self.failed_recving = self.failed_recving, set()
        return failed

    def worker_meta(self) -> UMBPWorkerMetadata | None:
        finished = {sid: 1 for sid, job in self.stores.items() if job.done}
        for sid in finished:
            job = self.stores.pop(sid)
            if isinstance(job, _Skipped):
                self.collector.replica_skipped(job.n)
            else:
                self.collector.transfer("store", job, job.poll() or [])
        return UMBPWorkerMetadata(finished_stores=finished) if finished else None

    def take_stats(self) -> UMBPConnectorStats | None:
        """This worker's counts since the last call, with its pool's snapshot when due (at
        most once a second embedded, every 5 s from the server: never an RPC per step)."""
        if self.store is None:
            return self.collector.take()
        if self.cfg.mode == "standalone":
            if self._pool_poller is None:  # started on first use, in the worker
                self._pool_poller = _PoolPoller(self.store.client, f"server:{self.cfg.endpoint}")
            latest = self._pool_poller.take()
            if latest is not None:
                self.collector.stats.pool(*latest)
        elif self.collector.pool_due(1.0):
            try:
                s, remote = self.store.stats(), self.store.remote_stats() or {}
                self.collector.stats.pool(f"worker:{self.worker}", _pool_fields(s, remote))
            except umbp.UmbpError as e:  # the store closing: no snapshot this time
                logger.debug("umbp: no pool snapshot: %s", e)
        return self.collector.take()

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self._pool_poller is not None:
            self._pool_poller.stop()
        if self.server is not None:
            self.server.shutdown()
        if self.store is not None:
            self.store.close()
        self.runtime.worker_shutdown()
