"""What the connector reports to vLLM's stats loggers: `/metrics` of `vllm serve` and the
periodic "KV Transfer metrics" log line.

Each worker counts its own transfers (bytes and the copy's duration, measured in Rust by the
copy engine or the server; blocks and failures on one worker per engine, since all move the same
blocks) and the scheduler its lookups, once per request; vLLM collects both every step (`get_kv_connector_stats`), sums them over the engine's workers (`aggregate`)
and hands the result to `UMBPPromMetrics.observe` in the API server. The pools' occupancy rides
along as each pool's latest snapshot, read at most once a second in embedded mode (a Rust call,
no lock on the copy path) and every 5 s from the server in standalone mode (an RPC on a thread of
its own, never on the engine's step), keyed by pool so that the workers of one server count it
once.

The payload is a plain dict (vLLM sends it between processes with msgpack):

    {"c": {counter: n}, "h": {histogram: [seconds, ...]}, "pools": {pool: {field: n}}}
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: Counters: (name in the payload, Prometheus name, help).
COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("load_blocks", "vllm:umbp_load_blocks", "KV blocks restored into the engine by UMBP."),
    ("load_bytes", "vllm:umbp_load_bytes", "Bytes of KV restored into the engine by UMBP."),
    (
        "load_failed_blocks",
        "vllm:umbp_load_failed_blocks",
        "KV blocks a UMBP load was planned for but did not deliver (vLLM recomputed them).",
    ),
    ("store_blocks", "vllm:umbp_store_blocks", "KV blocks copied into the UMBP pool."),
    ("store_bytes", "vllm:umbp_store_bytes", "Bytes of KV copied into the UMBP pool."),
    (
        "store_present_blocks",
        "vllm:umbp_store_present_blocks",
        "KV blocks a store found already in the UMBP pool (not copied again).",
    ),
    (
        "store_dropped_blocks",
        "vllm:umbp_store_dropped_blocks",
        "KV blocks not stored because the pool was full of pinned objects or vLLM had "
        "released the KV cache's memory.",
    ),
    (
        "store_skipped_blocks",
        "vllm:umbp_store_skipped_blocks",
        "KV blocks not kept by design: the pool's store_admission skipped them (on_reuse), "
        "or another TP rank holding the same KV (MLA) stored them; counted per rank.",
    ),
    (
        "store_hint_skipped_blocks",
        "vllm:umbp_store_hint_skipped_blocks",
        "KV blocks not stored because their request's store hint said so: a priority above "
        "store_priority_skip_above, or kv_transfer_params umbp_store=skip (counted per engine).",
    ),
    (
        "store_hint_now_blocks",
        "vllm:umbp_store_hint_now_blocks",
        "KV blocks sent to be kept on first sighting, past an on_reuse store admission: a "
        "priority at or below store_priority_admit_at_most, or umbp_store=now (per engine).",
    ),
    (
        "store_failed_blocks",
        "vllm:umbp_store_failed_blocks",
        "KV blocks whose store failed (server gone, copy error, cancelled).",
    ),
    (
        "lookup_hit_tokens",
        "vllm:umbp_lookup_hit_tokens",
        "Prompt tokens UMBP's lookups found in the pool (what vLLM then loads).",
    ),
    (
        "lookup_miss_tokens",
        "vllm:umbp_lookup_miss_tokens",
        "Prompt tokens UMBP's lookups asked for and did not find.",
    ),
)

#: Histograms of seconds: (name in the payload, Prometheus name, help, buckets).
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LOOKUP_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25)
HISTOGRAMS: tuple[tuple[str, str, str, tuple[float, ...]], ...] = (
    (
        "load_seconds",
        "vllm:umbp_load_seconds",
        "Time of one UMBP load (a request's blocks of one cache group), submission to done.",
        _TRANSFER_BUCKETS,
    ),
    (
        "store_seconds",
        "vllm:umbp_store_seconds",
        "Time of one UMBP store (a step's blocks of one cache group), submission to done.",
        _TRANSFER_BUCKETS,
    ),
    (
        "lookup_seconds",
        "vllm:umbp_lookup_seconds",
        "Time of one UMBP lookup of a request's blocks (the scheduler asking every worker, "
        "or the server).",
        _LOOKUP_BUCKETS,
    ),
)

#: Per-pool gauges: (field, Prometheus name, help).
POOL_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("used_bytes", "vllm:umbp_pool_used_bytes", "Bytes of KV objects in the UMBP pool."),
    ("capacity_bytes", "vllm:umbp_pool_capacity_bytes", "Capacity of the UMBP pool in bytes."),
    ("objects", "vllm:umbp_pool_objects", "KV objects in the UMBP pool."),
)
#: Per-pool cumulative counts, exported as counters by their increase: (field, name, help).
POOL_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("evictions", "vllm:umbp_pool_evictions", "Objects the UMBP pool evicted to make room."),
    (
        "corrupt_detected",
        "vllm:umbp_corrupt_detected",
        "KV objects that failed their checksum on the way to the engine, in any UMBP tier "
        "(integrity): removed, their blocks recomputed, never restored.",
    ),
    (
        "remote_hits",
        "vllm:umbp_remote_hits",
        "Objects fetched from UMBP's remote tier into the pool on a lookup.",
    ),
)


def _empty() -> dict[str, Any]:
    return {"c": {}, "h": {}, "pools": {}}


@dataclass
class UMBPConnectorStats(KVConnectorStats):
    """One interval's counts of a worker or the scheduler, or their sum over an engine."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = _empty()

    def count(self, name: str, n: float = 1) -> None:
        c = self.data["c"]
        c[name] = c.get(name, 0) + n

    def observe_seconds(self, name: str, seconds: float) -> None:
        self.data["h"].setdefault(name, []).append(seconds)

    def pool(self, pool_id: str, fields: dict[str, int]) -> None:
        self.data["pools"][pool_id] = fields

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, UMBPConnectorStats) or other is self:
            return self
        for k, v in other.data.get("c", {}).items():
            self.count(k, v)
        for k, v in other.data.get("h", {}).items():
            self.data["h"].setdefault(k, []).extend(v)
        self.data["pools"].update(other.data.get("pools", {}))  # the newest snapshot
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's numbers: counters, and each histogram's count and mean."""
        out: dict[str, int | float] = {k: v for k, v in sorted(self.data["c"].items()) if v}
        for k, samples in sorted(self.data["h"].items()):
            if samples:
                out[f"{k}_count"] = len(samples)
                out[f"{k}_mean_ms"] = round(1000 * sum(samples) / len(samples), 3)
        pools = self.data["pools"].values()
        if pools:
            out["pool_used_bytes"] = sum(p.get("used_bytes", 0) for p in pools)
        return out

    def is_empty(self) -> bool:
        d = self.data
        return not (d["c"] or d["h"] or d["pools"])


class StatsCollector:
    """One role's counts since vLLM last collected them. vLLM sums its workers' stats, and
    every worker of an engine moves the same blocks (its own share of their bytes): block
    counts come from one worker (`count_blocks`), bytes and durations from all."""

    def __init__(self, count_blocks: bool = True) -> None:
        self.stats = UMBPConnectorStats()
        self.count_blocks = count_blocks
        self._pool_read_at = 0.0

    def pool_due(self, every_s: float) -> bool:
        """Whether the pool snapshot is due (at most one per `every_s`)."""
        now = time.monotonic()
        if now - self._pool_read_at < every_s:
            return False
        self._pool_read_at = now
        return True

    def transfer(self, kind: str, job: Any, statuses: list[str]) -> None:
        """Counts a finished load or store (`kind`: "load", "store") from its per-block
        statuses, with its duration and bytes when the job gives them."""
        s = self.stats
        done = sum(1 for st in statuses if st == "done")
        if kind == "load":
            # vLLM recomputes from a request's first failed block on: those count as failed.
            used = next((i for i, st in enumerate(statuses) if st != "done"), len(statuses))
            if self.count_blocks:
                s.count("load_blocks", used)
                s.count("load_failed_blocks", len(statuses) - used)
            done = used
        elif self.count_blocks:
            skipped = sum(1 for st in statuses if st == "skipped")
            present = sum(1 for st in statuses if st == "already_present")
            dropped = sum(1 for st in statuses if st == "pool_full")
            s.count("store_blocks", done)
            s.count("store_skipped_blocks", skipped)
            s.count("store_present_blocks", present)
            s.count("store_dropped_blocks", dropped)
            s.count("store_failed_blocks", len(statuses) - done - present - dropped - skipped)
        size = getattr(job, "object_bytes", 0) or 0
        if done and size:
            s.count(f"{kind}_bytes", done * size)
        elapsed = getattr(job, "elapsed_s", None)
        if elapsed is not None:
            s.observe_seconds(f"{kind}_seconds", elapsed)

    def replica_skipped(self, blocks: int) -> None:
        """Counts blocks this rank left to the first rank of its replica group (MLA in
        standalone mode); each such rank counts its own (worker 0 stores, never skips)."""
        self.stats.count("store_skipped_blocks", blocks)

    def failed_loads(self, blocks: int) -> None:
        """Counts loads that were planned but could not start (vLLM recomputes them)."""
        if self.count_blocks:
            self.stats.count("load_failed_blocks", blocks)

    def take(self) -> UMBPConnectorStats | None:
        """What was counted since the last call (None when nothing: vLLM then sends nothing)."""
        if self.stats.is_empty():
            return None
        out, self.stats = self.stats, UMBPConnectorStats()
        return out


class UMBPPromMetrics(KVConnectorPromMetrics):
    """The connector's series on `/metrics`, labelled `model_name`, `engine` and `mode`."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self._mode = "standalone" if extra.get("mode") == "standalone" else "embedded"
        names = [*labelnames, "mode"]
        self._counters = {
            key: self._counter_cls(name=name, documentation=doc, labelnames=names)
            for key, name, doc in (*COUNTERS, *POOL_COUNTERS)
        }
        self._histograms = {
            key: self._histogram_cls(
                name=name, documentation=doc, labelnames=names, buckets=list(buckets)
            )
            for key, name, doc, buckets in HISTOGRAMS
        }
        self._gauges = {
            key: self._gauge_cls(
                name=name, documentation=doc, labelnames=names, multiprocess_mode="mostrecent"
            )
            for key, name, doc in POOL_GAUGES
        }
        self._children: dict[tuple[str, int], Any] = {}
        # Per engine and pool: the cumulative counts last seen, to export their increase.
        self._pool_seen: dict[tuple[int, str], dict[str, int]] = {}
        self._pool_latest: dict[tuple[int, str], dict[str, int]] = {}

    def _child(self, metric: Any, key: str, engine_idx: int) -> Any:
        c = self._children.get((key, engine_idx))
        if c is None:
            c = metric.labels(*self.per_engine_labelvalues[engine_idx], self._mode)
            self._children[(key, engine_idx)] = c
        return c

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for key, n in data.get("c", {}).items():
            if key in self._counters and n > 0:
                self._child(self._counters[key], key, engine_idx).inc(n)
        for key, samples in data.get("h", {}).items():
            if key in self._histograms:
                h = self._child(self._histograms[key], key, engine_idx)
                for v in samples:
                    h.observe(v)
        pools = data.get("pools", {})
        if not pools:
            return
        for pool_id, fields in pools.items():
            seen = self._pool_seen.setdefault((engine_idx, pool_id), {})
            for key, _, _ in POOL_COUNTERS:
                now = fields.get(key)
                if now is None:
                    continue
                before = seen.get(key)
                seen[key] = now
                # The first snapshot of a pool is its baseline; a restarted server starts over.
                if before is not None and now > before:
                    self._child(self._counters[key], key, engine_idx).inc(now - before)
            self._pool_latest[(engine_idx, pool_id)] = fields
        # Workers read their pools at their own times: each pool's latest snapshot counts.
        latest = [f for (e, _), f in self._pool_latest.items() if e == engine_idx]
        for key, _, _ in POOL_GAUGES:
            total = sum(f.get(key, 0) for f in latest)
            self._child(self._gauges[key], key, engine_idx).set(total)
