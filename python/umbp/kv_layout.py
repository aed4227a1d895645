"""Registering KV caches from the tensors an engine hands over, whatever their layout.

An engine gives each layer's KV cache as a tensor view into a shared allocation. Which bytes
belong to one block depends on the view's strides: in vLLM's ``LBHNC``/``LBNHC`` layouts a
layer's block is one run, in ``LHBNC`` and ``BHLNC`` it is one run per KV head. The store finds
the runs from each view's shape and strides (in Rust), checks that they cover every byte of a
block exactly once, and refuses what it cannot plan with a ``ConfigError`` naming the tensor.

Nothing here imports torch or vLLM: tensors are read through ``data_ptr()``, ``element_size()``,
``shape`` and ``stride()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from umbp._native import EmbeddedStore
from umbp.errors import ConfigError

#: One layer for ``EmbeddedStore.register_tensor_layout``.
TensorDescription = tuple[str, int, int, tuple[int, ...], tuple[int, ...], int, "int | None"]


def block_dim_of(name: str, shape: Sequence[int], num_blocks: int) -> int:
    """The dimension of a layer's KV cache view that indexes blocks.

    Dimension 0 when its size is a whole multiple of ``num_blocks``: vLLM ≥ 0.32's
    ``[B, H, N, C]`` views (``allocate_kv_cache``), MLA's ``[B, N, C]``, and caches whose
    attention kernel splits a block into ``r`` rows (``r × num_blocks`` rows). Dimension 1 for
    a K/V pair in front of the blocks (``[2, B, N, H, D]``, the per-layer form of earlier vLLM
    backends' ``get_kv_cache_shape``).
    """
    if len(shape) >= 1 and shape[0] >= num_blocks and shape[0] % num_blocks == 0:
        return 0
    if len(shape) >= 2 and shape[0] == 2 and shape[1] % num_blocks == 0 and shape[1] > 0:
        return 1
    raise ConfigError(
        f"KV cache tensor of layer {name} has shape {tuple(shape)}: no dimension holds the "
        f"cache's {num_blocks} blocks (expected them, or a whole multiple of them, in "
        "dimension 0, or in dimension 1 after a K/V pair)"
    )


def describe_tensor(
    name: str,
    tensor: Any,
    num_blocks: int,
    expected_block_bytes: int | None = None,
    block_dim: int | None = None,
) -> TensorDescription:
    """One layer's tensor as ``register_tensor_layout`` takes it."""
    shape = tuple(int(s) for s in tensor.shape)
    if block_dim is None:
        block_dim = block_dim_of(name, shape, num_blocks)
    return (
        name,
        int(tensor.data_ptr()),
        int(tensor.element_size()),
        shape,
        tuple(int(s) for s in tensor.stride()),
        block_dim,
        expected_block_bytes,
    )


def register_tensor_layout(
    store: EmbeddedStore,
    groups: Iterable[Sequence[TensorDescription]],
    num_blocks: Sequence[int],
    layout_name: str | None = None,
) -> int:
    """Registers one layout of several cache groups; returns its id.

    ``layout_name`` (e.g. vLLM's resolved ``kv_cache_layout``) is added to any error, so the
    user sees which layout setting the refused tensor came from.
    """
    groups = [list(g) for g in groups]
    try:
        return store.register_tensor_layout(groups, list(num_blocks))
    except ConfigError as e:
        if layout_name is None:
            raise
        raise ConfigError(
            f"{e} (KV cache layout {layout_name}; try another VLLM_KV_CACHE_LAYOUT, e.g. LBNHC)"
        ) from e


def summary_line(summary: Sequence[dict[str, int]]) -> str:
    """A one-line description of ``EmbeddedStore.layout_summary``, for start-up logs."""
    parts = []
    for g, s in enumerate(summary):
        piece = (
            f"{s['min_piece']} B"
            if s["min_piece"] == s["max_piece"]
            else f"{s['min_piece']}-{s['max_piece']} B"
        )
        parts.append(
            f"group {g}: {s['ranges_per_block']} runs of {piece} per block "
            f"({s['object_bytes']} B objects)"
        )
    return "; ".join(parts)
