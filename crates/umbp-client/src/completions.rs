//! The client's completion page (see [`umbp_proto::completion`]): slots the server sets and
//! wakes the waiter on the moment a transfer's copy job finishes.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_proto::completion::{CompletionPage, SEQ_LIMIT, SLOT_BYTES};

use crate::host_share::{alloc_shared_host, SharedHostMemory};
use crate::ClientError;

/// Slots of a client's page: more than transfers in flight at once (a transfer that finds
/// none free is answered by its reply only).
pub(crate) const SLOTS: u32 = 1024;

/// The page, mapped in this process, and which of its slots are free.
#[derive(Debug)]
pub(crate) struct Completions {
    pub(crate) page: CompletionPage,
    /// The memfd and the mapping (sent to every server the client attaches to).
    pub(crate) shm: SharedHostMemory,
    /// Free slots, oldest freed first (a slot just given up, whose job may still end late,
    /// is the last to be used again).
    free: Mutex<VecDeque<u32>>,
    next_seq: AtomicU32,
}

impl Completions {
    pub(crate) fn new() -> Result<Arc<Self>, ClientError> {
        let shm = alloc_shared_host(SLOTS as u64 * SLOT_BYTES)?;
        // SAFETY: a fresh read-write MAP_SHARED mapping of a memfd sealed against shrinking,
        // 2 MiB aligned, unmapped only by `Drop` below, after the view (a field of the same
        // value) is no longer used.
        let page =
            unsafe { CompletionPage::new(shm.span_addr() as *mut u8, SLOTS as u64 * SLOT_BYTES) }
                .map_err(|e| ClientError::Internal(e.to_string()))?;
        Ok(Arc::new(Completions {
            page,
            shm,
            free: Mutex::new((0..SLOTS).collect()),
            next_seq: AtomicU32::new(1),
        }))
    }

    /// Bytes the server is asked to map.
    pub(crate) fn len(&self) -> u64 {
        SLOTS as u64 * SLOT_BYTES
    }

    /// A free slot below `limit` (the slots the current server accepted), armed for a new use.
    pub(crate) fn lease(self: &Arc<Self>, limit: u32) -> Option<Lease> {
        let slot = {
            let mut f = self.free.lock();
            let i = f.iter().position(|s| *s < limit)?;
            f.remove(i)?
        };
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed) % SEQ_LIMIT;
        self.page.arm(slot, seq);
        Some(Lease {
            owner: Arc::clone(self),
            slot,
            seq,
        })
    }
}

impl Drop for Completions {
    fn drop(&mut self) {
        // SAFETY: the mapping `alloc_shared_host` made, unmapped once; nothing in this process
        // holds a view of it any more (every lease holds this value, and it is being dropped).
        unsafe {
            libc::munmap(
                self.shm.span_addr() as *mut libc::c_void,
                self.shm.span_len() as usize,
            )
        };
    }
}

/// One transfer's slot. Held by the transfer and by the task that receives its reply; the
/// slot is free again when both are gone, so a waiter never sees the next use's word.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) owner: Arc<Completions>,
    pub(crate) slot: u32,
    pub(crate) seq: u32,
}

impl Lease {
    pub(crate) fn page(&self) -> &CompletionPage {
        &self.owner.page
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.owner.free.lock().push_back(self.slot);
    }
}
