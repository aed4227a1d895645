"""The bindings' contract with Python: the exception classes and where the GIL is released."""

import pickle
import sys
import threading
import time

import pytest

import umbp
import umbp._native
import umbp.errors
import umbp.kv_layout
from conftest import hashes

NAMES = [
    "UmbpError",
    "ConfigError",
    "PoolError",
    "PoolFullError",
    "RegistrationError",
    "TransferError",
    "TransferTimeout",
    "StoreClosedError",
    "LookupServiceError",
    "CudaError",
    "ServerUnavailable",
]


def test_the_exception_classes_are_the_extensions():
    assert umbp.errors.__all__ == NAMES
    for name in NAMES:
        cls = getattr(umbp.errors, name)
        assert cls is getattr(umbp._native, name) is getattr(umbp, name)
        assert (cls.__module__, cls.__qualname__) == ("umbp.errors", name)
        assert cls.__doc__
        assert issubclass(cls, umbp.errors.UmbpError)
    assert umbp.errors.UmbpError.__bases__ == (Exception,)
    assert umbp.errors.ConfigError.__bases__ == (umbp.errors.UmbpError, ValueError)
    assert umbp.errors.TransferTimeout.__bases__ == (umbp.errors.UmbpError, TimeoutError)
    e = pickle.loads(pickle.dumps(umbp.errors.PoolFullError("full")))
    assert type(e) is umbp.errors.PoolFullError and str(e) == "full"


def test_raising_looks_nothing_up(monkeypatch):
    # The extension raises its own classes: replacing a name in umbp.errors changes nothing.
    real = umbp.errors.ConfigError
    monkeypatch.setattr(umbp.errors, "ConfigError", RuntimeError)
    with pytest.raises(real, match="64-byte keys"):
        umbp.Keys.from_bytes(b"abc")


def test_python_code_raises_the_same_classes():
    with pytest.raises(umbp._native.ConfigError, match="no dimension holds"):
        umbp.kv_layout.block_dim_of("l0", (3, 5), 4)


class Ticker:
    """A thread that counts while it can take the GIL. With a switch interval of minutes, the
    main thread keeps the GIL until it releases it itself: the count moves during a call only
    if the call released the GIL."""

    def __enter__(self):
        self.count, self.stop = 0, False
        self.interval = sys.getswitchinterval()
        started = threading.Event()

        def run():
            started.set()
            while not self.stop:
                self.count += 1
                time.sleep(0.0001)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        started.wait()
        sys.setswitchinterval(300)
        return self

    def ticks_during(self, call):
        time.sleep(0.01)  # lets the ticker run and go to sleep
        before = self.count
        call()
        return self.count - before

    def __exit__(self, *exc):
        sys.setswitchinterval(self.interval)
        self.stop = True
        self.thread.join()


def test_bulk_lookups_release_the_gil_and_small_ones_keep_it(store, kb):
    many = kb.keys_packed(0, b"".join(hashes(range(2_000_000))), 32)
    few = many[:16]
    with Ticker() as t:
        assert t.ticks_during(lambda: store.exists(few)) == 0
        assert t.ticks_during(lambda: store.exists(many)) > 0
        assert t.ticks_during(lambda: kb.keys_packed(0, b"\x01" * 32 * 1_000_000, 32)) > 0
