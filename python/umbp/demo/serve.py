"""The UMBP demo: `vllm serve` with UMBPStoreConnector, restoring long shared prefixes.

It builds a small random-weight model locally, starts `vllm serve` with the usage guide's
embedded configuration (only the pool size lowered to fit this machine), and for each of a few
~4K-token prompts measures time-to-first-token three times over the OpenAI API:

1. cold: nothing cached anywhere; vLLM computes the prefix and UMBP stores it;
2. restored: after `POST /reset_prefix_cache` (vLLM's own cache only) the prefix comes back
   from UMBP's pool;
3. recomputed: after `POST /reset_prefix_cache?reset_external=true` (vLLM's cache and every
   UMBP pool) the prefix is computed again.

It prints cached tokens, TTFTs, the restored / recomputed ratio, and whether all three greedy
outputs are identical.

    python -m umbp.demo.serve [--prompts 3] [--tokens 4000] [--port 8765]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time

CONNECTOR = {
    "kv_connector": "UMBPStoreConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"mode": "embedded", "total_capacity_bytes": 2 << 30},
}


def say(msg: str) -> None:
    print(f"[umbp demo] {msg}", flush=True)


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(
        method, path, json.dumps(body) if body else None, {"Content-Type": "application/json"}
    )
    return conn, conn.getresponse()


def completion(port: int, model: str, prompt: str, max_tokens: int) -> dict:
    """Streams one greedy completion; returns TTFT, text and cached prompt tokens."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    conn, resp = request(port, "POST", "/v1/completions", body)
    ttft, text, usage = None, "", {}
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for ch in chunk.get("choices", []):
            if ch.get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            text += ch.get("text", "")
        usage = chunk.get("usage") or usage
    conn.close()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "text": text,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached": details.get("cached_tokens", 0) or 0,
    }


def reset(port: int, external: bool) -> None:
    path = "/reset_prefix_cache" + ("?reset_external=true" if external else "")
    for _ in range(100):  # vLLM refuses while blocks are still held by in-flight stores
        conn, resp = request(port, "POST", path)
        ok = resp.status == 200 and json.loads(resp.read() or b"{}").get("success", True)
        conn.close()
        if ok:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{path} kept failing")


def make_prompts(n: int, tokens: int) -> list[str]:
    rng = random.Random(7)
    words = [
        "offload",
        "restore",
        "prefix",
        "block",
        "cache",
        "host",
        "memory",
        "engine",
        "token",
        "layer",
    ]
    out = []
    for i in range(n):
        s = f"Document {i}. "
        while len(s) < tokens:
            s += rng.choice(words) + " "
        out.append(s[:tokens])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description="UMBP demo on vLLM CPU")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4000, help="prompt length (byte tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--workdir", default=os.path.join(sys.prefix, "umbp-demo"))
    a = ap.parse_args()

    from umbp.demo.tiny_model import build

    say("building the demo model (4-layer random-weight Llama, byte tokenizer) ...")
    model = build(os.path.join(a.workdir, "tiny-llama"))
    say(f"model at {model}")
    log_path = os.path.join(a.workdir, "vllm-serve.log")
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model,
        "--served-model-name", "tiny", "--port", str(a.port), "--host", "127.0.0.1",
        "--enable-prefix-caching", "--enforce-eager", "--max-model-len", "8192",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(CONNECTOR),
    ]  # fmt: skip
    say(
        "starting: "
        + " ".join(cmd[:3])
        + " ... --kv-transfer-config '"
        + json.dumps(CONNECTOR)
        + "'"
    )
    say(f"server log: {log_path}")
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        t0 = time.time()
        while True:
            if server.poll() is not None:
                with open(log_path) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"vllm serve exited with {server.returncode}:\n{tail}")
            try:
                conn, resp = request(a.port, "GET", "/health", timeout=2)
                conn.close()
                if resp.status == 200:
                    break
            except OSError:
                pass
            if int(time.time() - t0) % 10 == 0:
                say(f"waiting for the server to start ({time.time() - t0:.0f}s) ...")
            time.sleep(1)
        say(f"server ready after {time.time() - t0:.0f}s")
        completion(a.port, "tiny", "warm up", 2)
        rows = []
        for i, p in enumerate(make_prompts(a.prompts, a.tokens)):
            cold = completion(a.port, "tiny", p, a.max_tokens)
            reset(a.port, external=False)
            restored = completion(a.port, "tiny", p, a.max_tokens)
            reset(a.port, external=True)
            recomputed = completion(a.port, "tiny", p, a.max_tokens)
            same = cold["text"] == restored["text"] == recomputed["text"]
            rows.append((cold, restored, recomputed, same))
            say(
                f"prompt {i}: {restored['prompt_tokens']} tokens; TTFT cold {cold['ttft'] * 1000:.0f} ms, "
                f"restored {restored['ttft'] * 1000:.0f} ms ({restored['cached']} tokens from UMBP), "
                f"recomputed {recomputed['ttft'] * 1000:.0f} ms; outputs identical: {same}"
            )
        restored_ms = statistics.median(r[1]["ttft"] for r in rows) * 1000
        recomputed_ms = statistics.median(min(r[0]["ttft"], r[2]["ttft"]) for r in rows) * 1000
        all_same = all(r[3] for r in rows)
        print()
        print("UMBP demo summary (vLLM CPU, embedded mode, usage-guide configuration)")
        print(f"  prompts                       {len(rows)} x ~{a.tokens} tokens")
        print(f"  cached tokens when restored   {[r[1]['cached'] for r in rows]}")
        print(f"  TTFT restored (median)        {restored_ms:.0f} ms")
        print(f"  TTFT recomputed (median)      {recomputed_ms:.0f} ms")
        print(f"  TTFT ratio restored/recomputed {restored_ms / recomputed_ms:.2f}")
        print(f"  greedy outputs identical      {all_same}")
        return 0 if all_same and all(r[1]["cached"] > 0 for r in rows) else 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)


if __name__ == "__main__":
    sys.exit(main())
