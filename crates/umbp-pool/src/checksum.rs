//! The object checksum of end-to-end integrity ([`umbp_core::Integrity`]): XXH3-64 of the
//! object's bytes, the hash the disk and remote tiers already use. Writers compute it where
//! the bytes pass a CPU anyway ([`Summer`] takes them piece by piece, in object order) and
//! hand it to [`Reservation::set_checksum`](crate::Reservation::set_checksum); the pool sums
//! a committed object itself only when its writer did not.

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

/// The checksum of `bytes`.
pub fn checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// A checksum built from an object's bytes in order, piece by piece; equal to
/// [`checksum`] of the pieces concatenated.
#[derive(Clone)]
pub struct Summer(Box<Xxh3>);

impl std::fmt::Debug for Summer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Summer")
    }
}

impl Default for Summer {
    fn default() -> Self {
        Summer(Box::new(Xxh3::new()))
    }
}

impl Summer {
    /// A checksum of no bytes yet.
    pub fn new() -> Summer {
        Summer::default()
    }

    /// Adds the next bytes of the object.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The checksum of every byte added.
    pub fn finish(&self) -> u64 {
        self.0.digest()
    }

    /// Starts again with no bytes.
    pub fn reset(&mut self) {
        self.0.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_sum_as_the_whole() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        for cut in [0usize, 1, 15, 240, 4096, 77_777, 100_000] {
            let mut s = Summer::new();
            s.update(&data[..cut]);
            s.update(&data[cut..]);
            assert_eq!(s.finish(), checksum(&data), "cut at {cut}");
        }
        let mut flipped = data.clone();
        flipped[5000] ^= 1;
        assert_ne!(checksum(&flipped), checksum(&data));
    }
}
