"""What another local user can do to a serving engine, on a real vLLM CPU engine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from test_connector import connector

import umbp
from conftest import COMPUTED, finish, prompts, run_engine, wait_for

SQUATTER = Path(__file__).parents[1] / "python" / "squatter.py"
SQUATTER_UID = 12345


def _can_run_as_other_user() -> bool:
    return bool(os.geteuid() == 0 and shutil.which("setpriv") and Path("/usr/bin/python3").exists())


@pytest.mark.skipif(
    not _can_run_as_other_user(),
    reason="needs root, setpriv and /usr/bin/python3 to run a squatter as another uid",
)
def test_a_squatter_of_another_uid_gets_nothing_and_vllm_keeps_serving(model):
    """While the engine serves, a process of uid 12345 takes the worker's socket path, and the
    scheduler's pooled connection to the real worker is closed by the worker (as the worker's
    300 s idle timeout would; here its connection limit, through a flood of connections from
    this user). The scheduler then reconnects to the path and meets the squatter: it must
    refuse it before sending anything, and vLLM must keep serving with unchanged outputs.

    For the squatter to bind in the private socket directory, the test first loosens that
    directory to 0777: the first line of defence (the 0700 directory) is taken away on purpose,
    so that this test shows the second one (the client's SO_PEERCRED check)."""
    ps = prompts(2, seed=5)
    base = run_engine({"model": model, "connector": COMPUTED, "steps": [{"generate": ps}]})
    expected = [o["tokens"] for o in base["steps"][0]]

    # lookup_dir like /tmp: shared, sticky; pytest's tmp_path is private to root.
    lookup_dir = Path(tempfile.mkdtemp(prefix="umbp-squat-"))
    lookup_dir.chmod(0o1777)
    ready, go = lookup_dir / "engine.ready", lookup_dir / "go"
    report = lookup_dir / "squatter.report"
    engine = run_engine(
        {
            "model": model,
            "connector": connector(lookup_dir),
            "steps": [
                {"generate": ps},  # the scheduler's connection to the worker is now pooled
                {"reset": False},  # vLLM's own cache only: the next lookups go to the worker
                {"signal": str(ready)},
                {"wait_for": str(go)},
                {"generate": ps},
            ],
        },
        background=True,
    )
    squatter, r = None, None
    flood: list[socket.socket] = []
    try:
        wait_for(ready)
        private = lookup_dir / f"umbp-{os.geteuid()}"
        (sock,) = private.glob("*.sock")
        aside = private / "real-worker.sock"
        private.chmod(0o777)  # the breach this test assumes (see above)
        os.rename(sock, aside)  # the worker still serves its socket, under another name
        squatter = subprocess.Popen(
            [
                "setpriv",
                f"--reuid={SQUATTER_UID}",
                f"--regid={SQUATTER_UID}",
                "--clear-groups",
                "/usr/bin/python3",
                str(SQUATTER),
                str(sock),
                str(report),
            ]
        )
        deadline = time.monotonic() + 30
        while "ready" not in (report.read_text() if report.exists() else ""):
            assert time.monotonic() < deadline and squatter.poll() is None, "no squatter"
            time.sleep(0.05)
        assert os.stat(sock).st_uid == SQUATTER_UID
        # The worker closes its idlest connection (the scheduler's pooled one) to make room.
        for _ in range(4100):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(str(aside))
            flood.append(c)
        # Answered only once the worker has accepted (and made room for) every connection.
        umbp.LookupClient([str(aside)], timeout_ms=20000).wait_ready(20000)
        go.write_text("go")
        r = finish(engine)
    finally:
        for c in flood:
            c.close()
        if squatter is not None:
            squatter.kill()
            squatter.wait()
        if r is None:  # the test failed before the engine finished: stop it
            os.killpg(engine.pid, signal.SIGKILL)
    try:
        assert "steps" in r, r
        assert [o["tokens"] for o in r["steps"][0]] == expected
        after = r["steps"][4]
        assert [o["tokens"] for o in after] == expected, "vLLM must keep serving unchanged"
        assert after[0]["cached"] == 0, "the squatter's answer must not count as hits"
        conns = [x for x in report.read_text().splitlines() if x.startswith("conn")]
        assert conns, "the scheduler never connected to the squatter: the test did not attack"
        assert all(x == "conn 0 0" for x in conns), f"the squatter received something: {conns}"
        assert f"served by uid {SQUATTER_UID}" in r["output"], r["output"][-3000:]
    finally:
        shutil.rmtree(lookup_dir, ignore_errors=True)
