"""The connector's standalone runtime (`umbp.vllm.standalone`, `StandaloneRuntime`) against a
real `umbp_standalone_server`, without vLLM: the store and lookups the worker and scheduler
sides are given, and what each failure of the server does to them. The same rows on real vLLM
engines are in tests/vllm/test_standalone.py.
"""

import mmap
import signal
import time

import numpy as np
import pytest
import standalone_peer as peer
from test_standalone import server  # noqa: F401  (the fixture)
from test_worker_ranks import topo as worker_topo

import umbp
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.runtime import StandaloneRuntime, runtime_class, topology_ranks
from umbp.vllm.standalone import ServerLookups, ServerStore
from umbp.vllm.topology import Ranks, Topology

HASH = 32


def topo(tp=1, pcp=1, dcp=1) -> Topology:
    return worker_topo(tp=tp, pcp=pcp, dcp=dcp, namespace=peer.NAMESPACE)


def cfg(endpoint, **extra) -> ConnectorConfig:
    return ConnectorConfig.parse({"mode": "standalone", "endpoint": endpoint, **extra})


def packed(seed, n=peer.BLOCKS) -> bytes:
    return b"".join(peer.hashes(seed)[:n])


class Rank:
    """One worker's store: a host buffer registered through `ServerStore`."""

    def __init__(self, endpoint, tp=0, timeout_ms=30000):
        # Its own mapping, as an engine's KV cache is: a heap buffer could share pages with
        # one an earlier test shared (and freed), which the client refuses to share again.
        shape = (peer.LAYERS, peer.BLOCKS, peer.PIECE)
        self.mem = mmap.mmap(-1, int(np.prod(shape)), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buf = np.frombuffer(self.mem, dtype=np.uint8).reshape(shape)
        c = umbp.StandaloneClient(
            endpoint, startup_timeout_ms=5000, lookup_timeout_ms=300, timeout_ms=timeout_ms
        )
        self.store = ServerStore(c)
        self.store.register_memory(self.buf.ctypes.data, self.buf.nbytes)
        self.layout = c.register_layout(peer.layout(self.buf))
        self.kb = umbp.KeyBuilder(peer.NAMESPACE, tp=tp)

    def keys(self, seed, n=peer.BLOCKS):
        return self.kb.keys_packed(0, packed(seed, n), HASH)

    def put(self, seed, n=peer.BLOCKS):
        return self.store.store(self.layout, 0, list(range(n)), self.keys(seed, n))

    def get(self, seed, n=peer.BLOCKS):
        return self.store.load(self.layout, 0, list(range(n)), self.keys(seed, n))


def test_standalone_mode_has_its_runtime():
    assert runtime_class(cfg("/run/umbp/x.sock")) is StandaloneRuntime


def test_topology_ranks_follow_vllm_dcp_groups():
    # vLLM: DCP groups run over PCP first, then TP (consecutive TP ranks when PCP is 1).
    assert topology_ranks(topo(tp=4, dcp=2)) == [
        (0, 0, 0, 0),
        (1, 0, 1, 0),
        (2, 0, 0, 0),
        (3, 0, 1, 0),
    ]
    assert [r[:2] for r in topology_ranks(topo(tp=2, pcp=2))] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    rt = StandaloneRuntime(cfg("/x.sock"), topo(tp=4, dcp=2))
    rt.serve_lookups(None, Ranks(tp=3, dcp=1))  # one of the expected ranks
    with pytest.raises(RuntimeError, match="decode-context ranks"):
        rt.serve_lookups(None, Ranks(tp=3, dcp=0))


def test_absent_server_fails_startup_after_the_timeout_naming_the_endpoint(tmp_path):
    ep = str(tmp_path / "nobody.sock")
    rt = StandaloneRuntime(cfg(ep, startup_timeout_ms=1500), topo())
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no umbp_standalone_server answered") as e:
        rt.lookup_client()
    took = time.monotonic() - t0
    assert 1.2 <= took <= 1.8, took
    assert ep in str(e.value) and "startup_timeout_ms=1500" in str(e.value)


def test_hits_need_every_rank(server):  # noqa: F811
    r0, r1 = Rank(server.endpoint, tp=0), Rank(server.endpoint, tp=1)
    assert r0.put(1).wait() == ["done"] * peer.BLOCKS
    assert r1.put(1, n=4).wait() == ["done"] * 4
    rt = StandaloneRuntime(cfg(server.endpoint), topo(tp=2))
    look = rt.lookup_client()
    assert isinstance(look, ServerLookups)
    assert look.prefix_hits(0, packed(1), HASH) == 4
    assert look.exists_all(0, packed(1), HASH) == [True] * 4 + [False] * (peer.BLOCKS - 4)
    assert look.prefix_hits(0, packed(2), HASH) == 0
    # The events' eviction watch: the same answer, no lease taken, no hit counted.
    before = r0.store.client.stats()
    assert look.holds_all(0, packed(1), HASH) == [True] * 4 + [False] * (peer.BLOCKS - 4)
    after = r0.store.client.stats()
    assert (after["leases"], after["hits"]) == (before["leases"], before["hits"])
    # reset_external: the whole pool, every client's objects.
    assert look.clear() == peer.BLOCKS + 4
    assert look.prefix_hits(0, packed(1), HASH) == 0
    rt.scheduler_shutdown()
    r0.store.close()
    r1.store.close()


def test_a_store_admitted_now_passes_the_servers_on_reuse_admission(tmp_path):
    """The connector's "now" store hint in standalone mode: `admit_now` travels with the
    store (protocol 4) and the server keeps the blocks on first sighting under
    `--store-admission on_reuse`; a store without it is skipped there."""
    from standalone_server import running

    with running(tmp_path.name, extra_args=["--store-admission", "on_reuse"]) as srv:
        r = Rank(srv.endpoint)
        try:
            assert r.put(1).wait() == ["skipped"] * peer.BLOCKS
            t = r.store.store(r.layout, 0, list(range(peer.BLOCKS)), r.keys(2), admit_now=True)
            assert t.wait() == ["done"] * peer.BLOCKS
            assert r.store.client.stats()["objects"] == peer.BLOCKS
            assert r.get(2).wait() == ["done"] * peer.BLOCKS
        finally:
            r.store.close()


def test_a_dead_server_fails_transfers_and_a_new_one_is_used_by_itself(server):  # noqa: F811
    r = Rank(server.endpoint)
    r.buf[:] = peer.pattern(3)
    assert r.put(3).wait() == ["done"] * peer.BLOCKS
    look = StandaloneRuntime(cfg(server.endpoint), topo()).lookup_client()
    server.kill()
    # Lookups miss; loads and stores end at once, every block failed (nothing raises).
    assert look.prefix_hits(0, packed(3), HASH) == 0
    for job in (r.get(3), r.put(4)):
        t0 = time.monotonic()
        assert job.wait() == ["failed"] * peer.BLOCKS
        assert time.monotonic() - t0 < 1 and job.done
        assert job.poll() == ["failed"] * peer.BLOCKS
    server.start()
    # The clients attach again and register their memory and layout again by themselves.
    r.buf[:] = peer.pattern(5)
    assert r.put(5).wait() == ["done"] * peer.BLOCKS
    assert look.prefix_hits(0, packed(5), HASH) == peer.BLOCKS
    r.buf[:] = 0
    assert r.get(5).wait() == ["done"] * peer.BLOCKS
    assert np.array_equal(r.buf, peer.pattern(5))
    look.close()
    r.store.close()


def test_a_stalled_server(server):  # noqa: F811
    r = Rank(server.endpoint, timeout_ms=1000)
    look = StandaloneRuntime(cfg(server.endpoint, lookup_timeout_ms=300), topo()).lookup_client()
    r.buf[:] = peer.pattern(6)
    assert r.put(6).wait() == ["done"] * peer.BLOCKS
    server.signal(signal.SIGSTOP)
    try:
        # A lookup past lookup_timeout_ms is a miss; later ones miss at once.
        t0 = time.monotonic()
        assert look.prefix_hits(0, packed(6), HASH) == 0
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert look.prefix_hits(0, packed(6), HASH) == 0
        second = time.monotonic() - t0
        assert 0.25 <= first <= 0.6 and second < 0.05, (first, second)
        # A transfer past timeout_ms stays pending; a synchronous wait on it raises.
        pending = r.get(6)
        with pytest.raises(umbp.TransferTimeout):
            pending.wait(1200)
        assert not pending.done
        # New transfers fail at once meanwhile.
        t0 = time.monotonic()
        job = r.put(7)
        assert job.done and job.wait() == ["failed"] * peer.BLOCKS
        assert time.monotonic() - t0 < 0.05
    finally:
        server.signal(signal.SIGCONT)
    # Once the server answers, the pending load completes and everything resumes.
    assert pending.wait(5000) == ["done"] * peer.BLOCKS
    assert np.array_equal(r.buf, peer.pattern(6))
    deadline = time.monotonic() + 5
    while look.prefix_hits(0, packed(6), HASH) != peer.BLOCKS:
        assert time.monotonic() < deadline, "lookups did not resume"
        time.sleep(0.05)
    assert r.put(8).wait() == ["done"] * peer.BLOCKS
    look.close()
    r.store.close()


@pytest.mark.parametrize("stalled", [False, True])
def test_closing_never_waits_on_a_stopped_server(server, stalled):  # noqa: F811
    r = Rank(server.endpoint, timeout_ms=500)
    assert server.stats()["sessions"] == 1
    server.signal(signal.SIGSTOP)
    try:
        if stalled:
            with pytest.raises(umbp.TransferTimeout):
                r.put(9).wait()
        t0 = time.monotonic()
        r.store.close()
        took = time.monotonic() - t0
    finally:
        server.signal(signal.SIGCONT)
    # Skipped detach when a call is stalled; at most its 200 ms deadline otherwise.
    assert took < (0.1 if stalled else 0.5), took
    # The connection was shut down: the server releases the session once it runs again.
    deadline = time.monotonic() + 2
    while server.stats()["sessions"] != 0:
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.05)


def test_engine_stream_handle_0_is_the_default_stream_not_a_pool_stream(monkeypatch):
    """Issue 28's cause, without a GPU: `torch.cuda.ExternalStream(0)` is a fresh pool stream
    (PyTorch reads a null pointer as "none given"), so the event ServerStore orders a
    transfer after must be recorded on `torch.cuda.default_stream()` for handle 0, and on the
    external stream itself for any other handle; a stream that is not the handle is refused."""
    torch = pytest.importorskip("torch")
    from umbp.vllm.standalone import engine_stream

    class FakeStream:
        def __init__(self, handle: int, made_by: str) -> None:
            self.cuda_stream, self.made_by = handle, made_by

    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: FakeStream(0, "default"))
    monkeypatch.setattr(
        torch.cuda,
        "ExternalStream",
        lambda handle, device=None: FakeStream(handle or 0x5EED, "external"),  # 0: a pool stream
    )
    assert engine_stream(0, "cuda:0").made_by == "default"
    s = engine_stream(0x7F00_1234, "cuda:0")
    assert (s.made_by, s.cuda_stream) == ("external", 0x7F00_1234)
    monkeypatch.setattr(
        torch.cuda, "default_stream", lambda device=None: FakeStream(0x5EED, "pool")
    )
    with pytest.raises(RuntimeError, match="cannot be ordered"):
        engine_stream(0, "cuda:0")
