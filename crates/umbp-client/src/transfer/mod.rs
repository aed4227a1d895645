//! Transfers: starting a store or load (on the transfer channel, else over gRPC) and the
//! [`Transfer`] a caller waits on, answered by the completion page or the reply. A transfer
//! that fails as a whole answers every key failed (see `failed`).

pub(crate) mod answer;
mod failed;

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_core::{Admit, BlockKey, ErrorKind, KeyOutcome};
use umbp_proto::completion::{self, ALL_DONE, PENDING, REPLIED, WAIT_SLICE};
use umbp_proto::v1;

pub use self::answer::TransferTiming;
use self::answer::{decode_reply, Answer, Slot};
pub(crate) use self::failed::FailureLog;
use crate::channel::Pending;
use crate::client::StandaloneClient;
use crate::completions::Lease;
use crate::error::{ClientError, Result};
use crate::eta;
use crate::rpc::{session_lost, status_error};

impl StandaloneClient {
    /// Starts storing blocks `block_ids` of group `group` of `layout` under `keys`. When the
    /// server cannot take it (gone, restarting, or stalled on an earlier transfer) the
    /// transfer is answered at once with every key failed ([`Transfer::failure`] says why);
    /// other errors (bad input, an unknown layout, a closed client) are returned.
    pub fn store(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        self.store_as(layout, group, block_ids, keys, Admit::Policy)
    }

    /// [`StandaloneClient::store`], meeting the server pool's store admission as `admit` says
    /// ([`Admit::Now`]: kept on each key's first sighting even under `on_reuse`).
    pub fn store_as(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
        admit: Admit,
    ) -> Result<Transfer> {
        self.start(
            (v1::Direction::Store, admit),
            layout,
            group,
            block_ids,
            keys,
        )
    }

    /// Starts loading `keys` into blocks `block_ids` of group `group` of `layout` (a server
    /// that cannot take it answers as for [`StandaloneClient::store`]).
    pub fn load(
        &self,
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        self.start(
            (v1::Direction::Load, Admit::Policy),
            layout,
            group,
            block_ids,
            keys,
        )
    }

    fn start(
        &self,
        dir: (v1::Direction, Admit),
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        match self.transfer(dir, layout, group, block_ids, keys) {
            Err(e) if e.kind().is_disconnect() => Ok(self.failed_transfer(keys.len(), &e)),
            r => r,
        }
    }

    /// A transfer of `keys` keys the server could not take: answered, every key failed.
    fn failed_transfer(&self, keys: usize, e: &ClientError) -> Transfer {
        let now = Instant::now();
        Transfer {
            client: self.clone(),
            slot: Arc::new(Slot::failed(e)),
            lease: None,
            page_answer: std::sync::OnceLock::new(),
            keys,
            sent: now,
            sent_ns: 0,
            session_id: 0,
            transfer_id: 0,
            deadline: now,
            timeout: Duration::ZERO,
            stalled_marked: AtomicBool::new(false),
            eta_key: (0, 0, false),
            due: None,
            logged: AtomicBool::new(false),
        }
    }

    fn transfer(
        &self,
        (dir, admit): (v1::Direction, Admit),
        layout: u32,
        group: u32,
        block_ids: &[u64],
        keys: &[BlockKey],
    ) -> Result<Transfer> {
        self.check()?;
        if keys.len() != block_ids.len() {
            return Err(ClientError::Invalid(format!(
                "{} keys for {} block ids; give one key per block",
                keys.len(),
                block_ids.len()
            )));
        }
        if self.inner.stalled_transfers.load(Ordering::Acquire) > 0 {
            return Err(ClientError::Stalled { what: "transfer" });
        }
        let (a, layout_id) = self.server_layout(layout)?;
        let transfer_id = self.inner.next_transfer.fetch_add(1, Ordering::Relaxed);
        let mut packed = Vec::with_capacity(keys.len() * umbp_proto::KEY_BYTES);
        for k in keys {
            packed.extend_from_slice(k.as_bytes());
        }
        let timeout = self.inner.opts.transfer_timeout;
        let lease = match &self.inner.completions {
            Some(c) if a.completion_slots > 0 => c.lease(a.completion_slots).map(Arc::new),
            _ => None,
        };
        let (completion_slot, completion_seq) =
            lease.as_ref().map_or((0, 0), |l| (l.slot + 1, l.seq));
        let req = v1::TransferRequest {
            session_id: a.session_id,
            layout_id,
            group,
            direction: dir as i32,
            block_ids: block_ids.to_vec(),
            keys: packed,
            timeout_ms: timeout.as_millis().min(u32::MAX as u128) as u32,
            transfer_id,
            completion_slot,
            completion_seq,
            admit_now: admit == Admit::Now,
        };
        let slot = Arc::new(Slot::default());
        let n = keys.len();
        let sent = Instant::now();
        let sent_ns = completion::monotonic_ns();
        let done = Transfer {
            client: self.clone(),
            slot: Arc::clone(&slot),
            lease: lease.clone(),
            page_answer: std::sync::OnceLock::new(),
            keys: n,
            sent,
            sent_ns,
            session_id: a.session_id,
            transfer_id,
            deadline: sent + timeout,
            timeout,
            stalled_marked: AtomicBool::new(false),
            eta_key: (layout, group, dir == v1::Direction::Store),
            logged: AtomicBool::new(false),
            due: self
                .inner
                .eta
                .due((layout, group, dir == v1::Direction::Store), n, sent),
        };
        // The transfer channel first: written by this thread, no runtime hand-off.
        let mut lease = lease;
        if let Some(ch) = a.channel.as_ref().filter(|c| c.is_open()) {
            let p = Pending {
                slot: Arc::clone(&slot),
                lease: lease.take(),
                sent,
                keys: n,
                _client: Arc::clone(&self.inner) as Arc<dyn Any + Send + Sync>,
            };
            match ch.send(&req, p) {
                Ok(()) => return Ok(done),
                Err(p) => lease = p.lease,
            }
        }
        let s2 = Arc::clone(&slot);
        let mut grpc = self.inner.grpc.clone();
        // The task keeps the client alive until the server answers (dropping every handle
        // does not cancel a transfer); `Inner`'s drop copes with being run on this task.
        let me = self.clone();
        let l2 = lease;
        let generation = a.generation;
        self.inner.rt().spawn(async move {
            let r = grpc.transfer(req).await;
            let out = match r {
                Ok(reply) => {
                    let reply = reply.into_inner();
                    *s2.timing.lock() = Some(TransferTiming {
                        round_trip: sent.elapsed(),
                        server: Duration::from_micros(reply.server_micros),
                        copy: Duration::from_micros(reply.copy_micros),
                        completion_page: false,
                        to_server: None,
                        to_caller: None,
                    });
                    decode_reply(reply, n)
                }
                Err(s) => {
                    // Only this transfer's session: the caller may have moved on (answered
                    // by the completion page) and attached again meanwhile.
                    if session_lost(&s) {
                        me.lost_attachment(generation);
                    }
                    Err(status_error("transfer", &me.inner.opts.endpoint, s))
                }
            };
            s2.fill(out);
            // A waiter asleep on the page wakes for the reply (the server may never have set
            // the slot: a refused or unfinished transfer).
            if let Some(l) = l2 {
                l.page().settle(l.slot, l.seq, REPLIED);
            }
        });
        Ok(done)
    }
}

/// A transfer in flight. Dropping it does not cancel it.
///
/// Its answer is one [`KeyOutcome`] per key. A transfer that failed as a whole (the server
/// could not take it, went away before answering, or refused it) answers every key
/// [`umbp_core::FailureKind::Server`], and [`Transfer::failure`] says why.
#[derive(Debug)]
pub struct Transfer {
    client: StandaloneClient,
    slot: Arc<Slot>,
    /// Its slot of the completion page, when it has one.
    lease: Option<Arc<Lease>>,
    /// Set when the page was first seen saying every key is done (then the answer).
    page_answer: std::sync::OnceLock<TransferTiming>,
    keys: usize,
    sent: Instant,
    /// `sent` on the host's monotonic clock, in nanoseconds (see [`TransferTiming::to_server`]).
    sent_ns: u64,
    session_id: u64,
    transfer_id: u64,
    deadline: Instant,
    timeout: Duration,
    stalled_marked: AtomicBool,
    /// What kind of transfer it is for [`eta::TransferEta`], and when its answer is due.
    eta_key: eta::EtaKey,
    due: Option<Instant>,
    /// Set once its failure as a whole was noted in the client's log.
    logged: AtomicBool,
}

impl Transfer {
    /// Per-key outcomes once answered, else None. Never blocks.
    pub fn poll(&self) -> Option<Vec<KeyOutcome>> {
        // The page first: once it says every key is done, that is the answer, even if the
        // reply later fails (the server died after finishing the job).
        if self.all_done() {
            return Some(self.done_by_page());
        }
        let v = self.slot.value.lock();
        v.as_ref().map(|r| self.take(r))
    }

    /// Why the transfer failed as a whole (every key then failed), once answered: the error's
    /// kind and message. None while pending and for a transfer the server answered.
    pub fn failure(&self) -> Option<(ErrorKind, String)> {
        if self.all_done() {
            return None;
        }
        match self.slot.value.lock().as_ref() {
            Some(Err(e)) => Some(e.clone()),
            _ => None,
        }
    }

    /// Whether the completion page says every key is done; the first time it does, the
    /// answer is kept (with the page's times), so it never changes afterwards.
    fn all_done(&self) -> bool {
        if self.page_answer.get().is_some() {
            return true;
        }
        let Some(l) = &self.lease else {
            return false;
        };
        if l.page().load(l.slot) != completion::word(l.seq, ALL_DONE) {
            return false;
        }
        // A transfer marked stalled is answered now: later transfers need not wait for its
        // reply to go on.
        if self.stalled_marked.load(Ordering::Acquire)
            && !self.slot.stall_cleared.swap(true, Ordering::AcqRel)
        {
            self.client
                .inner
                .stalled_transfers
                .fetch_sub(1, Ordering::AcqRel);
        }
        let seen_ns = completion::monotonic_ns();
        let t = l.page().times(l.slot);
        let between =
            |from: u64, to: u64| (from > 0 && to >= from).then(|| Duration::from_nanos(to - from));
        let _ = self.page_answer.set(TransferTiming {
            round_trip: self.sent.elapsed(),
            server: Duration::from_micros(t.server_us),
            copy: Duration::from_micros(t.copy_us),
            completion_page: true,
            to_server: between(self.sent_ns, t.received_ns),
            to_caller: between(t.published_ns, seen_ns),
        });
        true
    }

    /// The answer the completion page gave: every key done.
    fn done_by_page(&self) -> Vec<KeyOutcome> {
        vec![KeyOutcome::Done; self.keys]
    }

    /// Sleeps on the completion page until the server sets the slot, the reply arrives or
    /// `until`; the answer when the page says every key is done. Near the time the answer is
    /// due (see [`eta`]) the caller watches the page word instead of sleeping, to be running
    /// when the answer comes rather than woken after it.
    fn wait_on_page(&self, l: &Lease, until: Instant) -> Option<Vec<KeyOutcome>> {
        let pending = completion::word(l.seq, PENDING);
        let mut waited = false;
        loop {
            if self.all_done() {
                // Only an answer that came while this caller waited tells how long the
                // transfer took (not one a late caller or a second wait found).
                if waited {
                    if let Some(t) = self.page_answer.get() {
                        self.client
                            .inner
                            .eta
                            .answered(self.eta_key, self.keys, t.round_trip);
                    }
                }
                return Some(self.done_by_page());
            }
            waited = true;
            let w = l.page().load(l.slot);
            // Anything else than pending (some keys not done, the reply, a late write of an
            // earlier use): the reply says.
            if w != pending {
                return None;
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            let mut sleep = (until - now).min(WAIT_SLICE);
            if let Some(due) = self.due {
                let wake = due.checked_sub(eta::EARLY).unwrap_or(due);
                if now >= wake && now < due + eta::WATCH_PAST {
                    std::thread::yield_now();
                    continue;
                }
                if now < wake {
                    sleep = sleep.min(wake - now);
                }
            }
            l.page().wait(l.slot, pending, sleep);
        }
    }

    /// The outcomes of answer `r`: every key failed when the transfer failed as a whole (noted
    /// in the client's log the first time).
    fn take(&self, r: &Answer) -> Vec<KeyOutcome> {
        match r {
            Ok(s) => s.clone(),
            Err((_, message)) => {
                if !self.logged.swap(true, Ordering::AcqRel) {
                    let endpoint = self.client.inner.opts.endpoint.to_string();
                    self.client.inner.transfer_failures.note(&endpoint, message);
                }
                failed::every_key_failed(self.keys, message)
            }
        }
    }

    /// Where the time went, once the server has answered (None before, or after a failed
    /// call).
    pub fn timing(&self) -> Option<TransferTiming> {
        if self.all_done() {
            return self.page_answer.get().copied();
        }
        *self.slot.timing.lock()
    }

    /// From the call to the end of the transfer, once answered (None before, and for a
    /// transfer that failed as a whole): to the server plus the server's part when the
    /// completion page answered (its time to the job's end: not when the caller happened to
    /// look), else the round trip to the reply.
    pub fn elapsed(&self) -> Option<Duration> {
        self.timing().map(|t| match t.to_server {
            Some(to) if t.completion_page => to + t.server,
            _ => t.round_trip,
        })
    }

    /// Whether the server has answered.
    pub fn is_done(&self) -> bool {
        self.slot.value.lock().is_some() || self.all_done()
    }

    /// Waits up to `timeout` (None: the transfer's own deadline) for the answer; the only error
    /// is [`ClientError::Timeout`], for a transfer still pending (its memory may still be
    /// written). Past the transfer's deadline an unanswered transfer counts as stalled: new
    /// transfers of the client fail at once until the server answers it.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<KeyOutcome>> {
        let until = match timeout {
            Some(t) => Instant::now() + t,
            None => self.deadline,
        };
        if let Some(l) = &self.lease {
            if let Some(done) = self.wait_on_page(l, until) {
                return Ok(done);
            }
        }
        let mut v = self.slot.value.lock();
        while v.is_none() {
            if self.slot.ready.wait_until(&mut v, until).timed_out() {
                break;
            }
        }
        if let Some(r) = v.as_ref() {
            return Ok(self.take(r));
        }
        drop(v);
        if Instant::now() >= self.deadline && !self.stalled_marked.swap(true, Ordering::AcqRel) {
            let stalled = Arc::clone(&self.client.inner.stalled_transfers);
            stalled.fetch_add(1, Ordering::AcqRel);
            let slot = Arc::clone(&self.slot);
            self.client.inner.rt().spawn_blocking(move || {
                let mut v = slot.value.lock();
                while v.is_none() {
                    slot.ready.wait(&mut v);
                }
                if !slot.stall_cleared.swap(true, Ordering::AcqRel) {
                    stalled.fetch_sub(1, Ordering::AcqRel);
                }
            });
        }
        Err(ClientError::Timeout {
            what: "transfer",
            ms: timeout.unwrap_or(self.timeout).as_millis() as u64,
        })
    }

    /// Asks the server to stop the transfer (keys not started end cancelled); wait for the
    /// answer before reusing its memory.
    pub fn cancel(&self) -> Result<()> {
        if self.is_done() {
            return Ok(());
        }
        let (session_id, transfer_id) = (self.session_id, self.transfer_id);
        self.client.call(
            "cancel_transfer",
            self.client.inner.opts.control_timeout,
            |mut g| async move {
                g.cancel_transfer(v1::CancelTransferRequest {
                    session_id,
                    transfer_id,
                })
                .await
            },
        )?;
        Ok(())
    }
}
