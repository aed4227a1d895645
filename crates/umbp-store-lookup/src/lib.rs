//! The lookup service over an embedded store: [`StoreLookup`] answers one worker's
//! [`LookupServer`](umbp_lookup::LookupServer) from its [`EmbeddedStore`].
//!
//! It lives here, where the two meet, so that the store knows nothing of the service and the
//! service nothing of the store.

use std::sync::Arc;

use umbp_core::{BlockKey, KeyBuilder};
use umbp_lookup::LookupTarget;
use umbp_store::EmbeddedStore;

/// Answers the scheduler's lookups from one worker's store: keys are built here, with this
/// worker's ranks, from the block hashes the scheduler sends.
#[derive(Debug)]
pub struct StoreLookup {
    store: Arc<EmbeddedStore>,
    keys: KeyBuilder,
    describe: String,
}

impl StoreLookup {
    /// Serves `store`'s lookups for keys of `keys`' namespace and ranks.
    pub fn new(store: Arc<EmbeddedStore>, keys: KeyBuilder, describe: String) -> Self {
        StoreLookup {
            store,
            keys,
            describe,
        }
    }
}

impl StoreLookup {
    /// This worker's keys of the packed hashes, once the store is known to be open (a closed
    /// store holds nothing: its lookups fail, and the scheduler counts a miss).
    fn open_keys(
        &self,
        group: u32,
        packed: &[u8],
        hash_len: usize,
    ) -> Result<Vec<BlockKey>, String> {
        self.store.check_open().map_err(|e| e.to_string())?;
        self.keys
            .keys_packed(group, packed, hash_len)
            .map_err(|e| e.to_string())
    }
}

impl LookupTarget for StoreLookup {
    fn prefix_hits(&self, group: u32, packed: &[u8], hash_len: usize) -> Result<u32, String> {
        // A closed store holds nothing: its lookups fail (the scheduler counts a miss).
        self.store.check_open().map_err(|e| e.to_string())?;
        if hash_len == 0 || hash_len > 32 || !packed.len().is_multiple_of(hash_len) {
            return Err(format!(
                "{} bytes are not whole {hash_len}-byte hashes",
                packed.len()
            ));
        }
        let hashes: Vec<&[u8]> = packed.chunks_exact(hash_len).collect();
        let n = self
            .store
            .prefix_hits_with(hashes.len(), |i| {
                self.keys
                    .key(group, hashes[i])
                    .expect("hash length checked above")
            })
            .map_err(|e| e.to_string())?;
        Ok(n as u32)
    }

    fn exists(&self, group: u32, packed: &[u8], hash_len: usize) -> Result<Vec<bool>, String> {
        let keys = self.open_keys(group, packed, hash_len)?;
        self.store.exists(&keys).map_err(|e| e.to_string())
    }

    fn holds(&self, group: u32, packed: &[u8], hash_len: usize) -> Result<Vec<bool>, String> {
        let keys = self.open_keys(group, packed, hash_len)?;
        self.store.holds(&keys).map_err(|e| e.to_string())
    }

    /// The engine's reset: this worker's pool, and the engine's namespace in the remote tier
    /// (which would otherwise hand the objects back at the next lookup).
    fn clear(&self) -> u64 {
        // The remote first: a lookup between the two would fetch back what the pool lost.
        self.store.clear_remote_namespace(&self.keys.namespace_id());
        self.store.clear().unwrap_or(0)
    }

    fn describe(&self) -> String {
        let Ok(s) = self.store.stats() else {
            return format!("{} (store closed)", self.describe);
        };
        // `key=value` words after the text (`umbp stats --lookup-dir` reads them).
        let remote = match self.store.remote_stats() {
            None => "off".to_owned(),
            Some(r) if r.connected => format!("up remote_hits={}", r.hits),
            Some(r) => format!("down remote_hits={}", r.hits),
        };
        format!(
            "{} objects={} used_bytes={} capacity_bytes={} evictions={} hits={} misses={} \
             bytes_in={} bytes_out={} remote={remote}",
            self.describe,
            s.objects,
            s.used_bytes,
            s.capacity_bytes,
            s.evictions,
            s.hits,
            s.misses,
            s.bytes_in,
            s.bytes_out
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use umbp_core::{GroupLayout, KvLayout, LayerSpec, PoolConfig, RankTopology};
    use umbp_store::StoreConfig;

    fn store() -> EmbeddedStore {
        EmbeddedStore::new(StoreConfig {
            pool: PoolConfig {
                prefault: false,
                ..PoolConfig::with_capacity(4 << 20)
            },
            num_workers: 2,
            ..StoreConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn a_lookup_service_over_a_closed_store_answers_misses() {
        let s = Arc::new(store());
        let buf = vec![0u8; 4096];
        // SAFETY: `buf` outlives the store's use of it (the store is closed first).
        unsafe { s.register_memory(buf.as_ptr() as u64, 4096) }.unwrap();
        let layer = LayerSpec {
            base_addr: buf.as_ptr() as u64,
            num_blocks: 4,
            block_stride: 1024,
            block_bytes: 1024,
        };
        let lid = s
            .register_layout(KvLayout::new(vec![GroupLayout::new(vec![layer]).unwrap()]).unwrap())
            .unwrap();
        let kb = KeyBuilder::new("s", RankTopology::default()).unwrap();
        let keys = vec![kb.key(0, b"h").unwrap()];
        s.wait(&s.store(lid, 0, &[1], keys).unwrap()).unwrap();
        let dir = std::env::temp_dir().join(format!("umbp-store-closed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.sock");
        let target = Arc::new(StoreLookup::new(Arc::clone(&s), kb, String::new()));
        let server = umbp_lookup::LookupServer::bind(&path, target).unwrap();
        let client = umbp_lookup::LookupClient::new(vec![path], Duration::from_secs(2));
        assert_eq!(client.prefix_hits(0, b"h", 1), 1);
        assert_eq!(client.exists_all(0, b"h", 1), [true]);
        s.close();
        assert_eq!(
            client.prefix_hits(0, b"h", 1),
            0,
            "a closed store answered a hit"
        );
        assert_eq!(client.exists_all(0, b"h", 1), [false]);
        server.shutdown();
    }
}
