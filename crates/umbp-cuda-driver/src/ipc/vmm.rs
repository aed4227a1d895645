//! The server's side for memory of the virtual memory management API: another process's
//! physical allocations, imported from their descriptors and mapped back to back into one
//! reserved range ([`ImportedVmm`]); and the same kind of memory made here for tests
//! ([`VmmAllocation`]).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use crate::device::Device;
use crate::error::CudaError;
use crate::result::{self, ipc, require, OptionalEntryPoint};
use crate::sys::library::Driver;
use crate::sys::types::*;

/// Checks that chunks `(offset, size)` lie back to back from offset 0, in order; returns their
/// total size.
fn chunk_layout(chunks: impl IntoIterator<Item = (u64, u64)>) -> Result<u64, CudaError> {
    let bad = |reason: String| CudaError::Import { reason };
    let mut next = 0u64;
    let mut n = 0usize;
    for (i, (offset, size)) in chunks.into_iter().enumerate() {
        if size == 0 {
            return Err(bad(format!("chunk {i} is empty")));
        }
        if offset != next {
            return Err(bad(format!(
                "chunk {i} starts at offset {offset}, where the chunks before it end at {next}: \
                 the chunks must lie back to back from offset 0, in order, as \
                 export_device_range returns them"
            )));
        }
        next = offset
            .checked_add(size)
            .ok_or_else(|| bad(format!("chunk {i} wraps the address space")))?;
        n += 1;
    }
    if n == 0 {
        return Err(bad("no chunks".into()));
    }
    Ok(next)
}

/// Checks that every chunk's size is a multiple of the allocation granularity.
fn check_granularity(
    chunks: impl IntoIterator<Item = (u64, u64)>,
    granularity: u64,
) -> Result<(), CudaError> {
    for (i, (_, size)) in chunks.into_iter().enumerate() {
        if granularity == 0 || size % granularity != 0 {
            return Err(CudaError::Import {
                reason: format!(
                    "chunk {i}'s size {size} is not a multiple of the device's allocation \
                     granularity {granularity}: it is not a whole cuMemCreate allocation"
                ),
            });
        }
    }
    Ok(())
}

/// The minimum allocation granularity of pinned device memory exportable as POSIX file
/// descriptors (`cuMemGetAllocationGranularity`). Needs no current context.
fn granularity(dev: &Device) -> Result<u64, CudaError> {
    let prop =
        CUmemAllocationProp::device(dev.raw_device(), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    let g =
        ipc::mem_get_allocation_granularity(dev.driver(), &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM)?;
    if g == 0 {
        return Err(CudaError::Invalid(
            "cuMemGetAllocationGranularity returned 0".into(),
        ));
    }
    Ok(g as u64)
}

/// The allocation granularity of device `device`'s memory for the virtual memory management
/// API: every chunk [`ImportedVmm::map`] maps is a multiple of it.
pub fn vmm_granularity(device: i32) -> Result<u64, CudaError> {
    granularity(&*Device::open(device)?)
}

/// Checks that the driver has every entry point a [`VmmRange`] needs (an old driver may lack
/// them), before anything is reserved.
fn require_vmm_range(drv: &Driver) -> Result<(), CudaError> {
    for entry in [
        OptionalEntryPoint::MemAddressReserve,
        OptionalEntryPoint::MemAddressFree,
        OptionalEntryPoint::MemMap,
        OptionalEntryPoint::MemUnmap,
        OptionalEntryPoint::MemRelease,
        OptionalEntryPoint::MemSetAccess,
    ] {
        require(drv, entry)?;
    }
    Ok(())
}

/// One physical allocation of a [`VmmRange`].
#[derive(Debug)]
struct Piece {
    offset: u64,
    size: u64,
    handle: CUmemGenericAllocationHandle,
    mapped: bool,
}

/// A reserved address range with physical allocations mapped into it back to back. Dropping
/// it undoes whatever was done: unmaps what was mapped, releases every handle it holds, frees
/// the addresses (so a failure half-way through building one leaves nothing behind).
#[derive(Debug)]
struct VmmRange {
    dev: Arc<Device>,
    va: CUdeviceptr,
    len: u64,
    pieces: Vec<Piece>,
}

impl VmmRange {
    /// Reserves `len` bytes of addresses aligned to `align`. Needs the device's context
    /// current.
    fn reserve(dev: &Arc<Device>, len: u64, align: u64) -> Result<Self, CudaError> {
        let va = ipc::mem_address_reserve(dev.driver(), len as usize, align as usize)?;
        Ok(VmmRange {
            dev: Arc::clone(dev),
            va,
            len,
            pieces: Vec::new(),
        })
    }

    /// Maps the whole allocation `handle` (which the range now owns: it is released on drop,
    /// also when mapping fails) at `offset`.
    fn map_piece(
        &mut self,
        offset: u64,
        size: u64,
        handle: CUmemGenericAllocationHandle,
    ) -> Result<(), CudaError> {
        self.pieces.push(Piece {
            offset,
            size,
            handle,
            mapped: false,
        });
        debug_assert!(offset + size <= self.len);
        // SAFETY: `[va + offset, va + offset + size)` lies in our reservation and nothing is
        // mapped there (the pieces are back to back); the handle is live.
        unsafe {
            ipc::mem_map(
                self.dev.driver(),
                self.va + offset,
                size as usize,
                0,
                handle,
            )
        }?;
        if let Some(p) = self.pieces.last_mut() {
            p.mapped = true;
        }
        Ok(())
    }

    /// Lets the device read and write every piece (per mapping, as PyTorch does).
    fn allow_access(&self) -> Result<(), CudaError> {
        let desc = CUmemAccessDesc {
            location: CUmemLocation {
                type_: CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.dev.raw_device(),
            },
            flags: CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        for p in &self.pieces {
            // SAFETY: a mapped range of our reservation and one valid descriptor.
            unsafe {
                ipc::mem_set_access(
                    self.dev.driver(),
                    self.va + p.offset,
                    p.size as usize,
                    std::slice::from_ref(&desc),
                )
            }?;
        }
        Ok(())
    }
}

impl Drop for VmmRange {
    fn drop(&mut self) {
        if result::driver().is_err() {
            return;
        }
        let Ok(_g) = self.dev.scoped() else {
            return;
        };
        let drv = self.dev.driver();
        for p in self.pieces.iter().filter(|p| p.mapped) {
            // SAFETY: a mapping this range made; its user has finished copying.
            let _ = unsafe { ipc::mem_unmap(drv, self.va + p.offset, p.size as usize) };
        }
        for p in &self.pieces {
            // SAFETY: the handle this range owns (created or imported), unmapped above.
            let _ = unsafe { ipc::mem_release(drv, p.handle) };
        }
        // SAFETY: our reservation, with nothing mapped in it any more.
        let _ = unsafe { ipc::mem_address_free(drv, self.va, self.len as usize) };
    }
}

/// Another process's memory of the virtual memory management API, mapped into this one: its
/// physical allocations, imported from their descriptors, back to back in one reserved range;
/// unmapped and released when dropped. Send and Sync: addresses and driver handles, usable
/// from any thread.
#[derive(Debug)]
pub struct ImportedVmm {
    range: VmmRange,
}

impl ImportedVmm {
    /// Maps `chunks` (descriptor, offset, size: [`DeviceExport::Vmm`]'s chunks, received over
    /// a Unix socket) on device `device` of this process, back to back from offset 0, readable
    /// and writable by the device. The descriptors are only borrowed: the caller may close
    /// them afterwards.
    pub fn map(device: i32, chunks: &[(BorrowedFd<'_>, u64, u64)]) -> Result<Self, CudaError> {
        let layout = || chunks.iter().map(|c| (c.1, c.2));
        let total = chunk_layout(layout())?;
        let dev = Device::open(device)?;
        let drv = dev.driver();
        require(drv, OptionalEntryPoint::MemImportFromShareableHandle)?;
        require_vmm_range(drv)?;
        let g = granularity(&dev)?;
        check_granularity(layout(), g)?;
        let _g = dev.scoped()?;
        let mut range = VmmRange::reserve(&dev, total, g)?;
        for (i, (fd, offset, size)) in chunks.iter().enumerate() {
            // The descriptor is only read, and open for as long as it is borrowed.
            let h = ipc::mem_import_from_posix_fd(drv, *fd).map_err(|e| CudaError::Import {
                reason: format!(
                    "chunk {i} (descriptor {}): {e}; pass the descriptors \
                         export_device_range made, received over a Unix socket (SCM_RIGHTS)",
                    fd.as_raw_fd()
                ),
            })?;
            range
                .map_piece(*offset, *size, h)
                .map_err(|e| CudaError::Import {
                    reason: format!(
                        "chunk {i}: {e}; each chunk's size must be its whole allocation's"
                    ),
                })?;
        }
        range.allow_access()?;
        Ok(ImportedVmm { range })
    }

    /// Where the chunks are mapped in this process (the first chunk's start).
    pub fn addr(&self) -> u64 {
        self.range.va
    }

    /// The chunks' total size.
    pub fn len(&self) -> u64 {
        self.range.len
    }

    /// Whether it is empty (never: no chunks is refused).
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }
}

/// Test support (not part of the API): memory of the virtual memory management API, as
/// PyTorch's expandable segments make it: `cuMemCreate` allocations of `chunk_sizes` (each a
/// multiple of [`vmm_granularity`]) mapped back to back into one reserved range, readable and
/// writable by the device; `exportable` asks for POSIX file descriptors as handle types.
#[doc(hidden)]
#[derive(Debug)]
pub struct VmmAllocation {
    range: VmmRange,
}

#[doc(hidden)]
impl VmmAllocation {
    /// Test support: see [`VmmAllocation`].
    pub fn create(device: i32, chunk_sizes: &[u64], exportable: bool) -> Result<Self, CudaError> {
        let mut offsets = Vec::with_capacity(chunk_sizes.len());
        let mut next = 0u64;
        for &s in chunk_sizes {
            offsets.push((next, s));
            next = next.saturating_add(s);
        }
        let total = chunk_layout(offsets.iter().copied())?;
        let dev = Device::open(device)?;
        let drv = dev.driver();
        require(drv, OptionalEntryPoint::MemCreate)?;
        require_vmm_range(drv)?;
        let g = granularity(&dev)?;
        check_granularity(offsets.iter().copied(), g)?;
        let _g = dev.scoped()?;
        let mut range = VmmRange::reserve(&dev, total, g)?;
        let types = if exportable {
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        } else {
            CU_MEM_HANDLE_TYPE_NONE
        };
        let prop = CUmemAllocationProp::device(dev.raw_device(), types);
        for (offset, size) in offsets {
            let h = ipc::mem_create(drv, size as usize, &prop)?;
            range.map_piece(offset, size, h)?;
        }
        range.allow_access()?;
        Ok(VmmAllocation { range })
    }

    /// Test support: the range's start.
    pub fn addr(&self) -> u64 {
        self.range.va
    }

    /// Test support: the range's size.
    pub fn len(&self) -> u64 {
        self.range.len
    }

    /// Test support: whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_must_lie_back_to_back_from_zero() {
        assert_eq!(chunk_layout([(0, 4), (4, 8), (12, 4)]), Ok(16));
        assert_eq!(chunk_layout([(0, 2 << 20)]), Ok(2 << 20));
        let m = chunk_layout([(0, 4), (8, 4)]).unwrap_err().to_string();
        assert!(
            m.contains("chunk 1 starts at offset 8") && m.contains("end at 4"),
            "{m}"
        );
        let m = chunk_layout([(4, 4)]).unwrap_err().to_string();
        assert!(m.contains("chunk 0 starts at offset 4"), "{m}");
        // Out of order is refused too (overlap included).
        assert!(chunk_layout([(4, 4), (0, 4)]).is_err());
        assert!(chunk_layout([(0, 8), (4, 4)]).is_err());
        let m = chunk_layout([(0, 4), (4, 0)]).unwrap_err().to_string();
        assert!(m.contains("chunk 1 is empty"), "{m}");
        assert!(chunk_layout(std::iter::empty()).is_err());
        assert!(chunk_layout([(0, u64::MAX), (u64::MAX, 1)]).is_err());
        assert!(chunk_layout([(0, u64::MAX - 1), (u64::MAX - 1, 2)]).is_err());
    }

    #[test]
    fn chunk_sizes_must_be_whole_allocations() {
        let g = 2 << 20;
        assert!(check_granularity([(0, g), (g, 2 * g)], g).is_ok());
        let m = check_granularity([(0, g), (g, g / 2)], g)
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("chunk 1's size") && m.contains("granularity"),
            "{m}"
        );
        assert!(check_granularity([(0, g)], 0).is_err());
    }
}
