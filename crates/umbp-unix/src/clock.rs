//! The host's clock and page size.

/// `CLOCK_MONOTONIC` now, in nanoseconds: one clock for every process of the host.
pub fn monotonic_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// The system page size.
pub fn page_size() -> u64 {
    rustix::param::page_size() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clock_moves_forward_and_pages_are_powers_of_two() {
        let a = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(monotonic_ns() >= a + 1_000_000);
        assert!(page_size().is_power_of_two() && page_size() >= 4096);
    }
}
