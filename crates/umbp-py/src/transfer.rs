//! `Transfer`: a store or load in flight, in either mode (Python's `Job` is the same class).
//!
//! Both modes answer with one outcome per key, in the words of [`umbp_core::KeyOutcome`]. A
//! standalone transfer that failed as a whole (the server could not take it, or went away
//! before answering) answers every key "failed" (kind "server"); `failure()` says why. Only a
//! wait that runs out while the transfer is still pending raises (`TransferTimeout`).

use std::time::Duration;

use pyo3::prelude::*;
use umbp_client::Transfer as ClientTransfer;
use umbp_copy::JobHandle;
use umbp_core::KeyOutcome;

use crate::errors::Result;
use crate::lifecycle::{without_gil, Origin, ReleaseGilOnDrop};

/// Where a transfer runs.
enum Source {
    /// In this process's copy engine (embedded mode).
    Embedded {
        handle: JobHandle,
        /// The wait's default: the store's `timeout_ms`.
        timeout: Duration,
        /// A forked child cannot wait for the parent's copy threads.
        origin: Origin,
    },
    /// In the node's server (standalone mode).
    Standalone {
        /// Holds a handle of the client: dropped with the GIL released, leaked in a forked
        /// child.
        inner: Box<ReleaseGilOnDrop<ClientTransfer>>,
        /// Bytes of one key's object (0 when the layout is unknown: the transfer then fails).
        object_bytes: u64,
    },
}

/// A store or load in flight. Dropping it does not cancel it.
#[pyclass(module = "umbp._native", frozen)]
pub(crate) struct Transfer {
    source: Source,
    keys: usize,
}

impl Transfer {
    /// A job of this process's copy engine.
    pub(crate) fn embedded(handle: JobHandle, timeout: Duration) -> Transfer {
        Transfer {
            keys: handle.len(),
            source: Source::Embedded {
                handle,
                timeout,
                origin: Origin::here(),
            },
        }
    }

    /// A transfer of the standalone server, of `keys` keys.
    pub(crate) fn standalone(t: ClientTransfer, keys: usize, object_bytes: u64) -> Transfer {
        Transfer {
            keys,
            source: Source::Standalone {
                inner: Box::new(ReleaseGilOnDrop::new(t)),
                object_bytes,
            },
        }
    }

    /// The outcomes once answered, else None; never blocks for long.
    fn outcomes(&self) -> Result<Option<Vec<KeyOutcome>>> {
        Ok(match &self.source {
            Source::Embedded { handle, .. } => handle.poll(),
            Source::Standalone { inner, .. } => inner.live("transfer")?.poll(),
        })
    }
}

fn names(outcomes: &[KeyOutcome]) -> Vec<&'static str> {
    outcomes.iter().map(KeyOutcome::name).collect()
}

#[pymethods]
impl Transfer {
    /// Per-key statuses once finished, else None. Never blocks.
    fn poll(&self) -> Result<Option<Vec<&'static str>>> {
        Ok(self.outcomes()?.as_deref().map(names))
    }

    /// Whether the transfer has finished (or the server has answered).
    #[getter]
    fn done(&self) -> Result<bool> {
        Ok(match &self.source {
            Source::Embedded { handle, .. } => handle.is_done(),
            Source::Standalone { inner, .. } => inner.live("transfer")?.is_done(),
        })
    }

    /// Waits (GIL released) up to `timeout_ms` (default: the store's or client's `timeout_ms`)
    /// and returns per-key statuses; raises `TransferTimeout` when the transfer is still
    /// pending (its blocks may still be written).
    #[pyo3(signature = (timeout_ms=None))]
    fn wait(&self, py: Python<'_>, timeout_ms: Option<u64>) -> Result<Vec<&'static str>> {
        let outcomes = match &self.source {
            Source::Embedded {
                handle,
                timeout,
                origin,
            } => {
                origin.check("job")?;
                let t = timeout_ms.map_or(*timeout, Duration::from_millis);
                without_gil(py, || handle.wait(t))?
            }
            Source::Standalone { inner, .. } => {
                let t = inner.live("transfer")?;
                without_gil(py, || t.wait(timeout_ms.map(Duration::from_millis)))?
            }
        };
        Ok(names(&outcomes))
    }

    /// Stops the keys that have not started (they end "cancelled"); wait for the answer
    /// before reusing the blocks' memory. Standalone: asks the server (GIL released); nothing
    /// to do once answered; raises when the server cannot be asked.
    fn cancel(&self, py: Python<'_>) -> Result<()> {
        match &self.source {
            Source::Embedded { handle, .. } => handle.cancel(),
            Source::Standalone { inner, .. } => {
                let t = inner.live("transfer")?;
                without_gil(py, || t.cancel())?;
            }
        }
        Ok(())
    }

    /// Seconds from submission to the end of the transfer, once finished (else None; None too
    /// for a standalone transfer that failed as a whole). Standalone: to the server plus the
    /// server's part when the completion page answered (its time to the job's end: not when
    /// this process happened to look), else the round trip to the reply.
    #[getter]
    fn elapsed_s(&self) -> Result<Option<f64>> {
        Ok(match &self.source {
            Source::Embedded { handle, .. } => handle.elapsed().map(|d| d.as_secs_f64()),
            Source::Standalone { inner, .. } => {
                inner.live("transfer")?.elapsed().map(|d| d.as_secs_f64())
            }
        })
    }

    /// Bytes of one key's object.
    #[getter]
    fn object_bytes(&self) -> u64 {
        match &self.source {
            Source::Embedded { handle, .. } => handle.object_bytes(),
            Source::Standalone { object_bytes, .. } => *object_bytes,
        }
    }

    /// Messages of keys that ended "failed", by key index (empty until finished).
    fn errors(&self) -> Result<Vec<(usize, String)>> {
        Ok(self
            .failures()?
            .into_iter()
            .map(|(i, _, m)| (i, m))
            .collect())
    }

    /// Keys that ended "failed", by key index, with why in one word and in words (empty until
    /// finished): "invalid_range", "size_mismatch", "pool", "device" (one device call
    /// failed), "device_lost" (the device is unusable until the process restarts),
    /// "unsupported", "server" (standalone: the transfer failed as a whole; see
    /// `failure()`) or "corrupt" (the stored object failed its checksum: removed, nothing
    /// copied).
    fn failures(&self) -> Result<Vec<(usize, &'static str, String)>> {
        let outcomes = self.outcomes()?.unwrap_or_default();
        Ok(umbp_core::outcome::failures(&outcomes)
            .map(|(i, f)| (i, f.kind.name(), f.message.clone()))
            .collect())
    }

    /// Why a standalone transfer failed as a whole (every key then "failed"), once answered:
    /// `(kind, message)`, the kind in the words of `UmbpError.kind` ("unavailable": the server
    /// went away or could not take it). None otherwise, and always in embedded mode.
    fn failure(&self) -> Result<Option<(&'static str, String)>> {
        Ok(match &self.source {
            Source::Embedded { .. } => None,
            Source::Standalone { inner, .. } => inner
                .live("transfer")?
                .failure()
                .map(|(kind, message)| (kind.name(), message)),
        })
    }

    fn __len__(&self) -> usize {
        self.keys
    }

    fn __repr__(&self) -> String {
        let state = match &self.source {
            Source::Standalone { inner, .. } if inner.forked() => "of the parent process",
            Source::Standalone { inner, .. } if inner.is_done() => "answered",
            Source::Standalone { .. } => "in flight",
            Source::Embedded { handle, .. } if handle.is_done() => "finished",
            Source::Embedded { .. } => "running",
        };
        format!("<umbp.Transfer of {} keys, {state}>", self.keys)
    }
}
