//! What a measured shape runs on: pinned host memory, the contiguous-copy ceiling, the KV
//! cache on the GPU with its checks, and a store with the cache registered and its block ids
//! drawn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use rand::{rngs::StdRng, seq::SliceRandom, RngCore, SeedableRng};
use serde_json::{json, Value};
use umbp_core::{
    BlockKey, GroupLayout, KeyBuilder, KeyOutcome, KvLayout, LayerSpec, PoolConfig, RankTopology,
};
use umbp_cuda::{CopyMethod, CudaOptions, Device, DeviceBuffer, HostRegistration, Stream};
use umbp_store::{EmbeddedStore, StoreConfig};

use super::args::Args;
use super::shapes::{Shape, GB};
use crate::common::progress;

/// A host buffer registered for DMA (unregistered before it is freed: fields drop in order).
pub(super) struct Pinned {
    pub(super) _reg: HostRegistration,
    pub(super) buf: Vec<u8>,
}

impl Pinned {
    pub(super) fn new(dev: &Arc<Device>, len: usize) -> Result<Pinned> {
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is dropped after the registration and is never reallocated.
        let reg = unsafe { dev.register_host(buf.as_mut_ptr(), len as u64) }?;
        Ok(Pinned { _reg: reg, buf })
    }
}

/// Contiguous pinned copies: H2D, D2H and both at once, GB/s (best of `iters` repeats).
pub(super) fn ceiling(
    dev: &Arc<Device>,
    host: &mut Pinned,
    scratch: &DeviceBuffer,
) -> Result<Value> {
    let s1 = dev.stream()?;
    let s2 = dev.stream()?;
    let half = (host.buf.len() / 2).min(scratch.len() as usize / 2) as u64;
    let h = host.buf.as_mut_ptr();
    let d = scratch.ptr();
    let time = |f: &dyn Fn() -> Result<()>| -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..4 {
            let t0 = Instant::now();
            f()?;
            s1.synchronize()?;
            s2.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let h2d = time(&|| {
        // SAFETY: `h..h+2*half` is registered host memory and `d..d+2*half` device memory,
        // both owned here; nothing else touches them while the streams run.
        unsafe { dev.copy_htod(d, h, 2 * half, &s1) }.map_err(Into::into)
    })?;
    let d2h = time(&|| {
        // SAFETY: as above.
        unsafe { dev.copy_dtoh(h, d, 2 * half, &s1) }.map_err(Into::into)
    })?;
    let both = time(&|| {
        // SAFETY: as above; the two halves are disjoint.
        unsafe {
            dev.copy_htod(d, h, half, &s1)?;
            dev.copy_dtoh(h.add(half as usize), d + half, half, &s2)?;
        }
        Ok(())
    })?;
    Ok(json!({
        "h2d_gbps": 2.0 * half as f64 / h2d / GB,
        "d2h_gbps": 2.0 * half as f64 / d2h / GB,
        "both_gbps": 2.0 * half as f64 / both / GB,
        "bytes": 2 * half,
    }))
}

pub(super) fn keys(kb: &KeyBuilder, tag: u32, ids: &[u64]) -> Vec<BlockKey> {
    ids.iter()
        .map(|b| kb.key(tag, &b.to_le_bytes()).expect("short hash"))
        .collect()
}

pub(super) fn check_done(res: &[KeyOutcome], what: &str) -> Result<()> {
    if let Some((i, bad)) = res
        .iter()
        .enumerate()
        .find(|(_, r)| **r != KeyOutcome::Done)
    {
        bail!("{what}: key {i} did not transfer: {bad:?}");
    }
    Ok(())
}

pub(super) struct Cache {
    pub(super) kv: DeviceBuffer,
    pub(super) shape: (u64, u64, u64), // layers, num_blocks, piece
}

impl Cache {
    pub(super) fn piece_addr(&self, layer: u64, block: u64) -> u64 {
        let (_, nb, p) = self.shape;
        self.kv.ptr() + (layer * nb + block) * p
    }

    /// Checks that blocks `dst` hold exactly the bytes of blocks `src` (`host` is scratch of
    /// twice their size).
    pub(super) fn check_same(
        &self,
        dev: &Device,
        s: &Stream,
        src: &[u64],
        dst: &[u64],
        host: &mut [u8],
        what: &str,
    ) -> Result<()> {
        let (want, got) = host.split_at_mut(host.len() / 2);
        self.read_blocks(dev, s, src, want)?;
        self.read_blocks(dev, s, dst, got)?;
        ensure!(want == got, "{what}");
        Ok(())
    }

    /// Copies every piece of `blocks` to `host` (object layout, block after block).
    pub(super) fn read_blocks(
        &self,
        dev: &Device,
        s: &Stream,
        blocks: &[u64],
        host: &mut [u8],
    ) -> Result<()> {
        let (layers, _, p) = self.shape;
        ensure!(host.len() as u64 >= blocks.len() as u64 * layers * p);
        let mut at = 0usize;
        for &b in blocks {
            for l in 0..layers {
                // SAFETY: the piece lies inside `kv`; `host[at..at+p]` is registered memory.
                unsafe { dev.copy_dtoh(host.as_mut_ptr().add(at), self.piece_addr(l, b), p, s) }?;
                at += p as usize;
            }
        }
        s.synchronize()?;
        Ok(())
    }

    pub(super) fn poison(&self, dev: &Device, s: &Stream, blocks: &[u64], value: u8) -> Result<()> {
        let (layers, _, p) = self.shape;
        for &b in blocks {
            for l in 0..layers {
                // SAFETY: the piece lies inside `kv`, which only this benchmark uses.
                unsafe { dev.memset(self.piece_addr(l, b), value, p, s) }?;
            }
        }
        s.synchronize()?;
        Ok(())
    }
}

/// A KV cache on the GPU filled with random bytes, a store with the CUDA memory registered and
/// its layout, and three disjoint random sets of `--blocks` block ids.
pub(super) struct Prepared {
    pub(super) cache: Cache,
    pub(super) s: Stream,
    pub(super) store: EmbeddedStore,
    pub(super) layout: u32,
    pub(super) kb: KeyBuilder,
    pub(super) src_a: Vec<u64>,
    pub(super) src_b: Vec<u64>,
    pub(super) dst: Vec<u64>,
    /// Bytes of one set.
    pub(super) total: u64,
}

pub(super) fn prepare(
    a: &Args,
    dev: &Arc<Device>,
    shape: &Shape,
    method: CopyMethod,
    host: &mut Pinned,
) -> Result<Prepared> {
    let (layers, piece, nb) = (shape.layers, shape.piece, shape.num_blocks);
    let n = a.blocks;
    ensure!(
        nb >= 3 * n,
        "shape {}: the cache needs at least 3 × --blocks blocks ({} < {})",
        shape.name,
        nb,
        3 * n
    );
    let object = layers * piece;
    let total = n * object;
    ensure!(
        host.buf.len() as u64 >= 2 * total,
        "host buffer too small for {} blocks",
        n
    );
    let kv_bytes = layers * nb * piece;
    progress!(
        "shape {}: {layers} layers × {nb} blocks × {piece} B pieces = {:.1} GiB on the GPU (layer stride {:.2} GiB), method {method}; {n} random blocks ({:.2} GB) each way",
        shape.name,
        kv_bytes as f64 / (1u64 << 30) as f64,
        (nb * piece) as f64 / (1u64 << 30) as f64,
        total as f64 / GB
    );
    let cache = Cache {
        kv: dev.alloc(kv_bytes)?,
        shape: (layers, nb, piece),
    };
    let s = dev.stream()?;
    // Random bytes: a pinned pattern whose length is no multiple of any page, copied across.
    {
        let pat = (64 << 20) + 4112;
        let mut rng = StdRng::seed_from_u64(7);
        rng.fill_bytes(&mut host.buf[..pat]);
        let mut off = 0u64;
        while off < kv_bytes {
            let len = (pat as u64).min(kv_bytes - off);
            // SAFETY: inside `kv` and the registered host buffer.
            unsafe { dev.copy_htod(cache.kv.ptr() + off, host.buf.as_ptr(), len, &s) }?;
            off += len;
        }
        s.synchronize()?;
    }
    let capacity = ((2 * total) as f64 / 0.85) as u64;
    let store = EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault: true,
            integrity: umbp_core::Integrity::from_options(
                &a.integrity,
                umbp_core::options::INTEGRITY_SAMPLE_EVERY.default_u64(),
            )?,
            ..PoolConfig::with_capacity(capacity.next_multiple_of(64 << 20))
        },
        num_workers: a.workers,
        cuda: {
            let d = CudaOptions::default();
            CudaOptions {
                method,
                max_ctas: a.max_ctas.unwrap_or(d.max_ctas),
                staging_bytes: a.staging_mib.map_or(d.staging_bytes, |m| m << 20),
                staging_slots: a.staging_slots.unwrap_or(d.staging_slots),
                batch_blocks: a.batch_blocks.unwrap_or(d.batch_blocks),
                auto_dma_min_piece: a
                    .auto_dma_min_piece_kib
                    .map_or(d.auto_dma_min_piece, |k| k << 10),
                auto_dma_min_block: a
                    .auto_dma_min_block_kib
                    .map_or(d.auto_dma_min_block, |k| k << 10),
                ..d
            }
        },
        ..StoreConfig::default()
    })?;
    // SAFETY: `cache.kv` outlives the store (closed at the end of this function).
    unsafe { store.register_cuda_memory(cache.kv.ptr(), kv_bytes, a.device) }?;
    ensure!(
        store.wait_pool_registered(Duration::from_secs(120)),
        "pool registration did not finish"
    );
    let layout = store.register_layout(KvLayout::new(vec![GroupLayout::new(
        (0..layers)
            .map(|l| LayerSpec {
                base_addr: cache.piece_addr(l, 0),
                num_blocks: nb,
                block_stride: piece,
                block_bytes: piece,
            })
            .collect(),
    )?])?)?;
    let kb = KeyBuilder::new("bench-gpu", RankTopology::default())?;
    let mut ids: Vec<u64> = (0..nb).collect();
    ids.shuffle(&mut StdRng::seed_from_u64(42));
    let src_a: Vec<u64> = ids[..n as usize].to_vec();
    let src_b: Vec<u64> = ids[n as usize..2 * n as usize].to_vec();
    let dst: Vec<u64> = ids[2 * n as usize..3 * n as usize].to_vec();
    Ok(Prepared {
        cache,
        s,
        store,
        layout,
        kb,
        src_a,
        src_b,
        dst,
        total,
    })
}
