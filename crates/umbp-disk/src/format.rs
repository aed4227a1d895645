//! The on-disk format: an object is a 4 KiB header block (magic, version, the full 64-byte
//! key, the length, an XXH3-64 checksum of key and bytes, and a checksum of the header
//! itself) followed by its bytes, padded to 4 KiB. Each segment file `seg-N.dat` of objects
//! has a companion `seg-N.idx`: a 64-byte file header, then one 128-byte record per object
//! written (key, offset, length, checksum; the record checksummed too), appended only after
//! the object's bytes are written, so that start-up reads the small index files instead of
//! the objects.

use umbp_core::BlockKey;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// Alignment of every offset, length and buffer of direct I/O (covers 512 B and 4 KiB
/// logical blocks).
pub const ALIGN: u64 = 4096;
/// Bytes of the header block in front of each object.
pub const HEADER_BYTES: u64 = ALIGN;
/// Bytes of one index record.
pub const RECORD_BYTES: usize = 128;
/// Bytes of an index file's own header.
pub const IDX_HEADER_BYTES: usize = 64;

const OBJ_MAGIC: &[u8; 8] = b"UMBPDOB1";
const IDX_MAGIC: &[u8; 8] = b"UMBPDIX1";
const VERSION: u32 = 1;
const KEY: usize = umbp_core::key::KEY_BYTES;
/// Bytes of the header proper (the rest of the block is zero).
const HEAD: usize = 8 + 4 + 4 + KEY + 8 + 8;

/// `n` rounded up to [`ALIGN`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

/// Bytes an object of `len` bytes takes on disk, header included.
pub fn extent(len: u64) -> u64 {
    HEADER_BYTES + align_up(len)
}

/// The object checksum: XXH3-64 of the full key, then the bytes (a value moved to another key
/// fails it).
pub fn checksum(key: &BlockKey, data: &[u8]) -> u64 {
    let mut h = Xxh3::new();
    h.update(key.as_bytes());
    h.update(data);
    h.digest()
}

/// Writes the header of `key`'s object of `data` into `block` (at least [`HEADER_BYTES`]
/// long; the header block's tail is zeroed). Returns the object checksum.
pub fn encode_header(block: &mut [u8], key: &BlockKey, data: &[u8]) -> u64 {
    let sum = checksum(key, data);
    let b = &mut block[..HEADER_BYTES as usize];
    b.fill(0);
    b[0..8].copy_from_slice(OBJ_MAGIC);
    b[8..12].copy_from_slice(&VERSION.to_le_bytes());
    b[16..16 + KEY].copy_from_slice(key.as_bytes());
    b[16 + KEY..24 + KEY].copy_from_slice(&(data.len() as u64).to_le_bytes());
    b[24 + KEY..32 + KEY].copy_from_slice(&sum.to_le_bytes());
    let hs = xxh3_64(&b[..HEAD]);
    b[HEAD..HEAD + 8].copy_from_slice(&hs.to_le_bytes());
    sum
}

/// Why an object read from disk is not the one asked for (every one is a miss).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// The header's magic, version or own checksum is wrong (never written, torn, or
    /// overwritten).
    Header,
    /// The header names another key.
    Key,
    /// The header gives another length than the index.
    Length,
    /// The bytes do not match the checksum (a torn write, or damage).
    Checksum,
}

/// Checks `ext` (an object's header block and bytes, as read from disk) against `key` and
/// `len`; the object's bytes when they are right.
pub fn verify<'a>(ext: &'a [u8], key: &BlockKey, len: u64) -> Result<&'a [u8], Bad> {
    if ext.len() < HEADER_BYTES as usize + len as usize {
        return Err(Bad::Length);
    }
    let b = &ext[..HEAD + 8];
    let hs = u64::from_le_bytes(b[HEAD..HEAD + 8].try_into().expect("8 bytes"));
    if &b[0..8] != OBJ_MAGIC
        || u32::from_le_bytes(b[8..12].try_into().expect("4 bytes")) != VERSION
        || xxh3_64(&b[..HEAD]) != hs
    {
        return Err(Bad::Header);
    }
    if &b[16..16 + KEY] != key.as_bytes() {
        return Err(Bad::Key);
    }
    if u64::from_le_bytes(b[16 + KEY..24 + KEY].try_into().expect("8 bytes")) != len {
        return Err(Bad::Length);
    }
    let sum = u64::from_le_bytes(b[24 + KEY..32 + KEY].try_into().expect("8 bytes"));
    let data = &ext[HEADER_BYTES as usize..HEADER_BYTES as usize + len as usize];
    if checksum(key, data) != sum {
        return Err(Bad::Checksum);
    }
    Ok(data)
}

/// One index record: where an object of a segment lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// The object's key.
    pub key: BlockKey,
    /// Offset of its header block in the segment file.
    pub offset: u64,
    /// Its length in bytes (without header and padding).
    pub len: u64,
}

impl Record {
    /// The record's bytes.
    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut r = [0u8; RECORD_BYTES];
        r[0..KEY].copy_from_slice(self.key.as_bytes());
        r[KEY..KEY + 8].copy_from_slice(&self.offset.to_le_bytes());
        r[KEY + 8..KEY + 16].copy_from_slice(&self.len.to_le_bytes());
        let s = xxh3_64(&r[..RECORD_BYTES - 8]);
        r[RECORD_BYTES - 8..].copy_from_slice(&s.to_le_bytes());
        r
    }

    /// The record in `r`, or `None` when its checksum fails (a torn append) or it makes no
    /// sense (an offset not aligned).
    pub fn decode(r: &[u8]) -> Option<Record> {
        let r: &[u8; RECORD_BYTES] = r.try_into().ok()?;
        let s = u64::from_le_bytes(r[RECORD_BYTES - 8..].try_into().ok()?);
        if xxh3_64(&r[..RECORD_BYTES - 8]) != s {
            return None;
        }
        let key = BlockKey::from_bytes(r[0..KEY].try_into().ok()?);
        let offset = u64::from_le_bytes(r[KEY..KEY + 8].try_into().ok()?);
        let len = u64::from_le_bytes(r[KEY + 8..KEY + 16].try_into().ok()?);
        offset
            .is_multiple_of(ALIGN)
            .then_some(Record { key, offset, len })
    }
}

/// The header of an index file of a segment of `segment_bytes`.
pub fn idx_header(segment_bytes: u64) -> [u8; IDX_HEADER_BYTES] {
    let mut h = [0u8; IDX_HEADER_BYTES];
    h[0..8].copy_from_slice(IDX_MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&segment_bytes.to_le_bytes());
    let s = xxh3_64(&h[..IDX_HEADER_BYTES - 8]);
    h[IDX_HEADER_BYTES - 8..].copy_from_slice(&s.to_le_bytes());
    h
}

/// The records of an index file's bytes, or `None` when its header is not this version's.
/// Records that fail their checksum (a torn last append) are skipped.
pub fn parse_idx(bytes: &[u8]) -> Option<Vec<Record>> {
    let h = bytes.get(..IDX_HEADER_BYTES)?;
    let s = u64::from_le_bytes(h[IDX_HEADER_BYTES - 8..].try_into().ok()?);
    if &h[0..8] != IDX_MAGIC
        || u32::from_le_bytes(h[8..12].try_into().ok()?) != VERSION
        || xxh3_64(&h[..IDX_HEADER_BYTES - 8]) != s
    {
        return None;
    }
    Some(
        bytes[IDX_HEADER_BYTES..]
            .chunks_exact(RECORD_BYTES)
            .filter_map(Record::decode)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> BlockKey {
        let mut b = [0u8; KEY];
        b[0] = n;
        b[63] = n.wrapping_mul(7);
        BlockKey::from_bytes(b)
    }

    fn object(k: &BlockKey, data: &[u8]) -> Vec<u8> {
        let mut ext = vec![0u8; extent(data.len() as u64) as usize];
        encode_header(&mut ext, k, data);
        ext[HEADER_BYTES as usize..HEADER_BYTES as usize + data.len()].copy_from_slice(data);
        ext
    }

    #[test]
    fn an_object_reads_back_and_every_damage_is_named() {
        let (k, data) = (key(1), vec![7u8; 5000]);
        let mut ext = object(&k, &data);
        assert_eq!(ext.len(), 4096 + 8192);
        assert_eq!(verify(&ext, &k, 5000), Ok(&data[..]));
        assert_eq!(verify(&ext, &key(2), 5000), Err(Bad::Key));
        assert_eq!(verify(&ext, &k, 4999), Err(Bad::Length));
        ext[HEADER_BYTES as usize + 4999] ^= 1;
        assert_eq!(verify(&ext, &k, 5000), Err(Bad::Checksum));
        ext[20] ^= 1;
        assert_eq!(verify(&ext, &k, 5000), Err(Bad::Header));
        assert_eq!(verify(&vec![0u8; 8192], &k, 10), Err(Bad::Header));
        assert_eq!(verify(&ext[..100], &k, 10), Err(Bad::Length));
    }

    #[test]
    fn the_checksum_covers_the_key() {
        assert_ne!(checksum(&key(1), b"same"), checksum(&key(2), b"same"));
    }

    #[test]
    fn records_round_trip_and_torn_ones_are_skipped() {
        let r = Record {
            key: key(3),
            offset: 8192,
            len: 77,
        };
        let mut file = idx_header(1 << 20).to_vec();
        file.extend_from_slice(&r.encode());
        let mut torn = r.encode();
        torn[5] ^= 0xff;
        file.extend_from_slice(&torn);
        file.extend_from_slice(&r.encode()[..40]);
        assert_eq!(parse_idx(&file), Some(vec![r]));
        file[0] = b'X';
        assert_eq!(parse_idx(&file), None);
        assert_eq!(parse_idx(&[0u8; 10]), None);
        let odd = Record { offset: 100, ..r };
        assert_eq!(Record::decode(&odd.encode()), None);
    }

    #[test]
    fn extents_are_aligned() {
        assert_eq!(extent(0), 4096);
        assert_eq!(extent(1), 8192);
        assert_eq!(extent(2 << 20), 4096 + (2 << 20));
    }
}
