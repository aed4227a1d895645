"""The same fault gives the same exception class and the same `kind` in embedded and standalone
mode (a real `umbp_standalone_server` process for the latter), and per-key failures are named
with one vocabulary in both."""

import sys
from pathlib import Path

import numpy as np
import pytest
import standalone_peer as peer

import umbp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import running  # noqa: E402


@pytest.fixture(params=["embedded", "standalone"])
def store(request, tmp_path):
    """A store of either mode with `peer.own_buffer()` registered and its layout: (store,
    layout id, buffer)."""
    buf = peer.own_buffer()
    if request.param == "embedded":
        s = umbp.EmbeddedStore(64 << 20, num_workers=1, prefault=False)
        s.register_memory(buf.ctypes.data, buf.nbytes)
        yield s, s.register_layout(peer.layout(buf)), buf
        s.close()
    else:
        with running(tmp_path.name) as server:
            s, lid = peer.attach(server.endpoint, buf, "kinds")
            yield s, lid, buf
            s.close()


def raised(call):
    with pytest.raises(umbp.UmbpError) as e:
        call()
    return type(e.value).__name__, e.value.kind


def test_calls_fail_with_the_same_class_and_kind_in_both_modes(store):
    s, lid, _buf = store
    k = peer.keys(3)
    ids = list(range(peer.BLOCKS))
    assert raised(lambda: s.deregister_memory(12345)) == ("RegistrationError", "registration")
    assert raised(lambda: s.store(99, 0, ids, k)) == ("ConfigError", "not_found")
    assert raised(lambda: s.object_bytes(lid, 3)) == ("ConfigError", "invalid_argument")
    assert raised(lambda: s.store(lid, 0, [0, 1], k)) == ("ConfigError", "invalid_argument")
    assert raised(lambda: s.register_memory(4096, 4096)) == (
        "RegistrationError",
        "registration",
    )
    # A block id outside the layout: refused at once (embedded), or when the answer comes
    # (standalone, whose server checks it): the transfer failed as a whole, so its key reads
    # "failed" (kind "server") and `failure()` has the same kind as the embedded exception.
    bad = [peer.BLOCKS + 1]
    if isinstance(s, umbp.EmbeddedStore):
        assert raised(lambda: s.store(lid, 0, bad, k[:1])) == ("ConfigError", "invalid_argument")
    else:
        t = s.store(lid, 0, bad, k[:1])
        assert t.wait() == ["failed"] and t.failures()[0][:2] == (0, "server")
        kind, message = t.failure()
        assert kind == "invalid_argument" and "out of range" in message, message
    s.close()
    assert raised(lambda: s.exists(k)) == ("StoreClosedError", "closed")


def test_a_key_stored_with_another_size_fails_as_size_mismatch_in_both_modes(store):
    s, lid, buf = store
    k = peer.keys(4)
    buf[:] = peer.pattern(4)
    assert s.store(lid, 0, [0], k[:1]).wait() == ["done"]
    # A layout whose blocks are half as large, over the same registered memory.
    half = [
        [(base, blocks, stride, piece // 2) for base, blocks, stride, piece in group]
        for group in peer.layout(buf)
    ]
    small = s.register_layout(half)
    t = s.load(small, 0, [0], k[:1])
    assert t.wait() == ["failed"]
    [(index, kind, message)] = t.failures()
    assert (index, kind) == (0, "size_mismatch"), message
    assert "layout" in message


def test_exceptions_raised_from_python_have_their_class_kind():
    assert umbp.ConfigError("x").kind == "invalid_argument"
    assert umbp.ServerUnavailable("x").kind == "unavailable"
    assert umbp.StoreClosedError("x").kind == "closed"
    assert umbp.UmbpError("x").kind == "internal"
    e = umbp.PoolFullError("no room")
    assert isinstance(e, umbp.UmbpError) and e.kind == "pool_full"


def test_the_kind_survives_pickling(store):
    import pickle

    s, _lid, _buf = store
    with pytest.raises(umbp.RegistrationError) as e:
        s.deregister_memory(12345)
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is umbp.RegistrationError and back.kind == "registration"
    assert str(back) == str(e.value)
    assert np.all(_buf == 0)
