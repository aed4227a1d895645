//! [`StandaloneClient`] as a [`KvStore`]: the standalone side of the surface both modes
//! share (the embedded store's session is the other).

use std::time::Duration;

use umbp_core::{BlockKey, ErrorKind, KeyOutcome, KvLayout};
use umbp_core::{KvError, KvStore, KvTransfer};

use crate::error::{ClientError, Result};
use crate::{StandaloneClient, Transfer};

impl KvError for ClientError {
    fn error_kind(&self) -> ErrorKind {
        self.kind()
    }
}

impl KvTransfer for Transfer {
    type Error = ClientError;

    fn poll(&self) -> Option<Vec<KeyOutcome>> {
        Transfer::poll(self)
    }

    fn is_done(&self) -> bool {
        Transfer::is_done(self)
    }

    fn wait(&self, timeout: Duration) -> Result<Vec<KeyOutcome>> {
        Transfer::wait(self, Some(timeout))
    }

    fn cancel(&self) -> Result<()> {
        Transfer::cancel(self)
    }

    fn elapsed(&self) -> Option<Duration> {
        Transfer::elapsed(self)
    }
}

impl KvStore for StandaloneClient {
    type Error = ClientError;
    type Transfer = Transfer;

    unsafe fn register_host_memory(&self, addr: u64, len: u64) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { StandaloneClient::register_host_memory(self, addr, len) }
    }

    /// The device is the one that owns the memory, which the client finds itself.
    unsafe fn register_cuda_memory(&self, addr: u64, len: u64, _device: i32) -> Result<u64> {
        // SAFETY: forwarded contract.
        unsafe { StandaloneClient::register_cuda_memory(self, addr, len) }
    }

    fn deregister_memory(&self, region: u64) -> Result<()> {
        StandaloneClient::deregister_memory(self, region)
    }

    fn register_layout(&self, layout: KvLayout) -> Result<u32> {
        let groups = layout
            .groups()
            .iter()
            .map(|g| g.layers().to_vec())
            .collect();
        Ok(StandaloneClient::register_layout(self, groups)?.id)
    }

    fn object_bytes(&self, layout: u32, group: u32) -> Result<u64> {
        StandaloneClient::object_bytes(self, layout, group)
    }

    fn store(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        StandaloneClient::store(self, layout, group, block_ids, keys)
    }

    fn load(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        StandaloneClient::load(self, layout, group, block_ids, keys)
    }
}
