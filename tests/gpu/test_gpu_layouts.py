"""The layout matrix on a real GPU: every KV cache shape vLLM can hand the connector, in CUDA
memory, stored through the GPU copy path with its default method, overwritten, restored into
other block ids and compared byte for byte (the cases of tests/kv_matrix.py; the CPU tests run
the same matrix against host memory and check the shapes against vLLM's own functions)."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kv_matrix  # noqa: E402

import umbp  # noqa: E402

CASES = [
    (form, heads, bs, dtype, method)
    for form in kv_matrix.FORMS
    for heads in ((1,) if form.startswith("MLA") else (1, 2, 8))
    for bs in (16, 64)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn)
    for method in ("auto",)
] + [
    # Scattered runs through each method explicitly.
    (form, 8, 16, torch.bfloat16, method)
    for form in ("LHBNC", "BHLNC", "KV2")
    for method in ("dma", "staged")
]


@pytest.mark.parametrize(
    "form,heads,block_size,dtype,method",
    CASES,
    ids=[f"{c[0]}-h{c[1]}-bs{c[2]}-{str(c[3]).split('.')[-1]}-{c[4]}" for c in CASES],
)
def test_layout_round_trip_on_the_gpu_is_byte_exact(form, heads, block_size, dtype, method):
    cache = kv_matrix.Cache(
        form,
        device="cuda",
        layers=8,
        blocks=96,
        heads=heads,
        block_size=block_size,
        head_size=128,
        dtype=dtype,
    )
    store = umbp.EmbeddedStore(256 << 20, prefault=False, num_workers=2, cuda_copy_method=method)
    try:
        store.register_cuda_memory(
            cache.raw.data_ptr(), cache.raw.numel(), torch.cuda.current_device()
        )
        # A seed that is the same in every run (str hashes are randomised per process).
        summary = kv_matrix.round_trip(store, cache, seed=sum(map(ord, form)))
        assert summary["object_bytes"] == 8 * cache.page
    finally:
        store.close()
