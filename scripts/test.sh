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
step "Python tests (bindings, lookup service, connector options)"
python -m pytest -q -p no:cacheprovider tests/python
step "vLLM tests (real vLLM CPU engines; a few minutes)"
python -m pytest -q -p no:cacheprovider tests/vllm
step "all checks passed"
