//! The one surface both modes give a process that copies its KV cache through UMBP: register
//! memory and a layout, start stores and loads, and wait for their per-key outcomes.
//!
//! [`KvStore`] is implemented by the embedded store's session (`umbp_store::Session`, the
//! pool in this process) and by the standalone client (`umbp_client::StandaloneClient`, the
//! node's server); its transfers are [`KvTransfer`]s (`umbp_copy::JobHandle` and
//! `umbp_client::Transfer`). Code that only moves blocks (benchmarks, the bindings' common
//! paths) is written once against them. The traits live here, in the crate every other one
//! depends on, so neither mode's crate needs the other's.
// The one place this crate says `unsafe`: two trait methods whose callers promise that the
// memory they register stays valid. Nothing here runs unsafe code.
#![allow(unsafe_code)]

use std::time::Duration;

use crate::{BlockKey, ErrorKind, KeyOutcome, KvLayout};

/// An error of a [`KvStore`] or [`KvTransfer`]: it says what kind of problem it is.
pub trait KvError: std::error::Error + Send + Sync + 'static {
    /// The error's kind.
    fn error_kind(&self) -> ErrorKind;
}

/// A store or load in flight. Dropping it does not cancel it.
pub trait KvTransfer {
    /// What waiting or cancelling can fail with.
    type Error: KvError;

    /// Per-key outcomes once finished, else None. Never blocks.
    fn poll(&self) -> Option<Vec<KeyOutcome>>;

    /// Whether it has finished.
    fn is_done(&self) -> bool;

    /// Waits up to `timeout` for the per-key outcomes; the error of a transfer still running
    /// then is of kind [`ErrorKind::Timeout`] (its memory may still be written).
    fn wait(&self, timeout: Duration) -> Result<Vec<KeyOutcome>, Self::Error>;

    /// Stops the keys that have not started (they end [`KeyOutcome::Cancelled`]); wait for
    /// the outcomes before reusing the memory.
    fn cancel(&self) -> Result<(), Self::Error>;

    /// From submission to the end of the last key, once finished (None before, and for a
    /// transfer that failed as a whole).
    fn elapsed(&self) -> Option<Duration>;
}

/// Where a process registers its KV cache and copies its blocks to and from a pool.
pub trait KvStore {
    /// What its calls fail with.
    type Error: KvError;
    /// A store or load in flight.
    type Transfer: KvTransfer;

    /// Registers host memory; returns its region id.
    ///
    /// # Safety
    /// The memory stays valid (allocated, and not written by another thread while a transfer
    /// copies it) until [`KvStore::deregister_memory`] returns or the store is dropped.
    unsafe fn register_host_memory(&self, addr: u64, len: u64) -> Result<u64, Self::Error>;

    /// Registers CUDA memory of device `device` (the standalone client finds the device
    /// itself); returns its region id.
    ///
    /// # Safety
    /// As [`KvStore::register_host_memory`].
    unsafe fn register_cuda_memory(
        &self,
        addr: u64,
        len: u64,
        device: i32,
    ) -> Result<u64, Self::Error>;

    /// Removes registration `region`; layouts in it are dropped with it.
    fn deregister_memory(&self, region: u64) -> Result<(), Self::Error>;

    /// Registers a layout lying in registered memory; returns its id.
    fn register_layout(&self, layout: KvLayout) -> Result<u32, Self::Error>;

    /// Bytes of one block's object in group `group` of layout `layout`.
    fn object_bytes(&self, layout: u32, group: u32) -> Result<u64, Self::Error>;

    /// Starts storing blocks `block_ids` of group `group` of layout `layout` under `keys`.
    fn store(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Self::Transfer, Self::Error>;

    /// Starts loading `keys` into blocks `block_ids` of group `group` of layout `layout`.
    fn load(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Self::Transfer, Self::Error>;
}
