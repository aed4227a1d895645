"""Real vLLM CUDA engines with UMBPStoreConnector: restored KV must give the outputs the same
engine computes cold, in embedded and standalone mode.

Each engine runs every prompt cold, again from vLLM's own prefix cache, then
`reset_prefix_cache()` and again (UMBP restores every full block of it). The byte verifier
(verifier.py) fingerprints every stored block after the forward pass that wrote it and every
restored block when its load is done, without making the engine wait (an earlier version that
synchronized hid the standalone race of issue 28): a wrong byte fails the test with where it
is, even where the greedy tokens of this dummy-weight model happen to agree. Restored token counts are printed (`pytest -s`) and written to
$UMBP_GPU_RESULTS when set.

Needs vLLM's CUDA build (the offline bundle), a CUDA device and, for standalone mode, the server
binary; skipped otherwise. Run by `scripts/gpu-device-run.sh` with `VLLM=1`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from common import (  # noqa: E402
    Server,
    finish_engine,
    model_dir,
    passes_of,
    prompts,
    run_engine,
    server_bin,
    start_engine,
)

RESULTS = os.environ.get("UMBP_GPU_RESULTS")
PASSES = ["cold", "own", "reset", "restored"]


def record(name: str, result: dict) -> None:
    rows = []
    for p in result.get("passes", []):
        if "tokens" in p:
            rows.append(f"{p['pass']}[{p['prompt']}] cached {p['cached']}/{p['prompt_tokens']}")
    print(f"\n{name}: start-up {result.get('startup_s')} s; " + "; ".join(rows))
    print(f"{name}: verifier {json.dumps(result.get('verify'))[:1500]}")
    if RESULTS:
        path = Path(RESULTS)
        all_ = json.loads(path.read_text()) if path.exists() else {}
        all_[name] = {k: v for k, v in result.items() if k != "prompts"}
        path.write_text(json.dumps(all_, indent=1))


def check(result: dict, n_prompts: int, block_size: int, restored: str = "restored") -> None:
    assert "error" not in result and "startup_error" not in result, result
    cold, own, back = (passes_of(result, p) for p in ("cold", "own", restored))
    for i in range(n_prompts):
        # Every full block before the last token is restored (vLLM computes at least one).
        full = (cold[i]["prompt_tokens"] - 1) // block_size * block_size
        assert back[i]["cached"] == full, (i, back[i]["cached"], full)
        assert own[i]["tokens"] == cold[i]["tokens"], f"prompt {i}: vLLM's own cache differs"
        assert back[i]["tokens"] == cold[i]["tokens"], (
            f"prompt {i}: restored output {back[i]['tokens']} differs from cold {cold[i]['tokens']}"
        )
    v = result["verify"]
    assert v["mismatched"] == 0 and v["changed_late"] == 0, v
    assert v["checked"] > 0 and v["unknown"] == 0 and v["failed_loads"] == 0, v
    assert v["results_pending"] == 0, v


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def workload() -> list[list[int]]:
    """Two prompts sharing a 3,000-token prefix, and two distinct long ones. Whole numbers of
    blocks: vLLM computes a cached prompt's last block again (its last token must be
    computed), in another batch shape than the first time, and the verifier counts how many
    such blocks came out with other bits (`recomputed_differently`)."""
    return prompts(2, 4096, shared=3000, seed=1) + prompts(2, 8192, seed=2)


def connector(mode: str, server: Server | None) -> dict:
    if mode == "standalone":
        assert server is not None
        return {"mode": "standalone", "endpoint": server.endpoint}
    return {"capacity_bytes": 16 << 30}


def need_server(mode: str) -> None:
    if mode == "standalone" and not server_bin():
        pytest.skip("needs umbp_standalone_server ($UMBP_SERVER_BIN or PATH)")


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("mode", ["embedded", "standalone"])
def test_restored_outputs_match_cold(tmp_path, models, mode, block_size, graphs):
    need_server(mode)
    server = Server(tmp_path, capacity="24GiB").start() if mode == "standalone" else None
    ps = workload()
    try:
        result = run_engine(
            dict(
                model=model_dir(models, "llama8b-8l"),
                block_size=block_size,
                eager=not graphs,
                connector=connector(mode, server),
                prompts=ps,
                passes=PASSES,
            ),
            tmp_path / "engine.log",
        )
    finally:
        if server is not None:
            server.stop()
    record(f"{mode}-bs{block_size}-{'graphs' if graphs else 'eager'}", result)
    check(result, len(ps), block_size)


@pytest.mark.parametrize("mode", ["embedded", "standalone"])
def test_one_token_requests_restore_exactly(tmp_path, models, mode):
    """The time-to-first-token run's shape, where standalone mode restored wrong KV on the
    H200 (issue 28): one output token per request, so each request ends in the step that
    prefilled it and the next pass follows at once; 4K- and 16K-token prompts, CUDA graphs.
    With the verifier's details: bytes wrong at the load check and unchanged after the next
    forward pass mean the pool holds wrong bytes (a store copied too early); wrong at the load
    check and changed after it (`changed_late`) mean a load landed after it was reported
    done."""
    need_server(mode)
    server = Server(tmp_path, capacity="24GiB").start() if mode == "standalone" else None
    ps = prompts(3, 4096, seed=11) + prompts(3, 16384, seed=12)
    try:
        result = run_engine(
            dict(
                model=model_dir(models, "llama8b-8l"),
                block_size=16,
                eager=False,
                kv_cache_bytes=16 << 30,
                connector=connector(mode, server),
                prompts=ps,
                passes=PASSES,
                max_tokens=1,
            ),
            tmp_path / "engine.log",
        )
    finally:
        if server is not None:
            server.stop()
    record(f"{mode}-one-token", result)
    check(result, len(ps), 16)


def test_server_killed_and_restarted_mid_run(tmp_path, models):
    """The server is killed between passes: the engine misses (recomputes: the same outputs)
    and carries on; a new server on the same socket is attached again by itself and restores
    again, with no engine restart."""
    need_server("standalone")
    server = Server(tmp_path, capacity="24GiB").start()
    stored, killed, missed, restarted = (tmp_path / n for n in ("s", "k", "m", "r"))
    plan = [[0, "cold"], [0, "own"], [0, "reset"], [0, f"signal:{stored}"], [0, f"wait:{killed}"]]
    plan += [[0, "restored"], [0, "reset"], [0, f"signal:{missed}"], [0, f"wait:{restarted}"]]
    plan += [[1, "cold"], [1, "own"], [1, "reset"], [1, "restored"]]
    proc = start_engine(
        dict(
            model=model_dir(models, "llama8b-8l"),
            block_size=16,
            eager=True,
            connector=connector("standalone", server) | {"timeout_ms": 5000},
            prompts=prompts(1, 4100, seed=3) + prompts(1, 4100, seed=4),
            plan=plan,
        ),
        tmp_path / "engine.log",
    )
    try:
        wait_for_file(proc, stored, tmp_path / "engine.log")
        server.kill()
        killed.write_text("go")
        wait_for_file(proc, missed, tmp_path / "engine.log")
        server.start()
        restarted.write_text("go")
        result = finish_engine(proc, tmp_path / "engine.log")
    finally:
        server.stop()
    record("standalone-server-killed-restarted", result)
    assert "error" not in result, result
    cold, own, back = (passes_of(result, p) for p in ("cold", "own", "restored"))
    assert back[0]["cached"] == 0, back[0]  # the pool went with the server: a miss
    assert back[0]["tokens"] == cold[0]["tokens"] == own[0]["tokens"]
    assert back[1]["cached"] == (4100 - 1) // 16 * 16, back[1]  # the new server restores
    assert back[1]["tokens"] == cold[1]["tokens"]
    v = result["verify"]
    assert v["mismatched"] == 0 and v["changed_late"] == 0 and v["checked"] > 0, v


def test_two_engines_share_the_server(tmp_path, models):
    """Engine A (eager) computes and stores; engine B (CUDA graphs, another process) restores
    A's prefixes from the same server: every restored block is byte for byte what A stored.
    Prints how many blocks B computed itself with other bits than A (eager and compiled
    kernels round differently): those are why B's greedy tokens may differ from A's on this
    dummy-weight model while the bytes UMBP moves are exact."""
    need_server("standalone")
    server = Server(tmp_path, capacity="24GiB").start()
    ps = workload()
    fps = tmp_path / "a.fingerprints.pt"
    common = dict(model=model_dir(models, "llama8b-8l"), block_size=16, prompts=ps)
    try:
        a = run_engine(
            common
            | dict(
                eager=True,
                connector=connector("standalone", server),
                passes=["cold"],
                multiprocessing=False,
                dump_fingerprints=str(fps),
            ),
            tmp_path / "engine-a.log",
        )
        b = run_engine(
            common
            | dict(
                eager=False,
                connector=connector("standalone", server),
                passes=["restored", "reset", "cold"],  # restored from A; then B's own
                verify_seed=str(fps),
            ),
            tmp_path / "engine-b.log",
        )
    finally:
        server.stop()
    record("standalone-two-engines-a", a)
    record("standalone-two-engines-b", b)
    assert "error" not in a and "error" not in b, (a, b)
    back = passes_of(b, "restored")
    for i, p in enumerate(ps):
        assert back[i]["cached"] == (len(p) - 1) // 16 * 16, back[i]
    v = b["verify"]
    assert v["seeded_blocks"] > 0 and v["checked"] > 0, v
    assert v["mismatched"] == 0 and v["changed_late"] == 0 and v["unknown"] == 0, v
    same = [passes_of(a, "cold")[i]["tokens"] == back[i]["tokens"] for i in range(len(ps))]
    print(f"B restored A's KV: tokens equal to A's cold run {same}")


def wait_for_file(proc, path: Path, log: Path, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, f"{path.name} never came: {log.read_text()[-3000:]}"
        time.sleep(0.1)


@pytest.mark.parametrize("shape", ["swa", "mla"])
def test_other_model_shapes(tmp_path, models, shape):
    """A sliding-window + full-attention model (two KV cache groups) and an MLA model, in
    standalone mode."""
    need_server("standalone")
    server = Server(tmp_path, capacity="24GiB").start()
    ps = prompts(2, 4100, shared=3000, seed=5)
    try:
        result = run_engine(
            dict(
                model=model_dir(models, shape),
                block_size=16 if shape == "swa" else 64,
                eager=True,
                connector=connector("standalone", server),
                prompts=ps,
                passes=PASSES,
            ),
            tmp_path / "engine.log",
        )
    finally:
        server.stop()
    record(f"standalone-{shape}", result)
    if "startup_error" in result:
        pytest.skip(f"vLLM 0.33 does not start this shape here: {result['startup_error'][:300]}")
    check(result, len(ps), 16 if shape == "swa" else 64)
