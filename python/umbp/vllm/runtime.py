"""Where the connector's store, lookup client and lookup server come from: the runtime seam.

The scheduler side and the worker side never look at the mode. They are given a runtime, built
once per process by the connector, and ask it for what they need:

- the scheduler side, for a lookup client (`prefix_hits`, `exists_all`, `clear` over every
  worker of the engine), and to clean up at shutdown;
- the worker side, for its store (which it registers the KV cache with and copies through), and
  for a service that answers the scheduler's lookups from that store.

Two runtimes:

- `EmbeddedRuntime`: a private pool per worker, answering lookups on a Unix socket in this
  user's private directory under `lookup_dir`;
- `StandaloneRuntime`: the node's `umbp_standalone_server` owns the pool; every worker
  attaches to it and registers its KV cache, the scheduler asks it directly (one request
  covers every rank), and no worker serves lookups.

The worker's store is a `Store` in either mode (`umbp.EmbeddedStore`, or the standalone
`ServerStore` over a `umbp.StandaloneClient`), and each of its stores and loads a
`TransferHandle` (`umbp.Transfer`, the one class both modes answer with). Both answer one
status per block in the same words, failures included: the worker never looks at the mode.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

import umbp
from umbp.errors import ConfigError
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.host import (
    check_engine_memory,
    release_engine_memory_claim,
    remove_dead_sockets,
    socket_dir,
)
from umbp.vllm.standalone import ServerLookups, ServerStore
from umbp.vllm.topology import Ranks, Topology

logger = logging.getLogger("umbp.vllm")


class TransferHandle(Protocol):
    """A store or load in flight: `umbp.Transfer` (either mode), or something that answers as
    one: one status per block ("done", "missing", "failed", ...). One that failed as a whole
    answers every block "failed"; only a wait that runs out on a pending transfer raises
    (`umbp.TransferTimeout`)."""

    @property
    def done(self) -> bool: ...

    @property
    def elapsed_s(self) -> float | None: ...

    @property
    def object_bytes(self) -> int: ...

    def poll(self) -> list[str] | None: ...

    def wait(self, timeout_ms: int | None = None) -> list[str]: ...


class Store(Protocol):
    """What the worker side asks of its store, in either mode: registering the KV cache and
    its layout, stores and loads (ordered after `stream`, the engine's CUDA stream, when
    given), and closing."""

    def register_memory(self, addr: int, length: int) -> int: ...

    def register_cuda_memory(self, addr: int, length: int, device: int) -> int: ...

    def deregister_memory(self, region_id: int) -> None: ...

    def register_tensor_layout(self, groups: list, num_blocks: list[int]) -> int: ...

    def layout_summary(self, layout_id: int) -> list[dict[str, int]]: ...

    def store(
        self,
        layout_id: int,
        group: int,
        block_ids: Sequence[int],
        keys: umbp.Keys,
        *,
        stream: int | None = None,
        admit_now: bool = False,
    ) -> TransferHandle: ...

    def load(
        self,
        layout_id: int,
        group: int,
        block_ids: Sequence[int],
        keys: umbp.Keys,
        *,
        stream: int | None = None,
    ) -> TransferHandle: ...

    def close(self) -> None: ...


class Runtime(Protocol):
    """What the scheduler side and the worker side need from a mode."""

    def __init__(self, cfg: ConnectorConfig, topo: Topology) -> None: ...

    # Scheduler side.
    def lookup_client(self) -> Any:
        """A client that asks about every rank of the engine at once (`prefix_hits`,
        `exists_all`, `holds_all`, `clear`, as `umbp.LookupClient`)."""
        ...

    def scheduler_shutdown(self) -> None:
        """Called once when the scheduler side shuts down, after the workers have stopped."""
        ...

    # Worker side.
    def open_store(self, ranks: Ranks) -> Store:
        """The store of the worker at `ranks` (the worker registers its KV cache with it)."""
        ...

    def serve_lookups(self, store: Store, ranks: Ranks) -> umbp.LookupServer | None:
        """Starts answering the scheduler's lookups for this worker's keys, if the mode needs
        the worker to (the caller shuts the returned service down)."""
        ...

    def describe_worker(self) -> str:
        """A few words for the worker's start-up log line: its pool and where it answers."""
        ...

    def worker_shutdown(self) -> None:
        """Called once when the worker side shuts down, after its store has closed."""
        ...


def runtime_class(cfg: ConnectorConfig) -> type[Runtime]:
    """The runtime of `cfg.mode`."""
    if cfg.mode == "standalone":
        return StandaloneRuntime
    return EmbeddedRuntime


def socket_paths(topo: Topology, lookup_dir: str) -> list[str]:
    """Every worker's lookup socket (embedded mode), in this user's private directory under
    `lookup_dir`, in worker order."""
    d = socket_dir(lookup_dir)
    return [str(umbp.socket_path(d, topo.tag, topo.dp_rank, w)) for w in range(topo.workers)]


class EmbeddedRuntime:
    """Embedded mode: every worker owns a private pool and serves the scheduler's lookups and
    clears on its own Unix socket; a block hits only when every worker holds it."""

    mode = "embedded"

    def __init__(self, cfg: ConnectorConfig, topo: Topology) -> None:
        self.cfg = cfg
        self.topo = topo
        self.capacity: int | None = None  # the worker's pool bytes, once opened
        self.path: str | None = None  # the worker's socket, once serving
        self.claims: str | None = None  # the engine's memory claims file, once claimed

    def socket_paths(self) -> list[str]:
        return socket_paths(self.topo, self.cfg.lookup_dir)

    # -- scheduler side ----------------------------------------------------------------------

    def lookup_client(self) -> umbp.LookupClient:
        # Sockets left by a killed engine of this namespace with more workers (another TP
        # layout) are nobody's now: this engine's workers replace only their own paths.
        ours = set(self.socket_paths())
        d = socket_dir(self.cfg.lookup_dir)
        stale = d.glob(f"umbp-{self.topo.tag}-dp{self.topo.dp_rank}-w*.sock")
        for p in remove_dead_sockets([p for p in stale if str(p) not in ours]):
            logger.info("umbp: removed the socket of an earlier engine's worker: %s", p)
        client = umbp.LookupClient(self.socket_paths(), timeout_ms=self.cfg.lookup_timeout_ms)
        logger.info(
            "umbp: scheduler side: namespace %s, %d worker socket(s) in %s",
            self.topo.namespace,
            self.topo.workers,
            self.cfg.lookup_dir,
        )
        return client

    def scheduler_shutdown(self) -> None:
        # vLLM shuts the scheduler down after the executor has stopped (or killed) the
        # workers: remove the sockets of workers that could not remove their own.
        try:
            paths = self.socket_paths()
        except ConfigError as e:  # the directory changed under us: leave it alone
            logger.warning("umbp: lookup sockets not checked at shutdown: %s", e)
            return
        for p in remove_dead_sockets(paths):
            logger.info("umbp: removed the socket of a worker that did not shut down: %s", p)
        # The claims of workers that were killed before they could drop their own.
        release_engine_memory_claim(self._claims_path())

    def _claims_path(self):
        return (
            socket_dir(self.cfg.lookup_dir) / f"umbp-{self.topo.tag}-dp{self.topo.dp_rank}.claims"
        )

    # -- worker side -------------------------------------------------------------------------

    def disk_subdir(self, worker: int) -> str:
        """Worker `worker`'s own directory name under `disk_dir` (workers never share one)."""
        return f"umbp-{self.topo.tag}-dp{self.topo.dp_rank}-w{worker}"

    def open_store(self, ranks: Ranks) -> umbp.EmbeddedStore:
        cfg, topo = self.cfg, self.topo
        worker = ranks.worker(topo)
        # MLA: this rank's blocks are the first rank's, which writes the shared objects.
        remote_read_only = cfg.remote_url is not None and not topo.writes_shared(ranks.tp)
        if not remote_read_only and cfg.remote_url is not None and topo.tp_replicas > 1:
            logger.info(
                "umbp: the KV of every %d consecutive TP ranks is identical (MLA): the remote "
                "tier gets one object per block, written by the first rank of each group",
                topo.tp_replicas,
            )
        capacity = cfg.worker_capacity(topo.workers)
        if cfg.dram_prefault and not cfg.dram_use_hugepages:
            # Every worker of this engine on this host prefaults a pool: check their sum.
            claims = self._claims_path()
            check_engine_memory(claims, capacity, topo.workers_per_host)
            self.claims = str(claims)
        # Every option reaches the store from the user's JSON in Rust (one crossing).
        store = umbp.EmbeddedStore.for_connector(
            cfg.source_json,
            cfg.kv_role,
            capacity_bytes=capacity,
            disk_subdir=self.disk_subdir(worker),
            remote_read_only=remote_read_only,
        )
        self.capacity = capacity
        return store

    def serve_lookups(self, store: umbp.EmbeddedStore, ranks: Ranks) -> umbp.LookupServer:
        path = self.socket_paths()[ranks.worker(self.topo)]
        server = umbp.LookupServer(
            store,
            path,
            self.topo.namespace,
            tp=self.topo.key_tp(ranks.tp),
            pcp=ranks.pcp,
            dcp=ranks.dcp,
            describe=f"pid {os.getpid()} tp{ranks.tp} pcp{ranks.pcp} dcp{ranks.dcp}",
        )
        self.path = path
        return server

    def worker_shutdown(self) -> None:
        if self.claims is not None:
            release_engine_memory_claim(self.claims, os.getpid())
            self.claims = None

    def describe_worker(self) -> str:
        pool = f"{(self.capacity or 0) / (1 << 30):.2f} GiB pool"
        return f"{pool}, lookups on {self.path}" if self.path else pool


def topology_ranks(topo: Topology) -> list[tuple[int, int, int, int]]:
    """Every worker's `(tp, pcp, dcp, pp)` ranks, as vLLM assigns them: a worker's index is
    `tp + tp_size * pcp`, and its DCP group runs over PCP first, then TP (vLLM's
    `initialize_model_parallel`), so its DCP rank is `(tp * pcp_size + pcp) % dcp_size`.
    `StandaloneRuntime.serve_lookups` checks every worker's own ranks against this list."""
    out = []
    for pcp in range(topo.pcp_size):
        for tp in range(topo.tp_size):
            dcp = (tp * topo.pcp_size + pcp) % topo.dcp_size
            out.append((tp, pcp, dcp, 0))
    return out


def key_ranks(topo: Topology) -> list[tuple[int, int, int, int]]:
    """The distinct ranks the engine's keys carry, in worker order: `topology_ranks`, with
    every TP rank of a replica group (`Topology.tp_replicas`, MLA) keyed as the group's first.
    A block hits when the server holds it under each of these: the scheduler asks about one
    rank of each replica group."""
    out: list[tuple[int, int, int, int]] = []
    for tp, pcp, dcp, pp in topology_ranks(topo):
        r = (topo.key_tp(tp), pcp, dcp, pp)
        if r not in out:
            out.append(r)
    return out


class StandaloneRuntime:
    """Standalone mode: the node's `umbp_standalone_server` owns the pool. Each worker
    attaches, registers its KV cache (CUDA IPC, or its host pages shared through a memfd on CPU
    engines) and submits transfers the server performs; the scheduler asks the server about
    every rank at once. Nothing here starts a server: the operator does."""

    mode = "standalone"

    def __init__(self, cfg: ConnectorConfig, topo: Topology) -> None:
        self.cfg = cfg
        self.topo = topo
        self.client: umbp.StandaloneClient | None = None

    def _connect(self, side: str) -> umbp.StandaloneClient:
        cfg = self.cfg
        assert cfg.endpoint is not None  # required in this mode (validated)
        t0 = time.monotonic()
        try:
            client = umbp.StandaloneClient(
                cfg.endpoint,
                startup_timeout_ms=cfg.startup_timeout_ms,
                lookup_timeout_ms=cfg.lookup_timeout_ms,
                timeout_ms=cfg.timeout_ms,
                client_name=f"vLLM {side} pid {os.getpid()} namespace {self.topo.namespace}",
            )
        except umbp.ServerUnavailable as e:
            waited = (time.monotonic() - t0) * 1000
            raise RuntimeError(
                f"UMBPStoreConnector ({side}): no umbp_standalone_server answered at "
                f"{cfg.endpoint} within startup_timeout_ms={cfg.startup_timeout_ms} (waited "
                f"{waited:.0f} ms). Start the server there (see docs/standalone.md), or fix "
                f"option `endpoint`. {e}"
            ) from e
        logger.info(
            "umbp: %s attached to the UMBP server at %s (boot %s, session %s)",
            side,
            cfg.endpoint,
            client.boot_id,
            client.session_id,
        )
        self.client = client
        return client

    # -- scheduler side ----------------------------------------------------------------------

    def lookup_client(self) -> ServerLookups:
        client = self._connect("scheduler")
        if self.topo.tp_replicas > 1:
            logger.info(
                "umbp: the KV of every %d consecutive TP ranks is identical (MLA): one object "
                "per block for each group of them, stored by its first rank",
                self.topo.tp_replicas,
            )
        return ServerLookups(client, self.topo.namespace, key_ranks(self.topo))

    def scheduler_shutdown(self) -> None:
        if self.client is not None:
            self.client.close()  # never waits on a stalled server

    # -- worker side -------------------------------------------------------------------------

    def open_store(self, ranks: Ranks) -> ServerStore:
        return ServerStore(self._connect("worker"))

    def serve_lookups(self, store: Store, ranks: Ranks) -> None:
        # The scheduler asks the server; but it builds every rank's keys from the topology,
        # so this worker's own ranks must be among them.
        mine = (ranks.tp, ranks.pcp, ranks.dcp, 0)
        if mine not in topology_ranks(self.topo):
            raise RuntimeError(
                f"UMBPStoreConnector: this worker's ranks (tp, pcp, dcp) = {mine[:3]} are not "
                f"the ones the scheduler expects for tp={self.topo.tp_size} "
                f"pcp={self.topo.pcp_size} dcp={self.topo.dcp_size}; this vLLM assigns "
                "decode-context ranks differently from what UMBP supports, so standalone mode "
                'cannot look its blocks up: use mode "embedded"'
            )
        return None

    def worker_shutdown(self) -> None:
        pass  # the store's close closed the client

    def describe_worker(self) -> str:
        c = self.client
        if c is None:
            return "not attached"
        return f"UMBP server {self.cfg.endpoint} (session {c.session_id})"
