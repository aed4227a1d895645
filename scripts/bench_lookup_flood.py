"""Pings and stores of one client while other clients loop the largest lookup the server takes
(issue 46, item 4), side by side with the same client on an idle server.

    python scripts/bench_lookup_flood.py [--flooders 8] [--seconds 10] [--server PATH]

Starts a real `umbp_standalone_server` (this checkout's release build unless --server), then:
1. idle: the measuring client pings and stores (32 blocks of 64 KiB, new keys each time);
2. flood: the same while `--flooders` processes, each on a connection of its own, loop
   `exists_across_ranks` over 262,144 blocks x 16 ranks (4,194,304 keys, the server's limit).
Prints p50 / p99 of each, and the flood-to-idle ratio. Targets: ping p99 <= 10 ms and stores
within 1.2x of idle during the flood.
"""

import argparse
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import umbp

ROOT = Path(__file__).resolve().parents[1]
BLOCKS, PIECE = 32, 64 << 10
FLOOD_BLOCKS, FLOOD_RANKS = 262_144, 16


def flooder(endpoint, stop, counter):
    c = umbp.StandaloneClient(endpoint, startup_timeout_ms=30000, client_name="flood")
    hashes = os.urandom(FLOOD_BLOCKS * 32)
    ranks = [(tp, 0, 0, 0) for tp in range(FLOOD_RANKS)]
    while not stop.is_set():
        c.exists_across_ranks("flood", ranks, 0, hashes, 32)
        with counter.get_lock():
            counter.value += 1
    c.close()


def measure(c, layout, seconds, tag):
    pings, stores = [], []
    kb = umbp.KeyBuilder(f"bench-{tag}", tp=0)
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline:
        t = time.perf_counter()
        c.ping()
        pings.append(time.perf_counter() - t)
        keys = kb.keys(0, [int(n * BLOCKS + b).to_bytes(8, "little") * 4 for b in range(BLOCKS)])
        t = time.perf_counter()
        out = c.store(layout, 0, list(range(BLOCKS)), keys).wait()
        stores.append(time.perf_counter() - t)
        assert set(out) <= {"done", "skipped"}, out
        n += 1
        time.sleep(0.005)
    return np.array(pings) * 1e3, np.array(stores) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flooders", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--server", default=str(ROOT / "target" / "release" / "umbp_standalone_server"))
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="umbp-flood-"))
    sock = d / "s.sock"
    log = open(d / "server.log", "wb")  # noqa: SIM115 (the server writes it until stopped)
    srv = subprocess.Popen(
        [a.server, "--address", str(sock), "--capacity", "1GiB", "--prefault", "false"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(sock))
                break
            except OSError:
                assert time.monotonic() < deadline and srv.poll() is None, "no server"
                time.sleep(0.05)
        c = umbp.StandaloneClient(str(sock), startup_timeout_ms=30000, client_name="measure")
        m = mmap.mmap(-1, BLOCKS * PIECE, flags=mmap.MAP_PRIVATE)
        buf = np.frombuffer(m, dtype=np.uint8)
        buf[:] = 7
        c.register_memory(buf.ctypes.data, buf.nbytes)
        layout = c.register_layout([[(buf.ctypes.data, BLOCKS, PIECE, PIECE)]])
        measure(c, layout, 1.0, "warm")
        idle = measure(c, layout, a.seconds, "idle")
        stop, counter = mp.Event(), mp.Value("q", 0)
        procs = [
            mp.Process(target=flooder, args=(str(sock), stop, counter)) for _ in range(a.flooders)
        ]
        for p in procs:
            p.start()
        while counter.value < a.flooders:  # every flooder has looked up once
            time.sleep(0.05)
        t0, n0 = time.monotonic(), counter.value
        flood = measure(c, layout, a.seconds, "flood")
        lookups_per_s = (counter.value - n0) / (time.monotonic() - t0)
        stop.set()
        for p in procs:
            p.join(60)
        cores = os.cpu_count()
        print(
            f"{a.flooders} flooders x {FLOOD_BLOCKS * FLOOD_RANKS:,} keys per lookup, "
            f"{lookups_per_s:.1f} lookups/s during the flood; {cores} cores"
        )
        print(f"{'':22}{'idle':>10}{'flood':>10}{'ratio':>8}")
        for name, i, f in (("ping", idle[0], flood[0]), ("store 32 x 64 KiB", idle[1], flood[1])):
            for q in (50, 99):
                a_, b_ = np.percentile(i, q), np.percentile(f, q)
                print(f"{name + f' p{q} ms':22}{a_:10.2f}{b_:10.2f}{b_ / a_:8.2f}")
            print(
                f"{name + ' mean ms':22}{i.mean():10.2f}{f.mean():10.2f}{f.mean() / i.mean():8.2f}"
            )
        c.close()
    finally:
        srv.terminate()
        srv.wait(30)
        log.close()
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
