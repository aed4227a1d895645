"""UMBPStoreConnector on deployment shapes a CPU engine cannot run, with vLLM's real objects.

Built here from vLLM itself: `VllmConfig` (with the tiny local model), `ParallelConfig`,
`KVCacheConfig` and its spec classes, `Request` with vLLM's block hasher, `KVCacheBlocks`,
`BlockPool`, `SchedulerOutput`. Both connector roles run in this process: the worker side
registers CPU tensors and serves its lookup socket, the scheduler side asks it, exactly as the
two processes of an engine do.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
)
from vllm.sampling_params import SamplingParams
from vllm.v1 import kv_cache_interface as kvi
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

import umbp
from umbp.errors import ConfigError
from umbp.vllm import plugin
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.connector import UMBPStoreConnector
from umbp.vllm.namespace import derive_namespace, spec_fields
from umbp.vllm.runtime import socket_paths
from umbp.vllm.topology import engine_topology

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hook_signatures import check_overridden_hooks  # noqa: E402

BS = 16  # tokens per block in these tests
BF16 = torch.bfloat16


@pytest.fixture(scope="module", autouse=True)
def parallel_groups():
    """vLLM's parallel groups of a one-worker engine, as a real worker process has them: the
    worker side reads its ranks from them (it refuses to guess rank 0)."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        ps.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=0,
            backend="gloo",
        )
        ps.ensure_model_parallel_initialized(1, 1)
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


@pytest.fixture(scope="module")
def model_config(model) -> ModelConfig:
    plugin.register()
    return ModelConfig(model=model, dtype="bfloat16")


def vllm_config(model_config, tmp_path: Path, parallel=None, **extra) -> VllmConfig:
    """The connector's config with `extra` options; in embedded mode (unless `extra` says
    `mode`) a small unprefaulted pool with its lookup sockets in `tmp_path`."""
    embedded = {"total_capacity_bytes": 16 << 20, "lookup_dir": str(tmp_path)}
    embedded["dram_prefault"] = False
    ktc = KVTransferConfig(
        kv_connector="UMBPStoreConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            **(embedded if extra.get("mode", "embedded") == "embedded" else {}),
            **extra,
        },
    )
    return VllmConfig(
        model_config=model_config,
        parallel_config=parallel or ParallelConfig(),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_model_len=4096, is_encoder_decoder=False, max_num_batched_tokens=4096
        ),
        kv_transfer_config=ktc,
    )


def full(block_size: int = BS, heads: int = 2, head: int = 32) -> kvi.FullAttentionSpec:
    return kvi.FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=BF16
    )


def sliding(block_size: int = BS) -> kvi.SlidingWindowSpec:
    return kvi.SlidingWindowSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=BF16, sliding_window=2 * BS
    )


def kv_config(*groups: tuple[list[str], object], num_blocks: int = 16) -> kvi.KVCacheConfig:
    return kvi.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[kvi.KVCacheGroupSpec(list(names), spec) for names, spec in groups],
    )


# ---------------------------------------------------------------------------------------------
# Item 1: data parallelism
# ---------------------------------------------------------------------------------------------


def test_dense_dp_engines_get_distinct_sockets_from_the_dp_index(model_config, tmp_path):
    kc = kv_config((["l0"], full()))
    paths = []
    for rank in (0, 1):
        vc = vllm_config(
            model_config, tmp_path, ParallelConfig(data_parallel_size=2, data_parallel_rank=rank)
        )
        # What vLLM's engine core does for a dense model's DP engine (they are independent):
        vc.parallel_config.reconfigure_for_independent_dp_rank()
        assert vc.parallel_config.data_parallel_rank == 0
        topo = engine_topology(ConnectorConfig.parse({"lookup_dir": str(tmp_path)}), vc, kc)
        assert topo.dp_rank == rank
        paths.append(socket_paths(topo, str(tmp_path)))
    assert paths[0] != paths[1], "two DP engines on one host must not share lookup sockets"


# ---------------------------------------------------------------------------------------------
# Item 2: decode context parallelism
# ---------------------------------------------------------------------------------------------


def test_dcp_block_hashes_cover_block_size_times_dcp_tokens(model_config, tmp_path):
    pc = ParallelConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    vc = vllm_config(model_config, tmp_path, pc)
    kc = kv_config((["l0"], full()))
    cfg = ConnectorConfig.parse({"lookup_dir": str(tmp_path)})
    topo = engine_topology(cfg, vc, kc)
    assert topo.block_size == BS * 2, "one block hash covers block_size x dcp tokens"
    kc.hash_block_size = BS * 2  # as vLLM's engine core resolves it
    assert engine_topology(cfg, vc, kc).block_size == BS * 2
    kc.hash_block_size = BS  # a finer prefix-match unit than the block: refused by name
    with pytest.raises(ConfigError, match="prefix_match_unit"):
        engine_topology(cfg, vc, kc)


# ---------------------------------------------------------------------------------------------
# Item 4: both sides derive one namespace for every spec type
# ---------------------------------------------------------------------------------------------


def every_spec() -> dict[str, object]:
    attn = dict(block_size=BS, num_kv_heads=2, head_size=32, dtype=BF16)
    specs = {
        "FullAttentionSpec": kvi.FullAttentionSpec(**attn),
        "SlidingWindowSpec": kvi.SlidingWindowSpec(**attn, sliding_window=64),
        "ChunkedLocalAttentionSpec": kvi.ChunkedLocalAttentionSpec(**attn, attention_chunk_size=64),
        "CrossAttentionSpec": kvi.CrossAttentionSpec(**attn),
        "EncoderOnlyAttentionSpec": kvi.EncoderOnlyAttentionSpec(**attn),
        "SinkFullAttentionSpec": kvi.SinkFullAttentionSpec(**attn, sink_len=4),
        "MLAAttentionSpec": kvi.MLAAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=64, dtype=BF16
        ),
        "SlidingWindowMLASpec": kvi.SlidingWindowMLASpec(
            block_size=BS, num_kv_heads=1, head_size=64, dtype=BF16, sliding_window=64
        ),
        "MambaSpec": kvi.MambaSpec(block_size=BS, shapes=((4, 8), (2, 8)), dtypes=(BF16, BF16)),
        "UniformTypeKVCacheSpecs": kvi.UniformTypeKVCacheSpecs(
            block_size=BS,
            kv_cache_specs={"a": kvi.FullAttentionSpec(**attn), "b": full(head=64)},
        ),
    }
    return specs


def test_scheduler_and_workers_derive_one_namespace_for_every_spec_type(model_config, tmp_path):
    vc = vllm_config(model_config, tmp_path)
    specs = every_spec()
    concrete = {
        c.__name__
        for c in _subclasses(kvi.KVCacheSpec)
        if not inspect.isabstract(c) and c.__module__ == kvi.__name__
    }
    # Every spec type vLLM defines is built here, except bases and ones whose groups are
    # never transferred (HiSparse and hidden-state caches are engine-internal buffers).
    internal = {
        "AttentionSpec",
        "KVCacheSpec",
        "HiSparseHotSpec",
        "HiSparseResidentSpec",
        "HiddenStateCacheSpec",
        "CircularBufferSpec",
        "RSWASpec",
    }
    assert concrete - internal <= set(specs), concrete - internal - set(specs)
    for name, spec in specs.items():
        layers = ["a", "b"] if name == "UniformTypeKVCacheSpecs" else ["a"]
        worker = kv_config((layers, spec))
        scheduler = generate_scheduler_kv_cache_config([worker])
        assert derive_namespace(vc, worker) == derive_namespace(vc, scheduler), name
    # And a whole engine's groups, mixed specs in one of them.
    worker = kv_config((["a", "b"], specs["UniformTypeKVCacheSpecs"]), (["c"], sliding()))
    scheduler = generate_scheduler_kv_cache_config([worker])
    cfg = ConnectorConfig.parse({"lookup_dir": str(tmp_path)})
    w, s = engine_topology(cfg, vc, worker), engine_topology(cfg, vc, scheduler)
    assert (w.namespace, w.tag, w.load_groups) == (s.namespace, s.tag, s.load_groups)
    assert socket_paths(w, str(tmp_path)) == socket_paths(s, str(tmp_path))


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


# ---------------------------------------------------------------------------------------------
# A scheduler and a worker of one engine, in this process
# ---------------------------------------------------------------------------------------------


class Engine:
    """Both roles of the connector over real vLLM objects; the worker's KV cache is CPU unless
    `caches` gives it (tests/gpu_vllm: views of CUDA memory)."""

    def __init__(
        self,
        vc: VllmConfig,
        kc: kvi.KVCacheConfig,
        caches: dict[str, torch.Tensor] | None = None,
    ) -> None:
        init_none_hash(_sha256)
        self.vc, self.kc = vc, kc
        self.worker = UMBPStoreConnector(vc, KVConnectorRole.WORKER, kc)
        self.caches = caches or {
            name: torch.zeros((kc.num_blocks, 2, BS, 2, 32), dtype=BF16)
            for g in kc.kv_cache_groups
            for name in g.layer_names
        }
        self.worker.register_kv_caches(self.caches)
        self.sched_kc = generate_scheduler_kv_cache_config([kc])
        self.sched = UMBPStoreConnector(vc, KVConnectorRole.SCHEDULER, self.sched_kc)
        self.hasher = get_request_block_hasher(BS, _sha256)
        self.pool = BlockPool(kc.num_blocks, enable_caching=True, hash_block_size=BS)
        self.sched.bind_gpu_block_pool(self.pool)

    def request(self, rid: str, blocks: int, seed: int = 0) -> Request:
        tokens = [(seed * 7919 + i) % 251 + 1 for i in range(blocks * BS + 1)]
        return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)

    def put(self, group: int, req: Request, block_ids: list[int]) -> None:
        """Stores the request's first blocks of `group` straight into the worker's pool."""
        w = self.worker._worker
        keys = w.keys.keys(group, list(req.block_hashes[: len(block_ids)]))
        assert w.store.store(w.layout, group, block_ids, keys).wait(5000) == ["done"] * len(
            block_ids
        )

    def step(self, finished: set[str] = frozenset()) -> KVConnectorOutput:
        """One scheduler step: metadata to the worker, the worker's transfers, its output."""
        so = SchedulerOutput.make_empty()
        so.finished_req_ids = set(finished)
        meta = self.sched.build_connector_meta(so)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        res = self.worker.get_transfer_results(set())
        out = KVConnectorOutput(
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        self.sched.update_connector_output(out)
        return out

    def close(self) -> None:
        self.worker.shutdown()


def _sha256(obj) -> bytes:
    from vllm.utils.hashing import sha256

    return sha256(obj)


def matched(engine: Engine, req: Request, computed: int = 0, tries: int = 500):
    """get_num_new_matched_tokens, asked again while the answer is pending (lookup_async)."""
    for _ in range(tries):
        n, is_async = engine.sched.get_num_new_matched_tokens(req, computed)
        if n is not None:
            return n, is_async
        time.sleep(0.01)
    raise AssertionError("the lookup never finished")


def blocks_of(engine: Engine, *ids_by_group: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(tuple([engine.pool.blocks[b] for b in ids] for ids in ids_by_group))


# ---------------------------------------------------------------------------------------------
# Item 5: several KV cache groups
# ---------------------------------------------------------------------------------------------


def test_hybrid_support_is_declared():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    assert supports_hma(UMBPStoreConnector)


def test_two_groups_hit_only_when_every_group_holds_the_blocks(model_config, tmp_path):
    vc = vllm_config(model_config, tmp_path, load_async=False)
    e = Engine(vc, kv_config((["full.0", "full.1"], full()), (["swa.0"], sliding())))
    try:
        req = e.request("r1", blocks=3)
        e.put(0, req, [1, 2, 3])
        assert matched(e, req) == (0, False), "group 1 holds nothing: no hit"
        e.put(1, req, [4, 5, 6])
        # Several groups always load asynchronously (failures are reported per request).
        assert matched(e, req) == (3 * BS, True)
        # The sliding-window group's first block is outside the window: vLLM gives it the
        # null block, which must never be written.
        e.sched.update_state_after_alloc(req, blocks_of(e, [7, 8, 9], [0, 10, 11]), 3 * BS)
        for layer in e.caches.values():
            layer[0].fill_(3)
        out = e.step()
        while "r1" not in out.finished_recving:
            out = e.step()
        assert out.failed_recving == set() and not out.invalid_block_ids
        assert all(bool((layer[0] == 3).all()) for layer in e.caches.values())
        for a, b in ((1, 7), (2, 8), (3, 9)):
            assert torch.equal(e.caches["full.0"][a], e.caches["full.0"][b])
        assert torch.equal(e.caches["swa.0"][5], e.caches["swa.0"][10])
    finally:
        e.close()


def test_two_groups_report_a_failed_load_per_request_not_per_block(model_config, tmp_path):
    vc = vllm_config(model_config, tmp_path)
    e = Engine(vc, kv_config((["full.0"], full()), (["swa.0"], sliding())))
    try:
        req = e.request("r2", blocks=2, seed=1)
        e.put(0, req, [1, 2])
        e.put(1, req, [3, 4])
        n, _ = matched(e, req)
        assert n == 2 * BS
        e.worker._worker.store.clear()  # evicted between the lookup and the load
        e.sched.update_state_after_alloc(req, blocks_of(e, [5, 6], [7, 8]), n)
        out = e.step()
        while "r2" not in out.finished_recving:
            out = e.step()
        # Block ids are per group; vLLM's scheduler raises on them with several groups.
        assert out.failed_recving == {"r2"} and not out.invalid_block_ids
    finally:
        e.close()


def test_only_prefix_cacheable_groups_are_stored(model_config, tmp_path):
    vc = vllm_config(model_config, tmp_path)
    kc = kv_config((["full.0"], full()), (["swa.0"], sliding()))
    kc.kv_cache_groups[1].enable_kv_transfer = False  # vLLM's switch for a group
    e = Engine(vc, kc)
    try:
        assert kc.prefix_cacheable_group_ids == (0,)
        req = e.request("r3", blocks=2, seed=2)
        assert matched(e, req)[0] == 0
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [_new_req(req, ([1, 2, 3], [4, 5, 6]))]
        so.num_scheduled_tokens = {req.request_id: req.num_tokens}
        meta = e.sched.build_connector_meta(so)
        assert [t.group for t in meta.stores] == [0]
    finally:
        e.close()


def test_sliding_window_blocks_after_a_local_hit_are_stored(model_config, tmp_path):
    """vLLM's own prefix hit gives a sliding-window group null blocks outside the window; the
    group's real blocks of the same request must still be stored (they were all skipped)."""
    vc = vllm_config(model_config, tmp_path)
    e = Engine(vc, kv_config((["full.0"], full()), (["swa.0"], sliding())))
    try:
        req = e.request("r4", blocks=4, seed=3)
        assert matched(e, req, computed=3 * BS)[0] == 0
        so = SchedulerOutput.make_empty()
        # A local hit of 3 blocks; the window (2 blocks) leaves the first one null.
        new = _new_req(req, ([1, 2, 3, 4, 5], [0, 6, 7, 8, 9]))
        new.num_computed_tokens = 3 * BS
        so.scheduled_new_reqs = [new]
        so.num_scheduled_tokens = {req.request_id: req.num_tokens - 3 * BS}
        meta = e.sched.build_connector_meta(so)
        assert sorted((t.group, tuple(t.block_ids)) for t in meta.stores) == [
            (0, (1, 2, 3, 4)),
            (1, (6, 7, 8)),
        ]
        e.worker.bind_connector_metadata(meta)
        e.worker.wait_for_save()
        w = e.worker._worker
        for job in w.stores.values():
            statuses = job.wait(5000)
            assert statuses and set(statuses) == {"done"}, statuses
        hashes = list(req.block_hashes)
        assert w.store.exists(w.keys.keys(1, hashes)) == [False, True, True, True]
        # A later request with one local block finds the other three in both groups.
        assert matched(e, e.request("r5", blocks=4, seed=3), computed=BS) == (3 * BS, True)
    finally:
        e.close()


def _new_req(req: Request, block_ids):
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData.from_request(req, block_ids, None)


# ---------------------------------------------------------------------------------------------
# Item 7: lookup_async rechecks and forgets
# ---------------------------------------------------------------------------------------------


def test_async_lookup_is_rechecked_and_dropped_when_the_request_finishes(model_config, tmp_path):
    vc = vllm_config(model_config, tmp_path, lookup_async=True)
    e = Engine(vc, kv_config((["l0"], full())))
    side = e.sched._scheduler
    # Lookups wait for `gate` on the lookup thread, so a lookup is surely pending when the
    # test needs one (an ungated lookup may answer before the call that started it returns,
    # which is the right thing for the connector to do, but leaves nothing pending to test).
    gate = threading.Event()
    looked_up = side._lookup

    def gated_lookup(hashes):
        assert gate.wait(10), "the test never opened the gate"
        return looked_up(hashes)

    side._lookup = gated_lookup
    try:
        req = e.request("a", blocks=3)
        e.put(0, req, [1, 2, 3])
        n, _ = e.sched.get_num_new_matched_tokens(req, 0)
        assert n is None  # looking up
        assert side.async_lookups["a"].first == 0
        # Meanwhile vLLM's own cache came to hold the first block: the lookup of blocks 0..2
        # is stale and started again for blocks 1..2, the only ones left to restore.
        assert e.sched.get_num_new_matched_tokens(req, BS)[0] is None
        assert side.async_lookups["a"].first == 1
        gate.set()
        assert matched(e, req, computed=BS)[0] == 2 * BS
        assert "a" not in side.async_lookups
        # A finished request's pending lookup is dropped: a new request with the same id (and
        # other tokens) is looked up afresh.
        gate.clear()
        assert e.sched.get_num_new_matched_tokens(req, 0)[0] is None
        assert "a" in side.async_lookups
        e.step(finished={"a"})
        assert "a" not in side.async_lookups
        gate.set()
        other = e.request("a", blocks=3, seed=5)
        assert matched(e, other)[0] == 0
    finally:
        gate.set()
        e.close()


# ---------------------------------------------------------------------------------------------
# Item 8: reset_cache waits for stores in flight
# ---------------------------------------------------------------------------------------------


def test_reset_cache_is_not_done_while_a_store_is_in_flight(model_config, tmp_path):
    vc = vllm_config(model_config, tmp_path)
    e = Engine(vc, kv_config((["l0"], full())))
    try:
        req = e.request("s", blocks=2, seed=3)
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [_new_req(req, ([1, 2, 3],))]
        so.num_scheduled_tokens = {req.request_id: req.num_tokens}
        e.sched.get_num_new_matched_tokens(req, 0)
        meta = e.sched.build_connector_meta(so)
        assert len(meta.stores) == 1
        # The store is queued but no worker has run it: a clear now would be undone by it.
        assert e.sched.reset_cache() is False
        e.worker.bind_connector_metadata(meta)
        e.worker.wait_for_save()
        e.worker.clear_connector_metadata()
        for _ in range(500):
            wm = e.worker.build_connector_worker_meta()
            if wm is not None:
                e.sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=wm))
                break
            time.sleep(0.01)
        assert e.sched.reset_cache() is True
        assert matched(e, e.request("s2", blocks=2, seed=3))[0] == 0, "the clear came last"
    finally:
        e.close()


# ---------------------------------------------------------------------------------------------
# Items 6, 10, 11: sleep mode, EAGLE, hit labels
# ---------------------------------------------------------------------------------------------


def test_sleep_mode_is_refused_by_name(model_config, tmp_path):
    ktc = vllm_config(model_config, tmp_path).kv_transfer_config
    assert UMBPStoreConnector.supports_sleep_mode(ktc) is False  # asked by vLLM 0.33+
    vc = vllm_config(model_config, tmp_path)
    vc.model_config.enable_sleep_mode = True  # vLLM 0.32 never asks: the connector refuses
    try:
        with pytest.raises(ConfigError, match="enable_sleep_mode"):
            UMBPStoreConnector(vc, KVConnectorRole.SCHEDULER, kv_config((["l0"], full())))
    finally:
        vc.model_config.enable_sleep_mode = False


def mamba(mode: str = "align", **kw) -> kvi.MambaSpec:
    return kvi.MambaSpec(
        block_size=BS, shapes=((4, 8), (2, 8)), dtypes=(BF16, BF16), mamba_cache_mode=mode, **kw
    )


def test_mamba_state_groups_outside_align_mode_are_refused_by_name(model_config, tmp_path):
    """Issue 31: vLLM prefix-caches recurrent state only in its `align` mode; other modes, and
    speculative state blocks, are refused at start-up by group, with the flag to change."""
    vc = vllm_config(model_config, tmp_path)
    cfg = ConnectorConfig.parse({"lookup_dir": str(tmp_path)})
    none = mamba("none")
    for kc in (
        kv_config((["attn.0"], full()), (["mamba.1"], none)),
        kv_config((["mamba.1", "mamba.2"], kvi.UniformTypeKVCacheSpecs(BS, {"mamba.1": none}))),
    ):
        with pytest.raises(ConfigError, match=r"group \d \(MambaSpec\).*--mamba-cache-mode align"):
            engine_topology(cfg, vc, kc)
    kc = kv_config((["attn.0"], full()), (["mamba.1"], mamba(num_speculative_blocks=1)))
    with pytest.raises(ConfigError, match=r"group 1 \(MambaSpec, layers mamba\.1\).*speculative"):
        engine_topology(cfg, vc, kc)
    topo = engine_topology(cfg, vc, kv_config((["attn.0"], full()), (["mamba.1"], mamba())))
    assert (topo.attention_groups, topo.state_groups, topo.force_async_loads) == ((0,), (1,), True)


def _state_put(e: Engine, group: int, req: Request, index: int, block_id: int) -> None:
    """Stores block `block_id` as the state after block `index` of `req` in a state group."""
    w = e.worker._worker
    keys = w.keys.keys(group, [req.block_hashes[index]])
    assert w.store.store(w.layout, group, [block_id], keys).wait(5000) == ["done"]


def test_a_state_group_hits_up_to_the_last_boundary_every_group_holds(model_config, tmp_path):
    """Issue 31: attention groups need every block of a hit, a state group only the state at
    its end. Missing state at the longest prefix shrinks the hit to the last boundary every
    group holds, never a hit with missing state; a load writes only the state block."""
    vc = vllm_config(model_config, tmp_path)
    e = Engine(vc, kv_config((["attn.0"], full()), (["mamba.1"], mamba())))
    try:
        req = e.request("m1", blocks=4, seed=5)
        e.put(0, req, [1, 2, 3, 4])
        assert matched(e, req)[0] == 0, "no state anywhere: no hit"
        _state_put(e, 1, req, 1, 5)  # the state after 2 blocks
        assert matched(e, req) == (2 * BS, True), "only the state after 2 blocks"
        e.caches["mamba.1"][6].fill_(7)
        _state_put(e, 1, req, 3, 6)  # the state after 4 blocks
        assert matched(e, req) == (4 * BS, True)
        # vLLM gives the state group nulls and one block, the last.
        e.sched.update_state_after_alloc(req, blocks_of(e, [7, 8, 9, 10], [0, 0, 0, 11]), 4 * BS)
        before = {n: t.clone() for n, t in e.caches.items()}
        out = e.step()
        while "m1" not in out.finished_recving:
            out = e.step()
        assert out.failed_recving == set()
        assert torch.equal(e.caches["mamba.1"][11], e.caches["mamba.1"][6])
        changed = [
            b for b in range(16) if not torch.equal(e.caches["mamba.1"][b], before["mamba.1"][b])
        ]
        assert changed == [11], changed
        # A state allocation other than "only the last block" is a failed load, not a guess.
        req2 = e.request("m2", blocks=4, seed=5)
        assert matched(e, req2)[0] == 4 * BS
        e.sched.update_state_after_alloc(req2, blocks_of(e, [7, 8, 9, 10], [0, 12, 0, 13]), 4 * BS)
        assert [f[0] for f in e.sched._scheduler.failed_loads] == ["m2"]
    finally:
        e.close()


def test_state_is_stored_only_from_vllms_boundary_hand_offs(model_config, tmp_path):
    """Issue 31: a state group's table is not append-only (vLLM nulls, frees and reuses its
    blocks), so state is stored only from `boundary_state_offloads`, exact (group, block,
    tokens) triples; attention groups are stored by position as before."""
    from vllm.v1.core.sched.output import KVConnectorBlockState

    vc = vllm_config(model_config, tmp_path)
    e = Engine(vc, kv_config((["attn.0"], full()), (["mamba.1"], mamba())))
    try:
        req = e.request("m3", blocks=3, seed=9)
        assert matched(e, req)[0] == 0
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [_new_req(req, ([1, 2, 3], [0, 0, 4]))]
        so.num_scheduled_tokens = {req.request_id: req.num_tokens}
        so.kv_connector_block_state = KVConnectorBlockState(
            req_ids={"m3"},
            resolve_block_ids=lambda rid: ([1, 2, 3], [0, 0, 4]),
            # The state after 3 blocks in block 4; a partial tail (not a block boundary) and
            # another group's entry are not stored.
            boundary_state_offloads={"m3": [(1, 4, 3 * BS), (1, 4, 3 * BS - 5), (0, 1, BS)]},
        )
        meta = e.sched.build_connector_meta(so)
        stores = sorted((t.group, list(t.block_ids)) for t in meta.stores)
        assert stores == [(0, [1, 2, 3]), (1, [4])], stores
        state = next(t for t in meta.stores if t.group == 1)
        assert state.hashes == bytes(req.block_hashes[2])
        # Offered again (vLLM re-offers after a restore): not stored twice.
        so2 = SchedulerOutput.make_empty()
        so2.kv_connector_block_state = so.kv_connector_block_state
        assert [t.group for t in e.sched.build_connector_meta(so2).stores] == []
    finally:
        e.close()


@pytest.mark.parametrize("lookahead", [0, 1])
def test_eagle_drops_the_last_block_of_a_hit(model_config, tmp_path, lookahead):
    """Without lookahead block hashes vLLM's prefix cache drops a hit's last block for an
    EAGLE drafter and so does the connector. With them (vLLM 0.34, which the connector
    declares) a hash covers the next token too and the last block is kept; the lookahead
    joins the key namespace (the hashes differ)."""
    from vllm.config import SpeculativeConfig

    vc = vllm_config(model_config, tmp_path)
    plain = UMBPStoreConnector(vc, KVConnectorRole.SCHEDULER, kv_config((["l0"], full())))
    object.__setattr__(vc, "num_hash_lookahead_tokens", lookahead)
    # vLLM's own rule (SpeculativeConfig.use_eagle_block_drop), on a real object; building a
    # whole EAGLE config needs a draft checkpoint, so only the method is set.
    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", "eagle")
    object.__setattr__(spec, "disable_eagle_block_drop", False)
    assert spec.use_eagle_block_drop()
    vc.speculative_config = spec
    e = Engine(vc, kv_config((["l0"], full())))
    try:
        req = e.request("e", blocks=3)
        e.put(0, req, [1, 2, 3])
        assert matched(e, req)[0] == (3 if lookahead else 2) * BS
        ours = e.sched._scheduler.topo.namespace
        assert (ours != plain._scheduler.topo.namespace) == bool(lookahead)
    finally:
        vc.speculative_config = None
        e.close()
        plain.shutdown()


def test_lazy_offload_stores_blocks_freed_while_its_last_pick_was_in_flight(model_config, tmp_path):
    """Issue 30 item 7: lazy offload scans vLLM's free queue from its head each step. A cursor
    kept across steps rested on the last block it picked; that block's store ended after other
    blocks were freed behind it, so it went back to the queue after them and the next scan,
    starting after it, skipped them: they were evicted without being stored. Stored blocks
    go back to the eviction head. A scan window below a step's allocation is refused."""
    vc = vllm_config(model_config, tmp_path, lazy_offload=True)
    e = Engine(vc, kv_config((["attn.0"], full())))
    try:
        pool, w = e.pool, e.worker._worker

        def cached(req: Request) -> list:
            blocks = pool.get_new_blocks(2)
            pool.cache_full_blocks(req, blocks, 0, 2, BS, 0)
            return blocks

        a, b = e.request("a", blocks=2, seed=1), e.request("b", blocks=2, seed=2)
        blocks_a = cached(a)
        pool.free_blocks(blocks_a)  # a finished: its blocks are free, cached, not stored
        so = SchedulerOutput.make_empty()
        meta = e.sched.build_connector_meta(so)  # lazy offload picks a's blocks
        assert [list(t.block_ids) for t in meta.stores] == [[b.block_id for b in blocks_a]]
        blocks_b = cached(b)
        pool.free_blocks(blocks_b)  # b finishes while a's store is in flight
        e.worker.bind_connector_metadata(meta)
        e.worker.start_load_kv(None)
        e.worker.wait_for_save()
        for _ in range(500):
            res = e.worker.get_transfer_results(set())
            wm = e.worker.build_connector_worker_meta()
            if wm is not None and wm.finished_stores:
                break
            time.sleep(0.01)
        e.worker.clear_connector_metadata()
        e.sched.update_connector_output(
            KVConnectorOutput(finished_recving=res.finished_recving, kv_connector_worker_meta=wm)
        )
        head = list(pool.free_block_queue.iter_blocks_after(None))[:2]
        assert head == blocks_a, "stored blocks go back to the eviction head"
        # The next scan finds b's blocks; their store copies in the background, so step
        # until it is in the pool (never, if the scan skipped them).
        keys = w.keys.keys(0, list(a.block_hashes[:2]) + list(b.block_hashes[:2]))
        deadline = time.monotonic() + 30
        while w.store.exists(keys) != [True] * 4 and time.monotonic() < deadline:
            e.step()
            time.sleep(0.01)
        assert w.store.exists(keys) == [True] * 4
    finally:
        e.close()
    with pytest.raises(ConfigError, match=r"lazy_offload_max_blocks.*at least 256"):
        UMBPStoreConnector(
            vllm_config(model_config, tmp_path, lazy_offload=True, lazy_offload_max_blocks=8),
            KVConnectorRole.SCHEDULER,
            generate_scheduler_kv_cache_config([kv_config((["attn.0"], full()))]),
        )


def deepseek_v32_specs(mla_cache_dtype: str, layers: int = 3, block_size: int = 64) -> dict:
    """DeepSeek-V3.2's cache specs as its layers declare them in vLLM 0.32: per layer, the
    sparse MLA latent cache (`MLAAttention.get_kv_cache_spec`: 576 = 512 latent + 64 RoPE, or
    the 656-byte fp8_ds_mla blob) and the lightning indexer's key cache
    (`DeepseekV32IndexerCache`: 128 fp8 values + one fp32 scale = 132 bytes, one head)."""
    fp8 = mla_cache_dtype == "fp8_ds_mla"
    specs = {}
    for i in range(layers):
        specs[f"model.layers.{i}.self_attn.attn"] = kvi.MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=576,
            dtype=torch.uint8 if fp8 else BF16,
            cache_dtype_str=mla_cache_dtype,
            state_content_bytes=656 if fp8 else None,
            is_index_group_leader=True,
        )
        specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = kvi.MLAAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            max_tp_shards=1,
            head_size=132,
            dtype=torch.uint8,
            cache_role=kvi.SparseCacheRole.INDEXER,
        )
    return specs


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("mla_cache_dtype", ["auto", "fp8_ds_mla"])
def test_sparse_mla_with_an_indexer_restores_every_byte(
    model_config, tmp_path, mla_cache_dtype, layout
):
    """Issue 31: DeepSeek-V3.2's sparse-attention indexer keeps a per-token key cache beside
    the MLA latents (vLLM CPU cannot run the model). vLLM's own `get_kv_cache_configs` and
    `allocate_kv_cache` build the engine's cache from the real layer specs; the indexer's
    blocks are stored with their block like any attention cache (every block of a hit), and
    a restore into other blocks writes exactly the stored bytes of both caches, nothing else."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_configs
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    bs = 64
    specs = deepseek_v32_specs(mla_cache_dtype, block_size=bs)
    vc = vllm_config(model_config, tmp_path)
    vc.cache_config.block_size = bs
    vc.cache_config.kv_cache_layout = layout  # what the engine core resolves
    per_block = sum(s.page_size_bytes for s in specs.values())
    [kc] = get_kv_cache_configs(vc, [specs], [160 * per_block])  # 8K tokens and more
    cfg = ConnectorConfig.parse({"lookup_dir": str(tmp_path)})
    topo = engine_topology(cfg, vc, kc)
    everything = tuple(range(len(kc.kv_cache_groups)))
    assert (topo.load_groups, topo.state_groups, topo.block_size) == (everything, (), bs)
    caches = allocate_kv_cache(kc, torch.device("cpu"), KVCacheLayout[layout])
    assert set(caches) == set(specs)
    worker = UMBPStoreConnector(vc, KVConnectorRole.WORKER, kc)
    try:
        worker.register_kv_caches(caches)
        w = worker._worker
        raws = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in caches.values()}
        assert len(raws) == 1, "vLLM 0.32 backs every layer with one allocation"
        storage = next(iter(raws.values()))
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))
        gen = torch.Generator().manual_seed(31)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        src, dst = [1, 5, 9], [2, 30, 17]
        stored = {n: t[src].clone() for n, t in caches.items()}
        hashes = [bytes([b]) * 32 for b in src]
        for g in everything:
            keys = w.keys.keys(g, hashes)
            assert w.store.store(w.layout, g, src, keys).wait(5000) == ["done"] * 3
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
        expect = {n: t.clone() for n, t in caches.items()}
        for n in expect:
            expect[n][dst] = stored[n]
        for g in everything:
            keys = w.keys.keys(g, hashes)
            assert w.store.load(w.layout, g, dst, keys).wait(5000) == ["done"] * 3
        for n, t in caches.items():  # as bytes: random bf16 bytes hold NaNs
            assert torch.equal(t.view(torch.uint8), expect[n].view(torch.uint8)), n
    finally:
        worker.shutdown()


def test_hits_are_labelled_host_memory(model_config, tmp_path):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    e = Engine(vllm_config(model_config, tmp_path), kv_config((["l0"], full())))
    try:
        req = e.request("h", blocks=2)
        assert e.sched.get_external_cache_hit_sources(req, 2 * BS) == {CacheHitSource.HOST: 2 * BS}
    finally:
        e.close()


# ---------------------------------------------------------------------------------------------
# Compatibility with the installed vLLM's connector API
# ---------------------------------------------------------------------------------------------


def test_released_kv_memory_is_deregistered_and_registered_again(model_config, tmp_path):
    """vLLM 0.34 releases the KV cache's memory between `unregister_kv_caches` and
    `restore_kv_caches` (release_kv_cache_memory, discard, weight updates) and maps it again
    at the same addresses, empty. In between nothing may be copied into it; afterwards the
    pool's objects restore into it exactly, through the scheduler's lookup and a load."""
    vc = vllm_config(model_config, tmp_path, load_async=False)
    e = Engine(vc, kv_config((["full.0", "full.1"], full())))
    try:
        w = e.worker._worker
        g = torch.Generator().manual_seed(5)
        for t in e.caches.values():
            t.copy_(torch.randn(t.shape, generator=g).to(BF16))
        req = e.request("r1", blocks=3)
        e.put(0, req, [1, 2, 3])
        want = {n: t[[1, 2, 3]].clone() for n, t in e.caches.items()}
        layout_before = w.layout
        real = w.store

        class FailsSecond:  # the store, with a deregistration that fails part-way
            calls = 0

            def __getattr__(self, name):
                return getattr(real, name)

            def deregister_memory(self, region):
                FailsSecond.calls += 1
                if FailsSecond.calls == 2:
                    raise umbp.UmbpError("injected")
                real.deregister_memory(region)

        w.store = FailsSecond()
        with pytest.raises(umbp.UmbpError, match="injected"):
            e.worker.unregister_kv_caches()
        assert len(w.regions) == 1 and w.layout == -1  # one left; nothing new starts
        w.store = real
        e.worker.unregister_kv_caches()  # deregisters the rest
        e.worker.unregister_kv_caches()  # idempotent
        assert w.layout == -1 and w.regions == []
        keys = w.keys.keys(0, list(req.block_hashes[:3]))
        with pytest.raises(umbp.UmbpError):  # the old layout is gone with its memory
            w.store.load(layout_before, 0, [4, 5, 6], keys).wait(5000)
        # A step that would run meanwhile copies nothing: its load fails (recomputed).
        assert matched(e, req) == (3 * BS, False)
        e.sched.update_state_after_alloc(req, blocks_of(e, [4, 5, 6]), 3 * BS)
        out = e.step()
        assert out.invalid_block_ids == {4, 5, 6}
        for t in e.caches.values():  # what vLLM maps again holds nothing
            t.zero_()
        e.worker.restore_kv_caches()
        e.worker.restore_kv_caches()  # idempotent
        assert w.layout >= 0 and len(w.regions) == len(e.caches)
        req2 = e.request("r2", blocks=3)  # the same tokens: the same hashes
        assert matched(e, req2) == (3 * BS, False)
        e.sched.update_state_after_alloc(req2, blocks_of(e, [7, 8, 9]), 3 * BS)
        out = e.step()
        assert not out.invalid_block_ids
        for n, t in e.caches.items():
            assert torch.equal(t[[7, 8, 9]], want[n]), n
    finally:
        e.close()


@pytest.mark.parametrize("load_async", [True, False])
def test_may_load_async_answers_without_a_lookup(model_config, tmp_path, load_async):
    """vLLM 0.34 asks `may_load_async` as each request enters the waiting queue: True only
    where the load could be asynchronous (async loads, a full block to look up), and it never
    asks the pool (nothing is stored here, yet a 3-block prompt answers True)."""
    vc = vllm_config(model_config, tmp_path, load_async=load_async)
    e = Engine(vc, kv_config((["full.0"], full())))
    try:
        assert e.worker.may_load_async(e.request("w", blocks=3)) is False  # the worker role
        assert e.sched.may_load_async(e.request("r", blocks=3)) is load_async
        tiny = Request(
            "t", list(range(1, BS + 1)), SamplingParams(max_tokens=1), None, block_hasher=e.hasher
        )
        assert len(tiny.block_hashes) == 1
        assert e.sched.may_load_async(tiny) is False  # its last token is always computed
        assert e.worker._worker.store.stats()["hits"] == 0
    finally:
        e.close()


def test_a_request_asked_again_counts_its_lookup_once(model_config, tmp_path):
    """vLLM asks `get_num_new_matched_tokens` again every step it cannot schedule a request:
    the stats count the request's lookup once."""
    vc = vllm_config(model_config, tmp_path, load_async=False, lookup_async=False)
    e = Engine(vc, kv_config((["full.0", "full.1"], full())))
    try:
        req = e.request("r1", blocks=3)
        e.put(0, req, [1, 2])
        for _ in range(3):
            assert matched(e, req) == (2 * BS, False)
        c = e.sched.get_kv_connector_stats().data["c"]
        assert (c["lookup_hit_tokens"], c["lookup_miss_tokens"]) == (2 * BS, BS)
        assert e.sched.get_kv_connector_stats() is None  # handed out once
    finally:
        e.close()


def test_gpu_headroom_advice_gives_the_exact_setting():
    """vLLM 0.34's extensible KV cache sizes itself with gpu_memory_utilization 1.0 by
    default; UMBP's staging, allocated afterwards, must then be left out of vLLM's budget."""
    import types

    from umbp.vllm.worker import gpu_headroom_advice

    h100 = 79 << 30  # about what torch reports for an 80 GB card
    cc = types.SimpleNamespace(enable_extensible_kv_cache=True, gpu_memory_utilization=None)
    note = gpu_headroom_advice(cc, 512 << 20, h100)
    assert note and "gpu_memory_utilization=0.99" in note and "512 MiB" in note
    assert gpu_headroom_advice(cc, 8 << 30, h100) and "=0.89" in gpu_headroom_advice(
        cc, 8 << 30, h100
    )
    cc.gpu_memory_utilization = 0.99
    assert gpu_headroom_advice(cc, 512 << 20, h100) is None
    cc.gpu_memory_utilization = 0.995
    assert gpu_headroom_advice(cc, 512 << 20, h100)
    assert gpu_headroom_advice(cc, 0, h100) is None  # no staging
    # vLLM 0.32 / 0.33 (no extensible cache): 0.9 of the device by default, room enough.
    old = types.SimpleNamespace(gpu_memory_utilization=0.9)
    assert gpu_headroom_advice(old, 512 << 20, h100) is None


def test_namespace_describes_a_spec_by_its_fields_not_at_their_defaults():
    """A field at its declared default (one a newer vLLM adds, say) leaves a cache group's
    description as it was; any other value changes it (tests/vllm_next compares 0.32 and
    0.34 objects)."""
    full = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=8, head_size=128, dtype=BF16)
    spelled = kvi.FullAttentionSpec(
        block_size=BS, num_kv_heads=8, head_size=128, dtype=BF16, sliding_window=None
    )
    want = {"type": "FullAttentionSpec", "block_size": BS, "num_kv_heads": 8}
    want |= {"head_size": 128, "dtype": "torch.bfloat16", "head_size_v": 128}  # set from head_size
    assert spec_fields(full) == spec_fields(spelled) == want
    other_v = kvi.FullAttentionSpec(
        block_size=BS, num_kv_heads=8, head_size=128, dtype=BF16, head_size_v=64
    )
    assert spec_fields(other_v) == want | {"head_size_v": 64}
    window = kvi.SlidingWindowSpec(
        block_size=BS, num_kv_heads=8, head_size=128, dtype=BF16, sliding_window=256
    )
    assert spec_fields(window) == want | {"type": "SlidingWindowSpec", "sliding_window": 256}


def test_every_overridden_hook_matches_the_installed_base_class():
    check_overridden_hooks(UMBPStoreConnector)
