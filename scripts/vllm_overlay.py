"""Unpacks the pure-Python part of a vLLM release into a folder beside the test venv, so that
unit tests can run against that release's connector API objects (its `KVConnectorBase_V1`,
`KVCacheAccess`, KV cache specs, scheduler) with the venv's torch, where no engine of that
release can run (vLLM 0.34 needs torch 2.14; vLLM CPU 0.32 is what runs here).

    python scripts/vllm_overlay.py [--version 0.34.0] [--dest DIR] [--check]

Prints the folder (default `.venv/vllm-<version>-py`); put it first on PYTHONPATH. Only the
wheel's `.py` files are kept (about 63 MB for 0.34.0); its compiled kernels are left out, so
nothing that runs a kernel works there. The wheel (about 320 MB) is downloaded to a temporary
folder and deleted at once. `--check` exits 0 when the folder is complete.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default="0.34.0")
    ap.add_argument("--dest", default=None)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    dest = Path(a.dest) if a.dest else ROOT / ".venv" / f"vllm-{a.version}-py"
    marker = dest / ".complete"
    if marker.exists() and marker.read_text().strip() == a.version:
        print(dest)
        return 0
    if a.check:
        return 1
    shutil.rmtree(dest, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        print(f"downloading the vLLM {a.version} wheel (pure-Python part kept)", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", tmp, f"vllm=={a.version}"],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        n = 0
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py"):
                    z.extract(name, dest)
                    n += 1
    marker.write_text(a.version)
    size = sum(f.stat().st_size for f in dest.rglob("*.py")) / 1e6
    print(f"vLLM {a.version}: {n} Python files, {size:.0f} MB in {dest}", file=sys.stderr)
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
