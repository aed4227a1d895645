//! The benchmark's buffers: which pages back them ([`PageMode`]) and [`Buf`], a 2 MiB-aligned
//! anonymous mapping of this process.

use anyhow::{ensure, Result};

/// Buffers start on this boundary, so transparent huge pages can back them whole.
pub(super) const ALIGN: usize = 2 << 20;

/// Which pages back the buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PageMode {
    /// 4 KiB pages (transparent huge pages refused with MADV_NOHUGEPAGE).
    #[value(name = "4k")]
    Small,
    /// Transparent huge pages asked for with MADV_HUGEPAGE, where the host grants them.
    Thp,
}

impl PageMode {
    pub(super) fn name(self) -> &'static str {
        match self {
            PageMode::Small => "4k",
            PageMode::Thp => "thp",
        }
    }
}

/// An anonymous private buffer of this process, 2 MiB-aligned. Unmapped on drop.
pub(super) struct Buf {
    pub(super) addr: usize,
    pub(super) len: usize,
}

impl Buf {
    pub(super) fn map(len: usize, mode: PageMode) -> Result<Buf> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing; checked below.
        let r = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len + ALIGN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        ensure!(
            r != libc::MAP_FAILED,
            "cannot map {len} bytes: {}; lower --total-mib",
            std::io::Error::last_os_error()
        );
        let head = r.cast::<u8>().align_offset(ALIGN);
        let addr = r as usize + head;
        // SAFETY: trimming the unused ends (`head < ALIGN`) of the mapping just made.
        unsafe {
            if head > 0 {
                libc::munmap(r, head);
            }
            if ALIGN - head > 0 {
                libc::munmap((addr + len) as *mut libc::c_void, ALIGN - head);
            }
        }
        let advice = match mode {
            PageMode::Small => libc::MADV_NOHUGEPAGE,
            PageMode::Thp => libc::MADV_HUGEPAGE,
        };
        // SAFETY: advising our own mapping; a refusal only leaves the default pages.
        unsafe { libc::madvise(addr as *mut libc::c_void, len, advice) };
        Ok(Buf { addr, len })
    }

    /// Writes every byte (allocating every page).
    pub(super) fn fill(&self, byte: u8) {
        // SAFETY: the whole mapping is ours and nothing else uses it yet.
        unsafe { std::ptr::write_bytes(self.addr as *mut u8, byte, self.len) };
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our own mapping; no copies run after the benchmark.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len) };
    }
}
