"""A node's server replaced under running clients without losing its pool (issue 49): a real
`umbp_standalone_server --hand-over` full of objects, a second process started with
`--take-over` on the same address. The new one serves every object byte-exact from the same
memory, the old one exits 0; twice in a row (a chain of upgrades); a new server whose pool
differs starts empty and says why; a taker that vanishes before acknowledging leaves the old
server serving its pool again (it executes itself anew with it)."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer

import umbp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import Server, server_binary, short_dir, take_over  # noqa: E402

SEEDS = range(1, 13)  # 12 x 512 KiB


def need_binary():
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    return binary


def store_all(endpoint):
    buf = peer.own_buffer()
    c, lid = peer.attach(endpoint, buf, "writer")
    with c:
        for seed in SEEDS:
            buf[:] = peer.pattern(seed)
            got = c.store(lid, 0, list(range(peer.BLOCKS)), peer.keys(seed)).wait()
            assert set(got) <= {"done", "already_present"}, got


def load_all(endpoint):
    """Every seed's blocks loaded from the server at `endpoint` and checked byte for byte."""
    buf = peer.own_buffer()
    c, lid = peer.attach(endpoint, buf, "reader")
    with c:
        for seed in SEEDS:
            assert c.exists(peer.keys(seed)) == [True] * peer.BLOCKS, f"seed {seed} is gone"
            buf[:] = 0
            got = c.load(lid, 0, list(range(peer.BLOCKS)), peer.keys(seed)).wait()
            assert got == ["done"] * peer.BLOCKS, got
            assert np.array_equal(buf, peer.pattern(seed)), f"seed {seed} changed"


def server(binary, d, capacity, *args):
    return Server(binary, d, capacity=capacity, extra_args=list(args), log_level="info")


def test_a_new_server_takes_the_pool_over_twice_and_serves_every_object(tmp_path):
    binary = need_binary()
    d = short_dir(tmp_path.name + "ho")
    a = server(binary, d, "64MiB", "--hand-over")
    b = server(binary, d, "64MiB", "--take-over")
    c = server(binary, d, "64MiB", "--take-over")
    try:
        a.start()
        store_all(a.endpoint)
        objects = a.stats()["objects"]
        assert objects == len(SEEDS) * peer.BLOCKS
        took_b = take_over(a, b)
        st = b.stats()
        assert st["objects"] == objects, st
        load_all(b.endpoint)
        assert "took over the pool" in b.log.read_text()
        # The server that took over hands on to the next (it listens for a taker too).
        took_c = take_over(b, c)
        assert c.stats()["objects"] == objects
        load_all(c.endpoint)
        assert "generation=2" in c.log.read_text() or "generation: 2" in c.log.read_text()
        print(f"hand-over to the first lookup answered: {took_b:.3f} s, then {took_c:.3f} s")
    finally:
        for s in (a, b, c):
            if s.proc is not None:
                s.stop()


def test_a_server_whose_pool_differs_starts_empty_and_says_why(tmp_path):
    binary = need_binary()
    d = short_dir(tmp_path.name + "hx")
    a = server(binary, d, "64MiB", "--hand-over")
    b = server(binary, d, "128MiB", "--take-over")
    try:
        a.start()
        store_all(a.endpoint)
        take_over(a, b)
        assert b.stats()["objects"] == 0
        log = b.log.read_text()
        assert "--capacity" in log and "starting with an empty pool" in log, log
    finally:
        for s in (a, b):
            if s.proc is not None:
                s.stop()


def test_a_taker_that_vanishes_leaves_the_old_server_serving_its_pool(tmp_path):
    binary = need_binary()
    d = short_dir(tmp_path.name + "hv")
    a = server(binary, d, "64MiB", "--hand-over")
    try:
        a.start()
        store_all(a.endpoint)
        before = a.boot_id()
        pid = a.proc.pid
        # A taker that asks, receives the pool and dies before acknowledging.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(a.endpoint + ".handover")
            s.sendall(b"UMBP-TAKE-OVER 1\n")
            s.settimeout(30)
            head, fds, _flags, _addr = socket.recv_fds(s, 4096, 2)
            assert head.startswith(b"POOL "), head
            for fd in fds:
                os.close(fd)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = a.boot_id()
            if now is not None and now != before:
                break
            time.sleep(0.05)
        assert a.proc.poll() is None, a.log.read_text()
        assert a.proc.pid == pid  # the same process, executed anew
        assert a.stats()["objects"] == len(SEEDS) * peer.BLOCKS, a.log.read_text()
        load_all(a.endpoint)
        assert "running this server again" in a.log.read_text()
        # Executed anew, it still hands over: a real taker now gets the pool.
        c = server(binary, d, "64MiB", "--take-over")
        take_over(a, c)
        assert c.stats()["objects"] == len(SEEDS) * peer.BLOCKS
        load_all(c.endpoint)
        c.stop()
    finally:
        if a.proc is not None:
            a.stop()


def test_a_take_over_without_a_running_server_starts_as_usual(tmp_path):
    binary = need_binary()
    d = short_dir(tmp_path.name + "hn")
    b = server(binary, d, "16MiB", "--take-over")
    try:
        b.start()
        assert b.stats()["objects"] == 0
        assert "no server hands a pool over" in b.log.read_text()
    finally:
        b.stop()


def test_under_systemd_the_pool_waits_in_the_descriptor_store_for_the_next_start(tmp_path):
    """SIGTERM of a `--hand-over` server run by systemd (`$NOTIFY_SOCKET`) puts the pool's
    memfd and image in the unit's descriptor store (`FDSTORE=1`, names umbp-pool and
    umbp-image); the next start, given them as systemd does (`LISTEN_FDS`, `LISTEN_PID`,
    `LISTEN_FDNAMES`, descriptors from 3), serves every object. This test plays systemd."""
    binary = need_binary()
    d = short_dir(tmp_path.name + "hs")
    notify = d / "notify.sock"
    store = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    store.bind(str(notify))
    a = server(binary, d, "64MiB", "--hand-over")
    old_env = os.environ.get("NOTIFY_SOCKET")
    os.environ["NOTIFY_SOCKET"] = str(notify)
    try:
        a.start()
    finally:
        if old_env is None:
            del os.environ["NOTIFY_SOCKET"]
        else:
            os.environ["NOTIFY_SOCKET"] = old_env
    try:
        store_all(a.endpoint)
        objects = a.stats()["objects"]
        a.stop()  # SIGTERM: exit 0, sockets removed, the pool in the store
        store.settimeout(10)
        kept = {}
        for _ in range(2):
            msg, fds, _flags, _addr = socket.recv_fds(store, 4096, 1)
            fields = dict(line.split("=", 1) for line in msg.decode().split("\n") if line)
            assert fields.get("FDSTORE") == "1" and len(fds) == 1, (msg, fds)
            kept[fields["FDNAME"]] = fds[0]
        assert set(kept) == {"umbp-pool", "umbp-image"}, kept

        def as_systemd_does():
            os.dup2(kept["umbp-pool"], 3)
            os.dup2(kept["umbp-image"], 4)
            os.environ["LISTEN_PID"] = str(os.getpid())
            os.environ["LISTEN_FDS"] = "2"
            os.environ["LISTEN_FDNAMES"] = "umbp-pool:umbp-image"

        b = server(binary, d, "64MiB", "--hand-over")
        b.starts += 1
        b.log = b.dir / "server-systemd.log"
        with open(b.log, "wb") as log:
            b.proc = subprocess.Popen(
                b.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=as_systemd_does,
                close_fds=False,
            )
        for fd in kept.values():
            os.close(fd)
        deadline = time.monotonic() + 15
        while b.boot_id() is None and time.monotonic() < deadline:
            assert b.proc.poll() is None, b.log.read_text()
            time.sleep(0.02)
        assert b.stats()["objects"] == objects, b.log.read_text()
        assert "systemd's descriptor store" in b.log.read_text()
        load_all(b.endpoint)
        b.stop()
    finally:
        store.close()
        if a.proc is not None:
            a.stop()


def test_transfers_during_a_hand_over_fail_cleanly_and_go_on_after_it(tmp_path):
    """A client loops loads (each checked byte for byte) and stores while its server is
    replaced: calls during the hand-over fail with ServerUnavailable or a failed status (the
    engine would recompute), never with wrong bytes, and the same client goes on against the
    new server, whose pool still holds what was stored."""
    binary = need_binary()
    d = short_dir(tmp_path.name + "ht")
    a = server(binary, d, "64MiB", "--hand-over")
    b = server(binary, d, "64MiB", "--take-over")
    a.start()
    stop = threading.Event()
    seen = {"ok": 0, "failed": 0, "wrong": 0, "ok_after": 0}
    handed = threading.Event()

    def loop():
        buf = peer.own_buffer()
        c, lid = peer.attach(a.endpoint, buf, "looper")
        ids = list(range(peer.BLOCKS))
        with c:
            buf[:] = peer.pattern(7)
            c.store(lid, 0, ids, peer.keys(7)).wait()
            while not stop.is_set():
                try:
                    buf[:] = 0
                    got = c.load(lid, 0, ids, peer.keys(7)).wait()
                    if got == ["done"] * peer.BLOCKS:
                        if not np.array_equal(buf, peer.pattern(7)):
                            seen["wrong"] += 1
                        seen["ok"] += 1
                        seen["ok_after"] += handed.is_set()
                    else:
                        seen["failed"] += 1
                    buf[:] = peer.pattern(7)
                    c.store(lid, 0, ids, peer.keys(7)).wait()
                except umbp.UmbpError:
                    seen["failed"] += 1
                    time.sleep(0.01)

    t = threading.Thread(target=loop)
    try:
        t.start()
        deadline = time.monotonic() + 20
        while seen["ok"] < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        take_over(a, b)
        handed.set()
        deadline = time.monotonic() + 20
        while seen["ok_after"] < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        stop.set()
        t.join(timeout=30)
        print(f"loads during and around a hand-over: {seen}")
        assert seen["wrong"] == 0, seen
        assert seen["ok_after"] >= 20, f"the client did not go on with the new server: {seen}"
    finally:
        stop.set()
        t.join(timeout=30)
        for s in (a, b):
            if s.proc is not None:
                s.stop()


def test_a_giver_that_dies_mid_hand_over_leaves_the_taker_serving_an_empty_pool(tmp_path):
    """The old server killed after the request and before sending its pool (played by a
    socket that takes the request and closes): the new server starts with an empty pool,
    says why, and serves."""
    binary = need_binary()
    d = short_dir(tmp_path.name + "hk")
    b = server(binary, d, "16MiB", "--take-over")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as giver:
        giver.bind(str(d / "umbp.sock.handover"))
        giver.listen(1)

        def die_on_request():
            conn, _ = giver.accept()
            conn.recv(64)
            conn.close()  # as a SIGKILLed process's sockets: closed, its file left behind
            giver.close()

        t = threading.Thread(target=die_on_request)
        t.start()
        try:
            b.start()
            t.join(timeout=10)
            assert b.stats()["objects"] == 0
            log = b.log.read_text()
            assert "ended before it handed its pool over" in log, log
            assert "starting with an empty pool" in log, log
        finally:
            b.stop()
