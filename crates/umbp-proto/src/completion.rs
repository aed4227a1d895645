//! The completion page: how the server tells a client that a transfer finished without
//! waiting for the Transfer reply.
//!
//! A client maps a small sealed memfd (the page) and registers it with its session
//! (`RegisterCompletionPage`). The page is an array of [`SLOT_BYTES`]-byte slots; a transfer
//! that names slot `k` (its `completion_slot` is `k + 1`) gets, the moment its copy job's last
//! key finishes and on the copy worker that finished it:
//!
//! | bytes | written by the server |
//! |---|---|
//! | 8..16 | microseconds from receiving the request to the job's end |
//! | 16..24 | microseconds of the copy job (submission to its last key) |
//! | 24..32 | when the request was received, `CLOCK_MONOTONIC` nanoseconds |
//! | 32..40 | when the slot was published, `CLOCK_MONOTONIC` nanoseconds |
//! | 0..4 | the word: `(seq << 2) \| ALL_DONE` or `(seq << 2) \| SEE_REPLY`, stored last (release) |
//!
//! and then a `FUTEX_WAKE` on the word. A client arms the slot with `(seq << 2) | PENDING`
//! before sending the request and sleeps in `FUTEX_WAIT` while the word still holds that; its
//! own reply handler moves a still-pending word to `(seq << 2) | REPLIED` (and wakes), so a
//! transfer the server refused or never finished wakes its waiter too. Both ends move the word
//! only from `(seq << 2) | PENDING` of their own use (compare-and-swap), so once it left pending
//! it stays: a late write for an earlier use of the slot (a job that outlived its reply, or one
//! of a session that is gone) changes nothing. The path saves the server's runtime, the reply's
//! encoding, the client's runtime and one more thread hand-off between the copy and the caller.
//!
//! The server reads only the word it is about to swap and acts on nothing else in the page, so
//! a client that scribbles on it harms only itself; the memfd is sealed against shrinking, so
//! the server's writes can never raise SIGBUS.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use umbp_unix::futex;
use umbp_unix::mapping::SharedMapping;

use crate::ProtoError;

/// Bytes of one slot (a cache line: concurrent transfers never share one).
pub const SLOT_BYTES: u64 = 64;
/// 8-byte fields of a slot in use: the word's and four times.
const TIMES: usize = 5;
/// Largest page the server maps.
pub const MAX_PAGE_BYTES: u64 = 1 << 20;
/// Armed by the client: the transfer has not finished.
pub const PENDING: u32 = 0;
/// Set by the server: every key is DONE (the reply, when it comes, says the same).
pub const ALL_DONE: u32 = 1;
/// Set by the server: the job finished but not every key is DONE; read the reply.
pub const SEE_REPLY: u32 = 2;
/// Set by the client's reply handler over a still-pending word.
pub const REPLIED: u32 = 3;
/// Sequence numbers are below this (30 bits).
pub const SEQ_LIMIT: u32 = 1 << 30;
/// Most waiters of one word a wake-up reaches.
pub const MAX_WOKEN: i32 = 64;
/// Longest single sleep of a waiter (see [`CompletionPage::wait`]).
pub const WAIT_SLICE: Duration = Duration::from_millis(100);

/// What the server writes into a slot with its word (see the module's table). The two clock
/// readings are `CLOCK_MONOTONIC`, one clock for every process of the host, so that a client
/// can tell how long its request took to reach the server and the answer to reach it; a
/// server that does not write them leaves 0.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SlotTimes {
    /// Microseconds from receiving the request to the job's end.
    pub server_us: u64,
    /// Microseconds of the copy job (submission to its last key).
    pub copy_us: u64,
    /// When the request was received (nanoseconds of `CLOCK_MONOTONIC`).
    pub received_ns: u64,
    /// When the slot was published (nanoseconds of `CLOCK_MONOTONIC`).
    pub published_ns: u64,
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: one clock for every process of the host (the
/// completion page's clock readings).
pub use umbp_unix::clock::monotonic_ns;

/// A slot's word for use `seq` (taken modulo [`SEQ_LIMIT`]) in state `state`.
pub fn word(seq: u32, state: u32) -> u32 {
    ((seq % SEQ_LIMIT) << 2) | (state & 3)
}

/// A completion page mapped in this process. Every access is atomic: the other process may
/// write any slot at any time.
#[derive(Debug)]
pub struct CompletionPage {
    mapping: SharedMapping,
    slots: u32,
}

impl CompletionPage {
    /// The page in `mapping`, holding `len / SLOT_BYTES` slots. The mapping must be of a memfd
    /// sealed against shrinking, so that no access to it can fault.
    pub fn new(mapping: SharedMapping) -> Result<Self, ProtoError> {
        let len = mapping.len() as u64;
        if !(SLOT_BYTES..=MAX_PAGE_BYTES).contains(&len) {
            return Err(ProtoError::CompletionPage(format!(
                "{len} bytes; give {SLOT_BYTES} to {MAX_PAGE_BYTES} bytes"
            )));
        }
        Ok(CompletionPage {
            slots: (len / SLOT_BYTES) as u32,
            mapping,
        })
    }

    /// Slots in the page.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn slot_offset(&self, slot: u32) -> usize {
        assert!(
            slot < self.slots,
            "slot {slot} of a {}-slot page",
            self.slots
        );
        (slot as u64 * SLOT_BYTES) as usize
    }

    fn word_of(&self, slot: u32) -> &AtomicU32 {
        self.mapping.atomic_u32(self.slot_offset(slot))
    }

    fn time_of(&self, slot: u32, i: usize) -> &AtomicU64 {
        debug_assert!((1..TIMES).contains(&i));
        self.mapping.atomic_u64(self.slot_offset(slot) + 8 * i)
    }

    /// The slot's word now.
    pub fn load(&self, slot: u32) -> u32 {
        self.word_of(slot).load(Ordering::Acquire)
    }

    /// Client: arms the slot for use `seq` before the request goes out.
    pub fn arm(&self, slot: u32, seq: u32) {
        for i in 1..TIMES {
            self.time_of(slot, i).store(0, Ordering::Relaxed);
        }
        self.word_of(slot)
            .store(word(seq, PENDING), Ordering::Release);
    }

    /// Client: moves the slot from pending to `state` for use `seq`, if it is still pending,
    /// and wakes its waiters. Whether it was.
    pub fn settle(&self, slot: u32, seq: u32, state: u32) -> bool {
        let moved = self
            .word_of(slot)
            .compare_exchange(
                word(seq, PENDING),
                word(seq, state),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if moved {
            self.wake(slot);
        }
        moved
    }

    /// Server: publishes the end of use `seq` of `slot` (times first, then the word) and
    /// wakes its waiters, only while the slot is still armed for that use: a late write for an
    /// earlier use, or one after the client settled the slot, changes nothing, so a slot's
    /// word never changes again once it left pending. Whether it published.
    pub fn publish(&self, slot: u32, seq: u32, all_done: bool, t: &SlotTimes) -> bool {
        let pending = word(seq, PENDING);
        if self.word_of(slot).load(Ordering::Acquire) != pending {
            return false;
        }
        self.time_of(slot, 1).store(t.server_us, Ordering::Relaxed);
        self.time_of(slot, 2).store(t.copy_us, Ordering::Relaxed);
        self.time_of(slot, 3)
            .store(t.received_ns, Ordering::Relaxed);
        self.time_of(slot, 4)
            .store(t.published_ns, Ordering::Relaxed);
        let state = if all_done { ALL_DONE } else { SEE_REPLY };
        let moved = self
            .word_of(slot)
            .compare_exchange(
                pending,
                word(seq, state),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok();
        if moved {
            self.wake(slot);
        }
        moved
    }

    /// The times the server wrote with the slot's word (read them after seeing the word).
    pub fn times(&self, slot: u32) -> SlotTimes {
        let t = |i| self.time_of(slot, i).load(Ordering::Relaxed);
        SlotTimes {
            server_us: t(1),
            copy_us: t(2),
            received_ns: t(3),
            published_ns: t(4),
        }
    }

    /// Sleeps while the slot's word is `expected`, at most `timeout` (spurious returns are
    /// possible: look at the word again). A wake-up reaches at most [`MAX_WOKEN`] waiters of a
    /// word, so wait in slices of at most [`WAIT_SLICE`] when more threads may wait on one.
    pub fn wait(&self, slot: u32, expected: u32, timeout: Duration) {
        // Any end is fine: the caller looks at the word again. The word is a live u32 of the
        // page, so the call cannot fail.
        let _ = futex::wait(self.word_of(slot), expected, Some(timeout));
    }

    /// Wakes waiters of the slot's word: bounded, so a client that parks many threads on its
    /// own words cannot make a copy worker wake them all. Not FUTEX_PRIVATE: the other side is
    /// another process mapping the same memfd.
    fn wake(&self, slot: u32) {
        let _ = futex::wake(self.word_of(slot), MAX_WOKEN as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    /// A page of `len` bytes in this process's own anonymous shared memory.
    fn page(len: usize) -> CompletionPage {
        CompletionPage::new(SharedMapping::anonymous(len).unwrap()).unwrap()
    }

    /// Times as a server writes them, the clock readings made up from the two durations.
    fn times(server_us: u64, copy_us: u64) -> SlotTimes {
        SlotTimes {
            server_us,
            copy_us,
            received_ns: 1_000_000 + server_us,
            published_ns: 2_000_000 + copy_us,
        }
    }

    #[test]
    fn words_carry_sequence_and_state() {
        assert_eq!(word(5, ALL_DONE), 21);
        assert_eq!(word(SEQ_LIMIT + 5, ALL_DONE), 21);
        assert_eq!(word(SEQ_LIMIT - 1, REPLIED) >> 2, SEQ_LIMIT - 1);
    }

    #[test]
    fn sizes_outside_the_limits_are_refused() {
        let new = |len| CompletionPage::new(SharedMapping::anonymous(len).unwrap());
        assert!(new(32).is_err());
        assert!(new(MAX_PAGE_BYTES as usize + 4096).is_err());
        assert_eq!(new(4096).unwrap().slots(), 64);
    }

    #[test]
    fn a_published_slot_wakes_its_waiter_with_the_times() {
        let page = Arc::new(page(4096));
        page.arm(3, 7);
        let p2 = Arc::clone(&page);
        let waiter = std::thread::spawn(move || {
            let start = Instant::now();
            while p2.load(3) == word(7, PENDING) {
                p2.wait(3, word(7, PENDING), Duration::from_secs(10));
            }
            (p2.load(3), p2.times(3), start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        let sent = times(11, 9);
        page.publish(3, 7, true, &sent);
        let (w, got, waited) = waiter.join().unwrap();
        assert_eq!(w, word(7, ALL_DONE));
        assert_eq!(got, sent);
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // Other slots are untouched.
        assert_eq!(page.load(2), 0);
    }

    #[test]
    fn settle_moves_only_a_pending_word_of_the_same_use() {
        let page = page(4096);
        page.arm(0, 1);
        assert!(!page.settle(0, 2, REPLIED));
        assert!(page.publish(0, 1, false, &times(0, 0)));
        assert!(!page.settle(0, 1, REPLIED));
        assert_eq!(page.load(0), word(1, SEE_REPLY));
        page.arm(0, 2);
        assert!(page.settle(0, 2, REPLIED));
        assert_eq!(page.load(0), word(2, REPLIED));
        // Once settled, the server's write for the same use changes nothing.
        assert!(!page.publish(0, 2, true, &times(5, 5)));
        assert_eq!(page.load(0), word(2, REPLIED));
        assert_eq!(page.times(0), SlotTimes::default());
    }

    #[test]
    fn a_late_write_for_an_earlier_use_changes_nothing() {
        let page = page(4096);
        page.arm(4, 10);
        assert!(page.publish(4, 10, true, &times(1, 1)));
        page.arm(4, 11);
        assert!(!page.publish(4, 10, false, &times(7, 7)));
        assert_eq!(page.load(4), word(11, PENDING));
        assert_eq!(page.times(4), SlotTimes::default());
        assert!(page.publish(4, 11, true, &times(2, 3)));
        assert!(!page.publish(4, 10, false, &times(7, 7)));
        assert_eq!(
            (page.load(4), page.times(4)),
            (word(11, ALL_DONE), times(2, 3))
        );
    }

    #[test]
    fn a_wait_on_a_word_nobody_sets_returns_at_its_timeout() {
        let page = page(4096);
        page.arm(1, 1);
        page.wait(1, word(1, PENDING), Duration::from_millis(20));
        // A word that is not the expected one returns at once.
        page.wait(1, word(9, PENDING), Duration::from_secs(3600));
        assert_eq!(page.load(1), word(1, PENDING));
    }
}
