//! The client's attachment to the server as state: the current session ([`Attachment`]),
//! numbered by generation, and the rules for attaching, forgetting and re-attaching
//! ([`AttachState`]). The calls to the server are passed in, so that the rules are tested
//! without one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use umbp_proto::SECRET_BYTES;

use crate::channel::TransferChannel;
use crate::error::Result;

/// The server's session of this client.
#[derive(Debug, Clone)]
pub(crate) struct Attachment {
    /// Counts attaches of this client: server ids are valid in one generation only.
    pub(crate) generation: u64,
    pub(crate) session_id: u64,
    pub(crate) boot_id: String,
    pub(crate) secret: [u8; SECRET_BYTES],
    pub(crate) fd_socket: PathBuf,
    /// Slots of the completion page this session accepted (0: none; replies only).
    pub(crate) completion_slots: u32,
    /// The session's transfer channel, when the server opened one.
    pub(crate) channel: Option<Arc<TransferChannel>>,
}

/// A session the server opened for this client (its answer to an attach), not yet numbered
/// or set up.
#[derive(Debug)]
pub(crate) struct NewSession {
    pub(crate) session_id: u64,
    pub(crate) boot_id: String,
    pub(crate) secret: [u8; SECRET_BYTES],
    pub(crate) fd_socket: PathBuf,
}

/// Which session the client is attached in, if any, and how many it has had.
///
/// Detached (no current attachment) at first and whenever a call found the session gone;
/// the next call attaches again. An attachment is current only once it is set up (everything
/// registered again): one whose set-up failed is dropped, and the client stays detached.
#[derive(Debug, Default)]
pub(crate) struct AttachState {
    current: RwLock<Option<Attachment>>,
    /// Held while attaching (one attach at a time).
    attaching: Mutex<()>,
    /// The last generation handed out.
    generation: AtomicU64,
    /// Sessions the server opened for this client.
    attaches: AtomicU64,
}

impl AttachState {
    /// The current attachment (None when detached).
    pub(crate) fn current(&self) -> Option<Attachment> {
        self.current.read().clone()
    }

    /// The current attachment; when there is none, attaches, one caller at a time (the
    /// others wait and take its attachment): `attach` asks the server for a session, which
    /// gets the next generation, then `set_up` (told whether this client attached before)
    /// registers everything in it. The attachment is current once both succeeded; a failure
    /// of either is returned and leaves the client detached, for the next call to attach
    /// again.
    pub(crate) fn current_or_attach(
        &self,
        attach: impl FnOnce() -> Result<NewSession>,
        set_up: impl FnOnce(Attachment, bool) -> Result<Attachment>,
    ) -> Result<Attachment> {
        if let Some(a) = self.current() {
            return Ok(a);
        }
        let _one = self.attaching.lock();
        if let Some(a) = self.current() {
            return Ok(a);
        }
        let s = attach()?;
        let a = Attachment {
            generation: self.generation.fetch_add(1, Ordering::AcqRel) + 1,
            session_id: s.session_id,
            boot_id: s.boot_id,
            secret: s.secret,
            fd_socket: s.fd_socket,
            completion_slots: 0,
            channel: None,
        };
        let again = self.attaches.fetch_add(1, Ordering::Relaxed) > 0;
        let a = set_up(a, again)?;
        *self.current.write() = Some(a.clone());
        Ok(a)
    }

    /// Forgets the current attachment (any, or only generation `only`: a failure seen in an
    /// earlier session must not drop a newer one) and closes its transfer channel; whether
    /// one was forgotten. The lock is not held while closing.
    pub(crate) fn forget(&self, only: Option<u64>) -> bool {
        let gone = {
            let mut a = self.current.write();
            match (&*a, only) {
                (Some(cur), Some(g)) if cur.generation != g => None,
                _ => a.take(),
            }
        };
        let had = gone.is_some();
        if let Some(ch) = gone.and_then(|a| a.channel) {
            ch.close();
        }
        had
    }

    /// Takes the current attachment away, leaving the client detached (its channel is the
    /// caller's to close).
    pub(crate) fn take(&self) -> Option<Attachment> {
        self.current.write().take()
    }

    /// As [`take`](Self::take), for the client's last owner (no lock taken).
    pub(crate) fn take_mut(&mut self) -> Option<Attachment> {
        self.current.get_mut().take()
    }

    /// The session id and boot id of the current attachment (None when detached).
    pub(crate) fn session(&self) -> Option<(u64, String)> {
        self.current
            .read()
            .as_ref()
            .map(|a| (a.session_id, a.boot_id.clone()))
    }

    /// How many sessions the server opened for this client (1 + re-attaches).
    pub(crate) fn attach_count(&self) -> u64 {
        self.attaches.load(Ordering::Relaxed)
    }
}
