"""The connector's options (`kv_connector_extra_config`): parsing and validation.

Every option is checked at engine start-up. An unknown option, a wrong type or an
out-of-range value raises `umbp.ConfigError` naming the option and saying what to change.
The checks, defaults and ranges live in one place, the Rust schema
(`umbp_core::options::SCHEMA`): `parse` hands the user's options over as JSON and gets every
option back validated and defaulted. `options_table` renders the schema as the tables of
docs/configuration.md (`python -m umbp.vllm.config --write docs/configuration.md`).
This module does not import vLLM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from umbp import _native
from umbp.errors import ConfigError

#: Every option, from the one schema in Rust (`umbp_core::options::SCHEMA`): name, scope,
#: type, default, range, doc. Defaults and ranges live there only.
SCHEMA: tuple[dict[str, Any], ...] = tuple(_native.connector_option_schema())
OPTIONS: dict[str, dict[str, Any]] = {s["name"]: s for s in SCHEMA}
#: The smallest pool a worker may get (a share of `total_capacity_bytes` included).
MIN_POOL_BYTES: int = OPTIONS["capacity_bytes"]["min"]


def _json(extra: dict[str, Any]) -> str:
    """`extra` as JSON; a value JSON cannot carry is refused naming its option."""
    for name, v in extra.items():
        try:
            json.dumps(v, allow_nan=False)
        except (TypeError, ValueError):
            raise ConfigError(
                f"invalid option `{name}`: {v!r} is not a JSON value (true/false, a number, a "
                "string or null)"
            ) from None
    try:
        return json.dumps(extra)
    except TypeError:  # a key JSON cannot carry (a tuple, say)
        bad = next(k for k in extra if not isinstance(k, (str, int, float, bool)))
        raise ConfigError(f"option names must be strings, got {bad!r}") from None


@dataclass(frozen=True)
class ConnectorConfig:
    """Validated connector options (see `SCHEMA`); built by `parse` only."""

    mode: str
    kv_role: str
    load_async: bool
    lookup_async: bool
    lookup_workers: int
    kv_event_max_objects: int
    self_describing_kv_events: bool
    enable_lookup: bool
    save_decode_cache: bool
    store_priority_skip_above: int | None
    store_priority_admit_at_most: int | None
    lazy_offload: bool
    lazy_offload_max_blocks: int | None
    enable_partial_hash_hits: bool
    num_workers: int
    timeout_ms: int
    lookup_timeout_ms: int
    key_namespace: str | None
    # embedded
    capacity_bytes: int | None  # None when total_capacity_bytes is set
    total_capacity_bytes: int | None
    lookup_instance: str
    lookup_dir: str
    dram_high_watermark: float
    dram_low_watermark: float
    dram_use_hugepages: bool
    dram_hugepage_size: str
    dram_numa_node: int | None
    dram_prefault: bool
    eviction_policy: str
    store_admission: str
    integrity: str
    integrity_sample_every: int
    remote_url: str | None
    remote_ttl_s: int
    remote_write: str
    remote_timeout_ms: int
    remote_write_backlog: int
    remote_write_mb_per_s: int
    disk_dir: str | None
    disk_capacity_bytes: int
    disk_write_mb_per_s: int
    disk_write: str
    disk_close_write_s: int
    cuda_staging_bytes: int
    # standalone
    endpoint: str | None
    startup_timeout_ms: int
    kv_cache_export: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # The options as the user gave them (JSON): the embedded store is built from these in Rust
    # (`EmbeddedStore.for_connector`), so no option is re-typed on its way to the store.
    source_json: str = field(default="{}", compare=False, repr=False)

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
            if per < MIN_POOL_BYTES:
                raise ConfigError(
                    f"option `total_capacity_bytes` ({self.total_capacity_bytes}) split over "
                    f"{workers_per_engine} workers leaves {per} bytes each, below the "
                    f"{MIN_POOL_BYTES >> 20} MiB minimum; raise it"
                )
            return per
        assert self.capacity_bytes is not None
        return self.capacity_bytes

    @classmethod
    def parse(
        cls, extra: dict[str, Any] | None, kv_role: str | None = "kv_both"
    ) -> ConnectorConfig:
        """Validates `kv_connector_extra_config` and `kv_role` (in Rust, against `SCHEMA`)."""
        extra = dict(extra or {})
        role = kv_role or None  # unset (or empty): kv_both
        if role is not None and not isinstance(role, str):
            role = repr(role)  # refused by name like any other wrong role
        source = _json(extra)
        opts = _native.connector_options(source, role)
        extra.pop("mode", None)
        return cls(**opts, extra=extra, source_json=source)


def parse_endpoint(ep: str) -> str:
    """Returns the socket path of a standalone endpoint (an absolute path or `unix://` URL)."""
    if not isinstance(ep, str):
        raise ConfigError(f"invalid option `endpoint`: must be a string, got {ep!r}")
    path = ConnectorConfig.parse({"mode": "standalone", "endpoint": ep}).endpoint
    assert path is not None
    return path


# -- the docs' option tables ------------------------------------------------------------------

SCOPES = ("shared", "embedded", "standalone")
# Edit the schema (crates/umbp-core/src/options/schema.rs), not the tables; then regenerate them.
_BEGIN = "<!-- BEGIN options:{scope} (generated: python -m umbp.vllm.config --write "
_BEGIN += "docs/configuration.md) -->"
_END = "<!-- END options:{scope} -->"


def options_table(scope: str) -> str:
    """The Markdown table of the options of `scope` ("shared", "embedded", "standalone")."""
    rows = [
        "| Option | Default | Meaning | Rejected when |",
        "|---|---|---|---|",
        *(
            f"| `{s['name']}` | {s['default_doc']} | {s['doc']} | {s['rejected']} |"
            for s in SCHEMA
            if s["scope"] == scope
        ),
    ]
    return "\n".join(rows) + "\n"


def render_docs(text: str) -> str:
    """`text` (docs/configuration.md) with every generated table block rewritten from the
    schema; raises ValueError when a block's markers are missing."""
    for scope in SCOPES:
        begin, end = _BEGIN.format(scope=scope), _END.format(scope=scope)
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            raise ValueError(f"no generated block for {scope} options ({begin!r} ... {end!r})")
        text = text[: i + len(begin)] + "\n" + options_table(scope) + text[j:]
    return text


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="The connector's option tables, from the schema.")
    ap.add_argument("--write", metavar="MD", help="rewrite the generated tables of this file")
    ap.add_argument("--check", metavar="MD", help="exit 1 if this file's tables are stale")
    a = ap.parse_args(argv)
    path = a.write or a.check
    if path is None:
        for scope in SCOPES:
            print(f"{scope}:\n{options_table(scope)}")
        return 0
    with open(path, encoding="utf-8") as f:
        text = f.read()
    new = render_docs(text)
    if a.check:
        if new != text:
            print(f"{path}: option tables differ from the schema; run with --write {path}")
            return 1
        return 0
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
