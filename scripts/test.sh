#!/usr/bin/env bash
# Runs every check and test: formatting, lints, Rust unit/property/stress/integration tests,
# and the Python tests against the built package. Creates .venv/ if needed.
# A first run needs about 10 GB free (vLLM CPU and torch ~6.5 GB in .venv/, Rust builds ~3 GB).
FREE_KB="$(df -Pk "$(dirname "$0")/.." | awk 'NR == 2 { print $4 }')"
printf '==> %s GB free on the disk that holds this checkout\n' "$((FREE_KB / 1024 / 1024))"
if [ "$FREE_KB" -lt $((10 * 1024 * 1024)) ]; then
  printf 'warning: under 10 GB free; a first run may stop with "No space left on device"\n' >&2
fi
source "$(dirname "$0")/venv.sh"
export CARGO_TERM_COLOR=never
# One-shot builds gain nothing from incremental caches (3 GB of target/debug here).
export CARGO_INCREMENTAL=0

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets -q -- -D warnings
step "ruff (lint + format check)"
ruff check python tests
ruff format --check python tests
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
step "Python tests (bindings, lookup service, connector options, packaging)"
python -m pytest -q -p no:cacheprovider tests/python
step "vLLM tests (real vLLM CPU engines; a few minutes)"
python -m pytest -q -p no:cacheprovider tests/vllm
step "all checks passed"
