//! Wire format. Every frame is a 12-byte header followed by `body_len` bytes:
//!
//! | bytes | request | reply |
//! |---|---|---|
//! | 0..4 | magic `UMBL` | magic `UMBR` |
//! | 4 | op | status (0 ok, 1 error: body is a UTF-8 message) |
//! | 5..8 | zero | zero |
//! | 8..12 | body length, little-endian | body length |
//!
//! Request bodies: `PrefixHits` / `Exists` / `Holds`: group `u32`, hash length `u32`, then the
//! packed hashes. Replies: `PrefixHits`: hits `u32`; `Exists` and `Holds`: one byte per hash
//! (0/1); `Clear`:
//! removed `u64`; `Ping`: worker description (UTF-8).

use std::io::{Read, Write};

use thiserror::Error;
use umbp_core::ErrorKind;

pub(crate) const REQ_MAGIC: [u8; 4] = *b"UMBL";
pub(crate) const REP_MAGIC: [u8; 4] = *b"UMBR";
/// Most hashes in one request (a 4M-token prompt at block size 16). A request is answered
/// in chunks, so a worker's memory for one request stays small whatever its size.
pub(crate) const MAX_KEYS: usize = 1 << 18;
/// Largest hash, in bytes.
pub(crate) const MAX_HASH_LEN: usize = 32;
/// Largest body accepted (8 MiB and the 8-byte hash header: [`MAX_KEYS`] 32-byte hashes).
pub(crate) const MAX_BODY: usize = 8 + MAX_KEYS * MAX_HASH_LEN;

/// Operations of the lookup protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Liveness and a description of the worker.
    Ping = 1,
    /// How many blocks, from the first, the worker holds.
    PrefixHits = 2,
    /// Which blocks the worker holds.
    Exists = 3,
    /// Remove every object of the worker's pool.
    Clear = 4,
    /// Attach the client's shared hash buffer (the memfd rides along with `SCM_RIGHTS`).
    AttachShm = 5,
    /// `PrefixHits` with the hashes in the shared buffer.
    PrefixHitsShm = 6,
    /// `Exists` with the hashes in the shared buffer.
    ExistsShm = 7,
    /// Which blocks the worker's pool holds now, leasing nothing and reading no lower tier
    /// (the connector's event bookkeeping; a lookup a load follows is `Exists`).
    Holds = 8,
    /// `Holds` with the hashes in the shared buffer.
    HoldsShm = 9,
}

impl Op {
    pub(crate) fn from_u8(v: u8) -> Option<Op> {
        Some(match v {
            1 => Op::Ping,
            2 => Op::PrefixHits,
            3 => Op::Exists,
            4 => Op::Clear,
            5 => Op::AttachShm,
            6 => Op::PrefixHitsShm,
            7 => Op::ExistsShm,
            8 => Op::Holds,
            9 => Op::HoldsShm,
            _ => return None,
        })
    }
}

/// Errors of the lookup service.
#[derive(Debug, Error)]
pub enum LookupError {
    /// Socket I/O failed.
    #[error("lookup socket {path}: {source}")]
    Io {
        /// The socket.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The peer broke the protocol.
    #[error("lookup socket {path}: protocol error: {message}")]
    Protocol {
        /// The socket.
        path: String,
        /// What was wrong.
        message: String,
    },
    /// The worker answered with an error.
    #[error("lookup socket {path}: the worker reported: {message}")]
    Remote {
        /// The socket.
        path: String,
        /// Its message.
        message: String,
    },
    /// Another live process already serves this socket.
    #[error("lookup socket {0} is already served by a live process: another engine uses the same model/namespace, lookup_instance, data-parallel rank and worker rank on this host; give it a different lookup_instance")]
    InUse(String),
    /// Something other than a socket is at the socket path; it is left alone.
    #[error("{0} exists and is not a socket; it was left alone: remove it, or set lookup_dir to another directory")]
    NotASocket(String),
    /// The worker did not answer in time.
    #[error("lookup socket {path}: no answer within {ms} ms")]
    Timeout {
        /// The socket.
        path: String,
        /// The deadline.
        ms: u64,
    },
}

impl LookupError {
    /// The error's kind: a socket path in use (or not a socket) is a setting to change
    /// ([`ErrorKind::InvalidArgument`]); the rest mean the worker cannot be reached in time
    /// ([`ErrorKind::Unavailable`]) or broke the protocol ([`ErrorKind::Internal`]).
    pub fn kind(&self) -> ErrorKind {
        match self {
            LookupError::InUse(_) | LookupError::NotASocket(_) => ErrorKind::InvalidArgument,
            LookupError::Io { .. } | LookupError::Timeout { .. } => ErrorKind::Unavailable,
            LookupError::Protocol { .. } | LookupError::Remote { .. } => ErrorKind::Internal,
        }
    }
}

pub(crate) fn header(magic: [u8; 4], code: u8, body_len: usize) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(&magic);
    h[4] = code;
    h[8..12].copy_from_slice(&(body_len as u32).to_le_bytes());
    h
}

/// Reads one frame; returns `(code, body)`, or `None` on a clean end of stream.
///
/// A read timeout before the first byte is returned as that timeout with nothing consumed, so
/// callers may poll with short timeouts. Once a frame has started, timeouts are retried (a
/// peer that stops halfway through a frame for 200 timeouts in a row is an error).
pub(crate) fn read_frame(
    r: &mut impl Read,
    magic: [u8; 4],
) -> std::io::Result<Option<(u8, Vec<u8>)>> {
    let mut h = [0u8; 12];
    if !read_full(r, &mut h, true)? {
        return Ok(None);
    }
    finish_frame(r, magic, h, 12).map(Some)
}

/// Completes a frame whose first `got` header bytes are already in `h`.
pub(crate) fn finish_frame(
    r: &mut impl Read,
    magic: [u8; 4],
    mut h: [u8; 12],
    got: usize,
) -> std::io::Result<(u8, Vec<u8>)> {
    if got < 12 {
        read_full(r, &mut h[got..], false)?;
    }
    let (_, len) = parse_header(&h, magic, MAX_BODY)
        .map_err(|m| std::io::Error::new(std::io::ErrorKind::InvalidData, m))?;
    let mut body = vec![0u8; len];
    read_full(r, &mut body, false)?;
    Ok((h[4], body))
}

/// Decodes a frame header into `(code, body length)`; a wrong magic or a body longer than
/// `max_body` is an error.
pub(crate) fn parse_header(
    h: &[u8; 12],
    magic: [u8; 4],
    max_body: usize,
) -> Result<(u8, usize), String> {
    if h[..4] != magic {
        return Err("bad magic".into());
    }
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > max_body {
        return Err(format!(
            "frame of {len} bytes exceeds the {max_body}-byte limit"
        ));
    }
    Ok((h[4], len))
}

/// Fills `buf`. Returns false on end of stream before the first byte of a frame start.
fn read_full(r: &mut impl Read, buf: &mut [u8], frame_start: bool) -> std::io::Result<bool> {
    use std::io::ErrorKind::{Interrupted, TimedOut, UnexpectedEof, WouldBlock};
    let mut got = 0;
    let mut stalls = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 && frame_start => return Ok(false),
            Ok(0) => return Err(UnexpectedEof.into()),
            Ok(n) => {
                got += n;
                stalls = 0;
            }
            Err(e) if e.kind() == Interrupted => {}
            Err(e) if matches!(e.kind(), WouldBlock | TimedOut) => {
                if got == 0 && frame_start {
                    return Err(e);
                }
                stalls += 1;
                if stalls > 200 {
                    return Err(TimedOut.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

pub(crate) fn write_frame(
    w: &mut impl Write,
    magic: [u8; 4],
    code: u8,
    body: &[u8],
) -> std::io::Result<()> {
    w.write_all(&header(magic, code, body.len()))?;
    w.write_all(body)?;
    w.flush()
}

/// Encodes a `PrefixHits` / `Exists` body.
pub(crate) fn hashes_body(group: u32, hash_len: u32, packed: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + packed.len());
    b.extend_from_slice(&group.to_le_bytes());
    b.extend_from_slice(&hash_len.to_le_bytes());
    b.extend_from_slice(packed);
    b
}

/// Encodes a `PrefixHitsShm` / `ExistsShm` body.
pub(crate) fn shm_body(group: u32, hash_len: u32, offset: u64, len: u64) -> Vec<u8> {
    let mut b = Vec::with_capacity(24);
    b.extend_from_slice(&group.to_le_bytes());
    b.extend_from_slice(&hash_len.to_le_bytes());
    b.extend_from_slice(&offset.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b
}

/// Decodes a `PrefixHitsShm` / `ExistsShm` body into `(group, hash_len, offset, len)`.
pub(crate) fn parse_shm_body(body: &[u8]) -> Result<(u32, u32, u64, u64), String> {
    if body.len() != 24 {
        return Err(format!(
            "shared-buffer request of {} bytes, expected 24",
            body.len()
        ));
    }
    let u32_at = |i: usize| u32::from_le_bytes(body[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(body[i..i + 8].try_into().expect("8 bytes"));
    Ok((u32_at(0), u32_at(4), u64_at(8), u64_at(16)))
}

/// Decodes a `PrefixHits` / `Exists` body into `(group, hash_len, packed)`.
pub(crate) fn parse_hashes_body(body: &[u8]) -> Result<(u32, usize, &[u8]), String> {
    if body.len() < 8 {
        return Err("body shorter than its 8-byte header".into());
    }
    let group = u32::from_le_bytes(body[0..4].try_into().expect("4 bytes"));
    let hash_len = u32::from_le_bytes(body[4..8].try_into().expect("4 bytes")) as usize;
    let packed = &body[8..];
    if hash_len == 0 || hash_len > MAX_HASH_LEN || !packed.len().is_multiple_of(hash_len) {
        return Err(format!(
            "{} hash bytes are not a whole number of {hash_len}-byte hashes (1..=32)",
            packed.len()
        ));
    }
    Ok((group, hash_len, packed))
}

/// Fuzzing of every decoder with random and mutated input (bounded: runs in `cargo test`).
/// The live server's frame decoder is fuzzed over real sockets in `tests/fuzz.rs`.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn valid_frames() -> Vec<Vec<u8>> {
        let mut frames = Vec::new();
        for (op, body) in [
            (Op::Ping as u8, Vec::new()),
            (Op::Clear as u8, Vec::new()),
            (Op::PrefixHits as u8, hashes_body(0, 32, &[9u8; 32 * 3])),
            (Op::Exists as u8, hashes_body(1, 16, &[9u8; 16 * 5])),
            (Op::PrefixHitsShm as u8, shm_body(0, 32, 0, 320)),
            (Op::ExistsShm as u8, shm_body(2, 8, 64, 8)),
            (Op::Holds as u8, hashes_body(3, 16, &[7u8; 16 * 2])),
            (Op::HoldsShm as u8, shm_body(1, 16, 0, 32)),
        ] {
            let mut f = header(REQ_MAGIC, op, body.len()).to_vec();
            f.extend_from_slice(&body);
            frames.push(f);
        }
        frames
    }

    /// A valid frame with some bytes overwritten, then possibly cut or extended.
    fn mutated() -> impl Strategy<Value = Vec<u8>> {
        (
            0..6usize,
            proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            proptest::option::of(any::<usize>()),
            proptest::collection::vec(any::<u8>(), 0..16),
        )
            .prop_map(|(i, flips, cut, tail)| {
                let mut f = valid_frames().swap_remove(i);
                for (at, v) in flips {
                    let n = f.len();
                    f[at % n] = v;
                }
                if let Some(c) = cut {
                    f.truncate(c % (f.len() + 1));
                }
                f.extend_from_slice(&tail);
                f
            })
    }

    fn any_input() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![proptest::collection::vec(any::<u8>(), 0..96), mutated()]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn headers_decode_or_fail_cleanly(h in any::<[u8; 12]>(), max in 0usize..1 << 20) {
            if let Ok((code, len)) = parse_header(&h, REQ_MAGIC, max) {
                prop_assert_eq!(&h[..4], &REQ_MAGIC);
                prop_assert_eq!(code, h[4]);
                prop_assert!(len <= max);
            }
        }

        #[test]
        fn frames_decode_or_fail_cleanly(input in any_input()) {
            for magic in [REQ_MAGIC, REP_MAGIC] {
                let mut r = std::io::Cursor::new(&input);
                // Several frames may follow each other: decode until the input runs out.
                for _ in 0..8 {
                    match read_frame(&mut r, magic) {
                        Ok(Some((_, body))) => prop_assert!(body.len() <= MAX_BODY),
                        Ok(None) | Err(_) => break,
                    }
                }
            }
        }

        #[test]
        fn frames_round_trip(code in any::<u8>(), body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut buf = Vec::new();
            write_frame(&mut buf, REP_MAGIC, code, &body).unwrap();
            let got = read_frame(&mut std::io::Cursor::new(&buf), REP_MAGIC).unwrap();
            prop_assert_eq!(got, Some((code, body)));
        }

        #[test]
        fn hash_bodies_decode_or_fail_cleanly(input in any_input()) {
            let body = input.get(12..).unwrap_or(&input);
            if let Ok((_, hl, packed)) = parse_hashes_body(body) {
                prop_assert!((1..=MAX_HASH_LEN).contains(&hl));
                prop_assert_eq!(packed.len() % hl, 0);
                prop_assert_eq!(packed.len() + 8, body.len());
            }
        }

        #[test]
        fn shm_bodies_decode_or_fail_cleanly(input in any_input(), g: u32, hl: u32, off: u64, len: u64) {
            let body = input.get(12..).unwrap_or(&input);
            prop_assert_eq!(parse_shm_body(body).is_ok(), body.len() == 24);
            prop_assert_eq!(parse_shm_body(&shm_body(g, hl, off, len)), Ok((g, hl, off, len)));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

        /// Every range read from a sealed shared buffer is checked against its size.
        #[test]
        fn shared_buffer_ranges_are_checked(
            off in prop_oneof![any::<u64>(), 0u64..(crate::shm::SHM_BYTES as u64 + 64)],
            len in prop_oneof![any::<u64>(), 0u64..4096],
        ) {
            thread_local! {
                static READER: crate::shm::ShmReader = {
                    let w = crate::shm::ShmWriter::new().unwrap();
                    crate::shm::ShmReader::map(w.dup_fd().unwrap()).unwrap()
                };
            }
            let size = crate::shm::SHM_BYTES as u64;
            let inside = off.checked_add(len).is_some_and(|e| e <= size);
            let r = READER.with(|r| r.read(off, len));
            prop_assert_eq!(r.is_ok(), inside);
            if let Ok(v) = r {
                prop_assert_eq!(v.len() as u64, len);
            }
        }
    }
}
