"""Exceptions raised by UMBP. Every error a user can cause says what to change.

The classes are created by the native extension, which raises them directly, and re-exported
here (their ``__module__`` is ``umbp.errors``)::

    UmbpError(Exception)                  base class of every UMBP error
    ConfigError(UmbpError, ValueError)    an option, layout, key or argument is invalid
    PoolError(UmbpError)                  the pool's memory could not be set up
    PoolFullError(UmbpError)              no room even after eviction; retry later
    RegistrationError(UmbpError)          a memory registration is malformed, unknown,
                                          overlapping or still in use
    TransferError(UmbpError)              a transfer failed
    TransferTimeout(UmbpError, TimeoutError)  a wait ran past its deadline (still running)
    StoreClosedError(UmbpError)           the store was closed
    LookupServiceError(UmbpError)         a lookup service could not start, or its workers
                                          could not be reached
    CudaError(UmbpError)                  no CUDA here (no NVIDIA driver), or a CUDA call failed
    ServerUnavailable(UmbpError)          the standalone server cannot be reached, went away or
                                          restarted, or did not answer in time (a later call
                                          attaches again by itself)

Every exception has a ``kind``, the same in embedded and standalone mode for the same fault
(the server sends it with each refusal): ``invalid_argument``, ``not_found``, ``pool_full``,
``registration``, ``session_lost``, ``unavailable``, ``closed``, ``device_lost``, ``device``,
``timeout``, ``transfer_failed``, ``denied``, ``resource`` or ``internal``. The class follows
from the kind (``session_lost`` and ``unavailable`` are ``ServerUnavailable``, ...); decide on
``e.kind`` rather than on the message's words. Per-key failures (``Transfer.failures()``, in
either mode) name theirs with one vocabulary too: ``invalid_range``, ``size_mismatch``,
``pool``, ``device``, ``device_lost``, ``unsupported``, ``server`` (standalone: the
transfer failed as a whole; ``Transfer.failure()`` gives its error's kind and message) and
``corrupt`` (the stored object failed its checksum: removed, nothing copied; `integrity`).
"""

from umbp._native import (
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

__all__ = [
    "UmbpError",
    "ConfigError",
    "PoolError",
    "PoolFullError",
    "RegistrationError",
    "TransferError",
    "TransferTimeout",
    "StoreClosedError",
    "LookupServiceError",
    "CudaError",
    "ServerUnavailable",
]
