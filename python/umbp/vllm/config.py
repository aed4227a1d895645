"""The connector's options (`kv_connector_extra_config`): parsing and validation.

Every option is checked at engine start-up. An unknown option, a wrong type or an
out-of-range value raises `umbp.ConfigError` naming the option and saying what to change.
This module does not import vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from umbp.errors import ConfigError

GIB = 1 << 30

#: Options every mode accepts, with their defaults.
SHARED_DEFAULTS: dict[str, Any] = {
    "load_async": True,
    "lookup_async": False,
    "kv_event_max_objects": 65536,
    "enable_lookup": True,
    "save_decode_cache": False,
    "lazy_offload": False,
    "lazy_offload_max_blocks": None,
    "enable_partial_hash_hits": False,
    "num_workers": 4,
    "timeout_ms": 30000,
    "key_namespace": None,
    "lookup_timeout_ms": 1000,
    "lookup_workers": 2,
}

#: Options of embedded mode.
EMBEDDED_DEFAULTS: dict[str, Any] = {
    "capacity_bytes": None,
    "total_capacity_bytes": None,
    "lookup_instance": "",
    "lookup_dir": "/tmp",
    "dram_high_watermark": 0.9,
    "dram_low_watermark": 0.7,
    "dram_use_hugepages": False,
    "dram_hugepage_size": "2MiB",
    "dram_numa_node": None,
    "dram_prefault": True,
}

#: Options of standalone mode.
STANDALONE_DEFAULTS: dict[str, Any] = {
    "endpoint": None,
    "startup_timeout_ms": 30000,
}

DEFAULT_CAPACITY_BYTES = 64 * GIB
MODES = ("embedded", "standalone")
ROLES = ("kv_both", "kv_producer", "kv_consumer")


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ConfigError(f"option `{name}` must be true or false, got {v!r}")


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"option `{name}` must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConfigError(f"option `{name}` must be {rng}, got {v}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"option `{name}` must be a number, got {v!r}")
    if not 0.0 < float(v) <= 1.0:
        raise ConfigError(f"option `{name}` must be in (0, 1] (a fraction of capacity), got {v}")
    return float(v)


def _str(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ConfigError(f"option `{name}` must be a string, got {v!r}")
    return v


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector options."""

    mode: str = "embedded"
    kv_role: str = "kv_both"
    load_async: bool = True
    lookup_async: bool = False
    kv_event_max_objects: int = 65536
    enable_lookup: bool = True
    save_decode_cache: bool = False
    lazy_offload: bool = False
    lazy_offload_max_blocks: int | None = None
    enable_partial_hash_hits: bool = False
    num_workers: int = 4
    timeout_ms: int = 30000
    key_namespace: str | None = None
    lookup_timeout_ms: int = 1000
    lookup_workers: int = 2
    # embedded
    capacity_bytes: int | None = None
    total_capacity_bytes: int | None = None
    lookup_instance: str = ""
    lookup_dir: str = "/tmp"
    dram_high_watermark: float = 0.9
    dram_low_watermark: float = 0.7
    dram_use_hugepages: bool = False
    dram_hugepage_size: str = "2MiB"
    dram_numa_node: int | None = None
    dram_prefault: bool = True
    # standalone
    endpoint: str | None = None
    startup_timeout_ms: int = 30000
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def stores(self) -> bool:
        """Whether this connector stores blocks (every role but kv_consumer)."""
        return self.kv_role != "kv_consumer"

    @property
    def restores(self) -> bool:
        """Whether this connector restores blocks."""
        return self.kv_role != "kv_producer" and self.enable_lookup

    def worker_capacity(self, workers_per_engine: int) -> int:
        """Pool bytes of one worker (embedded mode)."""
        if self.total_capacity_bytes is not None:
            per = self.total_capacity_bytes // max(1, workers_per_engine)
            if per < (1 << 20):
                raise ConfigError(
                    f"option `total_capacity_bytes` ({self.total_capacity_bytes}) split over "
                    f"{workers_per_engine} workers leaves {per} bytes each, below the 1 MiB "
                    "minimum; raise it"
                )
            return per
        return self.capacity_bytes or DEFAULT_CAPACITY_BYTES

    @classmethod
    def parse(
        cls, extra: dict[str, Any] | None, kv_role: str | None = "kv_both"
    ) -> ConnectorConfig:
        """Validates `kv_connector_extra_config` and `kv_role`."""
        extra = dict(extra or {})
        role = kv_role or "kv_both"
        if role not in ROLES:
            raise ConfigError(f"`kv_role` must be one of {', '.join(ROLES)}, got {role!r}")
        mode = extra.pop("mode", "embedded")
        if mode not in MODES:
            raise ConfigError(f'option `mode` must be "embedded" or "standalone", got {mode!r}')
        allowed = dict(SHARED_DEFAULTS)
        other = STANDALONE_DEFAULTS if mode == "embedded" else EMBEDDED_DEFAULTS
        allowed.update(EMBEDDED_DEFAULTS if mode == "embedded" else STANDALONE_DEFAULTS)
        for name in extra:
            if name in other:
                if mode == "standalone":
                    raise ConfigError(
                        f"option `{name}` is not accepted in standalone mode: the server owns the "
                        "pool; set its size and placement with UMBP_DRAM_* on the server"
                    )
                raise ConfigError(
                    f'option `{name}` belongs to standalone mode; set "mode": "standalone" or remove it'
                )
            if name not in allowed:
                known = ", ".join(sorted(["mode", *allowed]))
                raise ConfigError(
                    f"unknown option `{name}` in kv_connector_extra_config; known options: {known}"
                )
        v = {**allowed, **extra}
        out: dict[str, Any] = {"mode": mode, "kv_role": role, "extra": extra}
        for name in (
            "load_async",
            "lookup_async",
            "enable_lookup",
            "save_decode_cache",
            "lazy_offload",
            "enable_partial_hash_hits",
        ):
            out[name] = _bool(name, v[name])
        out["kv_event_max_objects"] = _int("kv_event_max_objects", v["kv_event_max_objects"], 0)
        if v["lazy_offload_max_blocks"] is not None:
            out["lazy_offload_max_blocks"] = _int(
                "lazy_offload_max_blocks", v["lazy_offload_max_blocks"], 1
            )
        out["num_workers"] = _int("num_workers", v["num_workers"], 1, 256)
        out["timeout_ms"] = _int("timeout_ms", v["timeout_ms"], 1)
        out["lookup_timeout_ms"] = _int("lookup_timeout_ms", v["lookup_timeout_ms"], 1)
        out["lookup_workers"] = _int("lookup_workers", v["lookup_workers"], 1, 64)
        # "auto" is the in-tree class's spelling of "derive it" (its documented default).
        if v["key_namespace"] not in (None, "auto"):
            ns = _str("key_namespace", v["key_namespace"])
            if not ns or ":" in ns or any(c.isspace() for c in ns):
                raise ConfigError(
                    "option `key_namespace` must be non-empty, without ':' or whitespace"
                )
            out["key_namespace"] = ns
        if mode == "embedded":
            if v["capacity_bytes"] is not None and v["total_capacity_bytes"] is not None:
                raise ConfigError(
                    "options `capacity_bytes` and `total_capacity_bytes` are exclusive; set only one"
                )
            for name in ("capacity_bytes", "total_capacity_bytes"):
                if v[name] is not None:
                    out[name] = _int(name, v[name], 1 << 20)
            inst = _str("lookup_instance", v["lookup_instance"])
            if "/" in inst or any(c.isspace() for c in inst):
                raise ConfigError("option `lookup_instance` must not contain '/' or whitespace")
            out["lookup_instance"] = inst
            d = _str("lookup_dir", v["lookup_dir"])
            if not os.path.isdir(d):
                raise ConfigError(
                    f"option `lookup_dir`: {d!r} is not an existing directory; create it or pick another"
                )
            out["lookup_dir"] = d
            hi = _float("dram_high_watermark", v["dram_high_watermark"])
            lo = _float("dram_low_watermark", v["dram_low_watermark"])
            if lo >= hi:
                raise ConfigError(
                    f"option `dram_low_watermark` ({lo}) must be below `dram_high_watermark` ({hi})"
                )
            out["dram_high_watermark"], out["dram_low_watermark"] = hi, lo
            out["dram_use_hugepages"] = _bool("dram_use_hugepages", v["dram_use_hugepages"])
            size = v["dram_hugepage_size"]
            if isinstance(size, int) and not isinstance(size, bool):
                size = str(size)
            size = _str("dram_hugepage_size", size)
            if size.strip().lower() not in (
                "2m",
                "2mb",
                "2mib",
                "2097152",
                "1g",
                "1gb",
                "1gib",
                "1073741824",
            ):
                raise ConfigError(
                    f'option `dram_hugepage_size` {size!r} is not supported; use "2MiB" or "1GiB"'
                )
            out["dram_hugepage_size"] = size
            if v["dram_numa_node"] is not None:
                out["dram_numa_node"] = _int("dram_numa_node", v["dram_numa_node"], 0)
            out["dram_prefault"] = _bool("dram_prefault", v["dram_prefault"])
        else:
            ep = v["endpoint"]
            if ep is None:
                raise ConfigError(
                    "option `endpoint` is required in standalone mode: the server's socket path or unix:// address"
                )
            out["endpoint"] = parse_endpoint(_str("endpoint", ep))
            out["startup_timeout_ms"] = _int("startup_timeout_ms", v["startup_timeout_ms"], 1)
        return cls(**out)


def parse_endpoint(ep: str) -> str:
    """Returns the socket path of a standalone endpoint (an absolute path or `unix://` URL)."""
    path = ep[len("unix://") :] if ep.startswith("unix://") else ep
    if "://" in path or ep.startswith(("tcp:", "http:", "https:", "grpc:")):
        raise ConfigError(
            f"option `endpoint` {ep!r}: only Unix sockets are supported (an absolute path or unix:///path); TCP is rejected"
        )
    if not os.path.isabs(path):
        raise ConfigError(
            f"option `endpoint` {ep!r} must be an absolute socket path or unix:///absolute/path"
        )
    return path
