//! The pool's image: what a pool hands to the process that takes its memory over (a
//! server upgraded in place), and the checks the taker makes before it trusts a byte of it.
//!
//! The objects' bytes stay where they are, in the pool's memfd; the image is the index
//! alone: for every committed object its key, its slot in the allocator, its length, its
//! checksum if it has one, what is left of its pin and its place in the eviction policy (its
//! queue, its use count and when it entered the queue: [`Place`]), in the order its shard's
//! policy would evict them (first to go first). The taker puts each object back in the same
//! queue with the same count, in the same order across shards, so objects S3-FIFO had
//! promoted to its main queue keep that protection through an upgrade. Objects being written, or removed but still read, are not
//! in it: their slots are free in the taker's pool, and nothing half-written is ever visible.
//!
//! Layout (little-endian): a 64-byte header (`MAGIC`, [`FORMAT`], flags, the generation, the
//! region's bytes, the allocator's capacity and segment size, the record count), the records
//! ([`RECORD_BYTES`] each; format 1, without places, was 16 bytes shorter and is still read),
//! then an XXH3-64 of everything before it. A taker refuses an image
//! whose magic, format, geometry or checksum is not its own, or whose slots overlap, and
//! says why; a pool is then started empty, never from a torn index.

use umbp_core::key::KEY_BYTES;
use umbp_core::BlockKey;

use crate::alloc::Slot;

/// First bytes of an image.
pub const MAGIC: [u8; 8] = *b"UMBPIMG\0";
/// Version of the image format written. A taker reads this one and format 1 (records without
/// places: its objects enter the policy as new ones), and refuses others.
pub const FORMAT: u32 = 2;
/// Bytes of one record of format 1.
const RECORD_BYTES_V1: usize = KEY_BYTES + 8 + 8 + 4 + 4 + 8 + 8 + 8 + 8;
/// Bytes of one record.
pub const RECORD_BYTES: usize = RECORD_BYTES_V1 + 8 + 8;
/// Set in a record's place word when it holds a place.
const HAS_PLACE: u64 = 1 << 16;
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

/// Where an object sat in its pool's eviction policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Place {
    /// Its queue (S3-FIFO: 0 small, 1 main; LRU: its one queue).
    pub queue: u8,
    /// Its use count (S3-FIFO: 0 to 3; LRU: 0).
    pub freq: u8,
    /// When it entered its queue, on the giver's clock: the taker orders objects by it.
    pub rank: u64,
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
    /// Its place in the giver's policy (None from a format-1 image).
    pub place: Option<Place>,
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
            let p = r.place.unwrap_or_default();
            let word = u64::from(p.queue) | u64::from(p.freq) << 8;
            put(
                &mut out,
                if r.place.is_some() {
                    word | HAS_PLACE
                } else {
                    0
                },
            );
            put(&mut out, p.rank);
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
        let record_bytes = match format {
            1 => RECORD_BYTES_V1,
            FORMAT => RECORD_BYTES,
            _ => {
                return Err(format!(
                    "the image has format {format}, this build reads formats 1 and {FORMAT}"
                ))
            }
        };
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
        let expect = (count as u128) * record_bytes as u128 + HEADER_BYTES as u128;
        if expect != body.len() as u128 {
            return Err(format!(
                "the image says {count} objects but holds {} bytes of them",
                body.len() - HEADER_BYTES
            ));
        }
        let mut records = Vec::with_capacity(count as usize);
        for rec in body[HEADER_BYTES..].chunks_exact(record_bytes) {
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
            let place = (record_bytes == RECORD_BYTES && r64(k + 56) & HAS_PLACE != 0).then(|| {
                let word = r64(k + 56);
                Place {
                    queue: word as u8,
                    freq: (word >> 8) as u8,
                    rank: r64(k + 64),
                }
            });
            records.push(Record {
                key,
                slot,
                len,
                sum,
                pin_ms: r64(k + 48),
                place,
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
                    place: (i % 3 != 0).then_some(Place {
                        queue: (i % 2) as u8,
                        freq: (i % 4) as u8,
                        rank: 1000 + i as u64,
                    }),
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

    /// An image as a format-1 giver (the release before places) wrote it.
    fn encode_format1(img: &Image) -> Vec<u8> {
        let v2 = img.encode();
        let mut out = v2[..HEADER_BYTES].to_vec();
        out[8..12].copy_from_slice(&1u32.to_le_bytes());
        for rec in v2[HEADER_BYTES..v2.len() - 8].chunks_exact(RECORD_BYTES) {
            out.extend_from_slice(&rec[..RECORD_BYTES_V1]);
        }
        let sum = crate::checksum(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    #[test]
    fn a_format_1_image_is_read_without_places() {
        let img = image(7);
        let old = Image::decode(&encode_format1(&img), geo()).expect("format 1 is read");
        assert_eq!(old.records.len(), 7);
        for (a, b) in old.records.iter().zip(&img.records) {
            assert_eq!(
                (a.key, a.slot, a.len, a.sum, a.pin_ms),
                (b.key, b.slot, b.len, b.sum, b.pin_ms)
            );
            assert_eq!(a.place, None);
        }
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
        newer[8] = 3;
        assert!(Image::decode(&newer, geo())
            .unwrap_err()
            .contains("format 3"));
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
