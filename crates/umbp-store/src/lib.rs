//! The embedded store: what one engine worker owns in embedded mode.
//!
//! [`EmbeddedStore`] ties a [`Pool`], the [`MemoryRegistry`] of the worker's KV cache, its
//! registered [`KvLayout`]s and a [`CopyEngine`] together. Callers pass block ids and keys in
//! bulk; range planning and copies happen here.
//!
//! Registrations, layouts and jobs belong to a [`Session`] (one client); dropping it releases
//! them. Embedded mode is one session, which the store owns and its calls go to. A session is
//! a [`umbp_core::KvStore`], as the standalone client is.

mod config;
mod disk;
mod error;
mod ids;
mod kv_store;
mod mapped;
mod remote;
mod session;
mod shared;
mod store;
mod tier;

pub use config::{disk_tier, remote_tier, StoreConfig, WorkerPlacement};
pub use error::StoreError;
pub use ids::{LayoutId, SessionId};
pub use remote::start_remote_tier;
pub use session::{RegionOffset, RelativeLayer, Session, SessionRelease};
pub use store::EmbeddedStore;
pub use tier::{PoolFill, Tier};
pub use umbp_copy::{JobFinished, JobSet, MoveError};
pub use umbp_cuda::{CopyMethod, CudaError, CudaOptions, CudaStats, PinStatus};
pub use umbp_disk::{DiskConfig, DiskError, DiskStats, DiskWrite};
pub use umbp_remote::{
    secret_file_from_env as remote_secret_file_from_env, RemoteConfig, RemoteError, RemoteStats,
    WritePolicy,
};
