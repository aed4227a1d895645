//! What the soak stores: keys named by (namespace, index), and block bytes that are a function
//! of (key, offset) alone, so that any process can check any block it loads; and one client's
//! KV region (layer-first, `slots` blocks of `layers` pieces) with what fills and checks a slot.

use anyhow::Result;
use umbp_core::{BlockKey, KeyBuilder, LayerSpec, RankTopology};

use crate::bench_server::HostBuf;

/// Namespace number 0: keys every client of an arm stores and loads.
pub(crate) const SHARED_NS: u32 = 0;

/// A key of the soak: namespace number (0 shared, `w + 1` private to worker `w`) and index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct KeyId {
    pub(crate) ns: u32,
    pub(crate) idx: u32,
}

/// The namespace string of namespace number `ns`.
pub(crate) fn namespace(ns: u32) -> String {
    if ns == SHARED_NS {
        "umbp-soak-shared".into()
    } else {
        format!("umbp-soak-w{}", ns - 1)
    }
}

/// Builds the [`BlockKey`]s of soak keys (one builder per namespace, made once).
#[derive(Debug, Default)]
pub(crate) struct Keys {
    builders: std::collections::HashMap<u32, KeyBuilder>,
}

impl Keys {
    pub(crate) fn key(&mut self, k: KeyId) -> Result<BlockKey> {
        let b = match self.builders.entry(k.ns) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(KeyBuilder::new(&namespace(k.ns), RankTopology::default())?)
            }
        };
        Ok(b.key(0, &k.idx.to_le_bytes())?)
    }
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: every input bit reaches every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A seed from every byte of the key (namespace, rank and hash parts alike).
fn seed(key: &BlockKey) -> u64 {
    key.as_bytes().chunks(8).fold(GOLDEN, |h, c| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        mix(h ^ u64::from_le_bytes(w))
    })
}

/// The 8 bytes at object offset `8 × word` of `key`'s block.
fn word(seed: u64, word: u64) -> u64 {
    mix(seed.wrapping_add(word.wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// Writes the bytes of `key`'s block from object offset `at` (a multiple of 8) into `out`
/// (a multiple of 8 bytes long).
pub(crate) fn fill(key: &BlockKey, at: u64, out: &mut [u8]) {
    let s = seed(key);
    for (i, c) in out.chunks_exact_mut(8).enumerate() {
        c.copy_from_slice(&word(s, at / 8 + i as u64).to_le_bytes());
    }
}

/// How many bytes of `data` differ from `key`'s block from object offset `at`.
pub(crate) fn wrong_bytes(key: &BlockKey, at: u64, data: &[u8]) -> u64 {
    let s = seed(key);
    let mut wrong = 0;
    for (i, c) in data.chunks_exact(8).enumerate() {
        let want = word(s, at / 8 + i as u64).to_le_bytes();
        if c != want {
            wrong += c.iter().zip(want).filter(|(a, b)| **a != *b).count() as u64;
        }
    }
    wrong
}

/// One client's KV region: `layers` layers, each `slots` blocks of `piece` bytes, in host
/// memory shared through a memfd (what a CPU engine's KV cache is after registration).
#[derive(Debug)]
pub(crate) struct Region {
    pub(crate) buf: HostBuf,
    pub(crate) layers: u64,
    pub(crate) slots: u64,
    pub(crate) piece: u64,
}

impl Region {
    pub(crate) fn new(layers: u64, slots: u64, piece: u64) -> Result<Self> {
        Ok(Region {
            buf: HostBuf::new(layers * slots * piece)?,
            layers,
            slots,
            piece,
        })
    }

    /// Bytes of one block's object (every layer's piece).
    pub(crate) fn object_bytes(&self) -> u64 {
        self.layers * self.piece
    }

    /// The layout's layers: layer `l` holds every slot's piece of that layer.
    pub(crate) fn layer_specs(&self) -> Vec<LayerSpec> {
        (0..self.layers)
            .map(|l| LayerSpec {
                base_addr: self.buf.addr + l * self.slots * self.piece,
                num_blocks: self.slots,
                block_stride: self.piece,
                block_bytes: self.piece,
            })
            .collect()
    }

    fn piece_range(&self, l: u64, slot: u64) -> std::ops::Range<usize> {
        let at = ((l * self.slots + slot) * self.piece) as usize;
        at..at + self.piece as usize
    }

    /// Writes `key`'s block into `slot` (no transfer uses the slot meanwhile).
    pub(crate) fn fill_slot(&self, slot: u64, key: &BlockKey) {
        let m = self.buf.bytes_mut();
        for l in 0..self.layers {
            fill(key, l * self.piece, &mut m[self.piece_range(l, slot)]);
        }
    }

    /// Overwrites `slot` with bytes no key's block has, so a load must bring every byte.
    pub(crate) fn clobber_slot(&self, slot: u64) {
        let m = self.buf.bytes_mut();
        for l in 0..self.layers {
            m[self.piece_range(l, slot)].fill(0xA5);
        }
    }

    /// Flips one byte of `slot` (the soak's injected corruption).
    pub(crate) fn flip_byte(&self, slot: u64) {
        let m = self.buf.bytes_mut();
        let i = self.piece_range(self.layers / 2, slot).start + self.piece as usize / 2;
        m[i] ^= 0x40;
    }

    /// How many bytes of `slot` differ from `key`'s block.
    pub(crate) fn wrong_bytes(&self, slot: u64, key: &BlockKey) -> u64 {
        let m = self.buf.bytes();
        (0..self.layers)
            .map(|l| wrong_bytes(key, l * self.piece, &m[self.piece_range(l, slot)]))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(ns: u32, idx: u32) -> BlockKey {
        Keys::default().key(KeyId { ns, idx }).unwrap()
    }

    #[test]
    fn a_block_checks_against_its_own_key_only() {
        let (a, b) = (key(0, 1), key(1, 1));
        let mut blk = vec![0u8; 4096];
        fill(&a, 8192, &mut blk);
        assert_eq!(wrong_bytes(&a, 8192, &blk), 0);
        // Another key, or the same key at another offset, differs almost everywhere.
        assert!(wrong_bytes(&b, 8192, &blk) > 4000);
        assert!(wrong_bytes(&a, 0, &blk) > 4000);
        blk[100] ^= 1;
        blk[4095] ^= 0x80;
        assert_eq!(wrong_bytes(&a, 8192, &blk), 2);
    }

    #[test]
    fn a_slot_filled_then_clobbered_or_flipped_is_caught() {
        let r = Region::new(3, 4, 4096).unwrap();
        let k = key(2, 7);
        r.fill_slot(1, &k);
        assert_eq!(r.wrong_bytes(1, &k), 0);
        r.flip_byte(1);
        assert_eq!(r.wrong_bytes(1, &k), 1);
        r.clobber_slot(1);
        assert!(r.wrong_bytes(1, &k) > 3 * 4000);
        // Slots do not overlap: filling slot 2 leaves slot 1 as it was.
        r.fill_slot(1, &k);
        r.fill_slot(2, &key(2, 8));
        assert_eq!(r.wrong_bytes(1, &k), 0);
    }
}
