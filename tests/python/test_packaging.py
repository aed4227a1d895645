"""What the Python package ships: the extension and the Python sources, never the benchmarks.

The `umbp` command (crates/umbp-cli: the benchmarks, clap and their dependencies) is a cargo-built
binary of its own; the extension must not link it. Dependencies point one way: the store knows
nothing of the lookup service.
"""

import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import zipfile

import pytest

import umbp._native

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Strings that linking the command puts into a binary: clap's source paths (panic locations,
# debug info), the command's crate and module names, and the old Python entry point. The crate
# name must not be followed by a letter: `umbp_client` (the standalone server's client, which
# the extension links) is not the command.
COMMAND_MARKERS = (b"clap_builder", rb"umbp_cli(?![a-z])", b"bench_gpu", b"cli_main")


def markers_in(binary: bytes):
    return [m.decode() for m in COMMAND_MARKERS if re.search(m, binary)]


def test_the_extension_has_no_command_entry():
    assert not hasattr(umbp._native, "cli_main")
    names = [n.lower() for n in dir(umbp._native)]
    assert [n for n in names if n.startswith("cli") or "bench" in n] == []
    assert importlib.util.find_spec("umbp._cli") is None
    assert importlib.util.find_spec("umbp.__main__") is None


def test_the_markers_tell_the_command_from_the_client():
    assert markers_in(b"_ZN8umbp_cli4main and crates/umbp-cli") == ["umbp_cli(?![a-z])"]
    assert markers_in(b"_ZN11umbp_client6Inner umbp_client::Transfer") == []


def test_the_extension_binary_links_no_benchmarks():
    data = pathlib.Path(umbp._native.__file__).read_bytes()
    assert markers_in(data) == [], umbp._native.__file__


def cargo_tree(package):
    """The names of `package`'s normal and build dependencies, itself included."""
    if not (ROOT / "Cargo.toml").is_file():
        pytest.skip("not a source checkout")
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("cargo is not installed")
    out = subprocess.run(
        [cargo, "tree", "--locked", "-p", package, "-e", "normal,build", "--prefix", "none"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_the_bindings_crate_does_not_depend_on_the_command():
    deps = cargo_tree("umbp-py")
    assert {"umbp-store", "umbp-lookup", "umbp-client"} <= deps, sorted(deps)
    assert {"umbp-cli", "clap", "clap_builder", "env_logger"} & deps == set()


def test_the_store_and_the_lookup_service_do_not_depend_on_each_other():
    assert "umbp-lookup" not in cargo_tree("umbp-store")
    assert "umbp-store" not in cargo_tree("umbp-lookup")


def test_the_client_links_neither_the_pool_nor_the_copy_engine():
    """The standalone client needs the CUDA driver (to export its memory), not the mover."""
    deps = {d for d in cargo_tree("umbp-client") if d.startswith("umbp-")}
    assert deps == {"umbp-client", "umbp-core", "umbp-unix", "umbp-proto", "umbp-cuda-driver"}
    assert {"umbp-pool", "umbp-copy", "umbp-cuda"} & cargo_tree("umbp-cuda-driver") == set()


def test_a_built_wheel_ships_no_benchmarks():
    """Runs on the wheel named by UMBP_WHEEL (scripts/test.sh builds one and sets it)."""
    wheel = os.environ.get("UMBP_WHEEL")
    if not wheel:
        pytest.skip("UMBP_WHEEL is not set (scripts/test.sh sets it to a freshly built wheel)")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "umbp/__init__.py" in names, names
        assert [n for n in names if n.endswith(("_cli.py", "__main__.py"))] == []
        exts = [n for n in names if n.startswith("umbp/_native") and n.endswith(".so")]
        assert len(exts) == 1, names
        assert markers_in(z.read(exts[0])) == [], exts[0]
        # No `umbp` console script: the command is the cargo-built binary.
        for n in names:
            if n.endswith(".dist-info/entry_points.txt"):
                assert "console_scripts" not in z.read(n).decode(), n
        # maturin records the Rust crates linked into the extension.
        for n in names:
            if ".dist-info/sboms/" in n and n.endswith(".json"):
                linked = {c["name"] for c in json.loads(z.read(n)).get("components", [])}
                assert "umbp-store" in linked, sorted(linked)
                assert {"umbp-cli", "clap", "clap_builder", "env_logger"} & linked == set(), n
