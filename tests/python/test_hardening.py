"""Issue 11 (client, limits, store): closed and forked stores, unmapped memory, an empty
topology, and a lookup server of another user."""

import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import umbp
from conftest import KvCache, hashes

SQUATTER = Path(__file__).with_name("squatter.py")


def test_a_closed_store_raises_instead_of_answering():
    s = umbp.EmbeddedStore(8 << 20, prefault=False, num_workers=1)
    keys = umbp.KeyBuilder("c").keys(0, hashes([1, 2]))
    assert s.exists(keys) == [False, False]
    s.close()
    for call in (
        lambda: s.exists(keys),
        lambda: s.prefix_hits(keys),
        s.clear,
        s.stats,
    ):
        with pytest.raises(umbp.errors.StoreClosedError, match="closed"):
            call()
    s.close()  # still idempotent


def test_lookups_of_a_closed_store_are_misses(tmp_path):
    s = umbp.EmbeddedStore(16 << 20, prefault=False, num_workers=1)
    cache = KvCache(fill_seed=1)
    s.register_memory(cache.base, cache.buf.nbytes)
    layout = s.register_layout(cache.layout())
    keys = umbp.KeyBuilder("cl").keys(0, hashes([0, 1]))
    assert set(s.store(layout, 0, [0, 1], keys).wait()) == {"done"}
    srv = umbp.LookupServer(s, umbp.socket_path(tmp_path, "e", 0, 0), "cl")
    client = umbp.LookupClient([srv.path], timeout_ms=2000)
    packed = b"".join(hashes([0, 1]))
    assert client.prefix_hits(0, packed, 32) == 2
    s.close()
    assert client.prefix_hits(0, packed, 32) == 0
    assert client.exists_all(0, packed, 32) == [False, False]
    srv.shutdown()


def test_a_lookup_client_without_workers_is_an_error():
    with pytest.raises(umbp.errors.ConfigError, match="at least one worker"):
        umbp.LookupClient([], timeout_ms=100)


CHILD = r"""
import os, sys, tempfile, threading, umbp
s = umbp.EmbeddedStore(8 << 20, prefault=False, num_workers=2)
srv = umbp.LookupServer(s, os.path.join(tempfile.mkdtemp(), "w.sock"), "f")
client = umbp.LookupClient([srv.path], timeout_ms=500)
keys = umbp.KeyBuilder("f").keys(0, [b"a"])
# Keep the parent's threads busy on the store while forking.
stop = False
def spin():
    while not stop:
        s.stats(); s.exists(keys)
ts = [threading.Thread(target=spin) for _ in range(2)]
for t in ts: t.start()
pid = os.fork()
if pid == 0:
    out = []
    for name, call in [("stats", s.stats), ("exists", lambda: s.exists(keys)),
                       ("clear", s.clear), ("close", s.close), ("shutdown", srv.shutdown),
                       ("prefix_hits", lambda: client.prefix_hits(0, b"x" * 32, 32)),
                       ("wait_ready", lambda: client.wait_ready(100))]:
        try:
            out.append(f"{name}={call()!r}")
        except BaseException as e:
            out.append(f"{name}:{type(e).__name__}:{e}")
    print("\n".join(out), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
stop = True
for t in ts: t.join()
assert os.path.exists(srv.path), "the child removed the parent's socket"
print("parent-stats", s.stats()["objects"], flush=True)
srv.shutdown(); s.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_gets_clear_errors_not_panics_or_hangs():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {}
    for line in r.stdout.splitlines():
        name = re.split(r"[=: ]", line, maxsplit=1)[0]
        lines[name] = line[len(name) :]
    assert "PanicException" not in r.stdout + r.stderr, r.stdout + r.stderr
    for name in ("stats", "exists", "clear", "wait_ready"):
        assert lines[name].startswith(":StoreClosedError:"), r.stdout
        assert "forked child" in lines[name], r.stdout
    assert "close=None" in r.stdout and "shutdown=None" in r.stdout, r.stdout
    assert "prefix_hits=0" in r.stdout, r.stdout
    assert "parent-stats 0" in r.stdout, r.stdout


def test_registering_memory_that_is_not_mapped_is_refused():
    s = umbp.EmbeddedStore(8 << 20, prefault=False, num_workers=1)
    with pytest.raises(umbp.errors.RegistrationError, match="is not mapped"):
        s.register_memory(1 << 46, 4096)
    ro = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
    with pytest.raises(umbp.errors.RegistrationError, match="not readable and writable"):
        s.register_memory(_address(ro), mmap.PAGESIZE)
    rw = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    assert s.register_memory(_address(rw), 2 * mmap.PAGESIZE) >= 0
    s.close()


def _address(m):
    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def _can_run_as_other_user():
    return os.geteuid() == 0 and shutil.which("setpriv") and Path("/usr/bin/python3").exists()


@pytest.mark.skipif(
    not _can_run_as_other_user(),
    reason="needs root, setpriv and /usr/bin/python3 to run a server as another uid",
)
def test_a_lookup_server_of_another_user_gets_nothing():
    # A directory like /tmp: anyone may create names in it (pytest's tmp_path is private).
    d = Path(tempfile.mkdtemp(prefix="umbp-squat-"))
    d.chmod(0o1777)
    sock, report = d / "w0.sock", d / "report"
    p = subprocess.Popen(
        [
            "setpriv",
            "--reuid=12345",
            "--regid=12345",
            "--clear-groups",
            "/usr/bin/python3",
            str(SQUATTER),
            str(sock),
            str(report),
        ]
    )
    try:
        deadline = time.monotonic() + 20
        while "ready" not in (report.read_text() if report.exists() else ""):
            assert time.monotonic() < deadline and p.poll() is None, "squatter did not start"
            time.sleep(0.02)
        client = umbp.LookupClient([str(sock)], timeout_ms=2000)
        assert client.prefix_hits(0, b"".join(hashes(range(4))), 32) == 0
        assert client.prefix_hits(0, b"".join(hashes(range(1000))), 32) == 0
        assert client.exists_all(0, b"".join(hashes(range(4))), 32) == [False] * 4
        with pytest.raises(umbp.errors.LookupServiceError, match="uid 12345"):
            client.wait_ready(200)
        del client
        while report.read_text().count("conn") < 3:
            assert time.monotonic() < deadline, report.read_text()
            time.sleep(0.02)
        conns = [x for x in report.read_text().splitlines() if x.startswith("conn")]
        assert all(x == "conn 0 0" for x in conns), conns
    finally:
        p.kill()
        p.wait()
        shutil.rmtree(d, ignore_errors=True)


def _new_memory_cgroup(limit):
    """A fresh memory cgroup of `limit` bytes below this process's own (v2, else v1), or the
    reason why none can be made here."""
    own = Path("/proc/self/cgroup").read_text().splitlines()
    tries = []
    for line in own:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            tries.append((Path("/sys/fs/cgroup") / path.lstrip("/"), "memory.max"))
        elif "memory" in ctrl.split(","):
            tries.append(
                (Path("/sys/fs/cgroup/memory") / path.lstrip("/"), "memory.limit_in_bytes")
            )
    why = "no cgroup v2 or v1 memory controller is mounted at /sys/fs/cgroup"
    for parent, limit_file in tries:
        d = parent / f"umbp-test-{os.getpid()}"
        try:
            d.mkdir()
        except OSError as e:
            why = f"cannot create a cgroup in {parent}: {e}"
            continue
        try:
            (d / limit_file).write_text(str(limit))
            return d, None
        except OSError as e:
            d.rmdir()
            why = f"cannot set {limit_file} in {d}: {e}"
    return None, why


POOL_IN_CGROUP = r"""
import sys, umbp
try:
    umbp.EmbeddedStore(int(sys.argv[1]), num_workers=1)
except umbp.errors.ConfigError as e:
    print("CONFIG", e, flush=True)
    sys.exit(3)
print("STARTED", flush=True)
"""


def test_a_pool_larger_than_its_memory_cgroup_fails_start_up_with_a_message():
    cg, why = _new_memory_cgroup(1 << 30)
    if cg is None:
        pytest.skip(f"no writable memory cgroup: {why}")
    try:
        # Only the child moves into the cgroup, never the test runner.
        r = subprocess.run(
            [
                "sh",
                "-c",
                f'echo $$ > {cg}/cgroup.procs && exec "$0" -c "$1" {2 << 30}',
                sys.executable,
                POOL_IN_CGROUP,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 3, (r.returncode, r.stdout, r.stderr[-2000:])
        assert "capacity_bytes" in r.stdout and "memory cgroup" in r.stdout, r.stdout
        assert str(cg) in r.stdout, r.stdout
    finally:
        cg.rmdir()


def test_sockets_live_in_a_private_directory_that_is_checked(tmp_path):
    from umbp.vllm.host import socket_dir

    d = socket_dir(tmp_path)
    assert d == tmp_path / f"umbp-{os.geteuid()}"
    assert (d.stat().st_mode & 0o777) == 0o700 and d.stat().st_uid == os.geteuid()
    assert socket_dir(tmp_path) == d  # checked again on use
    d.chmod(0o1777)
    with pytest.raises(umbp.errors.ConfigError, match="mode 1777"):
        socket_dir(tmp_path)
    d.rmdir()
    other = tmp_path / "elsewhere"
    other.mkdir(mode=0o700)
    d.symlink_to(other)
    with pytest.raises(umbp.errors.ConfigError, match="not a directory"):
        socket_dir(tmp_path)
    d.unlink()
    if os.geteuid() == 0:
        d.mkdir(mode=0o700)
        os.chown(d, 12345, 12345)  # pre-created by another user
        with pytest.raises(umbp.errors.ConfigError, match="owned by uid 12345"):
            socket_dir(tmp_path)


def test_the_pools_of_an_engines_workers_on_a_host_are_checked_together(tmp_path):
    from umbp.vllm.host import check_engine_memory

    avail, source = umbp.memory_available()
    assert avail > 0 and source
    cap = avail * 6 // 10  # one fits, two do not
    claims = tmp_path / "e.claims"
    with pytest.raises(umbp.errors.ConfigError, match="2 pool"):
        check_engine_memory(claims, cap, 2)
    # A sibling worker (alive) has claimed its pool already: only this one is still to come.
    claims.write_text(f"{os.getppid()} {cap}\n")
    check_engine_memory(claims, cap, 2)
    assert claims.read_text().splitlines() == [f"{os.getppid()} {cap}", f"{os.getpid()} {cap}"]
    # Claims of dead processes are dropped.
    claims.write_text("999999999 1\n")
    with pytest.raises(umbp.errors.ConfigError):
        check_engine_memory(claims, cap, 2)


def test_a_stopped_engine_leaves_no_memory_claims(tmp_path):
    from umbp.vllm.host import release_engine_memory_claim

    claims = tmp_path / "e.claims"
    assert not release_engine_memory_claim(claims, os.getpid()), "no file: nothing to do"
    # A live sibling's claim stays; this worker's and a dead process's go.
    claims.write_text(f"{os.getppid()} 1\n{os.getpid()} 1\n999999999 1\n")
    assert not release_engine_memory_claim(claims, os.getpid())
    assert claims.read_text().splitlines() == [f"{os.getppid()} 1"]
    # The last claim gone (the sibling's, as the scheduler sees it once the worker is dead),
    # the file goes too.
    claims.write_text(f"{os.getpid()} 1\n999999999 1\n")
    assert release_engine_memory_claim(claims, os.getpid())
    assert not claims.exists()


def test_the_scheduler_removes_dead_sockets_of_an_earlier_engine_with_more_workers(tmp_path):
    import socket

    from umbp.vllm.config import ConnectorConfig
    from umbp.vllm.host import socket_dir
    from umbp.vllm.runtime import EmbeddedRuntime
    from umbp.vllm.topology import Topology

    def topo(tp):
        return Topology(
            namespace="sweep", tag="sweep", tp_size=tp, pcp_size=1, dcp_size=1, dp_rank=0,
            block_size=16, num_groups=1,
        )  # fmt: skip

    cfg = ConnectorConfig.parse({"lookup_dir": str(tmp_path)}, "kv_both")
    d = socket_dir(str(tmp_path))
    # An earlier TP 4 engine of the namespace: worker 3 was killed (its socket file is left,
    # nobody listens), worker 2 still serves; worker 0 is a path this engine will bind itself.
    old = EmbeddedRuntime(cfg, topo(4)).socket_paths()
    servers = []
    for w in (0, 2, 3):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(old[w])
        s.listen()
        servers.append(s)
    servers[0].close()
    servers[2].close()  # worker 3: dead
    other = d / "umbp-othertag-dp0-w3.sock"  # another namespace's: never touched
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(other))
    s.close()
    EmbeddedRuntime(cfg, topo(2)).lookup_client()
    assert not os.path.exists(old[3]), "the dead socket of a worker beyond this engine's is gone"
    assert os.path.exists(old[2]), "a live server's socket stays"
    assert os.path.exists(old[0]), "this engine's own paths are its workers' to replace"
    assert other.exists()
    servers[1].close()
