import os
import sys
from pathlib import Path

import numpy as np
import pytest

import umbp

LAYERS = 4
BLOCKS = 64
PIECE = 2048  # bytes of one layer of one block


class KvCache:
    """A layer-first KV cache in one numpy allocation, as vLLM CPU lays it out."""

    def __init__(self, fill_seed=None, layers=LAYERS, blocks=BLOCKS, piece=PIECE):
        self.layers, self.blocks, self.piece = layers, blocks, piece
        if fill_seed is None:
            self.buf = np.zeros((layers, blocks, piece), dtype=np.uint8)
        else:
            rng = np.random.default_rng(fill_seed)
            self.buf = rng.integers(0, 256, size=(layers, blocks, piece), dtype=np.uint8)
        self.base = self.buf.ctypes.data

    def layout(self):
        stride = self.buf.strides
        return [
            [
                (self.base + layer * stride[0], self.blocks, stride[1], self.piece)
                for layer in range(self.layers)
            ]
        ]

    def block(self, b):
        return self.buf[:, b, :].tobytes()


@pytest.fixture
def store():
    s = umbp.EmbeddedStore(16 << 20, num_workers=2, prefault=False)
    yield s
    s.close()


@pytest.fixture
def kb():
    return umbp.KeyBuilder("pytest-ns", tp=0)


def hashes(ids):
    return [int(i).to_bytes(8, "little") + b"\x5a" * 24 for i in ids]


def umbp_command():
    """The `umbp` command (the Rust binary of crates/umbp-cli; not part of the Python package):
    $UMBP_BIN, else this checkout's release build, else the one `scripts/venv.sh` installs next
    to the Python that runs the tests."""
    if os.environ.get("UMBP_BIN"):
        return Path(os.environ["UMBP_BIN"])
    root = Path(__file__).resolve().parents[2]
    built = Path(os.environ.get("CARGO_TARGET_DIR", root / "target")) / "release" / "umbp"
    if built.is_file():
        return built
    return Path(sys.executable).parent / "umbp"
