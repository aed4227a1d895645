//! What every command shares: progress lines on stderr, human-readable byte counts and the
//! default thread count.

/// Threads to use when the user does not say: every core.
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Prints a progress line to stderr (stdout is kept for results).
macro_rules! progress {
    ($($t:tt)*) => { eprintln!("[umbp bench] {}", format!($($t)*)) };
}
pub(crate) use progress;

/// `1.50 GiB`-style bytes (powers of 1024).
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}
