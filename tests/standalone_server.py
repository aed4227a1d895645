"""One real `umbp_standalone_server` process for tests (tests/python and tests/vllm).

The binary is $UMBP_SERVER_BIN, else `umbp_standalone_server` on PATH, else this checkout's
release build (`cargo build --release -p umbp-server`).
"""

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Numbers the log files of every server process this test process starts.
_LAUNCHES = itertools.count(1)

GRACE_MS = 3000


def server_binary() -> Path:
    if os.environ.get("UMBP_SERVER_BIN"):
        return Path(os.environ["UMBP_SERVER_BIN"])
    found = shutil.which("umbp_standalone_server")
    if found:
        return Path(found)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "umbp_standalone_server"


def short_dir(tag: str) -> Path:
    """A fresh directory with a short path (a Unix socket address holds at most 107 bytes)."""
    d = Path(os.environ.get("TMPDIR", "/tmp")) / f"umbp-t{os.getpid()}-{tag[-12:]}"
    d.mkdir(parents=True, exist_ok=True)
    return d


class Server:
    """One `umbp_standalone_server` on a socket in `directory`."""

    def __init__(self, binary, directory, capacity="64MiB", extra_args=(), log_level="warn"):
        self.binary, self.dir, self.capacity = binary, directory, capacity
        self.extra_args = list(extra_args)
        self.log_level = log_level
        self.path = directory / "umbp.sock"
        self.proc = None
        self.starts = 0

    @property
    def endpoint(self):
        return str(self.path)

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "--address",
            self.endpoint,
            "--capacity",
            self.capacity,
            "--prefault",
            "false",
            "--workers",
            "2",
            "--shutdown-grace-ms",
            str(GRACE_MS),
            "--log",
            self.log_level,
            *self.extra_args,
        ]

    def launch(self):
        """Starts the process (its log in server-N.log) without waiting for it."""
        self.starts += 1
        self.log = self.dir / f"server-{next(_LAUNCHES)}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )

    def boot_id(self):
        """The running server's boot id, None when none answers."""
        try:
            return self.stats()["boot_id"]
        except subprocess.CalledProcessError:
            return None

    def start(self):
        self.launch()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited: {self.log.read_text()}"
            if self.path.exists():
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    try:
                        s.connect(self.endpoint)
                        return
                    except OSError:
                        pass
            time.sleep(0.02)
        raise AssertionError(f"the server did not listen within 15 s: {self.log.read_text()}")

    def signal(self, sig):
        self.proc.send_signal(sig)

    def kill(self):
        """SIGKILL, and reap it (the socket file stays, as after a crash)."""
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def terminate(self):
        """SIGTERM; returns (exit code, seconds it took)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGCONT)  # a stopped server cannot act on SIGTERM
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=GRACE_MS / 1000 + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"SIGTERM did not stop the server: {self.log.read_text()}"
            ) from None
        return rc, time.monotonic() - t0

    def stop(self):
        """SIGTERM; the server must exit 0 and remove its sockets."""
        if self.proc is None:
            return
        rc = self.proc.returncode if self.proc.poll() is not None else self.terminate()[0]
        self.proc = None
        assert rc == 0, f"exit code {rc}: {self.log.read_text()}"
        assert not self.path.exists(), "the server left its socket behind"
        assert not Path(self.endpoint + ".fds").exists(), "the server left its side channel behind"

    def umbp(self, *args: str) -> str:
        """Runs `umbp ARGS --endpoint <this server>` (the operations attach no session)."""
        umbp_bin = shutil.which("umbp") or str(ROOT / ".venv" / "bin" / "umbp")
        out = subprocess.run(
            [umbp_bin, *args, "--endpoint", self.endpoint],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout

    def stats(self) -> dict:
        """`umbp stats --json` of the running server."""
        return json.loads(self.umbp("stats", "--json").strip().splitlines()[-1])


def take_over(old: Server, new: Server, timeout: float = 30) -> float:
    """Starts `new` (with `--take-over` in its arguments) beside the running `old` (started
    with `--hand-over`) at the same address; returns the seconds from the start to the first
    lookup the new server answered, once `old` has exited 0 (its `proc` is then None)."""
    before = old.boot_id()
    t0 = time.monotonic()
    new.launch()
    took = None
    while time.monotonic() - t0 < timeout:
        assert new.proc.poll() is None, new.log.read_text()
        now = new.boot_id()
        if now is not None and now != before:
            took = time.monotonic() - t0
            break
        time.sleep(0.01)
    assert took is not None, f"no new server within {timeout} s: {new.log.read_text()}"
    assert old.proc.wait(timeout=20) == 0, old.log.read_text()
    old.proc = None
    return took


@contextlib.contextmanager
def running(tag: str, capacity: str = "64MiB", extra_args=()):
    """A started server in a fresh short directory, stopped (and checked to exit cleanly)
    afterwards; pytest fixtures wrap it. Skips the test when there is no binary. `extra_args`
    go to the server's command line."""
    import pytest

    binary = server_binary()
    if not binary.is_file():
        pytest.skip(
            f"no umbp_standalone_server (looked at $UMBP_SERVER_BIN, PATH and {binary}); "
            "run scripts/venv.sh or `cargo build --release -p umbp-server`"
        )
    d = short_dir(tag)
    s = Server(binary, d, capacity=capacity, extra_args=extra_args)
    s.start()
    try:
        yield s
    finally:
        s.stop()
        shutil.rmtree(d, ignore_errors=True)
