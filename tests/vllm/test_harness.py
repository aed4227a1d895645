"""The real-engine harness of the GPU tests (tests/gpu_vllm/), on vLLM CPU: the same engine
runner and byte verifier, a tiny model, both modes. The CUDA engines run on the GPU machine
(`scripts/gpu-device-run.sh` with VLLM=1); here CI checks that the harness itself works and
that every block restored through the real connector is byte for byte the one stored."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

GPU_VLLM = Path(__file__).parent.parent / "gpu_vllm"
sys.path.insert(0, str(GPU_VLLM))
from common import Server, model_dir, passes_of, prompts, run_engine, server_bin  # noqa: E402

BLOCK = 32  # vLLM CPU's attention takes multiples of 32


@pytest.mark.parametrize("corrupt", [False, True], ids=["as-is", "one-byte-changed"])
@pytest.mark.parametrize("mode", ["embedded", "standalone"])
def test_restored_blocks_are_the_stored_bytes(tmp_path, mode, corrupt, monkeypatch):
    """With `corrupt`, the harness changes one byte of each restored load before checking it:
    the verifier must report exactly those, so a passing run means something."""
    if mode == "standalone" and not server_bin():
        pytest.skip("needs umbp_standalone_server (scripts/venv.sh builds it into .venv/bin)")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")  # UMBP's INFO lines must show (below)
    server = Server(tmp_path, capacity="1GiB").start() if mode == "standalone" else None
    conn = (
        {"mode": "standalone", "endpoint": server.endpoint}
        if server
        else {"capacity_bytes": 1 << 30}
    )
    ps = prompts(2, 640, shared=320, seed=7) + prompts(1, 1024, seed=8)
    try:
        r = run_engine(
            dict(
                model=model_dir(tmp_path, "tiny", max_len=2048),
                block_size=BLOCK,
                eager=True,
                max_model_len=2048,
                kv_cache_bytes=1 << 30,
                connector=conn,
                prompts=ps,
                passes=["cold", "own", "reset", "restored"],
                corrupt_loads=corrupt,
            ),
            tmp_path / "engine.log",
            timeout=400,
        )
    finally:
        if server is not None:
            server.stop()
    assert "error" not in r and "startup_error" not in r, r
    v = r["verify"]
    if corrupt:
        assert v["mismatched"] == len(ps), v  # one block of each prompt's load
        assert v["details"][0]["layers"] == [0], v
        return
    cold, back = passes_of(r, "cold"), passes_of(r, "restored")
    for i, p in enumerate(ps):
        assert back[i]["cached"] == (len(p) - 1) // BLOCK * BLOCK, back[i]
        assert back[i]["tokens"] == cold[i]["tokens"]
    assert v["checked"] > 0 and v["mismatched"] == 0 and v["changed_late"] == 0, v
    assert v["unknown"] == 0 and v["failed_loads"] == 0, v
    # UMBP's INFO lines reach the engine's log through vLLM's handlers (vLLM's format).
    log = (tmp_path / "engine.log").read_text()
    assert re.search(r"INFO .*umbp: worker \d+: ", log), "UMBP's start-up line is not logged"
