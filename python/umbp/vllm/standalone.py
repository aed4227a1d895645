"""Standalone mode: the connector's store and lookups served by the node's
`umbp_standalone_server`.

`StandaloneRuntime` (in `runtime.py`) hands the worker side a `ServerStore` and the scheduler
side a `ServerLookups`; both wrap a `umbp.StandaloneClient` and give the surface the embedded
objects give (`EmbeddedStore`, `LookupClient`), so the scheduler and worker code never look at
the mode.

What a broken server does to an engine (the SPEC's failure table):

- a lookup that fails or runs past `lookup_timeout_ms` is a miss, and while one is unanswered
  later lookups miss at once (the client's rule);
- a store or load the server cannot take (gone, restarting, or stalled on an earlier transfer)
  ends at once with every block "failed": a failed load is recomputed by vLLM
  (`kv_load_failure_policy: recompute`), a failed store is only a future miss;
- a transfer already submitted stays pending, with its blocks held, until the server answers;
  a synchronous wait on it past `timeout_ms` raises `umbp.TransferTimeout` (the worker fails
  the step rather than use blocks that may still be written);
- after a server restart the client attaches again and replays its registrations by itself.

Every such failure is logged, at most once per `_LOG_EVERY_S` seconds per process, with how
many calls failed since the last message.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import umbp

logger = logging.getLogger("umbp.vllm")

_LOG_EVERY_S = 10.0


class _FailureLog:
    """Logs a kind of failure at most once every `_LOG_EVERY_S` seconds, with a count."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.lock = threading.Lock()
        self.last = 0.0
        self.suppressed = 0

    def note(self, e: BaseException) -> None:
        with self.lock:
            now = time.monotonic()
            if now - self.last < _LOG_EVERY_S:
                self.suppressed += 1
                return
            n, self.suppressed, self.last = self.suppressed, 0, now
        more = f" ({n} more since the last message)" if n else ""
        logger.warning("umbp: %s failed%s: %s", self.what, more, e)


class _Failed:
    """A transfer the server could not take: done at once, every block failed."""

    def __init__(self, n: int) -> None:
        self.statuses = ["failed"] * n

    done = True
    elapsed_s = None
    object_bytes = 0

    def poll(self) -> list[str]:
        return list(self.statuses)

    def wait(self, timeout_ms: int | None = None) -> list[str]:
        return list(self.statuses)


class _Submitted:
    """A transfer the server took: `umbp.Transfer` with the failure of the whole transfer
    (the server went away before answering) read as every block failed."""

    def __init__(self, t: umbp.Transfer, n: int, log: _FailureLog) -> None:
        self.t, self.n, self.log = t, n, log

    @property
    def done(self) -> bool:
        return self.t.done

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from submission to the server's answer (None before, or on failure)."""
        try:
            return self.t.elapsed_s
        except umbp.UmbpError:
            return None

    @property
    def object_bytes(self) -> int:
        return self.t.object_bytes

    def poll(self) -> list[str] | None:
        try:
            return self.t.poll()
        except umbp.UmbpError as e:
            self.log.note(e)
            return ["failed"] * self.n

    def wait(self, timeout_ms: int | None = None) -> list[str]:
        try:
            return self.t.wait(timeout_ms)
        except umbp.TransferTimeout:
            raise  # still pending: the caller must not use the blocks
        except umbp.UmbpError as e:
            self.log.note(e)
            return ["failed"] * self.n


class _AfterStream:
    """A transfer to be submitted once the engine's stream has reached it (see
    `ServerStore._submit_after_stream`): not done before, then the submitted transfer."""

    def __init__(self, submitted: Future, n: int) -> None:
        self.submitted, self.n = submitted, n

    def _inner(self, timeout_s: float | None):
        try:
            return self.submitted.result(timeout_s)
        except FutureTimeout:
            raise umbp.TransferTimeout(
                "the transfer was not submitted within its deadline: the engine's CUDA stream "
                "has not reached it yet"
            ) from None
        except CancelledError:  # the store closed first
            return _Failed(self.n)

    @property
    def done(self) -> bool:
        return self.submitted.done() and self._inner(0).done

    @property
    def elapsed_s(self) -> float | None:
        """As the submitted transfer's: the wait for the engine's stream is not counted."""
        return self._inner(0).elapsed_s if self.submitted.done() else None

    @property
    def object_bytes(self) -> int:
        return self._inner(0).object_bytes if self.submitted.done() else 0

    def poll(self) -> list[str] | None:
        return self._inner(0).poll() if self.submitted.done() else None

    def wait(self, timeout_ms: int | None = None) -> list[str]:
        t0 = time.monotonic()
        inner = self._inner(None if timeout_ms is None else timeout_ms / 1000)
        if timeout_ms is None:
            return inner.wait()
        left = max(1, timeout_ms - int((time.monotonic() - t0) * 1000))
        return inner.wait(left)


def engine_stream(handle: int, device: Any):
    """The engine's CUDA stream `handle` (`torch.cuda.current_stream().cuda_stream`) as a
    torch stream, to record an event on.

    Handle 0 is CUDA's default stream, the one vLLM's engine thread computes on unless it set
    a stream of its own. `torch.cuda.ExternalStream(0)` is not that stream: PyTorch reads a
    null pointer as "no external stream" and hands out a fresh stream of its pool, which does
    not wait for the default stream. An event recorded there is done at once, and the server
    copied a store's blocks before the forward pass had written them (issue 28: restored KV
    held what those blocks held before, silently).
    """
    import torch

    s = (
        torch.cuda.default_stream(device)
        if handle == 0
        else torch.cuda.ExternalStream(handle, device=device)
    )
    if s.cuda_stream != handle:
        raise RuntimeError(
            f"UMBP: CUDA stream {handle:#x} of the engine came back as stream "
            f"{s.cuda_stream:#x}; transfers cannot be ordered after the engine's work"
        )
    return s


class ServerStore:
    """A worker's store in standalone mode: the `EmbeddedStore` calls the worker side makes,
    served by the node's server through `client`."""

    def __init__(self, client: umbp.StandaloneClient) -> None:
        self.client = client
        self.cuda_device: Any = None
        self.submitter: ThreadPoolExecutor | None = None
        self.failures = _FailureLog(f"transfers with the UMBP server at {client.endpoint}")

    # Registration (start-up: errors raise and fail the engine's start, naming the cause).

    def register_memory(self, addr: int, length: int) -> int:
        # CPU engines: the KV cache's pages move in place onto a memfd the server maps.
        return self.client.register_memory(addr, length)

    def register_cuda_memory(self, addr: int, length: int, device: int) -> int:
        import torch

        self.cuda_device = torch.device("cuda", device)
        return self.client.register_cuda_memory(addr, length)

    def deregister_memory(self, region: int) -> None:
        self.client.deregister_memory(region)

    def register_tensor_layout(self, groups: list, num_blocks: list[int]) -> int:
        return self.client.register_tensor_layout(groups, num_blocks)

    def layout_summary(self, layout: int) -> list[dict[str, int]]:
        return self.client.layout_summary(layout)

    # Transfers.

    def _submit(self, store: bool, layout: int, group: int, block_ids, keys, stream):
        if stream is not None and self.cuda_device is not None:
            return self._submit_after_stream(store, layout, group, block_ids, keys, stream)
        return self._submit_now(store, layout, group, block_ids, keys)

    def _submit_now(self, store: bool, layout: int, group: int, block_ids, keys):
        call = self.client.store if store else self.client.load
        try:
            t = call(layout, group, block_ids, keys)
        except umbp.ServerUnavailable as e:
            self.failures.note(e)
            return _Failed(len(block_ids))
        return _Submitted(t, len(block_ids), self.failures)

    def _submit_after_stream(self, store: bool, layout: int, group: int, block_ids, keys, stream):
        """The server copies on streams of its own, so what the engine queued before (the
        forward pass that wrote a store's blocks, the readers of a load's blocks) must be
        finished first. Rather than block the engine's thread on its stream, an event is
        recorded there and one helper thread waits for it, then submits (in order)."""
        import torch

        # A blocking-sync event: the helper thread sleeps until the engine's stream gets there.
        # A default event's wait spins in the driver, a whole core, for as long as the forward
        # pass runs, beside the engine thread's own driver calls (docs/benchmarks.md, TTFT).
        ev = torch.cuda.Event(blocking=True)
        ev.record(engine_stream(stream, self.cuda_device))
        if self.submitter is None:  # made on first use, in the worker, never at import
            self.submitter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="umbp-submit")

        def after_stream():
            ev.synchronize()
            return self._submit_now(store, layout, group, block_ids, keys)

        return _AfterStream(self.submitter.submit(after_stream), len(block_ids))

    def store(self, layout: int, group: int, block_ids, keys, stream: int | None = None):
        return self._submit(True, layout, group, block_ids, keys, stream)

    def load(self, layout: int, group: int, block_ids, keys, stream: int | None = None):
        return self._submit(False, layout, group, block_ids, keys, stream)

    def close(self) -> None:
        # Never waits on a stalled server (the client skips its detach then), nor on a
        # submission still waiting for the engine's stream.
        if self.submitter is not None:
            self.submitter.shutdown(wait=False, cancel_futures=True)
        self.client.close()


class ServerLookups:
    """The scheduler's lookups in standalone mode: one request per cache group asks the
    server about every rank of the engine's topology at once. A failed or late lookup is a
    miss."""

    def __init__(
        self,
        client: umbp.StandaloneClient,
        namespace: str,
        ranks: list[tuple[int, int, int, int]],
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.ranks = ranks
        self.failures = _FailureLog(f"lookups at the UMBP server at {client.endpoint}")

    def prefix_hits(self, group: int, packed_hashes: bytes, hash_len: int) -> int:
        """Blocks, from the first, that every rank holds (0 on any failure)."""
        try:
            _, n = self.client.exists_across_ranks(
                self.namespace, self.ranks, group, packed_hashes, hash_len, prefix_only=True
            )
        except umbp.UmbpError as e:
            self.failures.note(e)
            return 0
        return n

    def exists_all(self, group: int, packed_hashes: bytes, hash_len: int) -> list[bool]:
        """Which blocks every rank holds (all False on any failure)."""
        try:
            present, _ = self.client.exists_across_ranks(
                self.namespace, self.ranks, group, packed_hashes, hash_len
            )
        except umbp.UmbpError as e:
            self.failures.note(e)
            return [False] * (len(packed_hashes) // max(1, hash_len))
        return present

    def clear(self, timeout_ms: int = 10000) -> int:
        """Empties the server's whole pool, every engine's objects (reset_external), and this
        engine's namespace in the server's remote tier, if it has one (which would otherwise
        hand the objects back at the next lookup)."""
        removed = self.client.clear()
        self.client.clear(self.namespace)
        return removed

    def close(self) -> None:
        self.client.close()
