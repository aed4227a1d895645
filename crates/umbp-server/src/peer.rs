//! Who is at the other end of a connection: the peer's credentials, which the listener
//! (`listen`) fills in and the access check (`config`) and every request read.

use crate::budget::Short;

/// Who is at the other end of a connection (from `SO_PEERCRED`), and which connection it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerInfo {
    /// Unique per accepted connection.
    pub conn: u64,
    /// The peer's user id.
    pub uid: u32,
    /// The peer's group id.
    pub gid: u32,
    /// The peer's process id (0 when the kernel could not tell, e.g. another pid namespace).
    pub pid: u32,
    /// Set when the connection got no descriptor budget: every request on it is refused with
    /// this reason, and it is closed soon after.
    pub(crate) refused: Option<Short>,
}
