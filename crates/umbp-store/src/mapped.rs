//! Checking that memory handed to the store is mapped in this process.

use crate::error::StoreError;

/// Checks through `/proc/self/maps` that `[addr, addr + len)` is mapped readable and writable
/// in this process: a range that is not would crash the process on the first copy.
pub(crate) fn check_mapped_writable(addr: u64, len: u64) -> Result<(), StoreError> {
    let err = |reason: String| StoreError::Unmapped { addr, len, reason };
    let end = addr
        .checked_add(len)
        .ok_or_else(|| err("the range wraps around the address space".into()))?;
    let maps = match std::fs::read_to_string("/proc/self/maps") {
        Ok(m) => m,
        Err(e) => {
            log::warn!("umbp: /proc/self/maps unreadable ({e}); registered memory is not checked");
            return Ok(());
        }
    };
    let mut spans: Vec<(u64, u64, bool)> = maps
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (lo, hi) = f.next()?.split_once('-')?;
            let perms = f.next()?.as_bytes();
            let rw = perms.len() >= 2 && perms[0] == b'r' && perms[1] == b'w';
            Some((
                u64::from_str_radix(lo, 16).ok()?,
                u64::from_str_radix(hi, 16).ok()?,
                rw,
            ))
        })
        .collect();
    spans.sort_unstable();
    let mut at = addr;
    for (lo, hi, rw) in spans {
        if hi <= at {
            continue;
        }
        if lo > at || at >= end {
            break;
        }
        if !rw {
            return Err(err(format!(
                "{at:#x} lies in a mapping that is not readable and writable"
            )));
        }
        at = hi;
    }
    if at < end {
        return Err(err(format!("{at:#x} is not mapped in this process")));
    }
    Ok(())
}
