"""The disk tier (docs/disk.md) on real files: embedded stores with a tiny pool over a disk
directory, and real `umbp_standalone_server` processes started with --disk-dir, stopped and
started again on the same directory."""

import contextlib
import errno
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer

import umbp
from conftest import BLOCKS, KvCache, hashes
from umbp.errors import ConfigError
from umbp.vllm.config import ConnectorConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import Server, server_binary, short_dir  # noqa: E402

SEEDS = 8  # 8 caches of 512 KiB: twice the high watermark of a 4 MiB pool at 0.5


def wait_until(cond, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout} s"
        time.sleep(0.02)


def small_store(disk_dir, **kw):
    """A 4 MiB pool evicting above 2 MiB down to 1 MiB, over a 64 MiB disk tier."""
    return umbp.EmbeddedStore(
        4 << 20,
        high_watermark=0.5,
        low_watermark=0.25,
        segment_bytes=64 << 10,
        prefault=False,
        num_workers=2,
        disk_dir=str(disk_dir),
        disk_capacity_bytes=64 << 20,
        disk_segment_bytes=1 << 20,
        **kw,
    )


def seed_hashes(seed):
    return hashes(range(seed * 1000, seed * 1000 + BLOCKS))


def seed_keys(seed, blocks=None):
    h = seed_hashes(seed)
    return umbp.KeyBuilder("disk-py", tp=0).keys(0, h if blocks is None else [h[b] for b in blocks])


def fill(store):
    """Stores SEEDS caches of BLOCKS blocks; waits until the evictor's objects are on disk.
    Returns the caches by seed."""
    caches = {}
    for seed in range(SEEDS):
        src = KvCache(fill_seed=seed + 1)
        store.register_memory(src.base, src.buf.nbytes)
        lid = store.register_layout(src.layout())
        assert store.store(lid, 0, list(range(BLOCKS)), seed_keys(seed)).wait() == ["done"] * BLOCKS
        caches[seed] = src
    wait_until(lambda: store.disk_stats()["writes"] > 0, what="disk writes")
    assert store.flush_disk(30_000)
    return caches


def check_present_bytes(store, caches):
    """Loads every key of every seed that lookups find (promoting from disk) and checks its
    bytes; returns how many keys were found."""
    found = 0
    for seed, src in caches.items():
        keys = seed_keys(seed)
        present = store.exists(keys)
        blocks = [b for b, p in enumerate(present) if p]
        if not blocks:
            continue
        dst = KvCache()
        region = store.register_memory(dst.base, dst.buf.nbytes)
        lid = store.register_layout(dst.layout())
        got = store.load(lid, 0, blocks, seed_keys(seed, blocks)).wait()
        store.deregister_memory(region)
        for b, outcome in zip(blocks, got, strict=True):
            if outcome == "done":
                assert dst.block(b) == src.block(b), f"seed {seed} block {b}: wrong bytes"
                found += 1
    return found


def test_evicted_objects_come_back_from_disk_byte_exact(tmp_path):
    s = small_store(tmp_path / "disk")
    try:
        caches = fill(s)
        ds = s.disk_stats()
        assert ds["writes"] > 0 and ds["objects"] > 0 and ds["corrupt"] == 0, ds
        assert s.stats()["disk"]["writes"] == ds["writes"]
        # Embedded mode's dicts hold every counter of the disk group's model, a flag as a bool.
        for name, kind, _series, _help in dict(umbp.counter_fields())["disk"]:
            assert name in ds and name in s.stats()["disk"], name
            assert isinstance(ds[name], bool) == (kind == "flag"), name
        keys0 = seed_keys(0)
        # Seed 0 was stored first: the evictor took it; lookups promote it back from disk.
        assert s.stats()["objects"] < SEEDS * BLOCKS
        assert s.prefix_hits(keys0) == BLOCKS
        assert s.disk_stats()["hits"] >= 1
        dst = KvCache()
        region = s.register_memory(dst.base, dst.buf.nbytes)
        lid = s.register_layout(dst.layout())
        assert s.load(lid, 0, list(range(BLOCKS)), keys0).wait() == ["done"] * BLOCKS
        assert np.array_equal(dst.buf, caches[0].buf)
        s.deregister_memory(region)
        assert check_present_bytes(s, caches) > 0
        # clear() empties the disk too: nothing comes back.
        s.clear()
        assert s.exists(keys0) == [False] * BLOCKS
        assert s.disk_stats()["objects"] == 0
    finally:
        s.close()


def test_a_corrupted_segment_is_a_miss_never_wrong_bytes(tmp_path):
    d = tmp_path / "disk"
    s = small_store(d)
    try:
        caches = fill(s)
        on_disk = s.disk_stats()["objects"]
    finally:
        s.close()
    segments = sorted(d.glob("seg-*.dat"))
    assert segments, list(d.iterdir())
    # Flip a byte in the middle of every 4 KiB page of every segment: every object's header or
    # bytes no longer match its checksum.
    for seg in segments:
        data = bytearray(seg.read_bytes())
        for off in range(2048, len(data), 4096):
            data[off] ^= 0xFF
        seg.write_bytes(bytes(data))
    s = small_store(d)
    try:
        # Closing wrote the pool's objects too.
        assert s.disk_stats()["rebuilt_objects"] >= on_disk
        assert check_present_bytes(s, caches) == 0
        ds = s.disk_stats()
        assert ds["corrupt"] >= 1 and ds["hits"] == 0, ds
    finally:
        s.close()


def test_a_directory_removed_while_running_misses_and_never_crashes(tmp_path):
    d = tmp_path / "disk"
    s = small_store(d)
    try:
        caches = fill(s)
        shutil.rmtree(d)
        # New segments cannot be made now: later evictions are counted write errors or drops.
        more = {seed + SEEDS: KvCache(fill_seed=seed + 100) for seed in range(SEEDS)}
        for seed, src in more.items():
            s.register_memory(src.base, src.buf.nbytes)
            lid = s.register_layout(src.layout())
            assert s.store(lid, 0, list(range(BLOCKS)), seed_keys(seed)).wait() == ["done"] * BLOCKS
        assert s.flush_disk(30_000)
        # Every lookup answers: a hit loads the right bytes, the rest are misses.
        check_present_bytes(s, {**caches, **more})
        ds = s.disk_stats()
        assert ds["write_errors"] + ds["writes_dropped"] >= 1, ds
    finally:
        s.close()


def test_a_missing_or_unusable_directory_is_an_error_naming_the_option(tmp_path):
    with pytest.raises(ConfigError, match="disk_dir"):
        ConnectorConfig.parse({"disk_dir": str(tmp_path / "absent")})
    with pytest.raises(ConfigError, match="--disk-dir"):
        ConnectorConfig.parse({"mode": "standalone", "endpoint": "/x.sock", "disk_dir": "/tmp"})
    # A directory nobody (root included) can create files in.
    with pytest.raises(Exception, match="disk tier directory /proc/self/fdinfo"):
        small_store("/proc/self/fdinfo")
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    sock = short_dir(tmp_path.name + "x") / "umbp.sock"
    for d, says in [
        (tmp_path / "absent", "not an existing directory"),
        ("/proc/self/fdinfo", "cannot be written"),
    ]:
        out = subprocess.run(
            [str(binary), "--address", str(sock), "--capacity", "16MiB", "--prefault", "false"]
            + ["--disk-dir", str(d), "--disk-capacity", "64MiB"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode != 0
        assert "--disk-dir" in out.stderr and says in out.stderr, out.stderr
    shutil.rmtree(sock.parent, ignore_errors=True)


def store_seed(client, buf, seed):
    buf[:] = peer.pattern(seed)
    lid = client.register_layout(peer.layout(buf))
    assert (
        client.store(lid, 0, list(range(peer.BLOCKS)), peer.keys(seed)).wait()
        == ["done"] * peer.BLOCKS
    )


def test_a_restarted_server_finds_everything_the_last_one_held(tmp_path):
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    disk = tmp_path / "disk"
    disk.mkdir()
    sock_dir = short_dir(tmp_path.name + "r")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics = f"127.0.0.1:{probe.getsockname()[1]}"
    args = ["--high-watermark", "0.5", "--low-watermark", "0.25", "--disk-dir", str(disk)]
    args += ["--disk-capacity", "64MiB", "--metrics-address", metrics]
    server = Server(binary, sock_dir, capacity="4MiB", extra_args=args)
    seeds = range(1, 9)  # 8 x 512 KiB through a 4 MiB pool evicting above 2 MiB
    try:
        server.start()
        buf = peer.own_buffer()
        c = umbp.StandaloneClient(server.endpoint, startup_timeout_ms=10000, client_name="w")
        with c:
            c.register_memory(buf.ctypes.data, buf.nbytes)
            for seed in seeds:
                store_seed(c, buf, seed)
            # The client's dict of the server's disk group: every counter of the model.
            names = [f[0] for f in dict(umbp.counter_fields())["disk"]]
            assert sorted(c.stats()["disk"]) == sorted(names), c.stats()["disk"]
        wait_until(lambda: server.stats()["disk"]["writes"] > 0, what="the server's disk writes")
        wait_until(
            lambda: server.stats()["disk"]["backlog_bytes"] == 0, what="the disk backlog drained"
        )
        spilled = server.stats()["disk"]["objects"]
        assert spilled > 0
        text = server.umbp("stats")
        assert "disk tier" in text and "off (--disk-dir)" not in text, text
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10) as r:
            prom = r.read().decode()
        for series in ("umbp_disk_objects", "umbp_disk_writes_total", "umbp_disk_drops_total"):
            assert f"\n{series} " in prom, prom
        # Every counter of the disk group on every surface: the Python dict, `umbp stats
        # --json`, Prometheus (one model renders them all; a counter missing anywhere fails).
        fields = dict(umbp.counter_fields())["disk"]
        as_json = json.loads(server.umbp("stats", "--json"))["disk"]
        for name, _kind, series, _help in fields:
            assert name in server.stats()["disk"] and name in as_json, name
            assert f"\n{series} " in prom, series
        # And the pool's group, flat in the dict and in `umbp stats --json`.
        top = json.loads(server.umbp("stats", "--json"))
        for name, _kind, series, _help in dict(umbp.counter_fields())["pool"]:
            assert name in server.stats() and name in top, name
            assert f"\n{series} " in prom, series
        server.stop()  # SIGTERM, exit 0
        # A new server on the same directory, with room for all it promotes: the spilled
        # objects answer lookups and load.
        server.capacity = "16MiB"
        server.start()
        st = server.stats()
        # What was spilled, and what the pool held, written when SIGTERM closed it.
        stored = len(seeds) * peer.BLOCKS
        assert st["objects"] == 0 and st["disk"]["rebuilt_objects"] == stored, st["disk"]
        dst = peer.own_buffer()
        c = umbp.StandaloneClient(server.endpoint, startup_timeout_ms=10000, client_name="r")
        found = 0
        with c:
            c.register_memory(dst.ctypes.data, dst.nbytes)
            lid = c.register_layout(peer.layout(dst))
            for seed in seeds:
                keys = peer.keys(seed)
                blocks = [b for b, p in enumerate(c.exists(keys)) if p]
                if not blocks:
                    continue
                dst[:] = 0
                h = peer.hashes(seed)
                subset = umbp.KeyBuilder(peer.NAMESPACE, tp=0).keys(0, [h[b] for b in blocks])
                got = c.load(lid, 0, blocks, subset).wait()
                want = peer.pattern(seed)
                for b, outcome in zip(blocks, got, strict=True):
                    if outcome == "done":
                        assert np.array_equal(dst[:, b, :], want[:, b, :]), (seed, b)
                        found += 1
        assert found == stored, (found, stored)
        assert server.stats()["disk"]["hits"] == stored
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_eager_writes_reach_disk_before_eviction_and_evict_forgets_both_copies(tmp_path):
    s = small_store(tmp_path / "disk", disk_write="eager")
    try:
        caches = {}
        for seed in range(2):  # 1 MiB: below the high watermark, nothing is evicted
            src = KvCache(fill_seed=seed + 1)
            s.register_memory(src.base, src.buf.nbytes)
            lid = s.register_layout(src.layout())
            assert s.store(lid, 0, list(range(BLOCKS)), seed_keys(seed)).wait() == ["done"] * BLOCKS
            caches[seed] = src
        wait_until(lambda: s.disk_stats()["eager_queued"] == 2 * BLOCKS, what="eager queueing")
        assert s.flush_disk(30_000)
        ds = s.disk_stats()
        assert ds["writes"] == ds["objects"] == 2 * BLOCKS, ds
        assert s.stats()["evictions"] == 0 and s.stats()["objects"] == 2 * BLOCKS
        # evict drops the pool's and the disk's copies: nothing promotes them back.
        keys0 = seed_keys(0)
        assert s.evict(keys0) == BLOCKS
        assert s.exists(keys0) == [False] * BLOCKS
        assert s.disk_stats()["removed"] == BLOCKS
        assert check_present_bytes(s, caches) == BLOCKS  # seed 1, from the pool
    finally:
        s.close()


def test_disk_write_and_close_budget_options_are_checked_and_refused_in_standalone_mode():
    cfg = ConnectorConfig.parse({"disk_write": "eager", "disk_close_write_s": 0})
    assert (cfg.disk_write, cfg.disk_close_write_s) == ("eager", 0)
    default = ConnectorConfig.parse({})
    assert (default.disk_write, default.disk_close_write_s) == ("on_evict", 30)
    with pytest.raises(ConfigError, match="disk_write"):
        ConnectorConfig.parse({"disk_write": "always"})
    with pytest.raises(ConfigError, match="disk_close_write_s"):
        ConnectorConfig.parse({"disk_close_write_s": 4000})
    for name, flag in [
        ("disk_write", "--disk-write"),
        ("disk_close_write_s", "--disk-close-write-s"),
    ]:
        value = "eager" if name == "disk_write" else 5
        with pytest.raises(ConfigError, match=flag):
            ConnectorConfig.parse({"mode": "standalone", "endpoint": "/x.sock", name: value})


def load_found(client, seeds):
    """Loads every block of `seeds` the server finds (promoting from disk), checking its
    bytes; returns how many it loaded."""
    dst = peer.own_buffer()
    found = 0
    client.register_memory(dst.ctypes.data, dst.nbytes)
    lid = client.register_layout(peer.layout(dst))
    for seed in seeds:
        blocks = [b for b, p in enumerate(client.exists(peer.keys(seed))) if p]
        if not blocks:
            continue
        dst[:] = 0
        h = peer.hashes(seed)
        subset = umbp.KeyBuilder(peer.NAMESPACE, tp=0).keys(0, [h[b] for b in blocks])
        got = client.load(lid, 0, blocks, subset).wait()
        want = peer.pattern(seed)
        for b, outcome in zip(blocks, got, strict=True):
            if outcome == "done":
                assert np.array_equal(dst[:, b, :], want[:, b, :]), (seed, b)
                found += 1
    return found


@pytest.mark.parametrize(
    ("write", "extra", "stop", "survive"),
    [
        ("on_evict", [], "kill", False),  # only evicted objects reach disk: none here
        ("eager", [], "kill", True),  # every stored object is on disk before the crash
        ("on_evict", ["--disk-close-write-s", "0"], "term", False),  # no writes on close
    ],
)
def test_what_a_stopped_server_leaves_on_disk(tmp_path, write, extra, stop, survive):
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    disk = tmp_path / "disk"
    disk.mkdir()
    sock_dir = short_dir(tmp_path.name + write[:2] + stop)
    args = ["--disk-dir", str(disk), "--disk-capacity", "64MiB", "--disk-write", write, *extra]
    server = Server(binary, sock_dir, capacity="16MiB", extra_args=args)
    seeds = range(1, 5)  # 2 MiB in a 16 MiB pool: nothing is evicted
    stored = len(seeds) * peer.BLOCKS
    try:
        server.start()
        buf = peer.own_buffer()
        with umbp.StandaloneClient(server.endpoint, startup_timeout_ms=10000, client_name="w") as c:
            c.register_memory(buf.ctypes.data, buf.nbytes)
            for seed in seeds:
                store_seed(c, buf, seed)
        if write == "eager":
            wait_until(lambda: server.stats()["disk"]["writes"] == stored, what="eager writes")
        assert server.stats()["disk"]["writes"] == (stored if write == "eager" else 0)
        if stop == "kill":
            server.kill()
        else:
            server.stop()
        server.start()
        assert server.stats()["disk"]["rebuilt_objects"] == (stored if survive else 0)
        with umbp.StandaloneClient(server.endpoint, startup_timeout_ms=10000, client_name="r") as c:
            assert load_found(c, seeds) == (stored if survive else 0)
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


@contextlib.contextmanager
def small_tmpfs(path, size):
    """A tmpfs of `size` mounted on `path` (root only); skips the test where mounting is not
    allowed."""
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({r.stderr.strip()}); run as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_file_system(path):
    """Writes `path` until its file system is full; the bytes written."""
    chunk = b"\x5a" * (64 << 10)
    n = 0
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return n


def test_a_server_whose_file_system_fills_up_keeps_serving_exact_bytes(tmp_path):
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    sock_dir = short_dir(tmp_path.name + "full")
    with small_tmpfs(tmp_path / "fs", "80m") as fs:
        disk = fs / "tier"
        disk.mkdir()
        # 64 MiB: four preallocated 16 MiB segments; the first is made at start-up, the
        # second cannot be made once the filler has taken the rest.
        args = ["--high-watermark", "0.5", "--low-watermark", "0.25", "--disk-dir", str(disk)]
        args += ["--disk-capacity", "64MiB", "--disk-write", "eager"]
        server = Server(binary, sock_dir, capacity="4MiB", extra_args=args)
        try:
            server.start()
            buf = peer.own_buffer()
            with umbp.StandaloneClient(
                server.endpoint, startup_timeout_ms=10000, client_name="w"
            ) as c:
                c.register_memory(buf.ctypes.data, buf.nbytes)
                early = range(1, 5)
                for seed in early:
                    store_seed(c, buf, seed)
                wait_until(
                    lambda: server.stats()["disk"]["writes"] == len(early) * peer.BLOCKS,
                    what="the first writes",
                )
                # Something else takes the rest of the file system.
                assert fill_file_system(fs / "filler") > 0
                # 20 MiB more through the pool: the first segment fills, no second can be made.
                late = range(5, 45)
                for seed in late:
                    store_seed(c, buf, seed)
                wait_until(
                    lambda: server.stats()["disk"]["backlog_bytes"] == 0, what="the backlog drained"
                )
                d = server.stats()["disk"]
                assert d["write_errors"] >= 1, d
                assert d["writes"] < (len(early) + len(late)) * peer.BLOCKS, d
                assert d["corrupt"] == 0 and d["read_errors"] == 0, d
                # Every lookup answers: hits load exact bytes (checked), the rest miss. (The
                # tiny pool may evict promoted blocks before they load: counted misses.)
                assert load_found(c, [*early, *late]) > 0
                assert server.stats()["disk"]["hits"] > 0
            log = server.log.read_text()
            assert "disk tier: a write failed" in log and "No space left on device" in log, log
            assert server.proc.poll() is None, "the server is still running"
            # With room again, a restarted server (a pool that holds all it promotes) finds
            # every object written before the file system filled, byte-exact.
            (fs / "filler").unlink()
            server.stop()
            server.capacity = "32MiB"
            server.start()
            assert server.stats()["disk"]["rebuilt_objects"] >= len(early) * peer.BLOCKS
            with umbp.StandaloneClient(
                server.endpoint, startup_timeout_ms=10000, client_name="r"
            ) as c:
                assert load_found(c, early) == len(early) * peer.BLOCKS
        finally:
            server.stop()
            shutil.rmtree(sock_dir, ignore_errors=True)
