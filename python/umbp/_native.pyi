"""Type stubs of the Rust extension module."""

import os
import pathlib
from collections.abc import Sequence
from typing import Any, Literal

TransferStatus = Literal[
    "pending",
    "done",
    "already_present",
    "missing",
    "pool_full",
    "cancelled",
    "timed_out",
    "failed",
]
Status = TransferStatus

__version__: str

# The exception classes (re-exported by umbp.errors, whose name they carry).
class UmbpError(Exception):
    """Base class of every UMBP error."""

    kind: str
    """What kind of failure (see `umbp.errors`), the same in both modes for the same fault."""

class ConfigError(UmbpError, ValueError):
    """An option, layout, key or argument is invalid."""

class PoolError(UmbpError):
    """The pool's memory could not be set up."""

class PoolFullError(UmbpError):
    """The pool has no room even after eviction; retry later."""

class RegistrationError(UmbpError):
    """A memory registration is malformed, unknown, overlapping or still in use."""

class TransferError(UmbpError):
    """A transfer failed."""

class TransferTimeout(UmbpError, TimeoutError):
    """A wait ran past its deadline; the transfer is still running."""

class StoreClosedError(UmbpError):
    """The store was closed."""

class LookupServiceError(UmbpError):
    """A lookup service could not start, or its workers could not be reached."""

class CudaError(UmbpError):
    """CUDA is not available here (no NVIDIA driver), or a CUDA call failed."""

class ServerUnavailable(UmbpError):
    """The standalone server cannot be reached, went away or restarted, or did not answer in
    time; a later call attaches again by itself."""

class Keys:
    """An immutable batch of 64-byte block keys."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: slice) -> Keys: ...
    def to_bytes(self) -> bytes: ...
    @staticmethod
    def from_bytes(data: bytes) -> Keys: ...

class KeyBuilder:
    """Builds keys for one namespace and one worker's TP/PCP/DCP/PP ranks."""

    def __init__(
        self, namespace: str, *, tp: int = 0, pcp: int = 0, dcp: int = 0, pp: int = 0
    ) -> None: ...
    @property
    def namespace(self) -> str: ...
    def keys(self, group: int, hashes: Sequence[bytes]) -> Keys: ...
    def keys_packed(self, group: int, packed: bytes, hash_len: int) -> Keys: ...
    def key_strings(self, keys: Keys) -> list[str]: ...

class Transfer:
    """A store or load in flight, in either mode (`EmbeddedStore` and `StandaloneClient`
    answer with this class; `Job` is another name of it); dropping it does not cancel it.

    A standalone transfer that failed as a whole (the server could not take it, or went away
    before answering) answers every key "failed" (kind "server"), and `failure()` says why.
    Only a wait that runs out on a pending transfer raises."""

    @property
    def done(self) -> bool: ...
    def poll(self) -> list[TransferStatus] | None: ...
    def wait(self, timeout_ms: int | None = None) -> list[TransferStatus]:
        """Raises `TransferTimeout` when the transfer has not finished within `timeout_ms`
        (default: the store's or client's `timeout_ms`); its blocks may still be written."""
        ...
    def cancel(self) -> None:
        """Stops the keys not started (standalone: asks the server; raises when it cannot be
        asked)."""
        ...
    def errors(self) -> list[tuple[int, str]]: ...
    def failures(self) -> list[tuple[int, str, str]]:
        """(key index, kind, message) of each failed key; kind is "invalid_range",
        "size_mismatch", "pool", "device", "device_lost" (the device is unusable until the
        process restarts), "unsupported", "server" (standalone: the transfer failed as a
        whole) or "corrupt" (the stored object failed its checksum: removed, nothing copied)."""
        ...
    def failure(self) -> tuple[str, str] | None:
        """Why a standalone transfer failed as a whole, `(kind, message)` with the kind of
        `UmbpError.kind`; None otherwise (always None in embedded mode)."""
        ...
    @property
    def elapsed_s(self) -> float | None:
        """Seconds from submission to the transfer's end, once finished (standalone: through
        the completion page to the server's job end, else to the reply; None for a transfer
        that failed as a whole)."""
        ...
    @property
    def object_bytes(self) -> int:
        """Bytes of one key's object."""
        ...
    def __len__(self) -> int: ...

Job = Transfer

class EmbeddedStore:
    """A private host-DRAM pool with its copy engine."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        high_watermark: float = ...,
        low_watermark: float = ...,
        use_hugepages: bool = ...,
        hugepage_size: str = ...,
        numa_node: int | None = ...,
        prefault: bool = ...,
        prefault_threads: int = ...,
        memfd: bool = ...,
        segment_bytes: int = ...,
        eviction_policy: Literal["s3fifo", "lru"] = ...,
        store_admission: Literal["all", "on_reuse"] = ...,
        integrity: Literal["off", "sample", "all"] = ...,
        integrity_sample_every: int = ...,
        num_workers: int = ...,
        timeout_ms: int = ...,
        cuda_copy_method: Literal["auto", "dma", "staged"] = ...,
        cuda_staging_bytes: int = ...,
        cuda_max_ctas: int = ...,
        cuda_pin_chunk_bytes: int = ...,
        cuda_batch_blocks: int = ...,
        remote_url: str | None = ...,  # redis://host:port or redis+cluster://h:p,h:p
        remote_ttl_s: int = ...,
        remote_write: Literal["eager", "on_reuse"] = ...,
        remote_timeout_ms: int = ...,
        remote_write_backlog: int = ...,
        remote_write_mb_per_s: int = ...,
        disk_dir: str | os.PathLike[str] | None = ...,
        disk_capacity_bytes: int = ...,
        disk_write_mb_per_s: int = ...,
        disk_segment_bytes: int = ...,
        disk_write: Literal["on_evict", "eager"] = ...,
        disk_close_write_s: int = ...,
        lookup_lease_ms: int = ...,
    ) -> None:
        """An argument left out takes the store's default, the one of the connector option of
        the same meaning (docs/configuration.md); the defaults live in the Rust schema only."""
        ...
    @staticmethod
    def for_connector(
        options_json: str,
        kv_role: str | None = None,
        *,
        capacity_bytes: int,
        disk_subdir: str,
        remote_read_only: bool = False,
    ) -> EmbeddedStore:
        """One connector worker's store, from `kv_connector_extra_config` as JSON (validated and
        turned into the store's settings in Rust at once), its capacity share, its directory
        under `disk_dir`, and whether it writes nothing to the remote tier."""
    def disk_stats(self) -> dict[str, int] | None:
        """The disk tier's counters (None without `disk_dir`)."""
    def flush_disk(self, timeout_ms: int = 10000) -> bool:
        """Waits until every object queued for disk so far was written (or dropped)."""
    def remote_stats(self) -> dict[str, int | bool] | None:
        """The remote tier's counters (None without `remote_url`)."""
    def flush_remote(self, timeout_ms: int = 10000) -> bool:
        """Waits until every object stored so far went to the remote tier (or was dropped)."""
    def register_memory(self, addr: int, length: int) -> int:
        """The memory must stay alive until deregistered or the store is closed."""
    def deregister_memory(self, region_id: int) -> None: ...
    def register_layout(self, groups: Sequence[Sequence[tuple[int, int, int, int]]]) -> int:
        """One list per cache group of (base_addr, num_blocks, block_stride, block_bytes)."""
    def register_tensor_layout(
        self,
        groups: Sequence[
            Sequence[tuple[str, int, int, Sequence[int], Sequence[int], int, int | None]]
        ],
        num_blocks: Sequence[int],
    ) -> int:
        """One list per cache group of (name, data_ptr, element_size, shape, strides,
        block_dim, expected_block_bytes); runs are found from the strides."""
    def layout_summary(self, layout_id: int) -> list[dict[str, int]]: ...
    def object_bytes(self, layout_id: int, group: int) -> int: ...
    def exists(self, keys: Keys) -> list[bool]: ...
    def prefix_hits(self, keys: Keys) -> int: ...
    def store(
        self,
        layout_id: int,
        group: int,
        block_ids: Sequence[int],
        keys: Keys,
        *,
        stream: int | None = None,
        admit_now: bool = False,
    ) -> Transfer:
        """`stream` (CUDA layouts): `torch.cuda.current_stream().cuda_stream`; the copies run
        after the work already queued on it. `admit_now`: kept on each key's first sighting
        even under `store_admission="on_reuse"` (counted in `admissions_forced`)."""
    def load(
        self,
        layout_id: int,
        group: int,
        block_ids: Sequence[int],
        keys: Keys,
        *,
        stream: int | None = None,
    ) -> Transfer:
        """`stream` (CUDA layouts): the copies wait for the work already queued on it."""
    def pin(self, keys: Keys, ttl_s: float) -> list[str]:
        """Pins `keys` in the pool for `ttl_s` seconds (never evicted while pinned; pinning
        again renews): per key "pinned", "renewed", "missing" or "refused" (past the bytes a
        namespace, a quarter of the pool, or the pool, half of it, may pin)."""
    def unpin(self, keys: Keys) -> int:
        """Releases the pins of `keys`; how many were pinned."""
    def pin_stats(self) -> dict[str, int]:
        """pinned, pinned_bytes, granted, renewed, released, expired, refused, ended."""
    def evict(self, keys: Keys) -> int:
        """Drops `keys` from this store, the pool and the disk tier (a remote tier keeps its
        copies); how many were in the pool."""
    def clear(self) -> int: ...
    def stats(self) -> dict[str, object]: ...
    def _debug_corrupt(
        self, keys: Keys, offset: int = 0, mask: int = 1, *, tier: Literal["pool", "disk"] = "pool"
    ) -> int:
        """For tests only: flips the bits of `mask` in byte `offset` of each key's object in
        the pool or in the disk tier's segment file; how many were there."""
    def close(self) -> None: ...
    def __enter__(self) -> EmbeddedStore: ...
    def __exit__(self, *args: object) -> None: ...
    def register_cuda_memory(self, addr: int, length: int, device: int) -> int:
        """CUDA device memory (a tensor's data_ptr() and byte size) of device `device`.
        Raises CudaError where there is no CUDA."""
    def cuda_stats(self) -> dict[str, object] | None: ...
    def wait_pool_registered(self, timeout_ms: int) -> bool: ...

class StandaloneClient:
    """A client of the node's umbp_standalone_server (standalone mode).

    Connects and attaches on construction (its runtime starts then, never at import); after a
    server restart the next call raises `ServerUnavailable` and a later one attaches again,
    registering the client's memory and layouts again (their ids stay valid). Unusable in a
    forked child (`StoreClosedError`)."""

    def __init__(
        self,
        endpoint: str,
        *,
        startup_timeout_ms: int = ...,
        lookup_timeout_ms: int = ...,
        timeout_ms: int = ...,
        client_name: str | None = None,
    ) -> None:
        """`endpoint`: `/abs/path.sock` or `unix:///abs/path.sock` (`ConfigError` otherwise);
        no server answering within `startup_timeout_ms` raises `ServerUnavailable`. A timeout
        left out is the connector option's default of the same name."""
        ...
    @property
    def endpoint(self) -> str: ...
    def register_memory(self, addr: int, length: int) -> int:
        """Host memory, shared with the server by moving its pages in place onto a sealed
        memfd (pointers stay valid). Private anonymous memory, page-aligned at both ends (e.g.
        numpy over mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)) or exactly one allocation of 32
        MiB or more (torch CPU tensors, numpy arrays): smaller heap buffers share pages with
        other objects and are refused. Not written by another thread during the call, not
        pinned for a device; it must stay allocated until deregistered or the client is
        closed."""
    def register_cuda_memory(self, addr: int, length: int) -> int:
        """CUDA device memory (a tensor's data_ptr() and byte size), shared by IPC; it must
        stay allocated until deregistered or the client is closed."""
    def deregister_memory(self, region_id: int) -> None: ...
    def register_layout(self, groups: Sequence[Sequence[tuple[int, int, int, int]]]) -> int:
        """One list per cache group of (base_addr, num_blocks, block_stride, block_bytes)."""
    def register_tensor_layout(
        self,
        groups: Sequence[
            Sequence[tuple[str, int, int, Sequence[int], Sequence[int], int, int | None]]
        ],
        num_blocks: Sequence[int],
    ) -> int:
        """As EmbeddedStore.register_tensor_layout."""
    def object_bytes(self, layout_id: int, group: int) -> int: ...
    def exists(self, keys: Keys) -> list[bool]: ...
    def prefix_hits(self, keys: Keys) -> int: ...
    def exists_across_ranks(
        self,
        namespace: str,
        ranks: Sequence[tuple[int, int, int, int]],
        group: int,
        hashes: bytes,
        hash_bytes: int,
        prefix_only: bool = False,
    ) -> tuple[list[bool], int]:
        """`ranks`: (tp, pcp, dcp, pp) each; `hashes` packed, `hash_bytes` each. Returns the
        per-block answers (empty with `prefix_only`) and the leading blocks all ranks hold."""
    def pin(self, keys: Keys, ttl_s: float) -> list[str]:
        """Pins `keys` in the server's pool for `ttl_s` seconds (at most 24 h; pinning again
        renews): per key "pinned", "renewed", "missing" or "refused". Pins outlive this client."""
    def unpin(self, keys: Keys) -> int:
        """Releases the pins of `keys` in the server's pool; how many were pinned."""
    def holds_across_ranks(
        self,
        namespace: str,
        ranks: Sequence[tuple[int, int, int, int]],
        group: int,
        hashes: bytes,
        hash_bytes: int,
    ) -> list[bool]:
        """Per block, whether every rank has it in the server's DRAM pool now: no lease, no
        lower tier, no hit or miss counted (for watching evictions, never before a load)."""
    def store(
        self,
        layout_id: int,
        group: int,
        block_ids: Sequence[int],
        keys: Keys,
        *,
        admit_now: bool = False,
    ) -> Transfer:
        """`admit_now`: kept on each key's first sighting even under the server's
        `--store-admission on_reuse`."""
    def load(
        self, layout_id: int, group: int, block_ids: Sequence[int], keys: Keys
    ) -> Transfer: ...
    def clear(self, namespace: str | None = None) -> int:
        """Removes every object of the server's pool (every client's), or one namespace's."""
    def stats(self) -> dict[str, int | str]: ...
    def ping(self) -> str:
        """The server's boot id."""
    @property
    def session_id(self) -> int | None: ...
    @property
    def boot_id(self) -> str | None: ...
    @property
    def attach_count(self) -> int: ...
    def close(self) -> None: ...
    def __enter__(self) -> StandaloneClient: ...
    def __exit__(self, *args: object) -> None: ...

class LookupServer:
    """Serves one worker's lookups and clears on a Unix socket (embedded mode)."""

    def __init__(
        self,
        store: EmbeddedStore,
        path: str | os.PathLike[str],
        namespace: str,
        *,
        tp: int = 0,
        pcp: int = 0,
        dcp: int = 0,
        pp: int = 0,
        describe: str = "",
    ) -> None: ...
    @property
    def path(self) -> pathlib.Path: ...
    def shutdown(self) -> None: ...

class LookupClient:
    """Asks every worker of an engine at once; a failure or late answer is a miss."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]], timeout_ms: int = ...) -> None:
        """`timeout_ms` left out is the connector's `lookup_timeout_ms` default."""
        ...
    def prefix_hits(self, group: int, packed_hashes: bytes, hash_len: int) -> int: ...
    def exists_all(self, group: int, packed_hashes: bytes, hash_len: int) -> list[bool]: ...
    def holds_all(self, group: int, packed_hashes: bytes, hash_len: int) -> list[bool] | None:
        """What every worker's pool holds now, leasing nothing (for watching evictions);
        None when a worker did not answer."""
    def clear(self, timeout_ms: int = 10000) -> int: ...
    def wait_ready(self, timeout_ms: int) -> list[str]: ...
    @property
    def paths(self) -> list[pathlib.Path]: ...

def socket_path(
    dir: str | os.PathLike[str], tag: str, dp_rank: int, worker: int
) -> pathlib.Path: ...
def memory_available() -> tuple[int, str] | None: ...
def counter_fields() -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """Every group of counters a stats dict may hold ("disk", "remote"): its fields
    `(name, kind, series, help)` in order, kind "counter", "gauge" or "flag" (a bool), series
    the standalone server's Prometheus name of it."""
    ...

def connector_options(extra_json: str, kv_role: str | None = None) -> dict[str, Any]:
    """Validates `kv_connector_extra_config` (a JSON object) and `kv_role` against the options
    schema; every option, defaulted. Raises `ConfigError` naming a bad option."""
    ...

def connector_option_schema() -> list[dict[str, Any]]:
    """Every connector option: name, scope, type, default, nullable, min, max, unit, choices,
    doc, default_doc, rejected."""
    ...
