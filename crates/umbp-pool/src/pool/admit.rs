//! Store admission: with `on_reuse`, the pool remembers the fingerprints of keys seen once
//! (one bounded window per index shard) and stores a key only when it was seen before, or
//! when the writer asks for it at once ([`Admit::Now`]).

use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::inner::{shard_of, Inner, SHARDS};
use crate::window::FpWindow;
use umbp_core::caching::{Admit, StoreAdmission};
use umbp_core::PoolConfig;

/// The `on_reuse` windows, one per shard; `admission_window` keys in all.
pub(super) fn windows(cfg: &PoolConfig) -> Option<Box<[Mutex<FpWindow>]>> {
    match cfg.store_admission {
        StoreAdmission::All => None,
        StoreAdmission::OnReuse => {
            let per_shard = cfg.admission_window.div_ceil(SHARDS);
            Some(
                (0..SHARDS)
                    .map(|_| Mutex::new(FpWindow::new(per_shard)))
                    .collect(),
            )
        }
    }
}

impl Inner {
    /// Whether a commit of the key with fingerprint `fp` is stored. With `on_reuse`, a key not
    /// seen before is remembered and refused (counted in `admissions_skipped`).
    pub(super) fn admit(&self, fp: u64) -> bool {
        let Some(windows) = &self.admission else {
            return true;
        };
        let mut w = windows[shard_of(fp)].lock();
        if w.contains(fp) {
            return true;
        }
        w.insert(fp);
        drop(w);
        self.counters
            .admissions_skipped
            .fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Whether a commit of `fp` asked for as `how` is stored: [`Admit::Now`] always is, and
    /// is remembered; where `on_reuse` would have refused it, it counts in
    /// `admissions_forced`.
    pub(super) fn admit_as(&self, fp: u64, how: Admit) -> bool {
        match how {
            Admit::Policy => self.admit(fp),
            Admit::Now => {
                let Some(windows) = &self.admission else {
                    return true;
                };
                let mut w = windows[shard_of(fp)].lock();
                if !w.contains(fp) {
                    w.insert(fp);
                    drop(w);
                    self.counters
                        .admissions_forced
                        .fetch_add(1, Ordering::Relaxed);
                }
                true
            }
        }
    }

    /// Remembers a key that was asked for and missing, so that its first commit is stored.
    pub(super) fn seen(&self, fp: u64) {
        if let Some(windows) = &self.admission {
            windows[shard_of(fp)].lock().insert(fp);
        }
    }

    /// Keys remembered as seen once, and the windows' metadata bytes.
    pub(super) fn admission_window(&self) -> (u64, u64) {
        let Some(windows) = &self.admission else {
            return (0, 0);
        };
        windows.iter().fold((0, 0), |(n, b), w| {
            let w = w.lock();
            (n + w.len() as u64, b + w.metadata_bytes() as u64)
        })
    }
}
