#!/usr/bin/env bash
# Runs every check and test: formatting, lints, Rust unit/property/stress/integration tests,
# and the Python tests against the built package. Creates .venv/ if needed.
source "$(dirname "$0")/venv.sh"
export CARGO_TERM_COLOR=never

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
