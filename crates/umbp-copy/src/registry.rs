//! Registered engine memory.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::CopyError;

/// Identifies one registration.
pub type RegionId = u64;

/// What kind of memory a registration is. Each device kind and ordinal is moved by its own
/// mover (see [`crate::CopyEngine::set_device_mover`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory this process can read and write directly.
    Host,
    /// Device memory of CUDA device `device` (moved by the engine's device mover).
    Cuda {
        /// The CUDA device ordinal.
        device: i32,
    },
}

/// One registered range. Jobs hold an `Arc` of it while they run, which keeps deregistration
/// from returning while bytes may still move.
#[derive(Debug)]
pub struct Registration {
    /// Its id.
    pub id: RegionId,
    /// First address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Host or device.
    pub kind: MemoryKind,
}

impl Registration {
    /// Whether `[addr, addr + len)` lies inside this registration.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr + self.len)
    }
}

/// The set of registrations, ordered by address.
#[derive(Debug, Default)]
pub struct MemoryRegistry {
    inner: RwLock<RegistryInner>,
}

#[derive(Debug, Default)]
struct RegistryInner {
    by_addr: BTreeMap<u64, Arc<Registration>>,
    next_id: RegionId,
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `[addr, addr + len)`.
    ///
    /// # Safety
    /// The memory must stay valid for reads and writes, and must not be freed, until
    /// [`MemoryRegistry::deregister`] of the returned id has returned `Ok`. Copies write into
    /// it from other threads while the caller's own code may also use it: ordering those
    /// accesses (not starting a load into blocks that are being read, say) is the caller's job.
    pub unsafe fn register(
        &self,
        addr: u64,
        len: u64,
        kind: MemoryKind,
    ) -> Result<RegionId, CopyError> {
        let bad = |reason: &str| CopyError::BadRegistration {
            addr,
            len,
            reason: reason.to_owned(),
        };
        if addr == 0 || len == 0 {
            return Err(bad("address and length must be non-zero"));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| bad("the range wraps past the end of the address space"))?;
        let mut inner = self.inner.write();
        if let Some((_, prev)) = inner.by_addr.range(..end).next_back() {
            if prev.addr + prev.len > addr {
                return Err(bad(&format!(
                    "it overlaps registration {} ({:#x}+{}); deregister that one first",
                    prev.id, prev.addr, prev.len
                )));
            }
        }
        inner.next_id += 1;
        let id = inner.next_id;
        inner.by_addr.insert(
            addr,
            Arc::new(Registration {
                id,
                addr,
                len,
                kind,
            }),
        );
        Ok(id)
    }

    /// Removes registration `id` (only that one). Waits up to `timeout` for transfers that use
    /// it to finish; when they do not, the registration stays and `RegionBusy` is returned.
    pub fn deregister(&self, id: RegionId, timeout: Duration) -> Result<(), CopyError> {
        let reg = {
            let inner = self.inner.read();
            inner
                .by_addr
                .values()
                .find(|r| r.id == id)
                .cloned()
                .ok_or(CopyError::UnknownRegion(id))?
        };
        let deadline = Instant::now() + timeout;
        // Our clone, the map's, and one per job that uses it.
        loop {
            let in_flight = Arc::strong_count(&reg) - 2;
            if in_flight == 0 {
                let mut inner = self.inner.write();
                if Arc::strong_count(&reg) == 2 {
                    inner.by_addr.remove(&reg.addr);
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(CopyError::RegionBusy { id, in_flight });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The registration that covers all of `[addr, addr + len)`, if one does.
    pub fn find(&self, addr: u64, len: u64) -> Option<Arc<Registration>> {
        let inner = self.inner.read();
        let (_, r) = inner.by_addr.range(..=addr).next_back()?;
        r.covers(addr, len).then(|| Arc::clone(r))
    }

    /// Whether one registration covers all of `[addr, addr + len)`.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        self.find(addr, len).is_some()
    }

    /// Whether registration `id` exists.
    pub fn contains(&self, id: RegionId) -> bool {
        self.inner.read().by_addr.values().any(|r| r.id == id)
    }

    /// Number of registrations.
    pub fn len(&self) -> usize {
        self.inner.read().by_addr.len()
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_respect_bounds() {
        let r = MemoryRegistry::new();
        // SAFETY: no copies run in this test; the addresses are never dereferenced.
        let a = unsafe { r.register(0x1000, 0x1000, MemoryKind::Host) }.unwrap();
        // SAFETY: as above.
        let b = unsafe { r.register(0x3000, 0x100, MemoryKind::Host) }.unwrap();
        assert!(r.contains(a) && r.contains(b));
        assert!(r.covers(0x1000, 0x1000));
        assert!(r.covers(0x1800, 0x10));
        assert!(!r.covers(0x1800, 0x1000), "runs past the end");
        assert!(!r.covers(0x2000, 1), "gap");
        assert!(!r.covers(0xfff, 2), "starts before");
        assert!(!r.covers(u64::MAX, 2), "wraps");
        r.deregister(a, Duration::ZERO).unwrap();
        assert!(!r.covers(0x1000, 1));
        assert!(
            r.covers(0x3000, 0x100),
            "deregistering one region keeps the others"
        );
        assert!(matches!(
            r.deregister(a, Duration::ZERO),
            Err(CopyError::UnknownRegion(_))
        ));
        assert!(!r.contains(a), "a deregistered id is gone");
        assert!(r.contains(b), "the other registration's id is known");
    }

    #[test]
    fn overlaps_and_empty_ranges_are_rejected() {
        let r = MemoryRegistry::new();
        // SAFETY: never dereferenced.
        unsafe { r.register(0x1000, 0x1000, MemoryKind::Host) }.unwrap();
        // SAFETY: never dereferenced.
        let e = unsafe { r.register(0x1800, 0x1000, MemoryKind::Host) }.unwrap_err();
        assert!(e.to_string().contains("overlaps"), "{e}");
        // SAFETY: never dereferenced.
        assert!(unsafe { r.register(0x9000, 0, MemoryKind::Host) }.is_err());
    }

    #[test]
    fn busy_registrations_are_not_dropped() {
        let r = MemoryRegistry::new();
        // SAFETY: never dereferenced.
        let id = unsafe { r.register(0x1000, 0x1000, MemoryKind::Host) }.unwrap();
        let held = r.find(0x1000, 8).unwrap();
        assert!(matches!(
            r.deregister(id, Duration::from_millis(5)),
            Err(CopyError::RegionBusy { in_flight: 1, .. })
        ));
        drop(held);
        r.deregister(id, Duration::from_millis(5)).unwrap();
    }
}
