//! The client's completion page (see [`umbp_proto::completion`]): slots the server sets and
//! wakes the waiter on the moment a transfer's copy job finishes.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_proto::completion::{CompletionPage, SEQ_LIMIT, SLOT_BYTES};

use crate::host_share::shared_mapping;
use crate::ClientError;

/// Slots of a client's page: more than transfers in flight at once (a transfer that finds
/// none free is answered by its reply only).
pub(crate) const SLOTS: u32 = 1024;

/// The page, mapped in this process, and which of its slots are free.
#[derive(Debug)]
pub(crate) struct Completions {
    pub(crate) page: CompletionPage,
    /// The page's memfd (sent to every server the client attaches to).
    pub(crate) fd: OwnedFd,
    /// Free slots, oldest freed first (a slot just given up, whose job may still end late,
    /// is the last to be used again).
    free: Mutex<VecDeque<u32>>,
    next_seq: AtomicU32,
}

impl Completions {
    pub(crate) fn new() -> Result<Arc<Self>, ClientError> {
        let (fd, mapping) = shared_mapping(SLOTS as u64 * SLOT_BYTES)?;
        let page =
            CompletionPage::new(mapping).map_err(|e| ClientError::Internal(e.to_string()))?;
        Ok(Arc::new(Completions {
            page,
            fd,
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
