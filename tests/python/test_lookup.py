"""The embedded lookup service: real stores behind real Unix sockets."""

import json
import subprocess
import time

import pytest

import umbp
from conftest import KvCache, hashes, umbp_command


def worker(tmp_path, tp, ns="lk"):
    store = umbp.EmbeddedStore(16 << 20, num_workers=1, prefault=False)
    cache = KvCache(fill_seed=tp)
    store.register_memory(cache.base, cache.buf.nbytes)
    layout = store.register_layout(cache.layout())
    path = umbp.socket_path(tmp_path, "eng", 0, tp)
    server = umbp.LookupServer(store, path, ns, tp=tp, describe=f"tp{tp}")
    return store, cache, layout, server


def test_scheduler_hits_only_blocks_every_rank_holds(tmp_path):
    ranks = [worker(tmp_path, tp) for tp in range(2)]
    client = umbp.LookupClient([r[3].path for r in ranks], timeout_ms=1000)
    assert [d.split()[0] for d in client.wait_ready(5000)] == ["tp0", "tp1"]
    ids = list(range(10))
    packed = b"".join(hashes(ids))
    for tp, (store, _cache, layout, _srv) in enumerate(ranks):
        n = 10 if tp == 0 else 6
        keys = umbp.KeyBuilder("lk", tp=tp).keys(0, hashes(ids[:n]))
        assert set(store.store(layout, 0, ids[:n], keys).wait()) == {"done"}
    assert client.prefix_hits(0, packed, 32) == 6
    assert client.exists_all(0, packed, 32) == [True] * 6 + [False] * 4
    # A rank's keys carry its TP rank: rank 1's service does not see rank 0's objects.
    other_ns = umbp.LookupClient([ranks[0][3].path], timeout_ms=1000)
    assert other_ns.prefix_hits(0, packed, 32) == 10
    assert client.clear() == 16
    assert client.prefix_hits(0, packed, 32) == 0
    for store, _c, _l, srv in ranks:
        srv.shutdown()
        store.close()


def test_holds_all_watches_the_pool_without_leasing_or_counting(tmp_path):
    """`holds_all` (the connector's eviction watch) answers what every rank's pool holds
    but takes no lease and counts no hit: a lease renewed by every watch would keep the
    watched blocks from eviction for as long as they are watched."""
    ranks = [worker(tmp_path, tp) for tp in range(2)]
    client = umbp.LookupClient([r[3].path for r in ranks], timeout_ms=1000)
    client.wait_ready(5000)
    ids = list(range(10))
    packed = b"".join(hashes(ids))
    for tp, (store, _cache, layout, _srv) in enumerate(ranks):
        n = 10 if tp == 0 else 7
        keys = umbp.KeyBuilder("lk", tp=tp).keys(0, hashes(ids[:n]))
        assert set(store.store(layout, 0, ids[:n], keys).wait()) == {"done"}
    before = [r[0].stats() for r in ranks]
    assert client.holds_all(0, packed, 32) == [True] * 7 + [False] * 3
    for (store, *_), b in zip(ranks, before):
        s = store.stats()
        assert (s["leases"], s["hits"], s["misses"]) == (b["leases"], b["hits"], b["misses"])
    # A lookup a load follows does lease what it reports: each rank what it holds.
    assert client.exists_all(0, packed, 32) == [True] * 7 + [False] * 3
    assert [r[0].stats()["leases"] - b["leases"] for r, b in zip(ranks, before)] == [10, 7]
    # A rank that is gone: no answer (None), not "nothing held".
    ranks[1][3].shutdown()
    assert client.holds_all(0, packed, 32) is None
    for store, _c, _l, srv in ranks:
        srv.shutdown()
        store.close()


def test_engines_with_different_instances_never_answer_each_other(tmp_path):
    a = umbp.socket_path(tmp_path, "model-a", 0, 0)
    b = umbp.socket_path(tmp_path, "model-b", 0, 0)
    assert a != b
    store = umbp.EmbeddedStore(8 << 20, prefault=False)
    srv = umbp.LookupServer(store, a, "ns")
    with pytest.raises(umbp.LookupServiceError, match="lookup_instance"):
        umbp.LookupServer(store, a, "ns")
    t0 = time.monotonic()
    assert umbp.LookupClient([b], timeout_ms=1000).prefix_hits(0, b"h" * 32, 32) == 0
    assert time.monotonic() - t0 < 0.5
    with pytest.raises(umbp.LookupServiceError, match="model-b"):
        umbp.LookupClient([b]).wait_ready(200)
    srv.shutdown()
    store.close()


def test_lookup_bench_runs_against_the_schedulers_socket_paths(monkeypatch, capsys):
    # The benchmark drives the connector's real scheduler side: its workers must serve where
    # the embedded runtime looks (the private directory under lookup_dir).
    pytest.importorskip("vllm")
    from umbp.vllm import bench_lookup

    argv = ["bench_lookup", "--tokens", "1024", "--tp", "2", "--repeats", "2"]
    monkeypatch.setattr("sys.argv", argv)
    assert bench_lookup.main() == 0
    assert "speedup" in capsys.readouterr().out


def test_umbp_stats_watch_sums_the_engines_workers(tmp_path, kb):
    """`umbp stats --lookup-dir DIR --watch`: the operator's view of embedded engines, read
    through their workers' lookup sockets; two workers' pools summed, the second refresh's
    rates from the traffic in between."""
    ranks = [worker(tmp_path, tp) for tp in range(2)]
    keys = kb.keys(0, hashes(range(8)))
    for store, _, layout, _ in ranks:
        assert store.store(layout, 0, list(range(8)), keys).wait() == ["done"] * 8
    cmd = [str(umbp_command()), "stats", "--lookup-dir", str(tmp_path), "--json"]
    proc = subprocess.Popen(
        [*cmd, "--watch", "1", "--count", "3"], stdout=subprocess.PIPE, text=True
    )
    first = json.loads(proc.stdout.readline())
    store, _, layout, _ = ranks[0]
    assert store.load(layout, 0, list(range(8)), keys).wait() == ["done"] * 8
    store.exists(kb.keys(0, hashes(range(100, 104))))  # four misses
    later = [json.loads(proc.stdout.readline()) for _ in range(2)]
    assert proc.wait(30) == 0
    second = later[-1]  # the traffic fell between the first refresh and one of these
    assert max(x["gb_s_out"] for x in later) > 0
    piece = ranks[0][1].layers * ranks[0][1].piece
    assert first["clients"] == first["expected_clients"] == 2 and first["objects"] == 16
    assert first["used_bytes"] >= 16 * piece and first["capacity_bytes"] == 2 * (16 << 20)
    assert first["bytes_in"] == 16 * piece and first["remote"] == "off"
    assert second["bytes_out"] - first["bytes_out"] == 8 * piece
    assert second["lookups_last_minute"] >= 4
    assert 0 <= second["hit_rate_last_minute"] < 1
    once = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=30)
    assert once.returncode == 0 and "occupancy" in once.stdout and "clients     2" in once.stdout
    empty = subprocess.run(
        [str(umbp_command()), "stats", "--lookup-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert empty.returncode != 0 and "lookup_dir" in empty.stderr
    for _, _, _, srv in ranks:
        srv.shutdown()
