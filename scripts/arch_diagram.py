#!/usr/bin/env python3
"""The architecture diagram of README.md and docs/design.md, drawn from the crates.

Reads the workspace's crate graph (`cargo metadata --no-deps`: each member's normal
dependencies that are members too) and writes it as a Mermaid flowchart between the marker
comments `<!-- arch:begin -->` and `<!-- arch:end -->` of each file. An arrow is a dependency;
one that a longer path already implies is left out (transitive reduction), so the picture stays
readable and every path still means "depends on". Crates are grouped in the layers of `LAYERS`;
a crate missing there is an error, so a new crate cannot be left out of the picture silently.
The Python layer and the two deployment modes' run-time connections (dotted) are drawn from
`PYTHON` and `RUNTIME`, whose files and crates must exist.

    python scripts/arch_diagram.py            # (re)writes the block in both files
    python scripts/arch_diagram.py --check    # exit 1, with a diff, if either file differs
"""

from __future__ import annotations

import argparse
import difflib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [ROOT / "README.md", ROOT / "docs" / "design.md"]
BEGIN, END = "<!-- arch:begin -->", "<!-- arch:end -->"

# Layer id -> (title, {crate: what it is, in a few words}), drawn top to bottom.
LAYERS: dict[str, tuple[str, dict[str, str]]] = {
    "front": (
        "bindings and command",
        {
            "umbp-py": "PyO3 bindings, umbp._native",
            "umbp-cli": "the umbp command",
        },
    ),
    "serve": (
        "lookup service, server and client",
        {
            "umbp-store-lookup": "a store answering lookups",
            "umbp-lookup": "per-worker lookup socket",
            "umbp-server": "umbp_standalone_server",
            "umbp-client": "the server's client",
            "umbp-proto": "the server's gRPC API",
        },
    ),
    "store": ("store", {"umbp-store": "EmbeddedStore, sessions"}),
    "copy": (
        "copy engine",
        {
            "umbp-cuda": "CUDA mover",
            "umbp-copy": "registrations, copy jobs",
        },
    ),
    "driver": ("CUDA driver", {"umbp-cuda-driver": "driver API, IPC"}),
    "tiers": (
        "memory and tiers",
        {
            "umbp-remote": "remote tier: Redis / Valkey",
            "umbp-disk": "disk tier: NVMe segments",
            "umbp-pool": "DRAM pool, index, eviction",
        },
    ),
    "base": (
        "core",
        {
            "umbp-unix": "memfds, sockets, futexes",
            "umbp-core": "keys, layouts, options",
        },
    ),
}

# The Python layer: node -> (label, file it stands for, crates it uses).
PYTHON: dict[str, tuple[str, str, list[str]]] = {
    "py_scheduler": (
        "umbp.vllm scheduler side<br/>(vLLM's scheduler process)",
        "python/umbp/vllm/scheduler.py",
        ["umbp-py"],
    ),
    "py_worker": (
        "umbp.vllm worker side<br/>(each vLLM worker process)",
        "python/umbp/vllm/worker.py",
        ["umbp-py"],
    ),
}

# Run-time connections between processes (not dependencies): (from, to, label).
RUNTIME: list[tuple[str, str, str]] = [
    ("py_scheduler", "py_worker", "embedded: lookups, a Unix socket per worker"),
    ("umbp-client", "umbp-server", "standalone: gRPC and transfer channels, Unix sockets"),
]


def crate_graph() -> dict[str, set[str]]:
    """Each workspace crate's normal (not dev, not build) dependencies on other members."""
    cmd = ["cargo", "metadata", "--format-version", "1", "--no-deps"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr}")
    meta = json.loads(run.stdout)
    members = set(meta["workspace_members"])
    pkgs = [p for p in meta["packages"] if p["id"] in members]
    names = {p["name"] for p in pkgs}
    return {
        p["name"]: {d["name"] for d in p["dependencies"] if d["name"] in names and not d["kind"]}
        for p in pkgs
    }


def reduce(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Drops each edge a -> b that another path from a to b implies."""

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for d in graph[todo.pop()]:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return seen

    return {
        a: {b for b in deps if not any(b in reach(c) for c in deps - {b})}
        for a, deps in graph.items()
    }


def node(name: str) -> str:
    return name.replace("-", "_")


def check_inputs(graph: dict[str, set[str]]) -> list[str]:
    mapped = {c for _, crates in LAYERS.values() for c in crates}
    errors = [
        f"crate {c} is in the workspace but not in LAYERS of scripts/arch_diagram.py: "
        f"add it to the layer it belongs to, with a few words on what it is, then run "
        f"python scripts/arch_diagram.py"
        for c in sorted(set(graph) - mapped)
    ]
    errors += [
        f"LAYERS of scripts/arch_diagram.py names {c}, which is not a workspace crate: "
        f"remove it or fix its name"
        for c in sorted(mapped - set(graph))
    ]
    for _, path, uses in PYTHON.values():
        if not (ROOT / path).is_file():
            errors.append(f"PYTHON of scripts/arch_diagram.py names {path}, which is missing")
        errors += [
            f"PYTHON of scripts/arch_diagram.py uses {c}: no such crate"
            for c in uses
            if c not in graph
        ]
    for a, b, _ in RUNTIME:
        errors += [
            f"RUNTIME of scripts/arch_diagram.py connects {x}: no such crate or Python node"
            for x in (a, b)
            if x not in graph and x not in PYTHON
        ]
    return errors


def diagram(graph: dict[str, set[str]]) -> str:
    lines = [
        BEGIN,
        "<!-- Generated by scripts/arch_diagram.py from `cargo metadata`; edit the script. -->",
        "",
        "```mermaid",
        "flowchart TB",
        '  subgraph layer_python["Python package umbp: the vLLM connector"]',
    ]
    lines += [f'    {n}["{label}"]' for n, (label, _, _) in PYTHON.items()]
    lines.append("  end")
    for layer, (title, crates) in LAYERS.items():
        lines.append(f'  subgraph layer_{layer}["{title}"]')
        lines += [f'    {node(c)}["<b>{c}</b><br/>{what}"]' for c, what in crates.items()]
        lines.append("  end")
    lines += [f"  {n} --> {node(c)}" for n, (_, _, uses) in PYTHON.items() for c in uses]
    reduced = reduce(graph)
    lines += [f"  {node(a)} --> {node(b)}" for a in sorted(reduced) for b in sorted(reduced[a])]
    lines += [f'  {node(a)} -.->|"{label}"| {node(b)}' for a, b, label in RUNTIME]
    lines += [
        "```",
        "",
        "An arrow points from a crate to one it depends on (normal dependencies; an arrow that a",
        "longer path already implies is left out). Dotted: connections between processes at run",
        "time.",
        END,
    ]
    return "\n".join(lines)


def render(text: str, block: str, path: Path) -> str:
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{path.relative_to(ROOT)}: no {BEGIN} ... {END} block to write into")
    return text[:start] + block + text[end + len(END) :]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write")
    a = ap.parse_args()
    graph = crate_graph()
    errors = check_inputs(graph)
    if errors:
        print("\n".join(f"error: {e}" for e in errors), file=sys.stderr)
        return 1
    block = diagram(graph)
    stale = 0
    for path in TARGETS:
        old = path.read_text()
        new = render(old, block, path)
        rel = str(path.relative_to(ROOT))
        if a.check and new != old:
            stale += 1
            sys.stdout.writelines(
                difflib.unified_diff(
                    old.splitlines(True), new.splitlines(True), rel, rel + " (new)"
                )
            )
        elif not a.check and new != old:
            path.write_text(new)
            print(f"{rel}: diagram written")
    if stale:
        print(
            "the architecture diagram differs from the crates; run: python scripts/arch_diagram.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
