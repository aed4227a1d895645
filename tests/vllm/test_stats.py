"""The connector's stats as vLLM handles them: summed over an engine's workers, sent as a plain
dict, rebuilt by the logger, exported by `UMBPPromMetrics` into real `prometheus_client`
metrics (what `vllm serve` exposes on `/metrics`)."""

from __future__ import annotations

import msgspec
import prometheus_client as prom
import pytest
from vllm.config import KVTransferConfig

from umbp.vllm.connector import UMBPStoreConnector
from umbp.vllm.stats import StatsCollector, UMBPConnectorStats, UMBPPromMetrics


class _Job:
    def __init__(self, seconds: float, size: int) -> None:
        self.elapsed_s, self.object_bytes = seconds, size


@pytest.fixture
def prom_metrics():
    """Builds `UMBPPromMetrics` with prometheus_client's own classes; unregisters them after."""
    made: list[UMBPPromMetrics] = []

    def build(mode: str) -> UMBPPromMetrics:
        ktc = KVTransferConfig(
            kv_connector="UMBPStoreConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"mode": mode},
        )
        vc = type("Cfg", (), {"kv_transfer_config": ktc})()
        types = {prom.Gauge: prom.Gauge, prom.Counter: prom.Counter, prom.Histogram: prom.Histogram}
        m = UMBPStoreConnector.build_prom_metrics(
            vc, types, ["model_name", "engine"], {0: ["m", "0"]}
        )
        made.append(m)
        return m

    yield build
    for c in list(prom.REGISTRY._collector_to_names):  # noqa: SLF001
        names = prom.REGISTRY._collector_to_names[c]  # noqa: SLF001
        if any(n.startswith("vllm:umbp_") for n in names):
            prom.REGISTRY.unregister(c)


def sample(name: str, mode: str) -> float | None:
    return prom.REGISTRY.get_sample_value(name, {"model_name": "m", "engine": "0", "mode": mode})


def worker_stats(
    pool_id: str, used: int, evictions: int, loads: int, first: bool = True
) -> UMBPConnectorStats:
    """A worker's interval: `loads` loads of 3 blocks (the last missing) and a store of 4
    (done, present, dropped, failed). Only an engine's first worker counts blocks."""
    c = StatsCollector(count_blocks=first)
    for _ in range(loads):
        c.transfer("load", _Job(0.002, 4096), ["done", "done", "missing"])
    c.transfer("store", _Job(0.001, 4096), ["done", "already_present", "pool_full", "failed"])
    c.stats.pool(pool_id, {"used_bytes": used, "capacity_bytes": 1 << 20, "objects": 3,
                           "evictions": evictions})  # fmt: skip
    out = c.take()
    assert out is not None and c.take() is None  # handed out once, then nothing
    return out


def through_vllm(stats: UMBPConnectorStats) -> dict:
    """What the API server gets: the engine core's `to_dict()`, msgpack'd across."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(stats.to_dict()))


def test_embedded_workers_are_summed_pools_and_all(prom_metrics):
    m = prom_metrics("embedded")
    engine = worker_stats("worker:0", 1000, 5, loads=2).aggregate(
        worker_stats("worker:1", 3000, 7, loads=2, first=False)
    )
    sched = UMBPConnectorStats()
    sched.count("lookup_hit_tokens", 256)
    sched.observe_seconds("lookup_seconds", 0.0003)
    engine = engine.aggregate(sched)  # vLLM: worker stats, then the scheduler's
    data = through_vllm(engine)
    assert UMBPStoreConnector.build_kv_connector_stats(data).reduce()["load_blocks"] == 4
    m.observe(data, 0)
    # Blocks as the engine sees them (its first worker's 2 loads x 2 done), not per worker;
    # bytes and durations from both workers (each moves its share of every block).
    assert sample("vllm:umbp_load_blocks_total", "embedded") == 4
    assert sample("vllm:umbp_load_failed_blocks_total", "embedded") == 2
    assert sample("vllm:umbp_load_bytes_total", "embedded") == 8 * 4096
    assert sample("vllm:umbp_store_blocks_total", "embedded") == 1
    assert sample("vllm:umbp_store_present_blocks_total", "embedded") == 1
    assert sample("vllm:umbp_store_dropped_blocks_total", "embedded") == 1
    assert sample("vllm:umbp_store_failed_blocks_total", "embedded") == 1
    assert sample("vllm:umbp_load_seconds_count", "embedded") == 4
    assert sample("vllm:umbp_lookup_hit_tokens_total", "embedded") == 256
    assert sample("vllm:umbp_pool_used_bytes", "embedded") == 4000  # two pools, summed
    assert sample("vllm:umbp_pool_capacity_bytes", "embedded") == 2 << 20
    assert sample("vllm:umbp_pool_evictions_total", "embedded") is None  # first: baseline
    m.observe(through_vllm(worker_stats("worker:0", 900, 9, loads=0)), 0)
    assert sample("vllm:umbp_pool_evictions_total", "embedded") == 4  # 5 -> 9
    # worker 1 read its pool at another step: its latest snapshot still counts
    assert sample("vllm:umbp_pool_used_bytes", "embedded") == 900 + 3000


def test_standalone_workers_share_one_server_pool(prom_metrics):
    m = prom_metrics("standalone")
    a = worker_stats("server:/run/umbp.sock", 5000, 10, loads=1)
    b = worker_stats("server:/run/umbp.sock", 5000, 10, loads=1, first=False)
    m.observe(through_vllm(a.aggregate(b)), 0)
    assert sample("vllm:umbp_pool_used_bytes", "standalone") == 5000  # counted once
    assert sample("vllm:umbp_load_blocks_total", "standalone") == 2  # the engine's blocks
    assert sample("vllm:umbp_load_bytes_total", "standalone") == 4 * 4096  # both workers'
    b2 = worker_stats("server:/run/umbp.sock", 6000, 12, loads=0, first=False)
    m.observe(through_vllm(b2), 0)
    assert sample("vllm:umbp_pool_evictions_total", "standalone") == 2


def test_nothing_to_report_is_none():
    assert StatsCollector().take() is None
    assert UMBPStoreConnector.build_kv_connector_stats(None).is_empty()


def test_blocks_after_a_failed_one_count_as_failed():
    """vLLM recomputes a request from its first failed block on: the later ones are failed
    too, even when their copies went through."""
    c = StatsCollector()
    c.transfer("load", _Job(0.001, 4096), ["done", "missing", "done"])
    d = c.take().data["c"]
    assert (d["load_blocks"], d["load_failed_blocks"], d["load_bytes"]) == (1, 2, 4096)
