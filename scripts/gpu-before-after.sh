#!/usr/bin/env bash
# Before/after on one GPU machine: the same GPU benchmarks from two builds, run alternately in
# one call (machines are shared and noisy: only figures measured side by side are compared).
#   scripts/gpu-before-after.sh <new folder> <old folder>
# Each folder holds `umbp` and `umbp_standalone_server`. Per round and build: `umbp bench gpu
# --sweep` (method auto, pieces of $AB_KIB KiB) and `umbp bench server --cuda` (one client, 64
# and 8 KiB pieces). Every result's JSON line goes to $OUT/before-after.jsonl with its build and
# round; the text lines are printed.
set -u
NEW="${1:?new build folder}"
OLD="${2:?old build folder}"
OUT="${OUT:-$PWD/gpu-out}"
ROUNDS="${AB_ROUNDS:-2}"
KIB="${AB_KIB:-8,32,64,256}"
mkdir -p "$OUT"
chmod +x "$NEW"/umbp "$NEW"/umbp_standalone_server "$OLD"/umbp "$OLD"/umbp_standalone_server
record() { # build round bench file
  local line
  line="$(grep '^{' "$4" | tail -1)"
  [ -n "$line" ] && printf '{"build":"%s","round":%s,"bench":"%s","result":%s}\n' \
    "$1" "$2" "$3" "$line" >>"$OUT/before-after.jsonl"
}
for r in $(seq 1 "$ROUNDS"); do
  for b in old new; do
    d="$OLD"; [ "$b" = new ] && d="$NEW"
    timeout 180 "$d/umbp" bench gpu --sweep --sweep-methods auto --sweep-kib "$KIB" --rounds 3 \
      --json >/tmp/ab-gpu.txt 2>/tmp/ab-gpu.err
    echo "== gpu sweep, $b build, round $r: rc=$?"
    grep -v '^{' /tmp/ab-gpu.txt | tail -12
    record "$b" "$r" gpu /tmp/ab-gpu.txt
    timeout 180 "$d/umbp" bench server --cuda --clients 1 --block-kib 64,8 --rounds 12 \
      --server-bin "$d/umbp_standalone_server" --json >/tmp/ab-server.txt 2>/tmp/ab-server.err
    echo "== server --cuda, $b build, round $r: rc=$?"
    grep -v '^{' /tmp/ab-server.txt | tail -12
    record "$b" "$r" server /tmp/ab-server.txt
  done
done
