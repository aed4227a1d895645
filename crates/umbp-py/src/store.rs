//! The embedded store (`EmbeddedStore`); its transfers are [`crate::transfer::Transfer`]s.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use umbp_copy::{Direction, JobHandle};
use umbp_core::{
    options, EvictionPolicy, GroupLayout, HugepageSize, Integrity, KvLayout, LayerSpec,
    LayoutSummary, MemoryBacking, PoolConfig, StoreAdmission, TensorView,
};
use umbp_core::{Admit, CounterKind, CounterSet};
use umbp_store::{CopyMethod, CudaOptions, EmbeddedStore as CoreStore, StoreConfig};

use crate::errors::{Error, Result};
use crate::keys::Keys;
use crate::lifecycle::{bulk, track_store, without_gil, ReleaseGilOnDrop};
use crate::transfer::Transfer;

/// A private host-DRAM pool with its copy engine (embedded mode).
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct EmbeddedStore {
    inner: ReleaseGilOnDrop<Arc<CoreStore>>,
}

/// A pin's `ttl_s` as a duration: a positive, finite number of seconds (both store classes).
pub(crate) fn pin_ttl(ttl_s: f64) -> Result<std::time::Duration> {
    if !(ttl_s.is_finite() && ttl_s > 0.0) {
        return Err(umbp_core::CoreError::option(
            "ttl_s",
            format!("{ttl_s} is not a positive number of seconds"),
        )
        .into());
    }
    Ok(std::time::Duration::from_secs_f64(ttl_s))
}

pub(crate) fn to_u64s(v: Vec<i64>, what: &str) -> Result<Vec<u64>> {
    v.into_iter()
        .map(|x| {
            u64::try_from(x).map_err(|_| Error::Config(format!("{what} must be >= 0, got {x}")))
        })
        .collect()
}

/// One layer of `register_tensor_layout`: `(name, data_ptr, element_size, shape, strides,
/// block_dim, expected_block_bytes)`.
pub(crate) type TensorSpec = (String, u64, u64, Vec<u64>, Vec<i64>, usize, Option<u64>);

/// One layer of `register_layout`: `(base_addr, num_blocks, block_stride, block_bytes)`.
pub(crate) type LayerTuple = (u64, u64, u64, u64);

/// The KV layout of a `register_layout` argument (one list of layers per cache group), checked.
pub(crate) fn layout_from_tuples(groups: Vec<Vec<LayerTuple>>) -> Result<KvLayout> {
    let mut gl = Vec::with_capacity(groups.len());
    for layers in groups {
        let specs = layers
            .into_iter()
            .map(
                |(base_addr, num_blocks, block_stride, block_bytes)| LayerSpec {
                    base_addr,
                    num_blocks,
                    block_stride,
                    block_bytes,
                },
            )
            .collect();
        gl.push(GroupLayout::new(specs)?);
    }
    Ok(KvLayout::new(gl)?)
}

/// The KV layout of a `register_tensor_layout` argument: each tensor view's runs, planned from
/// its strides, checked.
pub(crate) fn layout_from_tensors(
    groups: Vec<Vec<TensorSpec>>,
    num_blocks: Vec<u64>,
) -> Result<KvLayout> {
    if groups.len() != num_blocks.len() {
        return Err(Error::Config(format!(
            "register_tensor_layout: {} groups but {} block counts",
            groups.len(),
            num_blocks.len()
        )));
    }
    let mut gl = Vec::with_capacity(groups.len());
    for (layers, nb) in groups.into_iter().zip(num_blocks) {
        let mut specs = Vec::new();
        for (name, addr, elem_bytes, shape, strides, block_dim, expected) in layers {
            let view = TensorView {
                name,
                addr,
                elem_bytes,
                shape,
                strides,
                block_dim,
            };
            specs.extend(view.layer_runs(nb, expected)?);
        }
        // Objects hold the runs in address order, so runs that follow each other in memory (a
        // block's layers in BHLNC, say) merge into one copy.
        specs.sort_by_key(|l| l.base_addr);
        gl.push(GroupLayout::new(specs)?);
    }
    Ok(KvLayout::new(gl)?)
}

#[pymethods]
impl EmbeddedStore {
    /// A store of `capacity_bytes`. Every other argument left out (or None) takes the store's
    /// default: the connector option's of the same meaning (`umbp_core::options`), so the
    /// signature repeats no default.
    #[new]
    #[pyo3(signature = (capacity_bytes, *, high_watermark=None, low_watermark=None,
        use_hugepages=None, hugepage_size=None, numa_node=None, prefault=None,
        prefault_threads=None, memfd=None, segment_bytes=None, eviction_policy=None,
        store_admission=None, integrity=None, integrity_sample_every=None, num_workers=None,
        timeout_ms=None,
        cuda_copy_method=None, cuda_staging_bytes=None, cuda_max_ctas=None,
        cuda_pin_chunk_bytes=None, cuda_batch_blocks=None, remote_url=None, remote_ttl_s=None,
        remote_write=None, remote_timeout_ms=None, remote_write_backlog=None,
        remote_write_mb_per_s=None, disk_dir=None, disk_capacity_bytes=None,
        disk_write_mb_per_s=None, disk_segment_bytes=None, disk_write=None,
        disk_close_write_s=None, lookup_lease_ms=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        capacity_bytes: u64,
        high_watermark: Option<f64>,
        low_watermark: Option<f64>,
        use_hugepages: Option<bool>,
        hugepage_size: Option<&str>,
        numa_node: Option<u32>,
        prefault: Option<bool>,
        prefault_threads: Option<usize>,
        memfd: Option<bool>,
        segment_bytes: Option<u64>,
        eviction_policy: Option<&str>,
        store_admission: Option<&str>,
        integrity: Option<&str>,
        integrity_sample_every: Option<u64>,
        num_workers: Option<usize>,
        timeout_ms: Option<u64>,
        cuda_copy_method: Option<&str>,
        cuda_staging_bytes: Option<u64>,
        cuda_max_ctas: Option<u32>,
        cuda_pin_chunk_bytes: Option<u64>,
        cuda_batch_blocks: Option<usize>,
        remote_url: Option<String>,
        remote_ttl_s: Option<u64>,
        remote_write: Option<&str>,
        remote_timeout_ms: Option<u64>,
        remote_write_backlog: Option<u64>,
        remote_write_mb_per_s: Option<u64>,
        disk_dir: Option<std::path::PathBuf>,
        disk_capacity_bytes: Option<u64>,
        disk_write_mb_per_s: Option<u64>,
        disk_segment_bytes: Option<u64>,
        disk_write: Option<&str>,
        disk_close_write_s: Option<u64>,
        lookup_lease_ms: Option<u64>,
    ) -> Result<Self> {
        let defaults = StoreConfig::default();
        let pool = defaults.pool;
        let cuda = defaults.cuda;
        let cfg = StoreConfig {
            pool: PoolConfig {
                capacity_bytes,
                high_watermark: high_watermark.unwrap_or(pool.high_watermark),
                low_watermark: low_watermark.unwrap_or(pool.low_watermark),
                use_hugepages: use_hugepages.unwrap_or(pool.use_hugepages),
                hugepage_size: match hugepage_size {
                    Some(size) => size.parse::<HugepageSize>()?,
                    None => pool.hugepage_size,
                },
                numa_node: numa_node.or(pool.numa_node),
                prefault: prefault.unwrap_or(pool.prefault),
                prefault_threads: prefault_threads.unwrap_or(pool.prefault_threads),
                backing: match memfd {
                    Some(true) => MemoryBacking::Memfd,
                    Some(false) => MemoryBacking::Anonymous,
                    None => pool.backing,
                },
                segment_bytes: segment_bytes.unwrap_or(pool.segment_bytes),
                eviction_policy: match eviction_policy {
                    Some(p) => p.parse::<EvictionPolicy>()?,
                    None => pool.eviction_policy,
                },
                store_admission: match store_admission {
                    Some(a) => a.parse::<StoreAdmission>()?,
                    None => pool.store_admission,
                },
                admission_window: pool.admission_window,
                keep_namespace_bytes: pool.keep_namespace_bytes,
                lookup_lease_ms: lookup_lease_ms.unwrap_or(pool.lookup_lease_ms),
                integrity: match (integrity, integrity_sample_every) {
                    (None, None) => pool.integrity,
                    (mode, every) => Integrity::from_options(
                        mode.unwrap_or(pool.integrity.as_str()),
                        every.unwrap_or(options::INTEGRITY_SAMPLE_EVERY.default_u64()),
                    )?,
                },
            },
            num_workers: num_workers.unwrap_or(defaults.num_workers),
            timeout: timeout_ms.map_or(defaults.timeout, Duration::from_millis),
            cuda: CudaOptions {
                method: match cuda_copy_method {
                    Some(method) => method.parse::<CopyMethod>()?,
                    None => cuda.method,
                },
                staging_bytes: cuda_staging_bytes.unwrap_or(cuda.staging_bytes),
                max_ctas: cuda_max_ctas.unwrap_or(cuda.max_ctas),
                pin_chunk_bytes: cuda_pin_chunk_bytes.unwrap_or(cuda.pin_chunk_bytes),
                batch_blocks: cuda_batch_blocks.unwrap_or(cuda.batch_blocks),
                ..cuda
            },
            disk: match disk_dir {
                None => None,
                Some(dir) => {
                    let mut d = umbp_store::disk_tier(
                        dir,
                        disk_capacity_bytes,
                        disk_write_mb_per_s,
                        disk_write,
                        disk_close_write_s,
                    )?;
                    d.segment_bytes = disk_segment_bytes.unwrap_or(0);
                    Some(d)
                }
            },
            remote: match remote_url {
                None => None,
                Some(url) => Some(umbp_store::remote_tier(
                    url,
                    remote_ttl_s,
                    remote_write,
                    remote_timeout_ms,
                    remote_write_backlog,
                    remote_write_mb_per_s,
                )?),
            },
        };
        let inner = Arc::new(without_gil(py, move || CoreStore::new(cfg))?);
        track_store(&inner);
        Ok(EmbeddedStore {
            inner: ReleaseGilOnDrop::new(inner),
        })
    }

    /// One connector worker's store, shaped by the connector's options
    /// (`kv_connector_extra_config` as JSON, and `kv_role`), validated and turned into the
    /// store's settings in Rust at once (`StoreConfig::for_connector`), plus what the worker
    /// adds: its share of the capacity, its own directory under `disk_dir`, and whether it
    /// writes nothing to the remote tier (an MLA rank the first of its group writes for).
    #[staticmethod]
    #[pyo3(signature = (options_json, kv_role=None, *, capacity_bytes, disk_subdir,
        remote_read_only=false))]
    fn for_connector(
        py: Python<'_>,
        options_json: &str,
        kv_role: Option<&str>,
        capacity_bytes: u64,
        disk_subdir: String,
        remote_read_only: bool,
    ) -> Result<Self> {
        let opts = umbp_core::ConnectorOptions::from_json(options_json, kv_role)?;
        let worker = umbp_store::WorkerPlacement {
            capacity_bytes,
            disk_subdir,
            remote_read_only,
        };
        let cfg = StoreConfig::for_connector(&opts, &worker)?;
        let inner = Arc::new(without_gil(py, move || CoreStore::new(cfg))?);
        track_store(&inner);
        Ok(EmbeddedStore {
            inner: ReleaseGilOnDrop::new(inner),
        })
    }

    /// Registers host memory (e.g. a KV cache tensor's `data_ptr()` and byte size). The memory
    /// must stay alive until `deregister_memory` returns or the store is closed.
    fn register_memory(&self, py: Python<'_>, addr: u64, length: u64) -> Result<u64> {
        let s = self.live()?;
        // SAFETY: the Python-facing contract (documented above and in the stubs) is that the
        // caller keeps the memory alive while it is registered; the connector holds the KV
        // cache tensors for the store's whole life.
        Ok(without_gil(py, || unsafe {
            s.register_memory(addr, length)
        })?)
    }

    /// Removes one registration (waiting for transfers that still use it).
    fn deregister_memory(&self, py: Python<'_>, region_id: u64) -> Result<()> {
        let s = self.live()?;
        Ok(without_gil(py, || s.deregister_memory(region_id))?)
    }

    /// Registers a KV layout: one list per cache group, one
    /// `(base_addr, num_blocks, block_stride, block_bytes)` tuple per layer. Every layer must
    /// lie inside registered memory. Returns the layout id.
    fn register_layout(&self, py: Python<'_>, groups: Vec<Vec<LayerTuple>>) -> Result<u32> {
        without_gil(py, move || {
            let layout = layout_from_tuples(groups)?;
            Ok(self.live()?.register_layout(layout)?)
        })
    }

    /// Registers a KV layout from tensor views: one list per cache group, one
    /// `(name, data_ptr, element_size, shape, strides, block_dim, expected_block_bytes)` tuple
    /// per layer (strides in elements, as `torch.Tensor.stride()` gives them;
    /// `expected_block_bytes` may be None). `num_blocks[g]` is group `g`'s number of blocks; a
    /// block dimension of `r * num_blocks` rows holds `r` rows per block. The runs of each
    /// layer's block are found from the strides; a view that cannot be planned exactly raises
    /// `ConfigError` naming the tensor. Returns the layout id.
    fn register_tensor_layout(
        &self,
        py: Python<'_>,
        groups: Vec<Vec<TensorSpec>>,
        num_blocks: Vec<u64>,
    ) -> Result<u32> {
        without_gil(py, move || {
            let layout = layout_from_tensors(groups, num_blocks)?;
            Ok(self.live()?.register_layout(layout)?)
        })
    }

    /// Per cache group of layout `layout_id`: what copying one block involves, as a dict with
    /// `runs`, `ranges_per_block` (after merging adjacent runs), `min_piece`, `max_piece` and
    /// `object_bytes`.
    fn layout_summary<'py>(
        &self,
        py: Python<'py>,
        layout_id: u32,
    ) -> Result<Vec<Bound<'py, PyDict>>> {
        let s = self.live()?;
        let summaries = without_gil(py, || -> Result<Vec<_>> {
            let l = s.layout(layout_id)?;
            Ok(l.groups().iter().map(|g| g.summary()).collect())
        })?;
        summary_dicts(py, &summaries)
    }

    /// Bytes of one block's object in `group` of layout `layout_id`.
    fn object_bytes(&self, layout_id: u32, group: u32) -> Result<u64> {
        let l = self.live()?.layout(layout_id)?;
        Ok(l.group(group)?.object_bytes())
    }

    /// Which keys are in the pool. Pins nothing and never refreshes recency.
    fn exists(&self, py: Python<'_>, keys: &Keys) -> Result<Vec<bool>> {
        let s = self.live()?;
        Ok(bulk(py, lookup_weight(s, keys), || s.exists(&keys.keys))?)
    }

    /// Pins `keys` in the pool for `ttl_s` seconds: never evicted while pinned (pinning again
    /// renews). Per key: "pinned", "renewed", "missing" (not in the pool) or "refused" (past
    /// the bytes a namespace, or the pool, may pin).
    fn pin(&self, py: Python<'_>, keys: &Keys, ttl_s: f64) -> Result<Vec<&'static str>> {
        let ttl = pin_ttl(ttl_s)?;
        let s = self.live()?;
        let got = without_gil(py, || s.pin(&keys.keys, ttl))?;
        Ok(got.into_iter().map(umbp_core::PinOutcome::name).collect())
    }

    /// Releases the pins of `keys`; how many were pinned.
    fn unpin(&self, py: Python<'_>, keys: &Keys) -> Result<u64> {
        let s = self.live()?;
        Ok(without_gil(py, || s.unpin(&keys.keys))?)
    }

    /// Counters of pins: pinned objects and bytes now, granted, renewed, released, expired,
    /// refused, and ended with their objects (evicted on request or cleared).
    fn pin_stats<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyDict>> {
        counters_dict(py, &self.live()?.pin_stats())
    }

    /// How many keys, from the first, are in the pool.
    fn prefix_hits(&self, py: Python<'_>, keys: &Keys) -> Result<usize> {
        let s = self.live()?;
        Ok(bulk(py, lookup_weight(s, keys), || {
            s.prefix_hits(&keys.keys)
        })?)
    }

    /// Starts copying `block_ids` of cache group `group` into the pool under `keys`. For a CUDA
    /// layout, `stream` (`torch.cuda.current_stream().cuda_stream`) orders the copies after the
    /// work already queued on that stream. `admit_now` keeps each block on its key's first
    /// sighting even under `store_admission="on_reuse"` (counted in `admissions_forced`).
    #[pyo3(signature = (layout_id, group, block_ids, keys, *, stream=None, admit_now=false))]
    #[allow(clippy::too_many_arguments)]
    fn store(
        &self,
        py: Python<'_>,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
        stream: Option<u64>,
        admit_now: bool,
    ) -> Result<Transfer> {
        let admit = if admit_now { Admit::Now } else { Admit::Policy };
        self.start(
            py,
            Direction::Store,
            (layout_id, group),
            block_ids,
            keys,
            (stream, admit),
        )
    }

    /// Starts copying `keys` from the pool into `block_ids` of cache group `group`. For a CUDA
    /// layout, `stream` makes the copies wait for the work already queued on that stream; the
    /// job finishes once the bytes are in place.
    #[pyo3(signature = (layout_id, group, block_ids, keys, *, stream=None))]
    fn load(
        &self,
        py: Python<'_>,
        layout_id: u32,
        group: u32,
        block_ids: Vec<i64>,
        keys: &Keys,
        stream: Option<u64>,
    ) -> Result<Transfer> {
        self.start(
            py,
            Direction::Load,
            (layout_id, group),
            block_ids,
            keys,
            (stream, Admit::Policy),
        )
    }

    /// Drops `keys` from this store: the pool and the disk tier (a remote tier keeps its
    /// copies); returns how many were in the pool.
    fn evict(&self, py: Python<'_>, keys: &Keys) -> Result<u64> {
        let s = self.live()?;
        Ok(without_gil(py, || s.evict(&keys.keys))?)
    }

    /// Removes every object; returns how many.
    fn clear(&self, py: Python<'_>) -> Result<u64> {
        let s = self.live()?;
        Ok(without_gil(py, || s.clear())?)
    }

    /// For tests of the integrity checks only: flips the bits of `mask` in byte `offset`
    /// (modulo the object's length) of each key's object, in the pool (`tier="pool"`) or in
    /// the disk tier's segment file (`tier="disk"`); how many of the keys were there.
    #[pyo3(signature = (keys, offset=0, mask=1, *, tier="pool"))]
    fn _debug_corrupt(
        &self,
        py: Python<'_>,
        keys: &Keys,
        offset: u64,
        mask: u8,
        tier: &str,
    ) -> Result<u64> {
        let disk = match tier {
            "pool" => false,
            "disk" => true,
            other => {
                return Err(Error::Config(format!(
                    "tier {other:?}: choose \"pool\" or \"disk\""
                )))
            }
        };
        let s = self.live()?;
        without_gil(py, || {
            let mut n = 0;
            for k in &keys.keys {
                n += u64::from(s.debug_corrupt(k, offset, mask, disk)?);
            }
            Ok(n)
        })
    }

    /// The disk tier's counters (None without `disk_dir`).
    fn disk_stats<'py>(&self, py: Python<'py>) -> Result<Option<Bound<'py, PyDict>>> {
        let st = self.live()?;
        without_gil(py, || st.disk_stats())
            .map(|s| counters_dict(py, &s))
            .transpose()
    }

    /// Waits until every object evicted so far was written to the disk tier (or dropped), at
    /// most `timeout_ms`; whether it was (true without a disk tier).
    #[pyo3(signature = (timeout_ms=10000))]
    fn flush_disk(&self, py: Python<'_>, timeout_ms: u64) -> Result<bool> {
        let st = self.live()?;
        Ok(without_gil(py, || {
            st.flush_disk(Duration::from_millis(timeout_ms))
        }))
    }

    /// The remote tier's counters (None without `remote_url`).
    fn remote_stats<'py>(&self, py: Python<'py>) -> Result<Option<Bound<'py, PyDict>>> {
        let st = self.live()?;
        without_gil(py, || st.remote_stats())
            .map(|s| counters_dict(py, &s))
            .transpose()
    }

    /// Waits until every object stored so far went to the remote tier (or was dropped), at
    /// most `timeout_ms`; whether it did (true without a remote tier).
    #[pyo3(signature = (timeout_ms=10000))]
    fn flush_remote(&self, py: Python<'_>, timeout_ms: u64) -> Result<bool> {
        let st = self.live()?;
        Ok(without_gil(py, || {
            st.flush_remote(Duration::from_millis(timeout_ms))
        }))
    }

    fn stats<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyDict>> {
        let st = self.live()?;
        let s = without_gil(py, || st.stats())?;
        let d = PyDict::new(py);
        // Every pool counter by its model's name, then the settings.
        for (f, v) in s.counters.pairs() {
            d.set_item(f.name, v)?;
        }
        d.set_item("eviction_policy", s.eviction_policy.as_str())?;
        d.set_item("store_admission", s.store_admission.as_str())?;
        d.set_item("lookup_lease_ms", s.lookup_lease_ms)?;
        d.set_item("integrity", s.integrity.as_str())?;
        d.set_item("integrity_sample_every", s.integrity.verify_every())?;
        let p = &s.placement;
        d.set_item(
            "hugepages_requested",
            p.hugepages_requested.map(|h| h.to_string()),
        )?;
        d.set_item("hugepages_used", p.hugepages_used.map(|h| h.to_string()))?;
        d.set_item("hugepage_fallback", p.hugepage_fallback.clone())?;
        d.set_item("numa_node", p.numa_node)?;
        d.set_item("prefaulted", p.prefaulted)?;
        d.set_item("prefault_seconds", p.prefault_seconds)?;
        d.set_item(
            "backing",
            match p.backing {
                MemoryBacking::Anonymous => "anonymous",
                MemoryBacking::Memfd => "memfd",
            },
        )?;
        let disk = without_gil(py, || st.disk_stats());
        d.set_item("disk", disk.map(|s| counters_dict(py, &s)).transpose()?)?;
        Ok(d)
    }

    /// Stops the copy workers (after queued transfers) and the evictor. Idempotent.
    fn close(&self, py: Python<'_>) {
        // In a forked child the store's threads (and any lock they held) exist only in the
        // parent: closing there would join threads that are not there. Nothing to do.
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

    /// Registers CUDA device memory of device `device` (a CUDA tensor's `data_ptr()` and byte
    /// size). The first call loads the CUDA driver and starts registering the pool for DMA in
    /// the background; without CUDA it raises `CudaError`. The memory must stay allocated until
    /// `deregister_memory` returns or the store is closed.
    fn register_cuda_memory(
        &self,
        py: Python<'_>,
        addr: u64,
        length: u64,
        device: i32,
    ) -> Result<u64> {
        let s = self.live()?;
        // SAFETY: the Python-facing contract (documented above and in the stubs) is that the
        // caller keeps the memory allocated while it is registered.
        Ok(without_gil(py, || unsafe {
            s.register_cuda_memory(addr, length, device)
        })?)
    }

    /// The CUDA backend's counters and the pool's DMA registration as a dict, or None before
    /// any CUDA memory is registered.
    fn cuda_stats<'py>(&self, py: Python<'py>) -> Result<Option<Bound<'py, PyDict>>> {
        let st = self.live()?;
        let Some((s, p)) = without_gil(py, || st.cuda_status()) else {
            return Ok(None);
        };
        let d = PyDict::new(py);
        d.set_item("dma_bytes", s.dma_bytes)?;
        d.set_item("staged_bytes", s.staged_bytes)?;
        d.set_item("kernel_ns", s.kernel_ns)?;
        d.set_item("kernel_launches", s.kernel_launches)?;
        d.set_item("copies_2d", s.copies_2d)?;
        d.set_item("copies_3d", s.copies_3d)?;
        d.set_item("copies_1d", s.copies_1d)?;
        d.set_item("batch_calls", s.batch_calls)?;
        d.set_item("staging_device_bytes", s.staging_device_bytes)?;
        d.set_item("max_ctas", s.max_ctas)?;
        d.set_item("sm_count", s.sm_count)?;
        d.set_item("auto_switches", s.auto_switches)?;
        d.set_item("small_pieces_by_dma", s.small_pieces_by_dma.to_vec())?;
        d.set_item("pool_registered_bytes", p.registered_bytes)?;
        d.set_item("pool_bytes", p.total_bytes)?;
        d.set_item("pool_registration_done", p.done)?;
        d.set_item("pool_registration_seconds", p.seconds)?;
        d.set_item("pool_registration_error", p.error)?;
        Ok(Some(d))
    }

    /// Waits (GIL released) up to `timeout_ms` for the pool's DMA registration; False when it
    /// has not finished or no CUDA memory is registered.
    fn wait_pool_registered(&self, py: Python<'_>, timeout_ms: u64) -> Result<bool> {
        let s = self.live()?;
        Ok(without_gil(py, || {
            s.wait_pool_registered(Duration::from_millis(timeout_ms))
        }))
    }
}

impl EmbeddedStore {
    /// The store, or `StoreClosedError` in a forked child.
    pub(crate) fn live(&self) -> Result<&Arc<CoreStore>> {
        self.inner.live("store")
    }

    /// Starts a store or a load (the shared body of `store` and `load`): checking the block
    /// ids, the layout and the ranges and queueing the job happen without the GIL.
    fn start(
        &self,
        py: Python<'_>,
        direction: Direction,
        (layout_id, group): (u32, u32),
        block_ids: Vec<i64>,
        keys: &Keys,
        (stream, admit): (Option<u64>, Admit),
    ) -> Result<Transfer> {
        let handle = without_gil(py, || -> Result<JobHandle> {
            let ids = to_u64s(block_ids, "block ids")?;
            let s = self.live()?;
            let keys = keys.keys.clone();
            // SAFETY: `stream` is the caller's CUDA stream of the layout's device, as the Python
            // API documents (`torch.cuda.current_stream().cuda_stream`), like the addresses of
            // `register_cuda_memory`; Python cannot check a raw handle.
            Ok(unsafe {
                match direction {
                    Direction::Store => s.store_as_on(layout_id, group, &ids, keys, stream, admit),
                    Direction::Load => s.load_on(layout_id, group, &ids, keys, stream),
                }
            }?)
        })?;
        Ok(Transfer::embedded(handle, self.live()?.timeout()))
    }
}

/// A layout's per-group summaries as the dicts `layout_summary` returns (embedded store and
/// standalone client alike).
pub(crate) fn summary_dicts<'py>(
    py: Python<'py>,
    summaries: &[LayoutSummary],
) -> Result<Vec<Bound<'py, PyDict>>> {
    summaries
        .iter()
        .map(|s| {
            let d = PyDict::new(py);
            d.set_item("runs", s.runs)?;
            d.set_item("ranges_per_block", s.ranges_per_block)?;
            d.set_item("min_piece", s.min_piece)?;
            d.set_item("max_piece", s.max_piece)?;
            d.set_item("object_bytes", s.object_bytes)?;
            Ok(d)
        })
        .collect()
}

/// A group of counters as a dict, every field of its model by name (a flag as a bool): the
/// remote tier's (embedded `remote_stats()`, standalone `stats()["remote"]`), the disk tier's
/// (`disk_stats()`, `stats()["disk"]`).
pub(crate) fn counters_dict<'py, S: CounterSet>(
    py: Python<'py>,
    s: &S,
) -> Result<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (f, v) in s.pairs() {
        match f.kind {
            CounterKind::Flag => d.set_item(f.name, v != 0)?,
            CounterKind::Counter | CounterKind::Gauge => d.set_item(f.name, v)?,
        }
    }
    Ok(d)
}

/// The weight of a lookup for [`bulk`]: with a remote tier it may wait on the network (and the
/// tier's threads log through Python), so it always runs without the GIL.
fn lookup_weight(s: &CoreStore, keys: &Keys) -> usize {
    if s.has_remote() {
        usize::MAX
    } else {
        keys.keys.len()
    }
}
