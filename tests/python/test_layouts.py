"""Every KV cache layout vLLM can hand the connector is stored and restored byte for byte
(the layout matrix of tests/kv_matrix.py, on CPU), and a view that cannot be planned exactly
is refused by name."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kv_matrix  # noqa: E402

import umbp  # noqa: E402
from umbp.kv_layout import describe_tensor, register_tensor_layout  # noqa: E402

DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
CASES = [
    (form, heads, bs, dtype)
    for form in kv_matrix.FORMS
    for heads in ((1,) if form.startswith("MLA") else (1, 2, 8))
    for bs in (16, 64)
    for dtype in DTYPES
]


def cpu_store(cache: kv_matrix.Cache) -> umbp.EmbeddedStore:
    s = umbp.EmbeddedStore(32 << 20, num_workers=2, prefault=False)
    s.register_memory(cache.raw.data_ptr(), cache.raw.numel())
    return s


@pytest.mark.parametrize(
    "form,heads,block_size,dtype",
    CASES,
    ids=[f"{c[0]}-h{c[1]}-bs{c[2]}-{str(c[3]).split('.')[-1]}" for c in CASES],
)
def test_layout_round_trip_is_byte_exact(form, heads, block_size, dtype):
    cache = kv_matrix.Cache(
        form,
        device="cpu",
        layers=3,
        blocks=40,
        heads=heads,
        block_size=block_size,
        head_size=32,
        dtype=dtype,
    )
    store = cpu_store(cache)
    try:
        summary = kv_matrix.round_trip(store, cache)
    finally:
        store.close()
    assert summary["object_bytes"] == 3 * cache.page
    # Blocks are one run where the layout keeps them together, one per head where heads sit
    # outside the block dimension.
    expect = {
        "LBHNC": 3,
        "LBNHC": 3,
        "LHBNC": 3 * heads,
        "BLHNC": 1,
        "BLNHC": 1,
        "BHLNC": 1,  # B outermost: a block of all layers is one run
        "KV2": 6,
        "MLA": 3,
        "MLA3": 3,
        "SPLIT": 3,
    }[form]
    assert summary["ranges_per_block"] == expect


def test_mirror_matches_vllms_own_views():
    """tests/kv_matrix.py builds caches as vLLM's create_kv_cache_views does (checked here
    against vLLM itself, so the GPU tests, which cannot import vLLM, test the same shapes)."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layers, blocks, bs, heads, head = 3, 10, 16, 2, 32
    for name, order in kv_matrix.LAYOUTS.items():
        for mla in (False, True):
            if mla:
                spec = kvi.MLAAttentionSpec(
                    block_size=bs, num_kv_heads=1, head_size=head, dtype=torch.bfloat16
                )
                form_heads = 1
            else:
                spec = kvi.FullAttentionSpec(
                    block_size=bs, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
                )
                form_heads = heads
            page = spec.page_size_bytes
            strides = kv_matrix.layout_byte_strides(
                (layers, blocks, form_heads, bs, page // (form_heads * bs)), order
            )
            tensor = kvi.KVCacheTensor(
                size=layers * blocks * page,
                layers=[f"l{i}" for i in range(layers)],
                layer_stride=strides[0],
                block_stride=strides[1],
            )
            raw = torch.empty(tensor.size, dtype=torch.int8)
            theirs = kvi.create_kv_cache_views(raw, spec, blocks, KVCacheLayout[name], tensor)
            content = page // (form_heads * bs)
            ours = kv_matrix.vllm_views(raw, layers, blocks, form_heads, bs, content, order)
            for t, o in zip(theirs, ours):
                o = o.view(torch.bfloat16)
                assert t.data_ptr() == o.data_ptr(), name
                assert tuple(t.shape) == tuple(o.shape), name
                assert t.stride() == o.stride(), name


def test_overlapping_views_are_refused_naming_tensor_and_layout():
    base = torch.zeros(41 * 2 * 16 * 64, dtype=torch.bfloat16)
    # Heads broadcast over the same bytes (stride 0): storing would copy one head twice.
    t = torch.as_strided(base, (40, 2, 16, 64), (16 * 64, 0, 64, 1))
    s = umbp.EmbeddedStore(8 << 20, num_workers=1, prefault=False)
    try:
        s.register_memory(base.data_ptr(), base.numel() * 2)
        with pytest.raises(umbp.ConfigError) as e:
            register_tensor_layout(
                s, [[describe_tensor("model.layers.7.attn", t, 40)]], [40], layout_name="LHBNC"
            )
        assert "model.layers.7.attn" in str(e.value)
        assert "LHBNC" in str(e.value)
        assert "overlap" in str(e.value)
        # Two layers registered over the same bytes.
        u = base[: 40 * 2 * 16 * 64].view(40, 2, 16, 64)
        v = torch.as_strided(base, (40, 2, 16, 64), (2 * 16 * 64, 16 * 64, 64, 1), 32)
        with pytest.raises(umbp.ConfigError, match="share bytes"):
            register_tensor_layout(
                s, [[describe_tensor("a", u, 40), describe_tensor("b", v, 40)]], [40]
            )
        # A tensor whose size does not match its spec's page.
        with pytest.raises(umbp.ConfigError, match="spec says 999"):
            register_tensor_layout(s, [[describe_tensor("c", u, 40, 999)]], [40])
        # No dimension holds the blocks.
        with pytest.raises(umbp.ConfigError, match="no dimension holds"):
            describe_tensor("d", u, 41)
    finally:
        s.close()
