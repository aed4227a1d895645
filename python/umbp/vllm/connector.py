"""`UMBPStoreConnector`: a vLLM V1 KV connector that offloads prefix blocks to UMBP.

vLLM builds the connector twice, in different processes: once with the scheduler role and once
per worker. This class dispatches to `_SchedulerSide` or `_WorkerSide`; both are thin: keys,
lookups, range planning and copies happen in Rust (`umbp._native`).

Embedded mode: every worker owns a private pool and serves the scheduler's lookups and clears on
a Unix socket in `lookup_dir`. A block hits only when every worker of the engine holds it.

Flow of one request:
- scheduler: `get_num_new_matched_tokens` asks every worker how many of the request's next
  blocks it holds; `update_state_after_alloc` queues a load into the blocks vLLM allocated;
  `build_connector_meta` sends the step's loads and the stores of blocks the step completes.
  Store sources are pinned in vLLM's block pool (`touch`) until every worker reports the
  store finished (`update_connector_output`), so `request_finished` never has to delay.
- worker: `start_load_kv` copies restored blocks in (waiting for synchronous loads before the
  forward pass); `wait_for_save` submits the step's stores after the forward pass;
  `build_connector_worker_meta` reports finished stores; `get_finished` finished async loads;
  `get_block_ids_with_load_errors` the blocks that could not be restored, which vLLM
  recomputes under `kv_load_failure_policy: recompute`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

import umbp
from umbp.errors import ConfigError
from umbp.kv_layout import describe_tensor, register_tensor_layout, summary_line
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.host import check_engine_memory, remove_dead_sockets, socket_dir
from umbp.vllm.namespace import derive_namespace, socket_tag

# Hooks that not every supported vLLM has: the connector uses them where they exist.
try:  # per-request load failures (the only kind vLLM accepts with several cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]
try:  # the hybrid allocator's marker (several KV cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # pragma: no cover - older vLLM
    SupportsHMA = None  # type: ignore[assignment,misc]
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

logger = logging.getLogger("umbp.vllm")


# ---------------------------------------------------------------------------------------------
# Metadata exchanged between the scheduler and the workers
# ---------------------------------------------------------------------------------------------


@dataclass
class _Transfer:
    """Blocks of one cache group to load or store, with the hashes that key them."""

    group: int
    block_ids: list[int]
    hashes: bytes  # packed, `hash_len` bytes each
    hash_len: int
    req_id: str = ""
    store_id: int = -1
    load_async: bool = False


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers: this step's loads and stores."""

    loads: list[_Transfer] = field(default_factory=list)
    stores: list[_Transfer] = field(default_factory=list)
    # Loads that could not be planned: (request id, whether async, blocks vLLM allocated).
    failed_loads: list[tuple[str, bool, list[int]]] = field(default_factory=list)


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: stores that finished, counted per worker."""

    finished_stores: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, UMBPWorkerMetadata)
        merged = dict(self.finished_stores)
        for k, v in other.finished_stores.items():
            merged[k] = merged.get(k, 0) + v
        return UMBPWorkerMetadata(finished_stores=merged)


# ---------------------------------------------------------------------------------------------
# Topology shared by both sides
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Topology:
    namespace: str
    tag: str
    tp_size: int
    pcp_size: int
    dcp_size: int
    dp_rank: int
    block_size: int  # tokens per block hash (the per-rank block size times DCP)
    num_groups: int
    # Groups stored and restored: the prefix-cacheable groups vLLM transfers (vLLM's own
    # `prefix_cacheable_group_ids`, which is also what it expects a load to restore).
    load_groups: tuple[int, ...] = (0,)
    eagle_drop: bool = False  # EAGLE-style drafting: drop the last block of a hit
    per_request_failures: bool = False  # several groups: block ids are ambiguous

    @property
    def force_async_loads(self) -> bool:
        return self.per_request_failures

    nnodes: int = 1  # hosts the engine's workers are spread over

    @property
    def workers(self) -> int:
        return self.tp_size * self.pcp_size

    @property
    def workers_per_host(self) -> int:
        return max(1, -(-self.workers // max(1, self.nnodes)))

    def socket_paths(self, lookup_dir: str) -> list[str]:
        """Every worker's socket, in this user's private directory under `lookup_dir`."""
        d = socket_dir(lookup_dir)
        return [str(umbp.socket_path(d, self.tag, self.dp_rank, w)) for w in range(self.workers)]


def _topology(cfg: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: Any) -> _Topology:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ConfigError(
            f"UMBPStoreConnector does not support pipeline parallelism "
            f"(pipeline_parallel_size={pc.pipeline_parallel_size}); use tensor parallelism, "
            "or run without the connector"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        raise ConfigError("UMBPStoreConnector needs a KV cache with at least one cache group")
    dcp = getattr(pc, "decode_context_parallel_size", 1) or 1
    sizes = {_tokens_per_block(g.kv_cache_spec, dcp) for g in groups}
    if len(sizes) != 1 or None in sizes:
        raise ConfigError(
            "UMBPStoreConnector needs every KV cache group to use one block size "
            f"(got {sorted(map(str, sizes))}); hybrid models with mixed block sizes are not "
            "supported: run them without the connector"
        )
    block_size = sizes.pop()
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, block_size):
        raise ConfigError(
            f"UMBPStoreConnector stores whole {block_size}-token blocks but vLLM hashes every "
            f"{hash_block_size} tokens; unset `prefix_match_unit` (--prefix-match-unit)"
        )
    if cfg.enable_partial_hash_hits:
        unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
        if unit not in (None, block_size):
            raise ConfigError(
                f"option `enable_partial_hash_hits`: the engine matches prefixes every {unit} "
                f"tokens but UMBP stores whole {block_size}-token blocks; set it to false"
            )
    load_groups = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if load_groups is None:  # older vLLM: every group that takes part in prefix caching
        load_groups = [
            i
            for i, g in enumerate(groups)
            if getattr(g, "enable_kv_transfer", True)
            and getattr(g.kv_cache_spec, "prefix_cacheable", True)
        ]
    if not load_groups:
        raise ConfigError(
            "UMBPStoreConnector: no KV cache group of this model takes part in prefix caching, "
            "so there is nothing to offload; run without the connector"
        )
    namespace = cfg.key_namespace or derive_namespace(vllm_config, kv_cache_config)
    return _Topology(
        namespace=namespace,
        tag=socket_tag(namespace, cfg.lookup_instance),
        tp_size=pc.tensor_parallel_size,
        pcp_size=getattr(pc, "prefill_context_parallel_size", 1),
        dcp_size=dcp,
        dp_rank=_dp_index(pc),
        block_size=block_size,
        num_groups=len(groups),
        load_groups=tuple(load_groups),
        eagle_drop=_eagle_drops_last_block(vllm_config),
        per_request_failures=len(groups) > 1,
        nnodes=int(getattr(pc, "nnodes", 1) or 1),
    )


def _dp_index(pc: Any) -> int:
    """The engine's data-parallel rank. vLLM resets `data_parallel_rank` to 0 in every engine
    of a dense model (its DP engines are independent) and keeps the real rank in
    `data_parallel_index`; older vLLM has only the rank."""
    index = getattr(pc, "data_parallel_index", None)
    if index is None:
        index = getattr(pc, "data_parallel_rank", 0)
    return int(index or 0)


def _tokens_per_block(spec: Any, dcp: int) -> int | None:
    """Tokens one block hash covers: with decode context parallelism a block of `block_size`
    tokens per rank spans `block_size × dcp` tokens (vLLM's `resolve_dcp_kv_block_size`)."""
    size = getattr(spec, "block_size", None)
    if size is None:
        return None
    try:
        from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    except ImportError:  # older vLLM
        return size * (dcp if getattr(spec, "dcp_sharded", True) else 1)
    return resolve_dcp_kv_block_size(spec, dcp)


def _eagle_drops_last_block(vllm_config: Any) -> bool:
    """Whether vLLM's own prefix cache drops the last matched block (EAGLE-style drafters
    recompute it to rebuild their hidden states)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    check = getattr(spec, "use_eagle_block_drop", None) or getattr(spec, "use_eagle", None)
    return bool(check()) if callable(check) else False


def _packed(hashes: list[bytes]) -> tuple[bytes, int]:
    if not hashes:
        return b"", 32
    hash_len = len(hashes[0])
    packed = b"".join(hashes)
    if len(packed) != hash_len * len(hashes):
        raise ValueError("block hashes of different lengths in one request")
    return packed, hash_len


# ---------------------------------------------------------------------------------------------
# Scheduler side
# ---------------------------------------------------------------------------------------------


@dataclass
class _RequestState:
    request: Any
    block_ids: list[list[int]]
    stored_upto: int = 0  # blocks [0, stored_upto) were stored, queued or restored
    load_start: int = 0
    load_blocks: int = 0


@dataclass
class _AsyncLookup:
    """A lookup running off the scheduler thread, and what it looked up."""

    first: int
    hashes: tuple[bytes, ...]
    future: Future


@dataclass
class _InFlightStore:
    blocks: list[Any]
    remaining: int
    transfer: _Transfer


class _SchedulerSide:
    def __init__(self, cfg: ConnectorConfig, topo: _Topology, vllm_config: VllmConfig) -> None:
        self.cfg = cfg
        self.topo = topo
        self.client = umbp.LookupClient(
            topo.socket_paths(cfg.lookup_dir), timeout_ms=cfg.lookup_timeout_ms
        )
        self.block_pool: BlockPool | None = None
        self.requests: dict[str, _RequestState] = {}
        self.pending_loads: list[_Transfer] = []
        self.in_flight: dict[int, _InFlightStore] = {}
        self.store_ids = itertools.count(1)
        kv_events = getattr(vllm_config, "kv_events_config", None)
        self.events_enabled = bool(
            kv_events and getattr(kv_events, "enable_kv_cache_events", False)
        )
        self.events: list[Any] = []
        # Tracked stored objects for KV events: hash -> group, bounded by kv_event_max_objects.
        self.tracked: dict[bytes, int] = {}
        self.last_recheck = time.monotonic()
        self.load_async = cfg.load_async or topo.force_async_loads
        self.failed_loads: list[tuple[str, bool, list[int]]] = []
        # Lazy offload: a cursor into vLLM's free queue and the hashes already offloaded.
        self.lazy_cursor: Any = None
        self.lazy_stored: OrderedDict[bytes, None] = OrderedDict()
        batched = getattr(
            getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None
        )
        self.lazy_max = cfg.lazy_offload_max_blocks or max(
            1, 2 * -(-(batched or 8192) // topo.block_size)
        )
        # lookup_async: one lookup per request at a time, on `lookup_workers` threads.
        self.async_lookups: dict[str, _AsyncLookup] = {}
        self.lookup_pool: ThreadPoolExecutor | None = None
        logger.info(
            "umbp: scheduler side: namespace %s, %d worker socket(s) in %s",
            topo.namespace,
            topo.workers,
            cfg.lookup_dir,
        )

    def shutdown(self) -> None:
        # vLLM shuts the scheduler down after the executor has stopped (or killed) the
        # workers: remove the sockets of workers that could not remove their own.
        if self.lookup_pool is not None:
            self.lookup_pool.shutdown(wait=False, cancel_futures=True)
        try:
            paths = self.topo.socket_paths(self.cfg.lookup_dir)
        except ConfigError as e:  # the directory changed under us: leave it alone
            logger.warning("umbp: lookup sockets not checked at shutdown: %s", e)
            return
        for p in remove_dead_sockets(paths):
            logger.info("umbp: removed the socket of a worker that did not shut down: %s", p)

    # -- lookups ---------------------------------------------------------------------------

    def _lookup_range(self, request: Request, num_computed_tokens: int) -> tuple[int, int]:
        bs = self.topo.block_size
        # Leave at least one prompt token for vLLM to compute.
        last = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        return num_computed_tokens // bs, last

    def _lookup(self, hashes: list[bytes]) -> int:
        """Leading blocks every worker holds, in every group a load restores."""
        packed, hash_len = _packed(hashes)
        hits = len(hashes)
        for g in self.topo.load_groups:
            hits = min(hits, self.client.prefix_hits(g, packed, hash_len))
            if hits <= 0:
                return 0
        return hits

    def _lookup_async(self, rid: str, first: int, hashes: list[bytes]) -> int | None:
        """The hits of a finished background lookup of exactly these blocks, or None (asked
        again later). A lookup of another range or other hashes (the request's tokens or its
        local hit changed meanwhile) is dropped and started again."""
        key = tuple(hashes)
        entry = self.async_lookups.get(rid)
        if entry is not None and (entry.first != first or entry.hashes != key):
            entry.future.cancel()
            entry = None
        if entry is None:
            if self.lookup_pool is None:
                self.lookup_pool = ThreadPoolExecutor(
                    max_workers=self.cfg.lookup_workers, thread_name_prefix="umbp-lookup"
                )
            entry = _AsyncLookup(first, key, self.lookup_pool.submit(self._lookup, hashes))
            self.async_lookups[rid] = entry
        if not entry.future.done():
            return None
        del self.async_lookups[rid]
        try:
            return entry.future.result()
        except Exception as e:  # a failed lookup is a miss
            logger.warning("umbp: lookup of request %s failed: %s", rid, e)
            return 0

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        state = self.requests.get(request.request_id)
        if state is None:
            state = _RequestState(
                request=request, block_ids=[[] for _ in range(self.topo.num_groups)]
            )
            self.requests[request.request_id] = state
        if not self.cfg.restores:
            return 0, False
        first, last = self._lookup_range(request, num_computed_tokens)
        if last <= first:
            return 0, False
        hashes = list(request.block_hashes[first:last])
        if self.cfg.lookup_async:
            found = self._lookup_async(request.request_id, first, hashes)
            if found is None:
                return None, False
            hits = found
        else:
            hits = self._lookup(hashes)
        if self.topo.eagle_drop:
            # As vLLM's own prefix cache: the drafter recomputes the last matched block.
            hits -= 1
        if hits <= 0:
            return 0, False
        state.load_start, state.load_blocks = first, hits
        return hits * self.topo.block_size, self.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self.requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        n = num_external_tokens // self.topo.block_size
        first = state.load_start
        ids_by_group = blocks.get_block_ids()
        block_hashes = list(request.block_hashes[first : first + n])
        rid = request.request_id
        loads = []
        for g in self.topo.load_groups:
            targets = list(ids_by_group[g][first : first + n]) if g < len(ids_by_group) else []
            if len(targets) != n:
                logger.warning(
                    "umbp: request %s: %d blocks of group %d allocated for %d restored blocks; "
                    "its load is reported failed and vLLM recomputes it",
                    rid,
                    len(targets),
                    g,
                    n,
                )
                allocated = [b for ids in ids_by_group for b in ids[first : first + n] if b]
                self.failed_loads.append((rid, self.load_async, allocated))
                loads = []
                break
            # Null blocks (block 0: e.g. sliding-window blocks outside the window) hold nothing.
            keep = [i for i, b in enumerate(targets) if b != 0]
            if not keep:
                continue
            hashes, hash_len = _packed([block_hashes[i] for i in keep])
            loads.append(
                _Transfer(
                    group=g,
                    block_ids=[targets[i] for i in keep],
                    hashes=hashes,
                    hash_len=hash_len,
                    req_id=rid,
                    load_async=self.load_async,
                )
            )
        self.pending_loads.extend(loads)
        # Restored blocks are in the pool already: do not store them again.
        state.stored_upto = max(state.stored_upto, first + n)

    # -- stores ----------------------------------------------------------------------------

    def _scheduled(self, so: SchedulerOutput):
        """(req_id, new block ids per group or None, resumed, computed tokens before the step)."""
        for r in so.scheduled_new_reqs:
            yield r.req_id, r.block_ids, False, r.num_computed_tokens
        c = so.scheduled_cached_reqs
        resumed = getattr(c, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(c.req_ids):
            yield rid, c.new_block_ids[i], rid in resumed, c.num_computed_tokens[i]

    def build_connector_meta(self, so: SchedulerOutput) -> UMBPConnectorMetadata:
        meta = UMBPConnectorMetadata(loads=self.pending_loads, failed_loads=self.failed_loads)
        self.pending_loads, self.failed_loads = [], []
        for rid in getattr(so, "preempted_req_ids", None) or ():
            state = self.requests.get(rid)
            if state is not None:
                state.block_ids = [[] for _ in range(self.topo.num_groups)]
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            lookup = self.async_lookups.pop(rid, None)
            if lookup is not None:
                lookup.future.cancel()
        if not self.cfg.stores or self.block_pool is None:
            return meta
        if self.cfg.lazy_offload:
            self._lazy_stores(meta)
            return meta
        bs = self.topo.block_size
        for rid, new_ids, resumed, computed in self._scheduled(so):
            state = self.requests.get(rid)
            if state is None:
                continue
            if new_ids is not None:
                for g, ids in enumerate(new_ids):
                    if g >= len(state.block_ids) or ids is None:
                        continue
                    if resumed:
                        state.block_ids[g] = list(ids)
                    else:
                        state.block_ids[g].extend(ids)
            req = state.request
            done_tokens = computed + so.num_scheduled_tokens.get(rid, 0)
            full = min(done_tokens // bs, len(req.block_hashes))
            if not self.cfg.save_decode_cache:
                full = min(full, req.num_prompt_tokens // bs)
            first = state.stored_upto
            if full <= first:
                continue
            state.stored_upto = full
            hashes = list(req.block_hashes[first:full])
            for g in self.topo.load_groups:  # only what a hash-addressed store can serve
                if g >= len(state.block_ids):
                    continue
                block_ids = state.block_ids[g][first:full]
                if len(block_ids) != full - first:
                    continue  # this group's blocks are not all allocated
                # Null blocks (block 0: sliding-window blocks outside the window, e.g. those
                # of vLLM's own prefix hit) hold nothing; the group's other blocks are stored.
                keep = [i for i, b in enumerate(block_ids) if b != 0]
                if not keep:
                    continue
                self._add_store(
                    meta,
                    g,
                    [self.block_pool.blocks[block_ids[i]] for i in keep],
                    [hashes[i] for i in keep],
                    rid,
                )
        return meta

    def _add_store(
        self,
        meta: UMBPConnectorMetadata,
        group: int,
        blocks: list[Any],
        hashes: list[bytes],
        rid: str,
    ) -> None:
        """Pins `blocks` until every worker has stored them, and queues their store."""
        assert self.block_pool is not None
        self.block_pool.touch(blocks)
        packed, hash_len = _packed(hashes)
        sid = next(self.store_ids)
        t = _Transfer(
            group=group,
            block_ids=[b.block_id for b in blocks],
            hashes=packed,
            hash_len=hash_len,
            req_id=rid,
            store_id=sid,
        )
        self.in_flight[sid] = _InFlightStore(blocks=blocks, remaining=self.topo.workers, transfer=t)
        meta.stores.append(t)

    def _lazy_stores(self, meta: UMBPConnectorMetadata) -> None:
        """Stores cached blocks that are next in line for eviction from vLLM's free queue."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        assert self.block_pool is not None
        queue = self.block_pool.free_block_queue
        if self.lazy_cursor is not None and self.lazy_cursor.ref_cnt > 0:
            self.lazy_cursor = None  # the cursor block was reused: start over from the head
        picked: dict[int, list[Any]] = {}
        last = self.lazy_cursor
        for n, node in enumerate(queue.iter_blocks_after(self.lazy_cursor)):
            if n >= self.lazy_max:
                break
            last = node
            bh = node.block_hash
            if bh is None or node.is_null or bh in self.lazy_stored:
                continue
            if get_group_id(bh) not in self.topo.load_groups:
                continue
            picked.setdefault(get_group_id(bh), []).append(node)
        self.lazy_cursor = last
        cap = 4 * len(self.block_pool.blocks)
        for g, nodes in picked.items():
            for node in nodes:
                self.lazy_stored[node.block_hash] = None
            while len(self.lazy_stored) > cap:
                self.lazy_stored.popitem(last=False)
            self._add_store(meta, g, nodes, [get_block_hash(n.block_hash) for n in nodes], "")

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        wm = getattr(out, "kv_connector_worker_meta", None)
        if not isinstance(wm, UMBPWorkerMetadata):
            return
        finished: list[_Transfer] = []
        for sid, n in wm.finished_stores.items():
            st = self.in_flight.get(sid)
            if st is None:
                continue
            st.remaining -= n
            if st.remaining <= 0:
                del self.in_flight[sid]
                assert self.block_pool is not None
                self.block_pool.free_blocks(st.blocks)
                finished.append(st.transfer)
        if finished and self.events_enabled:
            self._publish_stored(finished)

    def has_pending_push_work(self) -> bool:
        return bool(self.in_flight)

    # -- KV events ---------------------------------------------------------------------------

    def _publish_stored(self, transfers: list[_Transfer]) -> None:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for t in transfers:
            present = self.client.exists_all(t.group, t.hashes, t.hash_len)
            hashes = [t.hashes[i * t.hash_len : (i + 1) * t.hash_len] for i in range(len(present))]
            new = [h for h, p in zip(hashes, present) if p and h not in self.tracked]
            room = self.cfg.kv_event_max_objects - len(self.tracked)
            new = new[: max(room, 0)]
            if not new:
                continue
            for h in new:
                self.tracked[h] = t.group
            self.events.append(
                BlockStored(
                    block_hashes=[maybe_convert_block_hash(h) for h in new],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.topo.block_size,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                    group_idx=t.group,
                )
            )

    def _recheck_tracked(self) -> None:
        from vllm.distributed.kv_events import BlockRemoved
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        by_group: dict[int, list[bytes]] = {}
        for h, g in self.tracked.items():
            by_group.setdefault(g, []).append(h)
        for g, hashes in by_group.items():
            packed, hash_len = _packed(hashes)
            present = self.client.exists_all(g, packed, hash_len)
            gone = [h for h, p in zip(hashes, present) if not p]
            for h in gone:
                del self.tracked[h]
            if gone:
                self.events.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(h) for h in gone],
                        medium="CPU",
                        group_idx=g,
                    )
                )

    def take_events(self):
        if not self.events_enabled:
            return ()
        if self.tracked and time.monotonic() - self.last_recheck >= 1.0:
            self.last_recheck = time.monotonic()
            self._recheck_tracked()
        events, self.events = self.events, []
        return events

    def reset_cache(self) -> bool:
        if self.in_flight:
            # A store still in flight would land after the clear: not done yet (vLLM's
            # contract lets a connector answer False; the caller tries again).
            logger.info(
                "umbp: %d store(s) in flight; the pools are cleared once they finish",
                len(self.in_flight),
            )
            return False
        try:
            removed = self.client.clear()
        except umbp.UmbpError as e:
            logger.warning("umbp: clearing the workers' pools failed: %s", e)
            return False
        logger.info("umbp: cleared %d objects from the workers' pools", removed)
        return True


# ---------------------------------------------------------------------------------------------
# Worker side
# ---------------------------------------------------------------------------------------------


def _local_ranks() -> tuple[int, int, int]:
    from vllm.distributed import parallel_state as ps

    def rank(getter: str) -> int:
        try:
            return getattr(ps, getter)().rank_in_group
        except Exception:
            return 0

    try:
        tp = ps.get_tensor_model_parallel_rank()
    except Exception:
        tp = 0
    return tp, rank("get_pcp_group"), rank("get_dcp_group")


class _WorkerSide:
    def __init__(self, cfg: ConnectorConfig, topo: _Topology, kv_cache_config: Any) -> None:
        self.cfg = cfg
        self.topo = topo
        self.kv_cache_config = kv_cache_config
        self.tp, self.pcp, self.dcp = _local_ranks()
        self.worker = self.tp + self.topo.tp_size * self.pcp
        self.keys = umbp.KeyBuilder(topo.namespace, tp=self.tp, pcp=self.pcp, dcp=self.dcp)
        self.store: umbp.EmbeddedStore | None = None
        self.server: umbp.LookupServer | None = None
        self.layout = -1
        self.async_loads: dict[str, list[tuple[umbp.Job, list[int]]]] = {}
        self.load_errors: set[int] = set()
        self.failed_recving: set[str] = set()  # async loads that failed (several groups)
        self.unplanned_loads: set[str] = set()  # async loads the scheduler could not plan
        self.stores: dict[int, umbp.Job] = {}
        self.cuda_device: torch.device | None = None

    def _stream(self) -> int | None:
        """The engine's current CUDA stream: copies are ordered after the work queued on it
        (stores copy what the forward pass wrote; loads wait for readers of their blocks)."""
        if self.cuda_device is None:
            return None
        return torch.cuda.current_stream(self.cuda_device).cuda_stream

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        capacity = cfg.worker_capacity(self.topo.workers)
        if cfg.dram_prefault and not cfg.dram_use_hugepages:
            # Every worker of this engine on this host prefaults a pool: check their sum.
            claims = socket_dir(cfg.lookup_dir) / (
                f"umbp-{self.topo.tag}-dp{self.topo.dp_rank}.claims"
            )
            check_engine_memory(claims, capacity, self.topo.workers_per_host)
        self.store = umbp.EmbeddedStore(
            capacity,
            high_watermark=cfg.dram_high_watermark,
            low_watermark=cfg.dram_low_watermark,
            use_hugepages=cfg.dram_use_hugepages,
            hugepage_size=cfg.dram_hugepage_size,
            numa_node=cfg.dram_numa_node,
            prefault=cfg.dram_prefault,
            num_workers=cfg.num_workers,
            timeout_ms=cfg.timeout_ms,
        )
        # Register each backing allocation once (all layers are views into one or a few).
        # CUDA tensors go through the GPU copy path (the CUDA driver is loaded only here, in
        # the worker, after vLLM has initialised CUDA); CPU tensors through host copies.
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
                    self.store.register_cuda_memory(ptr, storage.nbytes(), t.device.index or 0)
                    self.cuda_device = t.device
                else:
                    self.store.register_memory(ptr, storage.nbytes())
        self.layout = self._register_layout(kv_caches)
        path = self.topo.socket_paths(self.cfg.lookup_dir)[self.worker]
        self.server = umbp.LookupServer(
            self.store,
            path,
            self.topo.namespace,
            tp=self.tp,
            pcp=self.pcp,
            dcp=self.dcp,
            describe=f"pid {os.getpid()} tp{self.tp} pcp{self.pcp} dcp{self.dcp}",
        )
        logger.info(
            "umbp: worker %d: %.2f GiB pool, %d layers registered, lookups on %s; %s",
            self.worker,
            capacity / (1 << 30),
            sum(len(g.layer_names) for g in self.kv_cache_config.kv_cache_groups),
            path,
            summary_line(self.store.layout_summary(self.layout)),
        )

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
                        "no per-layer KV views (e.g. Mamba state); models with such layers "
                        "are not supported yet"
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

    def _keys(self, t: _Transfer) -> umbp.Keys:
        return self.keys.keys_packed(t.group, t.hashes, t.hash_len)

    def start_load_kv(self, meta: UMBPConnectorMetadata) -> None:
        assert self.store is not None
        for rid, is_async, ids in meta.failed_loads:
            if is_async:
                self.unplanned_loads.add(rid)  # reported finished (and failed) by get_finished
            else:
                self.load_errors.update(ids)
        sync: list[tuple[umbp.Job, list[int]]] = []
        for t in meta.loads:
            job = self.store.load(
                self.layout, t.group, t.block_ids, self._keys(t), stream=self._stream()
            )
            if t.load_async:
                self.async_loads.setdefault(t.req_id, []).append((job, t.block_ids))
            else:
                sync.append((job, t.block_ids))
        for job, ids in sync:
            try:
                statuses = job.wait(self.cfg.timeout_ms)
            except umbp.TransferTimeout as e:
                # The blocks may still be written: never let the step use them.
                raise RuntimeError(
                    f"UMBP: a synchronous load of {len(ids)} blocks did not finish within "
                    f"timeout_ms={self.cfg.timeout_ms}; failing the step"
                ) from e
            self._note_failures(statuses, ids)

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
        for t in meta.stores:
            self.stores[t.store_id] = self.store.store(
                self.layout, t.group, t.block_ids, self._keys(t), stream=self._stream()
            )

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        for rid, jobs in list(self.async_loads.items()):
            if all(j.done for j, _ in jobs):
                for j, ids in jobs:
                    statuses = j.poll() or []
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
            del self.stores[sid]
        return UMBPWorkerMetadata(finished_stores=finished) if finished else None

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        if self.store is not None:
            self.store.close()


# ---------------------------------------------------------------------------------------------
# The connector
# ---------------------------------------------------------------------------------------------


class UMBPStoreConnector(KVConnectorBase_V1, *_HYBRID_BASES):
    """Offloads prefix KV blocks to UMBP host-DRAM pools and restores them."""

    if CacheHitSource is not None:
        # Restored tokens come from host memory (vLLM's per-tier hit metrics).
        _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # Sleep mode unmaps the KV cache while copies may still run, and the store cannot drop
        # its registrations yet: vLLM (0.33 and later) refuses the combination at start-up.
        return False

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
        ktc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.parse(ktc.kv_connector_extra_config, ktc.kv_role)
        if getattr(vllm_config.model_config, "enable_sleep_mode", False):
            # vLLM before 0.33 does not ask `supports_sleep_mode`: refuse here too.
            raise ConfigError(
                "UMBPStoreConnector does not support sleep mode: it unmaps the KV cache while "
                "UMBP may be copying it; unset `enable_sleep_mode` (--enable-sleep-mode) or run "
                "without the connector"
            )
        if self.cfg.mode == "standalone":
            raise ConfigError(
                'option `mode`: "standalone" needs umbp_standalone_server, which this release '
                'does not include yet; use "embedded"'
            )
        topo = _topology(self.cfg, vllm_config, kv_cache_config)
        self._scheduler: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self.cfg, topo, vllm_config)
        else:
            self._worker = _WorkerSide(self.cfg, topo, kv_cache_config)

    # -- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

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

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None
