"""The UMBP demo: `vllm serve` with UMBPStoreConnector, restoring long shared prefixes.

It builds a small random-weight model locally, starts `vllm serve` with the usage guide's
embedded configuration (only the pool size lowered to fit this machine), and for each of a few
~4K-token prompts measures time-to-first-token four times over the OpenAI API:

1. cold: nothing cached anywhere; vLLM computes the prefix and UMBP stores it;
2. own: the same prompt again, from vLLM's own prefix cache;
3. restored: after `POST /reset_prefix_cache` (vLLM's own cache only) the prefix comes back
   from UMBP's pool;
4. recomputed: after `POST /reset_prefix_cache?reset_external=true` (vLLM's cache and every
   UMBP pool) the prefix is computed again.

A restore is right when it gives what vLLM's own prefix cache gives for the same cached tokens:
as many cached tokens, the same greedy tokens and the same log-probability for each. That is
the reference, not the cold run: vLLM computes a prompt on top of a cached prefix with other
kernels than a full prefill (on some CPUs, e.g. with AMX, the tokens differ a dozen tokens on
with this random-weight model), so cold = own is shown for information only. The exit status is
0 when every restore was right, 1 otherwise; `--inject-corruption` flips one byte of the first
restored block (the connector's test hook) to show that the verdict catches it.

With `--mode standalone` (the second act) it starts `umbp_standalone_server`, then two
`vllm serve` engines attached to it: engine B restores the prefixes engine A computed; engine A
is restarted and restores them from the server too; then `reset_external` from A empties the
server's pool for both and B computes the prefixes again.

Embedded mode then sweeps prompt lengths (`--lengths`, 1K-16K tokens by default): one new
prompt each, restored vs recomputed TTFT printed and written as JSON (`--json`, default
<workdir>/demo-sweep.json), which `scripts/plot_results.py` charts.

    python -m umbp.demo.serve [--mode embedded|standalone] [--prompts 3] [--tokens 4000]
                              [--port 8765] [--lengths 1024,...,16384] [--json FILE]
                              [--seed 7] [--inject-corruption]
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


def standalone_connector(socket_path: str) -> dict:
    """The usage guide's standalone configuration, with this demo's socket."""
    return {
        **CONNECTOR,
        "kv_connector_extra_config": {"mode": "standalone", "endpoint": f"unix://{socket_path}"},
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
        "logprobs": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    conn, resp = request(port, "POST", "/v1/completions", body)
    ttft, text, usage, logprobs = None, "", {}, []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        for ch in chunk.get("choices", []):
            if ch.get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            text += ch.get("text", "")
            logprobs += (ch.get("logprobs") or {}).get("token_logprobs") or []
        usage = chunk.get("usage") or usage
    conn.close()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "text": text,
        "logprobs": logprobs,
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


def make_prompts(n: int, tokens: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
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


def bin_path(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


class Engine:
    """One `vllm serve` of the demo model with `connector`, on 127.0.0.1:`port`."""

    def __init__(
        self,
        name: str,
        model: str,
        port: int,
        connector: dict,
        workdir: str,
        max_len: int = 8192,
        corrupt: bool = False,
    ) -> None:
        self.name, self.port = name, port
        self.log_path = os.path.join(workdir, f"vllm-serve-{name}.log")
        env = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "TOKENIZERS_PARALLELISM": "false",
        }
        if corrupt:
            # The connector's test hook: one byte of the first restored block flipped in the
            # engine's KV cache after its load (docs/vllm.md, Exactness).
            env["UMBP_TEST_CORRUPT_RESTORES"] = "1"
        cmd = [
            bin_path("vllm"), "serve", model,
            "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1",
            "--enable-prefix-caching", "--enforce-eager", "--max-model-len", str(max_len),
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(connector),
        ]  # fmt: skip
        say(
            f"starting engine {name}: "
            + " ".join(cmd[:3])
            + f" --port {port} ... --kv-transfer-config '"
            + json.dumps(connector)
            + "'"
        )
        say(f"engine {name} log: {self.log_path}")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self) -> None:
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                with open(self.log_path) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(
                    f"vllm serve (engine {self.name}) exited with {self.proc.returncode}:\n{tail}"
                )
            try:
                conn, resp = request(self.port, "GET", "/health", timeout=2)
                conn.close()
                if resp.status == 200:
                    break
            except OSError:
                pass
            if int(time.time() - t0) % 10 == 0:
                say(f"waiting for engine {self.name} to start ({time.time() - t0:.0f}s) ...")
            time.sleep(1)
        say(f"engine {self.name} ready after {time.time() - t0:.0f}s")
        completion(self.port, "tiny", "warm up", 2)

    def complete(self, prompt: str, max_tokens: int) -> dict:
        return completion(self.port, "tiny", prompt, max_tokens)

    def reset(self, external: bool) -> None:
        reset(self.port, external)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(2)


def same_output(x: dict, y: dict) -> bool:
    """Whether two greedy completions are the same: tokens and each token's log-probability."""
    return x["text"] == y["text"] and x["logprobs"] == y["logprobs"]


def judge(own: dict, restored: dict) -> tuple[bool, str]:
    """Whether a restore gave what the engine's own prefix cache gives for the same cached
    tokens (the same blocks cached, the same greedy tokens and log-probabilities), and why
    not."""
    if restored["cached"] == 0:
        return False, "nothing was restored"
    if restored["cached"] != own["cached"]:
        return False, (
            f"restored {restored['cached']} tokens where vLLM's own cache holds {own['cached']}"
        )
    if restored["text"] != own["text"]:
        return False, "the restored output differs from vLLM's own prefix cache's"
    if restored["logprobs"] != own["logprobs"]:
        return False, "the restored log-probabilities differ from vLLM's own prefix cache's"
    return True, "restored = own cache"


def four_ways(engine: Engine, prompt: str, max_tokens: int) -> dict:
    """One prompt four ways: cold (nothing cached; UMBP stores it), own (vLLM's own prefix
    cache), restored (vLLM's cache reset, the prefix from UMBP) and recomputed (every cache
    reset, UMBP's included), with the restore judged against the own-cache run."""
    cold = engine.complete(prompt, max_tokens)
    own = engine.complete(prompt, max_tokens)
    engine.reset(external=False)
    restored = engine.complete(prompt, max_tokens)
    engine.reset(external=True)
    recomputed = engine.complete(prompt, max_tokens)
    ok, why = judge(own, restored)
    return {
        "cold": cold,
        "own": own,
        "restored": restored,
        "recomputed": recomputed,
        "ok": ok,
        "why": why,
        "cold_equals_own": same_output(cold, own),
    }


REFERENCE_NOTE = (
    "The reference for a restore is vLLM's own prefix cache: the same engine, the same cached\n"
    "  tokens, so the rest of the prompt is computed by the same kernels. A cold (full) prefill\n"
    "  may give other tokens after a dozen on vLLM CPU: it computes a prompt on top of a cached\n"
    "  prefix with other kernels, and this random-weight model has near-tied logits (shown for\n"
    "  information; see docs/vllm.md, Exactness)."
)


def embedded(a: argparse.Namespace, model: str) -> int:
    engine = Engine("A", model, a.port, CONNECTOR, a.workdir, a.max_model_len, a.corrupt)
    try:
        engine.wait_ready()
        rows = []
        for i, p in enumerate(make_prompts(a.prompts, a.tokens, seed=a.seed)):
            r = four_ways(engine, p, a.max_tokens)
            rows.append(r)
            cold, own, restored, recomputed = r["cold"], r["own"], r["restored"], r["recomputed"]
            say(
                f"prompt {i}: {restored['prompt_tokens']} tokens; TTFT cold "
                f"{cold['ttft'] * 1000:.0f} ms, vLLM's own cache {own['ttft'] * 1000:.0f} ms, "
                f"restored {restored['ttft'] * 1000:.0f} ms ({restored['cached']} tokens from "
                f"UMBP), recomputed {recomputed['ttft'] * 1000:.0f} ms; "
                f"{'OK' if r['ok'] else 'WRONG'}: {r['why']} "
                f"(cold = own: {r['cold_equals_own']})"
            )
        restored_ms = statistics.median(r["restored"]["ttft"] for r in rows) * 1000
        own_ms = statistics.median(r["own"]["ttft"] for r in rows) * 1000
        recomputed_ms = (
            statistics.median(min(r["cold"]["ttft"], r["recomputed"]["ttft"]) for r in rows) * 1000
        )
        all_ok = all(r["ok"] for r in rows)
        print()
        print("UMBP demo summary (vLLM CPU, embedded mode, usage-guide configuration)")
        print(f"  prompts                         {len(rows)} x ~{a.tokens} tokens (seed {a.seed})")
        print(f"  cached tokens when restored     {[r['restored']['cached'] for r in rows]}")
        print(f"  TTFT restored (median)          {restored_ms:.0f} ms")
        print(f"  TTFT vLLM's own cache (median)  {own_ms:.0f} ms")
        print(f"  TTFT recomputed (median)        {recomputed_ms:.0f} ms")
        print(f"  TTFT ratio restored/recomputed  {restored_ms / recomputed_ms:.2f}")
        print(f"  restored = vLLM's own cache     {all_ok} (greedy tokens and log-probabilities)")
        print(
            f"  cold prefill = own cache        {[r['cold_equals_own'] for r in rows]} (information)"
        )
        print("  " + REFERENCE_NOTE)
        ok = all_ok
        if a.lengths:
            ok = length_sweep(engine, a) and ok
        return verdict(ok)
    finally:
        engine.stop()


def verdict(ok: bool) -> int:
    print()
    if ok:
        say("PASS: every restore gave what vLLM's own prefix cache gives")
        return 0
    say("FAIL: a restore did not give what vLLM's own prefix cache gives (see the lines above)")
    return 1


def length_sweep(engine: Engine, a: argparse.Namespace) -> bool:
    """TTFT restored vs recomputed for one new prompt of each length of `--lengths`, printed
    and written to `--json` (scripts/plot_results.py charts it). True when every restore gave
    what vLLM's own prefix cache gives."""
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    print()
    say(f"prompt-length sweep: {', '.join(map(str, lengths))} tokens")
    rows = []
    for n, p in zip(lengths, make_prompts(len(lengths), max(lengths), seed=a.seed + 11)):
        r = four_ways(engine, p[:n], a.max_tokens)
        restored, recomputed = r["restored"], r["recomputed"]
        rows.append(
            {
                "tokens": restored["prompt_tokens"],
                "cold_ms": round(r["cold"]["ttft"] * 1000, 1),
                "own_ms": round(r["own"]["ttft"] * 1000, 1),
                "restored_ms": round(restored["ttft"] * 1000, 1),
                "recomputed_ms": round(recomputed["ttft"] * 1000, 1),
                "restored_tokens": restored["cached"],
                "restored_equals_own": r["ok"],
                "cold_equals_own": r["cold_equals_own"],
            }
        )
    print("   tokens | TTFT restored | own cache | recomputed | ratio | from UMBP | restored = own")
    for r in rows:
        print(
            f"  {r['tokens']:7d} | {r['restored_ms']:10.0f} ms | {r['own_ms']:6.0f} ms "
            f"| {r['recomputed_ms']:7.0f} ms | {r['restored_ms'] / r['recomputed_ms']:5.2f} "
            f"| {r['restored_tokens']:9d} | {r['restored_equals_own']}"
        )
    if a.json:
        out = {
            "kind": "demo-ttft",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"vLLM CPU, {os.cpu_count()} CPUs",
            "command": "./scripts/demo.sh (python -m umbp.demo.serve --lengths "
            f"{a.lengths} --json FILE)",
            "rows": rows,
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        say(f"sweep results: {a.json}")
    return all(r["restored_equals_own"] for r in rows)


def start_server(workdir: str) -> tuple[subprocess.Popen, str]:
    """`umbp_standalone_server` on a socket in `workdir`; returns it once it answers."""
    import umbp

    sock = os.path.join(workdir, "umbp.sock")
    log_path = os.path.join(workdir, "umbp-server.log")
    cmd = [bin_path("umbp_standalone_server"), "--address", sock, "--capacity", "2GiB"]
    say("starting: " + " ".join(cmd))
    say(f"server log: {log_path}")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with umbp.StandaloneClient(sock, startup_timeout_ms=30000) as c:
            say(f"server ready: boot {c.ping()}")
    except umbp.ServerUnavailable as e:
        proc.kill()
        with open(log_path) as f:
            raise RuntimeError(f"umbp_standalone_server did not start:\n{f.read()[-3000:]}") from e
    return proc, sock


def server_objects(sock: str) -> int:
    import umbp

    with umbp.StandaloneClient(sock, startup_timeout_ms=5000) as c:
        return int(c.stats()["objects"])


def standalone(a: argparse.Namespace, model: str) -> int:
    server, sock = start_server(a.workdir)
    connector = standalone_connector(sock)
    engines: list[Engine] = []
    try:
        ea = Engine("A", model, a.port, connector, a.workdir, corrupt=a.corrupt)
        eb = Engine("B", model, a.port + 1, connector, a.workdir, corrupt=a.corrupt)
        engines += [ea, eb]
        ea.wait_ready()
        eb.wait_ready()
        ps = make_prompts(a.prompts, a.tokens, seed=a.seed)
        cold, own, shared = [], [], []
        for i, p in enumerate(ps):
            cold.append(ea.complete(p, a.max_tokens))
            own.append(ea.complete(p, a.max_tokens))  # the reference: A's own prefix cache
            ea.reset(external=False)  # waits for A's stores to reach the server
            shared.append(eb.complete(p, a.max_tokens))
            ok, why = judge(own[-1], shared[-1])
            say(
                f"prompt {i}: {cold[-1]['prompt_tokens']} tokens; engine A computed it "
                f"(TTFT {cold[-1]['ttft'] * 1000:.0f} ms), engine B restored "
                f"{shared[-1]['cached']} tokens from the server (TTFT "
                f"{shared[-1]['ttft'] * 1000:.0f} ms); {'OK' if ok else 'WRONG'}: {why}"
            )
        say(f"the server holds {server_objects(sock)} objects; restarting engine A ...")
        ea.stop()
        engines.remove(ea)
        ea = Engine("A2", model, a.port, connector, a.workdir, corrupt=a.corrupt)
        engines.append(ea)
        ea.wait_ready()
        restarted = [ea.complete(p, a.max_tokens) for p in ps]
        for i, r in enumerate(restarted):
            ok, why = judge(own[i], r)
            say(
                f"prompt {i}: the restarted engine A restored {r['cached']} tokens "
                f"(TTFT {r['ttft'] * 1000:.0f} ms); {'OK' if ok else 'WRONG'}: {why}"
            )
        ea.reset(external=True)  # the whole server pool, for both engines
        left = server_objects(sock)
        say(f"reset_external from engine A: the server holds {left} objects")
        eb.reset(external=False)
        recomputed = [eb.complete(p, a.max_tokens) for p in ps]
        restores_ok = all(judge(o, s)[0] for o, s in zip(own, shared)) and all(
            judge(o, r)[0] for o, r in zip(own, restarted)
        )
        restored_ms = statistics.median(s["ttft"] for s in shared) * 1000
        recomputed_ms = statistics.median(r["ttft"] for r in recomputed) * 1000
        print()
        print("UMBP demo summary (vLLM CPU, standalone mode: one server, two engines)")
        print(f"  prompts                         {len(ps)} x ~{a.tokens} tokens (seed {a.seed})")
        print(f"  engine B: cached from A's work  {[s['cached'] for s in shared]}")
        print(f"  restarted A: cached             {[r['cached'] for r in restarted]}")
        print(f"  after reset_external: B cached  {[r['cached'] for r in recomputed]}")
        print(f"  TTFT restored on B (median)     {restored_ms:.0f} ms")
        print(f"  TTFT recomputed on B (median)   {recomputed_ms:.0f} ms")
        print(f"  TTFT ratio restored/recomputed  {restored_ms / recomputed_ms:.2f}")
        print(
            f"  restored = A's own cache        {restores_ok} (greedy tokens and log-probabilities)"
        )
        print(
            "  cold prefill = recomputed       "
            f"{[same_output(c, x) for c, x in zip(cold, recomputed)]} (information)"
        )
        print("  " + REFERENCE_NOTE)
        ok = restores_ok and all(r["cached"] == 0 for r in recomputed) and left == 0
        if left != 0 or any(r["cached"] for r in recomputed):
            say("FAIL: reset_external did not empty the server's pool")
        return verdict(ok)
    finally:
        for e in engines:
            e.stop()
        server.send_signal(signal.SIGTERM)
        try:
            rc = server.wait(timeout=30)
            say(f"umbp_standalone_server stopped (exit code {rc})")
        except subprocess.TimeoutExpired:
            server.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description="UMBP demo on vLLM CPU")
    ap.add_argument("--mode", choices=["embedded", "standalone"], default="embedded")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=4000, help="prompt length (byte tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--workdir", default=os.path.join(sys.prefix, "umbp-demo"))
    ap.add_argument(
        "--lengths",
        default="1024,2048,4096,8192,16384",
        help="embedded mode: after the prompts, one prompt of each length (byte tokens), "
        "restored vs recomputed; empty to skip",
    )
    ap.add_argument("--json", help="write the length sweep's results here (JSON)")
    ap.add_argument("--seed", type=int, default=7, help="the prompts' random seed")
    ap.add_argument(
        "--inject-corruption",
        dest="corrupt",
        action="store_true",
        help="test the verdict: flip one byte of the first restored block in the engine's KV "
        "cache after its load (the connector's UMBP_TEST_CORRUPT_RESTORES hook); the demo "
        "must then fail",
    )
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
        assert all(n > 0 for n in lengths)
    except (ValueError, AssertionError):
        ap.error(f"--lengths {a.lengths!r}: give prompt lengths in tokens, e.g. 1024,4096")
    if a.json is None:
        a.json = os.path.join(a.workdir, "demo-sweep.json")

    from umbp.demo.tiny_model import build

    say("building the demo model (4-layer random-weight Llama, byte tokenizer) ...")
    longest = max([a.tokens, *(int(x) for x in a.lengths.split(",") if x)])
    # The model's context covers the longest prompt (the demo's default folder keeps 8192).
    max_len = max(8192, 1 << (longest + 256 - 1).bit_length())
    name = "tiny-llama" if max_len == 8192 else f"tiny-llama-{max_len}"
    model = build(os.path.join(a.workdir, name), max_len=max_len)
    a.max_model_len = max_len
    say(f"model at {model}")
    return standalone(a, model) if a.mode == "standalone" else embedded(a, model)


if __name__ == "__main__":
    sys.exit(main())
