//! Bulk copies for the host backend.
//!
//! Pieces of KV blocks are tens of KiB, copied into memory that will not be read again soon.
//! Which copy moves them fastest depends on the host: on the AMD EPYC hosts measured here,
//! non-temporal (streaming) 16-byte stores beat the C library's `memcpy` by ~15% (its ordinary
//! stores read every destination line before writing it); on Intel Sapphire Rapids hosts,
//! `memcpy` (`rep movsb`, which writes whole lines without reading them) beat those streaming
//! stores by ~20%. So the copy of pieces of at least [`STREAM_THRESHOLD`] bytes is chosen per
//! process, by measuring every candidate this CPU supports on the pattern the engine copies
//! ([`calibrate`], run once when the first copy engine starts), or by `UMBP_HOST_COPY`.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// Pieces at least this long use the host's chosen bulk copy ([`HostCopy`]); shorter ones
/// the C library's `memcpy`.
pub const STREAM_THRESHOLD: usize = 4096;

/// A way to copy large pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCopy {
    /// Non-temporal 16-byte stores (SSE2, every x86_64 CPU).
    Stream16,
    /// Non-temporal 32-byte stores (AVX).
    Stream32,
    /// Non-temporal 64-byte stores, one whole cache line each (AVX-512F).
    Stream64,
    /// The C library's `memcpy` (glibc chooses `rep movsb`, vector or non-temporal copies by
    /// size and CPU).
    Libc,
}

impl HostCopy {
    /// Every variant, in the order they are tried.
    pub const ALL: [HostCopy; 4] = [
        HostCopy::Stream16,
        HostCopy::Stream32,
        HostCopy::Stream64,
        HostCopy::Libc,
    ];

    /// The name `UMBP_HOST_COPY` and the benchmarks use.
    pub fn name(self) -> &'static str {
        match self {
            HostCopy::Stream16 => "stream16",
            HostCopy::Stream32 => "stream32",
            HostCopy::Stream64 => "stream64",
            HostCopy::Libc => "libc",
        }
    }

    /// The variant named `name` (as [`HostCopy::name`] gives it).
    pub fn from_name(name: &str) -> Option<HostCopy> {
        HostCopy::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Whether this CPU can run it.
    pub fn supported(self) -> bool {
        match self {
            HostCopy::Libc => true,
            #[cfg(target_arch = "x86_64")]
            HostCopy::Stream16 => true,
            #[cfg(target_arch = "x86_64")]
            HostCopy::Stream32 => std::arch::is_x86_feature_detected!("avx"),
            #[cfg(target_arch = "x86_64")]
            HostCopy::Stream64 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    fn code(self) -> u8 {
        self as u8 + 1
    }
}

/// The chosen copy (0: not chosen yet).
static CHOSEN: AtomicU8 = AtomicU8::new(0);
static CALIBRATION: OnceLock<Calibration> = OnceLock::new();

/// What [`calibrate`] measured: GB/s of each supported candidate and the one chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    /// The copy in use from now on.
    pub chosen: HostCopy,
    /// Why: `"measured"`, `"UMBP_HOST_COPY"`, or `"default"` (nothing measured yet).
    pub how: &'static str,
    /// (candidate, GB/s) in [`HostCopy::ALL`] order; empty unless measured.
    pub gbps: Vec<(HostCopy, f64)>,
}

/// The copy in use (the default, [`HostCopy::Stream16`] on x86_64, until [`calibrate`] or
/// [`set`] chose one).
pub fn chosen() -> HostCopy {
    match CHOSEN.load(Ordering::Relaxed) {
        0 => default_copy(),
        c => HostCopy::ALL[(c - 1) as usize],
    }
}

fn default_copy() -> HostCopy {
    if cfg!(target_arch = "x86_64") {
        HostCopy::Stream16
    } else {
        HostCopy::Libc
    }
}

/// Uses `copy` from now on in this process (benchmarks and tests; an unsupported one is
/// refused and `false` returned).
pub fn set(copy: HostCopy) -> bool {
    if !copy.supported() {
        return false;
    }
    CHOSEN.store(copy.code(), Ordering::Relaxed);
    true
}

/// Chooses this process's bulk copy once: from `UMBP_HOST_COPY` (`stream16`, `stream32`,
/// `stream64`, `libc`; `auto` or unset measures), else by timing every candidate this CPU
/// supports with `threads` threads (at most one per core, 16 in all), each copying 32 KiB
/// pieces between 8 MiB buffers of its own flushed out of the caches before each pass, so that
/// every copy reads and writes memory as the engine's do (about 0.1-0.3 s, once per process).
/// Later calls return the first result.
pub fn calibrate(threads: usize) -> &'static Calibration {
    CALIBRATION.get_or_init(|| {
        let forced = std::env::var("UMBP_HOST_COPY").ok();
        if let Some(c) = forced.as_deref().and_then(HostCopy::from_name) {
            if set(c) {
                return Calibration {
                    chosen: c,
                    how: "UMBP_HOST_COPY",
                    gbps: Vec::new(),
                };
            }
        }
        // At most one thread per core and 16 in all (256 MiB of buffers), whatever the
        // engine's worker count.
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let gbps = measure(threads.clamp(1, cores.min(16)), 8 << 20, 5);
        let best = gbps
            .iter()
            .copied()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(default_copy(), |(c, _)| c);
        set(best);
        Calibration {
            chosen: best,
            how: "measured",
            gbps,
        }
    })
}

/// The calibration, if one ran.
pub fn calibration() -> Option<&'static Calibration> {
    CALIBRATION.get()
}

/// GB/s of every supported candidate: `threads` threads each copy `per_thread` bytes in
/// 32 KiB pieces from and to buffers flushed out of the caches, `rounds` rounds with the
/// candidates interleaved, best round kept.
pub fn measure(threads: usize, per_thread: usize, rounds: u32) -> Vec<(HostCopy, f64)> {
    const PIECE: usize = 32 << 10;
    let per_thread = per_thread.next_multiple_of(PIECE);
    let cands: Vec<HostCopy> = HostCopy::ALL
        .into_iter()
        .filter(|c| c.supported())
        .collect();
    let mut bufs: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
        .map(|t| (vec![t as u8 | 1; per_thread], vec![0u8; per_thread]))
        .collect();
    let mut best = vec![f64::MAX; cands.len()];
    for _ in 0..rounds {
        for (ci, &c) in cands.iter().enumerate() {
            // Both sides out of the cache first, as the engine finds them (a KV cache and a
            // pool of GiBs): copies into cached lines would favour ordinary stores.
            std::thread::scope(|s| {
                for (src, dst) in bufs.iter_mut() {
                    s.spawn(move || {
                        evict(src);
                        evict(dst);
                    });
                }
            });
            let t0 = Instant::now();
            std::thread::scope(|s| {
                for (src, dst) in bufs.iter_mut() {
                    s.spawn(move || {
                        for (d, sc) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
                            // SAFETY: `d` and `sc` are equal-length pieces of distinct buffers.
                            unsafe { copy_with(c, d.as_mut_ptr(), sc.as_ptr(), d.len()) };
                        }
                        fence();
                    });
                }
            });
            best[ci] = best[ci].min(t0.elapsed().as_secs_f64());
        }
    }
    let bytes = (threads * per_thread) as f64;
    cands
        .into_iter()
        .zip(best)
        .map(|(c, s)| (c, bytes / s / 1e9))
        .collect()
}

/// Writes `buf`'s cache lines back and drops them from every cache level.
fn evict(buf: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        for line in buf.chunks(64) {
            // SAFETY: `clflush` of an address inside a live buffer has no memory-safety
            // preconditions; SSE2 (which has it) is baseline on x86_64.
            unsafe { std::arch::x86_64::_mm_clflush(line.as_ptr()) };
        }
        // SAFETY: as above.
        unsafe { std::arch::x86_64::_mm_mfence() };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = buf;
}

/// Copies `len` bytes from `src` to `dst` with the chosen copy; call [`fence`] before other
/// threads read `dst`.
///
/// # Safety
/// `src` must be valid for `len` bytes of reads and `dst` for `len` bytes of writes, and the
/// two ranges must not overlap.
#[inline]
pub unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    if len >= STREAM_THRESHOLD {
        // SAFETY: forwarded contract; `chosen()` is always a supported copy.
        unsafe { copy_with(chosen(), dst, src, len) };
        return;
    }
    // SAFETY: forwarded contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

/// Copies with `how`, whatever its length.
///
/// # Safety
/// As [`copy`], and `how` must be [`HostCopy::supported`] on this CPU.
#[inline]
pub unsafe fn copy_with(how: HostCopy, dst: *mut u8, src: *const u8, len: usize) {
    match how {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract.
        HostCopy::Stream16 => unsafe { x86::stream16(dst, src, len) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract; the caller checked AVX support.
        HostCopy::Stream32 => unsafe { x86::stream32(dst, src, len) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded contract; the caller checked AVX-512F support.
        HostCopy::Stream64 => unsafe { x86::stream64(dst, src, len) },
        // SAFETY: forwarded contract.
        _ => unsafe { std::ptr::copy_nonoverlapping(src, dst, len) },
    }
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Copies the head with an ordinary copy until `dst` is `align`-byte aligned; returns the
    /// advanced pointers and the bytes left.
    ///
    /// # Safety
    /// As [`super::copy`].
    #[inline(always)]
    unsafe fn head(
        dst: *mut u8,
        src: *const u8,
        len: usize,
        align: usize,
    ) -> (*mut u8, *const u8, usize) {
        let head = dst.align_offset(align).min(len);
        // SAFETY: `head <= len`, inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        (dst.wrapping_add(head), src.wrapping_add(head), len - head)
    }

    /// # Safety
    /// As [`super::copy`].
    #[inline]
    pub unsafe fn stream16(dst: *mut u8, src: *const u8, len: usize) {
        // SAFETY: forwarded contract.
        let (mut d, mut s, mut left) = unsafe { head(dst, src, len, 16) };
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

    /// # Safety
    /// As [`super::copy`], on a CPU with AVX.
    #[target_feature(enable = "avx")]
    pub unsafe fn stream32(dst: *mut u8, src: *const u8, len: usize) {
        // SAFETY: forwarded contract.
        let (mut d, mut s, mut left) = unsafe { head(dst, src, len, 32) };
        while left >= 128 {
            // SAFETY: 128 bytes remain in both ranges; `d` is 32-byte aligned as the streaming
            // store requires; unaligned loads are allowed on `s`.
            unsafe {
                let a = _mm256_loadu_si256(s as *const __m256i);
                let b = _mm256_loadu_si256(s.add(32) as *const __m256i);
                let c = _mm256_loadu_si256(s.add(64) as *const __m256i);
                let e = _mm256_loadu_si256(s.add(96) as *const __m256i);
                _mm256_stream_si256(d as *mut __m256i, a);
                _mm256_stream_si256(d.add(32) as *mut __m256i, b);
                _mm256_stream_si256(d.add(64) as *mut __m256i, c);
                _mm256_stream_si256(d.add(96) as *mut __m256i, e);
                d = d.add(128);
                s = s.add(128);
            }
            left -= 128;
        }
        // SAFETY: the tail of `left < 128` bytes lies inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(s, d, left) };
    }

    /// # Safety
    /// As [`super::copy`], on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn stream64(dst: *mut u8, src: *const u8, len: usize) {
        // SAFETY: forwarded contract.
        let (mut d, mut s, mut left) = unsafe { head(dst, src, len, 64) };
        while left >= 256 {
            // SAFETY: 256 bytes remain in both ranges; `d` is 64-byte aligned as the streaming
            // store requires; unaligned loads are allowed on `s`.
            unsafe {
                let a = _mm512_loadu_si512(s as *const __m512i);
                let b = _mm512_loadu_si512(s.add(64) as *const __m512i);
                let c = _mm512_loadu_si512(s.add(128) as *const __m512i);
                let e = _mm512_loadu_si512(s.add(192) as *const __m512i);
                _mm512_stream_si512(d as *mut __m512i, a);
                _mm512_stream_si512(d.add(64) as *mut __m512i, b);
                _mm512_stream_si512(d.add(128) as *mut __m512i, c);
                _mm512_stream_si512(d.add(192) as *mut __m512i, e);
                d = d.add(256);
                s = s.add(256);
            }
            left -= 256;
        }
        // SAFETY: the tail of `left < 256` bytes lies inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(s, d, left) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_copy_copies_every_length_and_alignment() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 % 253) as u8).collect();
        for how in HostCopy::ALL.into_iter().filter(|c| c.supported()) {
            for len in [
                0, 1, 63, 64, 127, 255, 256, 4095, 4096, 4097, 10_001, 16_384,
            ] {
                for off in [0, 1, 15, 33] {
                    let mut dst = vec![0u8; len + 80];
                    // SAFETY: both buffers hold `len` bytes past the offsets; `how` is
                    // supported.
                    unsafe { copy_with(how, dst.as_mut_ptr().add(off), src.as_ptr().add(3), len) };
                    fence();
                    assert_eq!(
                        &dst[off..off + len],
                        &src[3..3 + len],
                        "{how:?} len {len} off {off}"
                    );
                    assert!(dst[..off].iter().all(|b| *b == 0), "{how:?} wrote before");
                    assert!(
                        dst[off + len..].iter().all(|b| *b == 0),
                        "{how:?} wrote after"
                    );
                }
            }
        }
    }

    #[test]
    fn names_round_trip_and_the_c_library_is_always_there() {
        for c in HostCopy::ALL {
            assert_eq!(HostCopy::from_name(c.name()), Some(c));
        }
        assert_eq!(HostCopy::from_name("rep-movsb"), None);
        assert!(HostCopy::Libc.supported());
    }

    #[test]
    fn measuring_times_only_supported_copies_and_gives_rates() {
        let m = measure(2, 1 << 20, 1);
        assert!(!m.is_empty());
        assert!(m.iter().all(|(c, g)| c.supported() && *g > 0.0), "{m:?}");
        assert!(m.iter().any(|(c, _)| *c == HostCopy::Libc));
    }
}
