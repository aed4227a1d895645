//! Tracing a mover's copies step by step ([`TraceSpan`]) and accounting the kernels' GPU time.

use std::sync::atomic::Ordering;

use super::spans::{Timed, TraceSpan, Tracer};
use super::{CudaMover, Dir};
use umbp_cuda_driver::CudaError;
use umbp_cuda_driver::{Event, Stream};

impl CudaMover {
    /// Starts recording a timeline of every copy step (kernels, DMAs, mover calls and waits
    /// for staging slots) until [`CudaMover::take_trace`]. Costs two timing events per step;
    /// for diagnosing throughput, not for production.
    pub fn start_trace(&self) -> Result<(), CudaError> {
        let base = self.dev.event(true)?;
        let s = self.dev.stream()?;
        base.record(&s)?;
        base.synchronize()?;
        *self.tracer.lock() = Some(Tracer {
            base,
            t0: std::time::Instant::now(),
            spans: Vec::new(),
        });
        self.tracing.store(true, Ordering::Release);
        Ok(())
    }

    /// Stops tracing and returns the spans recorded since [`CudaMover::start_trace`] (empty
    /// when no trace was started), in the order their mover calls finished.
    pub fn take_trace(&self) -> Vec<TraceSpan> {
        self.tracing.store(false, Ordering::Release);
        self.tracer.lock().take().map_or_else(Vec::new, |t| t.spans)
    }

    pub(super) fn trace_host(
        &self,
        dir: Dir,
        step: &'static str,
        bytes: u64,
        from: std::time::Instant,
    ) {
        if let Some(t) = self.tracer.lock().as_mut() {
            let us = |i: std::time::Instant| i.saturating_duration_since(t.t0).as_secs_f64() * 1e6;
            t.spans.push(TraceSpan {
                direction: dir.name(),
                step,
                bytes,
                start_us: us(from),
                end_us: us(std::time::Instant::now()),
            });
        }
    }

    /// When tracing, a timing event recorded on `stream` before a DMA step (tracing never
    /// fails a copy: an event that cannot be had leaves the step out of the trace).
    pub(super) fn dma_begin(&self, stream: &Stream) -> Option<Event> {
        if !self.tracing.load(Ordering::Relaxed) {
            return None;
        }
        let t0 = self.take_event(true).ok()?;
        match t0.record(stream) {
            Ok(()) => Some(t0),
            Err(_) => {
                self.give_event(t0, true);
                None
            }
        }
    }

    /// Ends the DMA step that [`CudaMover::dma_begin`] started.
    pub(super) fn dma_end(
        &self,
        stream: &Stream,
        t0: Option<Event>,
        bytes: u64,
        timings: &mut Vec<Timed>,
    ) {
        let Some(t0) = t0 else {
            return;
        };
        match self.take_event(true) {
            Ok(t1) if t1.record(stream).is_ok() => timings.push(Timed {
                step: "dma",
                bytes,
                t0,
                t1,
            }),
            Ok(t1) => {
                // t0 may still be pending on the stream: drop it rather than reuse it.
                self.give_event(t1, true);
            }
            Err(_) => {}
        }
    }

    /// Adds the kernels' GPU time to the counters and, when tracing, the steps to the trace;
    /// every event of `timings` has completed.
    pub(super) fn account(&self, dir: Dir, timings: Vec<Timed>, call_start: std::time::Instant) {
        let mut ns = 0u64;
        let mut total = 0u64;
        let mut kernel_bytes = 0u64;
        // The tracer is locked only while a trace runs (this is on every call's path).
        let mut tracer = self
            .tracing
            .load(Ordering::Relaxed)
            .then(|| self.tracer.lock());
        for t in timings {
            if t.step == "kernel" {
                if let Ok(ms) = t.t1.elapsed_ms_since(&t.t0) {
                    ns += (f64::from(ms) * 1e6) as u64;
                    kernel_bytes += t.bytes;
                }
            } else {
                total += t.bytes;
            }
            if let Some(tr) = tracer.as_mut().and_then(|g| g.as_mut()) {
                if let (Ok(a), Ok(b)) = (
                    t.t0.elapsed_ms_since(&tr.base),
                    t.t1.elapsed_ms_since(&tr.base),
                ) {
                    tr.spans.push(TraceSpan {
                        direction: dir.name(),
                        step: t.step,
                        bytes: t.bytes,
                        start_us: f64::from(a) * 1e3,
                        end_us: f64::from(b) * 1e3,
                    });
                }
            }
            self.give_event(t.t0, true);
            self.give_event(t.t1, true);
        }
        let traced = tracer.is_some();
        drop(tracer);
        self.counters.kernel_ns.fetch_add(ns, Ordering::Relaxed);
        if kernel_bytes > 0 {
            self.note_kernels(
                dir,
                ns as f64 / 1e6 / (kernel_bytes as f64 / 1e9),
                kernel_bytes,
            );
        }
        if traced {
            self.trace_host(dir, "call", total, call_start);
        }
    }
}
