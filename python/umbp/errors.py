"""Exceptions raised by UMBP. Every error a user can cause says what to change."""


class UmbpError(Exception):
    """Base class of every UMBP error."""


class ConfigError(UmbpError, ValueError):
    """An option, layout, key or argument is invalid."""


class PoolError(UmbpError):
    """The pool's memory could not be set up."""


class PoolFullError(UmbpError):
    """The pool has no room even after eviction (what is left is pinned or being written);
    retry later."""


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
]
