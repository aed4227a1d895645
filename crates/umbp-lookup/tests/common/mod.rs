//! Shared by the integration tests that run a live lookup server.

use umbp_lookup::LookupTarget;

/// Holds every block: prefix hits are the number of hashes asked.
pub struct AllHeld(pub &'static str);

impl LookupTarget for AllHeld {
    fn prefix_hits(&self, _g: u32, packed: &[u8], hl: usize) -> Result<u32, String> {
        Ok((packed.len() / hl) as u32)
    }
    fn exists(&self, _g: u32, packed: &[u8], hl: usize) -> Result<Vec<bool>, String> {
        Ok(vec![true; packed.len() / hl])
    }
    fn holds(&self, _g: u32, packed: &[u8], hl: usize) -> Result<Vec<bool>, String> {
        Ok(vec![true; packed.len() / hl])
    }
    fn clear(&self) -> u64 {
        0
    }
    fn describe(&self) -> String {
        self.0.into()
    }
}
