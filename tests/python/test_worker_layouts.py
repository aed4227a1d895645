"""The connector's worker registers KV caches exactly as vLLM allocates them, for every layout.

vLLM's own `allocate_kv_cache` (vllm/v1/worker/utils.py) builds the caches on CPU for each
`KVCacheLayout`; the worker side of `UMBPStoreConnector` registers them, stores blocks through
`wait_for_save`, the whole cache is overwritten, and `start_load_kv` restores the blocks into
other ids. The entire backing allocation is compared. Before the layout planner read strides,
LHBNC and BHLNC with 2+ KV heads restored only part of each block while reporting "done".
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kv_matrix  # noqa: E402

from umbp.vllm.config import ConnectorConfig  # noqa: E402
from umbp.vllm.metadata import Transfer, UMBPConnectorMetadata  # noqa: E402
from umbp.vllm.runtime import EmbeddedRuntime  # noqa: E402
from umbp.vllm.topology import Ranks, Topology  # noqa: E402
from umbp.vllm.worker import WorkerSide  # noqa: E402

LAYERS, BLOCKS, BS, HEAD = 3, 24, 16, 32


def kv_cache_config(layout: str, heads: int) -> KVCacheConfig:
    spec = FullAttentionSpec(
        block_size=BS, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    strides = kv_matrix.layout_byte_strides(
        (LAYERS, BLOCKS, heads, BS, page // (heads * BS)), KVCacheLayout[layout].stride_order
    )
    tensor = KVCacheTensor(
        size=LAYERS * BLOCKS * page,
        layers=names,
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


CASES = [(layout, heads, None) for layout in kv_matrix.LAYOUTS for heads in (1, 2, 8)] + [
    # The attention kernel's block is a quarter of the manager's: each layer view has
    # 4 × num_blocks rows (FlashInfer with --block-size 128 does this).
    ("LBNHC", 8, BS // 4),
    ("LBHNC", 2, BS // 4),
]


@pytest.mark.parametrize(
    "layout,heads,kernel_bs", CASES, ids=[f"{a}-h{b}-k{k or BS}" for a, b, k in CASES]
)
def test_worker_restores_every_layout_exactly(layout, heads, kernel_bs, tmp_path):
    kcc = kv_cache_config(layout, heads)
    caches = allocate_kv_cache(
        kcc,
        torch.device("cpu"),
        KVCacheLayout[layout],
        kernel_block_sizes=None if kernel_bs is None else [kernel_bs],
    )
    if kernel_bs is not None:
        assert next(iter(caches.values())).shape[0] == BLOCKS * BS // kernel_bs
    first = next(iter(caches.values()))
    # The backing int8 allocation every layer's view points into.
    buf = torch.empty(0, dtype=torch.int8).set_(first.untyped_storage())
    cfg = ConnectorConfig.parse(
        {"total_capacity_bytes": 16 << 20, "dram_prefault": False, "lookup_dir": str(tmp_path)},
        "kv_both",
    )
    topo = Topology(
        namespace=f"worker-layouts-{layout}-{heads}",
        tag=f"wl{layout}{heads}",
        tp_size=1,
        pcp_size=1,
        dcp_size=1,
        dp_rank=0,
        block_size=BS,
        num_groups=1,
    )
    w = WorkerSide(cfg, topo, EmbeddedRuntime(cfg, topo), kcc, Ranks(tp=0, pcp=0, dcp=0))
    try:
        w.register_kv_caches(caches)
        g = torch.Generator().manual_seed(3)
        buf.copy_(torch.randint(-128, 128, buf.shape, generator=g, dtype=torch.int8))
        before = buf.clone()
        src, dst = [3, 7, 11, 20], [0, 5, 13, 22]
        hashes = b"".join(i.to_bytes(8, "little") * 4 for i in src)
        store = Transfer(group=0, block_ids=src, hashes=hashes, hash_len=32, store_id=1)
        w.wait_for_save(UMBPConnectorMetadata(stores=[store]))
        assert w.stores[1].wait(30_000) == ["done"] * 4
        buf.copy_(torch.randint(-128, 128, buf.shape, generator=g, dtype=torch.int8))
        expect = buf.clone()
        # Block b of every layer, in bytes, through vLLM's own views of both buffers.
        for t in caches.values():
            tb = t.view(torch.int8)
            offset = tb.data_ptr() - buf.data_ptr()
            ev = torch.as_strided(expect, tb.shape, tb.stride(), offset)
            bv = torch.as_strided(before, tb.shape, tb.stride(), offset)
            r = tb.shape[0] // BLOCKS  # kernel rows per manager block
            ev.unflatten(0, (BLOCKS, r))[dst] = bv.unflatten(0, (BLOCKS, r))[src]
        load = Transfer(group=0, block_ids=dst, hashes=hashes, hash_len=32, req_id="r")
        w.start_load_kv(UMBPConnectorMetadata(loads=[load]))
        assert not w.take_load_errors()
        assert torch.equal(buf, expect), f"{layout} h{heads}: restored cache differs"
    finally:
        w.shutdown()
