"""Issue 46 (server hardening, round two), the parts Python reaches: an embedded store's
`disk_dir` judged as the server's `--disk-dir` is, and `umbp stats --lookup-dir` against
sockets planted by another user and sockets that never answer. The server's own attacks
(descriptor floods, the metrics port, a planted disk directory) are in
crates/umbp-server/tests/attacks.rs."""

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

import umbp
from conftest import KvCache, hashes, umbp_command

STRANGER = 65534


def _is_root():
    return os.geteuid() == 0


def small_disk_store(disk_dir):
    return umbp.EmbeddedStore(
        4 << 20,
        num_workers=1,
        prefault=False,
        disk_dir=str(disk_dir),
        disk_capacity_bytes=64 << 20,
        disk_segment_bytes=1 << 20,
    )


def test_an_embedded_disk_dir_others_could_change_is_refused_with_what_to_change(tmp_path):
    # tmp_path lies below pytest's private base: a directory of ours there is accepted.
    good = tmp_path / "tier"
    small_disk_store(good).close()
    assert (good.stat().st_mode & 0o777) == 0o700, "made private"
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(umbp.errors.ConfigError, match="chmod go-w"):
        small_disk_store(open_to_all)
    below = open_to_all / "tier"
    with pytest.raises(umbp.errors.ConfigError, match="without the sticky bit"):
        small_disk_store(below)
    assert not below.exists(), "nothing was made below a directory others may write"
    if not _is_root():
        return
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, STRANGER, STRANGER)
    with pytest.raises(umbp.errors.ConfigError, match=f"owned by uid {STRANGER}"):
        small_disk_store(theirs)
    link = tmp_path / "link"
    link.symlink_to(good)
    os.lchown(link, STRANGER, STRANGER)
    with pytest.raises(umbp.errors.ConfigError, match="symbolic link owned by uid"):
        small_disk_store(link)
    lock = good / "umbp-disk.lock"
    os.chown(lock, STRANGER, STRANGER)
    with pytest.raises(umbp.errors.ConfigError, match="remove it"):
        small_disk_store(good)


def _silent_listener(path):
    """A socket that takes connections and never answers."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(64)
    return s


PLANT = r"""
import socket, sys, time
from pathlib import Path
d, n = Path(sys.argv[1]), int(sys.argv[2])
held = []
for i in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    p = d / f"umbp-planted-dp0-w{i}.sock"
    s.bind(str(p))
    p.chmod(0o777)
    s.listen(64)
    held.append(s)
print("planted", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(
    not (_is_root() and shutil.which("setpriv") and Path("/usr/bin/python3").exists()),
    reason="needs root, setpriv and /usr/bin/python3 to plant sockets as another uid",
)
def test_umbp_stats_skips_other_users_sockets_and_gives_each_socket_a_second():
    d = Path(tempfile.mkdtemp(prefix="umbp-stats-"))
    d.chmod(0o1777)  # like /tmp: anyone may create names in it
    planter = subprocess.Popen(
        ["setpriv", f"--reuid={STRANGER}", f"--regid={STRANGER}", "--clear-groups"]
        + ["/usr/bin/python3", "-c", PLANT, str(d), "20"],
        stdout=subprocess.PIPE,
        text=True,
    )
    silent = []
    try:
        assert planter.stdout.readline().strip() == "planted"
        # Five of this user's own that never answer (killed engines' sockets, say), one live.
        silent = [_silent_listener(d / f"umbp-dead-dp0-w{i}.sock") for i in range(5)]
        store = umbp.EmbeddedStore(16 << 20, num_workers=1, prefault=False)
        cache = KvCache(fill_seed=1)
        store.register_memory(cache.base, cache.buf.nbytes)
        layout = store.register_layout(cache.layout())
        keys = umbp.KeyBuilder("st", tp=0).keys(0, hashes(range(4)))
        assert store.store(layout, 0, list(range(4)), keys).wait() == ["done"] * 4
        srv = umbp.LookupServer(store, str(d / "umbp-live-dp0-w0.sock"), "st", tp=0)
        t = time.monotonic()
        r = subprocess.run(
            [str(umbp_command()), "stats", "--lookup-dir", str(d), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - t
        assert r.returncode == 0, r.stderr
        assert "skipped 20 socket(s)" in r.stderr, r.stderr
        import json

        snap = json.loads(r.stdout.strip().splitlines()[-1])
        assert snap["clients"] == 1 and snap["expected_clients"] == 6, snap
        assert snap["objects"] == 4, snap
        print(f"umbp stats answered in {took:.1f} s beside 20 planted and 5 silent sockets")
        srv.shutdown()
        store.close()
    finally:
        planter.kill()
        planter.wait()
        for s in silent:
            s.close()
        shutil.rmtree(d, ignore_errors=True)
