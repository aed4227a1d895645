"""Dropping a store, or leaving the interpreter, while copy threads still have work and
Python logging is at DEBUG: the threads log through Python (they need the GIL), so the drop
must not hold the GIL while it waits for them."""

import subprocess
import sys

import pytest

SCRIPT = """
import logging, sys, numpy as np, umbp
logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
s = umbp.EmbeddedStore(256 << 20, prefault=False, num_workers=4)
buf = np.zeros(64 << 20, dtype=np.uint8)
s.register_memory(buf.ctypes.data, buf.nbytes)
lid = s.register_layout([[(buf.ctypes.data, 1024, 65536, 65536)]])
server = umbp.LookupServer(s, umbp.socket_path(sys.argv[2], "shutdown", 0, 0), "ns")
for r in range(20):
    k = umbp.KeyBuilder("x").keys(0, [bytes([r, i % 256, i // 256]) for i in range(1024)])
    j = s.store(lid, 0, list(range(1024)), k)  # not waited for
del j
if sys.argv[1] == "del":
    del server, s
    print("deleted", flush=True)
print("end", flush=True)
"""


@pytest.mark.parametrize("how", ["del", "exit"])
def test_drop_with_jobs_in_flight_and_debug_logging_does_not_hang(how, tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, how, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == (["deleted", "end"] if how == "del" else ["end"])
    assert "job of 1024 keys finished" in out.stderr


FORK_SCRIPT = """
import os, sys, numpy as np, umbp
s = umbp.EmbeddedStore(64 << 20, prefault=False, num_workers=2)
buf = np.zeros(4 << 20, dtype=np.uint8)
s.register_memory(buf.ctypes.data, buf.nbytes)
lid = s.register_layout([[(buf.ctypes.data, 64, 65536, 65536)]])
k = umbp.KeyBuilder("x").keys(0, [bytes([i]) for i in range(64)])
assert s.store(lid, 0, list(range(64)), k).wait() == ["done"] * 64
pid = os.fork()
if pid == 0:
    del s  # the copy threads live in the parent only: the child must not wait for them
    sys.exit(0)  # normal exit: atexit handlers and finalization run in the child too
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
assert s.exists(k) == [True] * 64  # the parent's store is untouched
"""


def test_a_forked_child_that_drops_a_store_exits():
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["child", "0"]


def test_only_sockets_nobody_serves_are_removed(tmp_path):
    import socket

    from umbp.vllm.host import remove_dead_sockets

    live, dead, other = tmp_path / "live.sock", tmp_path / "dead.sock", tmp_path / "file.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(live))
    server.listen(1)
    gone = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    gone.bind(str(dead))
    gone.close()  # bound, never listening again: connections are refused
    other.write_text("not a socket")
    try:
        paths = [live, dead, other, tmp_path / "missing.sock"]
        assert remove_dead_sockets(paths) == [str(dead)]
        assert live.exists() and other.exists() and not dead.exists()
    finally:
        server.close()
