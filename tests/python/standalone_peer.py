"""A client process of test_standalone.py: `python standalone_peer.py MODE ENDPOINT SEED [ARG]`.

Its KV cache is one numpy buffer (LAYERS x BLOCKS x PIECE bytes, layer-first); the pattern of
seed S is what `pattern(S)` gives, so any process can check another's bytes.

- `store`: stores every block under `keys(S)` and prints "stored".
- `load`: loads `keys(S)` into the blocks in reverse order, checks every byte against
  `pattern(S)` and prints "verified".
- `loop`: stores its blocks, prints "looping", then loads and stores them until killed.
- `rounds`: as `loop`, checking each load, until the file ARG exists; then one more round, a
  close, and "completed N" (N rounds).
"""

import mmap
import os
import sys

import numpy as np

import umbp

LAYERS, BLOCKS, PIECE = 4, 32, 4096
NAMESPACE = "standalone-test"


def pattern(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(LAYERS, BLOCKS, PIECE), dtype=np.uint8)


def hashes(seed):
    """The 32-byte block hashes of seed `seed`."""
    return [
        seed.to_bytes(4, "little") + i.to_bytes(4, "little") + b"\x33" * 24 for i in range(BLOCKS)
    ]


def keys(seed, tp=0):
    return umbp.KeyBuilder(NAMESPACE, tp=tp).keys(0, hashes(seed))


def own_buffer():
    """A zeroed KV cache in a private anonymous mapping of its own: page-aligned, as the
    standalone client moves only whole pages that hold nothing else (a heap buffer shares
    its first and last page with other objects and is refused)."""
    m = mmap.mmap(-1, LAYERS * BLOCKS * PIECE, flags=mmap.MAP_PRIVATE)
    return np.frombuffer(m, dtype=np.uint8).reshape(LAYERS, BLOCKS, PIECE)


def layout(buf):
    s = buf.strides
    base = buf.ctypes.data
    return [[(base + layer * s[0], BLOCKS, s[1], PIECE) for layer in range(LAYERS)]]


def attach(endpoint, buf, name):
    c = umbp.StandaloneClient(endpoint, startup_timeout_ms=10000, client_name=name)
    c.register_memory(buf.ctypes.data, buf.nbytes)
    return c, c.register_layout(layout(buf))


def main():
    mode, endpoint, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ids = list(range(BLOCKS))
    k = keys(seed)
    if mode == "load":
        buf = own_buffer()
        c, lid = attach(endpoint, buf, "peer-load")
        assert c.exists(k) == [True] * BLOCKS, c.exists(k)
        assert c.load(lid, 0, ids[::-1], k).wait() == ["done"] * BLOCKS
        assert np.array_equal(buf[:, ::-1, :], pattern(seed)), "loaded bytes differ"
        print("verified", flush=True)
        c.close()
        return
    buf = own_buffer()
    buf[:] = pattern(seed)
    c, lid = attach(endpoint, buf, f"peer-{mode}")
    first = c.store(lid, 0, ids, k).wait()
    assert set(first) <= {"done", "already_present"}, first
    if mode == "store":
        print("stored", flush=True)
        c.close()
        return
    print("looping", flush=True)
    expected = buf.copy()
    rounds, stop = 0, sys.argv[4] if mode == "rounds" else None
    while True:
        last = stop is not None and os.path.exists(stop)
        buf[:] = 0
        assert c.load(lid, 0, ids, k).wait() == ["done"] * BLOCKS
        if mode == "rounds":
            assert np.array_equal(buf, expected), "loaded bytes differ"
        assert set(c.store(lid, 0, ids, k).wait()) == {"already_present"}
        rounds += 1
        if last:
            break
    c.close()
    print(f"completed {rounds}", flush=True)


if __name__ == "__main__":
    main()
