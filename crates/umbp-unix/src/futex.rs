//! Sleeping on a `u32` of memory that other processes map too: never `FUTEX_PRIVATE`, so a
//! wake-up from a process mapping the same file reaches a waiter here.

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex::{self, Flags};

use crate::{Op, UnixError};

/// How a [`wait`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// A wake-up came (or the kernel returned early: look at the word again).
    Woken,
    /// The word did not hold the expected value: no sleep at all.
    Changed,
    /// The timeout passed.
    TimedOut,
    /// A signal interrupted the sleep.
    Interrupted,
}

/// Sleeps while `word` holds `expected`, at most `timeout` (forever when `None`).
pub fn wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) -> Result<Wake, UnixError> {
    let ts = timeout.map(|t| rustix::time::Timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: t.subsec_nanos() as _,
    });
    match futex::wait(word, Flags::empty(), expected, ts.as_ref()) {
        Ok(()) => Ok(Wake::Woken),
        Err(rustix::io::Errno::AGAIN) => Ok(Wake::Changed),
        Err(rustix::io::Errno::TIMEDOUT) => Ok(Wake::TimedOut),
        Err(rustix::io::Errno::INTR) => Ok(Wake::Interrupted),
        Err(e) => Err(UnixError::os(Op::FutexWait, e)),
    }
}

/// Wakes at most `max` waiters of `word`: how many woke.
pub fn wake(word: &AtomicU32, max: u32) -> Result<usize, UnixError> {
    futex::wake(word, Flags::empty(), max).map_err(|e| UnixError::os(Op::FutexWake, e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::SharedMapping;
    use crate::memfd;
    use std::sync::atomic::Ordering;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_wait_ends_at_its_timeout_or_at_once_on_another_value() {
        let w = AtomicU32::new(5);
        let t = Instant::now();
        assert_eq!(
            wait(&w, 5, Some(Duration::from_millis(20))).unwrap(),
            Wake::TimedOut
        );
        assert!(t.elapsed() >= Duration::from_millis(15));
        assert_eq!(wait(&w, 6, None).unwrap(), Wake::Changed);
        assert_eq!(wake(&w, 1).unwrap(), 0);
    }

    #[test]
    fn a_wake_reaches_a_waiter_of_another_thread() {
        let w = Arc::new(AtomicU32::new(0));
        let w2 = Arc::clone(&w);
        let t = std::thread::spawn(move || {
            while w2.load(Ordering::Acquire) == 0 {
                wait(&w2, 0, Some(Duration::from_secs(10))).unwrap();
            }
        });
        std::thread::sleep(Duration::from_millis(20));
        w.store(1, Ordering::Release);
        wake(&w, 1).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn a_wake_crosses_two_mappings_of_one_memfd() {
        // Two mappings of one file are two addresses of one page: only a shared futex (keyed
        // by the page, not the address) reaches from one to the other, as between processes.
        let fd = memfd::create(c"umbp-test", 4096, None).unwrap();
        let a = Arc::new(SharedMapping::map(&fd, 4096).unwrap());
        let b = SharedMapping::map(&fd, 4096).unwrap();
        assert_ne!(a.as_ptr(), b.as_ptr());
        let a2 = Arc::clone(&a);
        let t = std::thread::spawn(move || {
            let w = a2.atomic_u32(64);
            let start = Instant::now();
            while w.load(Ordering::Acquire) == 0 {
                wait(w, 0, Some(Duration::from_secs(10))).unwrap();
            }
            start.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        let w = b.atomic_u32(64);
        w.store(1, Ordering::Release);
        let mut woke = 0;
        let deadline = Instant::now() + Duration::from_secs(5);
        while woke == 0 && !t.is_finished() && Instant::now() < deadline {
            woke = wake(w, 1).unwrap();
        }
        let waited = t.join().unwrap();
        assert!(waited < Duration::from_secs(5), "{waited:?}");
    }
}
