//! Byte sizes: the MiB and GiB units and the huge page sizes the pool can ask the kernel
//! for. Shared by the pool configuration ([`crate::config`], which re-exports them) and the
//! connector's option schema ([`crate::options`]).

use std::fmt;
use std::str::FromStr;

use crate::error::CoreError;

/// 1 MiB.
pub const MIB: u64 = 1 << 20;
/// 1 GiB.
pub const GIB: u64 = 1 << 30;

/// Huge page sizes the pool can ask the kernel for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HugepageSize {
    /// 2 MiB pages.
    #[default]
    Size2MiB,
    /// 1 GiB pages.
    Size1GiB,
}

impl HugepageSize {
    /// Bytes in one page of this size.
    pub fn bytes(self) -> u64 {
        match self {
            HugepageSize::Size2MiB => 2 * MIB,
            HugepageSize::Size1GiB => GIB,
        }
    }
}

impl fmt::Display for HugepageSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HugepageSize::Size2MiB => "2MiB",
            HugepageSize::Size1GiB => "1GiB",
        })
    }
}

impl FromStr for HugepageSize {
    type Err = CoreError;

    /// Accepts `2M`, `2MB`, `2MiB`, `1G`, `1GB`, `1GiB` (any case) or the size in bytes.
    fn from_str(s: &str) -> Result<Self, CoreError> {
        let t = s.trim().to_ascii_lowercase();
        match t.as_str() {
            "2m" | "2mb" | "2mib" | "2097152" => Ok(HugepageSize::Size2MiB),
            "1g" | "1gb" | "1gib" | "1073741824" => Ok(HugepageSize::Size1GiB),
            _ => Err(CoreError::option(
                "dram_hugepage_size",
                format!("{s:?} is not a supported huge page size; use \"2MiB\" or \"1GiB\""),
            )),
        }
    }
}
