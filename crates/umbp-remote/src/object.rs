//! How one pool object is kept in the remote store.
//!
//! The value holds a header, then the object's bytes:
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0..4   | magic `UMBR` |
//! | 4      | format version (1) |
//! | 5..8   | zero |
//! | 8..72  | the object's [`BlockKey`] (its 64 bytes) |
//! | 72..80 | payload length, little-endian `u64` |
//! | 80..88 | XXH3-64 of the payload, little-endian |
//! | 88..   | the payload |
//!
//! The remote key is `umbp:v1:` and the block key's 64 bytes in hex: the block key already
//! carries the namespace (model, layout, dtype) and the ranks, so objects of different models
//! and layouts never meet, exactly as in the pool.

use umbp_core::key::KEY_BYTES;
use umbp_core::BlockKey;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes before the payload.
pub const HEADER_BYTES: usize = 88;
const MAGIC: &[u8; 4] = b"UMBR";
const VERSION: u8 = 1;
/// Prefix of every remote key (for `SCAN MATCH umbp:v1:*`).
pub const REMOTE_KEY_PREFIX: &str = "umbp:v1:";

/// The remote key of a block key.
pub fn remote_key(key: &BlockKey) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(REMOTE_KEY_PREFIX.len() + 2 * KEY_BYTES);
    s.push_str(REMOTE_KEY_PREFIX);
    for b in key.as_bytes() {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

/// The header of `key`'s object `payload`.
pub fn header(key: &BlockKey, payload: &[u8]) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..4].copy_from_slice(MAGIC);
    h[4] = VERSION;
    h[8..72].copy_from_slice(key.as_bytes());
    h[72..80].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    h[80..88].copy_from_slice(&xxh3_64(payload).to_le_bytes());
    h
}

/// Appends the value of `key`'s object `payload` to `out` (cleared first).
pub fn encode_into(key: &BlockKey, payload: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(HEADER_BYTES + payload.len());
    out.extend_from_slice(&header(key, payload));
    out.extend_from_slice(payload);
}

/// The value of an object as one command argument: the header and the object's bytes (in the
/// pool) are written straight into the command's buffer, with no buffer of its own between.
#[derive(Debug, Clone, Copy)]
pub struct Encoded<'a> {
    /// The object's key.
    pub key: &'a BlockKey,
    /// Its bytes.
    pub payload: &'a [u8],
}

impl redis::ToRedisArgs for Encoded<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        // Writes into a growing in-memory buffer cannot fail.
        w.write_all(&header(self.key, self.payload))
            .and_then(|()| w.write_all(self.payload))
            .expect("writing into the command buffer");
    }
}

/// Why a remote value was not taken as the object it was fetched for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// Shorter than a header, or not this format (another writer, another version).
    NotAnObject,
    /// It names another key.
    WrongKey,
    /// Its length field disagrees with the bytes present.
    WrongLength,
    /// Its payload does not match its checksum.
    BadChecksum,
}

/// The payload of `value`, if it is `key`'s object and intact.
pub fn decode<'v>(key: &BlockKey, value: &'v [u8]) -> Result<&'v [u8], Reject> {
    let (payload, sum) = parse(key, value)?;
    if xxh3_64(payload) != sum {
        return Err(Reject::BadChecksum);
    }
    Ok(payload)
}

/// Everything of [`decode`] but the checksum: the payload and the checksum it must have
/// (for [`copy_checked`], which checks it while copying).
pub fn parse<'v>(key: &BlockKey, value: &'v [u8]) -> Result<(&'v [u8], u64), Reject> {
    if value.len() < HEADER_BYTES || &value[..4] != MAGIC || value[4] != VERSION {
        return Err(Reject::NotAnObject);
    }
    if &value[8..72] != key.as_bytes() {
        return Err(Reject::WrongKey);
    }
    let len = u64::from_le_bytes(value[72..80].try_into().expect("8 bytes"));
    let payload = &value[HEADER_BYTES..];
    if len != payload.len() as u64 {
        return Err(Reject::WrongLength);
    }
    let sum = u64::from_le_bytes(value[80..88].try_into().expect("8 bytes"));
    Ok((payload, sum))
}

/// Bytes copied and hashed at a time by [`copy_checked`]: each piece is hashed from cache
/// right after it was read for the copy.
const PIECE: usize = 64 << 10;

/// Copies `payload` into `dst` (as long) piece by piece, hashing each piece as it goes;
/// whether the payload's XXH3-64 is `sum`. One pass over the payload's memory instead of two.
pub fn copy_checked(dst: &mut [u8], payload: &[u8], sum: u64) -> bool {
    assert_eq!(dst.len(), payload.len(), "copy_checked needs equal lengths");
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for (d, p) in dst.chunks_mut(PIECE).zip(payload.chunks(PIECE)) {
        // SAFETY: `d` and `p` are equal-length pieces of two distinct slices (`dst` is
        // borrowed mutably, so it cannot alias `payload`).
        unsafe { umbp_copy::memcpy::copy(d.as_mut_ptr(), p.as_ptr(), p.len()) };
        h.update(p);
    }
    umbp_copy::memcpy::fence();
    h.digest() == sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use umbp_core::{KeyBuilder, RankTopology};

    fn key(h: &[u8]) -> BlockKey {
        KeyBuilder::new("remote-test", RankTopology::default())
            .unwrap()
            .key(0, h)
            .unwrap()
    }

    #[test]
    fn round_trip_and_every_rejection() {
        let (k, other) = (key(b"a"), key(b"b"));
        let payload: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
        let mut v = Vec::new();
        encode_into(&k, &payload, &mut v);
        assert_eq!(v.len(), HEADER_BYTES + payload.len());
        assert_eq!(decode(&k, &v), Ok(&payload[..]));
        assert_eq!(decode(&other, &v), Err(Reject::WrongKey));
        assert_eq!(decode(&k, &v[..HEADER_BYTES - 1]), Err(Reject::NotAnObject));
        assert_eq!(
            decode(&k, b"garbage written by redis-cli"),
            Err(Reject::NotAnObject)
        );
        assert_eq!(decode(&k, &v[..v.len() - 1]), Err(Reject::WrongLength));
        let mut flipped = v.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(decode(&k, &flipped), Err(Reject::BadChecksum));
        let mut bad_version = v.clone();
        bad_version[4] = 2;
        assert_eq!(decode(&k, &bad_version), Err(Reject::NotAnObject));
        // Checking while copying agrees with decode.
        let (p, sum) = parse(&k, &v).unwrap();
        let mut dst = vec![0u8; p.len()];
        assert!(copy_checked(&mut dst, p, sum) && dst == payload);
        let (p, sum) = parse(&k, &flipped).unwrap();
        let mut dst = vec![0u8; p.len()];
        assert!(!copy_checked(&mut dst, p, sum));
        // An empty payload is an object too.
        encode_into(&k, &[], &mut v);
        assert_eq!(decode(&k, &v), Ok(&[][..]));
    }

    #[test]
    fn remote_keys_differ_by_namespace_and_rank() {
        let a = KeyBuilder::new("model-a", RankTopology::default()).unwrap();
        let b = KeyBuilder::new("model-b", RankTopology::default()).unwrap();
        let r1 = KeyBuilder::new(
            "model-a",
            RankTopology {
                tp: 1,
                ..Default::default()
            },
        )
        .unwrap();
        let ka = remote_key(&a.key(0, b"h").unwrap());
        assert!(ka.starts_with(REMOTE_KEY_PREFIX));
        assert_eq!(ka.len(), REMOTE_KEY_PREFIX.len() + 128);
        assert_ne!(ka, remote_key(&b.key(0, b"h").unwrap()));
        assert_ne!(ka, remote_key(&r1.key(0, b"h").unwrap()));
        assert_ne!(ka, remote_key(&a.key(1, b"h").unwrap()));
    }
}
