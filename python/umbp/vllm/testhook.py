"""A test hook that corrupts restores on purpose, to show that a wrong restore is caught.

With ``UMBP_TEST_CORRUPT_RESTORES=N`` in a worker's environment, the first ``N`` loads that
finish "done" each get one byte of their first block changed in the engine's KV cache, after
the copy: the high byte of the middle element of the block's first layer (in a float, an
exponent bit), as a faulty copy would leave it. The demo's ``--inject-corruption`` and the tests
use it to show that a restore which is not what vLLM's own prefix cache holds fails their
verdict. Never set it in production: the worker logs a warning for every block it corrupts.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

from umbp.kv_layout import block_dim_of

logger = logging.getLogger("umbp.vllm")

ENV = "UMBP_TEST_CORRUPT_RESTORES"


class RestoreCorrupter:
    """Corrupts the first block of each of the first ``budget`` finished loads."""

    def __init__(self, budget: int) -> None:
        self.budget = budget

    @classmethod
    def from_env(cls) -> RestoreCorrupter | None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return None
        try:
            n = int(raw)
        except ValueError:
            logger.warning("umbp: %s=%r is not a number of loads; ignored", ENV, raw)
            return None
        if n <= 0:
            return None
        logger.warning("umbp: %s=%d: the next %d restores are corrupted on purpose", ENV, n, n)
        return cls(n)

    def after_load(
        self,
        kv_caches: dict[str, Any],
        kv_cache_config: Any,
        group: int,
        ids: list[int],
        statuses: list[str],
    ) -> None:
        """Called for a load that finished: corrupts its first block if it was restored."""
        if self.budget <= 0 or not ids or not statuses or statuses[0] != "done":
            return
        names = kv_cache_config.kv_cache_groups[group].layer_names
        name = names[0]
        t = kv_caches[name]
        num_blocks = kv_cache_config.num_blocks
        dim = block_dim_of(name, tuple(t.shape), num_blocks)
        rows = t.shape[dim] // num_blocks
        block = t.narrow(dim, ids[0] * rows, rows)
        middle = tuple(s // 2 for s in block.shape)
        element = block[middle]
        if t.device.type == "cpu":
            high = element.data_ptr() + element.element_size() - 1
            byte = ctypes.c_uint8.from_address(high)
            byte.value ^= 0x40
        else:  # a CUDA cache: the element's value changed through torch, on its device
            element.fill_(-(float(element.item()) * 1e4 + 1e3))
        self.budget -= 1
        logger.warning(
            "umbp: %s: corrupted block %d of layer %s after its restore (%d more)",
            ENV,
            ids[0],
            name,
            self.budget,
        )
