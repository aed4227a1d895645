//! The client's attachment to the server as state: the current session ([`Attachment`]),
//! numbered by generation, and the rules for attaching, forgetting and re-attaching
//! ([`AttachState`]). The calls to the server are passed in, so that the rules are tested
//! without one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use umbp_proto::SECRET_BYTES;

use crate::channel::TransferChannel;
use crate::error::Result;

/// The server's session of this client.
#[derive(Debug, Clone)]
pub(crate) struct Attachment {
    /// Counts attaches of this client: server ids are valid in one generation only.
    pub(crate) generation: u64,
    pub(crate) session_id: u64,
    pub(crate) boot_id: String,
    pub(crate) secret: [u8; SECRET_BYTES],
    pub(crate) fd_socket: PathBuf,
    /// Slots of the completion page this session accepted (0: none; replies only).
    pub(crate) completion_slots: u32,
    /// The session's transfer channel, when the server opened one.
    pub(crate) channel: Option<Arc<TransferChannel>>,
}

/// A session the server opened for this client (its answer to an attach), not yet numbered
/// or set up.
#[derive(Debug)]
pub(crate) struct NewSession {
    pub(crate) session_id: u64,
    pub(crate) boot_id: String,
    pub(crate) secret: [u8; SECRET_BYTES],
    pub(crate) fd_socket: PathBuf,
}

/// Which session the client is attached in, if any, and how many it has had.
///
/// Detached (no current attachment) at first and whenever a call found the session gone;
/// the next call attaches again. An attachment is current only once it is set up (everything
/// registered again): one whose set-up failed is dropped, and the client stays detached.
#[derive(Debug, Default)]
pub(crate) struct AttachState {
    current: RwLock<Option<Attachment>>,
    /// Held while attaching (one attach at a time).
    attaching: Mutex<()>,
    /// The last generation handed out.
    generation: AtomicU64,
    /// Sessions the server opened for this client.
    attaches: AtomicU64,
}

impl AttachState {
    /// The current attachment (None when detached).
    pub(crate) fn current(&self) -> Option<Attachment> {
        self.current.read().clone()
    }

    /// The current attachment; when there is none, attaches, one caller at a time (the
    /// others wait and take its attachment): `attach` asks the server for a session, which
    /// gets the next generation, then `set_up` (told whether this client attached before)
    /// registers everything in it. The attachment is current once both succeeded; a failure
    /// of either is returned and leaves the client detached, for the next call to attach
    /// again.
    pub(crate) fn current_or_attach(
        &self,
        attach: impl FnOnce() -> Result<NewSession>,
        set_up: impl FnOnce(Attachment, bool) -> Result<Attachment>,
    ) -> Result<Attachment> {
        if let Some(a) = self.current() {
            return Ok(a);
        }
        let _one = self.attaching.lock();
        if let Some(a) = self.current() {
            return Ok(a);
        }
        let s = attach()?;
        let a = Attachment {
            generation: self.generation.fetch_add(1, Ordering::AcqRel) + 1,
            session_id: s.session_id,
            boot_id: s.boot_id,
            secret: s.secret,
            fd_socket: s.fd_socket,
            completion_slots: 0,
            channel: None,
        };
        let again = self.attaches.fetch_add(1, Ordering::Relaxed) > 0;
        let a = set_up(a, again)?;
        *self.current.write() = Some(a.clone());
        Ok(a)
    }

    /// Forgets the current attachment (any, or only generation `only`: a failure seen in an
    /// earlier session must not drop a newer one) and closes its transfer channel; whether
    /// one was forgotten. The lock is not held while closing.
    pub(crate) fn forget(&self, only: Option<u64>) -> bool {
        let gone = {
            let mut a = self.current.write();
            match (&*a, only) {
                (Some(cur), Some(g)) if cur.generation != g => None,
                _ => a.take(),
            }
        };
        let had = gone.is_some();
        if let Some(ch) = gone.and_then(|a| a.channel) {
            ch.close();
        }
        had
    }

    /// Takes the current attachment away, leaving the client detached (its channel is the
    /// caller's to close).
    pub(crate) fn take(&self) -> Option<Attachment> {
        self.current.write().take()
    }

    /// As [`take`](Self::take), for the client's last owner (no lock taken).
    pub(crate) fn take_mut(&mut self) -> Option<Attachment> {
        self.current.get_mut().take()
    }

    /// The session id and boot id of the current attachment (None when detached).
    pub(crate) fn session(&self) -> Option<(u64, String)> {
        self.current
            .read()
            .as_ref()
            .map(|a| (a.session_id, a.boot_id.clone()))
    }

    /// How many sessions the server opened for this client (1 + re-attaches).
    pub(crate) fn attach_count(&self) -> u64 {
        self.attaches.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::sync::mpsc;
    use std::time::Duration;

    use umbp_core::LayerSpec;
    use umbp_proto::channel::CHANNEL_OPENED;
    use umbp_proto::{Endpoint, FdHeader};

    use super::*;
    use crate::error::ClientError;
    use crate::register::records::{Records, Source};

    /// The server's answer to attach number `id`.
    fn session(id: u64) -> NewSession {
        NewSession {
            session_id: id,
            boot_id: format!("boot {id}"),
            secret: [id as u8; SECRET_BYTES],
            fd_socket: PathBuf::from("/nonexistent/umbp.sock.fds"),
        }
    }

    /// Attaches with session `id`, setting up nothing.
    fn attach(state: &AttachState, id: u64) -> Attachment {
        state
            .current_or_attach(|| Ok(session(id)), |a, _| Ok(a))
            .unwrap()
    }

    #[test]
    fn attaching_numbers_generations_and_reuses_the_current_attachment() {
        let s = AttachState::default();
        assert!(s.current().is_none());
        let mut agains = Vec::new();
        let a = s
            .current_or_attach(
                || Ok(session(7)),
                |a, again| {
                    agains.push(again);
                    Ok(a)
                },
            )
            .unwrap();
        assert_eq!((a.generation, a.session_id), (1, 7));
        assert_eq!(s.session(), Some((7, "boot 7".into())));
        // Attached: neither the server nor the set-up is asked again.
        let same = s
            .current_or_attach(|| panic!("attached again"), |_, _| panic!("set up again"))
            .unwrap();
        assert_eq!((same.generation, same.session_id), (1, 7));
        assert!(s.forget(None));
        assert!(s.current().is_none());
        s.current_or_attach(
            || Ok(session(8)),
            |a, again| {
                agains.push(again);
                Ok(a)
            },
        )
        .unwrap();
        // The set-up hears whether it is a re-attach (which it logs).
        assert_eq!(agains, [false, true]);
        assert_eq!(s.attach_count(), 2);
    }

    #[test]
    fn forgetting_a_stale_generation_keeps_the_current_attachment() {
        let s = AttachState::default();
        let first = attach(&s, 10);
        assert!(s.forget(None));
        let second = attach(&s, 11);
        assert_eq!((first.generation, second.generation), (1, 2));
        // A call of the first session failing late (a transfer answered meanwhile by the
        // completion page) must not drop the second.
        assert!(!s.forget(Some(first.generation)));
        assert_eq!(s.session(), Some((11, "boot 11".into())));
        // A failure in the current session does.
        assert!(s.forget(Some(second.generation)));
        assert_eq!(s.session(), None);
        // Nothing left to forget.
        assert!(!s.forget(None));
        assert!(!s.forget(Some(second.generation)));
    }

    #[test]
    fn a_failed_attach_call_counts_no_attach_and_uses_no_generation() {
        let s = AttachState::default();
        let e = s
            .current_or_attach(
                || {
                    Err(ClientError::Disconnected {
                        endpoint: "unix:///nowhere".into(),
                        reason: "gone".into(),
                    })
                },
                |_, _| panic!("set up without a session"),
            )
            .unwrap_err();
        assert!(matches!(e, ClientError::Disconnected { .. }), "{e}");
        assert_eq!(s.attach_count(), 0);
        assert!(s.current().is_none());
        assert_eq!(attach(&s, 1).generation, 1);
    }

    /// A stand-in for the server's side channel that opens one transfer channel and reports
    /// when the client closes it. Returns the socket's path and the report.
    fn fake_side_channel(dir: &std::path::Path) -> (PathBuf, mpsc::Receiver<()>) {
        let path = dir.join("umbp.sock.fds");
        let listener = UnixListener::bind(&path).unwrap();
        let (closed, report) = mpsc::channel();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut header = [0u8; FdHeader::BYTES];
            s.read_exact(&mut header).unwrap();
            s.write_all(&CHANNEL_OPENED.to_le_bytes()).unwrap();
            // Nothing is sent on it: the next read ends when the client shuts it down.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            let _ = closed.send(());
        });
        (path, report)
    }

    #[test]
    fn losing_the_attachment_closes_its_transfer_channel() {
        let dir = std::env::temp_dir().join(format!("umbp-attach-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (fd_socket, closed) = fake_side_channel(&dir);
        let endpoint = Endpoint::parse(dir.join("umbp.sock").to_str().unwrap()).unwrap();
        let s = AttachState::default();
        let a = s
            .current_or_attach(
                || Ok(session(3)),
                |mut a, _| {
                    a.fd_socket = fd_socket.clone();
                    a.channel = TransferChannel::open(
                        &a.fd_socket,
                        a.session_id,
                        &a.secret,
                        1 << 20,
                        &endpoint,
                    )
                    .unwrap();
                    Ok(a)
                },
            )
            .unwrap();
        let ch = a
            .channel
            .clone()
            .expect("the fake server opens the channel");
        assert!(ch.is_open());
        // A stale failure leaves the channel open.
        assert!(!s.forget(Some(a.generation + 1)));
        assert!(ch.is_open());
        assert!(s.forget(Some(a.generation)));
        assert!(!ch.is_open(), "the channel of a lost session stays open");
        closed
            .recv_timeout(Duration::from_secs(10))
            .expect("the server never saw the channel end");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn layer(base_addr: u64) -> LayerSpec {
        LayerSpec {
            base_addr,
            num_blocks: 4,
            block_stride: 0x100,
            block_bytes: 0x80,
        }
    }

    /// What the fake server was asked to register, in order.
    #[derive(Debug, PartialEq)]
    enum Registered {
        Region {
            addr: u64,
        },
        /// A layout's runs as (server region id, offset).
        Layout(Vec<(u64, u64)>),
    }

    /// Replays `rec` into attachment `a` as the client does, against a fake server that
    /// hands out ids from `next_id`, logs every registration to `log` and fails the
    /// registration numbered `fail_at` (counting from 0).
    fn replay(
        rec: &mut Records,
        a: &Attachment,
        next_id: &RefCell<u64>,
        log: &RefCell<Vec<Registered>>,
        fail_at: Option<usize>,
    ) -> Result<()> {
        let fail = |log: &RefCell<Vec<Registered>>| {
            (fail_at == Some(log.borrow().len() - 1)).then(|| ClientError::Disconnected {
                endpoint: "unix:///fake".into(),
                reason: "the server went away mid-replay".into(),
            })
        };
        let id = || {
            let mut n = next_id.borrow_mut();
            *n += 1;
            *n
        };
        rec.replay(
            a.generation,
            |r| {
                log.borrow_mut().push(Registered::Region { addr: r.addr });
                fail(log).map_or_else(|| Ok(id()), Err)
            },
            |rec, groups| {
                let runs = rec.layout_runs(groups, a.generation)?;
                log.borrow_mut().push(Registered::Layout(
                    runs.iter()
                        .flat_map(|g| g.runs.iter().map(|r| (r.region_id, r.offset)))
                        .collect(),
                ));
                fail(log).map_or_else(|| Ok(id() as u32), Err)
            },
        )
    }

    #[test]
    fn reattaching_replays_regions_then_layouts_in_order_keeping_client_ids() {
        let s = AttachState::default();
        let mut rec = Records::default();
        let first = attach(&s, 1);
        // Registered in the first session: server regions 100 and 101, layouts 50 and 51.
        let r0 = rec.add_region(0x20000, 0x1000, Source::Cuda, (first.generation, 100));
        let r1 = rec.add_region(0x10000, 0x1000, Source::Cuda, (first.generation, 101));
        let l0 = rec.add_layout(
            vec![vec![layer(0x10000), layer(0x20040)]],
            vec![0x100],
            (first.generation, 50),
        );
        let l1 = rec.add_layout(
            vec![vec![layer(0x20000)]],
            vec![0x80],
            (first.generation, 51),
        );
        assert_eq!((r0, r1, l0, l1), (0, 1, 0, 1));
        assert_eq!(rec.server_layout(l0, first.generation).unwrap(), 50);

        // The server restarts: a call fails, the session is forgotten.
        assert!(s.forget(None));
        let (next_id, log) = (RefCell::new(200), RefCell::new(Vec::new()));
        let second = s
            .current_or_attach(
                || Ok(session(2)),
                |a, again| {
                    assert!(again);
                    replay(&mut rec, &a, &next_id, &log, None)?;
                    Ok(a)
                },
            )
            .unwrap();
        assert_eq!(second.generation, 2);
        // Regions by client id, then layouts by client id, their runs naming the regions'
        // new server ids.
        assert_eq!(
            log.into_inner(),
            [
                Registered::Region { addr: 0x20000 },
                Registered::Region { addr: 0x10000 },
                Registered::Layout(vec![(202, 0), (201, 0x40)]),
                Registered::Layout(vec![(201, 0)]),
            ]
        );
        // The client's ids stay; their server ids are the new session's.
        assert_eq!(rec.regions[&r0].server, Some((2, 201)));
        assert_eq!(rec.regions[&r1].server, Some((2, 202)));
        assert_eq!(rec.server_layout(l0, second.generation).unwrap(), 203);
        assert_eq!(rec.server_layout(l1, second.generation).unwrap(), 204);
        assert_eq!(rec.object_bytes(l0, 0).unwrap(), 0x100);
        // The old session's ids are refused.
        let e = rec.server_layout(l0, first.generation).unwrap_err();
        assert!(matches!(e, ClientError::UnknownLayout(_)), "{e}");
    }

    #[test]
    fn a_failed_replay_leaves_the_client_detached_until_a_later_call_attaches() {
        let s = AttachState::default();
        let mut rec = Records::default();
        let first = attach(&s, 1);
        rec.add_region(0x10000, 0x1000, Source::Cuda, (first.generation, 100));
        rec.add_region(0x20000, 0x1000, Source::Cuda, (first.generation, 101));
        let l = rec.add_layout(
            vec![vec![layer(0x20000)]],
            vec![0x80],
            (first.generation, 50),
        );
        assert!(s.forget(Some(first.generation)));

        // The second region's registration fails: the attach fails with it.
        let (next_id, log) = (RefCell::new(200), RefCell::new(Vec::new()));
        let e = s
            .current_or_attach(
                || Ok(session(2)),
                |a, _| {
                    replay(&mut rec, &a, &next_id, &log, Some(1))?;
                    Ok(a)
                },
            )
            .unwrap_err();
        assert!(matches!(e, ClientError::Disconnected { .. }), "{e}");
        assert_eq!(log.borrow().len(), 2, "the replay went on after a failure");
        assert!(
            s.current().is_none(),
            "a half set-up session became current"
        );
        // What was replayed is of the dropped generation 2, the rest still of generation 1:
        // neither is usable until a full replay.
        assert_eq!(rec.regions[&0].server, Some((2, 201)));
        assert_eq!(rec.regions[&1].server, Some((1, 101)));
        assert!(rec.server_layout(l, 2).is_err());

        // The next call attaches again and replays everything.
        log.borrow_mut().clear();
        let third = s
            .current_or_attach(
                || Ok(session(3)),
                |a, _| {
                    replay(&mut rec, &a, &next_id, &log, None)?;
                    Ok(a)
                },
            )
            .unwrap();
        assert_eq!(third.generation, 3);
        assert_eq!(log.borrow().len(), 3);
        assert_eq!(rec.regions[&0].server, Some((3, 202)));
        assert_eq!(rec.regions[&1].server, Some((3, 203)));
        assert_eq!(rec.server_layout(l, third.generation).unwrap(), 204);
        assert_eq!(s.session(), Some((3, "boot 3".into())));
        assert_eq!(s.attach_count(), 3);
    }
}
