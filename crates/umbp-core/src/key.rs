//! Block keys.
//!
//! A [`BlockKey`] is a fixed 64-byte value, cheap to hash, compare and copy:
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0..16  | namespace id: the first 16 bytes of SHA-256 of the namespace string |
//! | 16..24 | TP, PCP, DCP and PP rank, little-endian `u16` each |
//! | 24..28 | KV cache group, little-endian `u32` |
//! | 28     | length of the block hash (1..=32) |
//! | 29..32 | zero |
//! | 32..64 | the block hash, zero-padded |
//!
//! Its readable form is `umbp:vllm:v1:<ns>:tp0:pcp0:dcp0:pp0:g0:<hash hex>`, produced by the
//! [`KeyBuilder`] that knows the namespace string.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::CoreError;

/// Size of a [`BlockKey`] in bytes.
pub const KEY_BYTES: usize = 64;
/// Longest block hash a key holds.
pub const MAX_HASH_BYTES: usize = 32;
/// Prefix of every key's string form.
pub const KEY_STRING_PREFIX: &str = "umbp:vllm:v1";

/// The ranks of one worker in its engine's parallel topology. The data-parallel rank is
/// deliberately absent: DP ranks share objects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RankTopology {
    /// Tensor-parallel rank.
    pub tp: u16,
    /// Prefill context-parallel rank.
    pub pcp: u16,
    /// Decode context-parallel rank.
    pub dcp: u16,
    /// Pipeline-parallel rank.
    pub pp: u16,
}

/// A compact binary object key. See the module docs for its byte layout.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockKey([u8; KEY_BYTES]);

impl BlockKey {
    /// Rebuilds a key from its 64 bytes (as sent over a socket, for example).
    pub fn from_bytes(bytes: [u8; KEY_BYTES]) -> Self {
        BlockKey(bytes)
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8; KEY_BYTES] {
        &self.0
    }

    /// The 16-byte namespace id.
    pub fn namespace_id(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out.copy_from_slice(&self.0[..16]);
        out
    }

    /// The ranks stored in the key.
    pub fn ranks(&self) -> RankTopology {
        let r = |i: usize| u16::from_le_bytes([self.0[i], self.0[i + 1]]);
        RankTopology {
            tp: r(16),
            pcp: r(18),
            dcp: r(20),
            pp: r(22),
        }
    }

    /// The KV cache group stored in the key.
    pub fn group(&self) -> u32 {
        u32::from_le_bytes([self.0[24], self.0[25], self.0[26], self.0[27]])
    }

    /// The block hash stored in the key.
    pub fn hash(&self) -> &[u8] {
        let len = usize::from(self.0[28]).min(MAX_HASH_BYTES);
        &self.0[32..32 + len]
    }

    /// A well-mixed 64-bit fingerprint of the whole key, used for hashing and sharding.
    ///
    /// Each of the eight words is folded in with a rotate, an xor and a multiply (FxHash's
    /// step), then the result is finished with the MurmurHash3 64-bit mixer so every bit of
    /// the key reaches the top bits the shards are picked by. A fold of xored rotations alone
    /// (one multiply less per word) let words cancel: hashes of all 0x00 and all 0x01 bytes
    /// met, which the `on_reuse` window and S3-FIFO's ghost set would take for the same key.
    #[inline]
    pub fn fingerprint(&self) -> u64 {
        const K: u64 = 0x517C_C1B7_2722_0A95;
        let mut acc: u64 = 0x9E37_79B9_7F4A_7C15;
        for chunk in self.0.chunks_exact(8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            acc = (acc.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(K);
        }
        acc ^= acc >> 33;
        acc = acc.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        acc ^= acc >> 33;
        acc = acc.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
        acc ^ (acc >> 33)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.ranks();
        write!(
            f,
            "BlockKey(ns={}, tp{}:pcp{}:dcp{}:pp{}, g{}, {})",
            hex(&self.0[..4]),
            r.tp,
            r.pcp,
            r.dcp,
            r.pp,
            self.group(),
            hex(self.hash())
        )
    }
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Builds keys for one namespace and one worker's ranks, in bulk.
#[derive(Debug, Clone)]
pub struct KeyBuilder {
    namespace: String,
    ranks: RankTopology,
    /// Bytes 0..28 of every key this builder makes.
    prefix: [u8; 28],
}

impl KeyBuilder {
    /// A builder for `namespace` (any non-empty string without `:`) and `ranks`.
    pub fn new(namespace: &str, ranks: RankTopology) -> Result<Self, CoreError> {
        if namespace.is_empty() {
            return Err(CoreError::option(
                "key_namespace",
                "must not be empty; leave it unset to derive one from the model",
            ));
        }
        if namespace.contains(':') || namespace.chars().any(char::is_whitespace) {
            return Err(CoreError::option(
                "key_namespace",
                format!("{namespace:?} must not contain ':' or whitespace"),
            ));
        }
        let digest = Sha256::digest(namespace.as_bytes());
        let mut prefix = [0u8; 28];
        prefix[..16].copy_from_slice(&digest[..16]);
        prefix[16..18].copy_from_slice(&ranks.tp.to_le_bytes());
        prefix[18..20].copy_from_slice(&ranks.pcp.to_le_bytes());
        prefix[20..22].copy_from_slice(&ranks.dcp.to_le_bytes());
        prefix[22..24].copy_from_slice(&ranks.pp.to_le_bytes());
        Ok(KeyBuilder {
            namespace: namespace.to_owned(),
            ranks,
            prefix,
        })
    }

    /// The namespace string.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The 16-byte namespace id every key of this builder starts with
    /// ([`BlockKey::namespace_id`]).
    pub fn namespace_id(&self) -> [u8; 16] {
        let mut id = [0u8; 16];
        id.copy_from_slice(&self.prefix[..16]);
        id
    }

    /// The ranks every key of this builder carries.
    pub fn ranks(&self) -> RankTopology {
        self.ranks
    }

    /// A builder for the same namespace and another worker's ranks.
    pub fn with_ranks(&self, ranks: RankTopology) -> Self {
        let mut b = self.clone();
        b.ranks = ranks;
        b.prefix[16..18].copy_from_slice(&ranks.tp.to_le_bytes());
        b.prefix[18..20].copy_from_slice(&ranks.pcp.to_le_bytes());
        b.prefix[20..22].copy_from_slice(&ranks.dcp.to_le_bytes());
        b.prefix[22..24].copy_from_slice(&ranks.pp.to_le_bytes());
        b
    }

    /// The key of one block.
    #[inline]
    pub fn key(&self, group: u32, hash: &[u8]) -> Result<BlockKey, CoreError> {
        if hash.is_empty() || hash.len() > MAX_HASH_BYTES {
            return Err(CoreError::InvalidHash { len: hash.len() });
        }
        let mut k = [0u8; KEY_BYTES];
        k[..28].copy_from_slice(&self.prefix);
        k[24..28].copy_from_slice(&group.to_le_bytes());
        k[28] = hash.len() as u8;
        k[32..32 + hash.len()].copy_from_slice(hash);
        Ok(BlockKey(k))
    }

    /// Keys of many blocks of one group, in order.
    pub fn keys<'a, I>(&self, group: u32, hashes: I) -> Result<Vec<BlockKey>, CoreError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let iter = hashes.into_iter();
        let mut out = Vec::with_capacity(iter.size_hint().0);
        for h in iter {
            out.push(self.key(group, h)?);
        }
        Ok(out)
    }

    /// Keys of blocks whose hashes are packed back to back, `hash_len` bytes each.
    pub fn keys_packed(
        &self,
        group: u32,
        packed: &[u8],
        hash_len: usize,
    ) -> Result<Vec<BlockKey>, CoreError> {
        if hash_len == 0 || hash_len > MAX_HASH_BYTES || !packed.len().is_multiple_of(hash_len) {
            return Err(CoreError::InvalidHash { len: hash_len });
        }
        self.keys(group, packed.chunks_exact(hash_len))
    }

    /// The readable form of a key made by this builder (or any builder of the same namespace).
    pub fn key_string(&self, key: &BlockKey) -> String {
        let r = key.ranks();
        format!(
            "{KEY_STRING_PREFIX}:{}:tp{}:pcp{}:dcp{}:pp{}:g{}:{}",
            self.namespace,
            r.tp,
            r.pcp,
            r.dcp,
            r.pp,
            key.group(),
            hex(key.hash())
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> KeyBuilder {
        KeyBuilder::new(
            "llama-8b-abc",
            RankTopology {
                tp: 3,
                pcp: 1,
                dcp: 2,
                pp: 0,
            },
        )
        .unwrap()
    }

    #[test]
    fn fields_round_trip() {
        let b = builder();
        let k = b.key(7, &[0xab; 32]).unwrap();
        assert_eq!(k.group(), 7);
        assert_eq!(k.hash(), &[0xab; 32]);
        assert_eq!(k.ranks(), b.ranks());
        assert_eq!(BlockKey::from_bytes(*k.as_bytes()), k);
    }

    #[test]
    fn string_form_is_readable() {
        let b = builder();
        let k = b.key(0, &[0x01, 0xff]).unwrap();
        assert_eq!(
            b.key_string(&k),
            "umbp:vllm:v1:llama-8b-abc:tp3:pcp1:dcp2:pp0:g0:01ff"
        );
    }

    #[test]
    fn every_field_separates_keys() {
        let b = builder();
        let base = b.key(0, &[1; 32]).unwrap();
        assert_ne!(base, b.key(1, &[1; 32]).unwrap());
        assert_ne!(base, b.key(0, &[2; 32]).unwrap());
        assert_ne!(
            base,
            b.key(0, &[1; 31]).unwrap(),
            "hash length is part of the key"
        );
        let other_rank = b.with_ranks(RankTopology { tp: 4, ..b.ranks() });
        assert_ne!(base, other_rank.key(0, &[1; 32]).unwrap());
        let other_ns = KeyBuilder::new("llama-8b-abd", b.ranks()).unwrap();
        assert_ne!(base, other_ns.key(0, &[1; 32]).unwrap());
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(KeyBuilder::new("", RankTopology::default()).is_err());
        assert!(KeyBuilder::new("a:b", RankTopology::default()).is_err());
        let b = builder();
        assert_eq!(b.key(0, &[]), Err(CoreError::InvalidHash { len: 0 }));
        assert_eq!(b.key(0, &[0; 33]), Err(CoreError::InvalidHash { len: 33 }));
        assert!(b.keys_packed(0, &[0; 10], 4).is_err());
        assert_eq!(b.keys_packed(0, &[0; 12], 4).unwrap().len(), 3);
    }

    #[test]
    fn fingerprints_tell_apart_hashes_of_one_repeated_byte_and_every_bit() {
        let b = builder();
        let mut seen = std::collections::HashSet::new();
        for byte in 0..=255u8 {
            assert!(
                seen.insert(b.key(0, &[byte; 32]).unwrap().fingerprint()),
                "{byte}"
            );
        }
        let k = b.key(3, &[0xA5; 32]).unwrap();
        for bit in 0..KEY_BYTES * 8 {
            let mut flipped = k;
            flipped.0[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(flipped.fingerprint(), k.fingerprint(), "bit {bit}");
        }
    }

    #[test]
    fn fingerprints_spread() {
        let b = builder();
        let mut shards = [0u32; 64];
        for i in 0u64..64_000 {
            let k = b.key(0, &i.to_le_bytes()).unwrap();
            shards[(k.fingerprint() >> 58) as usize] += 1;
        }
        let (min, max) = (shards.iter().min().unwrap(), shards.iter().max().unwrap());
        assert!(*min > 800 && *max < 1200, "uneven shards: {min}..{max}");
    }
}
