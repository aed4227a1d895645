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
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A slot's word for use `seq` (taken modulo [`SEQ_LIMIT`]) in state `state`.
pub fn word(seq: u32, state: u32) -> u32 {
    ((seq % SEQ_LIMIT) << 2) | (state & 3)
}

/// A view of a completion page mapped in this process. Every access is atomic: the other
/// process may write any slot at any time.
#[derive(Debug)]
pub struct CompletionPage {
    base: *mut u8,
    slots: u32,
}

// SAFETY: the page is only reached through atomic loads and stores (and futex calls, which
// the kernel makes atomic), from any thread; the pointer itself is never handed out.
unsafe impl Send for CompletionPage {}
// SAFETY: as for Send: shared access is atomic only.
unsafe impl Sync for CompletionPage {}

impl CompletionPage {
    /// A view of `len` bytes at `base`, holding `len / SLOT_BYTES` slots.
    ///
    /// # Safety
    /// `[base, base + len)` is a read-write mapping that stays mapped, and cannot fault, for
    /// as long as the view lives (a `MAP_SHARED` mapping of a memfd sealed against shrinking);
    /// `base` is aligned to [`SLOT_BYTES`].
    pub unsafe fn new(base: *mut u8, len: u64) -> Result<Self, ProtoError> {
        if !(SLOT_BYTES..=MAX_PAGE_BYTES).contains(&len) {
            return Err(ProtoError::CompletionPage(format!(
                "{len} bytes; give {SLOT_BYTES} to {MAX_PAGE_BYTES} bytes"
            )));
        }
        if !(base as u64).is_multiple_of(SLOT_BYTES) {
            return Err(ProtoError::CompletionPage(format!(
                "its address {base:p} is not {SLOT_BYTES}-byte aligned"
            )));
        }
        Ok(CompletionPage {
            base,
            slots: (len / SLOT_BYTES) as u32,
        })
    }

    /// Slots in the page.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    fn slot_ptr(&self, slot: u32) -> *mut u8 {
        assert!(
            slot < self.slots,
            "slot {slot} of a {}-slot page",
            self.slots
        );
        // SAFETY: `slot < slots`, so the offset stays inside the mapping (`new`'s contract).
        unsafe { self.base.add((slot as u64 * SLOT_BYTES) as usize) }
    }

    fn word_of(&self, slot: u32) -> &AtomicU32 {
        // SAFETY: the slot's first 4 bytes are inside the live mapping and 64-byte aligned;
        // they are only ever accessed atomically.
        unsafe { &*(self.slot_ptr(slot) as *const AtomicU32) }
    }

    fn time_of(&self, slot: u32, i: usize) -> &AtomicU64 {
        debug_assert!((1..TIMES).contains(&i));
        // SAFETY: bytes 8 * i .. 8 * i + 8 (i is 1 to 4) of the slot are inside the live
        // mapping (a slot is 64 bytes) and 8-byte aligned; they are only ever accessed
        // atomically.
        unsafe { &*(self.slot_ptr(slot).add(8 * i) as *const AtomicU64) }
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
        let ts = libc::timespec {
            tv_sec: timeout.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        self.futex(slot, libc::FUTEX_WAIT, expected as i32, &ts);
    }

    /// Wakes waiters of the slot's word: bounded, so a client that parks many threads on its
    /// own words cannot make a copy worker wake them all.
    fn wake(&self, slot: u32) {
        self.futex(slot, libc::FUTEX_WAKE, MAX_WOKEN, std::ptr::null());
    }

    /// One futex call on the slot's word. Not FUTEX_PRIVATE: the other side is another
    /// process mapping the same memfd.
    fn futex(&self, slot: u32, op: libc::c_int, val: i32, ts: *const libc::timespec) {
        // SAFETY: the word is a live, aligned u32 of a shared mapping; FUTEX_WAIT only reads it
        // (atomically) and sleeps, FUTEX_WAKE touches no memory; `ts` is null or outlives
        // the call.
        unsafe {
            libc::syscall(libc::SYS_futex, self.word_of(slot).as_ptr(), op, val, ts);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    /// A page in this process's own anonymous shared memory.
    struct Mem(*mut u8, usize);
    impl Mem {
        fn new(len: usize) -> Mem {
            // SAFETY: a fresh anonymous mapping; checked below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Mem(p as *mut u8, len)
        }
    }
    impl Drop for Mem {
        fn drop(&mut self) {
            // SAFETY: our own mapping, unmapped once, after every view of it is gone.
            unsafe { libc::munmap(self.0 as *mut libc::c_void, self.1) };
        }
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
        let m = Mem::new(4096);
        // SAFETY: the mapping outlives the views (each dropped at once).
        unsafe {
            assert!(CompletionPage::new(m.0, 0).is_err());
            assert!(CompletionPage::new(m.0, MAX_PAGE_BYTES + 4096).is_err());
            assert!(CompletionPage::new(m.0.add(8), 1024).is_err());
            assert_eq!(CompletionPage::new(m.0, 4096).unwrap().slots(), 64);
        }
    }

    #[test]
    fn a_published_slot_wakes_its_waiter_with_the_times() {
        let m = Mem::new(4096);
        // SAFETY: the mapping outlives the page (dropped after the thread is joined).
        let page = Arc::new(unsafe { CompletionPage::new(m.0, 4096) }.unwrap());
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
        let m = Mem::new(4096);
        // SAFETY: the mapping outlives the page.
        let page = unsafe { CompletionPage::new(m.0, 4096) }.unwrap();
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
        let m = Mem::new(4096);
        // SAFETY: the mapping outlives the page.
        let page = unsafe { CompletionPage::new(m.0, 4096) }.unwrap();
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
        let m = Mem::new(4096);
        // SAFETY: the mapping outlives the page.
        let page = unsafe { CompletionPage::new(m.0, 4096) }.unwrap();
        page.arm(1, 1);
        page.wait(1, word(1, PENDING), Duration::from_millis(20));
        // A word that is not the expected one returns at once.
        page.wait(1, word(9, PENDING), Duration::from_secs(3600));
        assert_eq!(page.load(1), word(1, PENDING));
    }
}
