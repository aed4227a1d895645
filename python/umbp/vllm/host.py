"""What the connector shares with the other processes of one host: the private socket
directory under `lookup_dir`, and the memory check over every worker of an engine."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from pathlib import Path

import umbp
from umbp.errors import ConfigError


def socket_dir(lookup_dir: str | os.PathLike[str], create: bool = True) -> Path:
    """This user's private directory for lookup sockets, `<lookup_dir>/umbp-<uid>`.

    Created 0700 when missing and checked on every use: it must be a real directory (not a
    link) owned by this user that no one else can write, so that another local user can
    neither pre-create nor squat the socket names in it (`lookup_dir` itself, `/tmp` by
    default, is shared).
    """
    uid = os.geteuid()
    d = Path(lookup_dir) / f"umbp-{uid}"
    if create:
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(
                f"option `lookup_dir`: cannot create the socket directory {d} ({e}); "
                "set lookup_dir to a directory this user can write"
            ) from e
    st = os.lstat(d)
    problems = []
    if not stat.S_ISDIR(st.st_mode):
        problems.append("is not a directory (a link or a file)")
    if st.st_uid != uid:
        problems.append(f"is owned by uid {st.st_uid}, not by this user (uid {uid})")
    if st.st_mode & 0o077:
        problems.append(f"has mode {stat.S_IMODE(st.st_mode):o}, not 700")
    if problems:
        raise ConfigError(
            f"option `lookup_dir`: the socket directory {d} " + " and ".join(problems) + "; "
            "another user may have created it: remove it, or set lookup_dir to a directory "
            "only this user can write"
        )
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_claims(f, drop_pid: int | None) -> list[str]:
    """The lines of the locked claims file `f` whose process is alive and is not `drop_pid`."""
    f.seek(0)
    live = []
    for line in f.read().splitlines():
        try:
            pid = int(line.split()[0])
        except (ValueError, IndexError):
            continue
        if pid != drop_pid and _alive(pid):
            live.append(line)
    return live


def _write_claims(f, lines: list[str]) -> None:
    f.seek(0)
    f.truncate()
    f.write("".join(x + "\n" for x in lines))
    f.flush()


def check_engine_memory(claims: Path, capacity: int, workers_on_host: int) -> None:
    """Checks, before this worker's pool is prefaulted, that the pools of the engine's
    workers on this host fit together in the memory this process may use (host or memory
    cgroup, `umbp.memory_available()`).

    Workers reach this at about the same time and each prefaults only its own pool, so each
    alone would see room for itself. The first worker of the engine to get here (under a lock
    on `claims`) checks the pools of every worker not yet started, itself included; later
    workers check the pools still to come. A worker whose pool does not fit raises
    `ConfigError` naming the options to change.
    """
    with open(claims, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        live = _live_claims(f, os.getpid())
        pending = max(1, workers_on_host - len(live))
        avail = umbp.memory_available()
        need = capacity * pending
        if avail is not None and need > avail[0]:
            raise ConfigError(
                f"UMBPStoreConnector: the {pending} pool(s) of {capacity} bytes that this "
                f"engine's workers on this host still have to prefault need {need} bytes, but "
                f"only {avail[0]} bytes are available to this process ({avail[1]}); lower "
                "capacity_bytes/total_capacity_bytes, or set dram_prefault false to populate on "
                "demand"
            )
        _write_claims(f, [*live, f"{os.getpid()} {capacity}"])


def release_engine_memory_claim(claims: Path, pid: int | None = None) -> bool:
    """Drops the claim of process `pid` (this worker, at shutdown; None: none in particular)
    and those of dead processes from `claims` (see `check_engine_memory`), under its lock, and
    removes the file once no claim is left. Returns whether the file was removed."""
    if not os.path.exists(claims):
        return False
    with open(claims, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        live = _live_claims(f, pid)
        if not live:
            # Unlinked while locked: a worker that opened it meanwhile writes its claim into
            # this file's inode, which it holds until it has checked; the next one starts anew.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claims)
            return True
        _write_claims(f, live)
        return False


def remove_dead_sockets(paths: list[str] | list[Path]) -> list[str]:
    """Removes those of `paths` that are socket files no process serves any more; returns them.

    A worker removes its socket when it shuts down, but one killed (SIGKILL: vLLM's forced kill
    of workers that do not stop in time, the OOM killer) leaves it. A socket is dead when a
    connection to it is refused; one that accepts, or whose queue is full, is live and kept, as
    is anything that is not a socket. The file is removed only if it is still the one tried
    (same device and inode), so a socket bound again at the path meanwhile stays.
    """
    import socket

    removed = []
    for p in map(str, paths):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not stat.S_ISSOCK(st.st_mode):
            continue
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(p)
            continue  # served
        except ConnectionRefusedError:
            pass
        except OSError:
            continue  # a full queue (EAGAIN) is a live server; anything else: leave it
        finally:
            s.close()
        try:
            now = os.lstat(p)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(p)
                removed.append(p)
        except OSError:
            pass
    return removed
