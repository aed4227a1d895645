"""Time to first token on a real vLLM CUDA engine: cold, from vLLM's own prefix cache, and
restored by UMBP (embedded and standalone mode), per prompt length, with the restore's cost
above the own cache turned into GB/s against the link measured in the same run.

    python tests/gpu_vllm/bench_ttft.py [--lengths 1024,4096,16384,32768] [--repeats 3]
        [--modes embedded,standalone[,standalone-spin]] [--shape llama8b] [--out ttft.json]

One engine per mode (Llama-3-8B's shape, dummy weights, 16-token blocks, CUDA graphs), one
request at a time. Per length, a warm-up prompt and then `--repeats` distinct prompts each go
cold -> own -> reset_prefix_cache -> restored, every request with one output token; medians are
reported. The connector's calls are traced (tests/gpu_vllm/verifier.py, `Tracer`): for the
first timed restore of each length the table gives where its time went (lookup, the steps
until the load was started and reported done, the rest). Mode `standalone-spin` is standalone
mode with the helper thread's wait for the engine's stream spinning in the CUDA driver, as it
did before it got a blocking-sync event: the difference it made, in the same run. The link ceiling is a 1 GiB pinned
host -> device copy, timed by CUDA events after the engines are gone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, Server, model_dir, passes_of, prompts, run_engine  # noqa: E402


def kv_bytes_per_token(shape: str) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 2


def link_gbps() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():  # the harness's own check on vLLM CPU
        return {"h2d": float("nan"), "d2h": float("nan")}
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        best = None
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            b.synchronize()
            dt = a.elapsed_time(b) / 1e3
            best = dt if best is None else min(best, dt)
        out[name] = n / best / 1e9
    return out


def trace_of(trace_prefix: Path, t0: float, t1: float) -> dict:
    """The connector's calls between a request's submission (t0) and its output (t1): when
    the lookup, the load's start, its hand-over to the server (standalone) and its reported
    end came, in ms after t0, and the whole timeline."""
    events, files = [], 0
    for f in trace_prefix.parent.glob(trace_prefix.name + ".*"):
        if f.suffix == ".tmp":
            continue
        try:
            events += json.loads(f.read_text())
            files += 1
        except (OSError, ValueError):
            continue
    ev = sorted((e for e in events if t0 <= e["t"] <= t1), key=lambda e: e["t"])
    ms = lambda t: round((t - t0) * 1e3, 2)  # noqa: E731
    out: dict = {"total_ms": ms(t1), "trace_files": files, "events_traced": len(events)}
    look = [e for e in ev if e["what"] == "get_num_new_matched_tokens" and e.get("tokens")]
    if look:
        out["lookup_at_ms"], out["lookup_ms"] = ms(look[0]["t"]), look[0]["ms"]
    load = [e for e in ev if e["what"] == "start_load_kv" and e.get("blocks")]
    if load:
        out["load_started_at_ms"], out["load_call_ms"] = ms(load[0]["t"]), load[0]["ms"]
    sub = [e for e in ev if e["what"] == "_submit_now" and not e.get("store")]
    if sub:
        out["load_submitted_at_ms"] = ms(sub[0]["t"] + sub[0]["ms"] / 1e3)
    done = [e for e in ev if e["what"] == "get_finished" and e.get("recving")]
    if done:
        out["load_reported_done_at_ms"] = ms(done[0]["t"] + done[0]["ms"] / 1e3)
    polls = [e for e in ev if e["what"] == "get_finished"]
    out["worker_steps_polled"] = len(polls)
    out["scheduler_steps"] = sum(1 for e in ev if e["what"] == "build_connector_meta")
    skip = ("role", "what", "t", "ms")
    out["timeline"] = [
        f"{ms(e['t'])} +{e['ms']} {e['role']} {e['what']} "
        + " ".join(f"{k}={v}" for k, v in e.items() if k not in skip)
        for e in ev[:80]
    ]
    return out


def run_mode(mode: str, args, root: Path, ps: list, plan: list, model: str) -> dict:
    server = None
    if mode.startswith("standalone"):
        (root / mode).mkdir()
        server = Server(root / mode, capacity=args.pool).start()
        conn = {"mode": "standalone", "endpoint": server.endpoint}
    else:
        conn = {"capacity_bytes": int(args.pool.rstrip("GiB")) << 30}
    trace = root / f"trace-{mode}"
    try:
        r = run_engine(
            dict(
                model=model,
                block_size=args.block_size,
                eager=args.eager,
                max_model_len=max(len(p) for p in ps) + 64,
                kv_cache_bytes=args.kv_gib << 30,
                connector=conn,
                prompts=ps,
                plan=plan,
                max_tokens=1,
                verify=False,
                trace=str(trace),
                spin_events=mode == "standalone-spin",
            ),
            root / f"engine-{mode}.log",
            timeout=args.timeout,
        )
    finally:
        if server is not None:
            server.stop()
    r["trace_prefix"] = str(trace)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096,16384,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="embedded,standalone")
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--kv-gib", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs")
    ap.add_argument("--pool", default="32GiB", help="pool size (GiB) of each mode")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--keep", default=None, help="folder for the logs and traces (default: a temporary one)"
    )
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="umbp-ttft-"))
    root.mkdir(parents=True, exist_ok=True)
    model = model_dir(root, args.shape, max_len=max(lengths) + 1024)
    ps, index = [], {}
    for li, n in enumerate(lengths):
        for r in range(args.repeats + 1):  # r = 0: warm-up
            index[(n, r)] = len(ps)
            ps.append(prompts(1, n, seed=1000 * li + r)[0])
    plan = [[i, p] for i in range(len(ps)) for p in ("cold", "own", "reset", "restored")]
    per_token = kv_bytes_per_token(args.shape)
    print(f"model {args.shape}: {per_token} KV bytes per token", flush=True)
    results, rows = {}, []
    for mode in args.modes.split(","):
        t = time.time()
        r = run_mode(mode, args, root, ps, plan, model)
        assert "error" not in r and "startup_error" not in r, r
        print(
            f"{mode}: engine up in {r['startup_s']} s, done in {time.time() - t:.0f} s", flush=True
        )
        results[mode] = r
        if args.out:  # what ran so far survives a later timeout
            Path(args.out).with_suffix(f".{mode}.json").write_text(json.dumps(r))
    link = link_gbps()
    print(
        f"link: pinned host -> device {link['h2d']:.1f} GB/s, device -> host {link['d2h']:.1f} GB/s"
    )
    for n in lengths:
        row: dict = {"tokens": n}
        for mode, r in results.items():
            p = {
                name: passes_of_len(r, name, index, n, args.repeats)
                for name in ("cold", "own", "restored")
            }
            cold = statistics.median(x["seconds"] for x in p["cold"]) * 1e3
            own = statistics.median(x["seconds"] for x in p["own"]) * 1e3
            rest = statistics.median(x["seconds"] for x in p["restored"]) * 1e3
            restored_tokens = p["restored"][0]["cached"]
            kv = restored_tokens * per_token
            above = rest - own
            row[mode] = {
                "cold_ms": round(cold, 1),
                "own_ms": round(own, 1),
                "restored_ms": round(rest, 1),
                "restored_tokens": restored_tokens,
                "kv_bytes": kv,
                "gbps_above_own": round(kv / (above / 1e3) / 1e9, 1) if above > 0 else None,
                "budget_ms": round(own + kv / (0.9 * link["h2d"] * 1e9) * 1e3 + 3, 1),
                "trace": trace_of(
                    Path(r["trace_prefix"]), p["restored"][0]["t0"], p["restored"][0]["t1"]
                ),
                "all_restored_ms": [round(x["seconds"] * 1e3, 1) for x in p["restored"]],
                "tokens_match": all(
                    a["tokens"] == b["tokens"] for a, b in zip(p["cold"], p["restored"])
                ),
            }
        rows.append(row)
    print_table(rows, link, list(results))
    for row in rows:
        for mode in results:
            if not row[mode]["tokens_match"]:
                print(
                    f"WRONG: {mode}, {row['tokens']} tokens: restored outputs differ from the "
                    "same engine's cold ones (restored KV is not the KV stored)"
                )
    if args.out:
        Path(args.out).write_text(json.dumps({"link": link, "rows": rows}, indent=1))


def passes_of_len(r: dict, name: str, index: dict, n: int, repeats: int) -> list[dict]:
    by_prompt = passes_of(r, name)
    return [by_prompt[index[(n, k)]] for k in range(1, repeats + 1)]


def print_table(rows: list[dict], link: dict, modes: list[str]) -> None:
    print(f"\nTTFT, medians (ms); link {link['h2d']:.1f} GB/s host->device")
    print(
        "| tokens | mode | cold | own cache | restored | KV restored | GB/s above own | budget | tokens same |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for mode in modes:
            m = row[mode]
            print(
                f"| {row['tokens']} | {mode} | {m['cold_ms']} | {m['own_ms']} | {m['restored_ms']} | "
                f"{m['kv_bytes'] / 2**30:.2f} GiB | {m['gbps_above_own']} | {m['budget_ms']} | "
                f"{m['tokens_match']} |"
            )
    for row in rows:
        for mode in modes:
            tr = {k: v for k, v in row[mode]["trace"].items() if k != "timeline"}
            print(f"trace {row['tokens']} {mode}: {json.dumps(tr)}")
            if row["tokens"] in (4096, 16384):  # one restore in full: where its time goes
                for line in row[mode]["trace"]["timeline"]:
                    print(f"  {line}")
        for mode in modes:
            if mode != "embedded" and "embedded" in row:
                e, s = row["embedded"]["restored_ms"], row[mode]["restored_ms"]
                print(f"{row['tokens']}: {mode} / embedded restored TTFT = {s / e:.3f}")


if __name__ == "__main__":
    main()
