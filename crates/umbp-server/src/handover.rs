//! A server upgraded in place: the running one hands its pool (memory and index) to the one
//! that replaces it, which serves every object from the same memory.
//!
//! Three ways, one payload (the pool's memfd and its image, `umbp_pool::image`, in a sealed
//! memfd of its own):
//! * **direct** (`--take-over`): the new server connects to `<endpoint>.handover` (the old
//!   one listens there with `--hand-over`, its own user and root only) and asks; the old one
//!   stops as on SIGTERM, hands over, waits for the taker's acknowledgement, removes its
//!   socket files and exits; the taker then binds the endpoint. If the taker goes before
//!   acknowledging, the old server executes itself again, adopting its own pool (below), so
//!   one of the two always serves.
//! * **systemd** (`--hand-over` under a unit with `FileDescriptorStoreMax=2`): on SIGTERM the
//!   two descriptors go to the service manager's descriptor store (`FDSTORE=1`), which hands
//!   them to the next start (`LISTEN_FDS`, names `umbp-pool` and `umbp-image`).
//! * **inherited** (`UMBP_ADOPT_FDS=<pool>,<image>`): the fallback's re-execution above.
//!
//! A taker that cannot use the image (another format, another geometry) starts empty and says
//! why; it never serves from a torn index. Objects being written while the old server
//! stopped are not in the image.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use umbp_store::EmbeddedStore;
use umbp_unix::memfd::{self, Seals};

/// What a taker sends first.
const REQUEST: &str = "UMBP-TAKE-OVER 1";
/// What a taker answers once it has the pool (used or not): the old server may go.
const ACK: &str = "TAKEN";
/// The environment variable of the inherited descriptors (`<pool fd>,<image fd>`).
pub(crate) const ADOPT_FDS_ENV: &str = "UMBP_ADOPT_FDS";
/// Names of the descriptors in systemd's store.
const POOL_NAME: &str = "umbp-pool";
const IMAGE_NAME: &str = "umbp-image";

/// The hand-over socket of the server at `endpoint`.
pub(crate) fn socket_path(endpoint: &Path) -> PathBuf {
    let mut p = endpoint.as_os_str().to_owned();
    p.push(".handover");
    PathBuf::from(p)
}

/// A pool another server handed over: its memory, its image's bytes, where it came from.
#[derive(Debug)]
pub(crate) struct Handed {
    pub(crate) pool: OwnedFd,
    pub(crate) image: Vec<u8>,
    pub(crate) from: String,
}

fn read_image(fd: OwnedFd) -> Result<Vec<u8>, String> {
    let size = memfd::file_info(&fd)
        .map_err(|e| format!("cannot fstat the image: {}", e.to_io()))?
        .size;
    if size > 1 << 34 {
        return Err(format!("an image of {size} bytes is not believable"));
    }
    let mut buf = vec![0u8; size as usize];
    let mut got = 0;
    while got < buf.len() {
        let n = memfd::read_at(&fd, &mut buf[got..], got as u64)
            .map_err(|e| format!("cannot read the image: {}", e.to_io()))?;
        if n == 0 {
            return Err("the image ended early".into());
        }
        got += n;
    }
    Ok(buf)
}

/// The image in a sealed memfd (nothing can change it once sent).
fn image_memfd(bytes: &[u8]) -> Result<OwnedFd, String> {
    let fd = memfd::create(c"umbp-image", bytes.len() as u64, None)
        .map_err(|e| format!("cannot make the image's memfd: {}", e.to_io()))?;
    let mut f = File::from(fd);
    f.write_all(bytes)
        .map_err(|e| format!("cannot write the image: {e}"))?;
    let fd = OwnedFd::from(f);
    memfd::add_seals(
        &fd,
        Seals::SHRINK | Seals::GROW | Seals::WRITE | Seals::SEAL,
    )
    .map_err(|e| format!("cannot seal the image: {}", e.to_io()))?;
    Ok(fd)
}

// -- the taker ----------------------------------------------------------------------------

/// The taker's side of a direct hand-over: asks the server at `endpoint` for its pool. `None`
/// when no server listens there for a hand-over (start as usual); otherwise the pool (or why
/// there is none) and the connection, to [`finish_taking`] once the pool is adopted.
pub(crate) fn take_over(endpoint: &Path) -> Option<(Result<Handed, String>, UnixStream)> {
    let path = socket_path(endpoint);
    let stream = match UnixStream::connect(&path) {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(
                socket = %path.display(),
                "--take-over: no server hands a pool over there ({e}); starting as usual"
            );
            return None;
        }
    };
    let got = ask(&stream);
    Some((got, stream))
}

fn ask(stream: &UnixStream) -> Result<Handed, String> {
    // The old server drains its transfers first (its --shutdown-grace-ms at most).
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .map_err(|e| e.to_string())?;
    (&*stream)
        .write_all(format!("{REQUEST}\n").as_bytes())
        .map_err(|e| format!("cannot ask the running server: {e}"))?;
    let mut buf = vec![0u8; 4096];
    let r = umbp_unix::fdpass::recv_with_fds(stream.as_fd(), &mut buf, 2, false)
        .map_err(|e| format!("no answer from the running server: {}", e.to_io()))?;
    if r.len == 0 {
        return Err("the running server ended before it handed its pool over".into());
    }
    let line = String::from_utf8_lossy(&buf[..r.len]).trim().to_owned();
    if let Some(why) = line.strip_prefix("REFUSED ") {
        return Err(format!(
            "the running server could not hand its pool over: {why}"
        ));
    }
    let mut fds = r.fds.into_iter();
    let (Some(pool), Some(image), true) = (fds.next(), fds.next(), line.starts_with("POOL "))
    else {
        return Err(format!("the running server answered {line:?}"));
    };
    Ok(Handed {
        pool,
        image: read_image(image)?,
        from: format!("the running server ({line})"),
    })
}

/// Tells the old server it may go, then waits (up to `wait`) until it has: its socket files
/// are gone when the connection closes.
pub(crate) fn finish_taking(stream: UnixStream, wait: Duration) {
    if let Err(e) = (&stream).write_all(format!("{ACK}\n").as_bytes()) {
        tracing::warn!("could not acknowledge the hand-over ({e}); the old server may have gone");
    }
    let _ = stream.set_read_timeout(Some(wait));
    let mut rest = Vec::new();
    if let Err(e) = (&stream).read_to_end(&mut rest) {
        tracing::warn!("the old server did not go within {wait:?} ({e}); binding regardless");
    }
}

/// A pool handed through an `exec` ([`ADOPT_FDS_ENV`]) or by systemd's descriptor store
/// (`LISTEN_FDS` with the names `umbp-pool` and `umbp-image`), if any: taken once.
pub(crate) fn inherited() -> Option<Result<Handed, String>> {
    // Read once, at start (the variable stays: the runtime's threads run already, so the
    // environment is not changed under them; a later re-execution sets its own).
    if let Ok(v) = std::env::var(ADOPT_FDS_ENV) {
        let nums: Vec<i32> = v.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        let [pool, image] = nums[..] else {
            return Some(Err(format!(
                "{ADOPT_FDS_ENV}={v:?} is not two descriptor numbers"
            )));
        };
        return Some(take_fds(
            pool,
            image,
            format!("this server's earlier run ({ADOPT_FDS_ENV})"),
        ));
    }
    let pid: u32 = std::env::var("LISTEN_PID").ok()?.parse().ok()?;
    if pid != std::process::id() {
        return None;
    }
    let n: i32 = std::env::var("LISTEN_FDS").ok()?.parse().ok()?;
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    let names: Vec<&str> = names.split(':').collect();
    let at = |name: &str| names.iter().position(|x| *x == name).map(|i| 3 + i as i32);
    let (Some(pool), Some(image)) = (at(POOL_NAME), at(IMAGE_NAME)) else {
        return None;
    };
    if pool >= 3 + n || image >= 3 + n {
        return None;
    }
    Some(take_fds(pool, image, "systemd's descriptor store".into()))
}

fn take_fds(pool: i32, image: i32, from: String) -> Result<Handed, String> {
    // SAFETY: the numbers come from the variable set for this process by whoever exec'd it
    // (this server, or systemd), read once; nothing else in the process uses them.
    let take = |fd| unsafe { umbp_unix::process::adopt_inherited_fd(fd) };
    let pool = take(pool).map_err(|e| format!("descriptor {pool}: {}", e.to_io()))?;
    let image = take(image).map_err(|e| format!("descriptor {image}: {}", e.to_io()))?;
    Ok(Handed {
        pool,
        image: read_image(image)?,
        from,
    })
}

// -- the giver ----------------------------------------------------------------------------

/// Reads a taker's request on `stream` (one line); whether it is one.
pub(crate) fn read_request(stream: &UnixStream) -> bool {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut line = String::new();
    let mut r = BufReader::new(stream);
    r.read_line(&mut line).is_ok() && line.trim() == REQUEST
}

/// How a hand-over ended for the giver.
#[derive(Debug)]
pub(crate) enum Given {
    /// The taker has the pool: go.
    Taken,
    /// Nothing was handed over (the store refused, or could not); the store is as it was
    /// or closed normally by the caller.
    Refused(String),
    /// The taker went without acknowledging: the pool is still ours (re-adopt it).
    Orphaned { pool: OwnedFd, image: OwnedFd },
}

/// Hands `store`'s pool to the taker at `stream`: closes the store (see
/// [`EmbeddedStore::hand_over`]), sends the memfd and the image, waits for the taker's
/// acknowledgement.
pub(crate) fn give(stream: &UnixStream, store: &EmbeddedStore, generation: u64) -> Given {
    let t = std::time::Instant::now();
    let (pool, image) = match store.hand_over(generation) {
        Ok(x) => x,
        Err(e) => {
            let why = e.to_string().replace('\n', " ");
            let _ = (&*stream).write_all(format!("REFUSED {why}\n").as_bytes());
            return Given::Refused(why);
        }
    };
    let objects = image.records.len();
    let image = match image_memfd(&image.encode()) {
        Ok(fd) => fd,
        Err(why) => {
            let _ = (&*stream).write_all(format!("REFUSED {why}\n").as_bytes());
            return Given::Refused(why);
        }
    };
    let head = format!("POOL generation={generation} objects={objects}\n");
    let sent = umbp_unix::fdpass::send_with_fds(
        stream.as_fd(),
        head.as_bytes(),
        &[pool.as_fd(), image.as_fd()],
    );
    if let Err(e) = sent {
        tracing::warn!("could not send the pool to the taker: {}", e.to_io());
        return Given::Orphaned { pool, image };
    }
    let sent_ms = t.elapsed().as_millis() as u64;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let mut line = String::new();
    let got = BufReader::new(stream).read_line(&mut line);
    tracing::info!(
        objects,
        sent_ms,
        acknowledged_ms = t.elapsed().as_millis() as u64,
        "hand-over: the store stopped and the pool was sent, then the taker answered"
    );
    match got {
        Ok(_) if line.trim() == ACK => Given::Taken,
        _ => Given::Orphaned { pool, image },
    }
}

/// Whether systemd's descriptor store can take a pool (`$NOTIFY_SOCKET` is set).
pub(crate) fn under_systemd() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some()
}

/// Hands `store`'s pool to systemd's descriptor store, for the unit's next start: the
/// objects handed, or why none were (the store is closed either way once it tried).
pub(crate) fn park_in_systemd(store: &EmbeddedStore, generation: u64) -> Result<usize, String> {
    let (pool, image) = store.hand_over(generation).map_err(|e| e.to_string())?;
    let objects = image.records.len();
    let image = image_memfd(&image.encode())?;
    if store_in_systemd(&pool, &image) {
        Ok(objects)
    } else {
        Err(
            "the service manager did not take the descriptors (NOTIFY_SOCKET unreachable, or \
             the unit lacks FileDescriptorStoreMax=2)"
                .into(),
        )
    }
}

/// Puts the pool in systemd's descriptor store (`FDSTORE=1` to `$NOTIFY_SOCKET`), for the
/// next start of the unit; false when not run by systemd or the store refused.
fn store_in_systemd(pool: &OwnedFd, image: &OwnedFd) -> bool {
    let Some(addr) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let sock = match std::os::unix::net::UnixDatagram::unbound() {
        Ok(s) => s,
        Err(_) => return false,
    };
    let connected = match addr.to_str().and_then(|a| a.strip_prefix('@')) {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name)
                .and_then(|a| sock.connect_addr(&a))
        }
        None => sock.connect(&addr),
    };
    if connected.is_err() {
        return false;
    }
    for (fd, name) in [(pool, POOL_NAME), (image, IMAGE_NAME)] {
        let msg = format!("FDSTORE=1\nFDNAME={name}\n");
        if umbp_unix::fdpass::send_with_fds(sock.as_fd(), msg.as_bytes(), &[fd.as_fd()]).is_err() {
            return false;
        }
    }
    true
}

/// Executes this server's binary again, with the same arguments, adopting `pool` and
/// `image` ([`ADOPT_FDS_ENV`]); returns only when that fails.
pub(crate) fn reexec_adopting(pool: &OwnedFd, image: &OwnedFd) -> String {
    for fd in [pool, image] {
        if let Err(e) = umbp_unix::process::keep_across_exec(fd) {
            return format!("cannot keep the pool across exec: {}", e.to_io());
        }
    }
    // Without --take-over (it has the pool), still handing over (which --take-over implies).
    let mut args: Vec<_> = std::env::args_os()
        .skip(1)
        .filter(|a| a != "--take-over" && a != "--hand-over")
        .collect();
    args.push("--hand-over".into());
    let err = std::os::unix::process::CommandExt::exec(
        std::process::Command::new("/proc/self/exe")
            .args(args)
            .env_remove("UMBP_TAKE_OVER")
            .env_remove("UMBP_HAND_OVER")
            .env(
                ADOPT_FDS_ENV,
                format!("{},{}", pool.as_raw_fd(), image.as_raw_fd()),
            ),
    );
    format!("cannot execute the server again: {err}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_image_travels_in_a_sealed_memfd() {
        let bytes: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let fd = image_memfd(&bytes).unwrap();
        let seals = memfd::seals(&fd).unwrap();
        assert!(seals.contains(Seals::WRITE | Seals::SHRINK | Seals::SEAL));
        assert_eq!(read_image(fd).unwrap(), bytes);
    }

    #[test]
    fn the_handover_socket_sits_beside_the_endpoint() {
        assert_eq!(
            socket_path(Path::new("/run/umbp/node.sock")),
            PathBuf::from("/run/umbp/node.sock.handover")
        );
    }
}
