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
  the step rather than use blocks that may still be written); if the server goes away before
  answering, every block of it is "failed";
- after a server restart the client attaches again and replays its registrations by itself.

The transfer rules are the client's own (`umbp.StandaloneClient`, in Rust): its `store` and
`load` answer a `umbp.Transfer` whose blocks read "failed" (kind "server", `failure()` says
why) and it logs such transfers at most once every 10 s, with how many it did not log. A
failed lookup is logged here, as often, with how many calls failed since the last message.
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


class _AfterStream:
    """A transfer to be submitted once the engine's stream has reached it (see
    `ServerStore._submit_after_stream`): not done before, then the submitted `umbp.Transfer`.
    One never submitted (the store closed first) is done, every block "failed"."""

    def __init__(self, submitted: Future, n: int) -> None:
        self.submitted, self.n = submitted, n

    def _inner(self, timeout_s: float | None) -> umbp.Transfer | None:
        """The submitted transfer; None when it never will be (the store closed first)."""
        try:
            return self.submitted.result(timeout_s)
        except FutureTimeout:
            raise umbp.TransferTimeout(
                "the transfer was not submitted within its deadline: the engine's CUDA stream "
                "has not reached it yet"
            ) from None
        except CancelledError:
            return None

    def _never(self) -> list[str]:
        return ["failed"] * self.n

    @property
    def done(self) -> bool:
        if not self.submitted.done():
            return False
        inner = self._inner(0)
        return inner is None or inner.done

    @property
    def elapsed_s(self) -> float | None:
        """As the submitted transfer's: the wait for the engine's stream is not counted."""
        inner = self._inner(0) if self.submitted.done() else None
        return None if inner is None else inner.elapsed_s

    @property
    def object_bytes(self) -> int:
        inner = self._inner(0) if self.submitted.done() else None
        return 0 if inner is None else inner.object_bytes

    def poll(self) -> list[str] | None:
        if not self.submitted.done():
            return None
        inner = self._inner(0)
        return self._never() if inner is None else inner.poll()

    def wait(self, timeout_ms: int | None = None) -> list[str]:
        t0 = time.monotonic()
        inner = self._inner(None if timeout_ms is None else timeout_ms / 1000)
        if inner is None:
            return self._never()
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
    """A worker's store in standalone mode (a `runtime.Store`): the `EmbeddedStore` calls the
    worker side makes, served by the node's server through `client`. What it adds to the
    client is ordering: a transfer given the engine's CUDA stream is submitted once the work
    queued there is done (the server copies on streams of its own)."""

    def __init__(self, client: umbp.StandaloneClient) -> None:
        self.client = client
        self.cuda_device: Any = None
        self.submitter: ThreadPoolExecutor | None = None

    # Registration (start-up: errors raise and fail the engine's start, naming the cause).

    def register_memory(self, addr: int, length: int) -> int:
        # CPU engines: the KV cache's pages move in place onto a memfd the server maps.
        return self.client.register_memory(addr, length)

    def register_cuda_memory(self, addr: int, length: int, device: int) -> int:
        import torch

        self.cuda_device = torch.device("cuda", device)
        return self.client.register_cuda_memory(addr, length)

    def deregister_memory(self, region_id: int) -> None:
        self.client.deregister_memory(region_id)

    def register_tensor_layout(self, groups: list, num_blocks: list[int]) -> int:
        return self.client.register_tensor_layout(groups, num_blocks)

    def layout_summary(self, layout_id: int) -> list[dict[str, int]]:
        return self.client.layout_summary(layout_id)

    # Transfers.

    def _submit(self, store: tuple[bool, bool], layout: int, group: int, block_ids, keys, stream):
        """`store`: (whether it is a store, whether it is admitted now)."""
        if stream is not None and self.cuda_device is not None:
            return self._submit_after_stream(store, layout, group, block_ids, keys, stream)
        return self._submit_now(store, layout, group, block_ids, keys)

    def _submit_now(self, store: tuple[bool, bool], layout: int, group: int, block_ids, keys):
        # A server that cannot take it answers every block "failed" (the client's rule).
        is_store, admit_now = store
        if not is_store:
            return self.client.load(layout, group, block_ids, keys)
        return self.client.store(layout, group, block_ids, keys, admit_now=admit_now)

    def _submit_after_stream(
        self, store: tuple[bool, bool], layout: int, group: int, block_ids, keys, stream
    ):
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

    def store(
        self,
        layout: int,
        group: int,
        block_ids,
        keys,
        *,
        stream: int | None = None,
        admit_now: bool = False,
    ):
        # `admit_now`: kept on first sighting even under the server's `on_reuse` admission.
        return self._submit((True, admit_now), layout, group, block_ids, keys, stream)

    def load(self, layout: int, group: int, block_ids, keys, *, stream: int | None = None):
        return self._submit((False, False), layout, group, block_ids, keys, stream)

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

    def holds_all(self, group: int, packed_hashes: bytes, hash_len: int) -> list[bool] | None:
        """Which blocks every rank has in the server's pool now, leasing nothing (for the
        events' eviction watch); None on any failure."""
        try:
            return self.client.holds_across_ranks(
                self.namespace, self.ranks, group, packed_hashes, hash_len
            )
        except umbp.UmbpError as e:
            self.failures.note(e)
            return None

    def clear(self, timeout_ms: int = 10000) -> int:
        """Empties the server's whole pool, every engine's objects (reset_external), and this
        engine's namespace in the server's remote tier, if it has one (which would otherwise
        hand the objects back at the next lookup)."""
        removed = self.client.clear()
        self.client.clear(self.namespace)
        return removed

    def close(self) -> None:
        self.client.close()
