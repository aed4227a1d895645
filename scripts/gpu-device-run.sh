#!/usr/bin/env bash
# Runs the GPU benchmark and the GPU tests on a machine with an NVIDIA GPU, from a folder that
# holds a built `umbp` binary, the umbp wheel and tests/gpu/test_gpu_path.py (see
# docs/benchmarks.md, "GPU"). Results go to $OUT (default ./gpu-out).
#   scripts/gpu-device-run.sh <folder>
set -u
C="${1:?folder with umbp, the wheel and test_gpu_path.py}"
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
  --format=csv | tee "$OUT/smi.txt"
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null)"
python3 -m pip install -q --no-deps --no-index --target /tmp/umbp "$C"/umbp-*.whl
export PYTHONPATH=/tmp/umbp PYTHONUNBUFFERED=1
chmod +x "$C/umbp"
timeout "${BENCH_TIMEOUT:-240}" "$C/umbp" bench gpu \
  --shapes "${SHAPES:-llama8b,tp8-8k,llama8b:36000}" --also-dma --pin-gib "${PIN_GIB:-64}" \
  --trace "$OUT/trace.json" --json >"$OUT/bench.txt" 2>"$OUT/bench.err"
echo "bench rc=$?"
grep -v '^{' "$OUT/bench.txt"
grep -E "error|panic|warn" "$OUT/bench.err" | tail -5
UMBP_GPU_RESULTS="$OUT/gpu_results.json" timeout "${TEST_TIMEOUT:-240}" \
  python3 -m pytest -q -rfE -p no:cacheprovider "$C/test_gpu_path.py" 2>&1 | tee "$OUT/pytest.txt" | tail -30
