//! One transfer's life, the same for both transports (gRPC and the transfer channel, which
//! are adapters over [`run`]): checked and submitted, counted in flight, named so that
//! `CancelTransfer` finds it, bounded by its deadline (then cancelled, then given
//! [`STOP_GRACE`] to stop), and answered exactly once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tonic::Status;
use umbp_copy::JobHandle;
use umbp_core::{Admit, ErrorKind, KeyOutcome};
use umbp_proto::errors::status;
use umbp_proto::{completion, v1};
use umbp_store::StoreError;

use crate::refusal::{invalid, status_of, unpack_keys};
use crate::sessions::ClientSession;
use crate::state::State;

/// Extra time a timed-out transfer gets to stop (keys being copied finish) before the reply.
pub(crate) const STOP_GRACE: Duration = Duration::from_secs(5);

/// How a started transfer ended: its reply, or an error when it did not stop in time.
pub(crate) type Outcome = Result<v1::TransferReply, Status>;

/// Checks and submits transfer `r` of session `cs` (received at `t`) and calls `answer`
/// exactly once when it ends: with the reply when its job finishes (keys its deadline
/// cancelled are reported timed out), or with an error when it does not stop within
/// [`STOP_GRACE`] of being cancelled. While its job runs it counts in flight and, with a
/// non-zero `transfer_id`, can be cancelled by name. A refused transfer is an error here
/// (`answer` is not called); a started one returns its job, for a transport that cancels it
/// when its caller goes away.
pub(crate) fn run(
    st: &Arc<State>,
    cs: &Arc<ClientSession>,
    r: &v1::TransferRequest,
    t: Instant,
    rt: &tokio::runtime::Handle,
    answer: impl FnOnce(Outcome) + Send + 'static,
) -> Result<JobHandle, Status> {
    let started = start(st, cs, r, t)?;
    let id = r.transfer_id;
    let job = started.job.clone();
    st.in_flight.fetch_add(1, Ordering::Relaxed);
    if id != 0 {
        cs.transfers.lock().insert(id, job.clone());
    }
    let timeout = if r.timeout_ms == 0 {
        st.store.timeout()
    } else {
        Duration::from_millis(r.timeout_ms as u64)
    };
    type Answer = Box<dyn FnOnce(Outcome) + Send>;
    let answer: Arc<Mutex<Option<Answer>>> = Arc::new(Mutex::new(Some(Box::new(answer))));
    // Set by the deadline task before it cancels the job.
    let timed_out = Arc::new(AtomicBool::new(false));
    {
        let (st, cs, answer, timed_out) = (
            Arc::clone(st),
            Arc::clone(cs),
            Arc::clone(&answer),
            Arc::clone(&timed_out),
        );
        // Runs on the copy worker that finishes the job (at once if it already has).
        job.on_done(move |results| {
            if id != 0 {
                cs.transfers.lock().remove(&id);
            }
            st.in_flight.fetch_sub(1, Ordering::Relaxed);
            let a = answer.lock().take();
            if let Some(a) = a {
                a(Ok(st.reply_of(
                    &started,
                    &results,
                    timed_out.load(Ordering::Acquire),
                )));
            }
        });
    }
    if !job.is_done() {
        let job = job.clone();
        rt.spawn(async move {
            if tokio::time::timeout(timeout, job.finished()).await.is_ok() {
                return;
            }
            timed_out.store(true, Ordering::Release);
            job.cancel();
            if tokio::time::timeout(STOP_GRACE, job.finished()).await.is_ok() {
                return;
            }
            let a = answer.lock().take();
            if let Some(a) = a {
                a(Err(status(
                    ErrorKind::TransferFailed,
                    format!(
                        "the transfer did not finish within {} ms nor stop {} s after it was cancelled; its memory may still be written",
                        timeout.as_millis(),
                        STOP_GRACE.as_secs()
                    ),
                )));
            }
        });
    }
    Ok(job)
}

/// Checks transfer request `r` of session `cs` (received at `t`) and submits its copy
/// job, with the session's completion page hooked to it when the request names a slot.
fn start(
    st: &State,
    cs: &ClientSession,
    r: &v1::TransferRequest,
    t: Instant,
) -> Result<Started, Status> {
    st.refuse_if_draining()?;
    let keys = unpack_keys(&r.keys, "keys").map_err(|s| st.refuse(s))?;
    if keys.len() != r.block_ids.len() {
        return Err(st.refuse(invalid(format!(
            "{} keys for {} block ids; give one key per block",
            keys.len(),
            r.block_ids.len()
        ))));
    }
    let dir = match v1::Direction::try_from(r.direction) {
        Ok(v1::Direction::Store) => umbp_copy::Direction::Store,
        Ok(v1::Direction::Load) => umbp_copy::Direction::Load,
        _ => {
            return Err(st.refuse(invalid(format!(
                "direction {} is neither store nor load",
                r.direction
            ))))
        }
    };
    if r.admit_now && dir == umbp_copy::Direction::Load {
        return Err(st.refuse(invalid(
            "admit_now is set on a load; it applies to stores only: send it false",
        )));
    }
    let completion = match r.completion_slot {
        0 => None,
        k => {
            let page = cs.res.lock().completions.clone().ok_or_else(|| {
                st.refuse(invalid(format!(
                    "completion slot {k} named, but session {} has no completion page; register one or send 0",
                    cs.id
                )))
            })?;
            let slot = k - 1;
            if slot >= page.page.slots() {
                return Err(st.refuse(invalid(format!(
                    "completion slot {k} is outside the session's page of {} slots; name 1 to {0}, or 0 for none",
                    page.page.slots()
                ))));
            }
            if r.completion_seq >= completion::SEQ_LIMIT {
                return Err(st.refuse(invalid(format!(
                    "completion sequence {} is too large; send one below 2^30",
                    r.completion_seq
                ))));
            }
            Some((page, slot, r.completion_seq))
        }
    };
    let object_bytes = cs
        .session
        .layout(r.layout_id)
        .and_then(|l| Ok(l.group(r.group).map_err(StoreError::from)?.object_bytes()))
        .map_err(|e| st.refuse(status_of(&e)))?;
    let submitted = Instant::now();
    let admit = if r.admit_now {
        Admit::Now
    } else {
        Admit::Policy
    };
    let job = match dir {
        umbp_copy::Direction::Store => {
            cs.session
                .store_as(r.layout_id, r.group, &r.block_ids, keys, admit)
        }
        umbp_copy::Direction::Load => cs.session.load(r.layout_id, r.group, &r.block_ids, keys),
    }
    .map_err(|e| st.refuse(status_of(&e)))?;
    if let Some((page, slot, seq)) = completion {
        // Runs on the copy worker that finishes the job: the client wakes from here,
        // without waiting for the reply, its encoding or the client's runtime.
        job.on_done(move |results| {
            let all_done = results.iter().all(|r| *r == KeyOutcome::Done);
            // Not published when the client already settled the slot (nothing to tell).
            let in_server = t.elapsed();
            let now = completion::monotonic_ns();
            let times = completion::SlotTimes {
                server_us: in_server.as_micros() as u64,
                copy_us: submitted.elapsed().as_micros() as u64,
                received_ns: now.saturating_sub(in_server.as_nanos() as u64),
                published_ns: now,
            };
            let _ = page.page.publish(slot, seq, all_done, &times);
        });
    }
    Ok(Started {
        job,
        dir,
        object_bytes,
        received: t,
        submitted,
    })
}

/// A transfer whose copy job is running.
pub(crate) struct Started {
    pub(crate) job: umbp_copy::JobHandle,
    dir: umbp_copy::Direction,
    object_bytes: u64,
    received: Instant,
    submitted: Instant,
}

impl State {
    /// The reply to transfer `s` that ended with `results` (cancelled by its deadline when
    /// `timed_out`), counted in the metrics.
    pub(crate) fn reply_of(
        &self,
        s: &Started,
        results: &[KeyOutcome],
        timed_out: bool,
    ) -> v1::TransferReply {
        let copy_micros = s.submitted.elapsed().as_micros() as u64;
        let (statuses, errors) = umbp_proto::outcomes::encode(results, timed_out);
        let ok = results.iter().filter(|r| r.is_ok()).count() as u64;
        let done = results.iter().filter(|r| **r == KeyOutcome::Done).count() as u64;
        let bytes = done * s.object_bytes;
        let m = match s.dir {
            umbp_copy::Direction::Store => &self.metrics.store,
            umbp_copy::Direction::Load => &self.metrics.load,
        };
        m.transfers.fetch_add(1, Ordering::Relaxed);
        m.keys_ok.fetch_add(ok, Ordering::Relaxed);
        m.keys_failed
            .fetch_add(results.len() as u64 - ok, Ordering::Relaxed);
        m.bytes.fetch_add(bytes, Ordering::Relaxed);
        let elapsed = s.received.elapsed();
        m.latency.observe(elapsed);
        v1::TransferReply {
            statuses,
            errors,
            bytes,
            server_micros: elapsed.as_micros() as u64,
            copy_micros,
        }
    }
}

/// Cancels a job when the request is dropped before it finished (the client went away or
/// cancelled the call).
pub(crate) struct CancelOnDrop(pub(crate) Option<umbp_copy::JobHandle>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(j) = self.0.take() {
            if !j.is_done() {
                j.cancel();
            }
        }
    }
}
