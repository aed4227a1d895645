"""Real Redis processes for tests (tests/python and tests/vllm): a cluster of `redis-server`
nodes on loopback ports of their own, from the distribution's package.

Without `redis-server` on PATH the tests that need it are skipped, unless
`UMBP_REQUIRE_REDIS=1` (scripts/test.sh sets it after installing the package), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _free_port() -> int:
    """A free port whose cluster-bus port (+10000) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 55000:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    """`n` redis-server processes; with `n > 1` joined into a cluster (no replicas)."""

    def __init__(self, n: int = 3):
        self.dir = Path(tempfile.mkdtemp(prefix="umbp-redis-"))
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        cluster = n > 1
        for _ in range(n):
            port = _free_port()
            d = self.dir / str(port)
            d.mkdir()
            args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1"]
            args += ["--save", "", "--appendonly", "no", "--dir", str(d)]
            if cluster:
                args += ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"]
            self.procs.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
            self.ports.append(port)
        for p in self.ports:
            self._wait_ping(p)
        if cluster:
            out = subprocess.run(
                ["redis-cli", "--cluster", "create"]
                + [f"127.0.0.1:{p}" for p in self.ports]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 0, out.stdout + out.stderr
            self.wait_ok()

    def wait_ok(self, timeout: float = 30) -> None:
        """Waits until every node sees the cluster as ok (after a start, or a stopped node's
        return: the others marked it failed)."""
        if len(self.ports) == 1:
            return
        deadline = time.monotonic() + timeout
        while not all("cluster_state:ok" in self.cli(p, "cluster", "info") for p in self.ports):
            assert time.monotonic() < deadline, "the Redis cluster never became ok"
            time.sleep(0.1)

    def _wait_ping(self, port: int) -> None:
        deadline = time.monotonic() + 10
        while self.cli(port, "ping").strip() != "PONG":
            assert time.monotonic() < deadline, f"redis-server on {port} never answered"
            time.sleep(0.05)

    @property
    def url(self) -> str:
        if len(self.ports) == 1:
            return f"redis://127.0.0.1:{self.ports[0]}"
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def cli(self, port: int, *args: str) -> str:
        """`redis-cli -c -p PORT ARGS` (follows cluster redirections)."""
        out = subprocess.run(
            ["redis-cli", "-c", "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout

    def keys(self, pattern: str = "umbp:v1:*") -> list[str]:
        """Every key matching `pattern`, over every node."""
        found: list[str] = []
        for p in self.ports:
            out = self.cli(p, "--scan", "--pattern", pattern)
            found += [k for k in out.split() if k]
        return sorted(set(found))

    def owner(self, key: str) -> int:
        """Index of the node that owns `key`'s slot."""
        slot = int(self.cli(self.ports[0], "cluster", "keyslot", key).strip())
        for line in self.cli(self.ports[0], "cluster", "nodes").splitlines():
            f = line.split()
            port = int(f[1].split("@")[0].rsplit(":", 1)[1])
            for r in f[8:]:
                a, _, b = r.partition("-")
                if a.isdigit() and int(a) <= slot <= int(b or a):
                    return self.ports.index(port)
        raise AssertionError(f"no node owns slot {slot}")

    def stop_node(self, i: int) -> None:
        """SIGSTOP: the node keeps its sockets open and answers nothing."""
        self.procs[i].send_signal(signal.SIGSTOP)

    def resume_node(self, i: int) -> None:
        """SIGCONT, then waits until the cluster is ok again."""
        self.procs[i].send_signal(signal.SIGCONT)
        self.wait_ok()

    def flush(self) -> None:
        for p in self.ports:
            self.cli(p, "flushall")

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def have_redis() -> bool:
    """Whether redis-server is here; fails instead when UMBP_REQUIRE_REDIS=1 and it is not."""
    found = shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None
    if not found and os.environ.get("UMBP_REQUIRE_REDIS") == "1":
        raise AssertionError("redis-server is not on PATH (apt-get install redis-server)")
    return found


@contextlib.contextmanager
def redis_cluster(n: int = 3):
    """A started cluster, closed afterwards; skips the test without redis-server."""
    import pytest

    if not have_redis():
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    c = RedisCluster(n)
    try:
        yield c
    finally:
        c.close()
