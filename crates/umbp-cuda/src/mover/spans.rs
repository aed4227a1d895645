//! What a traced copy records: the spans callers get ([`TraceSpan`]), the recorder the mover
//! holds while tracing, and a device step waiting for its timing events.

use umbp_cuda_driver::Event;

/// One step of a traced copy (see [`CudaMover::start_trace`]). Device steps are timed with
/// CUDA events, host steps with the host clock; both count microseconds from the start of the
/// trace (the two clocks agree to within a few microseconds).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpan {
    /// `"store"` or `"load"`.
    pub direction: &'static str,
    /// `"kernel"` (gather/scatter), `"dma"` (copy-engine copies of one slice or one DMA
    /// batch), `"call"` (host: one mover call, submission to completion), `"slot_wait"` (host:
    /// waiting for a staging slot to come free, where events order the stages) or
    /// `"desc_wait"` (host: waiting for a kernel to finish reading a descriptor buffer).
    pub step: &'static str,
    /// Bytes the step moved (0 for waits).
    pub bytes: u64,
    /// Start, microseconds since the trace started.
    pub start_us: f64,
    /// End, microseconds since the trace started.
    pub end_us: f64,
}

#[derive(Debug)]
pub(super) struct Tracer {
    pub(super) base: Event,
    pub(super) t0: std::time::Instant,
    pub(super) spans: Vec<TraceSpan>,
}

/// A device step timed by two events.
pub(super) struct Timed {
    pub(super) step: &'static str,
    pub(super) bytes: u64,
    pub(super) t0: Event,
    pub(super) t1: Event,
}
