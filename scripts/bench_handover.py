"""How long replacing a node's server takes when the new one takes the old one's pool over
(`--take-over` beside `--hand-over`), at several pool sizes, every object checked afterwards.

    python scripts/bench_handover.py [--sizes-gib 1,4] [--fill 0.85] [--json out.json]
                                     [--old-binary PATH]

Per size: a real `umbp_standalone_server --hand-over` is filled to `--fill` of its pool with
2 MiB objects (KV blocks of 32 pieces of 64 KiB, stored by a real client), then a second server
is started with `--take-over` on the same address. Printed per size: objects; the gap, from
the old server's log line "asks to take the pool over" (it stops serving) to the new one's
"ready" (both logs' clocks); the seconds from the new process's start to the first lookup it
answered (its own start-up included); the old server's hand-over after its drain and the new
server's start to adoption (their logs); then every object is loaded from the new server and
compared byte for byte.

`--old-binary` makes the server that hands over another build (an older release: the upgrade
case), the one taking over this checkout's; the client is this checkout's, so it also reads an
older server's stats.
"""

from __future__ import annotations

import argparse
import json
import mmap
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from standalone_server import Server, server_binary, short_dir, take_over  # noqa: E402

import umbp  # noqa: E402

PIECES, PIECE = 32, 64 << 10  # a 2 MiB object: 32 layers of 64 KiB (Llama-8B-like)
BATCH = 32  # objects per store


def content(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (PIECES, BATCH, PIECE), dtype=np.uint8)


def client(endpoint: str, name: str):
    m = mmap.mmap(-1, PIECES * BATCH * PIECE, flags=mmap.MAP_PRIVATE)
    buf = np.frombuffer(m, dtype=np.uint8).reshape(PIECES, BATCH, PIECE)
    c = umbp.StandaloneClient(endpoint, startup_timeout_ms=10000, client_name=name)
    c.register_memory(buf.ctypes.data, buf.nbytes)
    s = buf.strides
    layout = [[(buf.ctypes.data + p * s[0], BATCH, s[1], PIECE) for p in range(PIECES)]]
    return c, c.register_layout(layout), buf


def keys(seed: int):
    hashes = [seed.to_bytes(4, "little") + i.to_bytes(4, "little") * 7 for i in range(BATCH)]
    return umbp.KeyBuilder("bench-handover").keys(0, hashes)


def logged_at(log: str, what: str) -> float | None:
    """The time (seconds since the epoch) of the first log line containing `what`."""
    for line in log.splitlines():
        if what in line:
            stamp = line.split()[0].rstrip("Z")
            return datetime.fromisoformat(stamp).replace(tzinfo=timezone.utc).timestamp()
    return None


def logged_ms(log: str, what: str) -> float | None:
    for line in log.splitlines():
        if what in line:
            m = re.search(r"took_ms=(\d+)", line)
            if m:
                return float(m.group(1))
    return None


def one(size_gib: float, fill: float, old_binary: Path | None = None) -> dict:
    binary = server_binary()
    d = short_dir(f"bh{int(size_gib * 1024)}")
    cap = f"{int(size_gib * 1024)}MiB"
    old = Server(
        old_binary or binary, d, capacity=cap, extra_args=["--hand-over"], log_level="info"
    )
    new = Server(binary, d, capacity=cap, extra_args=["--take-over"], log_level="info")
    old.start()
    try:
        batches = int(size_gib * (1 << 30) * fill / (PIECES * BATCH * PIECE))
        c, lid, buf = client(old.endpoint, "filler")
        t0 = time.monotonic()
        with c:
            for b in range(batches):
                buf[:] = content(b)
                got = c.store(lid, 0, list(range(BATCH)), keys(b)).wait()
                assert set(got) <= {"done", "already_present"}, got
        fill_s = time.monotonic() - t0
        objects = old.stats()["objects"]
        took = take_over(old, new)
        st = new.stats()
        assert st["objects"] == objects, (st["objects"], objects)
        c, lid, buf = client(new.endpoint, "checker")
        t1 = time.monotonic()
        with c:
            for b in range(batches):
                buf[:] = 0
                got = c.load(lid, 0, list(range(BATCH)), keys(b)).wait()
                assert got == ["done"] * BATCH, got
                assert np.array_equal(buf, content(b)), f"batch {b} changed"
        check_s = time.monotonic() - t1
        asked = logged_at(old.log.read_text(), "asks to take the pool over")
        ready = logged_at(new.log.read_text(), "standalone server ready")
        return {
            "gap_ms": round((ready - asked) * 1000, 1) if asked and ready else None,
            "pool_gib": size_gib,
            "objects": objects,
            "bytes": objects * PIECES * PIECE,
            "first_lookup_s": round(took, 3),
            "old_hand_over_ms": logged_ms(old.log.read_text(), "handed over"),
            "new_adopt_ms": logged_ms(new.log.read_text(), "took over the pool"),
            "fill_s": round(fill_s, 1),
            "checked_s": round(check_s, 1),
        }
    finally:
        for s in (old, new):
            if s.proc is not None:
                s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", default="1,4")
    ap.add_argument("--fill", type=float, default=0.85)
    ap.add_argument("--json")
    ap.add_argument("--old-binary", type=Path, help="the server that hands over (default: ours)")
    a = ap.parse_args()
    if a.old_binary is not None and not a.old_binary.is_file():
        ap.error(f"--old-binary {a.old_binary}: no such file; build that release's server first")
    rows = []
    print(
        "pool     objects   gap (nobody serves)   start to first lookup   old gives   new adopts   checked"
    )
    for size in [float(x) for x in a.sizes_gib.split(",")]:
        r = one(size, a.fill, a.old_binary)
        rows.append(r)
        print(
            f"{size:4.1f} GiB {r['objects']:8,}   {r['gap_ms']} ms"
            f"             {r['first_lookup_s']:.3f} s"
            f"               {r['old_hand_over_ms']} ms     {r['new_adopt_ms']} ms"
            f"     {r['objects']:,} byte-exact ({r['checked_s']} s)"
        )
    if a.json:
        doc = {"bench": "handover", "rows": rows}
        if a.old_binary is not None:
            doc["old_binary"] = str(a.old_binary)
        Path(a.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
