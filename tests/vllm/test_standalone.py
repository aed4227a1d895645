"""Standalone mode on real vLLM CPU engines and a real `umbp_standalone_server` process: the
SPEC's failure table, one test per row (the same rows without vLLM, with finer timings, are in
tests/python/test_standalone_connector.py)."""

from __future__ import annotations

import re
import signal
import sys
from pathlib import Path

import pytest

from conftest import (
    assert_as_reference,
    cpu_has_amx,
    finish,
    prompts,
    reference,
    run_engine,
    tokens,
    wait_for,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import (  # noqa: E402
    Server,
    running,
    server_binary,
    short_dir,
    take_over,
)

BLOCK = 128  # vLLM CPU's default block size


@pytest.fixture
def server(tmp_path):
    with running(tmp_path.name, capacity="256MiB") as s:
        yield s


def standalone(server: Server, **extra) -> dict:
    return {"mode": "standalone", "endpoint": f"unix://{server.endpoint}", **extra}


def full_blocks(o: dict) -> int:
    return (o["prompt_tokens"] - 1) // BLOCK * BLOCK


#: Every prompt set of this module, by name.
PROMPTS = {
    "shared": prompts(3, seed=20),
    "own": prompts(2, shared=0, seed=21),
    "killed": prompts(3, shared=0, seed=22),
    "stopped": prompts(3, seed=23),
    "fresh": prompts(3, shared=0, seed=24),
    "tp2": prompts(2, shared=0, seed=25),
    "disk": prompts(2, shared=0, seed=26),
    "handover": prompts(2, shared=0, seed=27),
}


@pytest.fixture(scope="module")
def baseline(model):
    """Each prompt set computed and then from vLLM's own prefix cache (conftest.reference)."""
    ref = reference(model, PROMPTS)
    assert ref["block_size"] == BLOCK, f"this engine's blocks are {ref['block_size']} tokens"
    return ref


def test_two_engines_share_the_server_and_a_restarted_engine_restores(
    model, server, tmp_path, baseline
):
    ps, own = PROMPTS["shared"], PROMPTS["own"]
    a_ready, b_ready, a2_reset = tmp_path / "a.ready", tmp_path / "b.ready", tmp_path / "a2.reset"
    b_done = tmp_path / "b.done"
    # Engine A computes the prefixes and stays up while B runs.
    a = run_engine(
        {
            "model": model,
            "connector": standalone(server),
            "steps": [
                {"generate": ps},
                {"reset": False},  # waits for A's stores; empties vLLM's own cache
                {"signal": str(a_ready)},
                {"wait_for": str(b_done)},
            ],
        },
        background=True,
    )
    wait_for(a_ready)
    objects_a = server.stats()["objects"]
    # Engine B, another engine on the node, restores them; then stores prompts of its own.
    b = run_engine(
        {
            "model": model,
            "connector": standalone(server),
            "steps": [
                {"generate": ps},
                {"generate": own},
                {"reset": False},
                {"signal": str(b_ready)},
                {"wait_for": str(a2_reset)},
                {"reset": False},
                {"generate": own},  # after A2's reset_external: nothing left to restore
            ],
        },
        background=True,
    )
    wait_for(b_ready)
    b_done.write_text("go")
    ra = finish(a)
    objects_ab = server.stats()["objects"]
    # Engine A restarted: the new engine restores from the server, then resets the pool.
    a2_cleared = tmp_path / "a2.cleared"
    a2 = run_engine(
        {
            "model": model,
            "connector": standalone(server),
            "steps": [{"generate": ps}, {"reset": True}, {"signal": str(a2_cleared)}],
        },
        background=True,
    )
    wait_for(a2_cleared)
    objects_after_reset = server.stats()["objects"]  # B is still waiting: nothing new yet
    a2_reset.write_text("go")
    a2 = finish(a2)
    rb = finish(b)
    shared, own = baseline["shared"], baseline["own"]
    assert_as_reference(ra["steps"][0], shared, "A")
    b_ps, b_own, _, _, _, _, b_own_again = rb["steps"]
    assert_as_reference(b_ps, shared, "B restored")
    assert_as_reference(b_own, own, "B computed")
    assert [o["cached"] for o in b_ps] == [full_blocks(o) for o in b_ps], b_ps
    assert_as_reference(a2["steps"][0], shared, "A restarted")
    assert [o["cached"] for o in a2["steps"][0]] == [full_blocks(o) for o in a2["steps"][0]]
    assert objects_a > 0 and objects_ab > objects_a, (objects_a, objects_ab)
    # reset_external from A2 emptied the pool for every engine: B's own prefixes are gone.
    assert a2["steps"][1] is True and objects_after_reset == 0
    assert all(o["cached"] == 0 for o in b_own_again), b_own_again
    assert_as_reference(b_own_again, own, "B after reset_external")


def test_absent_server_fails_startup_after_startup_timeout(model, tmp_path):
    ep = str(short_dir(tmp_path.name) / "nobody.sock")
    r = run_engine(
        {
            "model": model,
            "connector": {"mode": "standalone", "endpoint": ep, "startup_timeout_ms": 3000},
            "steps": [],
        }
    )
    assert "startup_error" in r, r
    out = r["output"]
    m = re.search(
        r"no umbp_standalone_server answered at (\S+) within startup_timeout_ms=3000 "
        r"\(waited (\d+) ms\)",
        out,
    )
    assert m, out[-3000:]
    assert m.group(1) == ep
    print(f"startup failed after waiting {m.group(2)} ms (startup_timeout_ms=3000)")
    assert 2400 <= int(m.group(2)) <= 3600, m.group(0)


def test_a_server_restarted_on_its_disk_dir_restores_an_engines_prefixes(model, tmp_path, baseline):
    """A server with --disk-dir writes its pool to disk at SIGTERM; a new server on the same
    directory answers a new engine's lookups from disk: the same outputs, every full block
    restored."""
    ps = PROMPTS["disk"]
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["--disk-dir", str(disk), "--disk-capacity", "256MiB"]
    with running(tmp_path.name + "d", capacity="256MiB", extra_args=args) as s:
        spec = {"model": model, "connector": standalone(s), "steps": [{"generate": ps}]}
        first = run_engine(spec)
        assert "error" not in first, first.get("error")
        stored = s.stats()["objects"]
        assert stored > 0
        s.stop()  # SIGTERM: the pool goes to disk
        s.start()
        st = s.stats()
        assert st["objects"] == 0 and st["disk"]["rebuilt_objects"] == stored, st["disk"]
        second = run_engine(spec)
        assert "error" not in second, second.get("error")
        (before,), (after,) = first["steps"], second["steps"]
        assert_as_reference(before, baseline["disk"], "computed")
        assert_as_reference(after, baseline["disk"], "restored from disk")
        assert [o["cached"] for o in after] == [full_blocks(o) for o in after], after
        assert s.stats()["disk"]["hits"] > 0


def test_a_server_replaced_by_take_over_keeps_a_running_engines_prefixes(model, tmp_path, baseline):
    """The node's server replaced under a running engine (a second server started with
    `--take-over` beside the `--hand-over` one): the engine is not restarted, and its prompts'
    full blocks are restored from the new server, which took the old one's pool over."""
    ps = PROMPTS["handover"]
    binary = server_binary()
    if not binary.is_file():
        pytest.skip(f"no umbp_standalone_server at {binary}")
    d = short_dir(tmp_path.name + "h")
    old = Server(binary, d, capacity="256MiB", extra_args=["--hand-over"])
    new = Server(binary, d, capacity="256MiB", extra_args=["--take-over"])
    stored, replaced = tmp_path / "s", tmp_path / "r"
    old.start()
    try:
        proc = run_engine(
            {
                "model": model,
                "connector": standalone(old),
                "steps": [
                    {"generate": ps},
                    {"reset": False},
                    {"signal": str(stored)},
                    {"wait_for": str(replaced)},
                    {"generate": ps},  # vLLM's own cache is empty: from the new server
                ],
            },
            background=True,
        )
        wait_for(stored)
        objects = old.stats()["objects"]
        assert objects > 0
        took = take_over(old, new)
        assert new.stats()["objects"] == objects
        replaced.write_text("go")
        r = finish(proc)
        assert "error" not in r, r.get("error")
        first, _, _, _, again = r["steps"]
        assert_as_reference(first, baseline["handover"], "computed")
        assert_as_reference(again, baseline["handover"], "restored after the hand-over")
        print(f"hand-over: {took:.3f} s to the new server's first answered lookup")
        assert [o["cached"] for o in again] == [full_blocks(o) for o in again], again
    finally:
        for s in (old, new):
            if s.proc is not None:
                s.stop()


def test_killed_server_means_misses_and_a_restarted_one_is_used_again(
    model, server, tmp_path, baseline
):
    ps = PROMPTS["killed"]
    stored, killed, missed, restarted = (tmp_path / n for n in ("s", "k", "m", "r"))
    proc = run_engine(
        {
            "model": model,
            "connector": standalone(server, timeout_ms=5000),
            "steps": [
                {"generate": ps},
                {"reset": False},
                {"signal": str(stored)},
                {"wait_for": str(killed)},
                {"generate": ps},  # lookups miss, stores fail: recomputed
                {"reset": False},
                {"signal": str(missed)},
                {"wait_for": str(restarted)},
                {"generate": ps},  # the new server's pool is empty: stored again
                {"reset": False},
                {"generate": ps},  # hits again, no engine restart
            ],
        },
        background=True,
    )
    wait_for(stored)
    assert server.stats()["objects"] > 0
    server.kill()
    killed.write_text("go")
    wait_for(missed)
    server.start()
    restarted.write_text("go")
    r = finish(proc)
    assert "error" not in r, r.get("error")
    first, _, _, _, dead, _, _, _, again, _, restored = r["steps"]
    for what, run in (("first", first), ("dead", dead), ("again", again), ("restored", restored)):
        assert_as_reference(run, baseline["killed"], what)
    print("request seconds with the server dead:", [round(o["seconds"], 3) for o in dead])
    print("request seconds restored after its restart:", [round(o["seconds"], 3) for o in restored])
    assert all(o["cached"] == 0 for o in dead), dead
    assert all(o["seconds"] < 30 for o in dead), dead  # nothing hangs on the dead server
    assert [o["cached"] for o in restored] == [full_blocks(o) for o in restored], restored
    st = server.stats()
    assert st["objects"] > 0, st


def test_stopped_server_means_misses_and_shutdown_does_not_wait(model, server, tmp_path, baseline):
    ps, fresh = PROMPTS["stopped"], PROMPTS["fresh"]
    marks = {n: tmp_path / n for n in ("stored", "stopped", "served", "resumed", "again", "down")}
    proc = run_engine(
        {
            "model": model,
            # In-process engine: the shutdown step times the connector's own shutdown.
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            "connector": standalone(server, lookup_timeout_ms=500, timeout_ms=2000),
            "steps": [
                {"generate": ps},
                {"reset": False},
                {"signal": str(marks["stored"])},
                {"wait_for": str(marks["stopped"])},
                {"generate": fresh},  # lookups miss within 500 ms; stores stall, then fail
                {"signal": str(marks["served"])},
                {"wait_for": str(marks["resumed"])},
                {"reset": False},  # the stalled stores have finished
                {"generate": ps},  # restored from the server again
                {"signal": str(marks["again"])},
                {"wait_for": str(marks["down"])},
                {"shutdown": True},  # with the server stopped
            ],
        },
        background=True,
    )
    wait_for(marks["stored"])
    server.signal(signal.SIGSTOP)
    marks["stopped"].write_text("go")
    try:
        wait_for(marks["served"], timeout=120)
    finally:
        server.signal(signal.SIGCONT)
    marks["resumed"].write_text("go")
    wait_for(marks["again"])
    server.signal(signal.SIGSTOP)
    marks["down"].write_text("go")
    try:
        r = finish(proc, timeout=120)
    finally:
        server.signal(signal.SIGCONT)
    assert "error" not in r, r.get("error")
    first, _, _, _, stalled, _, _, _, restored, _, _, shutdown_s = r["steps"]
    assert_as_reference(first, baseline["stopped"], "first")
    assert_as_reference(restored, baseline["stopped"], "restored")
    assert_as_reference(stalled, baseline["fresh"], "stalled")
    print("request seconds with the server stopped:", [round(o["seconds"], 3) for o in stalled])
    print(f"engine shutdown with the server stopped: {shutdown_s:.2f} s")
    assert all(o["cached"] == 0 for o in stalled), stalled
    # The first request waits out one lookup (500 ms); the others miss at once and no store
    # holds up a step (the SIGKILL test's engine takes about as long per request).
    assert all(o["seconds"] < 15 for o in stalled), stalled
    assert [o["cached"] for o in restored] == [full_blocks(o) for o in restored], restored
    assert shutdown_s < 5, shutdown_s


def test_tensor_parallel_2_on_the_server(model, server, tmp_path):
    ps = PROMPTS["tp2"]
    stored = tmp_path / "stored"
    done = tmp_path / "done"
    proc = run_engine(
        {
            "model": model,
            "tp": 2,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            "connector": standalone(server, key_namespace="tp2-server"),
            "steps": [
                {"generate": ps},
                {"generate": ps},  # the reference: vLLM's own prefix cache
                {"reset": False},
                {"signal": str(stored)},
                {"wait_for": str(done)},
                {"generate": ps},
            ],
        },
        background=True,
        timeout=600,
    )
    wait_for(stored, timeout=600)
    st = server.stats()
    done.write_text("go")
    r = finish(proc, timeout=600)
    first, own, _, _, _, restored = r["steps"]
    blocks = sum(full_blocks(o) for o in first) // BLOCK
    # Both workers attached (and the scheduler), each rank stored its half of every block.
    assert st["sessions"] == 3 and st["objects"] == 2 * blocks, (st, blocks)
    # Restored prefixes give what the same TP 2 engine's own prefix cache gives (a TP 2 engine
    # need not match the one-process baseline token for token: its all-reduce sums in another
    # order, and on some CPUs the tiny random model's near-uniform logits flip).
    assert_as_reference(restored, {"cold": first, "own": own}, "TP 2 restored")
    assert [o["cached"] for o in restored] == [full_blocks(o) for o in restored], restored


#: Each MLA block holds one 576-wide bf16 latent per token in each of the tiny DeepSeek-V2's two
#: layers; how many tokens a block holds is the engine's choice (vLLM CPU's reference backend,
#: CPU_MLA, takes 16; its AMX backend, picked where the CPU has AMX, 128).
MLA_BYTES_PER_TOKEN = 2 * 576 * 2

#: vLLM's choice, and where the CPU has AMX also the reference backend it would not pick:
#: both kernel families are covered whichever host runs the tests.
MLA_BACKENDS = [None, "CPU_MLA"] if cpu_has_amx() else [None]


@pytest.mark.parametrize("backend", MLA_BACKENDS, ids=lambda b: b or "default")
def test_mla_at_tensor_parallel_2_stores_each_block_once(mla_model, server, tmp_path, backend):
    """A DeepSeek-V2-shaped MLA model at TP 2 on vLLM CPU's MLA backend: every rank holds the
    same latent cache, so the server holds one object per block (not one per rank), rank 1
    answers every store "skipped", and both ranks restore every full block from rank 0's
    objects with the outputs of the engine's own prefix cache (or, where vLLM CPU turns that
    off for MLA, of the engine's first run: see below)."""
    ps = prompts(2, length=300, shared=0, seed=26)  # 18 full blocks of 16 each, or 2 of 128
    engine = {
        "model": mla_model,
        "tp": 2,
        "max_model_len": 1024,
        # Where vLLM CPU turns its own prefix cache off (MLA on CPU_MLA), the reference is the
        # first run, computed as a whole prompt, while a restored request is computed after a
        # cached prefix with other kernels (MLA's absorbed decode kernel, its context-chunk
        # prefill): greedy tokens drift apart a few tokens on (seed 26's second prompt gives
        # its 6th token differently, and so does vLLM's own prefix cache with the same hit,
        # forced on at TP 1, 2026-12-06). Four tokens are compared.
        "max_tokens": 4,
        "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "attention_backend": backend,
    }
    stored, done = tmp_path / "stored", tmp_path / "done"
    proc = run_engine(
        {
            **engine,
            "log_stats": True,
            "connector": standalone(server, key_namespace=f"mla-tp2-{backend}"),
            "steps": [
                {"generate": ps},
                {"reset": False},
                {"signal": str(stored)},
                {"wait_for": str(done)},
                {"generate": ps},
                {"metrics": True},
                # vLLM's own prefix cache where vLLM keeps it on (after the counters: with it
                # off, this pass computes and stores every block again).
                {"generate": ps},
            ],
        },
        background=True,
        timeout=600,
    )
    wait_for(stored, timeout=600)
    sessions = server.stats()["sessions"]
    done.write_text("go")
    r = finish(proc, timeout=600)
    assert len(r.get("steps", [])) == 7, r["output"][-8000:]
    first, _, _, _, restored, metrics, again = r["steps"]
    block = r["block_size"]  # read from the engine: 16 or 128, by backend and CPU
    st = server.stats()
    blocks = sum((o["prompt_tokens"] - 1) // block for o in first)
    # Both workers attached (and the scheduler); one object per block, one copy's bytes.
    assert sessions == 3, sessions
    assert (st["objects"], st["puts"]) == (blocks, blocks), (st, blocks, block)
    assert st["used_bytes"] == blocks * block * MLA_BYTES_PER_TOKEN, (st, blocks, block)
    # Rank 0 stored every block, rank 1 skipped every block; every block was restored.
    assert metrics.get("vllm:umbp_store_blocks") == blocks, metrics
    assert metrics.get("vllm:umbp_store_skipped_blocks") == blocks, metrics
    assert metrics.get("vllm:umbp_load_blocks") == blocks, metrics
    assert metrics.get("vllm:umbp_store_failed_blocks", 0) == 0, metrics
    assert [o["cached"] for o in first] == [0, 0], first
    assert [o["cached"] for o in restored] == [
        (o["prompt_tokens"] - 1) // block * block for o in restored
    ], restored
    if r["prefix_caching"]:
        assert_as_reference(restored, {"cold": first, "own": again}, "MLA restored")
    else:  # no own prefix cache to judge by (`again` restored from the server once more)
        assert tokens(restored) == tokens(first) == tokens(again)
    print(
        f"MLA TP 2 ({backend or 'default'} backend, {block}-token blocks, vLLM's own prefix cache "
        f"{'on' if r['prefix_caching'] else 'off'}): {blocks} blocks, server objects "
        f"{st['objects']}, used {st['used_bytes']} B, restored {[o['cached'] for o in restored]} "
        f"tokens, startup {r['startup_s']:.0f} s; metrics {metrics}"
    )


def test_kv_events_check_residency_on_the_server(model, server, tmp_path):
    ps = PROMPTS["tp2"][:1]
    stored, cleared = tmp_path / "stored", tmp_path / "cleared"
    proc = run_engine(
        {
            "model": model,
            "connector": standalone(server, key_namespace="events-server"),
            "kv_events": f"ipc://{tmp_path}/events.sock",
            "steps": [
                {"generate": ps},
                {"events": 2.0},
                {"signal": str(stored)},
                {"wait_for": str(cleared)},
                {"events": 3.0},
            ],
        },
        background=True,
    )
    wait_for(stored)
    server.umbp("clear")  # the objects leave the server's pool behind the engine's back
    cleared.write_text("go")
    r = finish(proc)
    after_store, after_clear = r["steps"][1], r["steps"][4]
    assert any(e["type"] == "BlockStored" for e in after_store), after_store
    assert any(e["type"] == "BlockRemoved" for e in after_clear), after_clear
