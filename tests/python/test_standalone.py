"""`umbp.StandaloneClient` against a real `umbp_standalone_server`, with real client processes
(tests/python/standalone_peer.py): bytes stored by one process and loaded by another, a client
killed mid-transfer, a server restarted under a client, SIGTERM during transfers, bad input.

The server is started by tests/standalone_server.py (binary: $UMBP_SERVER_BIN, else
`umbp_standalone_server` on PATH, else this checkout's release build).
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer
from test_bindings import Ticker

import umbp
from conftest import umbp_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import GRACE_MS, running  # noqa: E402

PEER = Path(__file__).with_name("standalone_peer.py")


@pytest.fixture
def server(tmp_path):
    with running(tmp_path.name) as s:
        yield s


def run_peer(*args, timeout=30):
    out = subprocess.run(
        [sys.executable, str(PEER), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def start_peer(*args):
    p = subprocess.Popen(
        [sys.executable, str(PEER), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline().strip()
    assert line == "looping", (line, p.stderr.read() if p.poll() is not None else "")
    return p


def own_client(server):
    """A client of the test process with one region and one layout of its own buffer."""
    buf = peer.own_buffer()
    c = umbp.StandaloneClient(server.endpoint, startup_timeout_ms=5000, client_name="pytest")
    c.register_memory(buf.ctypes.data, buf.nbytes)
    return c, c.register_layout(peer.layout(buf)), buf


def test_one_process_stores_and_another_loads_the_same_bytes(server):
    assert run_peer("store", server.endpoint, 7) == ["stored"]
    assert run_peer("load", server.endpoint, 7) == ["verified"]
    c, lid, buf = own_client(server)
    with c:
        k = peer.keys(7)
        assert c.exists(k) == [True] * peer.BLOCKS
        assert c.prefix_hits(k) == peer.BLOCKS
        assert c.object_bytes(lid, 0) == peer.LAYERS * peer.PIECE
        t = c.load(lid, 0, list(range(peer.BLOCKS)), k)
        assert len(t) == peer.BLOCKS
        assert t.wait() == ["done"] * peer.BLOCKS
        assert t.done and t.poll() == ["done"] * peer.BLOCKS
        assert t.errors() == [] and t.failures() == []
        t.cancel()  # answered: nothing to do
        assert np.array_equal(buf, peer.pattern(7))
        # Keys built by the server from the hashes, for ranks that hold all / some blocks.
        hashes = b"".join(peer.hashes(7))
        tp1 = peer.keys(7, tp=1)[:5]
        assert c.store(lid, 0, list(range(5)), tp1).wait() == ["done"] * 5
        ranks = [(0, 0, 0, 0), (1, 0, 0, 0)]
        present, prefix = c.exists_across_ranks(peer.NAMESPACE, ranks, 0, hashes, 32)
        assert present == [True] * 5 + [False] * (peer.BLOCKS - 5) and prefix == 5
        assert c.exists_across_ranks(peer.NAMESPACE, ranks, 0, hashes, 32, True) == ([], 5)
        st = c.stats()
        assert st["objects"] == peer.BLOCKS + 5 and st["sessions"] == 1, st
        assert st["boot_id"] == c.ping() == c.boot_id and isinstance(c.session_id, int)
        assert c.attach_count == 1 and st["capacity_bytes"] == 64 << 20
        assert c.clear("another-namespace") == 0
        assert c.clear(peer.NAMESPACE) == peer.BLOCKS + 5
        assert c.exists(k) == [False] * peer.BLOCKS


def test_a_transfer_reports_its_round_trip_and_object_size(server):
    """What the connector's metrics read off a finished transfer in standalone mode."""
    c, layout, buf = own_client(server)
    try:
        kb = umbp.KeyBuilder("elapsed")
        keys = kb.keys(0, [i.to_bytes(8, "little") for i in range(4)])
        t = c.store(layout, 0, [0, 1, 2, 3], keys)
        assert t.object_bytes == c.object_bytes(layout, 0) > 0
        assert t.wait() == ["done"] * 4
        assert t.elapsed_s is not None and 0 < t.elapsed_s < 5
    finally:
        c.close()


def test_umbp_stats_watch_shows_the_server(server):
    """`umbp stats --watch --json`: the server's pool and sessions, one line per refresh."""
    c, layout, buf = own_client(server)
    try:
        keys = umbp.KeyBuilder("watch").keys(0, [i.to_bytes(8, "little") for i in range(4)])
        assert c.store(layout, 0, [0, 1, 2, 3], keys).wait() == ["done"] * 4
        out = subprocess.run(
            [str(umbp_command()), "stats", "--endpoint", server.endpoint, "--json"]
            + ["--watch", "0.2", "--count", "2"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        lines = [json.loads(x) for x in out.stdout.splitlines()]
        assert len(lines) == 2
        size = c.object_bytes(layout, 0)
        assert lines[-1]["objects"] == 4 and lines[-1]["used_bytes"] >= 4 * size
        assert lines[-1]["clients"] == 1 and lines[-1]["remote"] == "off"
    finally:
        c.close()


def test_calls_to_the_server_release_the_gil(server):
    c, _, _buf = own_client(server)
    with c, Ticker() as t:
        assert t.ticks_during(lambda: [c.ping() for _ in range(20)]) > 0


def test_a_killed_client_leaves_nothing_behind_and_others_carry_on(server, tmp_path):
    c, _, _buf = own_client(server)
    stop = tmp_path / "stop"
    killed = start_peer("loop", server.endpoint, 1)
    other = start_peer("rounds", server.endpoint, 2, stop)
    assert c.stats()["sessions"] == 3
    killed.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    stop.touch()  # the other client ends after one more round
    killed.wait()
    want = {"sessions": 1, "registrations": 1, "layouts": 1, "reservations": 0, "pinned": 0}
    while True:
        st = c.stats()
        seen = {k: st[k] for k in want}
        if seen == want or time.monotonic() - t0 > 1.0:
            break
        time.sleep(0.02)
    out, err = other.communicate(timeout=30)
    assert other.returncode == 0, err[-3000:]
    assert out.split()[0] == "completed" and int(out.split()[1]) >= 1, out
    assert seen == want, (seen, time.monotonic() - t0)
    # The other client's last transfer may be counted a moment after its exit (its caller
    # was answered through the completion page, before the server's reply).
    t1 = time.monotonic()
    while c.stats()["transfers_in_flight"] != 0 and time.monotonic() - t1 < 2.0:
        time.sleep(0.02)
    assert c.stats()["transfers_in_flight"] == 0
    c.close()


def test_a_restarted_server_is_attached_again(server):
    c, lid, buf = own_client(server)
    ids = list(range(peer.BLOCKS))
    before, after = peer.keys(10), peer.keys(11)
    buf[:] = peer.pattern(10)
    assert c.store(lid, 0, ids, before).wait() == ["done"] * peer.BLOCKS
    boot = c.boot_id
    server.stop()
    server.start()
    buf[:] = peer.pattern(11)
    # The first call finds the session gone: every key failed (the client's rule), and the
    # transfer says why.
    t = c.store(lid, 0, ids, after)
    assert t.wait() == ["failed"] * peer.BLOCKS and t.done
    kind, message = t.failure()
    assert kind in ("unavailable", "session_lost") and "UMBP server" in message, (kind, message)
    assert t.failures() == [(i, "server", message) for i in range(peer.BLOCKS)]
    assert t.elapsed_s is None
    # The next call attaches again, registering the buffer and the layout again (same ids).
    assert c.store(lid, 0, ids, after).wait() == ["done"] * peer.BLOCKS
    assert c.attach_count == 2 and c.boot_id != boot and c.ping() == c.boot_id
    assert c.exists(before) == [False] * peer.BLOCKS  # gone with the old server
    buf[:] = 0
    assert c.load(lid, 0, ids[::-1], after).wait() == ["done"] * peer.BLOCKS
    assert np.array_equal(buf[:, ::-1, :], peer.pattern(11))
    st = c.stats()
    assert (st["sessions"], st["registrations"], st["layouts"]) == (1, 1, 1), st
    c.close()


def test_bad_input_raises_clear_errors(server, tmp_path):
    for bad in ("tcp://127.0.0.1:5000", "relative/umbp.sock"):
        with pytest.raises(umbp.ConfigError, match=bad):
            umbp.StandaloneClient(bad)
    nobody = str(tmp_path / "nobody.sock")
    with pytest.raises(umbp.ServerUnavailable, match=nobody):
        umbp.StandaloneClient(nobody, startup_timeout_ms=200)
    with pytest.raises(umbp.ConfigError, match="timeout_ms"):
        umbp.StandaloneClient(server.endpoint, timeout_ms=0)
    c, lid, _buf = own_client(server)
    k = peer.keys(3)
    with pytest.raises(umbp.ConfigError, match="32 keys for 2 block ids"):
        c.store(lid, 0, [0, 1], k)
    with pytest.raises(umbp.ConfigError, match="block ids must be >= 0"):
        c.load(lid, 0, [-1] * peer.BLOCKS, k)
    with pytest.raises(umbp.ConfigError, match="no KV layout with id 99"):
        c.store(99, 0, list(range(peer.BLOCKS)), k)
    with pytest.raises(umbp.ConfigError, match="no group 3"):
        c.object_bytes(lid, 3)
    other = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(umbp.RegistrationError, match="lies in no memory this client registered"):
        c.register_layout([[(other.ctypes.data, 16, 65536, 65536)]])
    with pytest.raises(umbp.ConfigError, match="layer"):
        c.register_layout([[(other.ctypes.data, 0, 65536, 65536)]])
    with pytest.raises(umbp.RegistrationError, match="not registered"):
        c.deregister_memory(12345)
    with pytest.raises(umbp.RegistrationError):
        c.register_memory(4096, 4096)  # nothing mapped there
    # A small heap buffer shares its pages with other objects, which moving them would race.
    small = np.ones(1000, dtype=np.uint8)
    with pytest.raises(umbp.RegistrationError, match="heap neighbours"):
        c.register_memory(small.ctypes.data, small.nbytes)
    assert small.sum() == 1000
    # The server checks block ids against the layout: the transfer fails as a whole, so its
    # key reads "failed", and `failure()` says why (the same outcome every time).
    t = c.store(lid, 0, [peer.BLOCKS + 1], k[:1])
    assert t.wait() == ["failed"] and t.poll() == ["failed"]
    kind, message = t.failure()
    assert kind == "invalid_argument" and "block id 33 is out of range" in message
    assert t.failures() == [(0, "server", message)] and t.errors() == [(0, message)]
    assert t.done and len(t) == 1
    # Keys nobody stored are missing, key by key.
    t = c.load(lid, 0, [0, 1], peer.keys(99)[:2])
    assert t.wait(timeout_ms=5000) == ["missing", "missing"] and t.errors() == []
    c.close()
    c.close()
    for call in (c.ping, c.stats, lambda: c.exists(k), lambda: c.store(lid, 0, [0], k[:1])):
        with pytest.raises(umbp.StoreClosedError, match="closed"):
            call()
    assert "umbp.sock" in repr(c)


FORK_SCRIPT = """
import os, sys, umbp
c = umbp.StandaloneClient(sys.argv[1])
pid = os.fork()
if pid == 0:
    try:
        c.ping()
        os._exit(1)
    except umbp.StoreClosedError as e:
        os._exit(0 if "forked child" in str(e) else 2)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), c.ping() == c.boot_id, flush=True)
"""


def test_a_client_is_unusable_in_a_forked_child(server):
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, server.endpoint],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["child", "0", "True"]


def test_sigterm_during_transfers_exits_cleanly(server):
    busy = start_peer("loop", server.endpoint, 5)
    try:
        time.sleep(0.1)
        rc, took = server.terminate()
        assert rc == 0, server.log.read_text()
        assert took < GRACE_MS / 1000 + 1, took
        assert not server.path.exists()
        server.proc = None
    finally:
        busy.kill()
        busy.wait()


DROP_SCRIPT = """
import logging, sys, time, umbp
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
sys.path.insert(0, sys.argv[3])
import standalone_peer as peer
buf = peer.own_buffer()
buf[:] = peer.pattern(4)
c = umbp.StandaloneClient(sys.argv[1])
c.register_memory(buf.ctypes.data, buf.nbytes)
lid = c.register_layout(peer.layout(buf))
for r in range(20):
    c.store(lid, 0, list(range(peer.BLOCKS)), peer.keys(100 + r))  # never waited for
if sys.argv[2] == "del":
    del c  # the transfers' own tasks now hold the last handles of the client
    time.sleep(0.5)
print("end", flush=True)
"""


@pytest.mark.parametrize("how", ["del", "exit"])
def test_dropping_a_client_with_transfers_in_flight_neither_panics_nor_hangs(server, how):
    out = subprocess.run(
        [sys.executable, "-c", DROP_SCRIPT, server.endpoint, how, str(PEER.parent)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0 and out.stdout.split() == ["end"], out.stderr[-3000:]
    assert "panicked" not in out.stderr, out.stderr[-3000:]
    with umbp.StandaloneClient(server.endpoint) as c:
        deadline = time.monotonic() + 5
        while c.stats()["sessions"] != 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        st = c.stats()
        assert (st["sessions"], st["registrations"], st["pinned"]) == (1, 0, 0), st
        if how == "del":
            assert st["objects"] == 20 * peer.BLOCKS, st  # every transfer ran to its end


IMPORT_SCRIPT = """
import os, threading
def tasks():
    return len(os.listdir("/proc/self/task"))
before = (threading.active_count(), tasks())
import umbp
import umbp.errors
assert umbp.StandaloneClient and umbp.Transfer and umbp.ServerUnavailable
print(before == (threading.active_count(), tasks()), before, flush=True)
"""


def test_importing_creates_no_threads():
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_SCRIPT], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("True"), out.stdout


def test_memory_freed_while_registered_and_mapped_again_is_refused_never_misread(server):
    """A KV buffer freed while registered and allocated again at the same address (an engine
    that drops and re-allocates its cache without deregistering): registering the new memory
    is refused, naming the fix, as in embedded mode. (It was taken, and the layout over it
    resolved to the old registration, whose memory the process no longer mapped there: loads
    answered "done" and the buffer kept its zeros.) After the deregister, exact bytes."""
    import ctypes
    import mmap

    ids, k = list(range(peer.BLOCKS)), peer.keys(41)
    src = peer.own_buffer()
    src[:] = peer.pattern(41)
    c, lid = peer.attach(server.endpoint, src, "stale")
    try:
        assert c.store(lid, 0, ids, k).wait() == ["done"] * peer.BLOCKS
        dst = peer.own_buffer()
        region = c.register_memory(dst.ctypes.data, dst.nbytes)
        # Fresh private memory over the same addresses, the registration never dropped.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3
        libc.mmap.argtypes += [ctypes.c_long]
        map_fixed = 0x10
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | map_fixed
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        assert libc.mmap(dst.ctypes.data, dst.nbytes, prot, flags, -1, 0) == dst.ctypes.data
        assert not dst.any()
        with pytest.raises(umbp.RegistrationError, match="deregister that one first") as e:
            c.register_memory(dst.ctypes.data, dst.nbytes)
        assert e.value.kind == "registration"
        c.deregister_memory(region)
        c.register_memory(dst.ctypes.data, dst.nbytes)
        lid2 = c.register_layout(peer.layout(dst))
        assert c.load(lid2, 0, ids, k).wait() == ["done"] * peer.BLOCKS
        assert np.array_equal(dst, peer.pattern(41)), "loaded bytes differ"
    finally:
        c.close()
