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
