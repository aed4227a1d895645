//! The copy engine's side of the one store surface ([`umbp_core::kv_store`]): a
//! [`CopyError`] is a [`KvError`] and a [`JobHandle`] is a [`KvTransfer`].

use std::time::Duration;

use umbp_core::kv_store::{KvError, KvTransfer};
use umbp_core::{ErrorKind, KeyOutcome};

use crate::engine::JobHandle;
use crate::CopyError;

impl KvError for CopyError {
    fn error_kind(&self) -> ErrorKind {
        self.kind()
    }
}

impl KvTransfer for JobHandle {
    type Error = CopyError;

    fn poll(&self) -> Option<Vec<KeyOutcome>> {
        JobHandle::poll(self)
    }

    fn is_done(&self) -> bool {
        JobHandle::is_done(self)
    }

    fn wait(&self, timeout: Duration) -> Result<Vec<KeyOutcome>, CopyError> {
        JobHandle::wait(self, timeout)
    }

    fn cancel(&self) -> Result<(), CopyError> {
        JobHandle::cancel(self);
        Ok(())
    }

    fn elapsed(&self) -> Option<Duration> {
        JobHandle::elapsed(self)
    }
}
