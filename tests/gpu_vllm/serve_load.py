"""Load for the serving bake-off (bench_serve.py).

- `vllm_bench`: vLLM's own `vllm bench serve` (its `prefix_repetition` and `random` datasets,
  Poisson request rates, goodput), run in this process through `vllm.benchmarks.serve.main`
  with the arguments its command line takes, so that one import of vLLM serves every point.
- `chat`: multi-turn chat, which `vllm bench serve` has no dataset for: conversations with a
  unique first prompt, each turn resending the whole conversation (every earlier prompt and
  answer, by token id) plus new user tokens; a fixed number of clients, each sending the next
  turn of the conversation that has waited longest, so the reuse distance of a conversation is
  the number of active conversations. With several servers, turns go round-robin (turn k of
  conversation c to server (c + k) mod n).
- `probe`: the correctness probe: prompts sent one at a time, cold, then again after vLLM's own
  prefix cache is dropped (so a tier restores them); greedy outputs compared.

Every point's figures come out of `summarize`, the same for every arm and workload.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import random
import statistics
import time
from collections import deque

import aiohttp

#: Token ids the prompts draw from (the word-level tokenizer's words; 0-2 are specials).
FIRST_ID, LAST_ID = 3, 31999


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(recs: list[dict], duration: float, slo: dict) -> dict:
    """Client figures of one point from per-request records (`ok`, `ttft`, `latency`,
    `output_len`, `itls`, `prompt_len`): TTFT/TPOT/ITL/E2E percentiles in ms, request and
    output-token throughput, goodput (requests per second meeting every SLO of `slo`, ms)."""
    ok = [r for r in recs if r.get("ok")]
    ttft = [r["ttft"] * 1e3 for r in ok]
    e2e = [r["latency"] * 1e3 for r in ok]
    tpot = [
        (r["latency"] - r["ttft"]) * 1e3 / (r["output_len"] - 1) for r in ok if r["output_len"] > 1
    ]
    itl = [x * 1e3 for r in ok for x in r.get("itls", [])]
    out_tokens = sum(r["output_len"] for r in ok)

    def good(r: dict) -> bool:
        t = r["ttft"] * 1e3
        p = (r["latency"] - r["ttft"]) * 1e3 / max(1, r["output_len"] - 1)
        return t <= slo.get("ttft", float("inf")) and p <= slo.get("tpot", float("inf"))

    f = lambda x: None if x is None else round(x, 3)  # noqa: E731
    return {
        "requests": len(recs),
        "completed": len(ok),
        "failed": len(recs) - len(ok),
        "duration_s": round(duration, 3),
        "req_per_s": round(len(ok) / duration, 4) if duration > 0 else None,
        "out_tok_per_s": round(out_tokens / duration, 2) if duration > 0 else None,
        "prompt_tokens": sum(r.get("prompt_len", 0) for r in ok),
        "output_tokens": out_tokens,
        "goodput_req_per_s": round(sum(good(r) for r in ok) / duration, 4) if duration else None,
        "slo_ms": slo,
        **{f"ttft_p{q}_ms": f(pct(ttft, q)) for q in (50, 90, 99)},
        "ttft_mean_ms": f(statistics.fmean(ttft)) if ttft else None,
        **{f"tpot_p{q}_ms": f(pct(tpot, q)) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": f(pct(itl, q)) for q in (50, 99)},
        **{f"e2e_p{q}_ms": f(pct(e2e, q)) for q in (50, 99)},
    }


# -- vLLM's own benchmark client ----------------------------------------------------------


def vllm_bench(base_url: str, model: str, argv: list[str], slo: dict, log) -> dict:
    """One `vllm bench serve` run against `base_url` (argv: its dataset, rate and length
    flags); returns `summarize` of its per-request results plus vLLM's own summary."""
    from vllm.benchmarks import serve as vb

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser as P
    except ImportError:  # older layouts
        from vllm.utils import FlexibleArgumentParser as P  # type: ignore
    parser = P()
    vb.add_cli_args(parser)
    goodput = [f"{k}:{v}" for k, v in slo.items()]
    args = parser.parse_args(
        [
            "--base-url", base_url, "--model", model, "--tokenizer", model,
            "--backend", "openai", "--endpoint", "/v1/completions",
            "--ignore-eos", "--temperature", "0", "--disable-tqdm", "--save-detailed",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            *(["--goodput", *goodput] if goodput else []), *argv,
        ]
    )  # fmt: skip
    buf = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(buf):
        res = vb.main(args)
    log.write(buf.getvalue()[-4000:])
    log.flush()
    recs = []
    errors = res.get("errors") or [""] * len(res.get("ttfts", []))
    for i, ttft in enumerate(res.get("ttfts", [])):
        out_len = res["output_lens"][i]
        recs.append(
            {
                "ok": not errors[i] and out_len > 0,
                "ttft": ttft,
                "latency": res["latencies"][i],
                "output_len": out_len,
                "itls": res["itls"][i],
                "prompt_len": res["input_lens"][i],
            }
        )
    dur = res.get("duration") or (time.time() - t0)
    out = summarize(recs, dur, slo)
    out["vllm_bench"] = {
        k: res.get(k)
        for k in (
            "request_throughput", "request_goodput", "output_throughput", "median_ttft_ms",
            "p99_ttft_ms", "median_tpot_ms", "completed", "failed", "duration",
        )
    }  # fmt: skip
    first_err = next((e for e in errors if e), None)
    if first_err:
        out["first_error"] = str(first_err)[:500]
    return out


# -- the project's own clients --------------------------------------------------------------


async def complete(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> dict:
    """One streamed completion by token ids; returns the request's record with its output
    token ids."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    rec: dict = {"prompt_len": len(prompt), "ok": False, "itls": []}
    out_ids: list[int] = []
    t0 = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                rec["error"] = f"HTTP {r.status}: {(await r.text())[:300]}"
                return rec
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    rec["cached_tokens"] = details.get("cached_tokens")
                for ch in chunk.get("choices", []):
                    ids = ch.get("token_ids") or []
                    if not ids and not ch.get("text"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itls"].append(now - last)
                    last = now
                    out_ids += ids
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        return rec
    rec["latency"] = time.perf_counter() - t0
    rec["output_ids"] = out_ids
    rec["output_len"] = len(out_ids)
    rec["ok"] = "ttft" in rec and len(out_ids) > 0
    return rec


def chat(
    urls: list[str],
    model: str,
    conversations: int,
    turns: int,
    first_len: int,
    user_len: int,
    output_len: int,
    clients: int,
    seed: int,
    slo: dict,
) -> dict:
    """Multi-turn chat (module docstring); returns `summarize` of every turn plus per-turn
    TTFT medians and, with several servers, per-server figures."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(FIRST_ID, LAST_ID) for _ in range(n)]

    history = {c: tokens(first_len) for c in range(conversations)}
    user = {(c, k): tokens(user_len) for c in range(conversations) for k in range(1, turns)}
    recs: list[dict] = []

    async def run() -> float:
        queue: deque = deque((c, 0) for c in range(conversations))
        ready = asyncio.Condition()
        inflight = 0
        timeout = aiohttp.ClientTimeout(total=1800)
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

            async def client() -> None:
                nonlocal inflight
                while True:
                    async with ready:
                        while not queue and inflight:
                            await ready.wait()
                        if not queue:
                            return
                        c, k = queue.popleft()
                        inflight += 1
                    prompt = history[c] if k == 0 else history[c] + user[(c, k)]
                    server = (c + k) % len(urls)
                    rec = await complete(session, urls[server], model, prompt, output_len)
                    rec.update(conv=c, turn=k, server=server)
                    recs.append(rec)
                    history[c] = prompt + rec.get("output_ids", [])
                    rec.pop("output_ids", None)
                    async with ready:
                        inflight -= 1
                        if k + 1 < turns and rec["ok"]:
                            queue.append((c, k + 1))
                        ready.notify_all()

            t0 = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(clients)))
            return time.perf_counter() - t0

    dur = asyncio.run(run())
    out = summarize(recs, dur, slo)
    out["ttft_p50_ms_by_turn"] = {
        k: round(pct([r["ttft"] * 1e3 for r in recs if r["ok"] and r["turn"] == k], 50) or 0, 3)
        for k in range(turns)
    }
    cached = [r.get("cached_tokens") for r in recs if r.get("cached_tokens") is not None]
    if cached:
        out["cached_tokens_reported"] = sum(cached)
    if len(urls) > 1:
        out["by_server"] = {
            s: summarize([r for r in recs if r["server"] == s], dur, slo) for s in range(len(urls))
        }
    errs = [r["error"] for r in recs if r.get("error")]
    if errs:
        out["first_error"] = errs[0][:500]
    return out


def probe(serve, model: str, n: int, length: int, output_len: int, seed: int) -> dict:
    """Greedy outputs of `n` prompts sent one at a time: cold, then again after vLLM's own
    prefix cache is dropped (the tier restores them). Returns how many matched, and the
    prompt tokens vLLM counted from each source over the restored pass."""
    rng = random.Random(seed)
    prompts = [[rng.randint(FIRST_ID, LAST_ID) for _ in range(length)] for _ in range(n)]

    async def one_pass() -> list[dict]:
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            for p in prompts:
                out.append(await complete(s, serve.base, model, p, output_len))
        return out

    cold = asyncio.run(one_pass())
    time.sleep(1.0)  # stores still in flight pin their blocks; reset retries meanwhile
    reset_ok = serve.reset(external=False)
    before = serve.metrics()
    restored = asyncio.run(one_pass())
    after = serve.metrics()
    src = {
        k.split("[", 1)[1].rstrip("]"): after.get(k, 0) - before.get(k, 0)
        for k in after
        if k.startswith("vllm:prompt_tokens_by_source")
    }
    same = sum(
        1
        for a, b in zip(cold, restored)
        if a["ok"] and b["ok"] and a["output_ids"] == b["output_ids"]
    )
    return {
        "prompts": n,
        "prompt_tokens": length,
        "reset_ok": reset_ok,
        "same_outputs": same,
        "restored_pass_tokens_by_source": src,
        "cold_ttft_ms": [round(r.get("ttft", 0) * 1e3, 2) for r in cold],
        "restored_ttft_ms": [round(r.get("ttft", 0) * 1e3, 2) for r in restored],
        "errors": [r["error"] for r in cold + restored if r.get("error")][:3],
    }
