"""CUDA memory through the standalone server, with PyTorch tensors in two client processes.

Client A fills a CUDA KV tensor and stores it through the server; client B (another process)
loads into its own tensor; bytes must be identical. Run with PyTorch's default caching
allocator (legacy CUDA IPC handles) and with `expandable_segments:True` (virtual-memory
allocations exported as descriptors). Also measures one CUDA client through the server against
embedded mode in the same run, at 64 KiB and 8 KiB pieces. Skipped without PyTorch, a CUDA
device or the server binary ($UMBP_SERVER_BIN, or on PATH).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SERVER = os.environ.get("UMBP_SERVER_BIN") or shutil.which("umbp_standalone_server")
if not SERVER:
    pytest.skip("needs umbp_standalone_server ($UMBP_SERVER_BIN or PATH)", allow_module_level=True)

RESULTS_FILE = os.environ.get("UMBP_GPU_RESULTS")

PEER = textwrap.dedent(
    """
    import json, sys, time, torch, umbp
    role, endpoint, block_kib, blocks, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    block = block_kib << 10
    c = umbp.StandaloneClient(endpoint, client_name=role)
    # One allocation viewed as [blocks, block] bytes, registered from one block in (the
    # registration starts inside the allocation, as a layer's view does).
    t = torch.zeros((blocks + 1) * block, dtype=torch.uint8, device="cuda")
    base = t.data_ptr() + block
    c.register_cuda_memory(base, blocks * block)
    lid = c.register_layout([[(base, blocks, block, block)]])
    kb = umbp.KeyBuilder(f"gpu-{block_kib}")
    hashes = [i.to_bytes(8, "little") for i in range(blocks)]
    keys = kb.keys(0, hashes)
    ids = list(range(blocks))
    g = torch.Generator(device="cuda").manual_seed(1234)
    want = torch.randint(0, 256, (blocks * block,), dtype=torch.uint8, device="cuda", generator=g)
    if role == "store":
        t[block:].copy_(want)
        torch.cuda.synchronize()
        st = c.store(lid, 0, ids, keys).wait()
        assert all(s == "done" for s in st), st
        print(json.dumps({"stats": {k: v for k, v in c.stats().items() if k in ("cuda_imports", "registrations")}}))
    elif role == "load":
        st = c.load(lid, 0, ids, keys).wait()
        assert all(s == "done" for s in st), st
        torch.cuda.synchronize()
        assert torch.equal(t[block:], want), "bytes differ after the load through the server"
        print(json.dumps({"ok": True}))
    else:  # bench: timed rounds both ways through the server
        t[block:].copy_(want)
        torch.cuda.synchronize()
        c.store(lid, 0, ids, keys).wait()
        time.sleep(3)  # the server page-locks its pool for DMA in the background at first use
        out = {}
        for direction in ("store", "load"):
            best = None
            for r in range(rounds):
                ks = kb.keys(0, [(i + (r + 1) * blocks).to_bytes(8, "little") for i in range(blocks)]) if direction == "store" else keys
                t0 = time.perf_counter()
                st = (c.store if direction == "store" else c.load)(lid, 0, ids, ks).wait()
                dt = time.perf_counter() - t0
                assert all(s in ("done", "already_present") for s in st), st
                best = dt if best is None else min(best, dt)
            out[direction] = blocks * block / best / 1e9
        torch.cuda.synchronize()
        assert torch.equal(t[block:], want)
        print(json.dumps(out))
    c.close()
    """
)


def start_server(tmp_path: Path, capacity: str = "4GiB"):
    sock = tmp_path / "s.sock"
    args = [SERVER, "--address", str(sock), "--capacity", capacity, "--workers", "8"]
    with open(tmp_path / "server.log", "w") as log:
        p = subprocess.Popen(args, stderr=log)
    for _ in range(400):
        if sock.exists():
            break
        time.sleep(0.05)
    assert sock.exists(), (tmp_path / "server.log").read_text()
    return p, sock


def stop_server(p):
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 0


def peer(role, sock, block_kib, blocks, rounds=1, expandable=False):
    env = dict(os.environ)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    r = subprocess.run(
        [sys.executable, "-c", PEER, role, str(sock), str(block_kib), str(blocks), str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, f"{role} failed:\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "expandable", [False, True], ids=["caching-allocator", "expandable-segments"]
)
@pytest.mark.parametrize("block_kib", [64, 96])
def test_cuda_bytes_restore_exactly_across_client_processes(tmp_path, expandable, block_kib):
    p, sock = start_server(tmp_path, "2GiB")
    try:
        stored = peer("store", sock, block_kib, 400, expandable=expandable)
        assert stored["stats"]["cuda_imports"] == 1
        assert peer("load", sock, block_kib, 400, expandable=expandable)["ok"]
    finally:
        stop_server(p)
    assert "session released" in (tmp_path / "server.log").read_text()


def test_one_cuda_client_through_the_server_against_embedded_mode(tmp_path):
    import umbp

    rows = {}
    p, sock = start_server(tmp_path)
    try:
        for block_kib, blocks in ((64, 8192), (8, 32768)):
            server = peer("bench", sock, block_kib, blocks, rounds=4)
            # Embedded mode in this process, same shape.
            block = block_kib << 10
            store = umbp.EmbeddedStore(4 << 30, prefault=True, num_workers=8)
            t = torch.zeros((blocks + 1) * block, dtype=torch.uint8, device="cuda")
            base = t.data_ptr() + block
            store.register_cuda_memory(base, blocks * block, 0)
            store.wait_pool_registered(60_000)
            lid = store.register_layout([[(base, blocks, block, block)]])
            kb = umbp.KeyBuilder(f"emb-{block_kib}")
            ids = list(range(blocks))
            keys = kb.keys(0, [i.to_bytes(8, "little") for i in range(blocks)])
            store.store(lid, 0, ids, keys).wait()
            emb = {}
            for direction in ("store", "load"):
                best = None
                for r in range(4):
                    ks = (
                        kb.keys(
                            0, [(i + (r + 1) * blocks).to_bytes(8, "little") for i in range(blocks)]
                        )
                        if direction == "store"
                        else keys
                    )
                    t0 = time.perf_counter()
                    (store.store if direction == "store" else store.load)(lid, 0, ids, ks).wait()
                    dt = time.perf_counter() - t0
                    best = dt if best is None else min(best, dt)
                emb[direction] = blocks * block / best / 1e9
            store.close()
            del t
            torch.cuda.empty_cache()
            rows[f"{block_kib}KiB"] = {
                "server_gbps": server,
                "embedded_gbps": emb,
                "ratio": {d: server[d] / emb[d] for d in ("store", "load")},
            }
            print(block_kib, rows[f"{block_kib}KiB"])
    finally:
        stop_server(p)
    if RESULTS_FILE:
        Path(RESULTS_FILE).write_text(json.dumps({"standalone_vs_embedded": rows}, indent=1))
    # Figures are reported, not asserted (machines are shared; see docs/benchmarks.md).
    assert all(v > 0 for r in rows.values() for v in r["server_gbps"].values())


def test_connector_store_through_the_server_is_ordered_after_the_engine_stream(tmp_path):
    """The connector's standalone store (`ServerStore`) submits once the engine's stream has
    reached the store, without blocking the caller: blocks written by a kernel still queued are
    stored with their new bytes."""
    import umbp
    from umbp.vllm.standalone import ServerStore

    layers, blocks, piece = 8, 512, 64 << 10
    p, sock = start_server(tmp_path, "2GiB")
    try:
        kv = torch.zeros((layers, blocks, piece), dtype=torch.uint8, device="cuda")
        store = ServerStore(umbp.StandaloneClient(str(sock), startup_timeout_ms=10_000))
        store.register_cuda_memory(kv.data_ptr(), kv.numel(), 0)
        s = kv.stride()
        lid = store.client.register_layout(
            [[(kv.data_ptr() + layer * s[0], blocks, s[1], piece) for layer in range(layers)]]
        )
        src, dst = list(range(0, 200)), list(range(300, 500))
        kb = umbp.KeyBuilder("order-server")
        cur = torch.cuda.current_stream()
        # The engine's default stream, as vLLM 0.33's engine thread had in issue 28: handle 0,
        # which `torch.cuda.ExternalStream` took for "no stream".
        assert cur.cuda_stream == 0
        # First let the server page-lock its pool (in the background, at the first CUDA
        # registration): a copy that waits on it is late enough to look ordered, and this
        # test passed with issue 28's bug.
        warm = kb.keys(0, [f"warm-{b}".encode() for b in src])
        assert store.store(lid, 0, src, warm).wait() == ["done"] * len(src)
        time.sleep(3)
        outcome = {}
        for ordered in (True, False):
            keys = kb.keys(0, [f"{ordered}-{b}".encode() for b in src])
            torch.cuda.synchronize()
            fresh = torch.randint(
                0, 256, (layers, len(src), piece), dtype=torch.uint8, device="cuda"
            )
            torch.cuda.synchronize()
            torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time before the writer runs
            kv[:, src[0] : src[-1] + 1] = fresh  # the kernel that writes the blocks
            t0 = time.perf_counter()
            job = store.store(lid, 0, src, keys, stream=cur.cuda_stream if ordered else None)
            submit_s = time.perf_counter() - t0
            if ordered:
                # The engine's thread does not wait for its stream (about 0.2 s of GPU time).
                assert submit_s < 0.05 and not job.done, submit_s
            assert job.wait() == ["done"] * len(src)
            torch.cuda.synchronize()
            kv[:, dst[0] : dst[-1] + 1] = 0
            torch.cuda.synchronize()
            assert store.load(lid, 0, dst, keys).wait() == ["done"] * len(dst)
            outcome[ordered] = torch.equal(kv[:, dst[0] : dst[-1] + 1], fresh)
        print(
            f"connector store ordering: ordered {outcome[True]}, unordered control {outcome[False]}"
        )
        assert outcome[True], "a standalone store with stream= copied stale bytes"
        store.close()
    finally:
        stop_server(p)


@pytest.mark.parametrize("form", ["MLA", "MLA3"])
@pytest.mark.parametrize("tp", [2, 4])
def test_mla_is_stored_once_and_every_rank_restores_it_from_cuda(tmp_path, form, tp):
    """MLA at TP 2 and 4 on the GPU: `tp` clients (ranks) with their own CUDA caches holding
    the same latent bytes; rank 0 stores each block once under keys without the TP rank, every
    rank's cache is overwritten and restored from that one object over CUDA IPC, and each
    rank's whole allocation is compared byte for byte (tests/kv_matrix.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import kv_matrix

    import umbp

    layers = 8
    p, sock = start_server(tmp_path, "2GiB")
    clients = []
    try:
        caches = [
            kv_matrix.Cache(
                form,
                device="cuda",
                layers=layers,
                blocks=96,
                heads=1,
                block_size=64,
                head_size=576,  # DeepSeek's latent: 512 + 64 RoPE values per token
                dtype=torch.bfloat16,
            )
            for _ in range(tp)
        ]
        for rank, c in enumerate(caches):
            client = umbp.StandaloneClient(str(sock), client_name=f"mla rank {rank}")
            client.register_cuda_memory(c.raw.data_ptr(), c.raw.numel())
            clients.append(client)
        statuses = kv_matrix.round_trip_replicated(clients, caches, f"gpu-mla-{form}-tp{tp}")
        assert statuses == ["done"] * len(statuses)
        st = clients[0].stats()
        # One object per block, not one per rank.
        assert st["objects"] == len(statuses), st
        assert st["used_bytes"] < 2 * len(statuses) * layers * caches[0].page, st
    finally:
        for c in clients:
            c.close()
        stop_server(p)
