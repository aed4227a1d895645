//! What shapes an embedded store.

use std::time::Duration;

use umbp_core::{options, CoreError, PoolConfig};
use umbp_cuda::{CudaError, CudaOptions};
use umbp_remote::{RemoteConfig, RemoteError};

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

impl StoreConfig {
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
