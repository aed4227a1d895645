//! One soak worker: a random mix of stores, loads and lookups (each followed by a load of its
//! hits) over its own namespace and the shared one, every loaded byte checked against the
//! key's block; a ledger of what it has seen present, cleared or left uncertain; and the final
//! audit of that ledger.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Result;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use umbp_core::{BlockKey, FailureKind, KeyOutcome};
use umbp_proto::completion::monotonic_ns;

use super::backend::{Backend, Fail};
use super::content::{KeyId, Keys, Region, SHARED_NS};
use super::counts::Counts;

/// What every worker of a client process shares.
#[derive(Debug, Clone)]
pub(crate) struct WorkSpec {
    pub(crate) private_keys: u32,
    pub(crate) shared_keys: u32,
    pub(crate) max_batch: u32,
    /// Fraction of operations on the shared namespace.
    pub(crate) shared_fraction: f64,
}

/// What a worker knows of a key: the last window (monotonic ns) in which it saw it present (a
/// store that placed it or found it there, a load that got it), and whether a clear removed it
/// since, or left its fate unknown (a clear or a failed store that overlapped that window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum State {
    Present { from: u64, to: u64 },
    Cleared { at: u64 },
    Uncertain,
}

/// A hit on a key of the worker's own namespace that a clear removed and nobody stored again:
/// the key, when the clear ended, when the hit was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClearHit {
    pub(crate) key: KeyId,
    pub(crate) cleared: u64,
    pub(crate) seen: u64,
}

/// What one worker's audit found: keys it expected present that could not be loaded, each
/// with the end of its last presence window.
#[derive(Debug, Default)]
pub(crate) struct Audit {
    pub(crate) missing: Vec<(KeyId, u64)>,
}

/// The audit passes over keys not found at first (a promotion from disk can find the pool
/// full for a moment), and the pause between passes.
const AUDIT_PASSES: u32 = 4;
const AUDIT_PAUSE: Duration = Duration::from_millis(250);

#[derive(Debug)]
pub(crate) struct Worker {
    /// The worker's number in its arm (its namespace is `id + 1`).
    pub(crate) id: u32,
    /// Declared before the region: dropped (deregistered) first.
    pub(crate) backend: Option<Backend>,
    pub(crate) region: Region,
    spec: WorkSpec,
    keys: Keys,
    ledger: HashMap<KeyId, State>,
    /// Every key in the ledger, to pick from.
    known: Vec<KeyId>,
    rng: StdRng,
    pub(crate) counts: Counts,
    pub(crate) clear_hits: Vec<ClearHit>,
    /// Loads left before the injected corruption (`--inject-wrong`); None: none.
    inject_after: Option<u64>,
}

impl Worker {
    pub(crate) fn new(
        id: u32,
        region: Region,
        spec: WorkSpec,
        seed: u64,
        inject_wrong: bool,
    ) -> Self {
        Worker {
            id,
            backend: None,
            region,
            spec,
            keys: Keys::default(),
            ledger: HashMap::new(),
            known: Vec::new(),
            rng: StdRng::seed_from_u64(seed ^ (u64::from(id) + 1).wrapping_mul(0x9E37_79B9)),
            counts: Counts::default(),
            clear_hits: Vec::new(),
            inject_after: inject_wrong.then_some(20),
        }
    }

    fn backend(&self) -> &Backend {
        self.backend
            .as_ref()
            .expect("a running worker has its backend")
    }

    /// A run of consecutive keys of one namespace (what a prompt's blocks are).
    fn run_of_keys(&mut self) -> Vec<KeyId> {
        let shared = self.rng.random_bool(self.spec.shared_fraction);
        let (ns, size) = if shared {
            (SHARED_NS, self.spec.shared_keys)
        } else {
            (self.id + 1, self.spec.private_keys)
        };
        let n = self.rng.random_range(1..=self.spec.max_batch.min(size));
        let start = self.rng.random_range(0..size);
        (0..n)
            .map(|i| KeyId {
                ns,
                idx: (start + i) % size,
            })
            .collect()
    }

    fn block_keys(&mut self, ids: &[KeyId]) -> Result<Vec<BlockKey>> {
        ids.iter().map(|k| self.keys.key(*k)).collect()
    }

    /// One operation of the mix.
    pub(crate) fn step(&mut self) -> Result<()> {
        let r: f64 = self.rng.random();
        if r < 0.35 {
            self.store()
        } else if r < 0.55 {
            self.load()
        } else {
            self.lookup()
        }
    }

    fn note_present(&mut self, k: KeyId, from: u64, to: u64, seen: u64) {
        let prev = self.ledger.insert(k, State::Present { from, to });
        match prev {
            None => self.known.push(k),
            Some(State::Cleared { at }) if k.ns != SHARED_NS => {
                // Only this worker stores its own namespace: present again without a store
                // of its own means the clear did not take it (or a restart brought it back).
                self.counts.clear_hits += 1;
                self.clear_hits.push(ClearHit {
                    key: k,
                    cleared: at,
                    seen,
                });
            }
            _ => {}
        }
    }

    fn note_failed(&mut self, f: &Fail) {
        match f {
            Fail::Restart(_) => self.counts.failed_restart += 1,
            Fail::Other(m) => {
                self.counts.failed_other += 1;
                if self.counts.failed_other <= 5 {
                    log::warn!("umbp soak: worker {}: {m}", self.id);
                }
            }
        }
    }

    /// A store that may or may not have placed `k`: a cleared key's fate is unknown now.
    fn note_unsure(&mut self, k: KeyId) {
        if let Some(s @ State::Cleared { .. }) = self.ledger.get_mut(&k) {
            *s = State::Uncertain;
        }
    }

    fn store(&mut self) -> Result<()> {
        let ids = self.run_of_keys();
        let keys = self.block_keys(&ids)?;
        for (slot, k) in keys.iter().enumerate() {
            self.region.fill_slot(slot as u64, k);
        }
        let slots: Vec<u64> = (0..ids.len() as u64).collect();
        self.counts.store_ops += 1;
        let t0 = monotonic_ns();
        let r = self.backend().transfer(true, &slots, &keys);
        let t1 = monotonic_ns();
        let outcomes = match r {
            Ok(o) => o,
            Err(f) => {
                self.note_failed(&f);
                ids.iter().for_each(|k| self.note_unsure(*k));
                return Ok(());
            }
        };
        let mut failure = None;
        for (k, o) in ids.iter().zip(outcomes) {
            match o {
                KeyOutcome::Done => {
                    self.counts.keys_stored += 1;
                    self.counts.bytes_stored += self.region.object_bytes();
                    // Stored by this worker: present again, not a hit after a clear.
                    if let Some(s @ State::Cleared { .. }) = self.ledger.get_mut(k) {
                        *s = State::Uncertain;
                    }
                    self.note_present(*k, t0, t1, t1);
                }
                KeyOutcome::AlreadyPresent => {
                    self.counts.keys_already += 1;
                    self.note_present(*k, t0, t1, t0);
                }
                KeyOutcome::PoolFull | KeyOutcome::Skipped => self.counts.keys_pool_full += 1,
                o => {
                    failure.get_or_insert(outcome_failure(&o));
                    self.note_unsure(*k);
                }
            }
        }
        if let Some(f) = failure {
            self.note_failed(&f);
        }
        Ok(())
    }

    /// Loads `ids` into the first slots and checks each block that came; `after_hit`: the
    /// keys were a lookup's hits, so a miss is a hit lost before its load.
    fn load_and_check(&mut self, ids: &[KeyId], after_hit: bool) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let keys = self.block_keys(ids)?;
        let slots: Vec<u64> = (0..ids.len() as u64).collect();
        for s in &slots {
            self.region.clobber_slot(*s);
        }
        let t0 = monotonic_ns();
        let r = self.backend().transfer(false, &slots, &keys);
        let t1 = monotonic_ns();
        let outcomes = match r {
            Ok(o) => o,
            Err(f) => {
                self.note_failed(&f);
                return Ok(());
            }
        };
        let mut failure = None;
        for (i, (k, o)) in ids.iter().zip(outcomes).enumerate() {
            match o {
                KeyOutcome::Done => {
                    if let Some(left) = &mut self.inject_after {
                        if *left == 0 {
                            self.region.flip_byte(i as u64);
                            self.inject_after = None;
                            log::warn!(
                                "umbp soak: worker {} flipped one loaded byte (--inject-wrong)",
                                self.id
                            );
                        } else {
                            *left -= 1;
                        }
                    }
                    let wrong = self.region.wrong_bytes(i as u64, &keys[i]);
                    if wrong > 0 {
                        self.counts.wrong_keys += 1;
                        self.counts.wrong_bytes += wrong;
                        log::error!(
                            "umbp soak: worker {}: key {}:{} loaded with {wrong} wrong bytes",
                            self.id,
                            k.ns,
                            k.idx
                        );
                    } else {
                        self.note_present(*k, t0, t1, t0);
                    }
                    self.counts.keys_loaded += 1;
                    self.counts.bytes_loaded += self.region.object_bytes();
                }
                KeyOutcome::Missing => {
                    if after_hit {
                        self.counts.lost_after_hit += 1;
                    } else {
                        self.counts.load_misses += 1;
                        if matches!(self.ledger.get(k), Some(State::Present { .. })) {
                            self.counts.expected_misses += 1;
                        }
                    }
                }
                o => {
                    failure.get_or_insert(outcome_failure(&o));
                }
            }
        }
        if let Some(f) = failure {
            self.note_failed(&f);
        }
        Ok(())
    }

    fn load(&mut self) -> Result<()> {
        self.counts.load_ops += 1;
        // Mostly keys seen before (present or not by now), else a blind run.
        let ids = if !self.known.is_empty() && self.rng.random_bool(0.7) {
            let n = self.rng.random_range(1..=self.spec.max_batch) as usize;
            let mut v: Vec<KeyId> = (0..n)
                .map(|_| self.known[self.rng.random_range(0..self.known.len())])
                .collect();
            v.sort_unstable();
            v.dedup();
            v
        } else {
            self.run_of_keys()
        };
        self.load_and_check(&ids, false)
    }

    fn lookup(&mut self) -> Result<()> {
        self.counts.lookup_ops += 1;
        let ids = self.run_of_keys();
        let keys = self.block_keys(&ids)?;
        let hits: Vec<KeyId> = if self.rng.random_bool(0.5) {
            match self.backend().prefix_hits(&keys) {
                Ok(n) => ids[..n.min(ids.len())].to_vec(),
                Err(f) => {
                    self.note_failed(&f);
                    return Ok(());
                }
            }
        } else {
            match self.backend().exists(&keys) {
                Ok(p) => ids
                    .iter()
                    .zip(p)
                    .filter(|(_, p)| *p)
                    .map(|(k, _)| *k)
                    .collect(),
                Err(f) => {
                    self.note_failed(&f);
                    return Ok(());
                }
            }
        };
        self.counts.lookup_keys += ids.len() as u64;
        self.counts.lookup_hits += hits.len() as u64;
        self.load_and_check(&hits, true)
    }

    /// A clear of namespace `ns` ran from `t0` to `t1` (monotonic ns); `sure`: it answered
    /// (else it may or may not have run). Keys last seen before it are gone, keys seen after
    /// it stay, keys seen during it are uncertain.
    pub(crate) fn apply_clear(&mut self, ns: u32, t0: u64, t1: u64, sure: bool) {
        for s in self
            .ledger
            .iter_mut()
            .filter(|(k, _)| k.ns == ns)
            .map(|(_, s)| s)
        {
            *s = match *s {
                State::Present { from, .. } if from > t1 => continue,
                State::Present { to, .. } if to < t0 && sure => State::Cleared { at: t1 },
                State::Present { .. } => State::Uncertain,
                // Cleared again: a hit from now on is measured against this clear.
                State::Cleared { .. } if sure => State::Cleared { at: t1 },
                other => other,
            };
        }
    }

    /// Checks every key of the ledger expected present (a lookup, then a load of the hits,
    /// every byte checked), passing again over those not found; keys of its own namespace a
    /// clear removed are looked up too (a hit is a hit after the clear).
    pub(crate) fn audit(&mut self) -> Result<Audit> {
        let mut todo: Vec<KeyId> = self
            .ledger
            .iter()
            .filter(|(_, s)| matches!(s, State::Present { .. }))
            .map(|(k, _)| *k)
            .collect();
        todo.sort_unstable();
        self.counts.audit_keys += todo.len() as u64;
        let batch = (self.region.slots as usize).clamp(1, 8);
        for pass in 0..AUDIT_PASSES {
            if todo.is_empty() {
                break;
            }
            if pass > 0 {
                std::thread::sleep(AUDIT_PAUSE);
            }
            let mut again = Vec::new();
            for ids in todo.chunks(batch) {
                again.extend(self.audit_batch(ids)?);
            }
            todo = again;
        }
        self.counts.audit_missing += todo.len() as u64;
        let cleared: Vec<KeyId> = self
            .ledger
            .iter()
            .filter(|(k, s)| k.ns != SHARED_NS && matches!(s, State::Cleared { .. }))
            .map(|(k, _)| *k)
            .collect();
        for ids in cleared.chunks(batch) {
            let keys = self.block_keys(ids)?;
            if let Ok(p) = self.backend().exists(&keys) {
                let now = monotonic_ns();
                for (k, _) in ids.iter().zip(p).filter(|(_, p)| *p) {
                    self.note_present(*k, now, now, now);
                }
            }
        }
        Ok(Audit {
            missing: todo
                .into_iter()
                .map(|k| match self.ledger.get(&k) {
                    Some(State::Present { to, .. }) => (k, *to),
                    _ => (k, 0),
                })
                .collect(),
        })
    }

    /// Looks `ids` up and loads the hits, checking them; returns those not loaded.
    fn audit_batch(&mut self, ids: &[KeyId]) -> Result<Vec<KeyId>> {
        let keys = self.block_keys(ids)?;
        let Ok(present) = self.backend().exists(&keys) else {
            return Ok(ids.to_vec());
        };
        let hits: Vec<usize> = (0..ids.len()).filter(|i| present[*i]).collect();
        let mut missing: Vec<KeyId> = (0..ids.len())
            .filter(|i| !present[*i])
            .map(|i| ids[i])
            .collect();
        if hits.is_empty() {
            return Ok(missing);
        }
        let slots: Vec<u64> = (0..hits.len() as u64).collect();
        let hit_keys: Vec<BlockKey> = hits.iter().map(|i| keys[*i]).collect();
        for s in &slots {
            self.region.clobber_slot(*s);
        }
        let outcomes = match self.backend().transfer(false, &slots, &hit_keys) {
            Ok(o) => o,
            Err(_) => {
                missing.extend(hits.iter().map(|i| ids[*i]));
                return Ok(missing);
            }
        };
        for (j, o) in outcomes.into_iter().enumerate() {
            let k = ids[hits[j]];
            if o != KeyOutcome::Done {
                missing.push(k);
                continue;
            }
            let wrong = self.region.wrong_bytes(j as u64, &hit_keys[j]);
            if wrong > 0 {
                self.counts.wrong_keys += 1;
                self.counts.wrong_bytes += wrong;
                log::error!(
                    "umbp soak: audit of worker {}: key {}:{} loaded with {wrong} wrong bytes",
                    self.id,
                    k.ns,
                    k.idx
                );
            }
            self.counts.audit_present += 1;
        }
        Ok(missing)
    }
}

/// A key outcome other than done / present / missing / full, as a failure.
fn outcome_failure(o: &KeyOutcome) -> Fail {
    match o {
        KeyOutcome::Failed(f) if f.kind == FailureKind::Server => Fail::Restart(f.message.clone()),
        // Cancelled: the server's stop cancelled it after its grace period.
        KeyOutcome::Cancelled => Fail::Restart("cancelled".into()),
        o => Fail::Other(format!("a key ended {o:?}")),
    }
}

/// The audit's findings as JSON: `[[ns, idx, last seen ns], ...]`.
pub(crate) fn missing_json(m: &[(KeyId, u64)]) -> Value {
    Value::Array(m.iter().map(|(k, t)| json!([k.ns, k.idx, t])).collect())
}

/// Hits after clears as JSON: `[[ns, idx, cleared ns, seen ns], ...]`.
pub(crate) fn clear_hits_json(h: &[ClearHit]) -> Value {
    Value::Array(
        h.iter()
            .map(|c| json!([c.key.ns, c.key.idx, c.cleared, c.seen]))
            .collect(),
    )
}
