"""The serving bake-off's harness (tests/gpu_vllm/bench_serve.py) on vLLM CPU: a real
`vllm serve` with UMBP in standalone mode, driven by vLLM's own `vllm bench serve` and by the
harness's chat client. CI checks what the GPU run relies on: every point gives client figures
and `/metrics` deltas, the tier restores (external hits), the saturation rate measured at `inf`
sets the later rates, and the probe's restored blocks pass the byte verifier."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ENV

GPU_VLLM = Path(__file__).parent.parent / "gpu_vllm"
sys.path.insert(0, str(GPU_VLLM))
from common import server_bin  # noqa: E402
from serve_engine import parse_metrics  # noqa: E402
from serve_load import pct, summarize  # noqa: E402


def test_summaries_and_metric_deltas_are_computed_as_documented():
    recs = [
        {"ok": True, "ttft": 0.1 * i, "latency": 0.1 * i + 0.3, "output_len": 4, "itls": [0.1]}
        for i in range(1, 11)
    ] + [{"ok": False}]
    s = summarize(recs, 2.0, {"ttft": 500})
    assert s["completed"] == 10 and s["failed"] == 1 and s["req_per_s"] == 5.0
    assert s["ttft_p50_ms"] == pytest.approx(550.0)
    assert s["tpot_p50_ms"] == pytest.approx(100.0)
    assert s["goodput_req_per_s"] == 2.5  # ttft 100..500 ms meet the SLO
    assert pct([3.0], 99) == 3.0 and pct([], 50) is None
    text = (
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 12.0\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 5.0\n'
        'vllm:umbp_load_seconds_bucket{le="0.1"} 3.0\n'
        'vllm:umbp_load_seconds_sum{engine="0"} 0.5\n'
        'vllm:umbp_load_seconds_sum{engine="1"} 0.25\n'
        "vllm:num_requests_running 4.0\n"
    )
    m = parse_metrics(text)
    assert m == {
        "vllm:prompt_tokens_by_source_total[local_compute]": 12.0,
        "vllm:prompt_tokens_by_source_total[external_kv_transfer]": 5.0,
        "vllm:umbp_load_seconds_sum": 0.75,
    }


def test_repeats_combine_into_medians_ranges_and_summed_counters():
    from bench_serve import combine

    def rec(seed, rps, ttft, ext):
        return {
            "seed": seed, "workload": "prefix", "req_per_s": rps, "ttft_p50_ms": ttft,
            "completed": 48, "metrics": {"vllm:prompt_tokens_by_source_total[x]": ext},
            "tokens_by_source": {"external_kv_transfer": ext}, "vllm_bench": {"duration": 1.0},
        }  # fmt: skip

    one = rec(1, 10.0, 50.0, 100.0)
    assert combine([one]) == one
    c = combine([rec(1, 12.0, 70.0, 100.0), rec(2, 10.0, 50.0, 120.0), rec(3, 11.0, 90.0, 80.0)])
    assert c["req_per_s"] == 11.0 and c["req_per_s_min"] == 10.0 and c["req_per_s_max"] == 12.0
    assert c["ttft_p50_ms"] == 70.0 and (c["ttft_p50_ms_min"], c["ttft_p50_ms_max"]) == (50, 90)
    assert c["completed"] == 48 and "completed_min" not in c
    assert c["tokens_by_source"] == {"external_kv_transfer": 300.0}
    assert c["metrics"]["vllm:prompt_tokens_by_source_total[x]"] == 300.0
    assert c["seed"] == [1, 2, 3] and len(c["repeats"]) == 3 and "vllm_bench" not in c
    assert c["workload"] == "prefix" and "error" not in c
    # Two repeats: their mean; a failed repeat is left out of the figures and reported.
    c = combine([rec(1, 12.0, 70.0, 1.0), rec(2, 10.0, 50.0, 1.0), {"seed": 3, "error": "boom"}])
    assert c["req_per_s"] == 11.0 and c["error"].startswith("1 of 3 repeats failed: boom")


def test_bench_serve_restores_and_verifies_on_vllm_cpu(tmp_path):
    if not server_bin():
        pytest.skip("needs umbp_standalone_server (scripts/venv.sh builds it into .venv/bin)")
    out = tmp_path / "serve.json"
    cmd = [
        sys.executable, str(GPU_VLLM / "bench_serve.py"), "--preset", "cpu-tiny",
        "--arms", "umbp-standalone", "--workloads", "prefix2,chat2",
        "--out", str(out), "--keep", str(tmp_path / "run"),
    ]  # fmt: skip
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    arm = res["arms"]["umbp-standalone"]
    assert "error" not in arm, arm.get("error")
    pts = arm["points"]
    assert set(pts) == {"prefix2@inf", "prefix2@sat", "prefix2@half", "chat2"}
    for name, pt in pts.items():
        assert pt["completed"] == pt["requests"] > 0, (name, pt)
        assert pt["metrics"]["vllm:request_success_total"] == pt["requests"], (name, pt)
    # The rates after `inf` come from the throughput measured there.
    sat = res["saturation_req_s"]["prefix2"]
    assert pts["prefix2@inf"]["req_per_s"] == sat
    assert pts["prefix2@half"]["rate_req_s"] == pytest.approx(sat / 2)
    # The working set is twice the GPU pool: the tier serves part of the prompts.
    assert pts["prefix2@inf"]["external_tokens"] > 0, pts["prefix2@inf"]
    assert pts["chat2"]["external_tokens"] > 0, pts["chat2"]
    assert pts["prefix2@inf"]["metrics"]["vllm:umbp_load_bytes_total"] > 0
    probe = arm["probe"]
    assert probe["same_outputs"] == probe["prompts"], probe
    assert probe["restored_pass_tokens_by_source"]["external_kv_transfer"] > 0, probe
    v = probe["verifier"]
    assert v["checked"] > 0 and v["mismatched"] == 0 and v["changed_late"] == 0, v
