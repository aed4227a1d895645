"""Pins (issue 50's first part): a pinned object stays in the pool through a churn of stores
forty times its size and loads byte-exact afterwards, while an unpinned one stored at the same
time is evicted; pins are bounded per namespace, renewable and released, and every one is
counted. A real EmbeddedStore of 4 MiB (both eviction policies), and a real
`umbp_standalone_server` whose pins, made by one engine, outlive it and serve another."""

import json
import socket
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer

import umbp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import Server, server_binary, short_dir  # noqa: E402

POLICIES = ["s3fifo", "lru"]


def store_seed(s, lid, buf, seed):
    buf[:] = peer.pattern(seed)
    got = s.store(lid, 0, list(range(peer.BLOCKS)), peer.keys(seed)).wait()
    assert set(got) <= {"done", "already_present"}, got


@pytest.mark.parametrize("policy", POLICIES)
def test_a_pinned_prefix_survives_a_churn_that_evicts_an_unpinned_one(policy):
    s = umbp.EmbeddedStore(
        4 << 20, segment_bytes=64 << 10, prefault=False, num_workers=2, eviction_policy=policy
    )
    try:
        buf = peer.own_buffer()
        s.register_memory(buf.ctypes.data, buf.nbytes)
        lid = s.register_layout(peer.layout(buf))
        # Seeds 1 and 2: 32 objects of 16 KiB each (512 KiB); only seed 1 is pinned.
        store_seed(s, lid, buf, 1)
        store_seed(s, lid, buf, 2)
        assert s.pin(peer.keys(1), 60.0) == ["pinned"] * peer.BLOCKS
        # Forty other seeds (20 MiB through a 4 MiB pool).
        for seed in range(100, 140):
            store_seed(s, lid, buf, seed)
        assert s.stats()["evictions"] > 0
        assert all(s.exists(peer.keys(1))), "a pinned object was evicted"
        assert not all(s.exists(peer.keys(2))), "the churn did not reach the unpinned seed"
        buf[:] = 0
        got = s.load(lid, 0, list(range(peer.BLOCKS)), peer.keys(1)).wait()
        assert got == ["done"] * peer.BLOCKS
        assert np.array_equal(buf, peer.pattern(1))
        # Pinning again renews; unpinning releases every pin; a key not in the pool is missing.
        assert s.pin(peer.keys(1)[:4], 60.0) == ["renewed"] * 4
        assert s.unpin(peer.keys(1)) == peer.BLOCKS
        assert s.unpin(peer.keys(1)) == 0
        assert s.pin(peer.keys(999)[:2], 60.0) == ["missing", "missing"]
        st = s.pin_stats()
        assert st["pinned"] == st["pinned_bytes"] == 0, st
        assert sorted(st) == sorted(f[0] for f in dict(umbp.counter_fields())["pins"])
        assert (st["granted"], st["renewed"], st["released"]) == (peer.BLOCKS, 4, peer.BLOCKS)
    finally:
        s.close()


def test_pins_are_bounded_per_namespace_and_counted():
    # A namespace may pin a quarter of the pool: 1 MiB of 4, 64 objects of 16 KiB.
    s = umbp.EmbeddedStore(4 << 20, segment_bytes=64 << 10, prefault=False, num_workers=2)
    try:
        buf = peer.own_buffer()
        s.register_memory(buf.ctypes.data, buf.nbytes)
        lid = s.register_layout(peer.layout(buf))
        for seed in (1, 2, 3):
            store_seed(s, lid, buf, seed)
        assert s.pin(peer.keys(1), 60.0) == ["pinned"] * peer.BLOCKS
        assert s.pin(peer.keys(2), 60.0) == ["pinned"] * peer.BLOCKS
        assert s.pin(peer.keys(3)[:3], 60.0) == ["refused"] * 3
        st = s.pin_stats()
        assert (st["pinned"], st["pinned_bytes"], st["refused"]) == (64, 1 << 20, 3), st
        # An explicit evict still removes a pinned object, and ends its pin.
        assert s.evict(peer.keys(1)[:2]) == 2
        assert s.pin_stats()["ended"] == 2
        assert s.pin(peer.keys(3)[:2], 60.0) == ["pinned", "pinned"]
        # A clear ends every pin.
        s.clear()
        st = s.pin_stats()
        assert (st["pinned"], st["pinned_bytes"], st["ended"]) == (0, 0, 2 + 64), st
    finally:
        s.close()


def test_a_pin_without_a_positive_ttl_is_refused_with_the_reason():
    s = umbp.EmbeddedStore(1 << 20, prefault=False)
    try:
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            with pytest.raises(umbp.ConfigError, match="ttl_s"):
                s.pin(peer.keys(1)[:1], bad)
    finally:
        s.close()


def test_server_pins_outlive_the_engine_that_made_them_and_bound_each_namespace(tmp_path):
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    # A namespace may pin 768 KiB: 48 objects of 16 KiB.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{probe.getsockname()[1]}"
    server = Server(
        binary,
        short_dir(tmp_path.name + "pin"),
        capacity="4MiB",
        extra_args=["--pin-namespace-bytes", "768KiB", "--metrics-address", metrics],
    )

    def client(name):
        c = umbp.StandaloneClient(server.endpoint, startup_timeout_ms=10000, client_name=name)
        buf = peer.own_buffer()
        c.register_memory(buf.ctypes.data, buf.nbytes)
        return c, buf, c.register_layout(peer.layout(buf))

    try:
        server.start()
        a, buf, lid = client("engine-a")
        store_seed(a, lid, buf, 1)
        store_seed(a, lid, buf, 2)
        assert a.pin(peer.keys(1), 60.0) == ["pinned"] * peer.BLOCKS
        # Past the bound, the pinned part is the prefix's beginning.
        got = a.pin(peer.keys(2), 60.0)
        assert got == ["pinned"] * 16 + ["refused"] * 16, got
        a.close()  # the engine that pinned is gone; its pins stay
        b, buf, lid = client("engine-b")
        for seed in range(100, 140):  # 20 MiB through the 4 MiB pool
            store_seed(b, lid, buf, seed)
        assert b.stats()["evictions"] > 0
        buf[:] = 0
        got = b.load(lid, 0, list(range(peer.BLOCKS)), peer.keys(1)).wait()
        assert got == ["done"] * peer.BLOCKS, "a pinned block was evicted"
        assert np.array_equal(buf, peer.pattern(1))
        assert b.pin(peer.keys(1)[:2], 60.0) == ["renewed"] * 2
        # The server's pin counters, on every surface of the one model: the client's dict,
        # `umbp stats --json`, its text and Prometheus.
        st = b.stats()["pins"]
        assert (st["pinned"], st["granted"], st["renewed"], st["refused"]) == (48, 48, 2, 16), st
        assert server.stats()["pins"] == st
        assert "pins                 48 objects" in server.umbp("stats")
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            prom = r.read().decode()
        assert "\numbp_pins_pinned 48\n" in prom and "\numbp_pins_granted_total 48\n" in prom
        for name, _kind, series, _help in dict(umbp.counter_fields())["pins"]:
            assert name in st and f"\n{series} " in prom, name
        # `umbp pins` lists them by namespace, with when they run out.
        listed = json.loads(server.umbp("pins", "--json"))["namespaces"]
        assert len(listed) == 1, listed
        (ns,) = listed
        assert (ns["objects"], ns["bytes"]) == (48, 768 << 10), ns
        assert 0 < ns["soonest_ms"] <= ns["latest_ms"] <= 60_000, ns
        mine = json.loads(server.umbp("pins", "--json", "--namespace", peer.NAMESPACE))
        assert [(n["namespace_id"], n["objects"]) for n in mine["namespaces"]] == [
            (ns["namespace_id"], 48)
        ]
        other = json.loads(server.umbp("pins", "--json", "--namespace", "someone-else"))
        assert other["namespaces"] == []
        assert "48" in server.umbp("pins")
        assert b.unpin(peer.keys(1)) == peer.BLOCKS
        with pytest.raises(umbp.ConfigError, match="ttl_s"):
            b.pin(peer.keys(1)[:1], 0.0)
        with pytest.raises(umbp.ConfigError, match="24 h"):
            b.pin(peer.keys(1)[:1], 25 * 3600.0)
        b.close()
    finally:
        server.stop()
