//! A heap buffer aligned for direct I/O.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::format::ALIGN;

/// A zeroed, [`ALIGN`]-aligned buffer whose length is a multiple of [`ALIGN`]; grows (never
/// shrinks) on demand.
#[derive(Debug)]
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// An empty buffer (no allocation).
    pub fn new() -> AlignedBuf {
        AlignedBuf {
            ptr: NonNull::dangling(),
            len: 0,
        }
    }

    /// The buffer, at least `len` bytes long (rounded up to [`ALIGN`]); contents are kept
    /// only while it need not grow.
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        let want = len.div_ceil(ALIGN as usize) * ALIGN as usize;
        if want > self.len {
            self.free();
            let layout = Layout::from_size_align(want, ALIGN as usize).expect("valid layout");
            // SAFETY: `want` is non-zero (`want > self.len >= 0`) and the layout valid.
            let p = unsafe { alloc_zeroed(layout) };
            self.ptr = NonNull::new(p).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
            self.len = want;
        }
        // SAFETY: `ptr` points to `self.len` initialised (zeroed or written) bytes owned by
        // this buffer, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn free(&mut self) {
        if self.len > 0 {
            let layout = Layout::from_size_align(self.len, ALIGN as usize).expect("valid layout");
            // SAFETY: allocated in `get` with this very layout, and not freed since.
            unsafe { dealloc(self.ptr.as_ptr(), layout) };
            self.len = 0;
            self.ptr = NonNull::dangling();
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.free();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_aligned() {
        let mut b = AlignedBuf::new();
        let s = b.get(10);
        assert_eq!((s.len(), s.as_ptr() as usize % 4096), (4096, 0));
        s[0] = 5;
        assert_eq!(b.get(100)[0], 5);
        let s = b.get(5000);
        assert_eq!((s.len(), s.as_ptr() as usize % 4096), (8192, 0));
    }
}
