"""UMBP: a host-DRAM KV-cache offload store.

Importing this package creates nothing: no threads, no pools, no runtime. A store maps and
prefaults its memory and starts its workers when it is constructed; a `StandaloneClient`
starts its runtime and connects to the node's `umbp_standalone_server` when it is constructed.
"""

from umbp._native import (
    EmbeddedStore,
    Job,
    KeyBuilder,
    Keys,
    LookupClient,
    LookupServer,
    StandaloneClient,
    Transfer,
    __version__,
    counter_fields,
    memory_available,
    socket_path,
)
from umbp.errors import (
    ConfigError,
    CudaError,
    LookupServiceError,
    PoolError,
    PoolFullError,
    RegistrationError,
    ServerUnavailable,
    StoreClosedError,
    TransferError,
    TransferTimeout,
    UmbpError,
)

#: Per-key statuses a finished embedded transfer reports ("skipped": a store the pool's
#: `store_admission` kept no copy of; the vLLM connector also answers it for blocks another rank
#: of a replica group stores, MLA's latents stored once).
STATUSES = ("done", "already_present", "missing", "pool_full", "cancelled", "failed", "skipped")

#: Per-key statuses a finished transfer of either mode may report ("timed_out", standalone
#: only: not done within the transfer's deadline, cancelled by the server).
TRANSFER_STATUSES = (
    "done",
    "already_present",
    "missing",
    "pool_full",
    "cancelled",
    "timed_out",
    "failed",
    "skipped",
)

__all__ = [
    "EmbeddedStore",
    "Job",
    "KeyBuilder",
    "Keys",
    "LookupClient",
    "LookupServer",
    "LookupServiceError",
    "STATUSES",
    "StandaloneClient",
    "Transfer",
    "TRANSFER_STATUSES",
    "socket_path",
    "counter_fields",
    "memory_available",
    "ConfigError",
    "CudaError",
    "PoolError",
    "PoolFullError",
    "RegistrationError",
    "ServerUnavailable",
    "StoreClosedError",
    "TransferError",
    "TransferTimeout",
    "UmbpError",
    "__version__",
]
