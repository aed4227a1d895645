"""Benchmark of the scheduler's lookup cost: `get_num_new_matched_tokens` of
`UMBPStoreConnector` for one long prompt, against eight real worker lookup services.

The benchmark starts a TP 8 topology itself: eight embedded stores, each holding every block of
the prompt under its own rank's keys, each serving lookups on its own Unix socket. It then
times the connector's scheduler-side `get_num_new_matched_tokens` (all blocks resident, so every
worker walks the whole prefix), and, in the same run, a plain Python baseline that builds the
readable string key of every block for every rank one by one (as the original connector's
reference code did) and checks each against an in-process set: no sockets at all.

    python -m umbp.vllm.bench_lookup [--tokens 131072] [--block-size 16] [--tp 8] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
import types

import numpy as np

import umbp
from umbp.vllm.config import ConnectorConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    from umbp.vllm.runtime import EmbeddedRuntime
    from umbp.vllm.scheduler import SchedulerSide
    from umbp.vllm.topology import Topology

    nblocks = a.tokens // a.block_size
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(nblocks)]
    ns = "bench-lookup"
    tmp = tempfile.mkdtemp(prefix="umbp-bench-")
    topo = Topology(
        namespace=ns, tag="bench", tp_size=a.tp, pcp_size=1, dcp_size=1, dp_rank=0,
        block_size=a.block_size, num_groups=1,
    )  # fmt: skip
    cfg = ConnectorConfig.parse({"lookup_dir": tmp, "lookup_timeout_ms": 5000}, "kv_both")
    print(
        f"[bench] starting {a.tp} worker stores with {nblocks} resident blocks each ...", flush=True
    )
    runtime = EmbeddedRuntime(cfg, topo)
    # Where the scheduler side looks: the private socket directory under lookup_dir.
    paths = runtime.socket_paths()
    workers = []
    piece = 64
    for rank in range(a.tp):
        store = umbp.EmbeddedStore(64 << 20, prefault=False, num_workers=1)
        kv = np.zeros((nblocks, piece), dtype=np.uint8)
        store.register_memory(kv.ctypes.data, kv.nbytes)
        layout = store.register_layout([[(kv.ctypes.data, nblocks, piece, piece)]])
        keys = umbp.KeyBuilder(ns, tp=rank).keys(0, hashes)
        assert set(store.store(layout, 0, list(range(nblocks)), keys).wait()) == {"done"}
        workers.append((store, kv, umbp.LookupServer(store, paths[rank], ns, tp=rank)))
    sched = SchedulerSide(cfg, topo, runtime, types.SimpleNamespace(kv_events_config=None))
    sched.client.wait_ready(5000)
    request = types.SimpleNamespace(
        request_id="r", block_hashes=hashes, num_tokens=a.tokens + 1, num_prompt_tokens=a.tokens + 1
    )

    def ours() -> float:
        sched.requests.clear()
        t = time.perf_counter()
        n, _ = sched.get_num_new_matched_tokens(request, 0)
        dt = time.perf_counter() - t
        assert n == nblocks * a.block_size, n
        return dt

    resident = {
        f"umbp:vllm:v1:{ns}:tp{r}:pcp0:dcp0:pp0:g0:{h.hex()}" for r in range(a.tp) for h in hashes
    }

    def baseline() -> float:
        t = time.perf_counter()
        hits = nblocks
        for r in range(a.tp):
            n = 0
            for h in hashes:
                key = f"umbp:vllm:v1:{ns}:tp{r}:pcp0:dcp0:pp0:g0:{h.hex()}"
                if key not in resident:
                    break
                n += 1
            hits = min(hits, n)
        dt = time.perf_counter() - t
        assert hits == nblocks
        return dt

    ours()
    baseline()
    ours_t, base_t = [], []
    for _ in range(a.repeats):  # interleaved, so machine noise hits both alike
        ours_t.append(ours())
        base_t.append(baseline())
    o_ms, b_ms = statistics.median(ours_t) * 1000, statistics.median(base_t) * 1000
    print(
        f"get_num_new_matched_tokens, {a.tokens} tokens = {nblocks} blocks, TP {a.tp}, all resident"
    )
    print(
        f"  UMBP connector (Rust keys, {a.tp} lookup sockets)  {o_ms:8.3f} ms (median of {a.repeats})"
    )
    print(f"  per-key Python baseline (string keys, no IPC)  {b_ms:8.3f} ms")
    print(f"  speedup                                         {b_ms / o_ms:8.1f}x")
    for store, _kv, server in workers:
        server.shutdown()
        store.close()
    if a.json:
        print(json.dumps({
            "bench": "lookup", "tokens": a.tokens, "blocks": nblocks, "tp": a.tp,
            "umbp_ms": o_ms, "baseline_ms": b_ms, "speedup": b_ms / o_ms,
        }))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
