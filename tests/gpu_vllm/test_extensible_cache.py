"""vLLM 0.34's extensible KV cache, released and recommitted, under the connector (issue 30).

vLLM 0.34 reserves the KV cache as a virtual range and maps physical pages into it (several
allocations as it grows); `release_kv_cache_memory`, `discard`, sleep and weight updates unmap
them between `unregister_kv_caches` and `restore_kv_caches` and map fresh, zeroed pages at the
same addresses afterwards. No vLLM 0.34 engine runs on this GPU machine (it needs torch 2.14),
so the memory comes from vLLM 0.34's own allocator, `ExtensibleTensor` (its module and the
driver module under it, carried: $UMBP_VLLM_NEXT_UTILS, or the 0.34 overlay of
`scripts/vllm_overlay.py`), and the connector's two roles run with vLLM's objects, as in
tests/vllm/test_shapes.py, over per-layer views of it:

- blocks stored from views that span two physical allocations (a first commit, then growth,
  as warm-up grows the cache), with a block straddling the two;
- `unregister_kv_caches`, the pages released, new zeroed ones mapped at the same addresses (what
  vLLM's `recommit` does), `restore_kv_caches`;
- the same prompt looked up and loaded: every byte equal to what was stored.

Standalone mode allocates the pages exportable (POSIX descriptors, what vLLM does for a
connector declaring `EXPORTS_FD`) and the server imports them, again after the restore. With the
two hooks made no-ops the test fails in both modes at the step that runs while the memory is
released (its load goes through instead of failing).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "vllm"))

from common import Server, server_bin  # noqa: E402
from test_shapes import (  # noqa: E402, F401  (parallel_groups: an autouse fixture)
    BF16,
    Engine,
    blocks_of,
    full,
    kv_config,
    matched,
    parallel_groups,
)
from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)

from umbp.vllm import plugin  # noqa: E402

#: `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, what vLLM 0.34 asks of the driver for a connector
#: declaring `KVCacheAccess.EXPORTS_FD`.
POSIX_FD = 0x1
#: 6 KV heads of 128 at bf16, 16-token blocks: 48 KiB per block and layer, so block 42 of each
#: layer straddles the first 2 MiB granule (and the two physical allocations).
HEADS, HEAD, BS = 6, 128, 16
LAYERS = 4
CAPACITY = 128  # blocks the reservation holds
FIRST, COMMITTED = 2, 96  # blocks committed at allocation, then after growth


def _utils_dir() -> Path | None:
    d = os.environ.get("UMBP_VLLM_NEXT_UTILS")
    if d:
        return Path(d)
    overlay = HERE.parents[1] / ".venv" / "vllm-0.34.0-py" / "vllm" / "utils"
    return overlay if overlay.is_dir() else None


@pytest.fixture(scope="module")
def extensible_tensor():
    """vLLM 0.34's `ExtensibleTensor` class, loaded from its own files over this vLLM."""
    d = _utils_dir()
    if d is None or not (d / "extensible_tensor.py").is_file():
        pytest.skip("needs vLLM 0.34's vllm/utils (set UMBP_VLLM_NEXT_UTILS)")
    saved = sys.modules.get("vllm.utils.vmm_driver")
    mods = {}
    try:
        for name in ("vmm_driver", "extensible_tensor"):
            spec = importlib.util.spec_from_file_location(f"vllm.utils.{name}", d / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"vllm.utils.{name}"] = mod  # extensible_tensor imports the driver
            spec.loader.exec_module(mod)
            mods[name] = mod
    finally:
        if saved is not None:
            sys.modules["vllm.utils.vmm_driver"] = saved
        else:
            sys.modules.pop("vllm.utils.vmm_driver", None)
        sys.modules.pop("vllm.utils.extensible_tensor", None)
    reason = mods["vmm_driver"].vmm_unavailable_reason(POSIX_FD)
    if reason:
        pytest.skip(f"vLLM 0.34's driver: {reason}")
    return mods["extensible_tensor"].ExtensibleTensor


@pytest.fixture(scope="module")
def model_config(tmp_path_factory) -> ModelConfig:
    from umbp.demo.tiny_model import build

    plugin.register()
    return ModelConfig(
        model=build(str(tmp_path_factory.mktemp("model") / "tiny")), dtype="bfloat16"
    )


def _vllm_config(model_config, extra: dict) -> VllmConfig:
    ktc = KVTransferConfig(
        kv_connector="UMBPStoreConnector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"load_async": False, **extra},
    )
    return VllmConfig(
        model_config=model_config,
        parallel_config=ParallelConfig(),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_model_len=4096, is_encoder_decoder=False, max_num_batched_tokens=4096
        ),
        kv_transfer_config=ktc,
    )


class Cache:
    """The KV cache as vLLM 0.34 lays out a block-compact, layer-outermost one: a segment of the
    reservation per layer, each layer's view spanning exactly its committed blocks."""

    def __init__(self, extensible_tensor, export_handle_types: int) -> None:
        self.block_bytes = 2 * BS * HEADS * HEAD * 2
        self.buf = extensible_tensor(
            LAYERS * CAPACITY * self.block_bytes,
            device="cuda",
            segment_capacities=[CAPACITY * self.block_bytes] * LAYERS,
            export_handle_types=export_handle_types,
        )
        self.commit(FIRST)  # at allocation: one granule per layer
        self.commit(COMMITTED)  # after warm-up: a second physical allocation per layer

    def commit(self, blocks: int) -> None:
        self.buf.resize_segments_([blocks * self.block_bytes] * LAYERS, zero_new=True)
        self.blocks = blocks

    def views(self) -> dict[str, torch.Tensor]:
        return {
            f"full.{i}": self.buf.segment_view(i).view(BF16).view(self.blocks, 2, BS, HEADS, HEAD)
            for i in range(LAYERS)
        }

    def release_and_recommit(self) -> None:
        """vLLM's `release_physical()` then `recommit()`: new zeroed pages, same addresses."""
        self.buf.release_physical()
        self.commit(self.blocks)


@pytest.mark.parametrize("mode", ["embedded", "standalone"])
def test_released_and_recommitted_extensible_cache_restores_every_byte(
    mode, extensible_tensor, model_config, tmp_path
):
    server = None
    if mode == "standalone":
        if not server_bin():
            pytest.skip("needs umbp_standalone_server ($UMBP_SERVER_BIN or PATH)")
        server = Server(tmp_path, capacity="1GiB").start()
        extra = {"mode": "standalone", "endpoint": server.endpoint}
    else:
        extra = {
            "total_capacity_bytes": 256 << 20,
            "lookup_dir": str(tmp_path),
            "dram_prefault": False,
        }
    cache = Cache(extensible_tensor, POSIX_FD if mode == "standalone" else 0)
    views = cache.views()
    addrs = {n: v.data_ptr() for n, v in views.items()}
    e = Engine(
        _vllm_config(model_config, extra),
        kv_config((list(views), full(heads=HEADS, head=HEAD)), num_blocks=COMMITTED),
        caches=views,
    )
    try:
        g = torch.Generator(device="cuda").manual_seed(30)
        for v in views.values():
            v.copy_(torch.randn(v.shape, generator=g, device="cuda").to(BF16))
        torch.cuda.synchronize()
        ids = list(range(30, 60))  # across block 42, where the two allocations meet
        req = e.request("r1", blocks=len(ids))
        e.put(0, req, ids)
        want = {n: v[ids].clone() for n, v in views.items()}

        e.worker.unregister_kv_caches()
        cache.release_and_recommit()
        assert {n: v.data_ptr() for n, v in cache.views().items()} == addrs
        for n, v in views.items():  # the kept views read the new, zeroed pages
            assert not v[ids].any(), n
        # A step while released copies nothing: its load fails and is recomputed.
        assert matched(e, req) == (len(ids) * BS, False)
        e.sched.update_state_after_alloc(req, blocks_of(e, ids), len(ids) * BS)
        assert e.step().invalid_block_ids == set(ids)
        for v in views.values():
            assert not v[ids].any()
        e.worker.restore_kv_caches()

        req2 = e.request("r2", blocks=len(ids))  # the same tokens: the same keys
        assert matched(e, req2) == (len(ids) * BS, False)
        e.sched.update_state_after_alloc(req2, blocks_of(e, ids), len(ids) * BS)
        out = e.step()
        assert not out.invalid_block_ids
        torch.cuda.synchronize()
        for n, v in views.items():
            assert torch.equal(v[ids], want[n]), f"{mode}: {n} differs after the restore"
        print(f"{mode}: {len(ids)} blocks x {LAYERS} layers restored exactly after a release")
    finally:
        e.close()
        cache.buf.free()
        if server is not None:
            server.stop()
