"""What the scheduler side and the worker side of `UMBPStoreConnector` send each other.

vLLM carries these between its processes every step: `UMBPConnectorMetadata` from the scheduler
to every worker (the step's loads and stores), `UMBPWorkerMetadata` back (the stores each worker
finished). Block hashes travel packed, back to back, so a transfer of thousands of blocks is a
few objects to pickle, not thousands.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class Transfer:
    """Blocks of one cache group to load or store, with the hashes that key them."""

    group: int
    block_ids: list[int]
    hashes: bytes  # packed, `hash_len` bytes each
    hash_len: int
    req_id: str = ""
    store_id: int = -1
    load_async: bool = False
    # Stores: kept on each key's first sighting even under an `on_reuse` store admission (the
    # request's priority or its `kv_transfer_params` asked for it).
    admit_now: bool = False


@dataclass
class UMBPConnectorMetadata(KVConnectorMetadata):
    """Scheduler → workers: this step's loads and stores."""

    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    # Loads that could not be planned: (request id, whether async, blocks vLLM allocated).
    failed_loads: list[tuple[str, bool, list[int]]] = field(default_factory=list)

    def with_loads_failed(self) -> UMBPConnectorMetadata:
        """This step with every load turned into a failed one (nothing to copy into)."""
        failed = [(t.req_id, t.load_async, list(t.block_ids)) for t in self.loads]
        return UMBPConnectorMetadata(
            loads=[], stores=self.stores, failed_loads=self.failed_loads + failed
        )


@dataclass
class UMBPWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers → scheduler: stores that finished, counted per worker."""

    finished_stores: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, UMBPWorkerMetadata)
        merged = dict(self.finished_stores)
        for k, v in other.finished_stores.items():
            merged[k] = merged.get(k, 0) + v
        return UMBPWorkerMetadata(finished_stores=merged)


def pack_hashes(hashes: list[bytes]) -> tuple[bytes, int]:
    """`hashes` back to back, and the length of one (32 for none)."""
    if not hashes:
        return b"", 32
    hash_len = len(hashes[0])
    packed = b"".join(hashes)
    if len(packed) != hash_len * len(hashes):
        raise ValueError("block hashes of different lengths in one request")
    return packed, hash_len
