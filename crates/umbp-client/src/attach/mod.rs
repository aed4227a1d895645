//! Attaching to the server: the session every call runs in, made on first use and again
//! after the server or the connection went away, replaying what the client registered.

pub(crate) mod state;

use std::os::fd::AsFd;
use std::sync::Arc;

use umbp_core::ErrorKind;
use umbp_proto::{v1, PROTOCOL, SECRET_BYTES};

use self::state::{Attachment, NewSession};
use crate::channel::TransferChannel;
use crate::client::StandaloneClient;
use crate::completions;
use crate::error::{ClientError, Result};

impl StandaloneClient {
    /// Forgets the current session: the next call attaches again.
    pub(crate) fn lost(&self) {
        self.forget_attachment(None);
    }

    /// Forgets the current session if it is still attachment `generation`.
    pub(crate) fn lost_attachment(&self, generation: u64) {
        self.forget_attachment(Some(generation));
    }

    fn forget_attachment(&self, only: Option<u64>) {
        // The lock is not held while logging: a log record may wait for a lock of the
        // embedding program (the Python GIL), whose holder may want this one.
        if self.inner.attach.forget(only) {
            log::warn!(
                "umbp: lost the session with the server at {}; the next call attaches again",
                self.inner.opts.endpoint
            );
        }
    }

    /// The current attachment, attaching (and replaying registrations) when there is none.
    pub(crate) fn attachment(&self) -> Result<Attachment> {
        self.inner
            .attach
            .current_or_attach(|| self.open_session(), |a, again| self.set_up(a, again))
    }

    /// Asks the server for a session.
    fn open_session(&self) -> Result<NewSession> {
        let t = self.inner.opts.control_timeout;
        let name = self.inner.opts.client_name.clone();
        let r = self.call("attach", t, |mut g| async move {
            g.attach(v1::AttachRequest {
                client_name: name,
                protocol: PROTOCOL,
            })
            .await
        })?;
        let secret: [u8; SECRET_BYTES] =
            r.secret
                .as_slice()
                .try_into()
                .map_err(|_| ClientError::Refused {
                    call: "attach",
                    kind: ErrorKind::Internal,
                    message: "the server sent a malformed session secret".into(),
                })?;
        Ok(NewSession {
            session_id: r.session_id,
            boot_id: r.boot_id,
            secret,
            fd_socket: r.fd_socket.into(),
        })
    }

    /// Sets up the new attachment `a` (`again`: not this client's first): registers every
    /// region and layout again, then the completion page, and opens the transfer channel.
    fn set_up(&self, mut a: Attachment, again: bool) -> Result<Attachment> {
        if again {
            log::warn!(
                "umbp: attached again to the server at {} (boot id {}, session {}); registering memory and layouts again",
                self.inner.opts.endpoint, a.boot_id, a.session_id
            );
        }
        self.replay(&a)?;
        a.completion_slots = self.register_completions(&a);
        a.channel = self.open_channel(&a);
        Ok(a)
    }

    /// Registers every recorded region and layout in attachment `a`.
    fn replay(&self, a: &Attachment) -> Result<()> {
        self.inner.records.lock().replay(
            a.generation,
            |r| self.register_region_on(a, r.addr, r.len, &r.source),
            |rec, groups| Ok(self.register_layout_on(a, rec, groups)?.0),
        )
    }

    /// Opens the transfer channel of attachment `a`; None when the client does without one
    /// or the server opened none (transfers then go over gRPC).
    fn open_channel(&self, a: &Attachment) -> Option<Arc<TransferChannel>> {
        if !self.inner.opts.transfer_channel {
            return None;
        }
        TransferChannel::open(
            &a.fd_socket,
            a.session_id,
            &a.secret,
            self.inner.opts.max_message_bytes,
            &self.inner.opts.endpoint,
        )
        .unwrap_or_else(|e| {
            log::info!("umbp: no transfer channel ({e}); transfers go over gRPC");
            None
        })
    }

    /// Registers the completion page in attachment `a`; the slots the server accepted, 0 when
    /// it refused (the page cannot be mapped: transfers are then answered by their replies
    /// only).
    fn register_completions(&self, a: &Attachment) -> u32 {
        let Some(c) = &self.inner.completions else {
            return 0;
        };
        let sid = a.session_id;
        let length = c.len();
        let registered = self.send_fds(a, &[c.fd.as_fd()]).and_then(|t| {
            let ticket = t[0];
            self.call(
                "register_completion_page",
                self.inner.opts.control_timeout,
                |mut g| async move {
                    g.register_completion_page(v1::RegisterCompletionPageRequest {
                        session_id: sid,
                        ticket,
                        length,
                    })
                    .await
                },
            )
        });
        match registered {
            Ok(r) => r.slots.min(completions::SLOTS),
            Err(e) => {
                log::info!(
                    "umbp: the server at {} took no completion page ({e}); transfers are answered by their replies only",
                    self.inner.opts.endpoint
                );
                0
            }
        }
    }

    /// The session id and boot id of the current attachment (None when detached).
    pub fn session(&self) -> Option<(u64, String)> {
        self.inner.attach.session()
    }

    /// How many times this client attached (1 + re-attaches).
    pub fn attach_count(&self) -> u64 {
        self.inner.attach.attach_count()
    }
}
