//! The MLA rows of `umbp bench cache`: objects and bytes a real pool holds per cached token
//! when a TP engine of multi-head latent attention stores a prefix, with every rank storing its
//! own copy (before) and with one object per block stored by the first rank (after: the vLLM
//! connector's replicated keys, standalone mode). Every rank then looks the prefix up and
//! reads every block, as a load fans out to every rank.

use anyhow::{ensure, Context, Result};
use umbp_core::{BlockKey, KeyBuilder, PoolConfig, RankTopology};
use umbp_pool::Pool;

/// DeepSeek-V3's KV shape: 61 layers of a 576-value bf16 latent (512 + 64 RoPE) per token.
pub const LAYERS: u64 = 61;
/// Bytes of one token's latent in one layer.
pub const LATENT_BYTES: u64 = 576 * 2;

/// What one TP size stored, before or after.
#[derive(Debug, Clone, Copy)]
pub struct MlaRow {
    pub tp: u16,
    /// Whether the ranks shared one object per block.
    pub once: bool,
    pub objects: u64,
    pub bytes: u64,
    /// Stores a rank left to the first rank of its replica group.
    pub skipped: u64,
    pub tokens: u64,
}

impl MlaRow {
    pub fn objects_per_token(&self) -> f64 {
        self.objects as f64 / self.tokens as f64
    }
    pub fn bytes_per_token(&self) -> f64 {
        self.bytes as f64 / self.tokens as f64
    }
}

/// Stores a prefix of `blocks` blocks of `block_tokens` tokens from `tp` ranks into a fresh
/// pool, with keys and store rule of the connector (`once`: every rank keyed as rank 0, rank 0
/// stores; else each rank under its own rank), then every rank looks it up and reads it.
pub fn mla_row(tp: u16, once: bool, blocks: u32, block_tokens: u64) -> Result<MlaRow> {
    let block_bytes = LAYERS * block_tokens * LATENT_BYTES;
    let copies = if once { 1 } else { u64::from(tp) };
    let pool = Pool::new(PoolConfig {
        // Room for every copy with the allocator's rounding: nothing is evicted.
        capacity_bytes: u64::from(blocks) * block_bytes * copies * 2 + (256 << 20),
        high_watermark: 1.0,
        low_watermark: 0.9,
        use_hugepages: false,
        prefault: false,
        ..PoolConfig::default()
    })
    .context("creating the pool")?;
    let replicas = if once { tp } else { 1 };
    let key_tp = |rank: u16| rank - rank % replicas;
    let builders: Vec<KeyBuilder> = (0..tp)
        .map(|rank| {
            let ranks = RankTopology {
                tp: key_tp(rank),
                ..RankTopology::default()
            };
            KeyBuilder::new("bench-cache-mla", ranks)
        })
        .collect::<Result<_, _>>()?;
    let key = |rank: u16, b: u32| -> BlockKey {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&b.to_le_bytes());
        builders[usize::from(rank)]
            .key(0, &h)
            .expect("a 32-byte hash is a valid key")
    };
    let data = vec![0x3Cu8; block_bytes as usize];
    let mut skipped = 0;
    for rank in 0..tp {
        for b in 0..blocks {
            if rank % replicas != 0 {
                skipped += 1; // the connector answers "skipped": the group's first rank stores
                continue;
            }
            pool.put(key(rank, b), &data)
                .with_context(|| format!("storing block {b} of rank {rank}"))?;
        }
    }
    for rank in 0..tp {
        let hits = pool.prefix_hits_with(blocks as usize, |b| key(rank, b as u32));
        ensure!(
            hits == blocks as usize,
            "rank {rank} found {hits} of {blocks} blocks"
        );
        for b in 0..blocks {
            let obj = pool.get(&key(rank, b)).context("a block stored above")?;
            ensure!(obj.len() == block_bytes, "block {b}: wrong size");
        }
    }
    let s = pool.stats();
    ensure!(
        s.evictions == 0,
        "the pool evicted {} objects: too small",
        s.evictions
    );
    pool.check_invariants();
    Ok(MlaRow {
        tp,
        once,
        objects: s.objects,
        bytes: s.bytes_in,
        skipped,
        tokens: u64::from(blocks) * block_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mla_once_stores_one_object_per_block_whatever_the_tp() {
        for tp in [2u16, 4, 8] {
            let before = mla_row(tp, false, 4, 16).unwrap();
            let after = mla_row(tp, true, 4, 16).unwrap();
            assert_eq!(before.objects, 4 * u64::from(tp));
            assert_eq!(after.objects, 4);
            assert_eq!(after.skipped, 4 * u64::from(tp - 1));
            assert_eq!(before.bytes, after.bytes * u64::from(tp));
            assert_eq!(after.bytes_per_token(), (LAYERS * LATENT_BYTES) as f64);
        }
    }
}
