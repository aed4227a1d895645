//! [`Session`] as a [`KvStore`]: the embedded side of the surface both modes share.

use umbp_copy::JobHandle;
use umbp_core::{BlockKey, ErrorKind, KvLayout};
use umbp_core::{KvError, KvStore};

use crate::{Session, StoreError};

impl KvError for StoreError {
    fn error_kind(&self) -> ErrorKind {
        self.kind()
    }
}

impl KvStore for Session {
    type Error = StoreError;
    type Transfer = JobHandle;

    unsafe fn register_host_memory(&self, addr: u64, len: u64) -> Result<u64, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { self.register_memory(addr, len) }
    }

    unsafe fn register_cuda_memory(
        &self,
        addr: u64,
        len: u64,
        device: i32,
    ) -> Result<u64, StoreError> {
        // SAFETY: forwarded contract.
        unsafe { Session::register_cuda_memory(self, addr, len, device) }
    }

    fn deregister_memory(&self, region: u64) -> Result<(), StoreError> {
        Session::deregister_memory(self, region)
    }

    fn register_layout(&self, layout: KvLayout) -> Result<u32, StoreError> {
        Session::register_layout(self, layout)
    }

    fn object_bytes(&self, layout: u32, group: u32) -> Result<u64, StoreError> {
        Ok(self.layout(layout)?.group(group)?.object_bytes())
    }

    fn store(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<JobHandle, StoreError> {
        Session::store(self, layout, group, block_ids, keys.to_vec())
    }

    fn load(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<JobHandle, StoreError> {
        Session::load(self, layout, group, block_ids, keys.to_vec())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use umbp_core::KvTransfer;
    use umbp_core::{GroupLayout, KeyBuilder, KeyOutcome, LayerSpec, PoolConfig, RankTopology};

    use super::*;
    use crate::{EmbeddedStore, StoreConfig};

    /// Stores blocks `0..n` of `s`'s layout over `buf` and loads them back into `n..2n`,
    /// written once against the trait.
    fn round_trip<S: KvStore>(s: &S, buf: &mut [u8], n: u64) -> Vec<KeyOutcome> {
        // SAFETY: `buf` outlives the registration (deregistered below).
        let region =
            unsafe { s.register_host_memory(buf.as_ptr() as u64, buf.len() as u64) }.unwrap();
        let block = buf.len() as u64 / (2 * n);
        let layout = s
            .register_layout(
                KvLayout::new(vec![GroupLayout::new(vec![LayerSpec {
                    base_addr: buf.as_ptr() as u64,
                    num_blocks: 2 * n,
                    block_stride: block,
                    block_bytes: block,
                }])
                .unwrap()])
                .unwrap(),
            )
            .unwrap();
        assert_eq!(s.object_bytes(layout, 0).unwrap(), block);
        let kb = KeyBuilder::new("kv-store-test", RankTopology::default()).unwrap();
        let keys: Vec<BlockKey> = (0..n)
            .map(|i| kb.key(0, &i.to_le_bytes()).unwrap())
            .collect();
        let src: Vec<u64> = (0..n).collect();
        let dst: Vec<u64> = (n..2 * n).collect();
        let wait = Duration::from_secs(5);
        let stored = s.store(layout, 0, &src, &keys).unwrap();
        assert!(stored.wait(wait).unwrap().iter().all(KeyOutcome::is_ok));
        assert!(stored.is_done() && stored.elapsed().is_some());
        let loaded = s.load(layout, 0, &dst, &keys).unwrap().wait(wait).unwrap();
        s.deregister_memory(region).unwrap();
        loaded
    }

    #[test]
    fn a_session_moves_blocks_through_the_trait() {
        let store = EmbeddedStore::new(StoreConfig {
            pool: PoolConfig {
                prefault: false,
                ..PoolConfig::with_capacity(4 << 20)
            },
            num_workers: 1,
            ..StoreConfig::default()
        })
        .unwrap();
        let session = store.open_session().unwrap();
        let mut buf = vec![0u8; 8 * 1024];
        buf[..4096].fill(7);
        assert_eq!(round_trip(&session, &mut buf, 4), vec![KeyOutcome::Done; 4]);
        assert!(buf[4096..].iter().all(|b| *b == 7));
    }
}
