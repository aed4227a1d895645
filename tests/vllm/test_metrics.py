"""The connector's series on `/metrics` of a real `vllm serve` (vLLM CPU), in both modes.

One server per mode: a prompt computed and stored, vLLM's own prefix cache reset, the same
prompt again (restored by UMBP); then `/metrics` must show the UMBP series with non-zero values
where the run moved data, labelled with the model, the engine and the mode. (How several
workers' counts add up is tests/vllm/test_stats.py's.)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ENV, prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import running  # noqa: E402

SERIES = re.compile(r"^(vllm:umbp_[a-z_]+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serve:
    """`vllm serve MODEL` with the connector, on a free port."""

    def __init__(self, model: str, extra: dict, log: Path) -> None:
        self.model, self.port = model, _free_port()
        ktc = {
            "kv_connector": "UMBPStoreConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        cmd = [
            str(Path(sys.executable).parent / "vllm"),
            "serve",
            model,
            "--port",
            str(self.port),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--dtype",
            "bfloat16",
            "--max-model-len",
            "4096",
            "--enforce-eager",
            "--kv-transfer-config",
            json.dumps(ktc),
        ]
        env = {**ENV, "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache
        self.log = log
        self._logf = open(log, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self._logf, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self.base = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            assert time.time() < deadline, "vllm serve never became healthy"
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)

    def post(self, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(
            self.base + path,
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip().startswith("{") else {}

    def complete(self, prompt: str) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
        return self.post("/v1/completions", body)

    def metrics(self) -> dict[str, dict[str, float]]:
        """The UMBP samples: {series: {labels: value}}."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, dict[str, float]] = {}
        for name, labels, value in SERIES.findall(text):
            out.setdefault(name, {})[labels] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._logf.close()


def _value(m: dict, name: str) -> float:
    """The one sample of `name` (every series of this engine has one label set)."""
    samples = m.get(name)
    assert samples, f"{name} missing from /metrics (UMBP series: {sorted(m)})"
    assert len(samples) == 1, samples
    return next(iter(samples.values()))


@pytest.mark.parametrize("mode", ["embedded", "standalone"])
def test_metrics_show_a_restored_prefix(model, tmp_path, mode):
    with (
        running(f"met{mode[:3]}", capacity="256MiB")
        if mode == "standalone"
        else (contextlib.nullcontext()) as server
    ):
        if mode == "standalone":
            extra = {"mode": "standalone", "endpoint": f"unix://{server.endpoint}"}
        else:
            extra = {"total_capacity_bytes": 64 << 20, "lookup_dir": str(tmp_path)}
            extra["dram_prefault"] = False
        serve = Serve(model, extra, tmp_path / "serve.log")
        try:
            serve.wait_healthy()
            prompt = prompts(1, length=1500, shared=0, seed=11)[0]
            first = serve.complete(prompt)
            time.sleep(1.5)  # the stores finish; a step collects them
            serve.complete("a")  # one more step hands the workers' counts to vLLM
            serve.post("/reset_prefix_cache")  # vLLM's own cache only
            again = serve.complete(prompt)
            cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached > 0, again
            assert again["choices"][0]["text"] == first["choices"][0]["text"]
            deadline = time.time() + 30
            while True:  # the API server records each engine's stats as they arrive
                m = serve.metrics()
                used = m.get("vllm:umbp_pool_used_bytes", {})
                # Standalone: the server's pool is read every 5 s, off the engine's step.
                if m.get("vllm:umbp_load_blocks_total") and any(used.values()):
                    break
                assert time.time() < deadline, f"no load counted: {m}"
                time.sleep(1)
                serve.complete("a")  # a step hands the newest counts to vLLM
            labels = next(iter(m["vllm:umbp_load_blocks_total"]))
            assert f'mode="{mode}"' in labels and 'engine="0"' in labels, labels
            assert f'model_name="{model}"' in labels, labels
            loaded = _value(m, "vllm:umbp_load_blocks_total")
            block = (cached + 127) // 128  # vLLM CPU's 128-token blocks
            assert loaded >= cached // 128 and loaded <= block, (loaded, cached)
            assert _value(m, "vllm:umbp_load_bytes_total") > 0
            assert _value(m, "vllm:umbp_store_blocks_total") >= loaded
            assert _value(m, "vllm:umbp_store_bytes_total") > 0
            assert _value(m, "vllm:umbp_lookup_hit_tokens_total") >= cached
            assert _value(m, "vllm:umbp_lookup_miss_tokens_total") > 0  # the first prompt
            assert _value(m, "vllm:umbp_load_seconds_count") >= 1
            assert _value(m, "vllm:umbp_store_seconds_count") >= 1
            assert _value(m, "vllm:umbp_lookup_seconds_count") >= 2
            assert not any(m.get("vllm:umbp_load_failed_blocks_total", {}).values())
            used = _value(m, "vllm:umbp_pool_used_bytes")
            capacity = _value(m, "vllm:umbp_pool_capacity_bytes")
            assert 0 < used <= capacity, (used, capacity)
            if mode == "standalone":  # the server's own pool, counted once
                assert capacity == 256 << 20
            else:
                assert capacity == 64 << 20
        finally:
            serve.stop()
