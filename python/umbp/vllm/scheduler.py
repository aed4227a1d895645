"""The scheduler side of `UMBPStoreConnector` (vLLM's scheduler process).

- `get_num_new_matched_tokens` asks every worker how many of the request's next blocks it holds
  (through the runtime's lookup client; the smallest answer counts);
- `update_state_after_alloc` queues a load into the blocks vLLM allocated;
- `build_connector_meta` sends the step's loads and the stores of blocks the step completes.
  Store sources are pinned in vLLM's block pool (`touch`) until every worker reports the
  store finished (`update_connector_output`), so `request_finished` never has to delay;
- with KV events enabled, stored objects are published once every worker holds them, and
  removals found by rechecking them;
- a request's store hint (`store_hint`): its `kv_transfer_params` `{"umbp_store": "skip" |
  "now" | "default"}`, else its priority against `store_priority_skip_above` /
  `store_priority_admit_at_most`. "skip" plans none of its stores (its loads still happen);
  "now" sends them to be kept on first sighting under an `on_reuse` store admission.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import umbp
from umbp.errors import ConfigError
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.metadata import Transfer, UMBPConnectorMetadata, UMBPWorkerMetadata, pack_hashes
from umbp.vllm.runtime import Runtime
from umbp.vllm.stats import StatsCollector, UMBPConnectorStats
from umbp.vllm.topology import Topology

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("umbp.vllm")

#: The `kv_transfer_params` key of a request's store hint, and the values it takes.
STORE_HINT_KEY = "umbp_store"
STORE_HINTS = ("default", "now", "skip")
#: Distinct bad hint values warned about (each once), at most.
_BAD_HINTS_WARNED = 64


@dataclass
class _RequestState:
    request: Any
    block_ids: list[list[int]]
    stored_upto: int = 0  # blocks [0, stored_upto) were stored, queued or restored
    load_start: int = 0
    load_blocks: int = 0
    # State groups: (group, boundary in blocks) stored or restored, not to be stored again.
    state_done: set[tuple[int, int]] = field(default_factory=set)
    lookup_counted: bool = False  # its first lookup's answer is in the stats
    hint: str | None = None  # its store hint, once decided (`SchedulerSide.store_hint`)


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
    transfer: Transfer
    # Lazy stores: the blocks were next in line for eviction; once stored they go back there.
    evict_first: bool = False
    # With `self_describing_kv_events`: per block, its token ids and its parent's hash.
    described: list[tuple[list[int], bytes | None]] | None = None
    lora: tuple[int | None, str | None] = (None, None)


@functools.cache
def _takes_evict_first(pool_type: type) -> bool:
    """Whether vLLM's `BlockPool.free_blocks` takes `evict_first` (0.34 and later)."""
    return "evict_first" in inspect.signature(pool_type.free_blocks).parameters


class SchedulerSide:
    """The connector's scheduler role: lookups, load planning, store pinning, KV events."""

    def __init__(
        self, cfg: ConnectorConfig, topo: Topology, runtime: Runtime, vllm_config: VllmConfig
    ) -> None:
        self.cfg = cfg
        self.topo = topo
        self.runtime = runtime
        self.client = runtime.lookup_client()
        self.block_pool: BlockPool | None = None
        self.requests: dict[str, _RequestState] = {}
        self.pending_loads: list[Transfer] = []
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
        # Lazy offload: the hashes already offloaded.
        self.lazy_stored: OrderedDict[bytes, None] = OrderedDict()
        batched = getattr(
            getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None
        )
        per_step = max(1, -(-(batched or 8192) // topo.block_size))
        self.lazy_max = cfg.lazy_offload_max_blocks or 2 * per_step
        if cfg.lazy_offload and self.lazy_max < per_step:
            raise ConfigError(
                f"option `lazy_offload_max_blocks`: {self.lazy_max} is fewer than the "
                f"{per_step} blocks one step can allocate (max_num_batched_tokens={batched} / "
                f"{topo.block_size} tokens a block), so vLLM could evict blocks before lazy "
                f"offload reaches them; set it to at least {per_step}, or leave it unset "
                f"({2 * per_step})"
            )
        # lookup_async: one lookup per request at a time, on `lookup_workers` threads.
        self.async_lookups: dict[str, _AsyncLookup] = {}
        self.lookup_pool: ThreadPoolExecutor | None = None
        self.collector = StatsCollector()
        self.bad_hints: set[str] = set()  # bad `umbp_store` values already warned about

    def shutdown(self) -> None:
        if self.lookup_pool is not None:
            self.lookup_pool.shutdown(wait=False, cancel_futures=True)
        self.runtime.scheduler_shutdown()

    # -- lookups ---------------------------------------------------------------------------

    def _lookup_range(self, request: Request, num_computed_tokens: int) -> tuple[int, int]:
        bs = self.topo.block_size
        # Leave at least one prompt token for vLLM to compute.
        last = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        return num_computed_tokens // bs, last

    def _lookup(self, hashes: list[bytes]) -> int:
        """Leading blocks every worker holds, in every group a load restores: every block in
        attention groups, and in state groups the state at the hit's last block (the longest
        such prefix, as vLLM's own prefix cache finds it)."""
        packed, hash_len = pack_hashes(hashes)
        hits = len(hashes)
        for g in self.topo.attention_groups:
            hits = min(hits, self.client.prefix_hits(g, packed, hash_len))
            if hits <= 0:
                return 0
        if not self.topo.state_groups:
            return hits
        held = [True] * hits
        for g in self.topo.state_groups:
            have = self.client.exists_all(g, packed[: hits * hash_len], hash_len)
            held = [a and b for a, b in zip(held, have)]
        return next((k for k in range(hits, 0, -1) if held[k - 1]), 0)

    def _timed_lookup(self, hashes: list[bytes]) -> tuple[int, float]:
        """`_lookup` and its duration in seconds."""
        t0 = time.perf_counter()
        hits = self._lookup(hashes)
        return hits, time.perf_counter() - t0

    def take_stats(self) -> UMBPConnectorStats | None:
        """The lookups' counts since the last call (None when none)."""
        return self.collector.take()

    def _lookup_async(self, rid: str, first: int, hashes: list[bytes]) -> tuple[int, float] | None:
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
            entry = _AsyncLookup(first, key, self.lookup_pool.submit(self._timed_lookup, hashes))
            self.async_lookups[rid] = entry
        if not entry.future.done():
            return None
        del self.async_lookups[rid]
        try:
            return entry.future.result()
        except Exception as e:  # a failed lookup is a miss
            logger.warning("umbp: lookup of request %s failed: %s", rid, e)
            return 0, None

    def may_load_async(self, request: Request) -> bool:
        """Whether this request's load could be asynchronous (vLLM 0.34 asks as a request
        enters the waiting queue; with `--max-num-inflight-kv-loads` such requests start
        loading while the running batch is full). No lookup here, it must be cheap: True when
        restores are on, loads are asynchronous and the prompt has a full block to look up.
        A request that then misses holds other early loads back until a slot frees, which
        is how every load waited before this hook."""
        if not (self.cfg.restores and self.load_async):
            return False
        first, last = self._lookup_range(request, request.num_computed_tokens)
        return last > first

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
            hits, seconds = found
        else:
            hits, seconds = self._timed_lookup(hashes)
        if self.topo.eagle_drop:
            # As vLLM's own prefix cache: the drafter recomputes the last matched block.
            hits -= 1
        if not state.lookup_counted:  # vLLM asks again while it cannot schedule the request
            state.lookup_counted = True
            s = self.collector.stats
            if seconds is not None:
                s.observe_seconds("lookup_seconds", seconds)
            s.count("lookup_hit_tokens", max(hits, 0) * self.topo.block_size)
            s.count("lookup_miss_tokens", (len(hashes) - max(hits, 0)) * self.topo.block_size)
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
            if g in self.topo.state_groups and keep != [n - 1]:
                # vLLM gives a state group one block, for the state at the hit's end.
                logger.warning(
                    "umbp: request %s: state group %d got blocks at %s of %d restored blocks "
                    "(expected only the last); its load is reported failed and vLLM "
                    "recomputes it",
                    rid,
                    g,
                    keep,
                    n,
                )
                allocated = [b for ids in ids_by_group for b in ids[first : first + n] if b]
                self.failed_loads.append((rid, self.load_async, allocated))
                loads = []
                break
            if not keep:
                continue
            hashes, hash_len = pack_hashes([block_hashes[i] for i in keep])
            loads.append(
                Transfer(
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
        state.state_done.update((g, first + n) for g in self.topo.state_groups)

    # -- stores ----------------------------------------------------------------------------

    def store_hint(self, request: Request) -> str:
        """What to do with `request`'s stores: "skip" (none), "now" (kept on first sighting
        under an `on_reuse` admission) or "default" (as the pool's admission says). Its
        `kv_transfer_params`' `umbp_store` wins ("default" too, over its priority); else its
        priority against the `store_priority_*` options. A bad `umbp_store` value is warned
        about once and ignored."""
        params = getattr(request, "kv_transfer_params", None)
        asked = params.get(STORE_HINT_KEY) if isinstance(params, dict) else None
        if asked is not None:
            if isinstance(asked, str) and asked in STORE_HINTS:
                return asked
            self._warn_bad_hint(request.request_id, asked)
        priority = getattr(request, "priority", 0)
        if not isinstance(priority, int):
            return "default"
        skip_above = self.cfg.store_priority_skip_above
        if skip_above is not None and priority > skip_above:
            return "skip"
        admit_at_most = self.cfg.store_priority_admit_at_most
        if admit_at_most is not None and priority <= admit_at_most:
            return "now"
        return "default"

    def _warn_bad_hint(self, rid: str, value: Any) -> None:
        key = repr(value)[:80]
        if key in self.bad_hints or len(self.bad_hints) >= _BAD_HINTS_WARNED:
            return
        self.bad_hints.add(key)
        logger.warning(
            "umbp: request %s: kv_transfer_params %r: %s is not one of %s; ignored (this "
            "value is not warned about again)",
            rid,
            STORE_HINT_KEY,
            key,
            ", ".join(repr(h) for h in STORE_HINTS),
        )

    def _hint(self, state: _RequestState) -> str:
        if state.hint is None:
            state.hint = self.store_hint(state.request)
        return state.hint

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
            hint = self._hint(state)
            hashes = list(req.block_hashes[first:full])
            for g in self.topo.attention_groups:  # what a hash-addressed store can serve
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
                if hint == "skip":  # not stored, as if already done
                    self.collector.stats.count("store_hint_skipped_blocks", len(keep))
                    continue
                st = self._add_store(
                    meta,
                    g,
                    [self.block_pool.blocks[block_ids[i]] for i in keep],
                    [hashes[i] for i in keep],
                    rid,
                    admit_now=hint == "now",
                )
                if self.cfg.self_describing_kv_events and self.events_enabled:
                    self._describe(st, req, [first + i for i in keep])
        if self.topo.state_groups:
            self._state_stores(meta, so)
        return meta

    def _state_stores(self, meta: UMBPConnectorMetadata, so: SchedulerOutput) -> None:
        """Stores the recurrent state vLLM hands over this step: (group, block, tokens) for
        each block that now holds the state after exactly `tokens` tokens (vLLM's
        `boundary_state_offloads`, valid only while this step's metadata is built). A state
        group's other blocks are nulled, reused or speculative: never stored by position."""
        block_state = getattr(so, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        assert self.block_pool is not None
        bs = self.topo.block_size
        for rid, items in offloads.items():
            state = self.requests.get(rid)
            if state is None:
                continue
            req = state.request
            by_group: dict[int, list[tuple[Any, bytes]]] = {}
            for g, block_id, tokens in items:
                if g not in self.topo.state_groups or block_id == 0 or tokens % bs:
                    continue
                k = tokens // bs
                if k <= 0 or k > len(req.block_hashes) or (g, k) in state.state_done:
                    continue
                if not self.cfg.save_decode_cache and tokens > req.num_prompt_tokens:
                    continue
                by_group.setdefault(g, []).append(
                    (self.block_pool.blocks[block_id], req.block_hashes[k - 1])
                )
                state.state_done.add((g, k))
            hint = self._hint(state)
            for g, pairs in by_group.items():
                if hint == "skip":
                    self.collector.stats.count("store_hint_skipped_blocks", len(pairs))
                    continue
                blocks, hashes = [b for b, _ in pairs], [h for _, h in pairs]
                self._add_store(meta, g, blocks, hashes, rid, admit_now=hint == "now")

    def _add_store(
        self,
        meta: UMBPConnectorMetadata,
        group: int,
        blocks: list[Any],
        hashes: list[bytes],
        rid: str,
        evict_first: bool = False,
        admit_now: bool = False,
    ) -> _InFlightStore:
        """Pins `blocks` until every worker has stored them, and queues their store
        (`admit_now`: kept on first sighting under an `on_reuse` admission)."""
        assert self.block_pool is not None
        self.block_pool.touch(blocks)
        packed, hash_len = pack_hashes(hashes)
        sid = next(self.store_ids)
        t = Transfer(
            group=group,
            block_ids=[b.block_id for b in blocks],
            hashes=packed,
            hash_len=hash_len,
            req_id=rid,
            store_id=sid,
            admit_now=admit_now,
        )
        if admit_now:
            self.collector.stats.count("store_hint_now_blocks", len(blocks))
        st = _InFlightStore(
            blocks=blocks, remaining=self.topo.workers, transfer=t, evict_first=evict_first
        )
        self.in_flight[sid] = st
        meta.stores.append(t)
        return st

    def _describe(self, st: _InFlightStore, req: Request, indices: list[int]) -> None:
        """Keeps what self-describing events say of each block: its tokens, its parent."""
        bs, tokens, hashes = self.topo.block_size, req.all_token_ids, req.block_hashes
        st.described = [
            (list(tokens[k * bs : (k + 1) * bs]), hashes[k - 1] if k > 0 else None) for k in indices
        ]
        lora = getattr(req, "lora_request", None)
        if lora is not None:
            st.lora = (getattr(lora, "adapter_id", None), getattr(lora, "name", None))

    def _lazy_stores(self, meta: UMBPConnectorMetadata) -> None:
        """Stores the cached blocks next in line for eviction: the first `lazy_max` blocks of
        vLLM's free queue, from its head, that are not stored yet. Each step scans from the head
        again (a cursor kept across steps skips blocks once the block it rests on moves, e.g.
        when its own store ends), so every block is stored before eviction reaches it as long
        as a step allocates fewer than `lazy_max` blocks (the default is twice a step's worth).
        Stored blocks go back to the head (`_release`), where they were."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        assert self.block_pool is not None
        picked: dict[int, list[Any]] = {}
        for n, node in enumerate(self.block_pool.free_block_queue.iter_blocks_after(None)):
            if n >= self.lazy_max:
                break
            bh = node.block_hash
            if bh is None or node.is_null or bh in self.lazy_stored:
                continue
            if get_group_id(bh) not in self.topo.load_groups:
                continue
            picked.setdefault(get_group_id(bh), []).append(node)
        cap = 4 * len(self.block_pool.blocks)
        for g, nodes in picked.items():
            for node in nodes:
                self.lazy_stored[node.block_hash] = None
            while len(self.lazy_stored) > cap:
                self.lazy_stored.popitem(last=False)
            hashes = [get_block_hash(n.block_hash) for n in nodes]
            self._add_store(meta, g, nodes, hashes, "", evict_first=True)

    def _release(self, st: _InFlightStore) -> None:
        """Unpins a finished store's blocks; lazily stored ones go back to the eviction head
        (vLLM's `free_blocks(..., evict_first=True)` where it has it), not to the tail, which
        would keep them over younger blocks vLLM has no copy of."""
        pool = self.block_pool
        assert pool is not None
        if not st.evict_first:
            pool.free_blocks(st.blocks)
            return
        if _takes_evict_first(type(pool)):
            pool.free_blocks(st.blocks, evict_first=True)
            return
        pool.free_blocks(st.blocks)  # older vLLM: onto the tail, then moved to the head
        queue = pool.free_block_queue
        if not hasattr(queue, "prepend_n"):
            return
        back = [
            b
            for b in st.blocks
            if b.ref_cnt == 0
            and not b.is_null
            and b.block_hash is not None
            and getattr(b, "pool", None) in (None, pool)
        ]
        for b in back:
            queue.remove(b)
        queue.prepend_n(back)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        wm = getattr(out, "kv_connector_worker_meta", None)
        if not isinstance(wm, UMBPWorkerMetadata):
            return
        finished: list[_InFlightStore] = []
        for sid, n in wm.finished_stores.items():
            st = self.in_flight.get(sid)
            if st is None:
                continue
            st.remaining -= n
            if st.remaining <= 0:
                del self.in_flight[sid]
                self._release(st)
                finished.append(st)
        if finished and self.events_enabled:
            self._publish_stored(finished)

    def has_pending_push_work(self) -> bool:
        return bool(self.in_flight)

    # -- KV events ---------------------------------------------------------------------------

    def _publish_stored(self, stores: list[_InFlightStore]) -> None:
        """A `BlockStored` per run of newly held blocks: hashes only, or with each block's
        tokens and parent (`self_describing_kv_events`; a run is blocks that follow each
        other in their request, its parent that of its first block)."""
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        for st in stores:
            t = st.transfer
            # Which landed; `holds_all` takes no lease (the pool may evict them as it likes)
            # and reads no lower tier (the events are the CPU medium's).
            present = self.client.holds_all(t.group, t.hashes, t.hash_len)
            if present is None:
                continue
            hashes = [t.hashes[i * t.hash_len : (i + 1) * t.hash_len] for i in range(len(present))]
            room = self.cfg.kv_event_max_objects - len(self.tracked)
            new = [
                i for i, (h, p) in enumerate(zip(hashes, present)) if p and h not in self.tracked
            ]
            new = new[: max(room, 0)]
            if not new:
                continue
            for i in new:
                self.tracked[hashes[i]] = t.group
            described = st.described
            runs: list[list[int]] = [[new[0]]]
            for i in new[1:]:
                prev = runs[-1][-1]
                if described is None or described[i][1] == hashes[prev]:
                    runs[-1].append(i)
                else:
                    runs.append([i])
            for run in runs:
                tokens: list[int] = []
                parent = None
                if described is not None:
                    parent = described[run[0]][1]
                    for i in run:
                        tokens.extend(described[i][0])
                self.events.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(hashes[i]) for i in run],
                        parent_block_hash=None
                        if parent is None
                        else maybe_convert_block_hash(parent),
                        token_ids=tokens,
                        block_size=self.topo.block_size,
                        lora_id=st.lora[0],
                        medium="CPU",
                        lora_name=st.lora[1],
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
            packed, hash_len = pack_hashes(hashes)
            # Never `exists_all`: its leases, renewed here every second, would keep every
            # tracked block from eviction; and a failed answer says nothing was removed.
            present = self.client.holds_all(g, packed, hash_len)
            if present is None:
                continue
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
            logger.warning("umbp: clearing the UMBP pool(s) failed: %s", e)
            return False
        logger.info("umbp: cleared %d objects from the UMBP pool(s)", removed)
        return True
