//! Events owned by UMBP ([`Event`]): made on a [`Device`], recorded on streams, waited for on
//! the host or by other streams, and timed.

use std::sync::Arc;

use super::context::Device;
use super::stream::Stream;
use crate::error::CudaError;
use crate::result;
use crate::sys::types::*;

impl Device {
    /// A new event: `timing` for elapsed-time measurement, else the cheapest kind; completion
    /// waits yield the CPU instead of spinning.
    pub fn event(self: &Arc<Self>, timing: bool) -> Result<Event, CudaError> {
        let _g = self.scoped()?;
        let flags = if timing {
            CU_EVENT_BLOCKING_SYNC
        } else {
            CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC
        };
        let e = result::event::event_create(self.drv, flags)?;
        Ok(Event {
            dev: Arc::clone(self),
            raw: e,
        })
    }

    /// Waits on the host for the latest record of `event`.
    ///
    /// # Safety
    /// `event` must be a live event handle of this device's context.
    pub unsafe fn wait_event(&self, event: CUevent) -> Result<(), CudaError> {
        // SAFETY: forwarded contract.
        unsafe { result::event::event_synchronize(self.drv, event) }
    }

    /// Whether the latest record of `event` has completed (never blocks; an error reads as
    /// not completed).
    ///
    /// # Safety
    /// `event` must be a live event handle of this device's context.
    pub unsafe fn event_done(&self, event: CUevent) -> bool {
        // SAFETY: forwarded contract.
        unsafe { result::event::event_query(self.drv, event) }.unwrap_or(false)
    }
}

/// An event owned by UMBP.
#[derive(Debug)]
pub struct Event {
    dev: Arc<Device>,
    raw: CUevent,
}

// SAFETY: event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// The raw handle.
    pub fn raw(&self) -> CUevent {
        self.raw
    }

    /// Records the event on a raw stream handle (any stream of this device's primary context,
    /// 0 for the legacy default stream).
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream of this device's primary context.
    pub unsafe fn record_raw(&self, stream: CUstream) -> Result<(), CudaError> {
        // SAFETY: a live event; forwarded contract for the stream.
        unsafe { result::event::event_record(self.dev.drv, self.raw, stream) }
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: &Stream) -> Result<(), CudaError> {
        // SAFETY: one of our live streams.
        unsafe { self.record_raw(stream.raw()) }
    }

    /// Blocks (yielding) until the event's latest record completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        // SAFETY: a live event.
        unsafe { result::event::event_synchronize(self.dev.drv, self.raw) }
    }

    /// Whether the latest record completed (never blocks).
    pub fn query(&self) -> Result<bool, CudaError> {
        // SAFETY: a live event.
        unsafe { result::event::event_query(self.dev.drv, self.raw) }
    }

    /// Milliseconds from `start` to this event (both timing events, both completed).
    pub fn elapsed_ms_since(&self, start: &Event) -> Result<f32, CudaError> {
        // SAFETY: live events (whether they time is the driver's to check).
        unsafe { result::event::event_elapsed_time(self.dev.drv, start.raw, self.raw) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if result::driver().is_ok() {
            // SAFETY: our event; the driver defers destruction until pending work completes.
            let _ = unsafe { result::event::event_destroy(self.dev.drv, self.raw) };
        }
    }
}
