//! How one pool object is kept in the remote store.
//!
//! The value holds a header, then the object's bytes. Two formats, by how the value is sealed
//! ([`Seal`]):
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0..4   | magic `UMBR` |
//! | 4      | format version: 1 checksummed, 2 keyed |
//! | 5..8   | zero |
//! | 8..72  | the object's [`BlockKey`] (its 64 bytes) |
//! | 72..80 | payload length, little-endian `u64` |
//! | 80..88 | version 1: XXH3-64 of the payload, little-endian |
//! | 80..96 | version 2: the first 16 bytes of HMAC-SHA256(secret, bytes 0..80 and the payload) |
//! | 88.. / 96.. | the payload |
//!
//! XXH3 catches accidents (a truncated or mixed-up value), not forgeries: anyone who can write
//! the remote store can write a value it accepts. The keyed format is for deployments where
//! the store's writers are not all trusted: only a writer holding the secret makes values that
//! pass, and the MAC covers the key and length too, so a value cannot be moved to another key.
//! A tier reads only its own format: a keyed tier misses on checksummed values and back.
//!
//! The remote key is `umbp:v1:` and the block key's 64 bytes in hex: the block key already
//! carries the namespace (model, layout, dtype) and the ranks, so objects of different models
//! and layouts never meet, exactly as in the pool.

use sha2::{Digest, Sha256};
use umbp_core::key::KEY_BYTES;
use umbp_core::BlockKey;
use xxhash_rust::xxh3::xxh3_64;

/// Bytes before the payload of a checksummed value (format 1).
pub const HEADER_BYTES: usize = 88;
/// Bytes before the payload of a keyed value (format 2).
pub const KEYED_HEADER_BYTES: usize = 96;
/// Bytes of the header a keyed MAC covers (everything before the MAC).
const MAC_COVERS: usize = 80;
const TAG_BYTES: usize = 16;
/// The shortest secret a keyed tier accepts.
pub const MIN_SECRET_BYTES: usize = 16;
const MAGIC: &[u8; 4] = b"UMBR";
const CHECKSUMMED: u8 = 1;
const KEYED: u8 = 2;
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

/// An HMAC-SHA256 key: the hash states after the secret's inner and outer pads, so each value
/// costs one clone of each.
#[derive(Clone)]
pub struct MacKey {
    inner: Sha256,
    outer: Sha256,
}

impl std::fmt::Debug for MacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MacKey(..)")
    }
}

impl MacKey {
    /// The key of `secret` (at least [`MIN_SECRET_BYTES`] bytes; HMAC hashes a longer one
    /// than SHA-256's block first).
    pub fn new(secret: &[u8]) -> Result<MacKey, String> {
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the secret is {} bytes; use at least {MIN_SECRET_BYTES} random bytes (e.g. \
                 `head -c 32 /dev/urandom | base64`)",
                secret.len()
            ));
        }
        let mut block = [0u8; 64];
        if secret.len() > block.len() {
            block[..32].copy_from_slice(&Sha256::digest(secret));
        } else {
            block[..secret.len()].copy_from_slice(secret);
        }
        let pad = |byte: u8| {
            let mut h = Sha256::new();
            h.update(block.map(|b| b ^ byte));
            h
        };
        Ok(MacKey {
            inner: pad(0x36),
            outer: pad(0x5c),
        })
    }

    fn tag(&self, inner: Sha256) -> [u8; TAG_BYTES] {
        let mut outer = self.outer.clone();
        outer.update(inner.finalize());
        let mut t = [0u8; TAG_BYTES];
        t.copy_from_slice(&outer.finalize()[..TAG_BYTES]);
        t
    }
}

/// How a tier seals the values it writes, and what it accepts.
#[derive(Debug, Clone)]
pub enum Seal {
    /// Format 1: an XXH3-64 checksum (accidents only).
    Checksum,
    /// Format 2: HMAC-SHA256 with a secret the nodes share.
    Keyed(Box<MacKey>),
}

impl Seal {
    /// Bytes before the payload.
    pub fn header_bytes(&self) -> usize {
        match self {
            Seal::Checksum => HEADER_BYTES,
            Seal::Keyed(_) => KEYED_HEADER_BYTES,
        }
    }

    /// The header of `key`'s object `payload`: its first [`Seal::header_bytes`] bytes.
    pub fn header(&self, key: &BlockKey, payload: &[u8]) -> [u8; KEYED_HEADER_BYTES] {
        self.header_with(key, payload, None)
    }

    /// [`Seal::header`], where `sum` (when given) is the payload's XXH3-64 as the pool kept
    /// it since the object was stored: a checksummed value carries it as is, without hashing
    /// the payload again, so damage the bytes took in DRAM since is found by whoever fetches
    /// them. A keyed value's MAC is always computed over the payload.
    pub fn header_with(
        &self,
        key: &BlockKey,
        payload: &[u8],
        sum: Option<u64>,
    ) -> [u8; KEYED_HEADER_BYTES] {
        let mut h = [0u8; KEYED_HEADER_BYTES];
        h[..4].copy_from_slice(MAGIC);
        h[8..72].copy_from_slice(key.as_bytes());
        h[72..80].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        match self {
            Seal::Checksum => {
                h[4] = CHECKSUMMED;
                let sum = sum.unwrap_or_else(|| xxh3_64(payload));
                h[80..88].copy_from_slice(&sum.to_le_bytes());
            }
            Seal::Keyed(k) => {
                h[4] = KEYED;
                let mut inner = k.inner.clone();
                inner.update(&h[..MAC_COVERS]);
                inner.update(payload);
                h[80..96].copy_from_slice(&k.tag(inner));
            }
        }
        h
    }

    fn version(&self) -> u8 {
        match self {
            Seal::Checksum => CHECKSUMMED,
            Seal::Keyed(_) => KEYED,
        }
    }
}

/// Appends the value of `key`'s object `payload` to `out` (cleared first).
pub fn encode_into(seal: &Seal, key: &BlockKey, payload: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(seal.header_bytes() + payload.len());
    out.extend_from_slice(&seal.header(key, payload)[..seal.header_bytes()]);
    out.extend_from_slice(payload);
}

/// The value of an object as one command argument: the header and the object's bytes (in the
/// pool) are written straight into the command's buffer, with no buffer of its own between.
#[derive(Debug, Clone, Copy)]
pub struct Encoded<'a> {
    /// How the value is sealed.
    pub seal: &'a Seal,
    /// The object's key.
    pub key: &'a BlockKey,
    /// Its bytes.
    pub payload: &'a [u8],
    /// The payload's XXH3-64 as the pool kept it, if it does ([`Seal::header_with`]).
    pub sum: Option<u64>,
}

impl redis::ToRedisArgs for Encoded<'_> {
    fn write_redis_args<W>(&self, out: &mut W)
    where
        W: ?Sized + redis::RedisWrite,
    {
        use std::io::Write;
        let mut w = out.writer_for_next_arg();
        let header = self.seal.header_with(self.key, self.payload, self.sum);
        // Writes into a growing in-memory buffer cannot fail.
        w.write_all(&header[..self.seal.header_bytes()])
            .and_then(|()| w.write_all(self.payload))
            .expect("writing into the command buffer");
    }
}

/// Why a remote value was not taken as the object it was fetched for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// Shorter than a header, or not this format (another writer, another version).
    NotAnObject,
    /// Sealed the other way: checksummed where this tier has a secret, or keyed where it has
    /// none.
    WrongSeal,
    /// It names another key.
    WrongKey,
    /// Its length field disagrees with the bytes present.
    WrongLength,
    /// Longer than any object this node's layouts make (not read past that).
    TooLarge,
    /// Its payload does not match its checksum.
    BadChecksum,
    /// Its MAC is not the one the secret gives: written without the secret, or altered.
    BadMac,
}

/// What a value's payload must hash to. (Made once per fetched value and consumed at once:
/// the hash state stays inline rather than costing an allocation.)
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub enum Check<'s> {
    /// Its XXH3-64.
    Sum(u64),
    /// Its MAC tag; the state has taken the header already.
    Mac {
        /// The key.
        key: &'s MacKey,
        /// HMAC's inner hash after the header's covered bytes.
        state: Sha256,
        /// The tag the value carries.
        tag: [u8; TAG_BYTES],
    },
}

/// The payload of `value`, if it is `key`'s object, sealed as `seal` says, and intact.
pub fn decode<'v>(seal: &Seal, key: &BlockKey, value: &'v [u8]) -> Result<&'v [u8], Reject> {
    let (payload, check) = parse(seal, key, value)?;
    match check {
        Check::Sum(sum) => sum_matches(xxh3_64(payload), sum)?,
        Check::Mac {
            key,
            mut state,
            tag,
        } => {
            state.update(payload);
            tag_matches(key, state, &tag)?;
        }
    }
    Ok(payload)
}

fn sum_matches(got: u64, want: u64) -> Result<(), Reject> {
    if got == want {
        Ok(())
    } else {
        Err(Reject::BadChecksum)
    }
}

/// Whether the MAC of what `state` took is `tag`, compared without an early exit (the time
/// taken says nothing of where the tags differ).
fn tag_matches(key: &MacKey, state: Sha256, tag: &[u8; TAG_BYTES]) -> Result<(), Reject> {
    let diff = key
        .tag(state)
        .iter()
        .zip(tag)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b));
    if diff == 0 {
        Ok(())
    } else {
        Err(Reject::BadMac)
    }
}

/// Everything of [`decode`] but hashing the payload: the payload and what it must hash to
/// (for [`copy_checked`], which hashes it while copying).
pub fn parse<'s, 'v>(
    seal: &'s Seal,
    key: &BlockKey,
    value: &'v [u8],
) -> Result<(&'v [u8], Check<'s>), Reject> {
    if value.len() < 5 || &value[..4] != MAGIC {
        return Err(Reject::NotAnObject);
    }
    if value[4] != seal.version() {
        return Err(if matches!(value[4], CHECKSUMMED | KEYED) {
            Reject::WrongSeal
        } else {
            Reject::NotAnObject
        });
    }
    let header = seal.header_bytes();
    if value.len() < header {
        return Err(Reject::NotAnObject);
    }
    if &value[8..72] != key.as_bytes() {
        return Err(Reject::WrongKey);
    }
    let len = u64::from_le_bytes(value[72..80].try_into().expect("8 bytes"));
    let payload = &value[header..];
    if len != payload.len() as u64 {
        return Err(Reject::WrongLength);
    }
    let check = match seal {
        Seal::Checksum => Check::Sum(u64::from_le_bytes(
            value[80..88].try_into().expect("8 bytes"),
        )),
        Seal::Keyed(k) => {
            let mut state = k.inner.clone();
            state.update(&value[..MAC_COVERS]);
            Check::Mac {
                key: k,
                state,
                tag: value[80..96].try_into().expect("16 bytes"),
            }
        }
    };
    Ok((payload, check))
}

/// Bytes copied and hashed at a time by [`copy_checked`]: each piece is hashed from cache
/// right after it was read for the copy.
const PIECE: usize = 64 << 10;

/// Copies `payload` into `dst` (as long) piece by piece with `copy` (given two pieces of
/// equal length), hashing each piece as it goes, and checks the result against `check`. One
/// pass over the payload's memory instead of two. `copy` is the destination's: a copy whose
/// stores need ordering (non-temporal ones) is ordered by its owner before the bytes are
/// published ([`crate::FetchSink::copy`]).
pub fn copy_checked(
    dst: &mut [u8],
    payload: &[u8],
    check: Check<'_>,
    copy: impl Fn(&mut [u8], &[u8]),
) -> Result<(), Reject> {
    assert_eq!(dst.len(), payload.len(), "copy_checked needs equal lengths");
    let pieces = dst.chunks_mut(PIECE).zip(payload.chunks(PIECE));
    match check {
        Check::Sum(sum) => {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for (d, p) in pieces {
                copy(d, p);
                h.update(p);
            }
            sum_matches(h.digest(), sum)
        }
        Check::Mac {
            key,
            mut state,
            tag,
        } => {
            for (d, p) in pieces {
                copy(d, p);
                state.update(p);
            }
            tag_matches(key, state, &tag)
        }
    }
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

    fn keyed(secret: &[u8]) -> Seal {
        Seal::Keyed(Box::new(MacKey::new(secret).unwrap()))
    }

    #[test]
    fn round_trip_and_every_rejection() {
        let (k, other) = (key(b"a"), key(b"b"));
        let payload: Vec<u8> = (0..200_000u32).map(|i| (i * 7) as u8).collect();
        for seal in [Seal::Checksum, keyed(b"0123456789abcdef-secret")] {
            let hb = seal.header_bytes();
            let mut v = Vec::new();
            encode_into(&seal, &k, &payload, &mut v);
            assert_eq!(v.len(), hb + payload.len());
            assert_eq!(decode(&seal, &k, &v), Ok(&payload[..]));
            assert_eq!(decode(&seal, &other, &v), Err(Reject::WrongKey));
            assert_eq!(decode(&seal, &k, &v[..hb - 1]), Err(Reject::NotAnObject));
            assert_eq!(
                decode(&seal, &k, b"garbage written by redis-cli"),
                Err(Reject::NotAnObject)
            );
            assert_eq!(
                decode(&seal, &k, &v[..v.len() - 1]),
                Err(Reject::WrongLength)
            );
            let bad = if hb == HEADER_BYTES {
                Reject::BadChecksum
            } else {
                Reject::BadMac
            };
            for at in [hb, v.len() / 2, v.len() - 1] {
                let mut flipped = v.clone();
                flipped[at] ^= 1;
                assert_eq!(decode(&seal, &k, &flipped), Err(bad), "byte {at}");
            }
            let mut bad_version = v.clone();
            bad_version[4] = 9;
            assert_eq!(decode(&seal, &k, &bad_version), Err(Reject::NotAnObject));
            // Checking while copying agrees with decode.
            let (p, check) = parse(&seal, &k, &v).unwrap();
            let mut dst = vec![0u8; p.len()];
            assert_eq!(
                copy_checked(&mut dst, p, check, |d, p| d.copy_from_slice(p)),
                Ok(())
            );
            assert_eq!(dst, payload);
            // An empty payload is an object too.
            encode_into(&seal, &k, &[], &mut v);
            assert_eq!(decode(&seal, &k, &v), Ok(&[][..]));
        }
    }

    #[test]
    fn a_keyed_tier_takes_only_values_sealed_with_its_secret() {
        let k = key(b"a");
        let payload = vec![0x5Au8; 4096];
        let (mine, theirs) = (
            keyed(b"the nodes' shared secret"),
            keyed(b"somebody else's secret"),
        );
        let mut v = Vec::new();
        // A checksummed value, valid as such (anyone can make one): refused by a keyed tier.
        encode_into(&Seal::Checksum, &k, &payload, &mut v);
        assert_eq!(decode(&mine, &k, &v), Err(Reject::WrongSeal));
        // Keyed with another secret: refused; keyed values are refused by a checksummed tier.
        encode_into(&theirs, &k, &payload, &mut v);
        assert_eq!(decode(&mine, &k, &v), Err(Reject::BadMac));
        assert_eq!(decode(&Seal::Checksum, &k, &v), Err(Reject::WrongSeal));
        // The MAC covers the header: a value's length or key cannot be rewritten either.
        encode_into(&mine, &k, &payload, &mut v);
        let mut moved = v.clone();
        moved[8..72].copy_from_slice(key(b"b").as_bytes());
        assert_eq!(decode(&mine, &key(b"b"), &moved), Err(Reject::BadMac));
        assert_eq!(
            MacKey::new(b"short").unwrap_err().split(';').next(),
            Some("the secret is 5 bytes")
        );
    }

    #[test]
    fn hmac_matches_rfc_4231() {
        // RFC 4231 test case 2 (a short key), and test case 6 (a key longer than a block):
        // HMAC-SHA256 truncated to 16 bytes, as the MAC field keeps it.
        fn hmac(secret: &[u8], msg: &[u8]) -> [u8; TAG_BYTES] {
            let mut block = [0u8; 64];
            let k = if secret.len() > 64 {
                Sha256::digest(secret).to_vec()
            } else {
                secret.to_vec()
            };
            block[..k.len()].copy_from_slice(&k);
            let m = MacKey {
                inner: Sha256::new_with_prefix(block.map(|b| b ^ 0x36)),
                outer: Sha256::new_with_prefix(block.map(|b| b ^ 0x5c)),
            };
            let mut inner = m.inner.clone();
            inner.update(msg);
            m.tag(inner)
        }
        let hex = |t: [u8; TAG_BYTES]| t.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(
            hex(hmac(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c7"
        );
        let long = [0xaau8; 131];
        assert_eq!(
            hex(hmac(
                &long,
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f"
        );
        // MacKey::new derives the same pads (for secrets of at least 16 bytes).
        let secret = b"sixteen or more bytes of secret";
        let mut a = MacKey::new(secret).unwrap().inner;
        a.update(b"m");
        let mut b = Sha256::new();
        let mut block = [0u8; 64];
        block[..secret.len()].copy_from_slice(secret);
        b.update(block.map(|x| x ^ 0x36));
        b.update(b"m");
        assert_eq!(a.finalize(), b.finalize());
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
