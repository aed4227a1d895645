//! The client of the standalone server (`StandaloneClient`); its transfers are
//! [`crate::transfer::Transfer`]s.
//!
//! The same store / load / exists surface as `EmbeddedStore`, served by a
//! `umbp_standalone_server` on the node: memory is registered with the server (host memory by
//! sharing its pages through a sealed memfd, CUDA memory by IPC), no KV byte crosses the
//! socket. Every call that talks to the server runs with the GIL released: the client's
//! runtime threads log through Python's `logging`, so they may need the GIL while holding a
//! lock a call waits for. The client (and its runtime) is made by the constructor, never at
//! import, and refuses to be used in a forked child.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use umbp_client::{
    ClientError, ClientOptions, ServerStats, StandaloneClient as CoreClient,
    Transfer as CoreTransfer,
};
use umbp_core::CounterSet;
use umbp_core::{Admit, KvLayout, LayerSpec, LayoutSummary, RankTopology};
use umbp_proto::Endpoint;

use crate::errors::{Error, Result};
use crate::keys::Keys;
use crate::lifecycle::{track_client, without_gil, ReleaseGilOnDrop};
use crate::store::{
    layout_from_tensors, layout_from_tuples, summary_dicts, to_u64s, LayerTuple, TensorSpec,
};
use crate::transfer::Transfer;

/// A client of the node's `umbp_standalone_server` (standalone mode).
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct StandaloneClient {
    inner: ReleaseGilOnDrop<Arc<CoreClient>>,
    endpoint: String,
    /// Each registered layout's per-group summary, for `layout_summary`.
    summaries: Mutex<HashMap<u32, Vec<LayoutSummary>>>,
}

fn layers_of(layout: &KvLayout) -> Vec<Vec<LayerSpec>> {
    layout
        .groups()
        .iter()
        .map(|g| g.layers().to_vec())
        .collect()
}

fn millis(what: &str, ms: u64) -> Result<Duration> {
    if ms == 0 {
        return Err(Error::Config(format!("{what} must be at least 1 ms")));
    }
    Ok(Duration::from_millis(ms))
}

#[pymethods]
impl StandaloneClient {
    /// Connects to the server at `endpoint` (`/abs/path.sock` or `unix:///abs/path.sock`),
    /// waiting up to `startup_timeout_ms` for it to answer, and attaches. `lookup_timeout_ms`
    /// is the deadline of a lookup, `timeout_ms` that of a transfer and of every other call.
    /// A bad endpoint raises `ConfigError`, no server answering `ServerUnavailable`, both
    /// naming the endpoint. A timeout left out (or None) is the connector option's default of
    /// the same name (`umbp_core::options`, through `ClientOptions::new`).
    #[new]
    #[pyo3(signature = (endpoint, *, startup_timeout_ms=None, lookup_timeout_ms=None,
        timeout_ms=None, client_name=None))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        startup_timeout_ms: Option<u64>,
        lookup_timeout_ms: Option<u64>,
        timeout_ms: Option<u64>,
        client_name: Option<String>,
    ) -> Result<Self> {
        let ep = Endpoint::parse(endpoint).map_err(ClientError::from)?;
        let mut opts = ClientOptions::new(ep);
        // Unset: ClientOptions' defaults, the connector options' (`umbp_core::options`).
        if let Some(ms) = startup_timeout_ms {
            opts.startup_timeout = millis("startup_timeout_ms", ms)?;
        }
        if let Some(ms) = lookup_timeout_ms {
            opts.lookup_timeout = millis("lookup_timeout_ms", ms)?;
        }
        if let Some(ms) = timeout_ms {
            opts.transfer_timeout = millis("timeout_ms", ms)?;
        }
        opts.control_timeout = opts.transfer_timeout;
        if let Some(name) = client_name {
            opts.client_name = name;
        }
        let endpoint = opts.endpoint.to_string();
        let client = Arc::new(without_gil(py, move || CoreClient::connect(opts))?);
        track_client(&client);
        Ok(StandaloneClient {
            inner: ReleaseGilOnDrop::new(client),
            endpoint,
            summaries: Mutex::default(),
        })
    }

    /// The server's address, as `unix:///path`.
    #[getter]
    fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Shares host memory (e.g. a KV cache tensor's `data_ptr()` and byte size) with the
    /// server and registers it: the pages of the range are moved in place onto a sealed
    /// memfd the server maps (pointers into it stay valid). The range must be private
    /// anonymous memory or memory shared before, page-aligned at both ends or exactly one
    /// large allocation (a torch CPU tensor or numpy array of 32 MiB or more); no other
    /// thread may write it during the call; it must not be pinned by a device
    /// (`cudaHostRegister`, RDMA); and it must stay allocated until `deregister_memory`
    /// returns or the client is closed. Returns the region id.
    fn register_memory(&self, py: Python<'_>, addr: u64, length: u64) -> Result<u64> {
        let c = self.live()?;
        // SAFETY: the Python-facing contract, documented above and in the stubs: the caller
        // writes the range from no other thread during the call, has not pinned it for a
        // device, and keeps it allocated while registered (the connector holds its KV cache
        // tensors for the client's whole life).
        Ok(without_gil(py, || unsafe {
            c.register_host_memory(addr, length)
        })?)
    }

    /// Registers CUDA device memory (a CUDA tensor's `data_ptr()` and byte size; the device is
    /// the one that owns it) with the server by IPC. The memory must stay allocated until
    /// `deregister_memory` returns or the client is closed. Returns the region id.
    fn register_cuda_memory(&self, py: Python<'_>, addr: u64, length: u64) -> Result<u64> {
        let c = self.live()?;
        // SAFETY: the Python-facing contract (documented above and in the stubs) is that the
        // caller keeps the memory allocated while it is registered.
        Ok(without_gil(py, || unsafe {
            c.register_cuda_memory(addr, length)
        })?)
    }

    /// Removes one registration; layouts in it are dropped with it.
    fn deregister_memory(&self, py: Python<'_>, region_id: u64) -> Result<()> {
        let c = self.live()?;
        Ok(without_gil(py, || c.deregister_memory(region_id))?)
    }

    /// Registers a KV layout: one list per cache group, one
    /// `(base_addr, num_blocks, block_stride, block_bytes)` tuple per layer, in this process's
    /// addresses. Every layer must lie inside memory registered by this client. Returns the
    /// layout id (it stays valid when the client attaches again after a server restart).
    fn register_layout(&self, py: Python<'_>, groups: Vec<Vec<LayerTuple>>) -> Result<u32> {
        let c = self.live()?;
        without_gil(py, move || self.register(c, layout_from_tuples(groups)?))
    }

    /// Registers a KV layout from tensor views, as `EmbeddedStore.register_tensor_layout`: one
    /// list per cache group, one
    /// `(name, data_ptr, element_size, shape, strides, block_dim, expected_block_bytes)` tuple
    /// per layer; `num_blocks[g]` is group `g`'s number of blocks. The runs are planned here
    /// from the strides (a view that cannot be planned exactly raises `ConfigError` naming the
    /// tensor) and registered with the server. Returns the layout id.
    fn register_tensor_layout(
        &self,
        py: Python<'_>,
        groups: Vec<Vec<TensorSpec>>,
        num_blocks: Vec<u64>,
    ) -> Result<u32> {
        let c = self.live()?;
        without_gil(py, move || {
            self.register(c, layout_from_tensors(groups, num_blocks)?)
        })
    }

    /// Per cache group of layout `layout_id`, what copying one block involves, as
    /// `EmbeddedStore.layout_summary`: dicts with `runs`, `ranges_per_block`, `min_piece`,
    /// `max_piece` and `object_bytes`.
    fn layout_summary<'py>(
        &self,
        py: Python<'py>,
        layout_id: u32,
    ) -> Result<Vec<Bound<'py, PyDict>>> {
        self.live()?;
        let s = self.summaries.lock().unwrap_or_else(|p| p.into_inner());
        let Some(summaries) = s.get(&layout_id) else {
            return Err(Error::Config(format!(
                "layout {layout_id} was not registered by this client"
            )));
        };
        summary_dicts(py, summaries)
    }

    /// Bytes of one block's object in `group` of layout `layout_id`.
    fn object_bytes(&self, py: Python<'_>, layout_id: u32, group: u32) -> Result<u64> {
        let c = self.live()?;
        Ok(without_gil(py, || c.object_bytes(layout_id, group))?)
    }

    /// Which keys are in the server's pool. Pins nothing and never refreshes recency.
    fn exists(&self, py: Python<'_>, keys: &Keys) -> Result<Vec<bool>> {
        let c = self.live()?;
        Ok(without_gil(py, || c.exists(&keys.keys))?)
    }

    /// How many keys, from the first, are in the server's pool.
    fn prefix_hits(&self, py: Python<'_>, keys: &Keys) -> Result<usize> {
        let c = self.live()?;
        Ok(without_gil(py, || c.prefix_hits(&keys.keys))?)
    }

    /// Per block, whether every rank of `ranks` (`(tp, pcp, dcp, pp)` tuples) holds it, with
    /// keys built by the server from `namespace`, `group` and `hashes` (packed back to back,
    /// `hash_bytes` each). Returns `(per-block answers, leading blocks every rank holds)`; the
    /// list is empty with `prefix_only`.
    #[pyo3(signature = (namespace, ranks, group, hashes, hash_bytes, prefix_only=false))]
    #[allow(clippy::too_many_arguments)]
    fn exists_across_ranks(
        &self,
        py: Python<'_>,
        namespace: &str,
        ranks: Vec<(u16, u16, u16, u16)>,
        group: u32,
        hashes: &[u8],
        hash_bytes: u32,
        prefix_only: bool,
    ) -> Result<(Vec<bool>, usize)> {
        let c = self.live()?;
        let ranks = topologies(ranks);
        Ok(without_gil(py, || {
            c.exists_across_ranks(namespace, &ranks, group, hashes, hash_bytes, prefix_only)
        })?)
    }

    /// Pins `keys` in the server's pool for `ttl_s` seconds (at most 24 h): never evicted while
    /// pinned, whichever engine stored them; pinning again renews. Per key: "pinned",
    /// "renewed", "missing" or "refused" (past the bytes a namespace may pin: the server's
    /// `--pin-namespace-bytes`). Pins outlive this client.
    fn pin(&self, py: Python<'_>, keys: &Keys, ttl_s: f64) -> Result<Vec<&'static str>> {
        let ttl = crate::store::pin_ttl(ttl_s)?;
        let c = self.live()?;
        let got = without_gil(py, || c.pin(&keys.keys, ttl))?;
        Ok(got.into_iter().map(umbp_core::PinOutcome::name).collect())
    }

    /// Releases the pins of `keys` in the server's pool; how many were pinned.
    fn unpin(&self, py: Python<'_>, keys: &Keys) -> Result<u64> {
        let c = self.live()?;
        Ok(without_gil(py, || c.unpin(&keys.keys))?)
    }

    /// Per block, whether every rank of `ranks` has it in the server's DRAM pool now, as
    /// `exists_across_ranks` but leasing nothing, reading no lower tier and counting no hit
    /// or miss (for watching evictions; never before a load).
    fn holds_across_ranks(
        &self,
        py: Python<'_>,
        namespace: &str,
        ranks: Vec<(u16, u16, u16, u16)>,
        group: u32,
        hashes: &[u8],
        hash_bytes: u32,
    ) -> Result<Vec<bool>> {
        let c = self.live()?;
        let ranks = topologies(ranks);
        Ok(without_gil(py, || {
            c.holds_across_ranks(namespace, &ranks, group, hashes, hash_bytes)
        })?)
    }

    /// Starts storing `block_ids` of cache group `group` of layout `layout_id` into the
    /// server's pool under `keys`. `admit_now` keeps each block on its key's first sighting
    /// even under the server's `--store-admission on_reuse`.
    #[pyo3(signature = (layout_id, group, block_ids, keys, *, admit_now=false))]
    fn store(
        &self,
        py: Python<'_>,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
        admit_now: bool,
    ) -> Result<Transfer> {
        let admit = if admit_now { Admit::Now } else { Admit::Policy };
        self.start(py, Some(admit), (layout_id, group), block_ids, keys)
    }

    /// Starts loading `keys` from the server's pool into `block_ids` of cache group `group`.
    fn load(
        &self,
        py: Python<'_>,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
    ) -> Result<Transfer> {
        self.start(py, None, (layout_id, group), block_ids, keys)
    }

    /// Removes every object of the server's pool (every client's!), or those of key
    /// namespace `namespace`; returns how many.
    #[pyo3(signature = (namespace=None))]
    fn clear(&self, py: Python<'_>, namespace: Option<&str>) -> Result<u64> {
        let c = self.live()?;
        Ok(without_gil(py, || c.clear(namespace))?)
    }

    /// The server's pool and session counters as a dict (every field of its `StatsReply`).
    fn stats<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyDict>> {
        let c = self.live()?;
        let s = without_gil(py, || c.stats())?;
        let pool: umbp_pool::PoolCounters = umbp_proto::counters::pool_counters(&s);
        // Every other field, by name: a field added to the protocol fails to compile here (the
        // pool's frozen fields are read through `pool_counters`).
        let ServerStats {
            boot_id,
            sessions,
            registrations,
            layouts,
            transfers_in_flight,
            pending_descriptors,
            stores,
            loads,
            store_bytes,
            load_bytes,
            placement,
            cuda_imports,
            remote,
            disk,
            pins,
            channel_transfers,
            transfer_channels,
            integrity,
            integrity_sample_every,
            pool: _,
            ..
        } = s;
        let d = PyDict::new(py);
        d.set_item("boot_id", boot_id)?;
        // Every pool counter by its model's name.
        for (f, v) in pool.pairs() {
            d.set_item(f.name, v)?;
        }
        d.set_item("sessions", sessions)?;
        d.set_item("registrations", registrations)?;
        d.set_item("layouts", layouts)?;
        d.set_item("transfers_in_flight", transfers_in_flight)?;
        d.set_item("pending_descriptors", pending_descriptors)?;
        d.set_item("stores", stores)?;
        d.set_item("loads", loads)?;
        d.set_item("store_bytes", store_bytes)?;
        d.set_item("load_bytes", load_bytes)?;
        d.set_item("placement", placement)?;
        d.set_item("cuda_imports", cuda_imports)?;
        d.set_item("channel_transfers", channel_transfers)?;
        d.set_item("transfer_channels", transfer_channels)?;
        d.set_item("integrity", integrity)?;
        d.set_item("integrity_sample_every", integrity_sample_every)?;
        // Each tier's group of counters, from the wire by the group's model.
        fn group<'py, S: umbp_core::CounterSet>(
            py: Python<'py>,
            counters: Option<&std::collections::HashMap<String, u64>>,
        ) -> Result<Option<Bound<'py, PyDict>>> {
            counters
                .map(|c| crate::store::counters_dict(py, &umbp_proto::counters::from_wire::<S>(c)))
                .transpose()
        }
        d.set_item(
            "remote",
            group::<umbp_store::RemoteStats>(py, remote.as_ref().map(|r| &r.counters))?,
        )?;
        d.set_item(
            "pins",
            group::<umbp_pool::KeepStats>(py, pins.as_ref().map(|p| &p.counters))?,
        )?;
        d.set_item(
            "disk",
            group::<umbp_store::DiskStats>(py, disk.as_ref().map(|x| &x.counters))?,
        )?;
        Ok(d)
    }

    /// Asks the server for its boot id (changes when it restarts).
    fn ping(&self, py: Python<'_>) -> Result<String> {
        let c = self.live()?;
        Ok(without_gil(py, || c.ping())?)
    }

    /// The server's id of this client's current session; None while detached (after a
    /// failure, until a call attaches again).
    #[getter]
    fn session_id(&self, py: Python<'_>) -> Result<Option<u64>> {
        let c = self.live()?;
        Ok(without_gil(py, || c.session().map(|(id, _)| id)))
    }

    /// The boot id of the server this client is attached to; None while detached.
    #[getter]
    fn boot_id(&self, py: Python<'_>) -> Result<Option<String>> {
        let c = self.live()?;
        Ok(without_gil(py, || c.session().map(|(_, b)| b)))
    }

    /// How many times this client attached: 1, plus one per re-attach after a server restart
    /// or a broken connection.
    #[getter]
    fn attach_count(&self) -> Result<u64> {
        Ok(self.live()?.attach_count())
    }

    /// Detaches (the server releases this client's registrations, layouts and transfers) and
    /// closes the client. Idempotent; later calls raise `StoreClosedError`.
    fn close(&self, py: Python<'_>) {
        // In a forked child the session and the runtime belong to the parent.
        if self.inner.forked() {
            return;
        }
        without_gil(py, || self.inner.close());
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        format!("<umbp.StandaloneClient of {}>", self.endpoint)
    }
}

impl StandaloneClient {
    /// The client, or `StoreClosedError` in a forked child.
    /// Registers `layout` with the server and keeps its summary.
    fn register(&self, c: &CoreClient, layout: KvLayout) -> Result<u32> {
        let id = c.register_layout(layers_of(&layout))?.id;
        let summary = layout.groups().iter().map(|g| g.summary()).collect();
        self.summaries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, summary);
        Ok(id)
    }

    fn live(&self) -> Result<&Arc<CoreClient>> {
        self.inner.live("standalone client")
    }

    /// Starts a store or a load (the shared body of `store` and `load`), GIL released.
    fn start(
        &self,
        py: Python<'_>,
        store: Option<Admit>,
        (layout_id, group): (u32, u32),
        block_ids: Vec<i64>,
        keys: &Keys,
    ) -> Result<Transfer> {
        let c = self.live()?;
        let n = keys.keys.len();
        // Both take the client's record lock, which a re-attach holds across RPCs.
        let (t, object_bytes) = without_gil(py, || -> Result<(CoreTransfer, u64)> {
            let object_bytes = c.object_bytes(layout_id, group).unwrap_or(0);
            let ids = to_u64s(block_ids, "block ids")?;
            let t = match store {
                Some(admit) => c.store_as(layout_id, group, &ids, &keys.keys, admit),
                None => c.load(layout_id, group, &ids, &keys.keys),
            }?;
            Ok((t, object_bytes))
        })?;
        Ok(Transfer::standalone(t, n, object_bytes))
    }
}

/// `(tp, pcp, dcp, pp)` tuples from Python as rank topologies.
fn topologies(ranks: Vec<(u16, u16, u16, u16)>) -> Vec<RankTopology> {
    ranks
        .into_iter()
        .map(|(tp, pcp, dcp, pp)| RankTopology { tp, pcp, dcp, pp })
        .collect()
}
