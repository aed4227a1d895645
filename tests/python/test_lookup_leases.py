"""Hits a lookup reports stay loadable until their load (docs/disk.md, "Lookup leases"):
after a restart, lookups promote objects from the disk tier while another writer churns the
pool with new objects, and every block a lookup found loads. Embedded stores and a real
`umbp_standalone_server`, both eviction policies."""

import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer

import umbp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import Server, server_binary, short_dir  # noqa: E402

SEEDS = range(1, 17)  # 16 x 512 KiB on disk, twice the 4 MiB pool
CHURN = range(100, 400)
POLICIES = ["s3fifo", "lru"]


def store_seed(target, lid, buf, seed):
    buf[:] = peer.pattern(seed)
    got = target.store(lid, 0, list(range(peer.BLOCKS)), peer.keys(seed)).wait()
    assert set(got) <= {"done", "already_present", "pool_full"}, got


def churn(target, stop):
    """Stores new seeds until `stop` is set (its own buffer and layout)."""
    buf = peer.own_buffer()
    target.register_memory(buf.ctypes.data, buf.nbytes)
    lid = target.register_layout(peer.layout(buf))
    for seed in CHURN:
        if stop.is_set():
            return
        store_seed(target, lid, buf, seed)


def look_up_and_load(target):
    """For each stored seed: a prefix lookup, then a load of what it found. Returns (hits,
    blocks that did not load)."""
    dst = peer.own_buffer()
    target.register_memory(dst.ctypes.data, dst.nbytes)
    lid = target.register_layout(peer.layout(dst))
    hits = lost = 0
    for _ in range(3):
        for seed in SEEDS:
            keys = peer.keys(seed)
            n = target.prefix_hits(keys)
            if n == 0:
                continue
            hits += n
            dst[:] = 0
            h = peer.hashes(seed)
            got = target.load(
                lid, 0, list(range(n)), umbp.KeyBuilder(peer.NAMESPACE, tp=0).keys(0, h[:n])
            ).wait()
            want = peer.pattern(seed)
            for b, outcome in enumerate(got):
                if outcome == "done":
                    assert np.array_equal(dst[:, b, :], want[:, b, :]), (seed, b)
                else:
                    lost += 1
    return hits, lost


def fill_and_close(target_factory):
    t = target_factory()
    buf = peer.own_buffer()
    t.register_memory(buf.ctypes.data, buf.nbytes)
    lid = t.register_layout(peer.layout(buf))
    for seed in SEEDS:
        store_seed(t, lid, buf, seed)
    return t


def run_with_churn(reader, writer):
    stop = threading.Event()
    th = threading.Thread(target=churn, args=(writer, stop))
    th.start()
    try:
        return look_up_and_load(reader)
    finally:
        stop.set()
        th.join()


@pytest.mark.parametrize("policy", POLICIES)
def test_embedded_hits_after_a_restart_load_while_stores_churn(tmp_path, policy):
    def make():
        return umbp.EmbeddedStore(
            4 << 20,
            segment_bytes=64 << 10,
            prefault=False,
            num_workers=2,
            eviction_policy=policy,
            disk_dir=str(tmp_path),
            disk_capacity_bytes=64 << 20,
            disk_segment_bytes=1 << 20,
        )

    fill_and_close(make).close()
    s = make()
    try:
        assert s.disk_stats()["rebuilt_objects"] == len(SEEDS) * peer.BLOCKS
        hits, lost = run_with_churn(s, s)
        st = s.stats()
        assert hits > 0 and st["leases"] >= hits, (hits, st)
        assert lost == 0, (hits, lost, st)
        assert st["leases_expired"] == 0, st
    finally:
        s.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_server_hits_after_a_restart_load_while_stores_churn(tmp_path, policy):
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    sock_dir = short_dir(tmp_path.name + "ls")
    args = ["--eviction-policy", policy, "--disk-dir", str(tmp_path)]
    args += ["--disk-capacity", "64MiB"]
    server = Server(binary, sock_dir, capacity="4MiB", extra_args=args)

    def client(name):
        return umbp.StandaloneClient(server.endpoint, startup_timeout_ms=10000, client_name=name)

    try:
        server.start()
        fill_and_close(lambda: client("fill")).close()
        server.stop()
        server.start()
        assert server.stats()["disk"]["rebuilt_objects"] == len(SEEDS) * peer.BLOCKS
        with client("reader") as r, client("writer") as w:
            hits, lost = run_with_churn(r, w)
        st = server.stats()
        assert hits > 0 and st["leases"] >= hits, (hits, st)
        assert lost == 0, (hits, lost, st)
        assert st["leases_expired"] == 0, st
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
