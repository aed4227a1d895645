"""A `vllm serve` process for the serving bake-off (bench_serve.py): start it with one arm's
KV tier, wait for health, scrape `/metrics`, reset its caches, read the CPU time and memory of
its process tree, stop it.

Nothing here knows about workloads; bench_serve.py drives the engine through `serve_load.py`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(rest[1]), []).append(int(d))
    return kids


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of `pids` (and of their children they waited for)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in rest[11:15])  # utime stime cutime cstime
    return total / CLK_TCK


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of `pids`, shared pages counted once per process (an upper bound)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except OSError:
            continue
    return total


_LIVE: set[Proc] = set()


def stop_all(*_args) -> None:
    """Stops every process this module started that still runs (at exit, on SIGTERM)."""
    for p in list(_LIVE):
        p.stop(grace=5)


def _on_term(signum, _frame) -> None:
    stop_all()
    raise SystemExit(128 + signum)


atexit.register(stop_all)
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_term)


class Proc:
    """A helper process (a tier's server) in its own session, logging to a file; stopped
    with its whole process group, at the latest when this process exits."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.args, self.log = args, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        _LIVE.add(self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cpu(self) -> float:
        return cpu_seconds(tree(self.proc.pid)) if self.alive() else 0.0

    def rss(self) -> int:
        return rss_bytes(tree(self.proc.pid)) if self.alive() else 0

    def stop(self, grace: float = 30) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # helpers left in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        _LIVE.discard(self)


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN|[+-]Inf)$")
#: The `/metrics` series whose deltas a point records (summed over their label sets, except
#: `by_source` series, kept per source).
KEEP = re.compile(
    r"^vllm:(prompt_tokens|prefix_cache|external_prefix_cache|num_preemptions|umbp_|kv_offload_"
    r"|generation_tokens|request_success|lmcache)"
)


def parse_metrics(text: str) -> dict[str, float]:
    """{series or series[source]: value} of the counters and histogram sums worth a delta."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or not KEEP.match(m.group(1)):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_bucket") or name.endswith("_created"):
            continue
        src = re.search(r'source="([^"]*)"', labels)
        key = f"{name}[{src.group(1)}]" if src else name
        with contextlib.suppress(ValueError):
            out[key] = out.get(key, 0.0) + float(value)
    return out


class Serve(Proc):
    """`vllm serve MODEL` on a free port with `args` (the arm's and the shared engine flags)."""

    def __init__(self, model: str, args: list[str], log: Path, env: dict, port: int = 0) -> None:
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = model
        vllm = str(Path(sys.executable).parent / "vllm")
        if not os.path.exists(vllm):  # a bundle on PYTHONPATH: no console script
            cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]
        else:
            cmd = [vllm, "serve"]
        cmd += [model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.t0 = time.time()
        super().__init__(cmd, log, env)

    def wait_healthy(self, timeout: float, watch: tuple[Proc, ...] = ()) -> float:
        """Seconds from start to healthy; raises with the log's tail if it never gets there, or
        at once when a process it needs (`watch`: the tier's server) has exited."""
        deadline = self.t0 + timeout
        while True:
            if not self.alive():
                raise RuntimeError(f"vllm serve exited (rc {self.proc.returncode}):\n{self.tail()}")
            for w in watch:
                if not w.alive():
                    raise RuntimeError(
                        f"the tier's server exited while vllm serve started:\n{w.tail()}"
                    )
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {timeout:.0f} s:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return time.time() - self.t0
            except OSError:
                time.sleep(0.5)

    def get(self, path: str, timeout: float = 30) -> str:
        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            return r.read().decode()

    def post(self, path: str, body: dict | None = None, timeout: float = 300) -> str:
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        try:
            return parse_metrics(self.get("/metrics"))
        except OSError:
            return {}

    def reset(self, external: bool, timeout: float = 60) -> bool:
        """Drops vLLM's prefix cache (and the connector's tier with `external`); vLLM refuses
        while blocks are in use (in-flight stores pin theirs), so this retries."""
        q = "?reset_external=true" if external else ""
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                text = self.post("/reset_prefix_cache" + q)
                if '"success":false' not in text.replace(" ", ""):
                    return True  # 0.33 answers {"success": bool}; 0.32 an empty 200
                time.sleep(0.2)
            except urllib.error.HTTPError:
                time.sleep(0.2)
            except OSError:
                time.sleep(0.5)
        return False


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = set(before) | set(after)
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 6) for k in sorted(keys)}
