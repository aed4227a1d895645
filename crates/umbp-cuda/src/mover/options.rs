//! The CUDA mover's options: how batches move ([`CopyMethod`]) and [`CudaOptions`].

use std::str::FromStr;

use crate::pin::SPLIT_BYTES;
use umbp_cuda_driver::CudaError;

/// How batches move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyMethod {
    /// DMA for batches whose pieces average at least [`CudaOptions::auto_dma_min_piece`] and
    /// whose blocks average at least [`CudaOptions::auto_dma_min_block`]; staged otherwise.
    Auto,
    /// DMA only: no GPU compute units.
    Dma,
    /// Always staged (falls back to DMA for a block larger than a staging slot).
    Staged,
}

impl FromStr for CopyMethod {
    type Err = CudaError;
    fn from_str(s: &str) -> Result<Self, CudaError> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(CopyMethod::Auto),
            "dma" => Ok(CopyMethod::Dma),
            "staged" => Ok(CopyMethod::Staged),
            _ => Err(CudaError::Option {
                name: "cuda_copy_method",
                reason: format!("{s:?} is not one of \"auto\", \"dma\", \"staged\""),
            }),
        }
    }
}

impl std::fmt::Display for CopyMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CopyMethod::Auto => "auto",
            CopyMethod::Dma => "dma",
            CopyMethod::Staged => "staged",
        })
    }
}

/// Options of the CUDA backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaOptions {
    /// How batches move.
    pub method: CopyMethod,
    /// Device staging memory per direction (0 disables staging). Where the device is out of
    /// memory, smaller slots are used (with a warning), down to 4 MiB.
    pub staging_bytes: u64,
    /// Staging slots per direction (the staging memory is split evenly).
    pub staging_slots: usize,
    /// Thread blocks (of 256 threads) a gather/scatter kernel may use.
    pub max_ctas: u32,
    /// Pool registration chunk (a multiple of 64 MiB; copies wait for at most one).
    pub pin_chunk_bytes: u64,
    /// Blocks per mover call.
    pub batch_blocks: usize,
    /// `auto` stages batches whose pieces average fewer bytes than this.
    pub auto_dma_min_piece: u64,
    /// `auto` stages batches whose blocks average fewer bytes than this.
    pub auto_dma_min_block: u64,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            method: CopyMethod::Auto,
            // The connector option's default: the store and the connector never disagree.
            staging_bytes: umbp_core::options::CUDA_STAGING_BYTES.default_u64(),
            staging_slots: 2,
            max_ctas: 132,
            pin_chunk_bytes: SPLIT_BYTES,
            batch_blocks: 256,
            auto_dma_min_piece: 1 << 20,
            auto_dma_min_block: 2 << 20,
        }
    }
}

impl CudaOptions {
    /// Checks every option (no CUDA needed).
    pub fn validate(&self) -> Result<(), CudaError> {
        let bad = |name, reason: String| Err(CudaError::Option { name, reason });
        if self.staging_bytes != 0 && self.staging_bytes < (1 << 20) {
            return bad(
                "cuda_staging_bytes",
                format!(
                    "{} is below 1 MiB (use 0 to disable staging)",
                    self.staging_bytes
                ),
            );
        }
        let within = |name, v: u64, hi: u64| {
            if (1..=hi).contains(&v) {
                Ok(())
            } else {
                bad(name, format!("{v} is outside 1..={hi}"))
            }
        };
        within("cuda_staging_slots", self.staging_slots as u64, 64)?;
        within("cuda_max_ctas", u64::from(self.max_ctas), 1024)?;
        within("cuda_batch_blocks", self.batch_blocks as u64, 4096)?;
        if self.pin_chunk_bytes == 0 || !self.pin_chunk_bytes.is_multiple_of(SPLIT_BYTES) {
            return bad(
                "cuda_pin_chunk_bytes",
                format!(
                    "{} is not a positive multiple of 64 MiB",
                    self.pin_chunk_bytes
                ),
            );
        }
        if self.method == CopyMethod::Staged && self.staging_bytes == 0 {
            return bad(
                "cuda_copy_method",
                "\"staged\" needs cuda_staging_bytes > 0".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_are_validated_without_cuda() {
        CudaOptions::default().validate().unwrap();
        let e = CudaOptions {
            pin_chunk_bytes: 100,
            ..CudaOptions::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("cuda_pin_chunk_bytes"), "{e}");
        let e = CudaOptions {
            method: CopyMethod::Staged,
            staging_bytes: 0,
            ..CudaOptions::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("cuda_copy_method"), "{e}");
        assert_eq!("DMA".parse::<CopyMethod>().unwrap(), CopyMethod::Dma);
        assert!("fast".parse::<CopyMethod>().is_err());
    }
}
