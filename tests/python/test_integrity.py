"""End-to-end integrity (`integrity`: off / sample / all) with real damage: bits flipped in
the pool (the hidden `_debug_corrupt`, and from outside the standalone server through its
pool's memfd), in a disk segment file, and in a Redis value (redis-cli). Every load of a
damaged object fails (vLLM would recompute the block) and is counted in `corrupt_detected`;
every byte that is loaded equals what was stored: 0 wrong restores."""

import socket
import sys
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


def attach(store, cache):
    store.register_memory(cache.base, cache.buf.nbytes)
    return store.register_layout(cache.layout())


def check_restores(statuses, dst, src, targets, damaged, fill=0, bad="failed"):
    """Each damaged block's load answered `bad` ("failed": found damaged in the pool;
    "missing": refused by the disk or remote tier, so never in the pool) and left the block as
    it was; every other block equals the source."""
    for i, (st, t) in enumerate(zip(statuses, targets)):
        if i in damaged:
            assert st == bad, (i, st)
            assert dst.block(t) == bytes([fill]) * len(dst.block(t)), f"block {i} was written"
        else:
            assert st == "done", (i, st)
            assert dst.block(t) == src.block(i), f"block {i} restored wrong bytes"


@pytest.mark.parametrize("integrity", ["all", "sample"])
def test_a_flipped_pool_byte_fails_that_load_and_every_other_byte_is_right(integrity):
    kb = umbp.KeyBuilder("integrity-pool", tp=0)
    keys = kb.keys(0, hashes(range(24)))
    src, dst = KvCache(fill_seed=3), KvCache()
    # sample 1 in 1: verifies every load, through the sampling's path.
    s = umbp.EmbeddedStore(
        16 << 20, num_workers=2, prefault=False, integrity=integrity, integrity_sample_every=1
    )
    try:
        lid = attach(s, src)
        ld = attach(s, dst)
        assert s.store(lid, 0, list(range(24)), keys).wait() == ["done"] * 24
        damaged = {2, 11, 23}
        for i in damaged:
            assert s._debug_corrupt(keys[i : i + 1], offset=1000 * i, mask=0x80) == 1
        targets = list(range(30, 54))
        t = s.load(ld, 0, targets, keys)
        check_restores(t.wait(), dst, src, targets, damaged)
        assert sorted((i, kind) for i, kind, _ in t.failures()) == [
            (i, "corrupt") for i in sorted(damaged)
        ]
        st = s.stats()
        assert (st["integrity"], st["corrupt_detected"], st["verified"]) == (integrity, 3, 24)
        # The damaged objects are gone: a lookup misses them, the rest still hits.
        assert s.exists(keys) == [i not in damaged for i in range(24)]
    finally:
        s.close()


def test_off_verifies_nothing():
    kb = umbp.KeyBuilder("integrity-off", tp=0)
    keys = kb.keys(0, hashes(range(4)))
    src, dst = KvCache(fill_seed=4), KvCache()
    s = umbp.EmbeddedStore(16 << 20, num_workers=2, prefault=False, integrity="off")
    try:
        lid = attach(s, src)
        ld = attach(s, dst)
        s.store(lid, 0, list(range(4)), keys).wait()
        assert s.load(ld, 0, [10, 11, 12, 13], keys).wait() == ["done"] * 4
        assert all(dst.block(10 + i) == src.block(i) for i in range(4))
        st = s.stats()
        assert (st["integrity"], st["verified"], st["corrupt_detected"]) == ("off", 0, 0)
    finally:
        s.close()


def test_the_default_is_off_and_a_bad_setting_names_the_option():
    s = umbp.EmbeddedStore(16 << 20, prefault=False)
    try:
        st = s.stats()
        assert (st["integrity"], st["integrity_sample_every"]) == ("off", 0)
    finally:
        s.close()
    with pytest.raises(umbp.ConfigError, match="integrity"):
        umbp.EmbeddedStore(16 << 20, prefault=False, integrity="most")
    with pytest.raises(umbp.ConfigError, match="integrity_sample_every"):
        umbp.EmbeddedStore(16 << 20, prefault=False, integrity_sample_every=0)


def test_a_flipped_byte_in_a_disk_segment_is_a_miss_and_the_rest_restores(tmp_path):
    kb = umbp.KeyBuilder("integrity-disk", tp=0)
    keys = kb.keys(0, hashes(range(16)))
    src, dst = KvCache(fill_seed=6), KvCache()

    def store():
        return umbp.EmbeddedStore(
            16 << 20,
            num_workers=2,
            prefault=False,
            integrity="all",
            disk_dir=tmp_path,
            disk_capacity_bytes=64 << 20,
            disk_write="eager",
        )

    s = store()
    try:
        lid = attach(s, src)
        assert s.store(lid, 0, list(range(16)), keys).wait() == ["done"] * 16
        assert s.flush_disk(10_000)
    finally:
        s.close()  # a clean close: everything is on disk
    s = store()  # a restart: the pool is empty, the disk holds every block
    try:
        lid = attach(s, dst)
        assert s.stats()["objects"] == 0
        assert s._debug_corrupt(keys[6:7], offset=5000, mask=0x01, tier="disk") == 1
        assert s.prefix_hits(keys) == 6
        assert s.exists(keys) == [i != 6 for i in range(16)]
        targets = list(range(40, 56))
        statuses = s.load(lid, 0, targets, keys).wait()
        check_restores(statuses, dst, src, targets, {6}, bad="missing")
        assert s.stats()["corrupt_detected"] == 1
        assert s.disk_stats()["corrupt"] == 1
    finally:
        s.close()


def test_a_damaged_redis_value_is_a_miss_and_the_rest_restores():
    kb = umbp.KeyBuilder("integrity-remote", tp=0)
    keys = kb.keys(0, hashes(range(8)))
    src, dst = KvCache(fill_seed=7), KvCache()
    with redis_cluster(1) as r:

        def node():
            return umbp.EmbeddedStore(
                16 << 20,
                num_workers=2,
                prefault=False,
                integrity="all",
                remote_url=r.url,
                remote_timeout_ms=2000,
            )

        a = node()
        try:
            la = attach(a, src)
            assert a.store(la, 0, list(range(8)), keys).wait() == ["done"] * 8
            assert a.flush_remote(10_000)
        finally:
            a.close()
        name = "umbp:v1:" + keys.to_bytes()[3 * 64 : 4 * 64].hex()
        # One payload byte (after the 88-byte header) overwritten in Redis.
        assert r.cli(r.ports[0], "setrange", name, str(88 + 777), "Z").strip().isdigit()
        b = node()
        try:
            lb = attach(b, dst)
            assert b.prefix_hits(keys) == 3
            assert b.exists(keys) == [i != 3 for i in range(8)]
            targets = list(range(20, 28))
            statuses = b.load(lb, 0, targets, keys).wait()
            check_restores(statuses, dst, src, targets, {3}, bad="missing")
            # Each lookup that fetched it refused it again (it never entered the pool).
            corrupt = b.remote_stats()["corrupt"]
            assert corrupt >= 1 and b.stats()["corrupt_detected"] == corrupt
        finally:
            b.close()


def flip_in_process(pid, needle, delta, mask):
    """Flips the bits of `mask` at `delta` bytes past the one place `needle` occurs in the
    private anonymous memory of process `pid` (the standalone server's pool: clients' shared
    buffers are shared mappings, never searched), from outside it, through /proc/PID/mem."""
    found = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
        for line in maps:
            f = line.split()
            if f[1] != "rw-p" or len(f) > 5:  # private, writable, no file or name
                continue
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            mem.seek(lo)
            try:
                data = mem.read(hi - lo)
            except OSError:
                continue
            at = data.find(needle)
            while at >= 0:
                found.append(lo + at)
                at = data.find(needle, at + 1)
        assert len(found) == 1, f"the block's bytes are at {len(found)} places"
        mem.seek(found[0] + delta)
        b = mem.read(1)[0]
        mem.seek(found[0] + delta)
        mem.write(bytes([b ^ mask]))


def test_the_standalone_server_fails_a_damaged_load_and_counts_it(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{probe.getsockname()[1]}"
    args = ["--integrity", "all", "--metrics-address", metrics]
    with running(tmp_path.name, extra_args=args) as server:
        src, dst = peer.own_buffer(), peer.own_buffer()
        src[:] = peer.pattern(21)
        c = umbp.StandaloneClient(server.endpoint, startup_timeout_ms=5000, client_name="w")
        with c:
            c.register_memory(src.ctypes.data, src.nbytes)
            c.register_memory(dst.ctypes.data, dst.nbytes)
            ls = c.register_layout(peer.layout(src))
            ld = c.register_layout(peer.layout(dst))
            k = peer.keys(21)
            assert c.store(ls, 0, list(range(peer.BLOCKS)), k).wait() == ["done"] * peer.BLOCKS
            # Block 9's object, found in the server's pool by its first layer's bytes, and
            # one bit of its third layer flipped from outside the server.
            flip_in_process(server.proc.pid, src[0, 9].tobytes(), 2 * peer.PIECE + 17, 0x40)
            t = c.load(ld, 0, list(range(peer.BLOCKS)), k)
            statuses = t.wait()
        for b, st in enumerate(statuses):
            if b == 9:
                assert st == "failed"
                assert not dst[:, 9].any(), "nothing of the damaged block was copied"
            else:
                assert st == "done" and np.array_equal(dst[:, b], src[:, b]), b
        st = server.stats()
        assert (st["integrity"], st["corrupt_detected"]) == ("all", 1), st
        assert st["verified"] == peer.BLOCKS
        assert "corrupt detected     1" in server.umbp("stats")
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            prom = r.read().decode()
        assert "umbp_corrupt_detected_total 1" in prom, prom
        assert f"umbp_pool_verified_total {peer.BLOCKS}" in prom, prom
