"""The remote tier (Redis / Valkey) behind real pools: two embedded stores, and two
`umbp_standalone_server` processes standing in for two nodes, against a real three-node Redis
cluster started from the distribution's `redis-server` (tests/redis_cluster.py)."""

import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer

import umbp
from conftest import KvCache, hashes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_cluster import redis_cluster  # noqa: E402
from standalone_server import running  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    with redis_cluster(3) as c:
        yield c


@pytest.fixture(autouse=True)
def empty_cluster(cluster):
    cluster.flush()


def node(cluster, **kw):
    kw.setdefault("remote_timeout_ms", 2000)  # tests share 2 cores with 3 Redis nodes
    return umbp.EmbeddedStore(16 << 20, num_workers=2, prefault=False, remote_url=cluster.url, **kw)


def attach(store, cache):
    store.register_memory(cache.base, cache.buf.nbytes)
    return store.register_layout(cache.layout())


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.02)


def test_node_b_restores_what_node_a_stored(cluster):
    kb = umbp.KeyBuilder("remote-py", tp=0)
    keys = kb.keys(0, hashes(range(24)))
    src, dst = KvCache(fill_seed=5), KvCache()
    a, b = node(cluster), node(cluster)
    try:
        la = attach(a, src)
        assert a.store(la, 0, list(range(24)), keys).wait() == ["done"] * 24
        assert a.flush_remote(10_000)
        sa = a.remote_stats()
        assert sa["writes"] == 24 and sa["connected"], sa
        assert len(cluster.keys()) == 24
        lb = attach(b, dst)
        # B's pool is empty: the lookup fetches from the cluster, the load copies locally.
        assert b.stats()["objects"] == 0
        assert b.prefix_hits(keys) == 24
        assert b.stats()["objects"] == 24
        targets = list(range(30, 54))
        assert b.load(lb, 0, targets, keys).wait() == ["done"] * 24
        for i, t in enumerate(targets):
            assert dst.block(t) == src.block(i)
        sb = b.remote_stats()
        assert sb["hits"] == 24 and sb["corrupt"] == 0 and sb["writes"] == 0, sb
        # A key of another namespace is never one of these.
        other = umbp.KeyBuilder("remote-py-other", tp=0).keys(0, hashes(range(3)))
        assert b.exists(other) == [False] * 3
    finally:
        a.close()
        b.close()


def stored_by_a_closed_node(cluster, namespace, n, seed):
    """Keys of `n` blocks that a node stored and wrote to the cluster, then closed."""
    keys = umbp.KeyBuilder(namespace, tp=0).keys(0, hashes(range(n)))
    a = node(cluster)
    try:
        la = attach(a, KvCache(fill_seed=seed))
        assert a.store(la, 0, list(range(n)), keys).wait() == ["done"] * n
        assert a.flush_remote(10_000)
    finally:
        a.close()
    return keys


def test_a_corrupted_object_is_a_miss_and_the_rest_restores(cluster):
    keys = stored_by_a_closed_node(cluster, "remote-py-corrupt", 8, seed=9)
    names = cluster.keys()
    assert len(names) == 8
    # Key 4's remote name: the key's 64 bytes in hex, after the prefix.
    k4 = "umbp:v1:" + keys.to_bytes()[4 * 64 : 5 * 64].hex()
    assert k4 in names
    assert cluster.cli(cluster.ports[0], "set", k4, "overwritten by redis-cli").strip() == "OK"
    b = node(cluster)
    try:
        attach(b, KvCache())  # fetches read values as far as a layout's object size
        assert b.prefix_hits(keys) == 4
        assert b.exists(keys) == [True] * 4 + [False] + [True] * 3
        s = b.remote_stats()
        assert s["corrupt"] >= 1, s
    finally:
        b.close()


def test_on_reuse_writes_only_what_lookups_hit_twice_a_second_apart(cluster):
    kb = umbp.KeyBuilder("remote-py-reuse", tp=0)
    keys = kb.keys(0, hashes(range(6)))
    src = KvCache(fill_seed=3)
    a = node(cluster, remote_write="on_reuse", remote_ttl_s=120)
    try:
        la = attach(a, src)
        assert a.store(la, 0, list(range(6)), keys).wait() == ["done"] * 6
        assert a.flush_remote(5_000)
        assert cluster.keys() == []
        assert a.prefix_hits(keys[:2]) == 2  # first hit of blocks 0, 1
        assert a.flush_remote(5_000) and cluster.keys() == []
        assert a.prefix_hits(keys[:1]) == 1  # within a second: the same reuse
        assert a.flush_remote(5_000) and cluster.keys() == []
        time.sleep(1.1)
        assert a.prefix_hits(keys[:1]) == 1  # second hit of block 0
        wait_until(lambda: len(cluster.keys()) == 1, what="block 0 written")
        assert a.remote_stats()["writes"] == 1
        ttl = int(cluster.cli(cluster.ports[0], "ttl", cluster.keys()[0]).strip())
        assert 0 < ttl <= 120
    finally:
        a.close()


def test_a_stopped_cluster_node_makes_lookups_miss_within_the_timeout(cluster):
    kb = umbp.KeyBuilder("remote-py-stopped", tp=0)
    keys = stored_by_a_closed_node(cluster, "remote-py-stopped", 32, seed=4)
    b = node(cluster, remote_timeout_ms=300)
    dst = KvCache(fill_seed=1)
    lb = attach(b, dst)
    victim = cluster.owner("umbp:v1:" + keys.to_bytes()[0:64].hex())
    try:
        cluster.stop_node(victim)
        t = time.monotonic()
        got = b.prefix_hits(keys)
        took = time.monotonic() - t
        assert got == 0, "block 0 lives on the stopped node"
        assert took < 0.3 + 0.2, f"the lookup took {took:.3f} s with remote_timeout_ms=300"
        # The pool keeps working.
        local = kb.keys(0, hashes(range(100, 104)))
        assert b.store(lb, 0, [0, 1, 2, 3], local).wait() == ["done"] * 4
        assert b.exists(local) == [True] * 4
        s = b.remote_stats()
        assert s["timeouts"] + s["skipped_lookups"] >= 1, s
        print(f"lookup with a stopped node: {took * 1000:.0f} ms, {s}")
    finally:
        cluster.resume_node(victim)
        b.close()


def test_two_standalone_servers_share_objects_through_the_cluster(cluster, tmp_path):
    """Two servers standing in for two nodes: a client of server A stores, a client of
    server B (another pool) loads the same bytes."""
    args = ["--remote-url", cluster.url, "--remote-timeout-ms", "2000"]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{probe.getsockname()[1]}"
    with (
        running(tmp_path.name + "a", extra_args=args) as sa,
        running(tmp_path.name + "b", extra_args=[*args, "--metrics-address", metrics]) as sb,
    ):
        src, dst = peer.own_buffer(), peer.own_buffer()
        src[:] = peer.pattern(11)
        ca = umbp.StandaloneClient(sa.endpoint, startup_timeout_ms=5000, client_name="node-a")
        with ca:
            ca.register_memory(src.ctypes.data, src.nbytes)
            la = ca.register_layout(peer.layout(src))
            k = peer.keys(11)
            assert ca.store(la, 0, list(range(peer.BLOCKS)), k).wait() == ["done"] * peer.BLOCKS
        wait_until(
            lambda: (sa.stats()["remote"] or {}).get("writes", 0) == peer.BLOCKS,
            what="server A's remote writes",
        )
        assert len(cluster.keys()) == peer.BLOCKS
        cb = umbp.StandaloneClient(sb.endpoint, startup_timeout_ms=5000, client_name="node-b")
        with cb:
            cb.register_memory(dst.ctypes.data, dst.nbytes)
            lb = cb.register_layout(peer.layout(dst))
            assert sb.stats()["objects"] == 0
            assert cb.exists(k) == [True] * peer.BLOCKS
            assert cb.load(lb, 0, list(range(peer.BLOCKS)), k).wait() == ["done"] * peer.BLOCKS
        assert np.array_equal(dst, src)
        st = sb.stats()
        assert st["remote"]["hits"] == peer.BLOCKS and st["remote"]["connected"], st["remote"]
        text = sb.umbp("stats")
        assert "remote tier          connected" in text, text
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            prom = r.read().decode()
        assert f"umbp_remote_hits_total {peer.BLOCKS}" in prom, prom
        assert "umbp_remote_connected 1" in prom, prom
        # Every counter of the remote group on every surface (one model renders them all).
        as_json = json.loads(sb.umbp("stats", "--json"))["remote"]
        for name, kind, series, _help in dict(umbp.counter_fields())["remote"]:
            assert name in st["remote"] and name in as_json, name
            assert f"\n{series} " in prom, series
            if kind == "flag":
                assert isinstance(st["remote"][name], bool), name


def test_an_engine_reset_clears_its_namespace_in_the_remote_tier(cluster, tmp_path):
    """The scheduler's clear (vLLM's reset_prefix_cache with reset_external) reaches each
    worker's lookup server: its pool, and the engine's namespace in the cluster, go; another
    namespace stays."""
    mine, other = umbp.KeyBuilder("remote-py-reset", tp=0), umbp.KeyBuilder("remote-py-keep")
    km, ko = mine.keys(0, hashes(range(10))), other.keys(0, hashes(range(10, 16)))
    src = KvCache(fill_seed=8)
    a = node(cluster)
    server = umbp.LookupServer(a, tmp_path / "w0.sock", "remote-py-reset")
    try:
        la = attach(a, src)
        assert a.store(la, 0, list(range(10)), km).wait() == ["done"] * 10
        assert a.store(la, 0, list(range(10, 16)), ko).wait() == ["done"] * 6
        assert a.flush_remote(10_000)
        assert len(cluster.keys()) == 16
        assert umbp.LookupClient([server.path], timeout_ms=5000).clear() == 16
        assert a.stats()["objects"] == 0
        left = cluster.keys()
        assert len(left) == 6, left
        assert a.prefix_hits(km) == 0, "the reset namespace is gone from the remote tier"
        assert a.prefix_hits(ko) == 6, "another namespace's objects come back from it"
    finally:
        server.shutdown()
        a.close()


def test_umbp_clear_namespace_reaches_the_servers_remote_tier(cluster, tmp_path):
    args = ["--remote-url", cluster.url, "--remote-timeout-ms", "2000"]
    with running(tmp_path.name, extra_args=args) as s:
        src = peer.own_buffer()
        src[:] = peer.pattern(12)
        c = umbp.StandaloneClient(s.endpoint, startup_timeout_ms=5000, client_name="clear")
        with c:
            c.register_memory(src.ctypes.data, src.nbytes)
            lid = c.register_layout(peer.layout(src))
            k = peer.keys(12)
            assert c.store(lid, 0, list(range(peer.BLOCKS)), k).wait() == ["done"] * peer.BLOCKS
            wait_until(
                lambda: len(cluster.keys()) == peer.BLOCKS, what="the server's remote writes"
            )
            # `umbp clear` (every namespace) leaves the shared remote tier alone...
            s.umbp("clear")
            assert len(cluster.keys()) == peer.BLOCKS
            assert c.exists(k) == [True] * peer.BLOCKS  # ...so lookups fetch them back
            # ...and `--namespace` clears that namespace there too.
            s.umbp("clear", "--namespace", peer.NAMESPACE)
            assert cluster.keys() == []
            assert c.exists(k) == [False] * peer.BLOCKS
