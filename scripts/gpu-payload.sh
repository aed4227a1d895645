#!/usr/bin/env bash
# Packs what a lent GPU machine needs for the serving bake-off into .vllm-bundle/pay/ (ignored
# by git, named in the third call's `carry`): the umbp and umbp_standalone_server binaries
# (stripped) and the umbp wheel (stripped), xz-compressed, an LMCache wheel when LMCACHE=1, and
# go.sh, which runs on the machine. Each call there may carry 64 MiB with the working tree, so
# the vLLM bundle's chunks travel first:
#
#   bash ../shared/tools/vllm-cuda/bundle.sh          # once: .vllm-bundle/c1 c2 c3
#   LMCACHE=1 scripts/gpu-payload.sh                   # here, after every change to the Rust
#   call 1: bash .vllm-bundle/c1/assemble.sh .vllm-bundle/c1          carry .vllm-bundle/c1
#   call 2: bash .vllm-bundle/c2/assemble.sh .vllm-bundle/c2          carry .vllm-bundle/c2
#   call 3: DEADLINE_S=1400 bash .vllm-bundle/pay/go.sh               carry .vllm-bundle/c3,
#                                                                           .vllm-bundle/pay
#   later calls, at once: bash scripts/gpu-serve-device.sh wait /tmp/pay 560
#
# go.sh takes ARMS, WORKLOADS, TWIN_ARMS, REPEATS, EXTRA (more bench_serve.py flags), CALL_S,
# DEADLINE_S and COPY_VARIANTS (`umbp bench copy` runs first; "none" skips them). The machine
# goes back 30 s after a call ends: issue the next call at once.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PAY=.vllm-bundle/pay
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$PAY"
rm -f "$PAY"/*.whl "$PAY"/umbp-payload.tar.xz
echo "== building (release): umbp, umbp_standalone_server, the wheel"
cargo build --release --locked -q -p umbp-cli -p umbp-server
strip -o "$STAGE/umbp" target/release/umbp
strip -o "$STAGE/umbp_standalone_server" target/release/umbp_standalone_server
.venv/bin/maturin build --release --strip -q -o "$STAGE" >/dev/null
tar -cJf "$PAY/umbp-payload.tar.xz" -C "$STAGE" umbp umbp_standalone_server \
  "$(cd "$STAGE" && ls umbp-*.whl)"
if [ "${LMCACHE:-0}" = 1 ]; then
  PY312=${PY312:-$(ls "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)}
  "${PY312:?need a python3.12 for pip download}" -m pip download -q --no-deps \
    --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$PAY" "lmcache==${LMCACHE_VERSION:-0.5.6}"
fi
cat >"$PAY/go.sh" <<'EOF'
#!/usr/bin/env bash
# On the GPU machine (call 3): the last vLLM bundle chunk, the payload, then the bake-off
# detached (scripts/gpu-serve-device.sh start), followed for CALL_S seconds.
set -u
R=$PWD
bash .vllm-bundle/c3/assemble.sh .vllm-bundle/c3 || exit 1
[ -f /tmp/vsite/.complete ] || { echo "the vLLM bundle is incomplete: run calls 1 and 2 first"; exit 1; }
rm -rf /tmp/pay && mkdir -p /tmp/pay
tar -xJf .vllm-bundle/pay/umbp-payload.tar.xz -C /tmp/pay
cp .vllm-bundle/pay/lmcache-*.whl /tmp/pay/ 2>/dev/null || true
cp -r tests /tmp/pay/
case "${COPY_VARIANTS:-auto}" in none) export COPY_VARIANTS=" " ;; *) export COPY_VARIANTS=${COPY_VARIANTS:-auto} ;; esac
export ARMS=${ARMS:-none,umbp-embedded,lmcache-local,native,umbp-standalone,lmcache}
export WORKLOADS=${WORKLOADS:-twin,random,chat8,prefix8,chat2,prefix2}
export BENCH_ARGS="--repeats ${REPEATS:-2} --saturation-from $R/docs/results/serve-h100-2026-12-07.json --twin-arms ${TWIN_ARMS:-umbp-standalone,native,umbp-embedded} --arm-estimate-s 150 ${EXTRA:-}"
bash scripts/gpu-serve-device.sh start /tmp/pay "${CALL_S:-540}" "${DEADLINE_S:-1400}"
EOF
chmod +x "$PAY/go.sh"
du -sh "$PAY"/* | sed 's/^/   /'
echo "== $PAY: $(du -sm "$PAY" | cut -f1) MiB (with c3 and the tree, under 64 MiB per call)"
