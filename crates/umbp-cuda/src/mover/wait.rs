//! Waiting for a mover call's completion event without paying the driver's wake-up.
//!
//! A blocking `cuEventSynchronize` sleeps until the driver's completion interrupt wakes the
//! thread: on the H200 machine (a VM) the call was seen to return 100-240 µs after its last
//! copy ended, and a job's last call adds that to every job. Polling the event instead sees
//! the end at once but costs a core while it polls. So a call's thread sleeps, looking at the
//! event every 200 µs, until shortly before its copies should end (by the direction's recent
//! rate and the calls queued ahead of it), then polls; where the copies take much longer than
//! expected (the GPU busy with compute, a slower link), it stops polling after 0.5 ms and
//! blocks.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::Event;

/// The first estimate of a direction's rate, before any call was seen: 64 GB/s, more than a
/// PCIe Gen5 x16 link moves, so a first call is polled early rather than late.
const FIRST_NS_PER_BYTE: f64 = 1.0 / 64.0;
/// Expect the copies a little sooner than the recent rate says (a call may run faster than
/// the average), so the thread is awake when they end.
const OPTIMISM: f64 = 0.9;
/// Wake this long before the expected end (sleeps overshoot by tens of microseconds).
const EARLY: Duration = Duration::from_micros(150);
/// Poll at most this long past the expected end, then block on the event.
const POLL_PAST: Duration = Duration::from_micros(500);
/// Calls shorter than this do not tell the rate (their fixed costs dominate).
const LEARN_FROM_BYTES: u64 = 1 << 20;
/// While sleeping towards the expected end, look at the event this often.
const SLEEP_SLICE: Duration = Duration::from_micros(200);
/// Weight of a new call's rate in the direction's running estimate.
const ALPHA: f64 = 0.25;

/// A direction's estimate of when the copies queued on its streams end.
#[derive(Debug)]
pub(super) struct Eta {
    state: Mutex<EtaState>,
}

#[derive(Debug)]
struct EtaState {
    /// When the copies queued so far should end.
    busy_until: Option<Instant>,
    /// Recent nanoseconds per byte of this direction's calls.
    ns_per_byte: f64,
}

/// When one call's copies should start and end.
#[derive(Debug, Clone, Copy)]
pub(super) struct Expected {
    start: Instant,
    end: Instant,
    bytes: u64,
    /// Whether the call's time tells the direction's rate (not when its copies first waited
    /// on the device for the submitter's work).
    learn: bool,
}

impl Default for Eta {
    fn default() -> Self {
        Eta {
            state: Mutex::new(EtaState {
                busy_until: None,
                ns_per_byte: FIRST_NS_PER_BYTE,
            }),
        }
    }
}

impl Eta {
    /// Notes a call of `bytes` just queued behind whatever is queued already. `ordered`: its
    /// copies wait on the device for the submitter's work first, so its time says nothing of
    /// the copies' rate.
    pub(super) fn queued(&self, bytes: u64, ordered: bool) -> Expected {
        let now = Instant::now();
        let mut s = self.state.lock();
        let start = s.busy_until.map_or(now, |b| b.max(now));
        let took = Duration::from_nanos((bytes as f64 * s.ns_per_byte * OPTIMISM) as u64);
        let end = start + took;
        s.busy_until = Some(end);
        Expected {
            start,
            end,
            bytes,
            learn: !ordered && bytes >= LEARN_FROM_BYTES,
        }
    }

    /// Notes that the call `e` was seen finished at `at`, and learns its rate.
    fn finished(&self, e: &Expected, at: Instant) {
        let mut s = self.state.lock();
        // The direction is idle from `at` if nothing was queued after this call, however
        // wrong its estimate was; otherwise no sooner than `at`.
        if s.busy_until == Some(e.end) || s.busy_until.is_some_and(|b| b < at) {
            s.busy_until = Some(at);
        }
        // A call the estimate started after it ended (queued behind calls that ended sooner
        // than expected) tells nothing.
        if e.learn && at > e.start {
            let sample = (at - e.start).as_nanos() as f64 / e.bytes as f64;
            s.ns_per_byte = (1.0 - ALPHA) * s.ns_per_byte + ALPHA * sample;
        }
    }

    /// Waits until `done` (recorded after the call `e`) has completed: checks it every
    /// [`SLEEP_SLICE`] while sleeping until shortly before the expected end (so a wrong
    /// estimate costs at most one slice), polls until a while after it, then blocks.
    pub(super) fn wait(&self, done: &Event, e: &Expected) -> Result<(), CudaError> {
        loop {
            if done.query()? {
                self.finished(e, Instant::now());
                return Ok(());
            }
            match e
                .end
                .checked_duration_since(Instant::now())
                .and_then(|d| d.checked_sub(EARLY))
            {
                Some(d) => std::thread::sleep(d.min(SLEEP_SLICE)),
                None => break,
            }
        }
        let give_up = e.end.max(Instant::now()) + POLL_PAST;
        loop {
            if done.query()? {
                self.finished(e, Instant::now());
                return Ok(());
            }
            if Instant::now() >= give_up {
                done.synchronize()?;
                self.finished(e, Instant::now());
                return Ok(());
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(eta: &Eta) -> f64 {
        eta.state.lock().ns_per_byte
    }

    #[test]
    fn calls_queue_behind_each_other_and_the_rate_follows_what_was_seen() {
        let eta = Eta::default();
        let a = eta.queued(64 << 20, false);
        let b = eta.queued(64 << 20, false);
        // Behind `a`, as long again (64 MiB at 64 GB/s x 0.9: about 0.94 ms each).
        assert_eq!(b.start, a.end);
        assert_eq!(b.end - b.start, a.end - a.start);
        assert!(a.end - a.start > Duration::from_micros(800));
        assert!(a.end - a.start < Duration::from_micros(1100));
        // `a` took 2 ms: slower than the first guess, and the rate moves a quarter of the way.
        let before = rate(&eta);
        eta.finished(&a, a.start + Duration::from_millis(2));
        let after = rate(&eta);
        assert!(after > before && after < before + 0.5 * (2e6 / (64 << 20) as f64 - before));
        // `b`, queued behind `a`, cannot end before `a` was seen done: the direction is busy
        // until `b` is seen done.
        let seen = a.start + Duration::from_millis(3);
        eta.finished(&b, seen);
        assert_eq!(eta.state.lock().busy_until, Some(seen));
        // A call alone that ends sooner than expected: idle from when it was seen done.
        let e = eta.queued(64 << 20, false);
        let early = e.start + Duration::from_micros(10);
        eta.finished(&e, early);
        assert_eq!(eta.state.lock().busy_until, Some(early));
        // An ordered call, or a short one, does not move the rate.
        let r = rate(&eta);
        let c = eta.queued(64 << 20, true);
        eta.finished(&c, c.start + Duration::from_millis(50));
        let d = eta.queued(4096, false);
        eta.finished(&d, d.start + Duration::from_millis(50));
        assert_eq!(rate(&eta), r);
    }
}
