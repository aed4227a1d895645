"""Benchmark of what the connector's metrics cost a vLLM engine: end-to-end time of the same
rounds with the stats collection on and off, interleaved in one engine.

One vLLM CPU engine (the tiny local model, built offline) runs in this process with
UMBPStoreConnector in embedded mode. Each round resets vLLM's own prefix cache and generates
a batch: half of its prompts were seen in earlier rounds (UMBP restores them), half are new
(UMBP stores them), so every round loads, stores and looks up. Rounds alternate between the
connector as shipped (metrics on) and the connector with its collectors replaced by ones that
count nothing and report None to vLLM (metrics off: what vLLM gets from a connector without
stats). The medians of the two, and their ratio, are printed.

    python -m umbp.vllm.bench_metrics [--rounds 12] [--prompts 8] [--tokens 1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any


class _Off:
    """A collector that counts nothing: `take()` is None, as a connector without stats."""

    class _Stats:
        def count(self, *_a: Any) -> None: ...

        def observe_seconds(self, *_a: Any) -> None: ...

        def pool(self, *_a: Any) -> None: ...

    stats = _Stats()

    def pool_due(self, _every_s: float) -> bool:
        return False

    def transfer(self, *_a: Any) -> None: ...

    def take(self) -> None:
        return None


def _prompt(i: int, tokens: int) -> str:
    words = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "kilo", "lima", "oscar", "zulu"]
    out, k = [], i
    while sum(len(w) + 1 for w in out) < tokens:
        k = (k * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(words[k % len(words)])
    return " ".join(out)[:tokens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12, help="rounds per arm (on, off)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per round")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # connectors in this process
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from umbp.demo.tiny_model import build
    from umbp.vllm.connector import UMBPStoreConnector
    from umbp.vllm.stats import StatsCollector

    work = tempfile.mkdtemp(prefix="umbp-bench-metrics-")
    model = build(os.path.join(work, "tiny"))
    llm = LLM(
        model=model,
        enable_prefix_caching=True,
        max_model_len=a.tokens + 64,
        dtype="bfloat16",
        seed=0,
        enforce_eager=True,
        disable_log_stats=False,  # vLLM's stats path on (LLM's default is off), as in serve
        kv_transfer_config=KVTransferConfig(
            kv_connector="UMBPStoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "capacity_bytes": 1 << 30,
                "lookup_dir": work,
                "dram_prefault": False,
            },
        ),
    )
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise SystemExit(
            "vLLM's engine core must run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conns = [core.scheduler.connector, get_kv_transfer_group()]
    assert all(isinstance(c, UMBPStoreConnector) for c in conns), conns
    roles = [c._worker or c._scheduler for c in conns]  # noqa: SLF001
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    half = a.prompts // 2
    seen = [_prompt(i, a.tokens) for i in range(half)]
    llm.generate(seen, sp, use_tqdm=False)  # warm-up: the repeated half is stored
    fresh = iter(range(1000, 10**6))
    times: dict[str, list[float]] = {"on": [], "off": []}
    pool = conns[1]._worker.store  # noqa: SLF001 (the worker's own pool)
    moved: dict[str, list[int]] = {"on": [], "off": []}  # blocks read from the pool
    for r in range(2 * a.rounds):
        arm = "on" if r % 2 == 0 else "off"
        for role in roles:
            role.collector = StatsCollector() if arm == "on" else _Off()
        batch = seen + [_prompt(next(fresh), a.tokens) for _ in range(a.prompts - half)]
        llm.reset_prefix_cache()  # vLLM's own cache: the seen half is restored by UMBP
        gets = pool.stats()["gets"]
        t0 = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        times[arm].append(time.perf_counter() - t0)
        moved[arm].append(pool.stats()["gets"] - gets)
    if not all(moved["on"] + moved["off"]):
        raise SystemExit(f"a round restored nothing from the pool: {moved}")
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    result = {
        "kind": "metrics",  # scripts/plot_results.py charts it
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs",
        "rounds_per_arm": a.rounds,
        "prompts": a.prompts,
        "tokens": a.tokens,
        "median_s_on": round(on, 4),
        "median_s_off": round(off, 4),
        "ratio_on_off": round(on / off, 4),
        "restored_blocks_per_round": statistics.median(moved["on"] + moved["off"]),
        "rounds_ms": {arm: [round(1000 * t, 1) for t in ts] for arm, ts in times.items()},
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(
            f"{a.rounds} rounds per arm, {a.prompts} prompts of {a.tokens} tokens "
            f"({half} restored, {a.prompts - half} stored per round; "
            f"{result['restored_blocks_per_round']} blocks restored per round):\n"
            f"  metrics on  median {on * 1000:.1f} ms per round\n"
            f"  metrics off median {off * 1000:.1f} ms per round\n"
            f"  ratio on / off {on / off:.4f}"
        )
    os._exit(0)  # vLLM's teardown is slow and adds nothing here


if __name__ == "__main__":
    raise SystemExit(main())
