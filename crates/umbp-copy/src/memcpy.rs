//! Bulk copies for the host backend.
//!
//! Pieces of KV blocks are tens of KiB, copied into memory that will not be read again soon.
//! Plain `memcpy` at that size uses ordinary stores, which read every destination line before
//! writing it and evict useful cache lines. Above [`STREAM_THRESHOLD`] bytes this copies with
//! non-temporal (streaming) stores instead, as `memcpy` itself does only for copies larger than
//! the last-level cache: that is what lets scattered 32 KiB pieces move at contiguous-copy speed.

/// Pieces at least this long use streaming stores.
pub const STREAM_THRESHOLD: usize = 4096;

/// Copies `len` bytes from `src` to `dst`; call [`fence`] before other threads read `dst`.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads and `dst` for `len` bytes of writes, and the
/// two ranges must not overlap.
#[inline]
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= STREAM_THRESHOLD {
        // SAFETY: forwarded contract.
        unsafe { stream_copy_x86_64(dst, src, len) };
        return;
    }
    // SAFETY: forwarded contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Orders streaming stores before later stores (and before the job is reported done).
#[inline]
pub fn fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `sfence` has no memory-safety preconditions; SSE2 is baseline on x86_64.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// # Safety
/// As [`copy`].
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn stream_copy_x86_64(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    // Align the destination to 16 bytes with an ordinary copy of the head.
    let head = dst.align_offset(16).min(len);
    // SAFETY: `head <= len`, inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut d = dst.wrapping_add(head);
    let mut s = src.wrapping_add(head);
    let mut left = len - head;
    while left >= 64 {
        // SAFETY: 64 bytes remain in both ranges; `d` is 16-byte aligned as the streaming
        // store requires; unaligned loads are allowed on `s`.
        unsafe {
            let a = _mm_loadu_si128(s as *const __m128i);
            let b = _mm_loadu_si128(s.add(16) as *const __m128i);
            let c = _mm_loadu_si128(s.add(32) as *const __m128i);
            let e = _mm_loadu_si128(s.add(48) as *const __m128i);
            _mm_stream_si128(d as *mut __m128i, a);
            _mm_stream_si128(d.add(16) as *mut __m128i, b);
            _mm_stream_si128(d.add(32) as *mut __m128i, c);
            _mm_stream_si128(d.add(48) as *mut __m128i, e);
            d = d.add(64);
            s = s.add(64);
        }
        left -= 64;
    }
    // SAFETY: the tail of `left < 64` bytes lies inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(s, d, left) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 253) as u8).collect();
        for len in [0, 1, 63, 64, 4095, 4096, 4097, 10_001, 16_384] {
            for off in [0, 1, 15] {
                let mut dst = vec![0u8; len + 32];
                // SAFETY: both buffers hold `len` bytes past the offsets.
                unsafe { copy(dst.as_mut_ptr().add(off), src.as_ptr().add(3), len) };
                fence();
                assert_eq!(
                    &dst[off..off + len],
                    &src[3..3 + len],
                    "len {len} off {off}"
                );
                assert!(dst[..off].iter().all(|b| *b == 0));
                assert!(dst[off + len..].iter().all(|b| *b == 0));
            }
        }
    }
}
