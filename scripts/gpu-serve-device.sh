#!/usr/bin/env bash
# The serving bake-off (tests/gpu_vllm/bench_serve.py) on a lent GPU machine whose calls are
# limited to 10 minutes: `start` runs `umbp bench copy` (each host copy, for the host-copy
# table), then starts the bake-off detached (setsid: it outlives the call while the machine
# stays warm) and follows it; `wait` (the next call, issued at once) follows it to the end.
# Each call copies what is there so far to $OUT, so a machine lost between calls loses only
# the arms not yet run.
#   scripts/gpu-serve-device.sh start <folder> [call seconds] [bake-off deadline seconds]
#   scripts/gpu-serve-device.sh wait <folder> [call seconds]
# <folder> holds umbp, umbp_standalone_server, the umbp wheel (umbp-*.whl), optionally an
# LMCache wheel (lmcache-*.whl), and tests/. vLLM's CUDA bundle must be unpacked in /tmp/vsite
# (../shared/tools/vllm-cuda: assemble.sh once per chunk). ARMS, WORKLOADS, BENCH_ARGS pass on.
set -u
MODE="${1:?start or wait}"
C="$(cd "${2:?folder}" && pwd)"
CALL_S="${3:-560}"
DEADLINE_S="${4:-1000}"
OUT="${OUT:-$PWD/serve-out}"
W=/tmp/umbp-serve
mkdir -p "$OUT" "$W"
T0=$(date +%s)
export PYTHONPATH="/tmp/umbp:/tmp/lmc:/tmp/vsite" PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
export UMBP_SERVER_BIN="$C/umbp_standalone_server"
# `umbp bench copy` with each host copy (NAME or NAME:BATCH_BLOCKS), one JSON line each.
copy_bench() {
  : >"$1"
  for v in $2; do
    hc=${v%%:*}; b=${v#*:}; extra=""; [ "$b" != "$v" ] && extra="--batch-blocks $b"
    timeout 120 "$C/umbp" bench copy --rounds 3 --host-copy "$hc" $extra --json 2>>"$W/copy.err" \
      | tail -1 >>"$1"
  done
  python3 - "$1" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{"):
        d = json.loads(line)
        print(f"copy {d['engine_copy']:9} batch {d.get('batch_blocks')} ratio {d['ratio']:.3f} "
              f"(store {d['store_ratio']:.2f} load {d['load_ratio']:.2f}) engine {d['gbps']:.1f} "
              f"memcpy {d['memcpy_gbps']:.1f} stream {d['stream_gbps']:.1f} GB/s; "
              f"calibration {d.get('calibration_gbps')}")
EOF
}
if [ "$MODE" = start ]; then
  [ -f /tmp/vsite/.complete ] || { echo "no vLLM bundle in /tmp/vsite"; exit 2; }
  chmod +x "$C/umbp" "$C/umbp_standalone_server"
  python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/umbp "$C"/umbp-*.whl
  if ls "$C"/lmcache-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/lmc "$C"/lmcache-*.whl \
      2>&1 | tail -2
  fi
  { nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
      --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400; } >"$OUT/machine.txt"
  cat "$OUT/machine.txt" | head -4
  copy_bench "$OUT/copy.jsonl" "${COPY_VARIANTS:-auto stream16 libc}"
  cd "$C"
  setsid nohup python3 tests/gpu_vllm/bench_serve.py --preset "${PRESET:-gpu-8b}" \
    --out "$W/serve.json" --keep "$W/run" --deadline-s "$DEADLINE_S" \
    --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" \
    --arms "${ARMS:-none,umbp-embedded,native,umbp-standalone,lmcache}" \
    --workloads "${WORKLOADS:-prefix2,prefix8,random,chat2,chat8}" ${BENCH_ARGS:-} \
    >"$W/driver.log" 2>&1 </dev/null &
  echo $! >"$W/driver.pid"
fi
PID=$(cat "$W/driver.pid")
copy_back() {
  cp "$W/serve.json" "$OUT/serve.json" 2>/dev/null
  cp "$W/driver.log" "$OUT/driver.log" 2>/dev/null
  (cd "$W" && find run -maxdepth 2 \( -name '*.log' -o -name 'verify-*.json' \) -size -20M \
    | tar -cJf "$OUT/logs.tar.xz" -T - 2>/dev/null)
}
while kill -0 "$PID" 2>/dev/null && [ $(( $(date +%s) - T0 )) -lt "$CALL_S" ]; do
  sleep 5
done
copy_back
if kill -0 "$PID" 2>/dev/null; then
  echo "bake-off still running after $(( $(date +%s) - T0 )) s: call '$0 wait' next"
else
  echo "bake-off finished"
  # A newer umbp carried by this call (umbp.next): its copy figures, once the GPU is idle.
  if [ "$MODE" = wait ] && [ -x "$C/umbp.next" ] && [ $(( $(date +%s) - T0 )) -lt $(( CALL_S - 40 )) ]; then
    cp "$C/umbp.next" "$C/umbp" && copy_bench "$OUT/copy-next.jsonl" "${NEXT_COPY:-auto libc}"
  fi
fi
grep -E "^\[|^\||probe|twin|startup" "$W/driver.log" | tail -70
