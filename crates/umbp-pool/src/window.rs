//! A bounded first-in-first-out set of key fingerprints: S3-FIFO's ghost set and the
//! `on_reuse` admission's "seen once" window. When full, the oldest fingerprint leaves.

use std::collections::{HashMap, VecDeque};

#[derive(Debug)]
pub(crate) struct FpWindow {
    /// Fingerprint → the sequence number of its newest insertion.
    present: HashMap<u64, u64>,
    /// Insertions, oldest first; an entry whose sequence number no longer matches `present`
    /// is stale (the fingerprint was taken or inserted again) and is skipped.
    order: VecDeque<(u64, u64)>,
    seq: u64,
    capacity: usize,
}

impl FpWindow {
    pub fn new(capacity: usize) -> Self {
        FpWindow {
            present: HashMap::new(),
            order: VecDeque::new(),
            seq: 0,
            capacity,
        }
    }

    pub fn len(&self) -> usize {
        self.present.len()
    }

    pub fn contains(&self, fp: u64) -> bool {
        self.present.contains_key(&fp)
    }

    /// Adds `fp` as the newest member (moving it to the back if present).
    pub fn insert(&mut self, fp: u64) {
        if self.capacity == 0 {
            return;
        }
        self.seq += 1;
        self.present.insert(fp, self.seq);
        self.order.push_back((fp, self.seq));
        self.trim();
    }

    /// Removes `fp`; returns whether it was a member.
    pub fn take(&mut self, fp: u64) -> bool {
        self.present.remove(&fp).is_some()
    }

    /// Changes the bound (the ghost set follows its main queue's length).
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity;
        self.trim();
    }

    fn trim(&mut self) {
        while self.present.len() > self.capacity {
            let Some((fp, seq)) = self.order.pop_front() else {
                break;
            };
            if self.present.get(&fp) == Some(&seq) {
                self.present.remove(&fp);
            }
        }
        // Stale records are dropped once they outnumber the members, so `order` stays within
        // twice the bound.
        if self.order.len() > 2 * self.capacity.max(16) {
            let present = &self.present;
            self.order.retain(|(fp, seq)| present.get(fp) == Some(seq));
        }
    }

    pub fn metadata_bytes(&self) -> usize {
        self.present.capacity() * 17 + self.order.capacity() * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oldest_members_leave_first() {
        let mut w = FpWindow::new(3);
        for fp in 1..=5 {
            w.insert(fp);
        }
        assert!(!w.contains(1) && !w.contains(2));
        assert!(w.contains(3) && w.contains(4) && w.contains(5));
        assert_eq!(w.len(), 3);
    }

    #[test]
    fn taken_and_reinserted_members_do_not_leave_early() {
        let mut w = FpWindow::new(2);
        w.insert(1);
        w.insert(2);
        assert!(w.take(1));
        assert!(!w.take(1));
        w.insert(3);
        w.insert(2); // refreshed: 3 is now the oldest
        w.insert(4);
        assert!(!w.contains(3));
        assert!(w.contains(2) && w.contains(4));
    }

    #[test]
    fn a_zero_window_holds_nothing() {
        let mut w = FpWindow::new(0);
        w.insert(7);
        assert!(!w.contains(7));
        let mut w = FpWindow::new(4);
        (0..4).for_each(|fp| w.insert(fp));
        w.set_capacity(1);
        assert_eq!(w.len(), 1);
        assert!(w.contains(3));
    }

    #[test]
    fn stale_records_stay_bounded() {
        let mut w = FpWindow::new(4);
        for i in 0..10_000u64 {
            w.insert(i % 3);
        }
        assert!(w.order.len() <= 32);
    }
}
