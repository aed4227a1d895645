#!/usr/bin/env bash
# Runs the GPU benchmark and the GPU tests on a machine with an NVIDIA GPU, from a folder that
# holds built `umbp` and `umbp_standalone_server` binaries, the umbp wheel and the tests folder
# (tests/kv_matrix.py and tests/gpu/; see docs/benchmarks.md, "GPU"). Results go to $OUT
# (default ./gpu-out).
#   scripts/gpu-device-run.sh <folder>
# BENCH=shapes (default: llama8b, tp8-8k, a 2.2 GiB layer stride, with dma beside), sweep (the
# piece-size sweep: auto, dma and staged for 4-256 KiB pieces), load (idle rounds, then the same
# copies beside a bf16 matmul loop that fills every SM, for 8, 32 and 64 KiB pieces), server
# (one CUDA client through the standalone server against embedded mode, 64 and 8 KiB pieces,
# answered through the completion page and then by replies only), ttft (time to first token on
# a real vLLM CUDA engine, embedded and standalone, or the modes of MODES, e.g.
# embedded,standalone,standalone-spin: needs VLLM=1), serve (the serving bake-off of
# tests/gpu_vllm/bench_serve.py, every arm and workload, or ARMS / WORKLOADS: needs VLLM=1) or
# none; TESTS=0 skips pytest.
# VLLM=1: vLLM's CUDA build is unpacked in $VLLM_SITE (default /tmp/vsite: the offline bundle of
# ../shared/tools/vllm-cuda/, `assemble.sh` run once per chunk before this); the real-engine
# tests (tests/gpu_vllm/) run too, filtered by VLLM_TESTS (a pytest -k expression, default all).
# TESTS_DIR: where tests/ is (default <folder>/tests). <folder>/vllm-next-utils, when there, holds
# vLLM 0.34's vllm/utils/{extensible_tensor,vmm_driver}.py (its extensible KV cache's allocator).
set -u
C="${1:?folder with umbp, the wheel and tests/}"
T="${TESTS_DIR:-$C/tests}"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv | tee "$OUT/smi.txt"
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
python3 -m pip install -q --no-deps --no-index --target /tmp/umbp "$C"/umbp-*.whl
export PYTHONPATH=/tmp/umbp PYTHONUNBUFFERED=1
if [ "${VLLM:-0}" = 1 ]; then
  VLLM_SITE="${VLLM_SITE:-/tmp/vsite}"
  [ -f "$VLLM_SITE/.complete" ] || { echo "VLLM=1: no vLLM bundle unpacked in $VLLM_SITE"; exit 2; }
  export PYTHONPATH="/tmp/umbp:$VLLM_SITE" VLLM_USE_FLASHINFER_SAMPLER=0
fi
chmod +x "$C/umbp"
# cuBLAS for the matmul load, from PyTorch's NVIDIA wheels.
NV_LIBS="$(python3 -c 'import glob, os, site; print(":".join(sorted({os.path.dirname(f) for d in site.getsitepackages() for f in glob.glob(os.path.join(d, "nvidia", "**", "lib*.so*"), recursive=True)})))' 2>/dev/null)"
export LD_LIBRARY_PATH="${NV_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -x "$C/umbp_standalone_server" ] && chmod +x "$C/umbp_standalone_server" \
  && export UMBP_SERVER_BIN="$C/umbp_standalone_server"
# vLLM 0.34's allocator modules (vllm/utils/{extensible_tensor,vmm_driver}.py of its wheel) for
# tests/gpu_vllm/test_extensible_cache.py: no vLLM 0.34 engine runs on this machine's torch.
[ -d "$C/vllm-next-utils" ] && export UMBP_VLLM_NEXT_UTILS="$C/vllm-next-utils"
case "${BENCH:-shapes}" in
  shapes)
    timeout "${BENCH_TIMEOUT:-240}" "$C/umbp" bench gpu \
      --shapes "${SHAPES:-llama8b,tp8-8k,llama8b:36000}" --also-dma --pin-gib "${PIN_GIB:-64}" \
      --trace "$OUT/trace.json" --json >"$OUT/bench.txt" 2>"$OUT/bench.err"
    ;;
  sweep)
    timeout "${BENCH_TIMEOUT:-360}" "$C/umbp" bench gpu --sweep \
      --sweep-methods "${SWEEP_METHODS:-auto,dma,staged}" --rounds "${ROUNDS:-3}" \
      --json >"$OUT/bench.txt" 2>"$OUT/bench.err"
    ;;
  load)
    timeout "${BENCH_TIMEOUT:-420}" "$C/umbp" bench gpu --shapes "${SHAPES:-tp8-8k,28x32768,llama8b}" \
      --under-load --under-load-methods "${LOAD_METHODS:-auto,dma,staged}" --load-rounds "${LOAD_ROUNDS:-5}" --json \
      >"$OUT/bench.txt" 2>"$OUT/bench.err"
    ;;
  server)
    : >"$OUT/bench.txt"
    for answered in "" "--replies-only"; do
      timeout "${BENCH_TIMEOUT:-240}" "$C/umbp" bench server --cuda --clients "${CLIENTS:-1}" \
        --block-kib 64,8 --rounds "${ROUNDS:-12}" --in-flight "${IN_FLIGHT:-1}" \
        --server-bin "$C/umbp_standalone_server" $answered --json >>"$OUT/bench.txt" 2>>"$OUT/bench.err"
    done
    ;;
  ttft)
    timeout "${BENCH_TIMEOUT:-420}" python3 "$T/gpu_vllm/bench_ttft.py" --out "$OUT/ttft.json" --keep /tmp/umbp-ttft \
      --lengths "${LENGTHS:-1024,4096,16384,32768}" --repeats "${ROUNDS:-3}" \
      --modes "${MODES:-embedded,standalone}" \
      >"$OUT/bench.txt" 2>"$OUT/bench.err"
    ;;
  serve)
    # The serving bake-off (docs/serving-bakeoff.md) in the foreground; where a call cannot
    # last that long, scripts/gpu-serve-device.sh runs it detached over several calls.
    timeout "${BENCH_TIMEOUT:-3000}" python3 "$T/gpu_vllm/bench_serve.py" --preset gpu-8b \
      --out "$OUT/serve.json" --keep /tmp/umbp-serve --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
      --arms "${ARMS:-none,native,lmcache,umbp-embedded,umbp-standalone}" \
      --workloads "${WORKLOADS:-prefix2,prefix8,random,chat2,chat8,twin}" >"$OUT/bench.txt" 2>"$OUT/bench.err"
    ;;
  none) : >"$OUT/bench.txt" ;;
esac
echo "bench rc=$?"
grep -v '^{' "$OUT/bench.txt" | tail -60
grep -E "error|panic|warn" "$OUT/bench.err" | tail -5
if [ "${TESTS:-1}" = 1 ]; then
  UMBP_GPU_RESULTS="$OUT/gpu_results.json" timeout "${TEST_TIMEOUT:-300}" \
    python3 -m pytest -q -rfE -p no:cacheprovider "$T/gpu" 2>&1 | tee "$OUT/pytest.txt" | tail -30
fi
if [ "${VLLM:-0}" = 1 ] && [ "${VLLM_TESTS:-all}" != none ]; then
  K=(); [ "${VLLM_TESTS:-all}" != all ] && K=(-k "$VLLM_TESTS")
  UMBP_GPU_RESULTS="$OUT/gpu_vllm_results.json" timeout "${VLLM_TEST_TIMEOUT:-900}" \
    python3 -m pytest -q -s -rfE -p no:cacheprovider --basetemp=/tmp/umbp-gpu-vllm "${K[@]}" "$T/gpu_vllm" 2>&1 \
    | tee "$OUT/pytest_vllm.txt" | grep -E "^(standalone|embedded)|passed|failed|FAILED|ERROR|skipped" | tail -40
fi
# Engine and server logs, traces and verifier summaries of both, in one file.
(cd /tmp && find umbp-ttft umbp-gpu-vllm umbp-serve \( -name '*.log' -o -name '*.verify.json' -o -name 'trace-*' \) \
  -size -20M 2>/dev/null | tar -cJf "$OUT/vllm-logs.tar.xz" -T - 2>/dev/null) || true
