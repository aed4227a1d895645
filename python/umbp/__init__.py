"""UMBP: a host-DRAM KV-cache offload store.

Importing this package creates nothing: no threads, no pools, no runtime. A store maps and
prefaults its memory and starts its workers when it is constructed.
"""

from umbp._native import (
    EmbeddedStore,
    Job,
    KeyBuilder,
    Keys,
    LookupClient,
    LookupServer,
    __version__,
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
    StoreClosedError,
    TransferError,
    TransferTimeout,
    UmbpError,
)

#: Per-key statuses a finished job reports.
STATUSES = ("done", "already_present", "missing", "pool_full", "cancelled", "failed")

__all__ = [
    "EmbeddedStore",
    "Job",
    "KeyBuilder",
    "Keys",
    "LookupClient",
    "LookupServer",
    "LookupServiceError",
    "STATUSES",
    "socket_path",
    "memory_available",
    "ConfigError",
    "CudaError",
    "PoolError",
    "PoolFullError",
    "RegistrationError",
    "StoreClosedError",
    "TransferError",
    "TransferTimeout",
    "UmbpError",
    "__version__",
]
