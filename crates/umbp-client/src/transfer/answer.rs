//! A transfer's answer: each key's [`KeyStatus`], the reply decoded into them, where the
//! answer lands for its waiters ([`Slot`]) and where the time went ([`TransferTiming`]).
//! Written by the transfer's task, the transfer channel's reader or the caller; none of it
//! knows the client.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use umbp_core::{ErrorKind, FailureKind, KeyOutcome};
use umbp_proto::v1;

use crate::error::{ClientError, Result};

/// What happened to one key of a transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyStatus {
    /// Stored, or loaded.
    Done,
    /// Store skipped: the key was already in the pool.
    AlreadyPresent,
    /// Load failed: not in the pool.
    Missing,
    /// Store failed: no room even after eviction.
    PoolFull,
    /// Cancelled before it ran.
    Cancelled,
    /// Not done within the transfer's deadline (cancelled by the server).
    TimedOut,
    /// Failed, for the reason named, with the server's message.
    Failed {
        /// Why, in the vocabulary the embedded store uses too.
        kind: FailureKind,
        /// The server's message.
        message: String,
    },
}

impl KeyStatus {
    /// The key's outcome in the vocabulary shared with the embedded store.
    pub fn outcome(&self) -> KeyOutcome {
        match self {
            KeyStatus::Done => KeyOutcome::Done,
            KeyStatus::AlreadyPresent => KeyOutcome::AlreadyPresent,
            KeyStatus::Missing => KeyOutcome::Missing,
            KeyStatus::PoolFull => KeyOutcome::PoolFull,
            KeyStatus::Cancelled => KeyOutcome::Cancelled,
            KeyStatus::TimedOut => KeyOutcome::TimedOut,
            KeyStatus::Failed { kind, .. } => KeyOutcome::Failed(*kind),
        }
    }

    /// Whether the key's transfer succeeded (a store of a present key counts).
    pub fn is_ok(&self) -> bool {
        self.outcome().is_ok()
    }

    /// The status's name: done, already_present, missing, pool_full, cancelled, timed_out,
    /// failed.
    pub fn name(&self) -> &'static str {
        self.outcome().name()
    }
}

pub(crate) fn decode_reply(r: v1::TransferReply, n: usize) -> Result<Vec<KeyStatus>> {
    use v1::KeyStatus as S;
    let malformed = |message: String| ClientError::Refused {
        call: "transfer",
        kind: ErrorKind::Internal,
        message,
    };
    if r.statuses.len() != n {
        return Err(malformed(format!(
            "the server answered {} statuses for {n} keys",
            r.statuses.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for &b in &r.statuses {
        out.push(match S::try_from(b as i32) {
            Ok(S::Done) => KeyStatus::Done,
            Ok(S::AlreadyPresent) => KeyStatus::AlreadyPresent,
            Ok(S::Missing) => KeyStatus::Missing,
            Ok(S::PoolFull) => KeyStatus::PoolFull,
            Ok(S::Cancelled) => KeyStatus::Cancelled,
            Ok(S::TimedOut) => KeyStatus::TimedOut,
            // Its kind and message come in `errors`.
            Ok(S::Failed) => KeyStatus::Failed {
                kind: FailureKind::Device,
                message: String::new(),
            },
            _ => return Err(malformed(format!("the server answered key status {b}"))),
        });
    }
    for e in r.errors {
        let kind = FailureKind::from_name(&e.kind).ok_or_else(|| {
            malformed(format!(
                "the server named key failure {:?}, which this client does not know",
                e.kind
            ))
        })?;
        if let Some(s) = out.get_mut(e.index as usize) {
            *s = KeyStatus::Failed {
                kind,
                message: e.message,
            };
        }
    }
    Ok(out)
}

/// A transfer's answer as every waiter reads it: the statuses, or the error's kind and
/// message (the typed error goes to the first waiter).
pub(crate) type Answer = std::result::Result<Vec<KeyStatus>, (ErrorKind, String)>;

/// Where a transfer's answer lands.
#[derive(Debug, Default)]
pub(crate) struct Slot {
    pub(crate) value: Mutex<Option<Answer>>,
    /// Set before the value, when the server answered.
    pub(crate) timing: Mutex<Option<TransferTiming>>,
    pub(crate) ready: Condvar,
    /// Set with the value: the error, kept typed for the first waiter.
    pub(crate) error: Mutex<Option<ClientError>>,
    /// Set by whoever clears the transfer's stall mark (its reply, or its completion page,
    /// whichever comes first), so it is cleared once.
    pub(crate) stall_cleared: AtomicBool,
}

impl Slot {
    pub(crate) fn fill(&self, r: Result<Vec<KeyStatus>>) {
        let mut v = self.value.lock();
        *v = Some(match r {
            Ok(s) => Ok(s),
            Err(e) => {
                let first = (e.kind(), e.to_string());
                *self.error.lock() = Some(e);
                Err(first)
            }
        });
        self.ready.notify_all();
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
