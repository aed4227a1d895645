"""The KV cache layout matrix: every shape vLLM can hand a connector, built the way vLLM builds
it, stored, overwritten and restored into other blocks, compared byte for byte.

Shared by the CPU tests (tests/python/test_layouts.py) and the GPU tests
(tests/gpu/test_gpu_layouts.py); needs torch, not vLLM. Where each shape comes from:

* ``LBHNC`` ... ``BHLNC``: vLLM 0.32/0.33 ``allocate_kv_cache`` →
  ``create_kv_cache_views`` (``vllm/v1/kv_cache_interface.py``): one int8 backing allocation
  viewed through ``torch.as_strided`` with the byte strides of ``compute_layout_strides`` for
  the logical ``[L, B, H, N, C]`` shape (C = (head_size + head_size_v) × dtype bytes), one
  ``[B, H, N, C]`` view per layer, then ``.view(dtype)``. ``vllm_views`` below mirrors that
  (the CPU tests check the mirror against vLLM's own function where vLLM is installed).
* ``MLA``: the same function with an ``MLAAttentionSpec`` (one head, no separate V:
  ``[B, 1, N, C]``), and ``MLA3``, the ``[B, N, C]`` per-layer form of earlier vLLM MLA
  backends (``get_kv_cache_shape`` → ``(num_blocks, block_size, head_size)``).
* ``KV2``: the ``[2, B, N, H, D]`` per-layer form (K/V split in front of the blocks) of earlier
  vLLM FlashAttention backends' ``get_kv_cache_shape``, reshaped from one allocation per layer
  group as ``_reshape_kv_cache_tensors`` did.
* ``SPLIT``: a manager block split into ``r`` kernel blocks (``create_kv_cache_views`` with a
  ``kernel_block_size``: ``[r × B, H, N, C]``), as with FlashInfer and ``--block-size 128``.

``round_trip_replicated`` is the MLA case of tensor parallelism: every TP rank holds the same
latent cache, the first rank stores each block once under keys without the TP rank, and every
rank restores it from that one object (tests/python/test_mla_replicas.py, with a real server).
"""

from __future__ import annotations

import math
import mmap

import torch

import umbp
from umbp.kv_layout import describe_tensor, register_tensor_layout

#: vLLM's KVCacheLayout: physical order of the logical axes [L, B, H, N, C].
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
FORMS = (*LAYOUTS, "KV2", "MLA", "MLA3", "SPLIT")


def layout_byte_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    """Byte strides in logical axis order for a dense tensor of ``shape`` (bytes in the last
    axis) stored in physical ``order``: ``compute_layout_strides`` without padding."""
    strides = [0] * len(shape)
    cur = 1
    for dim in reversed(order):
        strides[dim] = cur
        cur *= shape[dim]
    return tuple(strides)


def vllm_views(
    raw: torch.Tensor, layers: int, blocks: int, heads: int, states: int, content: int, order
) -> list[torch.Tensor]:
    """Per-layer int8 ``[B, H, N, C]`` views of ``raw`` (``create_kv_cache_views``)."""
    shape = (layers, blocks, heads, states, content)
    view = torch.as_strided(raw, size=shape, stride=layout_byte_strides(shape, order))
    return [view[layer] for layer in range(layers)]


class Cache:
    """One KV cache group of ``form``: a backing allocation and the per-layer tensors vLLM
    would register (``layers``). ``byte_views(buf)`` gives, for any buffer shaped like the
    allocation, per-layer byte views with (manager) blocks in axis 0; together they cover every
    byte of the allocation exactly once."""

    def __init__(
        self,
        form: str,
        *,
        device: str,
        layers: int,
        blocks: int,
        heads: int,
        block_size: int,
        head_size: int,
        dtype: torch.dtype,
        split: int = 4,
        mapped: bool = False,
    ) -> None:
        es = torch.empty((), dtype=dtype).element_size()
        self.form, self.blocks, self.device, self.es = form, blocks, device, es
        self.nlayers = layers
        if form in LAYOUTS or form in ("MLA", "SPLIT"):
            order = LAYOUTS.get(form, LAYOUTS["LBNHC"])
            if form == "MLA":
                heads, content = 1, head_size * es
            else:
                content = 2 * head_size * es
            rows, states = blocks, block_size
            if form == "SPLIT":
                rows, states = blocks * split, block_size // split
            self._dims = (layers, rows, heads, states, content)
            self._order = order
            self.raw = self._alloc(math.prod(self._dims), mapped)
            self.layers = [v.view(dtype) for v in self._views(self.raw)]
            self.page = heads * states * content * (rows // blocks)
        elif form in ("KV2", "MLA3"):
            if form == "KV2":
                # One allocation [L, 2, B, N, H, D]; layer l's view is [2, B, N, H, D].
                shape = (layers, 2, blocks, block_size, heads, head_size)
            else:
                shape = (layers, blocks, block_size, head_size)
            self._dims = shape
            self.raw = self._alloc(math.prod(shape) * es, mapped)
            typed = self.raw.view(dtype).view(shape)
            self.layers = [typed[layer] for layer in range(layers)]
            self.page = math.prod(shape[1:]) * es // blocks
        else:
            raise ValueError(form)

    def _alloc(self, nbytes: int, mapped: bool) -> torch.Tensor:
        """The backing allocation; ``mapped``: a mapping of its own (CPU), as the standalone
        client needs to share it with a server (a small heap allocation may share pages)."""
        if not mapped:
            return torch.empty(nbytes, dtype=torch.int8, device=self.device)
        self._mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(self._mapping, dtype=torch.int8)

    def _views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        dims = self._dims
        return vllm_views(buf, *dims, self._order)

    def byte_views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Per layer, a byte view of ``buf`` with manager blocks in axis 0."""
        L, B = self.nlayers, self.blocks
        if self.form == "KV2":
            v = buf.view(L, 2, B, -1)
            return [v[layer].transpose(0, 1) for layer in range(L)]
        if self.form == "MLA3":
            v = buf.view(L, B, -1)
            return [v[layer] for layer in range(L)]
        views = self._views(buf)
        if self.form == "SPLIT":
            return [v.unflatten(0, (B, -1)) for v in views]
        return views

    def read_blocks(self, ids: list[int]) -> list[torch.Tensor]:
        """Per layer, a copy of the bytes of blocks ``ids``."""
        idx = torch.as_tensor(ids, device=self.device)
        return [v[idx].clone() for v in self.byte_views(self.raw)]

    def fill(self, seed: int) -> None:
        g = torch.Generator(device=self.device).manual_seed(seed)
        self.raw.random_(-128, 128, generator=g)
        if self.device == "cuda":
            torch.cuda.synchronize()

    def describe(self, name_prefix: str = "model.layers") -> list[tuple]:
        return [
            describe_tensor(f"{name_prefix}.{i}.attn", t, self.blocks, self.page)
            for i, t in enumerate(self.layers)
        ]


def round_trip(store: umbp.EmbeddedStore, cache: Cache, seed: int = 1) -> dict[str, int]:
    """Stores random blocks, overwrites the whole cache, restores them into other block ids and
    checks the entire allocation: the restored blocks hold the stored bytes, every other byte
    the overwrite. Returns the layout summary of group 0."""
    n = min(12, cache.blocks // 3)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cache.blocks, generator=gen).tolist()
    src, dst = perm[:n], perm[n : 2 * n]
    cache.fill(seed)
    stored = cache.read_blocks(src)
    lid = register_tensor_layout(store, [cache.describe()], [cache.blocks], layout_name=cache.form)
    keys = umbp.KeyBuilder(f"matrix-{cache.form}-{seed}", tp=0).keys(
        0, [b.to_bytes(8, "little") + bytes(8) for b in src]
    )
    assert store.store(lid, 0, src, keys).wait(60_000) == ["done"] * n
    cache.fill(seed + 1000)
    # Expected: the overwrite, with the stored blocks' bytes in the destination blocks.
    expect = cache.raw.clone()
    idx = torch.as_tensor(dst, device=cache.device)
    for v, s in zip(cache.byte_views(expect), stored):
        v[idx] = s
    assert store.load(lid, 0, dst, keys).wait(60_000) == ["done"] * n
    if cache.device == "cuda":
        torch.cuda.synchronize()
    if not torch.equal(cache.raw, expect):
        diff = (cache.raw != expect).nonzero().flatten()
        raise AssertionError(
            f"{cache.form}: {diff.numel()} of {cache.raw.numel()} bytes differ after the "
            f"restore (first at byte {int(diff[0])})"
        )
    return store.layout_summary(lid)[0]


def round_trip_replicated(
    stores: list, caches: list[Cache], namespace: str, seed: int = 1
) -> list[str]:
    """MLA at TP ``len(caches)``: every rank's cache holds the same bytes; rank 0 stores random
    blocks under keys without the TP rank (``tp=0`` for all), the other ranks store nothing;
    every cache is overwritten (each rank with other bytes) and every rank restores the blocks
    from the one object into other block ids. Checks each rank's entire allocation; returns
    rank 0's store statuses."""
    cache = caches[0]
    n = min(12, cache.blocks // 3)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(cache.blocks, generator=gen).tolist()
    src, dst = perm[:n], perm[n : 2 * n]
    cache.fill(seed)
    for c in caches[1:]:
        c.raw.copy_(cache.raw)
    stored = cache.read_blocks(src)
    keys = umbp.KeyBuilder(namespace, tp=0).keys(
        0, [b.to_bytes(8, "little") + bytes(8) for b in src]
    )
    layouts = [
        register_tensor_layout(st, [c.describe()], [c.blocks], layout_name=c.form)
        for st, c in zip(stores, caches)
    ]
    statuses = stores[0].store(layouts[0], 0, src, keys).wait(60_000)
    for rank, c in enumerate(caches):
        c.fill(seed + 1000 + rank)
    for rank, (st, c, lid) in enumerate(zip(stores, caches, layouts)):
        expect = c.raw.clone()
        idx = torch.as_tensor(dst, device=c.device)
        for v, s in zip(c.byte_views(expect), stored):
            v[idx] = s
        got = st.load(lid, 0, dst, keys).wait(60_000)
        assert got == ["done"] * n, f"rank {rank}: {got}"
        if c.device == "cuda":
            torch.cuda.synchronize()
        if not torch.equal(c.raw, expect):
            diff = (c.raw != expect).nonzero().flatten()
            raise AssertionError(
                f"{c.form} rank {rank}: {diff.numel()} of {c.raw.numel()} bytes differ after "
                f"the restore (first at byte {int(diff[0])})"
            )
    return statuses
