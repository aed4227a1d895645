//! The one vocabulary of failures and per-key outcomes, shared by every crate and both modes.
//!
//! * [`ErrorKind`]: what kind of problem an error is. Every crate's error answers `kind()`;
//!   the server sends the kind with every refusal (a detail of the gRPC status, a field of a
//!   transfer-channel reply, a word of a side-channel refusal), the client reads it back, and
//!   the bindings choose a Python exception class from it in one place. Decisions (is the
//!   session lost? should the client attach again?) read the kind, never a message's words.
//! * [`KeyOutcome`], [`KeyFailure`] and [`FailureKind`]: what happened to one key of a
//!   transfer, the one type the copy engine, the embedded store, the server, the client and the
//!   bindings all answer with.
//!
//! The numbers are wire values: never reuse one; add new kinds at the end.

/// What kind of problem an error is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// An argument, option, key or layout is invalid; the message says what to change.
    InvalidArgument = 1,
    /// Something named by id (a layout, a region, a descriptor ticket) is unknown.
    NotFound = 2,
    /// The pool has no room even after eviction.
    PoolFull = 3,
    /// A memory registration is malformed, unknown, overlapping, of another owner or still in
    /// use, or memory cannot be shared or exported.
    Registration = 4,
    /// The server no longer knows this client's session (it restarted or released it): attach
    /// again.
    SessionLost = 5,
    /// The server (or another service) cannot be reached, went away, or did not answer in
    /// time.
    Unavailable = 6,
    /// The store, client or server was closed (or is shutting down), or the object was made in
    /// another process.
    Closed = 7,
    /// A device failed in a way that lasts: nothing more can be copied with it until the
    /// process restarts.
    DeviceLost = 8,
    /// A device is missing or one device call failed.
    Device = 9,
    /// A wait ran past its deadline; the work it waited for still runs.
    Timeout = 10,
    /// A transfer failed as a whole (it did not stop after it was cancelled, or its job
    /// failed).
    TransferFailed = 11,
    /// The server refuses this client: another protocol version, or a user it does not serve.
    Denied = 12,
    /// The host could not provide memory or pages for the pool.
    Resource = 13,
    /// Anything else: a bug, or the host refusing a thread.
    Internal = 14,
}

impl ErrorKind {
    /// Every kind, in wire order.
    pub const ALL: [ErrorKind; 14] = [
        ErrorKind::InvalidArgument,
        ErrorKind::NotFound,
        ErrorKind::PoolFull,
        ErrorKind::Registration,
        ErrorKind::SessionLost,
        ErrorKind::Unavailable,
        ErrorKind::Closed,
        ErrorKind::DeviceLost,
        ErrorKind::Device,
        ErrorKind::Timeout,
        ErrorKind::TransferFailed,
        ErrorKind::Denied,
        ErrorKind::Resource,
        ErrorKind::Internal,
    ];

    /// The kind's name, as Python's `UmbpError.kind` and logs show it.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::NotFound => "not_found",
            ErrorKind::PoolFull => "pool_full",
            ErrorKind::Registration => "registration",
            ErrorKind::SessionLost => "session_lost",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Closed => "closed",
            ErrorKind::DeviceLost => "device_lost",
            ErrorKind::Device => "device",
            ErrorKind::Timeout => "timeout",
            ErrorKind::TransferFailed => "transfer_failed",
            ErrorKind::Denied => "denied",
            ErrorKind::Resource => "resource",
            ErrorKind::Internal => "internal",
        }
    }

    /// The kind's wire value (never 0: 0 means "no kind sent").
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The kind of wire value `code`; None for 0 and for values this build does not know.
    pub fn from_code(code: u32) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.code() == code)
    }

    /// Whether a later call may succeed once the client attaches again (the server restarted,
    /// went away, or forgot the session).
    pub fn is_disconnect(self) -> bool {
        matches!(self, ErrorKind::SessionLost | ErrorKind::Unavailable)
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why one key of a transfer failed (the outcome [`KeyOutcome::Failed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// A range of the key's block is outside registered memory or mixes kinds of memory.
    InvalidRange,
    /// The stored object's size differs from what the layout expects.
    SizeMismatch,
    /// The pool refused for a reason other than being full.
    Pool,
    /// One device call failed; the device stays usable.
    Device,
    /// The device is unusable until the process restarts.
    DeviceLost,
    /// The mover cannot copy this block (memory of another device, too large a block).
    Unsupported,
    /// Standalone mode: the transfer failed as a whole, so every key did (the server went away
    /// before answering, refused the transfer, or could not take it); the message says why.
    Server,
    /// The stored object's bytes did not match its checksum (`integrity`): it was removed
    /// and nothing was copied; the engine recomputes the block.
    Corrupt,
}

impl FailureKind {
    /// Every failure kind.
    pub const ALL: [FailureKind; 8] = [
        FailureKind::InvalidRange,
        FailureKind::SizeMismatch,
        FailureKind::Pool,
        FailureKind::Device,
        FailureKind::DeviceLost,
        FailureKind::Unsupported,
        FailureKind::Server,
        FailureKind::Corrupt,
    ];

    /// The failure's name, on the wire and in Python (`Job.errors()`, `Transfer.errors()`).
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::InvalidRange => "invalid_range",
            FailureKind::SizeMismatch => "size_mismatch",
            FailureKind::Pool => "pool",
            FailureKind::Device => "device",
            FailureKind::DeviceLost => "device_lost",
            FailureKind::Unsupported => "unsupported",
            FailureKind::Server => "server",
            FailureKind::Corrupt => "corrupt",
        }
    }

    /// The failure of name `name`; None for a name this build does not know.
    pub fn from_name(name: &str) -> Option<FailureKind> {
        FailureKind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The error kind a call that failed this way as a whole would have.
    pub fn error_kind(self) -> ErrorKind {
        match self {
            FailureKind::InvalidRange | FailureKind::Unsupported => ErrorKind::InvalidArgument,
            FailureKind::SizeMismatch => ErrorKind::InvalidArgument,
            FailureKind::Pool => ErrorKind::Internal,
            FailureKind::Device => ErrorKind::Device,
            FailureKind::DeviceLost => ErrorKind::DeviceLost,
            FailureKind::Server | FailureKind::Corrupt => ErrorKind::TransferFailed,
        }
    }
}

impl std::fmt::Display for FailureKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why one key failed: its [`FailureKind`] and, in words, what happened (the message Python's
/// `failures()` and `errors()` give).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyFailure {
    /// Why, in one word.
    pub kind: FailureKind,
    /// Why, in words.
    pub message: String,
}

impl KeyFailure {
    /// A failure of kind `kind` saying `message`.
    pub fn new(kind: FailureKind, message: impl Into<String>) -> KeyFailure {
        KeyFailure {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for KeyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// What happened to one key of a transfer, in either mode.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyOutcome {
    /// Not finished yet.
    Pending,
    /// Stored, or loaded.
    Done,
    /// Store skipped: the key was already in the pool (or another writer committed it first).
    AlreadyPresent,
    /// Load failed: the key is not in the pool (never stored, or evicted).
    Missing,
    /// Store failed: no room even after eviction.
    PoolFull,
    /// Cancelled before it ran.
    Cancelled,
    /// Not done within the transfer's deadline (then cancelled).
    TimedOut,
    /// Failed, for the reason named.
    Failed(KeyFailure),
    /// Store not kept, by design rather than failure: the pool's store admission did not
    /// admit the key yet (`on_reuse`, first sighting), or (answered by the vLLM connector)
    /// another rank of the worker's replica group stores the block (MLA stored once).
    Skipped,
}

impl KeyOutcome {
    /// A failure of kind `kind` saying `message`.
    pub fn failed(kind: FailureKind, message: impl Into<String>) -> KeyOutcome {
        KeyOutcome::Failed(KeyFailure::new(kind, message))
    }

    /// The outcome's name, as Python's `poll()`/`wait()` return it.
    pub fn name(&self) -> &'static str {
        match self {
            KeyOutcome::Pending => "pending",
            KeyOutcome::Done => "done",
            KeyOutcome::AlreadyPresent => "already_present",
            KeyOutcome::Missing => "missing",
            KeyOutcome::PoolFull => "pool_full",
            KeyOutcome::Cancelled => "cancelled",
            KeyOutcome::TimedOut => "timed_out",
            KeyOutcome::Failed(_) => "failed",
            KeyOutcome::Skipped => "skipped",
        }
    }

    /// Whether the key's transfer succeeded (a store of a present key counts, and so does one
    /// the store admission skipped: nothing went wrong).
    pub fn is_ok(&self) -> bool {
        matches!(
            self,
            KeyOutcome::Done | KeyOutcome::AlreadyPresent | KeyOutcome::Skipped
        )
    }

    /// Why the key failed, when it did.
    pub fn failure(&self) -> Option<&KeyFailure> {
        match self {
            KeyOutcome::Failed(f) => Some(f),
            _ => None,
        }
    }
}

/// The failed keys of `outcomes`: `(index, failure)`, in key order.
pub fn failures(outcomes: &[KeyOutcome]) -> impl Iterator<Item = (usize, &KeyFailure)> {
    outcomes
        .iter()
        .enumerate()
        .filter_map(|(i, o)| o.failure().map(|f| (i, f)))
}

/// What pinning one block did (a pin keeps an object in the pool, out of every eviction, for a
/// while: the pool's keeps). The numbers are wire values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PinOutcome {
    /// No committed object has that key.
    Missing = 0,
    /// Pinned now (it was not).
    Pinned = 1,
    /// It was pinned already: its expiry is set anew.
    Renewed = 2,
    /// Pinning it would pass the bytes its namespace, or the pool, may pin (counted).
    Refused = 3,
}

impl PinOutcome {
    /// The wire value.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// From a wire value; an unknown one reads as [`PinOutcome::Missing`] (not pinned).
    pub fn from_code(code: u8) -> PinOutcome {
        match code {
            1 => PinOutcome::Pinned,
            2 => PinOutcome::Renewed,
            3 => PinOutcome::Refused,
            _ => PinOutcome::Missing,
        }
    }

    /// The word the bindings and the CLI show.
    pub fn name(self) -> &'static str {
        match self {
            PinOutcome::Missing => "missing",
            PinOutcome::Pinned => "pinned",
            PinOutcome::Renewed => "renewed",
            PinOutcome::Refused => "refused",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_values_round_trip_and_are_unique() {
        for (i, k) in ErrorKind::ALL.into_iter().enumerate() {
            assert_eq!(k.code(), i as u32 + 1, "{k} is out of wire order");
            assert_eq!(ErrorKind::from_code(k.code()), Some(k));
        }
        assert_eq!(ErrorKind::from_code(0), None);
        assert_eq!(ErrorKind::from_code(ErrorKind::ALL.len() as u32 + 1), None);
        let mut names: Vec<_> = ErrorKind::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorKind::ALL.len());
    }

    #[test]
    fn failure_names_round_trip() {
        for k in FailureKind::ALL {
            assert_eq!(FailureKind::from_name(k.name()), Some(k));
        }
        assert_eq!(FailureKind::from_name("move"), None);
        let lost = KeyOutcome::failed(FailureKind::DeviceLost, "gone");
        assert_eq!(lost.name(), "failed");
        assert_eq!(
            lost.failure().map(|f| f.kind),
            Some(FailureKind::DeviceLost)
        );
        let all = [KeyOutcome::Done, lost.clone(), KeyOutcome::Missing];
        let failed: Vec<_> = failures(&all).map(|(i, f)| (i, f.to_string())).collect();
        assert_eq!(failed, [(1, "gone".to_string())]);
        assert!(KeyOutcome::AlreadyPresent.is_ok());
        assert!(KeyOutcome::Skipped.is_ok());
        assert_eq!(KeyOutcome::Skipped.name(), "skipped");
        assert!(!KeyOutcome::TimedOut.is_ok());
    }

    #[test]
    fn only_session_loss_and_unavailability_mean_attach_again() {
        let again: Vec<_> = ErrorKind::ALL
            .into_iter()
            .filter(|k| k.is_disconnect())
            .collect();
        assert_eq!(again, [ErrorKind::SessionLost, ErrorKind::Unavailable]);
    }
}
