#!/usr/bin/env python3
"""Charts of the benchmark results committed in docs/results/ (JSON), written to docs/img/.

Each results file says its `kind`; one PNG per file, named after it:

- `ttft`: time to first token against prompt length on a real vLLM CUDA engine
  (`tests/gpu_vllm/bench_ttft.py`): restored by UMBP in each mode, from vLLM's own GPU cache,
  recomputed, and the budget the restore is held to (log scales).
- `demo-ttft`: the demo's prompt-length sweep (`./scripts/demo.sh`, `--json`): TTFT restored
  against recomputed on vLLM CPU.
- `metrics`: `python -m umbp.vllm.bench_metrics --json`: each round's time with the connector's
  metrics on and off.
- `gpu-sweep`: `umbp bench gpu --sweep --json`: store and load GB/s as a share of the pinned-copy
  ceiling, by piece size, per copy method.
- `gpu-under-load`: `umbp bench gpu --under-load --json`: copy GB/s beside a full-GPU matmul and
  the matmul's slowdown, per shape and method.
- `remote`: `umbp bench remote --json`: the remote tier's put and get against raw pipelined
  SET / GET of the same sizes.
- `server`: `umbp bench server --json` (one object per run): GB/s through the server against
  embedded mode, per piece size and direction.
- `serve`: the serving bake-off (`tests/gpu_vllm/bench_serve.py --out`): TTFT p50 and
  throughput against the offered rate per arm (no offload, vLLM native, LMCache, UMBP in both
  modes), chat TTFT, and each arm's share of prompt tokens from vLLM's cache and from its tier.

    python scripts/plot_results.py            # (re)writes docs/img/<name>.png
    python scripts/plot_results.py --check    # exit 1 if a committed PNG differs from a re-run

A dev tool (matplotlib, installed by scripts/venv.sh), not part of the package. The PNGs are
byte-reproducible with the pinned matplotlib: no timestamps, the Agg renderer, fixed fonts.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS, IMG = ROOT / "docs" / "results", ROOT / "docs" / "img"


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.family": "DejaVu Sans",
            "font.size": 9,
            "svg.hashsalt": "umbp",
            "axes.grid": True,
            "grid.alpha": 0.3,
        }
    )
    return plt


MODE_STYLE = {
    "embedded": ("UMBP restored, embedded", "tab:blue", "o", "-"),
    "standalone": ("UMBP restored, standalone", "tab:orange", "s", "-"),
    "standalone-spin": ("UMBP restored, standalone (old spinning wait)", "tab:red", "x", ":"),
}


def ttft(d: dict, plt):
    rows = d["rows"]
    tokens = [r["tokens"] for r in rows]
    modes = [m for m in MODE_STYLE if m in rows[0]]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    first = rows[0][modes[0]]
    assert "cold_ms" in first and "own_ms" in first
    ax.plot(
        tokens,
        [r["embedded"]["cold_ms"] for r in rows],
        "k--",
        marker="^",
        label="recomputed (cold prefill)",
    )
    for m in modes:
        label, color, marker, ls = MODE_STYLE[m]
        ax.plot(
            tokens,
            [r[m]["restored_ms"] for r in rows],
            color=color,
            marker=marker,
            ls=ls,
            label=label,
        )
    ax.plot(
        tokens,
        [r["embedded"]["budget_ms"] for r in rows],
        color="tab:blue",
        ls="none",
        marker="_",
        markersize=14,
        label="budget: own + KV / (0.9 × link) + 3 ms",
    )
    ax.plot(
        tokens,
        [r["embedded"]["own_ms"] for r in rows],
        color="tab:green",
        marker="d",
        label="vLLM's own GPU prefix cache",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tokens, [f"{t // 1024}K" for t in tokens])
    ax.set_xlabel("prompt tokens (one request, one output token)")
    ax.set_ylabel("time to first token, ms (median)")
    link = d["link"]
    ax.set_title(
        f"{d['device']}: TTFT, Llama-3-8B shape, vLLM 0.33\n"
        f"link {link['h2d']:.1f} GB/s host→GPU, {d['date']}",
        fontsize=9,
    )
    ax.legend(fontsize=7.5, loc="upper left")
    return fig


def metrics(d: dict, plt):
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    for arm, color in (("on", "tab:blue"), ("off", "tab:gray")):
        xs = list(range(1, len(d["rounds_ms"][arm]) + 1))
        ax.plot(xs, d["rounds_ms"][arm], marker="o", color=color, label=f"metrics {arm}")
    ax.set_xlabel("round of each arm (the arms alternate: on, off, on, ...)")
    ax.set_ylabel("round time, ms")
    ax.set_title(
        f"Connector metrics on vs off, vLLM CPU ({d['machine']}): "
        f"median ratio {d['ratio_on_off']:.3f}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    return fig


METHOD_STYLE = {"auto": ("tab:blue", "o"), "staged": ("tab:green", "s"), "dma": ("tab:gray", "^")}


def gpu_sweep(d: dict, plt):
    r = d["result"]
    rows = r["sweep"]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.8), dpi=120, sharey=True)
    for ax, direction in zip(axes, ("store", "load")):
        for method, (color, marker) in METHOD_STYLE.items():
            pts = sorted(
                (x["piece_bytes"] >> 10, x[f"{direction}_ratio"])
                for x in rows
                if x["method"] == method
            )
            if pts:
                ax.plot(*zip(*pts), color=color, marker=marker, label=method)
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="pinned-copy ceiling")
        ax.set_xscale("log", base=2)
        kibs = sorted({x["piece_bytes"] >> 10 for x in rows})
        ax.set_xticks(kibs, [str(k) for k in kibs])
        ax.set_xlabel("piece size, KiB (one layer's K+V of a block)")
        ceiling = r["ceiling"]["d2h_gbps" if direction == "store" else "h2d_gbps"]
        arrow = "GPU → pool" if direction == "store" else "pool → GPU"
        ax.set_title(f"{direction} ({arrow}); ceiling {ceiling:.1f} GB/s", fontsize=9)
    axes[0].set_ylabel("GB/s as a share of the ceiling")
    axes[0].set_ylim(0, 1.08)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{d['device']}: copy bandwidth by piece size, {d['date']}", fontsize=9)
    return fig


def gpu_under_load(d: dict, plt):
    ul = d["result"]["under_load"]
    rows = ul["rows"]
    labels = [f"{x['shape']}\n{x['method']}" for x in rows]
    xs = range(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.4, 3.8), dpi=120)
    w = 0.27
    for k, (direction, color) in enumerate(
        (("store", "tab:blue"), ("load", "tab:orange"), ("both", "tab:green"))
    ):
        a1.bar(
            [x + (k - 1) * w for x in xs],
            [x[direction]["ratio_to_idle_ceiling"] for x in rows],
            w,
            color=color,
            label=direction,
        )
        a2.bar(
            [x + (k - 1) * w for x in xs],
            [x[direction]["slowdown_pct"] for x in rows],
            w,
            color=color,
            label=direction,
        )
    a2.errorbar(
        list(xs),
        [0] * len(rows),
        yerr=[max(x[k]["noise_pct"] for k in ("store", "load", "both")) for x in rows],
        fmt="none",
        ecolor="k",
        capsize=3,
        label="matmul noise (±)",
    )
    a1.set_ylim(0, 1.2)
    a1.set_ylabel("copy GB/s as a share of the idle ceiling")
    a2.set_ylabel("matmul slowdown, %")
    for ax in (a1, a2):
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.legend(fontsize=7, ncol=2, loc="upper center")
    lo, hi = a2.get_ylim()
    a2.set_ylim(lo, hi + 0.35 * (hi - lo))
    tflops = ul["matmul_tflops"]
    fig.suptitle(
        f"{d['device']}: copies beside a full-GPU bf16 matmul ({tflops:.0f} TFLOP/s alone), "
        f"medians of {ul['rounds']} rounds, {d['date']}",
        fontsize=9,
    )
    return fig


def _paired_bars(ax, labels, base, other, ratios=None, fontsize=None) -> None:
    """Bars of `base` and `other` ((values, color, label) each) side by side per label, each
    `other` bar labelled with its ratio to `base` (or `ratios`)."""
    xs = range(len(labels))
    for shift, (values, color, label) in ((-0.2, base), (0.2, other)):
        ax.bar([x + shift for x in xs], values, 0.4, color=color, label=label)
    ratios = ratios or [o / b for o, b in zip(other[0], base[0])]
    for x, v, q in zip(xs, other[0], ratios):
        ax.annotate(f"{q:.2f}", (x + 0.2, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), labels, fontsize=fontsize)


def server(d: dict, plt):
    runs = d["runs"]
    fig, axes = plt.subplots(
        1, len(runs), figsize=(max(6.4, 4.2 * len(runs)), 3.8), dpi=120, sharey=True
    )
    axes = axes if len(runs) > 1 else [axes]
    for ax, run in zip(axes, runs):
        rows = sorted(run["median_results"], key=lambda m: -m["piece_bytes"])
        groups = [
            (f"{m['piece_bytes'] >> 10} KiB\n{direction}", m[f"server_{direction}_gbps"],
             m[f"embedded_{direction}_gbps"])
            for m in rows
            for direction in ("store", "load")
        ]  # fmt: skip
        _paired_bars(
            ax,
            [g[0] for g in groups],
            ([g[2] for g in groups], "tab:blue", "embedded (in the client's process)"),
            ([g[1] for g in groups], "tab:orange", "through the server"),
            fontsize=8,
        )
        answered = "completion page" if run["completion_page"] else "replies only"
        ax.set_title(f"answered by the {answered}", fontsize=9)
    top = max(max(m["embedded_store_gbps"], m["embedded_load_gbps"], m["server_store_gbps"],
                  m["server_load_gbps"]) for run in runs for m in run["median_results"])  # fmt: skip
    axes[0].set_ylim(0, 1.3 * top)
    axes[0].set_ylabel("GB/s (median of rounds; label: server / embedded)")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(
        f"{d['device']}, {d['date']}\none client process, "
        f"{runs[0]['mode'].replace('cuda', 'CUDA')} memory: through the server vs embedded",
        fontsize=9,
    )
    return fig


def demo_ttft(d: dict, plt):
    rows = d["rows"]
    tokens = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(tokens, [r["recomputed_ms"] for r in rows], "k--", marker="^", label="recomputed")
    ax.plot(tokens, [r["restored_ms"] for r in rows], color="tab:blue", marker="o",
            label="restored by UMBP (embedded)")  # fmt: skip
    for t, r in zip(tokens, rows):
        ax.annotate(f"{r['restored_ms'] / r['recomputed_ms']:.2f}", (t, r["restored_ms"]),
                    textcoords="offset points", xytext=(0, -12), ha="center", fontsize=7)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tokens, [f"{t // 1024}K" for t in tokens])
    ax.set_ylim(0.6 * min(r["restored_ms"] for r in rows), None)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token, ms (label: restored / recomputed)")
    ax.set_title(f"The demo: {d['machine']}, tiny random-weight Llama, {d['date']}", fontsize=9)
    ax.legend(fontsize=8)
    return fig


def _tier_vs_raw(plt, rows, panels, raw_label, tier_label, suptitle):
    """Two panels (writes, reads) of a tier's GB/s beside the raw ceiling's per object size;
    `panels`: (raw key, tier key, ratio key, title) each."""
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.6), dpi=120, sharey=True)
    for ax, (raw, tier, ratio, title) in zip(axes, panels):
        _paired_bars(
            ax,
            [f"{r['object_bytes'] >> 10} KiB" for r in rows],
            ([r[raw] for r in rows], "tab:gray", raw_label),
            ([r[tier] for r in rows], "tab:blue", tier_label),
            ratios=[r[ratio] for r in rows],
        )
        ax.set_title(title, fontsize=9)
    top = max(r[k] for r in rows for p in panels for k in p[:2])
    axes[0].set_ylim(0, 1.3 * top)
    axes[0].set_ylabel("GB/s, median of rounds (label: tier / raw)")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.suptitle(suptitle, fontsize=9)
    return fig


def remote(d: dict, plt):
    return _tier_vs_raw(
        plt,
        d["result"]["results"],
        (
            ("raw_set_gbps", "tier_put_gbps", "put_vs_raw", "writes: tier put vs raw SET"),
            ("raw_get_gbps", "tier_get_gbps", "get_vs_raw", "reads: tier get vs raw GET"),
        ),
        "raw pipelined Redis",
        "UMBP remote tier",
        f"Remote tier, {d['machine']}, {d['date']}",
    )


def disk(d: dict, plt):
    r = d["result"]
    rs = r["restart"]
    return _tier_vs_raw(
        plt,
        r["sizes"],
        (
            ("raw_write_gbps", "write_behind_gbps", "write_ratio", "writes: write-behind vs raw"),
            ("raw_read_gbps", "promote_gbps", "promote_ratio", "reads: promote vs raw"),
        ),
        "raw O_DIRECT",
        "UMBP disk tier",
        f"Disk tier, {d['machine']}, {d['date']}; index of {rs['objects']:,} objects rebuilt in "
        f"{rs['rebuild_ms']:.0f} ms",
    )


def handover(d: dict, plt):
    """scripts/bench_handover.py: per pool size, the time nobody served (old server stops →
    new one ready) and the new process's start → its first answered lookup. With `same_build`
    (an upgrade run: `--old-binary`), the upgrade's bars beside the same build's."""
    rows = d["rows"] + (d.get("second_run") or {}).get("rows", [])
    rows = sorted(rows, key=lambda r: r["pool_gib"])
    same = sorted((d.get("same_build") or {}).get("rows", []), key=lambda r: r["pool_gib"])
    series = [(rows, "upgrade (older build → this one)" if same else None, 0.0)]
    if same:
        series.append((same, "same build", 0.4))
    width = 0.4 if same else 0.8
    labels = [f"{r['pool_gib']:g} GiB\n{r['objects']:,} obj" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.4), dpi=120)
    for ax, key, scale, title, color in (
        (axes[0], "gap_ms", 1.0, "nobody serving (ms)", "tab:blue"),
        (axes[1], "first_lookup_s", 1000.0, "new process start → first lookup (ms)", "tab:gray"),
    ):
        top = 0.0
        for rs, label, shift in series:
            vals = [r[key] * scale for r in rs]
            top = max([top, *vals])
            xs = [i + shift - (0.2 if same else 0.0) for i in range(len(rs))]
            bars = ax.bar(
                xs, vals, width, color=color, alpha=1.0 if shift == 0 else 0.45, label=label
            )
            for b, v in zip(bars, vals):
                ax.text(
                    b.get_x() + b.get_width() / 2,
                    v,
                    f"{v:.1f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.3 * top)
        if same:
            ax.legend(fontsize=7)
    what = "An upgrade by --take-over" if same else "A server replaced by --take-over"
    fig.suptitle(f"{what}, every object byte-exact; {d['machine']}, {d['date']}", fontsize=8)
    return fig


ARM_STYLE = {
    "none": ("no offload", "black", "^", "--"),
    "native": ("vLLM native CPU offload", "tab:green", "D", "-"),
    "lmcache": ("LMCache (its server)", "tab:purple", "v", "-"),
    "lmcache-local": ("LMCache (in the engine)", "tab:pink", "<", "-"),
    "umbp-embedded": ("UMBP embedded", "tab:blue", "o", "-"),
    "umbp-standalone": ("UMBP standalone", "tab:orange", "s", "-"),
    "umbp-dma": ("UMBP embedded, DMA only", "tab:cyan", "P", ":"),
}


def _serve_points(d: dict, arm: str, workload: str, ws: int) -> list[dict]:
    pts = d["arms"].get(arm, {}).get("points", {}).values()
    return [
        p for p in pts if p.get("workload") == workload and p.get("ws") == ws and "req_per_s" in p
    ]


def serve(d: dict, plt):
    """The serving bake-off (tests/gpu_vllm/bench_serve.py): TTFT p50 and throughput against
    the offered rate per arm for each shared-prefix working set, chat TTFT, and where each
    arm's prompt tokens came from."""
    arms = [a for a in ARM_STYLE if a in d["arms"]
            and any("req_per_s" in p for p in d["arms"][a].get("points", {}).values())]  # fmt: skip
    sets = sorted({p["ws"] for a in arms for p in d["arms"][a].get("points", {}).values()
                   if p.get("workload") == "prefix"})  # fmt: skip
    if not sets:
        return _serve_twin(d, plt)
    fig, axes = plt.subplots(2, len(sets) + 1, figsize=(4.2 * (len(sets) + 1), 7.2), dpi=110)
    h = d["gpu_pool_tokens"]
    for col, ws in enumerate(sets):
        top, bottom = axes[0][col], axes[1][col]
        inf_x = None
        for arm in arms:
            pts = _serve_points(d, arm, "prefix", ws)
            finite = [p["rate_req_s"] for p in pts if p.get("rate_req_s") not in (None, "inf")
                      and p["rate_req_s"] != float("inf")]  # fmt: skip
            inf_x = inf_x or (1.5 * max(finite) if finite else 1.0)
            pts = sorted(
                pts,
                key=lambda p: inf_x if p.get("rate") == "inf" else p["rate_req_s"],
            )
            xs = [inf_x if p.get("rate") == "inf" else p["rate_req_s"] for p in pts]
            label, color, marker, ls = ARM_STYLE[arm]
            for ax, key in ((top, "ttft_p50_ms"), (bottom, "req_per_s")):
                ax.plot(xs, [p[key] for p in pts], color=color, marker=marker, ls=ls,
                        label=label)  # fmt: skip
                if all(f"{key}_min" in p for p in pts):  # repeats: their range
                    ax.errorbar(xs, [p[key] for p in pts], fmt="none", ecolor=color, capsize=3,
                                yerr=[[p[key] - p[f"{key}_min"] for p in pts],
                                      [p[f"{key}_max"] - p[key] for p in pts]])  # fmt: skip
        top.set_yscale("log")
        top.set_title(f"shared prefixes, {ws}x GPU pool ({ws * h:,} tokens)", fontsize=10)
        top.set_ylabel("TTFT p50 (ms)")
        bottom.set_ylabel("completed requests/s")
        bottom.set_xlabel("offered rate (req/s); rightmost point: all at once")
        if col == 0:
            top.legend(fontsize=7)
    # Chat TTFT p50 / p99 per arm and working set.
    ax = axes[0][-1]
    chat_sets = sorted({p["ws"] for a in arms for p in d["arms"][a].get("points", {}).values()
                        if p.get("workload") == "chat"})  # fmt: skip
    width = 0.8 / max(1, len(arms))
    for i, arm in enumerate(arms):
        vals = []
        for ws in chat_sets:
            pts = _serve_points(d, arm, "chat", ws)
            vals.append(pts[0] if pts else {"ttft_p50_ms": 0})
        xs = [j + i * width for j in range(len(chat_sets))]
        ys = [v["ttft_p50_ms"] for v in vals]
        err = None
        if all("ttft_p50_ms_min" in v for v in vals):  # repeats: their range
            err = [[v["ttft_p50_ms"] - v["ttft_p50_ms_min"] for v in vals],
                   [v["ttft_p50_ms_max"] - v["ttft_p50_ms"] for v in vals]]  # fmt: skip
        ax.bar(xs, ys, width, color=ARM_STYLE[arm][1], label=ARM_STYLE[arm][0], yerr=err,
               capsize=3)  # fmt: skip
    ax.set_xticks([j + width * (len(arms) - 1) / 2 for j in range(len(chat_sets))])
    ax.set_xticklabels([f"chat {ws}x" for ws in chat_sets])
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("multi-turn chat")
    if not chat_sets:
        ax.axis("off")
        ax.text(0.5, 0.5, "no chat workload in this run", ha="center", transform=ax.transAxes)
    # Where prompt tokens came from, per arm, at the heaviest reuse points.
    ax = axes[1][-1]
    cases = [(f"prefix {ws}x", "prefix", ws) for ws in sets] + [
        (f"chat {ws}x", "chat", ws) for ws in chat_sets
    ]
    labels, local, ext = [], [], []
    for name, wl, ws in cases:
        for arm in arms:
            pts = [p for p in _serve_points(d, arm, wl, ws) if p.get("rate") in (None, "inf")]
            if not pts:
                continue
            labels.append(f"{name} {ARM_STYLE[arm][0]}")
            local.append(100 * (pts[0].get("local_hit_share") or 0))
            ext.append(100 * (pts[0].get("external_hit_share") or 0))
    ys = range(len(labels))
    ax.barh(ys, local, color="tab:gray", label="vLLM's own GPU cache")
    ax.barh(ys, ext, left=local, color="tab:cyan", label="restored from the tier")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of prompt tokens (%)")
    ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Serving bake-off (Llama-3-8B shape), {d['device']}, {d['date']}")
    return fig


def _serve_twin(d: dict, plt):
    """Two engines behind a round-robin client: where each arm's prompt tokens came from."""
    twin = {a: p for a, p in d.get("twin", {}).items() if "req_per_s" in p}
    arms = [a for a in ARM_STYLE if a in twin]
    fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=110)
    ys = range(len(arms))
    local = [100 * (twin[a].get("local_hit_share") or 0) for a in arms]
    ext = [100 * (twin[a].get("external_hit_share") or 0) for a in arms]
    labels = [
        f"{ARM_STYLE[a][0]}" + (" (one shared server)" if twin[a].get("shared_tier") else "")
        for a in arms
    ]
    ax.barh(ys, local, color="tab:gray", label="the engine's own GPU cache")
    ax.barh(ys, ext, left=local, color="tab:cyan", label="restored from the tier")
    ax.set_yticks(list(ys))
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of prompt tokens (%)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"Two engines, chat turns round-robin: {d['device']}, {d['date']}", fontsize=8)
    return fig


KINDS = {
    "serve": serve,
    "disk": disk,
    "ttft": ttft,
    "remote": remote,
    "demo-ttft": demo_ttft,
    "metrics": metrics,
    "gpu-sweep": gpu_sweep,
    "gpu-under-load": gpu_under_load,
    "server": server,
    "handover": handover,
}


def render(path: Path, plt) -> bytes:
    d = json.loads(path.read_text())
    kind = d.get("kind")
    if kind not in KINDS:
        raise SystemExit(f"{path}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    fig = KINDS[kind](d, plt)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    a = ap.parse_args()
    plt = _plt()
    stale = []
    for path in sorted(RESULTS.glob("*.json")):
        png = IMG / f"{path.stem}.png"
        data = render(path, plt)
        if a.check:
            if not png.is_file() or png.read_bytes() != data:
                stale.append(png.relative_to(ROOT))
        else:
            IMG.mkdir(parents=True, exist_ok=True)
            png.write_bytes(data)
            print(f"{png.relative_to(ROOT)} ({len(data)} bytes)")
    if stale:
        print(f"stale or missing charts: {', '.join(map(str, stale))}; run {sys.argv[0]}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
