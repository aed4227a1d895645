"""Standalone mode's ordering against a busy engine stream, without vLLM: the smallest
reproduction beside the real-engine tests of issue 28 (tests/gpu_vllm/).

The connector's worker hands the server its transfers through `umbp.vllm.standalone.ServerStore`
with the engine's current CUDA stream, and never waits for that stream itself: a store must
copy what the work queued before it wrote, and a load reported done must be in place for the
work queued after that. Here the "forward pass" is a GPU spin of tens of milliseconds followed
by the writes of every block, queued right before the store, as vLLM does; and what reads a
load's blocks is queued the moment the load reads as done, as vLLM schedules a request once
the worker reports its async load finished. A KV cache shaped like vLLM's (one allocation,
layer-first, 32 layers, 2 MiB blocks as Llama-3-8B with 16-token blocks has) and reused block
ids with stale contents, so a copy at the wrong time shows as the wrong fill value.

Skipped without PyTorch, a CUDA device or the server binary ($UMBP_SERVER_BIN, or on PATH).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
import torch  # noqa: E402
from test_standalone_gpu import start_server, stop_server  # noqa: E402  (skips without CUDA or the server)

import umbp  # noqa: E402
from umbp.kv_layout import describe_tensor, register_tensor_layout  # noqa: E402
from umbp.vllm.standalone import ServerStore  # noqa: E402

LAYERS, BLOCKS, PAGE = 32, 1024, 64 << 10  # 64 KiB per layer and block, 2 MiB per block
SPIN_CYCLES = 200_000_000  # ~0.1 s of one GPU thread spinning: the "forward pass"


class FakeClient:
    """Stands in for `umbp.StandaloneClient` where only the moment of submission matters: it
    notes whether the engine's stream had finished its queued work when the transfer came."""

    endpoint = "fake"

    def __init__(self, stream) -> None:
        self.stream = stream
        self.seen: list[bool] = []

    def _transfer(self, layout, group, block_ids, keys, admit_now=False):
        self.seen.append(self.stream.query())
        return Done(len(block_ids))

    store = load = _transfer

    def close(self) -> None:
        pass


class Done:
    def __init__(self, n: int) -> None:
        self.n = n

    done = True

    def poll(self):
        return ["done"] * self.n

    def wait(self, timeout_ms=None):
        return self.poll()


@pytest.mark.parametrize("on", ["default-stream", "own-stream"])
def test_transfers_are_submitted_after_the_engine_stream_is_done(on):
    """No server: ServerStore must hand a transfer to its client only once the work queued on
    the engine's stream before it has finished. Failed for CUDA's default stream (handle 0)
    before issue 28's fix: the event went to an idle stream and the store was submitted while
    the engine was still computing."""
    stream = torch.cuda.default_stream() if on == "default-stream" else torch.cuda.Stream()
    client = FakeClient(stream)
    store = ServerStore(client)
    store.cuda_device = torch.device("cuda", 0)
    with torch.cuda.stream(stream):
        handle = torch.cuda.current_stream().cuda_stream
        assert (handle == 0) == (on == "default-stream")
        for direction in (store.store, store.load):
            torch.cuda._sleep(SPIN_CYCLES)  # the "forward pass", still running at submission
            t = direction(0, 0, [0], None, stream=handle)
            assert t.wait(60_000) == ["done"]
    store.close()
    assert client.seen == [True, True], client.seen


class Engine:
    """One allocation viewed per layer as [blocks, page] bytes, registered through the
    connector's standalone store as the worker does."""

    def __init__(self, sock) -> None:
        self.buf = torch.zeros(LAYERS * BLOCKS * PAGE, dtype=torch.uint8, device="cuda")
        n = BLOCKS * PAGE
        self.layers = [self.buf[i * n : (i + 1) * n].view(BLOCKS, PAGE) for i in range(LAYERS)]
        self.store = ServerStore(umbp.StandaloneClient(f"unix://{sock}", client_name="ordering"))
        self.store.register_cuda_memory(self.buf.data_ptr(), self.buf.numel(), 0)
        groups = [[describe_tensor(f"layer{i}", t, BLOCKS) for i, t in enumerate(self.layers)]]
        self.layout = register_tensor_layout(self.store, groups, [BLOCKS])
        self.keys = umbp.KeyBuilder("ordering")
        # Like vLLM's: the engine computes on a stream of its own, not the default one.
        self.stream = torch.cuda.Stream()

    def fill(self, idx, value: int) -> None:
        """Sets blocks `idx` (a device tensor: made before any queued work, since a host-to-
        device copy of ids from pageable memory would first wait for the stream) to `value`."""
        for t in self.layers:
            t.index_fill_(0, idx, value)

    def values(self, ids: list[int]) -> list[int]:
        """Per block, its byte value if every byte of it in every layer is that value, else -1."""
        idx = torch.tensor(ids, device="cuda")
        rows = torch.stack([t.index_select(0, idx) for t in self.layers], 1)  # [n, L, page]
        first = rows[:, 0, :1]
        same = (rows == first.unsqueeze(1)).flatten(1).all(1)
        return torch.where(same, first.flatten().to(torch.int64), -1).tolist()


def keys(e: Engine, tag: int, n: int):
    return e.keys.keys(0, [(tag << 32 | i).to_bytes(8, "little") for i in range(n)])


@pytest.mark.parametrize("blocks", [64, 256, 1000])
@pytest.mark.parametrize("on", ["default-stream", "own-stream"])
def test_store_copies_what_the_stream_wrote_and_load_is_in_place_when_done(tmp_path, on, blocks):
    """`default-stream`: the engine computes on CUDA's default stream (handle 0), as vLLM 0.33's
    engine thread did in the run that restored wrong KV (issue 28); `own-stream`: on a stream
    of its own."""
    # Room for all four rounds (4 × 1000 blocks of 2 MiB at most): this test is about ordering,
    # not eviction. With 8 GiB the last round's blocks were evicted before their load under
    # the default S3-FIFO policy (a new object that nobody read yet leaves first, and the
    # earlier rounds' blocks had been read), and read "missing".
    p, sock = start_server(tmp_path, "10GiB")
    try:
        e = Engine(sock)
        if on == "default-stream":
            e.stream = torch.cuda.default_stream()
        assert (e.stream.cuda_stream == 0) == (on == "default-stream")
        ids = list(range(blocks))
        targets = list(range(BLOCKS - blocks, BLOCKS))  # other blocks for the loads
        ids_t = torch.tensor(ids, device="cuda")
        targets_t = torch.tensor(targets, device="cuda")
        stale_store = stale_load = 0
        for r in range(1, 5):
            value = 16 * r
            with torch.cuda.stream(e.stream):
                e.fill(ids_t, 1)  # what the blocks held before
                torch.cuda.synchronize()
                # The "forward pass": long GPU work, then the writes of the step's blocks,
                # all queued; the store is submitted at once, as wait_for_save does.
                torch.cuda._sleep(SPIN_CYCLES)
                e.fill(ids_t, value)
                stream = e.stream.cuda_stream
                st = e.store.store(e.layout, 0, ids, keys(e, r, blocks), stream=stream)
                statuses = st.wait(60_000)
                assert all(s == "done" for s in statuses), statuses
                # The load, into blocks holding something else; read them the moment the
                # load reads as done (the worker's get_finished polls `done`).
                e.fill(targets_t, 2)
                ld = e.store.load(e.layout, 0, targets, keys(e, r, blocks), stream=stream)
                deadline = time.monotonic() + 60
                while not ld.done:
                    assert time.monotonic() < deadline
                # Every layer's blocks copied by kernels queued now, before any wait.
                snapshot = [t.index_select(0, targets_t) for t in e.layers]
                assert all(s == "done" for s in ld.poll()), ld.poll()
                got = sorted(set(torch.cat([x.unique() for x in snapshot]).tolist()))
                stale_load += got != [value]
                # What the pool holds (read after everything settled).
                e.fill(targets_t, 3)
                again = e.store.load(e.layout, 0, targets, keys(e, r, blocks), stream=stream)
                assert all(s == "done" for s in again.wait(60_000))
                torch.cuda.synchronize()
                held = set(e.values(targets))
                stale_store += held != {value}
                print(f"round {r}: pool holds {sorted(held)}, the load read {got} (want {value})")
        assert stale_store == 0, (
            f"{stale_store} of 4 stores copied before the stream wrote the blocks"
        )
        assert stale_load == 0, (
            f"{stale_load} of 4 loads read as done before their bytes were in place"
        )
        e.store.close()
    finally:
        stop_server(p)
