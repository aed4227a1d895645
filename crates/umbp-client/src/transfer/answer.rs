//! A transfer's answer: each key's [`KeyOutcome`], the reply decoded into them, where the
//! answer lands for its waiters ([`Slot`]) and where the time went ([`TransferTiming`]).
//! Written by the transfer's task, the transfer channel's reader or the caller; none of it
//! knows the client.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use umbp_core::{ErrorKind, KeyOutcome};
use umbp_proto::v1;

use crate::error::{ClientError, Result};

/// The outcomes of a transfer of `n` keys from the server's reply.
pub(crate) fn decode_reply(r: v1::TransferReply, n: usize) -> Result<Vec<KeyOutcome>> {
    umbp_proto::outcomes::decode(&r.statuses, r.errors, n).map_err(|message| ClientError::Refused {
        call: "transfer",
        kind: ErrorKind::Internal,
        message,
    })
}

/// A transfer's answer as every waiter reads it: the outcomes, or the kind and message of the
/// error that failed the transfer as a whole (then every key failed).
pub(crate) type Answer = std::result::Result<Vec<KeyOutcome>, (ErrorKind, String)>;

/// Where a transfer's answer lands.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) value: Mutex<Option<Answer>>,
    /// Set before the value, when the server answered.
    pub(crate) timing: Mutex<Option<TransferTiming>>,
    pub(crate) ready: Condvar,
    /// Set by whoever clears the transfer's stall mark (its reply, or its completion page,
    /// whichever comes first), so it is cleared once.
    pub(crate) stall_cleared: AtomicBool,
}

impl Slot {
    pub(crate) fn fill(&self, r: Result<Vec<KeyOutcome>>) {
        let mut v = self.value.lock();
        *v = Some(r.map_err(|e| (e.kind(), e.to_string())));
        self.ready.notify_all();
    }

    /// A slot answered at once: the transfer failed as a whole with `e`.
    pub(crate) fn failed(e: &ClientError) -> Slot {
        let s = Slot::default();
        *s.value.lock() = Some(Err((e.kind(), e.to_string())));
        s
    }
}

/// Where an answered transfer's time went ([`Transfer::timing`]).
///
/// [`Transfer::timing`]: crate::Transfer::timing
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferTiming {
    /// From handing the request to the client's runtime to receiving the answer (the reply,
    /// or the completion page's wake-up).
    pub round_trip: Duration,
    /// In the server, from receiving the request to sending the reply (to the job's end when
    /// the completion page answered).
    pub server: Duration,
    /// In the server, the copy job alone (submission to its last key).
    pub copy: Duration,
    /// Whether the completion page answered: the server set the transfer's slot to "every
    /// key done" from its copy worker (a waiting caller is woken there, without the reply).
    /// Then `round_trip` runs to when this client first saw the slot set, and `server` to the
    /// job's end rather than to the reply.
    pub completion_page: bool,
    /// With the completion page, from the call to the server receiving the request (the
    /// encoding, the write and the server thread's wake-up), read off the host's monotonic
    /// clock on both ends. None when the reply answered, or from a server that does not write
    /// the clock readings.
    pub to_server: Option<Duration>,
    /// With the completion page, from the server publishing the slot to this client seeing
    /// it (None as for `to_server`).
    pub to_caller: Option<Duration>,
}
