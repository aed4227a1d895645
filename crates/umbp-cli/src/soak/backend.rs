//! Where one soak worker moves its blocks: a standalone server (through its own client) or an
//! embedded store (through its own session), with stores, loads and lookups answering alike,
//! and failures sorted into "the server was restarting" and the rest.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use umbp_client::{ClientOptions, StandaloneClient};
use umbp_core::{BlockKey, ErrorKind, GroupLayout, KeyOutcome, KvLayout, PoolConfig};
use umbp_core::{KvStore, KvTransfer};
use umbp_proto::Endpoint;
use umbp_store::{DiskConfig, EmbeddedStore, Session, StoreConfig};

use super::content::Region;

/// How long one transfer or lookup of the soak may take before it counts as failed.
pub(crate) const WAIT: Duration = Duration::from_secs(60);

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fail {
    /// The server was gone, restarting or shutting down (expected around restarts).
    Restart(String),
    /// Anything else.
    Other(String),
}

/// Sorts a failure by its kind: the kinds a restart gives (the server gone, refusing new work
/// while it stops, the session lost) against the rest.
pub(crate) fn classify(kind: ErrorKind, message: impl Into<String>) -> Fail {
    match kind {
        ErrorKind::SessionLost | ErrorKind::Unavailable | ErrorKind::Closed => {
            Fail::Restart(message.into())
        }
        _ => Fail::Other(format!("{kind}: {}", message.into())),
    }
}

/// One worker's connection to the pool.
#[derive(Debug)]
pub(crate) enum Backend {
    Server {
        client: StandaloneClient,
        layout: u32,
    },
    Embedded {
        /// Declared before the store: released first.
        session: Session,
        store: Arc<EmbeddedStore>,
        layout: u32,
    },
}

/// Settings of an embedded store of the soak.
#[derive(Debug, Clone)]
pub(crate) struct EmbeddedSpec {
    pub(crate) disk_dir: std::path::PathBuf,
    pub(crate) pool_bytes: u64,
    pub(crate) disk_bytes: u64,
    pub(crate) copy_workers: usize,
}

/// Opens the embedded store (a restart opens it again on the same disk directory).
pub(crate) fn open_store(s: &EmbeddedSpec) -> Result<Arc<EmbeddedStore>> {
    let mut disk = DiskConfig::new(&s.disk_dir, s.disk_bytes);
    disk.io_threads = 2;
    let store = EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: true,
            ..PoolConfig::with_capacity(s.pool_bytes)
        },
        num_workers: s.copy_workers,
        disk: Some(disk),
        ..StoreConfig::default()
    })
    .with_context(|| format!("cannot open the embedded store on {}", s.disk_dir.display()))?;
    Ok(Arc::new(store))
}

impl Backend {
    /// Attaches to the server at `endpoint` and registers `region` (moving its memfd there)
    /// and its layout.
    pub(crate) fn connect(endpoint: &str, name: String, region: &mut Region) -> Result<Self> {
        let mut opts = ClientOptions::new(Endpoint::parse(endpoint)?);
        opts.client_name = name;
        opts.transfer_timeout = WAIT;
        opts.lookup_timeout = WAIT;
        let client = StandaloneClient::connect(opts)?;
        let shm = region
            .buf
            .fd
            .take()
            .context("the region's memory was registered already")?;
        client.register_shared_host(shm)?;
        let layout = client.register_layout(vec![region.layer_specs()])?.id;
        Ok(Backend::Server { client, layout })
    }

    /// A session of `store` with `region` and its layout registered.
    pub(crate) fn open(store: &Arc<EmbeddedStore>, region: &Region) -> Result<Self> {
        let session = store.open_session()?;
        // SAFETY: the region outlives the session: a worker drops its backend before its
        // region (field order), and a restart drops the backends before anything else.
        unsafe { session.register_memory(region.buf.addr, region.buf.len) }?;
        let layout = session.register_layout(KvLayout::new(vec![GroupLayout::new(
            region.layer_specs(),
        )?])?)?;
        Ok(Backend::Embedded {
            session,
            store: Arc::clone(store),
            layout,
        })
    }

    /// Stores (`store`) slots `slots` under `keys`, or loads `keys` into them, and waits for
    /// the per-key outcomes.
    pub(crate) fn transfer(
        &self,
        store: bool,
        slots: &[u64],
        keys: &[BlockKey],
    ) -> Result<Vec<KeyOutcome>, Fail> {
        match self {
            Backend::Server { client, layout } => {
                let t = if store {
                    client.store(*layout, 0, slots, keys)
                } else {
                    client.load(*layout, 0, slots, keys)
                }
                .map_err(|e| classify(e.kind(), e.to_string()))?;
                let outcomes =
                    KvTransfer::wait(&t, WAIT).map_err(|e| classify(e.kind(), e.to_string()))?;
                match t.failure() {
                    Some((kind, message)) => Err(classify(kind, message)),
                    None => Ok(outcomes),
                }
            }
            Backend::Embedded {
                session, layout, ..
            } => {
                let job = if store {
                    KvStore::store(session, *layout, 0, slots, keys)
                } else {
                    KvStore::load(session, *layout, 0, slots, keys)
                }
                .map_err(|e| classify(e.kind(), e.to_string()))?;
                KvTransfer::wait(&job, WAIT).map_err(|e| classify(e.kind(), e.to_string()))
            }
        }
    }

    /// Which of `keys` the pool holds (the disk tier's promoted into it first).
    pub(crate) fn exists(&self, keys: &[BlockKey]) -> Result<Vec<bool>, Fail> {
        match self {
            Backend::Server { client, .. } => client
                .exists(keys)
                .map_err(|e| classify(e.kind(), e.to_string())),
            Backend::Embedded { store, .. } => store
                .exists(keys)
                .map_err(|e| classify(e.kind(), e.to_string())),
        }
    }

    /// How many of `keys`, from the first, the pool holds.
    pub(crate) fn prefix_hits(&self, keys: &[BlockKey]) -> Result<usize, Fail> {
        match self {
            Backend::Server { client, .. } => client
                .prefix_hits(keys)
                .map_err(|e| classify(e.kind(), e.to_string())),
            Backend::Embedded { store, .. } => store
                .prefix_hits(keys)
                .map_err(|e| classify(e.kind(), e.to_string())),
        }
    }

    /// Detaches (server) or releases the session (embedded).
    pub(crate) fn close(self) {
        match self {
            Backend::Server { client, .. } => client.close(),
            Backend::Embedded { session, .. } => {
                let _ = session.release();
            }
        }
    }
}
