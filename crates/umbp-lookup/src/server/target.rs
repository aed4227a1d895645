//! What a lookup server serves and what it allows: the [`LookupTarget`] a worker's store
//! implements and the per-connection [`ServerLimits`].

use std::time::Duration;

use crate::protocol;

/// What a lookup server answers from (the worker's store).
pub trait LookupTarget: Send + Sync + 'static {
    /// How many of the blocks, from the first, this worker holds.
    fn prefix_hits(&self, group: u32, packed_hashes: &[u8], hash_len: usize)
        -> Result<u32, String>;
    /// Which blocks this worker holds.
    fn exists(
        &self,
        group: u32,
        packed_hashes: &[u8],
        hash_len: usize,
    ) -> Result<Vec<bool>, String>;
    /// Which blocks this worker's pool holds now, taking no lease and reading no lower tier
    /// (what the connector's `BlockRemoved` events watch; a load never follows it).
    fn holds(&self, group: u32, packed_hashes: &[u8], hash_len: usize)
        -> Result<Vec<bool>, String>;
    /// Removes every object; returns how many.
    fn clear(&self) -> u64;
    /// A short description of the worker (for `Ping`).
    fn describe(&self) -> String;
}

/// What one connection may cost a lookup server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerLimits {
    /// Connections served at once; at the limit the longest-idle one is closed for a new one.
    pub max_connections: usize,
    /// Most hashes in one request (larger requests get an error that names the limit).
    pub max_keys: usize,
    /// A connection with no request for this long is closed (clients reconnect).
    pub idle_timeout: Duration,
    /// A connection halfway through a request, or with a reply it does not read, that makes
    /// no progress for this long is closed.
    pub io_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_connections: 4096,
            max_keys: protocol::MAX_KEYS,
            idle_timeout: Duration::from_secs(300),
            io_timeout: Duration::from_secs(10),
        }
    }
}
