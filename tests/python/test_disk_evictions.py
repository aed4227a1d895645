"""Every object the pool evicts with a disk tier under it is accounted for (docs/disk.md,
"Write rate"): the pool's `evictions` equal the disk tier's `evicted_queued` +
`evicted_dropped` + `already_present`, exactly, whichever path evicted it. Bursts of 16 MiB
transfers into a 32 MiB pool make most evictions the synchronous ones of stores that find
the pool full; embedded stores and a real `umbp_standalone_server`, both eviction policies."""

import mmap
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import umbp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import Server, server_binary, short_dir  # noqa: E402

LAYERS, BLOCKS, PIECE = 4, 8, 4 << 20  # one block: 16 MiB
SEEDS = 5  # 40 objects of 16 MiB through a 32 MiB pool (the server's: 64 MiB)
POLICIES = ["s3fifo", "lru"]


def kv_buffer():
    """A KV cache in a private anonymous mapping (whole pages, as the standalone client needs);
    block b of layer l holds the byte b * 16 + l."""
    m = mmap.mmap(-1, LAYERS * BLOCKS * PIECE, flags=mmap.MAP_PRIVATE)
    buf = np.frombuffer(m, dtype=np.uint8).reshape(LAYERS, BLOCKS, PIECE)
    for layer in range(LAYERS):
        for b in range(BLOCKS):
            buf[layer, b, :] = b * 16 + layer
    return buf


def layout(buf):
    s = buf.strides
    base = buf.ctypes.data
    return [[(base + layer * s[0], BLOCKS, s[1], PIECE) for layer in range(LAYERS)]]


def keys(seed, blocks=range(BLOCKS)):
    h = [seed.to_bytes(4, "little") + i.to_bytes(4, "little") + b"\x77" * 24 for i in blocks]
    return umbp.KeyBuilder("disk-evictions", tp=0).keys(0, h)


def burst(target, lid):
    """Stores every seed's blocks, then the first seeds again (their second eviction finds them
    on disk). A block may answer `pool_full` while the pool's room is all being written or
    waiting for the disk (not an eviction): stored again, a few times."""
    for seed in [*range(SEEDS), 0, 1]:
        todo = list(range(BLOCKS))
        for _ in range(50):
            got = target.store(lid, 0, todo, keys(seed, todo)).wait()
            assert set(got) <= {"done", "already_present", "pool_full"}, got
            todo = [b for b, st in zip(todo, got, strict=True) if st == "pool_full"]
            if not todo:
                break
            time.sleep(0.01)


def wait_until(cond, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.05)


def check_identity(pool_evictions, ds, tag):
    assert pool_evictions >= 2 * BLOCKS, (tag, pool_evictions, ds)
    accounted = ds["evicted_queued"] + ds["evicted_dropped"] + ds["already_present"]
    print(
        f"{tag}: {pool_evictions} evictions = {ds['evicted_queued']} queued "
        f"({ds['evicted_copied']} copied) + {ds['evicted_dropped']} dropped "
        f"+ {ds['already_present']} on disk already"
    )
    assert pool_evictions == accounted, (tag, pool_evictions, ds)
    assert ds["evicted_copied"] <= ds["evicted_queued"], (tag, ds)


@pytest.mark.parametrize("policy", POLICIES)
def test_embedded_bursts_lose_no_eviction(tmp_path, policy):
    s = umbp.EmbeddedStore(
        32 << 20,
        prefault=False,
        num_workers=1,
        eviction_policy=policy,
        disk_dir=str(tmp_path),
        disk_capacity_bytes=2 << 30,
    )
    try:
        buf = kv_buffer()
        s.register_memory(buf.ctypes.data, buf.nbytes)
        burst(s, s.register_layout(layout(buf)))
        assert s.flush_disk(60_000)
        check_identity(s.stats()["evictions"], s.disk_stats(), policy)
    finally:
        s.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_server_bursts_lose_no_eviction(tmp_path, policy):
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    sock_dir = short_dir(tmp_path.name + "ev")
    args = ["--eviction-policy", policy, "--disk-dir", str(tmp_path)]
    args += ["--disk-capacity", "2GiB"]
    server = Server(binary, sock_dir, capacity="64MiB", extra_args=args)
    try:
        server.start()
        buf = kv_buffer()
        with umbp.StandaloneClient(
            server.endpoint, startup_timeout_ms=10000, client_name="ev"
        ) as c:
            c.register_memory(buf.ctypes.data, buf.nbytes)
            burst(c, c.register_layout(layout(buf)))
        wait_until(
            lambda: server.stats()["disk"]["backlog_bytes"] == 0, what="the disk backlog drained"
        )
        st = server.stats()
        check_identity(st["evictions"], st["disk"], policy)
        text = server.umbp("stats")
        assert "copied out for full-pool stores" in text, text
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
