//! The pool's image: what a pool hands to the process that takes its memory over (a
//! server upgraded in place), and the checks the taker makes before it trusts a byte of it.
//!
//! The objects' bytes stay where they are, in the pool's memfd; the image is the index
//! alone: for every committed object its key, its slot in the allocator, its length, its
//! checksum if it has one and what is left of its pin, in the order its shard's policy would
//! evict them (first to go first). Objects being written, or removed but still read, are not
//! in it: their slots are free in the taker's pool, and nothing half-written is ever visible.
//!
//! Layout (little-endian): a 64-byte header (`MAGIC`, [`FORMAT`], flags, the generation, the
//! region's bytes, the allocator's capacity and segment size, the record count), the records
//! ([`RECORD_BYTES`] each), then an XXH3-64 of everything before it. A taker refuses an image
//! whose magic, format, geometry or checksum is not its own, or whose slots overlap, and
//! says why; a pool is then started empty, never from a torn index.

use umbp_core::key::KEY_BYTES;
use umbp_core::BlockKey;

use crate::alloc::Slot;

/// First bytes of an image.
pub const MAGIC: [u8; 8] = *b"UMBPIMG\0";
/// Version of the image format; a taker refuses other versions.
pub const FORMAT: u32 = 1;
/// Bytes of one record.
pub const RECORD_BYTES: usize = KEY_BYTES + 8 + 8 + 4 + 4 + 8 + 8 + 8 + 8;
const HEADER_BYTES: usize = 8 + 4 + 4 + 8 * 6;

/// The geometry a taker's pool must share with the image's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of the memory (the memfd's size).
    pub region_bytes: u64,
    /// Bytes the allocator manages.
    pub capacity: u64,
    /// The allocator's segment size.
    pub segment_bytes: u64,
}

/// One committed object of an image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Its key.
    pub key: BlockKey,
    /// Where it lives.
    pub slot: Slot,
    /// Its length.
    pub len: u64,
    /// Its checksum, when the pool kept one.
    pub sum: Option<u64>,
    /// Milliseconds its pin had left (0: not pinned).
    pub pin_ms: u64,
}

/// A decoded image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Image {
    /// Handed over how many times before (the giver's generation + 1 for the taker).
    pub generation: u64,
    /// The giver's geometry.
    pub geometry: Geometry,
    /// The objects, by shard in eviction order.
    pub records: Vec<Record>,
}

fn put(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

impl Image {
    /// The image's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_BYTES + self.records.len() * RECORD_BYTES + 8);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        put(&mut out, self.generation);
        put(&mut out, self.geometry.region_bytes);
        put(&mut out, self.geometry.capacity);
        put(&mut out, self.geometry.segment_bytes);
        put(&mut out, self.records.len() as u64);
        put(&mut out, 0);
        for r in &self.records {
            out.extend_from_slice(r.key.as_bytes());
            put(&mut out, r.slot.offset);
            put(&mut out, r.slot.bytes);
            out.extend_from_slice(&r.slot.segment.to_le_bytes());
            out.extend_from_slice(&r.slot.index.to_le_bytes());
            put(&mut out, r.len);
            put(&mut out, u64::from(r.sum.is_some()));
            put(&mut out, r.sum.unwrap_or(0));
            put(&mut out, r.pin_ms);
        }
        let sum = crate::checksum(&out);
        put(&mut out, sum);
        out
    }

    /// Decodes `bytes` and checks them against `want` (the taker's geometry). The error says
    /// why the image cannot be used.
    pub fn decode(bytes: &[u8], want: Geometry) -> Result<Image, String> {
        if bytes.len() < HEADER_BYTES + 8 {
            return Err(format!(
                "the image is {} bytes, shorter than its header",
                bytes.len()
            ));
        }
        if bytes[..8] != MAGIC {
            return Err("the image does not start with UMBP's magic bytes".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().expect("4 bytes"));
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
        let format = u32_at(8);
        if format != FORMAT {
            return Err(format!(
                "the image has format {format}, this build reads format {FORMAT}"
            ));
        }
        let (body, tail) = bytes.split_at(bytes.len() - 8);
        if crate::checksum(body) != u64::from_le_bytes(tail.try_into().expect("8 bytes")) {
            return Err("the image's checksum does not match: it is damaged".into());
        }
        let generation = u64_at(16);
        let geometry = Geometry {
            region_bytes: u64_at(24),
            capacity: u64_at(32),
            segment_bytes: u64_at(40),
        };
        if geometry != want {
            return Err(format!(
                "the pool was {} bytes ({} managed, segments of {}), this server's is {} \
                 ({} managed, segments of {}): start it with the old --capacity and \
                 --segment-bytes to take the pool over",
                geometry.region_bytes,
                geometry.capacity,
                geometry.segment_bytes,
                want.region_bytes,
                want.capacity,
                want.segment_bytes
            ));
        }
        let count = u64_at(48);
        let expect = (count as u128) * RECORD_BYTES as u128 + HEADER_BYTES as u128;
        if expect != body.len() as u128 {
            return Err(format!(
                "the image says {count} objects but holds {} bytes of them",
                body.len() - HEADER_BYTES
            ));
        }
        let mut records = Vec::with_capacity(count as usize);
        for rec in body[HEADER_BYTES..].chunks_exact(RECORD_BYTES) {
            let r64 = |o: usize| u64::from_le_bytes(rec[o..o + 8].try_into().expect("8 bytes"));
            let r32 = |o: usize| u32::from_le_bytes(rec[o..o + 4].try_into().expect("4 bytes"));
            let key = BlockKey::from_bytes(rec[..KEY_BYTES].try_into().expect("key bytes"));
            let k = KEY_BYTES;
            let slot = Slot {
                offset: r64(k),
                bytes: r64(k + 8),
                segment: r32(k + 16),
                index: r32(k + 20),
            };
            let len = r64(k + 24);
            if len == 0 || len > slot.bytes {
                return Err(format!(
                    "an object of {len} bytes in a slot of {}: the image is inconsistent",
                    slot.bytes
                ));
            }
            let sum = (r64(k + 32) != 0).then(|| r64(k + 40));
            records.push(Record {
                key,
                slot,
                len,
                sum,
                pin_ms: r64(k + 48),
            });
        }
        Ok(Image {
            generation,
            geometry,
            records,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geo() -> Geometry {
        Geometry {
            region_bytes: 8 << 20,
            capacity: 8 << 20,
            segment_bytes: 1 << 20,
        }
    }

    fn image(n: usize) -> Image {
        Image {
            generation: 3,
            geometry: geo(),
            records: (0..n)
                .map(|i| Record {
                    key: BlockKey::from_bytes([i as u8; KEY_BYTES]),
                    slot: Slot {
                        offset: i as u64 * 4096,
                        bytes: 4096,
                        segment: 0,
                        index: i as u32,
                    },
                    len: 4000,
                    sum: (i % 2 == 0).then_some(i as u64 * 7),
                    pin_ms: i as u64,
                })
                .collect(),
        }
    }

    #[test]
    fn an_image_round_trips() {
        let img = image(5);
        assert_eq!(Image::decode(&img.encode(), geo()), Ok(img));
        assert_eq!(Image::decode(&image(0).encode(), geo()), Ok(image(0)));
    }

    #[test]
    fn every_damaged_or_foreign_image_is_refused_with_a_reason() {
        let good = image(3).encode();
        let mut flipped = good.clone();
        flipped[HEADER_BYTES + 70] ^= 1;
        assert!(Image::decode(&flipped, geo())
            .unwrap_err()
            .contains("damaged"));
        let mut newer = good.clone();
        newer[8] = 2;
        assert!(Image::decode(&newer, geo())
            .unwrap_err()
            .contains("format 2"));
        assert!(Image::decode(&good[..good.len() - 1], geo()).is_err());
        assert!(Image::decode(b"short", geo())
            .unwrap_err()
            .contains("shorter"));
        let other = Geometry {
            segment_bytes: 2 << 20,
            ..geo()
        };
        assert!(Image::decode(&good, other)
            .unwrap_err()
            .contains("--segment-bytes"));
        let mut magic = good;
        magic[0] = b'X';
        assert!(Image::decode(&magic, geo()).unwrap_err().contains("magic"));
    }
}
