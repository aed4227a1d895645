//! One client's KV cache: its shape and fill pattern, host memory in a sealed memfd or CUDA
//! memory, the key sets, moving them (either mode, through [`KvStore`]), and what one run
//! (client count and piece size) moves.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Result};
use umbp_client::host_share;
use umbp_core::{BlockKey, KeyBuilder, KeyOutcome, LayerSpec};
use umbp_core::{KvStore, KvTransfer};
use umbp_cuda::{Device, DeviceBuffer, Stream};

use super::args::Args;

/// The shape of one KV cache: `2 × blocks` blocks of `layers` pieces, layer-first; blocks
/// `0..blocks` are stored, and loaded back into blocks `blocks..2 × blocks`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Shape {
    pub(super) blocks: u64,
    pub(super) layers: u64,
    pub(super) piece: u64,
}

impl Shape {
    pub(super) fn len(&self) -> u64 {
        2 * self.blocks * self.layers * self.piece
    }

    /// Bytes moved each way by one cache.
    pub(super) fn moved(&self) -> u64 {
        self.blocks * self.layers * self.piece
    }

    /// Offset of layer `l`'s stored half (its loaded half follows it).
    pub(super) fn layer_offset(&self, l: u64) -> u64 {
        l * 2 * self.blocks * self.piece
    }

    pub(super) fn layer_specs(&self, base: u64) -> Vec<LayerSpec> {
        (0..self.layers)
            .map(|l| LayerSpec {
                base_addr: base + self.layer_offset(l),
                num_blocks: 2 * self.blocks,
                block_stride: self.piece,
                block_bytes: self.piece,
            })
            .collect()
    }

    pub(super) fn sources(&self) -> Vec<u64> {
        (0..self.blocks).collect()
    }

    pub(super) fn targets(&self) -> Vec<u64> {
        (self.blocks..2 * self.blocks).collect()
    }

    /// The stored half of layer `l` of cache `id`: words that differ per cache, layer and
    /// block, so a block loaded into the wrong place is caught.
    pub(super) fn pattern(&self, id: u32, l: u64, out: &mut [u8]) {
        let words_per_piece = self.piece / 8;
        for (w, c) in out.chunks_exact_mut(8).enumerate() {
            let w = w as u64;
            let (b, o) = (w / words_per_piece, w % words_per_piece);
            let v = (u64::from(id) << 56) ^ (l << 44) ^ (b << 24) ^ o ^ 0x9E37_79B9_7F4A_7C15;
            c.copy_from_slice(&v.to_le_bytes());
        }
    }

    /// Checks that the loaded half of every layer of `cache` equals its stored half.
    pub(super) fn verify(&self, cache: &[u8]) -> Result<()> {
        let half = (self.blocks * self.piece) as usize;
        for l in 0..self.layers {
            let at = self.layer_offset(l) as usize;
            let (src, dst) = (&cache[at..at + half], &cache[at + half..at + 2 * half]);
            if src != dst {
                let i = src.iter().zip(dst).position(|(a, b)| a != b).unwrap_or(0);
                bail!(
                    "layer {l}: loaded block {} differs from stored block {} at byte {}",
                    self.blocks + i as u64 / self.piece,
                    i as u64 / self.piece,
                    i as u64 % self.piece
                );
            }
        }
        Ok(())
    }
}

/// Host memory in a sealed memfd (what a client shares with the server), unmapped on drop.
#[derive(Debug)]
pub(crate) struct HostBuf {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) fd: Option<umbp_client::SharedHostMemory>,
}

impl HostBuf {
    pub(crate) fn new(len: u64) -> Result<Self> {
        let shm = host_share::alloc_shared_host(len)?;
        ensure!(
            shm.offset_in_span() == 0,
            "unexpected offset of shared memory"
        );
        let b = HostBuf {
            addr: shm.span_addr(),
            len: shm.span_len(),
            fd: Some(shm),
        };
        // Fault every page in now, outside the timed phases.
        // SAFETY: the whole mapping is ours and nobody else uses it yet.
        unsafe { std::ptr::write_bytes(b.addr as *mut u8, 0, b.len as usize) };
        Ok(b)
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: our live mapping; writers (the server, copy workers) are idle whenever the
        // benchmark reads it.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len as usize) }
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: as `bytes`; the benchmark writes only between transfers.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len as usize) }
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping alloc_shared_host made; every registration of it is gone (the
        // server maps the memfd itself and keeps its own mapping).
        unsafe { libc::munmap(self.addr as *mut libc::c_void, self.len as usize) };
    }
}

/// One KV cache: host memory or CUDA memory, with what fills and checks it.
pub(super) enum Cache {
    Host(HostBuf),
    Cuda {
        dev: Arc<Device>,
        buf: DeviceBuffer,
        stream: Stream,
    },
}

impl std::fmt::Debug for Cache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Cache::Host(h) => write!(f, "Cache::Host({:#x}+{})", h.addr, h.len),
            Cache::Cuda { buf, .. } => write!(f, "Cache::Cuda({:#x}+{})", buf.ptr(), buf.len()),
        }
    }
}

impl Cache {
    pub(super) fn new(shape: &Shape, id: u32, cuda: Option<&Arc<Device>>) -> Result<Self> {
        let half = (shape.blocks * shape.piece) as usize;
        match cuda {
            None => {
                let h = HostBuf::new(shape.len())?;
                let m = h.bytes_mut();
                for l in 0..shape.layers {
                    let at = shape.layer_offset(l) as usize;
                    shape.pattern(id, l, &mut m[at..at + half]);
                }
                Ok(Cache::Host(h))
            }
            Some(dev) => {
                let buf = dev.alloc(shape.len())?;
                let stream = dev.stream()?;
                let mut host = vec![0u8; half];
                for l in 0..shape.layers {
                    shape.pattern(id, l, &mut host);
                    // SAFETY: inside `buf`; `host` lives until the stream is synchronized.
                    unsafe {
                        dev.copy_htod(
                            buf.ptr() + shape.layer_offset(l),
                            host.as_ptr(),
                            half as u64,
                            &stream,
                        )
                    }?;
                    stream.synchronize()?;
                }
                Ok(Cache::Cuda {
                    dev: Arc::clone(dev),
                    buf,
                    stream,
                })
            }
        }
    }

    pub(super) fn base(&self) -> u64 {
        match self {
            Cache::Host(h) => h.addr,
            Cache::Cuda { buf, .. } => buf.ptr(),
        }
    }

    /// Overwrites the loaded half of every layer (so the last load must bring the bytes).
    pub(super) fn clobber(&self, shape: &Shape) -> Result<()> {
        let half = shape.blocks * shape.piece;
        for l in 0..shape.layers {
            let at = shape.layer_offset(l) + half;
            match self {
                Cache::Host(h) => h.bytes_mut()[at as usize..(at + half) as usize].fill(0xA5),
                Cache::Cuda { dev, buf, stream } => {
                    // SAFETY: inside `buf`, which no transfer uses meanwhile.
                    unsafe { dev.memset(buf.ptr() + at, 0xA5, half, stream) }?
                }
            }
        }
        if let Cache::Cuda { stream, .. } = self {
            stream.synchronize()?;
        }
        Ok(())
    }

    pub(super) fn verify(&self, shape: &Shape) -> Result<()> {
        match self {
            Cache::Host(h) => shape.verify(&h.bytes()[..shape.len() as usize]),
            Cache::Cuda { dev, buf, stream } => {
                let mut host = vec![0u8; shape.len() as usize];
                // SAFETY: `host` is as long as `buf`'s used part and outlives the copy.
                unsafe { dev.copy_dtoh(host.as_mut_ptr(), buf.ptr(), shape.len(), stream) }?;
                stream.synchronize()?;
                shape.verify(&host)
            }
        }
    }
}

/// Key set `set` of client `id`: one key per block.
pub(super) fn keys_of(kb: &KeyBuilder, id: u32, set: u32, blocks: u64) -> Result<Vec<BlockKey>> {
    (0..blocks)
        .map(|b| {
            let mut h = [0u8; 20];
            h[..4].copy_from_slice(&id.to_le_bytes());
            h[4..8].copy_from_slice(&set.to_le_bytes());
            h[8..16].copy_from_slice(&b.to_le_bytes());
            Ok(kb.key(0, &h)?)
        })
        .collect()
}

/// The key sets of one client, one per transfer in flight.
pub(super) fn key_sets(
    kb: &KeyBuilder,
    id: u32,
    in_flight: u32,
    blocks: u64,
) -> Result<Vec<Vec<BlockKey>>> {
    (0..in_flight)
        .map(|set| keys_of(kb, id, set, blocks))
        .collect()
}
/// How long one transfer of a benchmark may take.
pub(super) const WAIT: Duration = Duration::from_secs(120);

/// Stores blocks `shape.sources()` under every key set (`store`), or loads every set into
/// blocks `shape.targets()`, in either mode: every set's transfer is submitted before the
/// first is waited for (up to `timeout` each). Loads of several sets land on the same blocks;
/// every set holds the same bytes. Fails naming the first key that did not end done.
pub(super) fn move_sets<S: KvStore>(
    s: &S,
    (layout, shape): (u32, &Shape),
    store: bool,
    sets: &[Vec<BlockKey>],
    timeout: Duration,
) -> Result<Vec<S::Transfer>> {
    let (src, dst) = (shape.sources(), shape.targets());
    let transfers = sets
        .iter()
        .map(|keys| {
            if store {
                s.store(layout, 0, &src, keys)
            } else {
                s.load(layout, 0, &dst, keys)
            }
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    for t in &transfers {
        let outcomes = t.wait(timeout)?;
        if let Some((i, o)) = outcomes
            .iter()
            .enumerate()
            .find(|(_, o)| **o != KeyOutcome::Done)
        {
            let what = if store { "store" } else { "load" };
            bail!("{what} of key {i} ended {o:?}, not done");
        }
    }
    Ok(transfers)
}

/// One client count and piece size.
pub(super) struct Run<'a> {
    pub(super) a: &'a Args,
    pub(super) shape: Shape,
    pub(super) clients: usize,
    pub(super) workers: usize,
}

impl Run<'_> {
    /// Bytes every client together moves each way.
    pub(super) fn bytes(&self) -> u64 {
        self.clients as u64 * self.shape.moved() * u64::from(self.a.in_flight)
    }
}
