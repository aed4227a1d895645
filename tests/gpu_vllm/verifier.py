"""Observers of the connector inside a real engine, for the real-engine tests and the TTFT
benchmark (installed by `verified_connector.py` in whatever process vLLM builds the connector
in: the engine core process too, with vLLM's multiprocessing on).

- `Verifier` fingerprints KV blocks in the worker around UMBP's stores and loads and compares
  them; every check rewrites its summary to `$UMBP_VERIFY_OUT`.
- `Tracer` timestamps the connector's calls (CLOCK_MONOTONIC, comparable across processes) to
  `$UMBP_TRACE_OUT`: where a restore's time goes between the request and its first token.
"""

from __future__ import annotations

import json
import os
import threading
import time


def _write(path: str, obj) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class Verifier:
    """Fingerprints KV blocks inside the worker around UMBP's stores and loads, without ever
    making the engine wait.

    An earlier version synchronized the engine's stream before each store and after each
    load: that hid a standalone-mode race the same engines show without it (docs/vllm.md,
    "Exactness"). Now every fingerprint is a few kernels queued on the engine's own stream at
    the point the engine would read or the store should copy, and every comparison runs there
    too; its few result bytes come back by a non-blocking copy that a thread of the verifier
    reads once their event is done. The engine's timing stays the product's.

    A block's fingerprint is one int64 per (layer, dim 1 of the layer's view, dim 2): a
    position-weighted sum of its 16-bit words, so a moved, missing or foreign piece shows up
    with where it is. Stored blocks are fingerprinted after the forward pass that wrote them
    (queued right after the connector submitted the store); restored blocks when their load is
    done (a synchronous load: when it returned; an async one: when the worker reports it
    finished, before vLLM schedules the request), and again after the next forward pass
    (writes that landed late show there).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stored: dict = {}
        self.loaded_blocks = 0
        self.checked = 0
        self.mismatched = 0
        self.late = 0
        self.unknown = 0
        self.failed_loads = 0
        self.recomputed_differently = 0
        self.details: list = []
        self.pending_recheck: list = []
        self.async_pending: list = []
        self.later_results: list = []  # (event, host tensor, what to do with it)
        self.groups: list | None = None
        self.seed: dict = {}  # another engine's stored fingerprints ($UMBP_VERIFY_SEED)

    def install(self) -> None:
        from umbp.vllm import worker as W

        v = self
        reg, save = W.WorkerSide.register_kv_caches, W.WorkerSide.wait_for_save
        load, finished = W.WorkerSide.start_load_kv, W.WorkerSide.get_finished

        def register_kv_caches(self, kv_caches):
            reg(self, kv_caches)
            v.attach(self, kv_caches)

        def wait_for_save(self, meta):
            save(self, meta)  # the product first, exactly as it runs without the verifier
            if v.on():
                v.recheck()
                v.after_save(meta)

        def start_load_kv(self, meta, *a, **k):
            load(self, meta, *a, **k)
            if v.on():
                v.after_load(meta)

        def get_finished(self):
            on = v.on()
            if on:
                v.recheck()  # called after each step's forward pass was queued
            sending, recving = finished(self)
            if recving and on:
                v.after_async_loads(recving, set(self.failed_recving))
            return sending, recving

        W.WorkerSide.register_kv_caches = register_kv_caches
        W.WorkerSide.wait_for_save = wait_for_save
        W.WorkerSide.start_load_kv = start_load_kv
        W.WorkerSide.get_finished = get_finished

    def on(self) -> bool:
        """Whether to observe now: always, unless `$UMBP_VERIFY_GATE` names a file, which then
        switches the verifier on while it exists (the serving bench times its points with the
        verifier off and checks a probe with it on, in the same engine)."""
        gate = os.environ.get("UMBP_VERIFY_GATE")
        return not gate or os.path.exists(gate)

    def attach(self, ws, kv_caches) -> None:
        import torch

        self.torch = torch
        self.groups = []
        for g in ws.kv_cache_config.kv_cache_groups:
            seen, layers = set(), []
            for name in g.layer_names:
                t = kv_caches[name]
                key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                if key not in seen:
                    seen.add(key)
                    layers.append(t)
            self.groups.append(layers)
        self.device = self.groups[0][0].device
        seed = os.environ.get("UMBP_VERIFY_SEED")
        if seed and os.path.exists(seed):
            self.seed = {k: v.to(self.device) for k, v in torch.load(seed).items()}
        if self.device.type == "cuda":
            threading.Thread(target=self.collect_forever, daemon=True).start()

    def dump(self, path: str) -> None:
        """Saves the stored blocks' fingerprints for another engine's `UMBP_VERIFY_SEED`."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        self.torch.save({k: v.cpu() for k, v in self.stored.items()}, path)

    # -- device work, queued on the engine's stream, never waited for here ---------------

    def on_device(self, values: list[int]):
        """`values` as a device tensor, by a non-blocking copy from pinned memory (a pageable
        host-to-device copy first waits for everything queued on the stream)."""
        x = self.torch.tensor(values, dtype=self.torch.long)
        if self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        return x

    def fingerprint(self, group: int, ids: list[int]):
        torch = self.torch
        idx = self.on_device(ids)
        rows = []
        for t in self.groups[group]:
            x = t.index_select(0, idx)  # [n, d1, d2, ...]: a contiguous copy
            x = x.reshape(x.shape[0], x.shape[1], x.shape[2] if x.dim() > 2 else 1, -1)
            words = x.contiguous().view(torch.int16).to(torch.int32)
            # Weights 1..C keep each product and row sum inside int32 (C <= 2^15).
            w = torch.arange(1, words.shape[-1] + 1, device=self.device, dtype=torch.int32)
            rows.append((words * w).sum(-1, dtype=torch.int64))  # [n, d1, d2]
        return torch.stack(rows, 1)  # [n, layers, d1, d2]

    def later(self, flags, handle) -> None:
        """`flags` (a small device tensor) is read once the stream has computed it, then
        `handle(host_tensor)` runs (on the verifier's thread for CUDA)."""
        if self.device.type != "cuda":
            with self.lock:
                handle(flags)
            self.save()
            return
        host = self.torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ev = self.torch.cuda.Event()
        ev.record()
        with self.lock:
            self.later_results.append((ev, host, handle))

    def collect_forever(self) -> None:
        while True:
            time.sleep(0.2)
            with self.lock:
                ready = [r for r in self.later_results if r[0].query()]
                self.later_results = [r for r in self.later_results if r not in ready]
                for _, host, handle in ready:
                    handle(host)
            if ready:
                self.save()

    # -- the connector's calls ------------------------------------------------------------

    @staticmethod
    def hashes(t) -> list[bytes]:
        return [t.hashes[i : i + t.hash_len] for i in range(0, len(t.hashes), t.hash_len)]

    def after_save(self, meta) -> None:
        if not meta.stores or self.groups is None:
            return
        for t in meta.stores:
            fp = self.fingerprint(t.group, t.block_ids)
            again = []
            for j, h in enumerate(self.hashes(t)):
                # A block recomputed in another batch shape (vLLM recomputes the last block of
                # a fully cached prompt) or by another engine can differ in its last bits: the
                # first store wins, in the pool and here.
                key = (t.group, h)
                first = self.seed.get(key, self.stored.get(key))
                if first is not None:
                    again.append((first != fp[j]).any())
                self.stored.setdefault(key, fp[j])
            if again:

                def count(host):
                    self.recomputed_differently += int(host.sum())

                self.later(self.torch.stack(again).to(self.torch.int64), count)

    def after_load(self, meta) -> None:
        self.async_pending.extend(t for t in meta.loads if t.load_async)
        self.check_loaded([t for t in meta.loads if not t.load_async], "when the load returned")

    def after_async_loads(self, finished: set, failed: set) -> None:
        """Async loads just reported finished (a failed one is recomputed: not checked)."""
        self.failed_loads += sum(1 for t in self.async_pending if t.req_id in finished & failed)
        done = [t for t in self.async_pending if t.req_id in finished - failed]
        self.async_pending = [t for t in self.async_pending if t.req_id not in finished]
        self.check_loaded(done, "when the async load was reported finished")

    def check_loaded(self, loads: list, when: str) -> None:
        if not loads or self.groups is None:
            return
        if os.environ.get("UMBP_VERIFY_CORRUPT") == "1":
            # The verifier's own test: a wrong restored byte must be reported.
            self.groups[loads[0].group][0][loads[0].block_ids[0]].view(-1)[0] += 1
        for t in loads:
            self.loaded_blocks += len(t.block_ids)
            fp = self.fingerprint(t.group, t.block_ids)
            self.compare(t, fp, when)
            self.pending_recheck.append((t, fp))

    def compare(self, t, fp, when: str) -> None:
        """Queues the comparison of restored fingerprints with what the pool should hold."""
        rows, wants = [], []
        for j, h in enumerate(self.hashes(t)):
            # What the pool holds: the first store, this engine's or the seeding engine's.
            want = self.seed.get((t.group, h), self.stored.get((t.group, h)))
            if want is None:
                self.unknown += 1
                continue
            rows.append(j)
            wants.append(want)
        if not rows:
            return
        self.checked += len(rows)
        idx = self.on_device(rows)
        # Per block and layer: any cell different.
        diff = (self.torch.stack(wants) != fp.index_select(0, idx)).flatten(2).any(2)

        def tally(host):
            bad = host.any(1).nonzero().flatten().tolist()
            self.mismatched += len(bad)
            for b in bad[: max(0, 12 - len(self.details))]:
                j = rows[b]
                self.details.append(
                    {
                        "what": f"restored bytes differ from the stored ones ({when})",
                        "group": t.group,
                        "block_index": j,
                        "of": len(t.block_ids),
                        "block_id": t.block_ids[j],
                        "layers": host[b].nonzero().flatten().tolist()[:40],
                    }
                )

        self.later(diff.to(self.torch.int64), tally)

    def recheck(self) -> None:
        """After the next forward pass: are restored blocks still as they were loaded?"""
        pending, self.pending_recheck = self.pending_recheck, []
        for t, before in pending:
            now = self.fingerprint(t.group, t.block_ids)

            def tally(host, t=t):
                changed = host.nonzero().flatten().tolist()
                self.late += len(changed)
                if changed and len(self.details) < 12:
                    self.details.append(
                        {
                            "what": "a restored block changed after its load was reported done",
                            "block_index": changed[0],
                            "of": len(t.block_ids),
                            "block_id": t.block_ids[changed[0]],
                        }
                    )

            self.later((now != before).flatten(1).any(1).to(self.torch.int64), tally)

    def summary(self) -> dict:
        return {
            "stored_blocks": len(self.stored),
            "loaded_blocks": self.loaded_blocks,
            "checked": self.checked,
            "mismatched": self.mismatched,
            "changed_late": self.late,
            "unknown": self.unknown,
            "failed_loads": self.failed_loads,
            "seeded_blocks": len(self.seed),
            "recomputed_differently": self.recomputed_differently,
            "results_pending": len(self.later_results),
            "details": self.details,
        }

    def save(self) -> None:
        path = os.environ.get("UMBP_VERIFY_OUT")
        if path and self.groups is not None:  # only the worker's process has blocks
            _write(path, self.summary())


class Tracer:
    """Timestamps of the connector's calls to `$UMBP_TRACE_OUT.<pid>`, written by a thread of
    its own once a second (never on the engine's path). A worker's `get_finished` is noted
    only while it has async loads pending or reports some finished.

    The writer thread starts in the process that records the first call: vLLM may import
    this module in its front-end process and then fork the engine core, and a thread started
    before a fork does not run in the child."""

    def __init__(self) -> None:
        self.events: list = []
        self.written = 0
        self.path = ""
        self.writer_pid = 0
        self.lock = threading.Lock()

    def note(self, role: str, what: str, t0: float, **info) -> None:
        ms = round((time.monotonic() - t0) * 1e3, 3)
        if self.writer_pid != os.getpid():
            with self.lock:  # the engine's thread and standalone's submitter both note
                if self.writer_pid != os.getpid():
                    self.writer_pid = os.getpid()
                    self.events, self.written = [], 0  # a forked child's copy is the parent's
                    threading.Thread(target=self.flush_forever, daemon=True).start()
        self.events.append({"role": role, "what": what, "t": t0, "ms": ms, **info})
        del self.events[:-20000]

    def flush_forever(self) -> None:
        while True:
            time.sleep(1.0)
            if len(self.events) != self.written:
                self.written = len(self.events)
                _write(f"{self.path}.{os.getpid()}", list(self.events))

    def install(self) -> None:
        self.path = os.environ.get("UMBP_TRACE_OUT", "")
        if not self.path:
            return
        from umbp.vllm import scheduler as S
        from umbp.vllm import standalone as SA
        from umbp.vllm import worker as W

        tr = self

        def wrap(cls, name, role, info=lambda self, a, r: {}, when=lambda self, r: True):
            orig = getattr(cls, name)

            def timed(self, *a, **k):
                t0 = time.monotonic()
                busy = when(self, None)
                r = orig(self, *a, **k)
                if busy or when(self, r):
                    tr.note(role, name, t0, **info(self, a, r))
                return r

            setattr(cls, name, timed)

        wrap(S.SchedulerSide, "get_num_new_matched_tokens", "scheduler",
             lambda s, a, r: {"req": a[0].request_id, "tokens": r[0], "async": r[1]})  # fmt: skip
        wrap(S.SchedulerSide, "update_state_after_alloc", "scheduler",
             lambda s, a, r: {"req": a[0].request_id, "external": a[2]})  # fmt: skip
        wrap(S.SchedulerSide, "build_connector_meta", "scheduler",
             lambda s, a, r: {"loads": len(r.loads), "stores": len(r.stores)})  # fmt: skip
        wrap(W.WorkerSide, "start_load_kv", "worker",
             lambda s, a, r: {"blocks": sum(len(t.block_ids) for t in a[0].loads)})  # fmt: skip
        wrap(W.WorkerSide, "get_finished", "worker",
             lambda s, a, r: {"recving": sorted(r[1] or [])},
             lambda s, r: bool(s.async_loads) if r is None else bool(r[1]))  # fmt: skip
        # Standalone mode: when the helper thread hands a transfer to the server (after the
        # engine's stream has reached the point the transfer was queued at).
        wrap(SA.ServerStore, "_submit_now", "worker",
             lambda s, a, r: {"store": a[0], "blocks": len(a[3])})  # fmt: skip
