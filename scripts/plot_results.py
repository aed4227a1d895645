#!/usr/bin/env python3
"""Charts of the benchmark results committed in docs/results/ (JSON), written to docs/img/.

Each results file says its `kind`; one PNG per file, named after it:

- `ttft`: time to first token against prompt length on a real vLLM CUDA engine
  (`tests/gpu_vllm/bench_ttft.py`): restored by UMBP in each mode, from vLLM's own GPU cache,
  recomputed, and the budget the restore is held to (log scales).
- `metrics`: `python -m umbp.vllm.bench_metrics --json`: each round's time with the connector's
  metrics on and off.

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


KINDS = {"ttft": ttft, "metrics": metrics}


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
