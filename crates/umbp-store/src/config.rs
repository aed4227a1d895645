//! What shapes an embedded store.

use std::time::Duration;

use umbp_core::caching::{EvictionPolicy, StoreAdmission};
use umbp_core::{options, ConnectorOptions, CoreError, HugepageSize, Integrity, PoolConfig};
use umbp_cuda::{CudaError, CudaOptions};
use umbp_disk::{DiskConfig, DiskWrite};
use umbp_remote::{RemoteConfig, RemoteError, WritePolicy};

use crate::StoreError;

/// Everything that shapes an embedded store.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    /// The pool.
    pub pool: PoolConfig,
    /// Copy threads.
    pub num_workers: usize,
    /// Default deadline of a synchronous wait.
    pub timeout: Duration,
    /// The CUDA backend, used once CUDA memory is registered.
    pub cuda: CudaOptions,
    /// A remote tier behind the pool (off when `None`).
    pub remote: Option<RemoteConfig>,
    /// A disk tier under the pool (off when `None`).
    pub disk: Option<umbp_disk::DiskConfig>,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            pool: PoolConfig::default(),
            num_workers: options::NUM_WORKERS.default_u64() as usize,
            timeout: Duration::from_millis(options::TIMEOUT_MS.default_u64()),
            cuda: CudaOptions::default(),
            remote: None,
            disk: None,
        }
    }
}

/// A disk tier in `dir` from the options' values and units (bytes, MB/s, a policy name,
/// seconds); each None takes the option's default (`umbp_core::options`).
pub fn disk_tier(
    dir: std::path::PathBuf,
    capacity_bytes: Option<u64>,
    write_mb_per_s: Option<u64>,
    write: Option<&str>,
    close_write_s: Option<u64>,
) -> Result<DiskConfig, StoreError> {
    let mut d = DiskConfig::new(
        dir,
        capacity_bytes.unwrap_or(options::DISK_CAPACITY_BYTES.default_u64()),
    );
    d.write_bytes_per_s = write_mb_per_s
        .unwrap_or(options::DISK_WRITE_MB_PER_S.default_u64())
        .saturating_mul(1_000_000);
    d.write = write
        .unwrap_or(options::DISK_WRITE.default_str())
        .parse::<DiskWrite>()?;
    d.close_write =
        Duration::from_secs(close_write_s.unwrap_or(options::DISK_CLOSE_WRITE_S.default_u64()));
    Ok(d)
}

/// A remote tier at `url` from the options' values and units (seconds, a policy name, ms,
/// bytes, MB/s; a TTL of 0 is none); each None takes the option's default.
pub fn remote_tier(
    url: String,
    ttl_s: Option<u64>,
    write: Option<&str>,
    timeout_ms: Option<u64>,
    write_backlog: Option<u64>,
    write_mb_per_s: Option<u64>,
) -> Result<RemoteConfig, StoreError> {
    let r = RemoteConfig::new(url);
    Ok(RemoteConfig {
        ttl: match ttl_s {
            Some(s) => (s > 0).then(|| Duration::from_secs(s)),
            None => r.ttl,
        },
        write: match write {
            Some(w) => WritePolicy::parse(w)?,
            None => r.write,
        },
        timeout: timeout_ms.map_or(r.timeout, Duration::from_millis),
        write_backlog_bytes: write_backlog.unwrap_or(r.write_backlog_bytes),
        write_bytes_per_s: write_mb_per_s
            .map_or(r.write_bytes_per_s, |mb| mb.saturating_mul(1_000_000)),
        ..r
    })
}

/// What one worker of an engine adds to the connector's options to shape its store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerPlacement {
    /// This worker's pool: its share of the connector's capacity.
    pub capacity_bytes: u64,
    /// This worker's own directory under `disk_dir` (a name, not a path: workers never share
    /// segment files).
    pub disk_subdir: String,
    /// The worker writes nothing to the remote tier: an MLA rank whose blocks the first rank
    /// of its group writes (its `remote_write` is `never`).
    pub remote_read_only: bool,
}

impl StoreConfig {
    /// One worker's store, from the connector's validated options: the one place an option
    /// of `kv_connector_extra_config` becomes a setting of the embedded store.
    pub fn for_connector(
        opts: &ConnectorOptions,
        worker: &WorkerPlacement,
    ) -> Result<StoreConfig, StoreError> {
        let defaults = StoreConfig::default();
        let pool = PoolConfig {
            capacity_bytes: worker.capacity_bytes,
            high_watermark: opts.dram_high_watermark,
            low_watermark: opts.dram_low_watermark,
            use_hugepages: opts.dram_use_hugepages,
            hugepage_size: opts.dram_hugepage_size.parse::<HugepageSize>()?,
            numa_node: opts.dram_numa_node,
            prefault: opts.dram_prefault,
            eviction_policy: opts.eviction_policy.parse::<EvictionPolicy>()?,
            store_admission: opts.store_admission.parse::<StoreAdmission>()?,
            integrity: Integrity::from_options(&opts.integrity, opts.integrity_sample_every)?,
            ..defaults.pool
        };
        let disk = match &opts.disk_dir {
            None => None,
            Some(dir) => Some(disk_tier(
                std::path::absolute(dir)
                    .map_err(|e| CoreError::option("disk_dir", e.to_string()))?
                    .join(&worker.disk_subdir),
                Some(opts.disk_capacity_bytes),
                Some(opts.disk_write_mb_per_s),
                Some(&opts.disk_write),
                Some(opts.disk_close_write_s),
            )?),
        };
        let remote = match &opts.remote_url {
            None => None,
            Some(url) => Some(remote_tier(
                url.clone(),
                Some(opts.remote_ttl_s),
                Some(if worker.remote_read_only {
                    "never"
                } else {
                    &opts.remote_write
                }),
                Some(opts.remote_timeout_ms),
                Some(opts.remote_write_backlog),
                Some(opts.remote_write_mb_per_s),
            )?),
        };
        Ok(StoreConfig {
            pool,
            num_workers: opts.num_workers as usize,
            timeout: Duration::from_millis(opts.timeout_ms),
            cuda: CudaOptions {
                staging_bytes: opts.cuda_staging_bytes,
                ..defaults.cuda
            },
            remote,
            disk,
        })
    }

    /// Checks every option.
    pub fn validate(&self) -> Result<(), CoreError> {
        self.pool.validate()?;
        // The connector's ranges and messages (umbp_core::options).
        options::NUM_WORKERS.check_u64(self.num_workers as u64)?;
        // Below 1 ms but not zero counts as 1 ms: only a zero deadline is refused.
        let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
        options::TIMEOUT_MS.check_u64(ms.max(u64::from(!self.timeout.is_zero())))?;
        self.cuda.validate().map_err(|e| match e {
            CudaError::Option { name, reason } => CoreError::option(name, reason),
            other => CoreError::option("cuda", other.to_string()),
        })?;
        if let Some(r) = &self.remote {
            r.validate().map_err(|e| match e {
                RemoteError::Setting { name, why } => CoreError::option(name, why),
                RemoteError::Url { .. } => CoreError::option("remote_url", e.to_string()),
                other => CoreError::option("remote_url", other.to_string()),
            })?;
        }
        if let Some(d) = &self.disk {
            d.validate().map_err(|e| match e {
                umbp_disk::DiskError::Setting { name, why } => CoreError::option(name, why),
                other => CoreError::option("disk_dir", other.to_string()),
            })?;
        }
        Ok(())
    }
}
