"""MLA stored once across TP ranks, in standalone mode, against a real `umbp_standalone_server`.

With multi-head latent attention every TP rank holds the same latent cache. The connector keys
such blocks without the TP rank: the first rank of each replica group stores them, the others
answer "skipped", the scheduler asks the server about one rank, and every rank restores from
the one object. Byte-exact through the layout matrix (tests/kv_matrix.py's MLA forms) and
through the connector's worker side with vLLM's own `MLAAttentionSpec` and `allocate_kv_cache`
(a real MLA engine at TP 2 runs in tests/vllm/test_standalone.py). In embedded mode each
worker keeps its own pool, and the remote tier behind them gets one object per block, written
by the first rank only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import types

import pytest
from test_standalone import server  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kv_matrix  # noqa: E402

import umbp  # noqa: E402
from umbp.vllm.standalone import ServerStore  # noqa: E402

LAYERS, BS, HEAD = 3, 16, 576  # DeepSeek's latent: 512 + 64 RoPE values per token


def client(endpoint: str) -> umbp.StandaloneClient:
    return umbp.StandaloneClient(endpoint, startup_timeout_ms=5000, timeout_ms=30000)


@pytest.mark.parametrize("form", ["MLA", "MLA3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_mla_forms_are_stored_once_and_restored_on_every_rank(server, form, tp):  # noqa: F811
    caches = [
        kv_matrix.Cache(
            form,
            device="cpu",
            layers=LAYERS,
            blocks=40,
            heads=1,
            block_size=BS,
            head_size=HEAD,
            dtype=torch.bfloat16,
            mapped=True,
        )
        for _ in range(tp)
    ]
    stores = [ServerStore(client(server.endpoint)) for _ in range(tp)]
    try:
        for st, c in zip(stores, caches):
            st.register_memory(c.raw.data_ptr(), c.raw.numel())
        statuses = kv_matrix.round_trip_replicated(stores, caches, f"mla-{form}-tp{tp}")
        assert statuses == ["done"] * len(statuses)
        st = stores[0].client.stats()
        # One object per block, not one per rank.
        assert st["objects"] == len(statuses), st
        assert st["used_bytes"] < 2 * len(statuses) * LAYERS * caches[0].page, st
    finally:
        for s in stores:
            s.close()


def test_a_server_store_its_admission_skips_reads_skipped(tmp_path):
    """`--store-admission on_reuse`: a key's first store is not kept and answers "skipped" over
    the wire (KEY_STATUS_SKIPPED, protocol 3), not "done"; its second store is kept."""
    from standalone_server import running

    with running(tmp_path.name, extra_args=["--store-admission", "on_reuse"]) as srv:
        c = kv_matrix.Cache(
            "MLA",
            device="cpu",
            layers=LAYERS,
            blocks=40,
            heads=1,
            block_size=BS,
            head_size=HEAD,
            dtype=torch.bfloat16,
            mapped=True,
        )
        st = ServerStore(client(srv.endpoint))
        try:
            st.register_memory(c.raw.data_ptr(), c.raw.numel())
            lid = st.register_tensor_layout([c.describe()], [c.blocks])
            hashes = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
            keys = umbp.KeyBuilder("admission-skip", tp=0).keys(0, hashes)
            assert st.store(lid, 0, [0, 1, 2, 3], keys).wait(30_000) == ["skipped"] * 4
            assert st.store(lid, 0, [0, 1, 2, 3], keys).wait(30_000) == ["done"] * 4
            assert st.client.stats()["objects"] == 4
        finally:
            st.close()


# -- the connector: vLLM's own spec objects and KV cache allocation ----------------------------

vllm = pytest.importorskip("vllm")

from vllm.v1 import kv_cache_interface as kvi  # noqa: E402
from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from umbp.vllm.config import ConnectorConfig  # noqa: E402
from umbp.vllm.metadata import Transfer, UMBPConnectorMetadata  # noqa: E402
from umbp.vllm.runtime import StandaloneRuntime, key_ranks  # noqa: E402
from umbp.vllm.topology import Ranks, Topology, tp_replicas  # noqa: E402
from umbp.vllm.worker import WorkerSide  # noqa: E402

# Over glibc's largest mmap threshold (32 MiB): vLLM's allocation gets a mapping of its own,
# which the standalone client can share with the server in place.
BLOCKS = 640


def mla_spec() -> kvi.MLAAttentionSpec:
    # As vLLM's MLAAttention.get_kv_cache_spec makes it: one latent "head", never sharded.
    return kvi.MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16, max_tp_shards=1
    )


def full_spec(heads: int = 2) -> kvi.FullAttentionSpec:
    return kvi.FullAttentionSpec(
        block_size=BS, num_kv_heads=heads, head_size=64, dtype=torch.bfloat16
    )


def kv_cache_config(spec, layout: str = "LBHNC", tp: int = 2) -> kvi.KVCacheConfig:
    page = spec.page_size_bytes
    heads = spec.num_kv_heads if not isinstance(spec, kvi.MLAAttentionSpec) else 1
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    strides = kv_matrix.layout_byte_strides(
        (LAYERS, BLOCKS, heads, BS, page // (heads * BS)), KVCacheLayout[layout].stride_order
    )
    tensor = kvi.KVCacheTensor(
        size=LAYERS * BLOCKS * page, layers=names, layer_stride=strides[0], block_stride=strides[1]
    )
    groups = [kvi.KVCacheGroupSpec(names, spec)]
    kcc = kvi.KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[tensor], kv_cache_groups=groups)
    # What vLLM's get_kv_cache_configs sets on every worker's config (and so the scheduler's).
    kcc.kv_tp_replicas = kv_cache_groups_tp_replicas(groups, tp, 1)
    return kcc


def test_replicas_follow_vllms_specs():
    for tp in (1, 2, 4, 8):
        mla, full = kv_cache_config(mla_spec(), tp=tp), kv_cache_config(full_spec(), tp=tp)
        assert tp_replicas(mla, mla.kv_cache_groups, tp, 1, 1) == tp
        assert tp_replicas(full, full.kv_cache_groups, tp, 1, 1) == 1
    # Context parallelism splits or may split MLA's tokens across ranks: every rank its own.
    assert tp_replicas(mla, mla.kv_cache_groups, 8, 1, 2) == 1
    assert tp_replicas(mla, mla.kv_cache_groups, 8, 2, 1) == 1
    # A vLLM without `kv_tp_replicas`: every layer MLA.
    bare = types.SimpleNamespace(kv_cache_groups=mla.kv_cache_groups)
    assert tp_replicas(bare, bare.kv_cache_groups, 8, 1, 1) == 8
    bare = types.SimpleNamespace(kv_cache_groups=full.kv_cache_groups)
    assert tp_replicas(bare, bare.kv_cache_groups, 8, 1, 1) == 1


def topo(tp: int, replicas: int, namespace: str) -> Topology:
    return Topology(
        namespace=namespace,
        tag="mla",
        tp_size=tp,
        pcp_size=1,
        dcp_size=1,
        dp_rank=0,
        block_size=BS,
        num_groups=1,
        tp_replicas=replicas,
    )


def test_lookups_ask_one_rank_of_each_replica_group():
    assert key_ranks(topo(8, 8, "ns")) == [(0, 0, 0, 0)]
    assert key_ranks(topo(8, 2, "ns")) == [(0, 0, 0, 0), (2, 0, 0, 0), (4, 0, 0, 0), (6, 0, 0, 0)]
    assert len(key_ranks(topo(8, 1, "ns"))) == 8
    t = topo(4, 4, "ns")
    assert [t.key_tp(r) for r in range(4)] == [0, 0, 0, 0]
    assert [t.stores_blocks(r) for r in range(4)] == [True, False, False, False]


def restore_and_check(w, b, c, before, src, dst, hashes) -> None:
    """Loads blocks `src` (stored from `before`, the worker's whole int8 buffer then) into
    `dst` through worker `w`, and checks its buffer `b` (vLLM's layer views `c` into it): the
    `dst` blocks of every layer hold `before`'s `src` blocks, every other byte is unchanged."""
    expect = b.clone()
    for tensor in c.values():
        tb = tensor.view(torch.int8)
        off = tb.data_ptr() - b.data_ptr()
        ev = torch.as_strided(expect, tb.shape, tb.stride(), off)
        bv = torch.as_strided(before, tb.shape, tb.stride(), off)
        ev[dst] = bv[src]
    load = Transfer(group=0, block_ids=dst, hashes=hashes, hash_len=32, req_id="r")
    w.start_load_kv(UMBPConnectorMetadata(loads=[load]))
    assert not w.take_load_errors()
    assert torch.equal(b, expect), f"rank {w.tp}: restored cache differs"


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("replicated", [True, False], ids=["once", "per-rank"])
def test_connector_stores_mla_once_at_tp2_and_every_rank_restores_it(
    server,  # noqa: F811
    layout,
    replicated,
):
    """Two workers of a TP 2 engine (vLLM's own MLA spec and KV cache allocation), their
    scheduler's lookups, one real server: with the replicated layout rank 0 stores, rank 1
    answers "skipped", the server holds one object per block; both ranks restore every byte.
    `per-rank` is the layout before (each rank its own objects): twice the objects."""
    tp = 2
    kcc = kv_cache_config(mla_spec(), layout, tp=2)
    replicas = tp_replicas(kcc, kcc.kv_cache_groups, tp, 1, 1) if replicated else 1
    assert replicas == (2 if replicated else 1)
    t = topo(tp, replicas, f"mla-connector-{layout}-{replicas}")
    cfg = ConnectorConfig.parse({"mode": "standalone", "endpoint": server.endpoint}, "kv_both")
    workers, bufs, caches = [], [], []
    for rank in range(tp):
        c = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout[layout])
        caches.append(c)
        first = next(iter(c.values()))
        bufs.append(torch.empty(0, dtype=torch.int8).set_(first.untyped_storage()))
        workers.append(WorkerSide(cfg, t, StandaloneRuntime(cfg, t), kcc, Ranks(tp=rank)))
    sched = StandaloneRuntime(cfg, t)
    lookups = sched.lookup_client()
    try:
        for w, c in zip(workers, caches):
            w.register_kv_caches(c)
        g = torch.Generator().manual_seed(5)
        bufs[0].copy_(torch.randint(-128, 128, bufs[0].shape, generator=g, dtype=torch.int8))
        bufs[1].copy_(bufs[0])  # MLA: every rank holds the same latent cache
        before = bufs[0].clone()
        src, dst = [3, 7, 11, 20, 300], [0, 5, 13, 22, 600]
        hashes = b"".join(i.to_bytes(8, "little") * 4 for i in src)
        store = Transfer(group=0, block_ids=src, hashes=hashes, hash_len=32, store_id=1)
        for w in workers:
            w.wait_for_save(UMBPConnectorMetadata(stores=[store]))
        got = [w.stores[1].wait(30_000) for w in workers]
        assert got[0] == ["done"] * len(src)
        assert got[1] == (["skipped"] if replicated else ["done"]) * len(src)
        for w in workers:  # every rank reports the store finished (the scheduler waits)
            assert w.worker_meta().finished_stores == {1: 1}
        skipped = (workers[1].take_stats() or workers[0].take_stats()).data["c"]
        assert skipped.get("store_skipped_blocks", 0) == (len(src) if replicated else 0)
        objects = lookups.client.stats()["objects"]
        assert objects == len(src) * (1 if replicated else tp)
        assert lookups.ranks == key_ranks(t)
        assert lookups.prefix_hits(0, hashes, 32) == len(src)
        # Both ranks' caches overwritten (with other bytes each), then both restore.
        for b in bufs:
            b.copy_(torch.randint(-128, 128, b.shape, generator=g, dtype=torch.int8))
        for w, b, c in zip(workers, bufs, caches):
            restore_and_check(w, b, c, before, src, dst, hashes)
    finally:
        for w in workers:
            w.shutdown()
        lookups.client.clear()
        sched.scheduler_shutdown()


def test_embedded_remote_tier_gets_one_object_per_block_at_tp2(tmp_path):
    """Embedded mode at TP 2 with an MLA cache and a real Redis: each worker stores into its
    own pool, only rank 0 writes the remote tier (one object per block, not one per rank);
    two fresh workers (empty pools, as on another node) both restore every byte from it."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from redis_cluster import redis_cluster

    from umbp.vllm.runtime import EmbeddedRuntime

    tp = 2
    kcc = kv_cache_config(mla_spec(), "LBHNC", tp=2)
    replicas = tp_replicas(kcc, kcc.kv_cache_groups, tp, 1, 1)
    assert replicas == 2
    t = dataclasses.replace(topo(tp, replicas, "mla-embedded-remote"), replicas_share_pool=False)
    assert [t.stores_blocks(r) for r in range(tp)] == [True, True]
    assert [t.writes_shared(r) for r in range(tp)] == [True, False]
    src, dst = [3, 7, 11, 20, 300], [0, 5, 13, 22, 600]
    hashes = b"".join(i.to_bytes(8, "little") * 4 for i in src)
    g = torch.Generator().manual_seed(11)

    def engine(cluster, node: str):
        (tmp_path / node).mkdir()
        cfg = ConnectorConfig.parse(
            {
                "total_capacity_bytes": 64 << 20,
                "dram_prefault": False,
                "lookup_dir": str(tmp_path / node),
                "remote_url": cluster.url,
                "remote_timeout_ms": 5000,
            },
            "kv_both",
        )
        workers, bufs = [], []
        for rank in range(tp):
            c = allocate_kv_cache(kcc, torch.device("cpu"), KVCacheLayout.LBHNC)
            first = next(iter(c.values()))
            bufs.append(torch.empty(0, dtype=torch.int8).set_(first.untyped_storage()))
            w = WorkerSide(cfg, t, EmbeddedRuntime(cfg, t), kcc, Ranks(tp=rank))
            w.register_kv_caches(c)
            workers.append((w, c))
        return cfg, workers, bufs

    with redis_cluster(1) as cluster:
        _, node_a, bufs_a = engine(cluster, "a")
        try:
            bufs_a[0].copy_(
                torch.randint(-128, 128, bufs_a[0].shape, generator=g, dtype=torch.int8)
            )
            bufs_a[1].copy_(bufs_a[0])  # MLA: every rank holds the same latent cache
            before = bufs_a[0].clone()
            store = Transfer(group=0, block_ids=src, hashes=hashes, hash_len=32, store_id=1)
            for w, _ in node_a:
                w.wait_for_save(UMBPConnectorMetadata(stores=[store]))
            for w, _ in node_a:  # both ranks keep a copy in their own pool
                assert w.stores[1].wait(30_000) == ["done"] * len(src)
                assert w.store.flush_remote(10_000)
            writes = [w.store.remote_stats()["writes"] for w, _ in node_a]
            assert writes == [len(src), 0], writes
            assert len(cluster.keys()) == len(src)  # one object per block, not one per rank
        finally:
            for w, _ in node_a:
                w.shutdown()

        cfg, node_b, bufs_b = engine(cluster, "b")
        lookups = EmbeddedRuntime(cfg, t).lookup_client()
        try:
            for w, _ in node_b:
                assert w.store.stats()["objects"] == 0
            # The scheduler asks both workers: each fetches the shared objects into its pool.
            assert lookups.prefix_hits(0, hashes, 32) == len(src)
            for (w, c), b in zip(node_b, bufs_b):
                b.copy_(torch.randint(-128, 128, b.shape, generator=g, dtype=torch.int8))
                restore_and_check(w, b, c, before, src, dst, hashes)
                assert w.store.remote_stats()["hits"] == len(src)
        finally:
            for w, _ in node_b:
                w.shutdown()
