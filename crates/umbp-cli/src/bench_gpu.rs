//! `umbp bench gpu`: KV blocks between a CUDA KV cache and the pool, beside the contiguous
//! pinned-copy ceiling and a naive one-copy-per-piece baseline measured in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rand::{rngs::StdRng, seq::SliceRandom, RngCore, SeedableRng};
use serde_json::{json, Value};
use umbp_core::{BlockKey, GroupLayout, KeyBuilder, KvLayout, LayerSpec, PoolConfig, RankTopology};
use umbp_cuda::{
    CopyMethod, CudaOptions, Device, DeviceBuffer, Event, HostRegistration, Stream, TraceSpan,
};
use umbp_store::{EmbeddedStore, KeyResult, StoreConfig};

use crate::common::progress;
use crate::cublas::Matmul;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// KV cache shapes, comma-separated: `llama8b` (32 layers × 64 KiB: Llama-3-8B, 8 KV heads,
    /// head 128, bf16, 16-token blocks, TP 1), `tp8-8k` (80 layers × 8 KiB: Llama-3-70B at TP 8)
    /// or `<layers>x<piece_bytes>`; each optionally `:<blocks in the cache>`.
    #[arg(long, default_value = "llama8b,tp8-8k")]
    shapes: String,
    /// Blocks in each KV cache unless the shape says.
    #[arg(long, default_value_t = 4096)]
    num_blocks: u64,
    /// Random blocks moved each way per round.
    #[arg(long, default_value_t = 1000)]
    blocks: u64,
    /// Copy method: auto (the default), dma or staged.
    #[arg(long, default_value = "auto")]
    method: String,
    /// Also run every shape with the dma method, for comparison.
    #[arg(long)]
    also_dma: bool,
    /// Thread blocks a staging kernel may use (default: the store's default).
    #[arg(long)]
    max_ctas: Option<u32>,
    /// Device staging memory per direction, MiB (default: the store's default).
    #[arg(long)]
    staging_mib: Option<u64>,
    /// Staging slots per direction (default: the store's default).
    #[arg(long)]
    staging_slots: Option<usize>,
    /// Blocks per mover call (default: the store's default).
    #[arg(long)]
    batch_blocks: Option<usize>,
    /// Copy worker threads.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Run one more, untimed round per shape and write the timeline of its both-directions run
    /// (every kernel, DMA, mover call and host wait) to this JSON file, with a printed summary.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Timed rounds (the best of each figure is kept).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Also measure registering a pool of this many GiB for DMA (0: skip).
    #[arg(long, default_value_t = 0)]
    pin_gib: u64,
    /// Piece-size sweep instead of --shapes: 4, 8, 16, 24, 32, 48, 64, 96, 128 and 256 KiB
    /// pieces in blocks of about 2 MiB (--sweep-block-kib; 2 to 128 layers), each with auto,
    /// dma and staged, then a table of store / load / both-ways figures against the same run's
    /// ceiling.
    #[arg(long)]
    sweep: bool,
    /// Piece sizes of the sweep, KiB, comma-separated.
    #[arg(long, default_value = "4,8,16,24,32,48,64,96,128,256")]
    sweep_kib: String,
    /// Methods of the sweep, comma-separated.
    #[arg(long, default_value = "auto,dma,staged")]
    sweep_methods: String,
    /// Block sizes of the sweep, KiB, comma-separated (layers = block / piece, 2 to 128).
    #[arg(long, default_value = "2048")]
    sweep_block_kib: String,
    /// `auto` uses DMA only for pieces averaging at least this many KiB (default: the store's).
    #[arg(long)]
    auto_dma_min_piece_kib: Option<u64>,
    /// `auto` uses DMA only for blocks averaging at least this many KiB (default: the store's).
    #[arg(long)]
    auto_dma_min_block_kib: Option<u64>,
    /// After the idle rounds, move the same blocks again while a bf16 matmul loop that fills
    /// every SM runs on its own stream (the engine's forward pass): copy GB/s during the load
    /// and the matmul's slowdown against the same loop alone, medians of --load-rounds.
    #[arg(long)]
    under_load: bool,
    /// Methods measured under load, comma-separated.
    #[arg(long, default_value = "auto,dma,staged")]
    under_load_methods: String,
    /// Rounds under load (each: the matmul loop alone, then beside copies).
    #[arg(long, default_value_t = 5)]
    load_rounds: usize,
    /// Matrix size of the matmul load (n × n × n, bf16).
    #[arg(long, default_value_t = 8192)]
    matmul_n: usize,
    /// Milliseconds one matmul loop runs (at least 8 idle copy jobs long).
    #[arg(long, default_value_t = 300)]
    load_ms: u64,
    /// Print a JSON object as the last line.
    #[arg(long)]
    json: bool,
}

/// The sweep's shape for `piece` bytes and blocks of about `block` bytes (2 to 128 layers).
fn sweep_shape(piece: u64, block: u64, blocks: u64) -> Shape {
    let layers = (block / piece).clamp(2, 128);
    Shape {
        name: format!("{layers}x{piece}"),
        layers,
        piece,
        num_blocks: (3 * blocks).next_multiple_of(1024),
    }
}

/// A comma-separated list of positive KiB numbers (`what` names the option in errors).
fn parse_kib_list(v: &str, what: &str) -> Result<Vec<u64>> {
    v.split(',')
        .map(|s| {
            s.trim()
                .parse::<u64>()
                .ok()
                .filter(|&k| k > 0)
                .with_context(|| format!("{what} takes positive KiB numbers, not {s:?}"))
        })
        .collect()
}

/// A comma-separated list of copy methods (`what` names the option in errors).
fn parse_methods(v: &str, what: &str) -> Result<Vec<CopyMethod>> {
    v.split(',')
        .map(|s| {
            s.trim()
                .parse::<CopyMethod>()
                .map_err(|_| anyhow::anyhow!("{what}: {s:?} is not one of auto, dma, staged"))
        })
        .collect()
}

fn sweep(
    a: &Args,
    dev: &Arc<Device>,
    host: &mut Pinned,
    ceil: &Value,
    traces: &mut Vec<Value>,
) -> Result<Vec<Value>> {
    let kibs = parse_kib_list(&a.sweep_kib, "--sweep-kib")?;
    let block_kibs = parse_kib_list(&a.sweep_block_kib, "--sweep-block-kib")?;
    let methods = parse_methods(&a.sweep_methods, "--sweep-methods")?;
    let mut out = Vec::new();
    for &block_kib in &block_kibs {
        for &kib in &kibs {
            let shape = sweep_shape(kib << 10, block_kib << 10, a.blocks);
            for &m in &methods {
                out.push(run_shape(a, dev, &shape, m, host, ceil, traces)?);
            }
        }
    }
    println!();
    println!(
        "piece-size sweep: {} random blocks each way; ratios to this run's ceiling \
         (D2H {:.2}, H2D {:.2}, both {:.2} GB/s); kernel ms per GB moved",
        a.blocks,
        ceil["d2h_gbps"].as_f64().unwrap_or(0.0),
        ceil["h2d_gbps"].as_f64().unwrap_or(0.0),
        ceil["both_gbps"].as_f64().unwrap_or(0.0)
    );
    println!(
        "{:>6} {:>6} {:>6} {:>7} | {:>6} {:>6} {:>7} {:>6} | {:>8} {:>8} | {:>7}",
        "piece",
        "block",
        "layers",
        "method",
        "store",
        "load",
        "both",
        "both",
        "kern st",
        "kern ld",
        "staged"
    );
    println!(
        "{:>6} {:>6} {:>6} {:>7} | {:>6} {:>6} {:>7} {:>6} | {:>8} {:>8} | {:>7}",
        "KiB", "KiB", "", "", "ratio", "ratio", "GB/s", "ratio", "ms/GB", "ms/GB", "share"
    );
    for r in &out {
        let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        let staged = f("staged_bytes") / (f("staged_bytes") + f("dma_bytes")).max(1.0);
        println!(
            "{:>6} {:>6} {:>6} {:>7} | {:>6.3} {:>6.3} {:>7.2} {:>6.3} | {:>8.2} {:>8.2} | {:>6.0}%",
            r["piece_bytes"].as_u64().unwrap_or(0) >> 10,
            r["object_bytes"].as_u64().unwrap_or(0) >> 10,
            r["layers"].as_u64().unwrap_or(0),
            r["method"].as_str().unwrap_or("?"),
            f("store_ratio"),
            f("load_ratio"),
            f("both_gbps"),
            f("both_ratio"),
            f("kernel_ms_per_gb_store"),
            f("kernel_ms_per_gb_load"),
            100.0 * staged
        );
    }
    Ok(out)
}

const GB: f64 = 1e9;

struct Shape {
    name: String,
    layers: u64,
    piece: u64,
    num_blocks: u64,
}

fn parse_shapes(spec: &str, default_blocks: u64) -> Result<Vec<Shape>> {
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, nb) = match item.split_once(':') {
            Some((n, b)) => (n, b.parse::<u64>().context("blocks after ':'")?),
            None => (item, default_blocks),
        };
        let (layers, piece) = match name {
            "llama8b" => (32, 64 << 10),
            "tp8-8k" => (80, 8 << 10),
            other => {
                let Some((l, p)) = other.split_once('x') else {
                    bail!("unknown shape {other:?}: use llama8b, tp8-8k or <layers>x<piece_bytes>");
                };
                (l.parse()?, p.parse()?)
            }
        };
        ensure!(layers > 0 && piece > 0 && nb > 0, "shape {item:?} is empty");
        out.push(Shape {
            name: item.to_owned(),
            layers,
            piece,
            num_blocks: nb,
        });
    }
    ensure!(!out.is_empty(), "--shapes names no shape");
    Ok(out)
}

/// A host buffer registered for DMA (unregistered before it is freed: fields drop in order).
struct Pinned {
    _reg: HostRegistration,
    buf: Vec<u8>,
}

impl Pinned {
    fn new(dev: &Arc<Device>, len: usize) -> Result<Pinned> {
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` is dropped after the registration and is never reallocated.
        let reg = unsafe { dev.register_host(buf.as_mut_ptr(), len as u64) }?;
        Ok(Pinned { _reg: reg, buf })
    }
}

/// Contiguous pinned copies: H2D, D2H and both at once, GB/s (best of `iters` repeats).
fn ceiling(dev: &Arc<Device>, host: &mut Pinned, scratch: &DeviceBuffer) -> Result<Value> {
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

fn keys(kb: &KeyBuilder, tag: u32, ids: &[u64]) -> Vec<BlockKey> {
    ids.iter()
        .map(|b| kb.key(tag, &b.to_le_bytes()).expect("short hash"))
        .collect()
}

fn check_done(res: &[KeyResult], what: &str) -> Result<()> {
    if let Some((i, bad)) = res.iter().enumerate().find(|(_, r)| **r != KeyResult::Done) {
        bail!("{what}: key {i} did not transfer: {bad:?}");
    }
    Ok(())
}

struct Cache {
    kv: DeviceBuffer,
    shape: (u64, u64, u64), // layers, num_blocks, piece
}

impl Cache {
    fn piece_addr(&self, layer: u64, block: u64) -> u64 {
        let (_, nb, p) = self.shape;
        self.kv.ptr() + (layer * nb + block) * p
    }

    /// Checks that blocks `dst` hold exactly the bytes of blocks `src` (`host` is scratch of
    /// twice their size).
    fn check_same(
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
    fn read_blocks(&self, dev: &Device, s: &Stream, blocks: &[u64], host: &mut [u8]) -> Result<()> {
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

    fn poison(&self, dev: &Device, s: &Stream, blocks: &[u64], value: u8) -> Result<()> {
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
struct Prepared {
    cache: Cache,
    s: Stream,
    store: EmbeddedStore,
    layout: u32,
    kb: KeyBuilder,
    src_a: Vec<u64>,
    src_b: Vec<u64>,
    dst: Vec<u64>,
    /// Bytes of one set.
    total: u64,
}

fn prepare(
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

fn run_shape(
    a: &Args,
    dev: &Arc<Device>,
    shape: &Shape,
    method: CopyMethod,
    host: &mut Pinned,
    ceil: &Value,
    trace_out: &mut Vec<Value>,
) -> Result<Value> {
    // The naive one-copy-per-piece baseline is skipped in the sweep (it is slow for small
    // pieces and the sweep compares methods, not the baseline).
    let naive = !a.sweep;
    let (layers, piece) = (shape.layers, shape.piece);
    let n = a.blocks;
    let Prepared {
        cache,
        s,
        store,
        layout,
        kb,
        src_a,
        src_b,
        dst,
        total,
    } = prepare(a, dev, shape, method, host)?;
    let object = layers * piece;
    let nb = shape.num_blocks;
    let wait = |job: umbp_copy::JobHandle, what: &str| -> Result<()> {
        check_done(&job.wait(Duration::from_secs(600))?, what)
    };
    let kernel_ns = || store.cuda_status().map_or(0, |(c, _)| c.kernel_ns);
    let (mut best_s, mut best_l, mut best_b) = (f64::MAX, f64::MAX, f64::MAX);
    let (mut k_store, mut k_load, mut k_both) = (0u64, 0u64, 0u64);
    let mut both_ends = (0f64, 0f64);
    // With --trace, one more round after the timed ones records the timeline (its figures are
    // not counted: tracing adds events to every step).
    let traced_round = a.rounds + 1;
    let last_round = if a.trace.is_some() {
        traced_round
    } else {
        a.rounds
    };
    for round in 0..=last_round {
        store.clear()?;
        let tag = round * 2;
        let ka = keys(&kb, tag, &src_a);
        let kbk = keys(&kb, tag + 1, &src_b);
        if round == 0 {
            cache.poison(dev, &s, &dst, 0xA5)?;
        }
        let k0 = kernel_ns();
        let t0 = Instant::now();
        wait(store.store(layout, 0, &src_a, ka.clone())?, "store")?;
        let ts = t0.elapsed().as_secs_f64();
        let k1 = kernel_ns();
        let t0 = Instant::now();
        wait(store.load(layout, 0, &dst, ka.clone())?, "load")?;
        let tl = t0.elapsed().as_secs_f64();
        let k2 = kernel_ns();
        if round == 0 {
            // Warm-up: every restored byte must equal its source.
            let scratch = &mut host.buf[..2 * total as usize];
            cache.check_same(
                dev,
                &s,
                &src_a,
                &dst,
                scratch,
                "restored blocks differ from the stored ones",
            )?;
            progress!("warm-up: {n} blocks round-tripped byte for byte");
            cache.poison(dev, &s, &dst, 0x5A)?;
        }
        // Both directions at once: store set B while set A is loaded again.
        let tracing = a.trace.is_some() && round == traced_round;
        if tracing {
            store.cuda().context("no CUDA mover")?.start_trace()?;
        }
        let k3 = kernel_ns();
        let t0 = Instant::now();
        let js = store.store(layout, 0, &src_b, kbk)?;
        let jl = store.load(layout, 0, &dst, ka)?;
        // Note when each job finishes: a job that ends early leaves the other alone.
        let (mut end_s, mut end_l) = (None, None);
        while end_s.is_none() || end_l.is_none() {
            if end_s.is_none() && js.is_done() {
                end_s = Some(t0.elapsed().as_secs_f64());
            }
            if end_l.is_none() && jl.is_done() {
                end_l = Some(t0.elapsed().as_secs_f64());
            }
            ensure!(
                t0.elapsed() < Duration::from_secs(600),
                "the concurrent store and load did not finish in 10 minutes"
            );
            std::thread::sleep(Duration::from_micros(20));
        }
        wait(js, "concurrent store")?;
        wait(jl, "concurrent load")?;
        let tb = t0.elapsed().as_secs_f64();
        let k4 = kernel_ns();
        if tracing {
            let spans = store.cuda().context("no CUDA mover")?.take_trace();
            trace_out.push(summarize_trace(&shape.name, method, &spans));
            continue;
        }
        if round == 0 {
            let scratch = &mut host.buf[..2 * total as usize];
            cache.check_same(
                dev,
                &s,
                &src_a,
                &dst,
                scratch,
                "blocks restored during concurrent stores differ",
            )?;
            continue;
        }
        progress!(
            "round {round}: store {:.1} GB/s, load {:.1} GB/s, both at once {:.1} GB/s",
            total as f64 / ts / GB,
            total as f64 / tl / GB,
            2.0 * total as f64 / tb / GB
        );
        if ts < best_s {
            best_s = ts;
            k_store = k1 - k0;
        }
        if tl < best_l {
            best_l = tl;
            k_load = k2 - k1;
        }
        if tb < best_b {
            best_b = tb;
            k_both = k4 - k3;
            both_ends = (end_s.unwrap_or(tb), end_l.unwrap_or(tb));
        }
    }
    let (cstats, pin) = store.cuda_status().context("no CUDA status")?;
    store.close();
    drop(store);

    // Naive baseline: one copy call per piece, same blocks, same registered host memory.
    let mut run_naive = |load: bool| -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..2 {
            let t0 = Instant::now();
            let mut at = 0usize;
            for &b in if load { &dst } else { &src_a } {
                for l in 0..layers {
                    let hp = host.buf.as_mut_ptr();
                    // SAFETY: the piece lies in `kv`; `hp + at` in the registered buffer.
                    unsafe {
                        if load {
                            dev.copy_htod(cache.piece_addr(l, b), hp.add(at), piece, &s)?;
                        } else {
                            dev.copy_dtoh(hp.add(at), cache.piece_addr(l, b), piece, &s)?;
                        }
                    }
                    at += piece as usize;
                }
            }
            s.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(best)
    };
    let (naive_store, naive_load) = if naive {
        (
            total as f64 / run_naive(false)? / GB,
            total as f64 / run_naive(true)? / GB,
        )
    } else {
        (f64::NAN, f64::NAN)
    };

    let store_gbps = total as f64 / best_s / GB;
    let load_gbps = total as f64 / best_l / GB;
    let both_gbps = 2.0 * total as f64 / best_b / GB;
    let c_d2h = ceil["d2h_gbps"].as_f64().unwrap_or(f64::NAN);
    let c_h2d = ceil["h2d_gbps"].as_f64().unwrap_or(f64::NAN);
    let c_both = ceil["both_gbps"].as_f64().unwrap_or(f64::NAN);
    let gb = |b: u64| b as f64 / GB;
    let kernel_ms_per_gb = |ns: u64| ns as f64 / 1e6 / gb(total);
    let sm_share = f64::from(cstats.max_ctas.min(cstats.sm_count)) / f64::from(cstats.sm_count);
    let out = json!({
        "shape": shape.name,
        "layers": layers,
        "piece_bytes": piece,
        "object_bytes": object,
        "num_blocks": nb,
        "layer_stride_bytes": nb * piece,
        "max_pitch": dev.max_pitch,
        "method": method.to_string(),
        "blocks": n,
        "bytes_each_way": total,
        "store_gbps": store_gbps,
        "load_gbps": load_gbps,
        "both_gbps": both_gbps,
        "store_ratio": store_gbps / c_d2h,
        "load_ratio": load_gbps / c_h2d,
        "both_ratio": both_gbps / c_both,
        "naive_store_gbps": naive_store,
        "naive_load_gbps": naive_load,
        "kernel_ms_per_gb_store": kernel_ms_per_gb(k_store),
        "kernel_ms_per_gb_load": kernel_ms_per_gb(k_load),
        "kernel_ms_per_gb_both": kernel_ms_per_gb(k_both) / 2.0,
        "both_store_done_ms": both_ends.0 * 1e3,
        "both_load_done_ms": both_ends.1 * 1e3,
        "kernel_max_ctas": cstats.max_ctas,
        "sm_count": cstats.sm_count,
        "kernel_sm_share": sm_share,
        "staging_device_bytes": cstats.staging_device_bytes,
        "copies_2d": cstats.copies_2d,
        "copies_3d": cstats.copies_3d,
        "copies_1d": cstats.copies_1d,
        "batch_calls": cstats.batch_calls,
        "staged_bytes": cstats.staged_bytes,
        "dma_bytes": cstats.dma_bytes,
        "pool_registration_seconds": pin.seconds,
        "pool_bytes": pin.total_bytes,
    });
    println!(
        "{} [{method}]: {layers} layers × {piece} B pieces, {n} random blocks ({:.2} GB) each way",
        shape.name,
        gb(total)
    );
    println!(
        "  store (GPU → pool)   {store_gbps:>7.2} GB/s  ratio {:.3} of D2H ceiling {c_d2h:.2}",
        store_gbps / c_d2h
    );
    println!(
        "  load  (pool → GPU)   {load_gbps:>7.2} GB/s  ratio {:.3} of H2D ceiling {c_h2d:.2}",
        load_gbps / c_h2d
    );
    println!(
        "  both at once         {both_gbps:>7.2} GB/s  ratio {:.3} of both-ways ceiling {c_both:.2}",
        both_gbps / c_both
    );
    println!(
        "                       (the store finished after {:.2} ms, the load after {:.2} ms)",
        both_ends.0 * 1e3,
        both_ends.1 * 1e3
    );
    if naive {
        println!("  naive (1 call/piece) {naive_store:>7.2} GB/s store, {naive_load:.2} GB/s load");
    }
    println!(
        "  GPU kernel time      {:.3} ms/GB store, {:.3} ms/GB load, {:.3} ms/GB both at once, on ≤ {} of {} SMs; staging {} MiB; copies 2d {} 3d {} 1d {} batch calls {}",
        kernel_ms_per_gb(k_store),
        kernel_ms_per_gb(k_load),
        kernel_ms_per_gb(k_both) / 2.0,
        cstats.max_ctas,
        cstats.sm_count,
        cstats.staging_device_bytes >> 20,
        cstats.copies_2d,
        cstats.copies_3d,
        cstats.copies_1d,
        cstats.batch_calls
    );
    Ok(out)
}

/// Merged busy intervals of `spans` (start, end), sorted.
fn merged(mut spans: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<(f64, f64)> = Vec::new();
    for (s, e) in spans {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// Time both interval lists (each merged) cover at once.
fn overlap(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let (mut i, mut j, mut t) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            t += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    t
}

/// A traced both-directions run, summarised per direction: how busy its DMA stream was and
/// how fast it moved while busy, the gaps between its DMAs, its kernels, mover calls and waits
/// for staging slots; and how long both DMA streams ran at once. Printed, and returned with
/// the spans.
fn summarize_trace(shape: &str, method: CopyMethod, spans: &[TraceSpan]) -> Value {
    let pick = |dir: &str, step: &str| -> Vec<&TraceSpan> {
        spans
            .iter()
            .filter(|s| s.direction == dir && s.step == step)
            .collect()
    };
    let busy = |v: &[&TraceSpan]| merged(v.iter().map(|s| (s.start_us, s.end_us)).collect());
    let len = |v: &[(f64, f64)]| v.iter().map(|(s, e)| e - s).sum::<f64>();
    let mut out = serde_json::Map::new();
    let mut dma_busy = Vec::new();
    println!("  trace of an extra, untimed both-directions round ({shape} [{method}]):");
    for dir in ["store", "load"] {
        let dma = pick(dir, "dma");
        let kern = pick(dir, "kernel");
        let calls = pick(dir, "call");
        let mut waits = pick(dir, "slot_wait");
        waits.extend(pick(dir, "desc_wait"));
        let d = busy(&dma);
        let k = busy(&kern);
        let first = d
            .first()
            .map_or(f64::MAX, |x| x.0)
            .min(k.first().map_or(f64::MAX, |x| x.0));
        let first = if first == f64::MAX { 0.0 } else { first };
        let last = d
            .last()
            .map_or(0.0, |x| x.1)
            .max(k.last().map_or(0.0, |x| x.1));
        let window = (last - first).max(1e-9);
        let bytes: u64 = dma.iter().map(|s| s.bytes).sum();
        let gaps: Vec<f64> = d.windows(2).map(|w| w[1].0 - w[0].1).collect();
        let big: Vec<f64> = gaps.iter().copied().filter(|&g| g > 5.0).collect();
        let call_mean =
            calls.iter().map(|s| s.end_us - s.start_us).sum::<f64>() / calls.len().max(1) as f64;
        let wait_total: f64 = waits.iter().map(|s| s.end_us - s.start_us).sum();
        let dma_us = len(&d);
        println!(
            "    {dir:<5}: device window {:.0} µs (from {:.0} µs); DMA busy {:.0} µs = {:.0}% ({:.1} GB/s while busy, {:.1} over the window); {} DMA gaps > 5 µs, {:.0} µs in all, largest {:.0} µs; kernels busy {:.0} µs ({} launches); {} mover calls, {:.0} µs each on average; host waits for slots/descriptors {:.0} µs in all",
            window,
            first,
            dma_us,
            100.0 * dma_us / window,
            bytes as f64 / dma_us.max(1e-9) / 1e3,
            bytes as f64 / window / 1e3,
            big.len(),
            big.iter().sum::<f64>(),
            big.iter().copied().fold(0.0, f64::max),
            len(&k),
            kern.len(),
            calls.len(),
            call_mean,
            wait_total
        );
        out.insert(
            dir.to_owned(),
            json!({
                "window_us": window,
                "first_us": first,
                "dma_busy_us": dma_us,
                "dma_bytes": bytes,
                "dma_gaps_over_5us": big.len(),
                "dma_gap_us": big.iter().sum::<f64>(),
                "kernel_busy_us": len(&k),
                "kernel_launches": kern.len(),
                "calls": calls.len(),
                "call_mean_us": call_mean,
                "slot_wait_us": wait_total,
            }),
        );
        dma_busy.push(d);
    }
    let both = overlap(&dma_busy[0], &dma_busy[1]);
    println!("    both DMA streams busy at once for {both:.0} µs");
    json!({
        "shape": shape,
        "method": method.to_string(),
        "summary": out,
        "both_dma_busy_us": both,
        "spans": spans.iter().map(|s| json!({
            "dir": s.direction,
            "step": s.step,
            "bytes": s.bytes,
            "start_us": s.start_us,
            "end_us": s.end_us,
        })).collect::<Vec<_>>(),
    })
}

/// The compute load: a matmul loop on its own stream, timed by events.
struct Load<'a> {
    mm: &'a Matmul,
    stream: &'a Stream,
    per_loop: usize,
    start: Event,
    end: Event,
}

impl Load<'_> {
    fn queue(&self) -> Result<()> {
        self.start.record(self.stream)?;
        self.mm.queue(self.per_loop)?;
        self.end.record(self.stream)?;
        Ok(())
    }

    fn finished(&self) -> Result<bool> {
        Ok(self.end.query()?)
    }

    fn ms(&self) -> Result<f64> {
        self.end.synchronize()?;
        Ok(f64::from(self.end.elapsed_ms_since(&self.start)?))
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Store,
    Load,
    Both,
}

/// Copy rate and matmul time of one shape and method, with the matmul loop alone and beside
/// back-to-back jobs of `mode`. Only jobs that finish inside the loop's run count.
fn under_load_shape(
    a: &Args,
    dev: &Arc<Device>,
    shape: &Shape,
    method: CopyMethod,
    host: &mut Pinned,
    ceil: &Value,
    load: &Load<'_>,
) -> Result<Value> {
    let p = prepare(a, dev, shape, method, host)?;
    let ka = keys(&p.kb, 1_000_000, &p.src_a);
    check_done(
        &p.store
            .store(p.layout, 0, &p.src_a, ka.clone())?
            .wait(Duration::from_secs(600))?,
        "store",
    )?;
    let mut out = serde_json::Map::new();
    out.insert("shape".into(), json!(shape.name));
    out.insert("piece_bytes".into(), json!(shape.piece));
    out.insert("object_bytes".into(), json!(shape.piece * shape.layers));
    out.insert("method".into(), json!(method.to_string()));
    let mut tag = 2_000_000u32;
    for (mode, name, ceiling) in [
        (Mode::Store, "store", "d2h_gbps"),
        (Mode::Load, "load", "h2d_gbps"),
        (Mode::Both, "both", "both_gbps"),
    ] {
        let (mut alone, mut beside, mut rates) = (Vec::new(), Vec::new(), Vec::new());
        let k0 = p.store.cuda_status().map_or(0, |(c, _)| c.kernel_ns);
        let mut moved_all = 0u64;
        for _ in 0..a.load_rounds {
            load.queue()?;
            alone.push(load.ms()?);
            load.queue()?;
            let t0 = Instant::now();
            let (mut moved, mut last) = (0u64, t0);
            while !load.finished()? {
                let k = keys(&p.kb, tag, &p.src_b);
                tag += 1;
                let bytes = match mode {
                    Mode::Store => {
                        let j = p.store.store(p.layout, 0, &p.src_b, k.clone())?;
                        check_done(&j.wait(Duration::from_secs(600))?, "store under load")?;
                        p.total
                    }
                    Mode::Load => {
                        let j = p.store.load(p.layout, 0, &p.dst, ka.clone())?;
                        check_done(&j.wait(Duration::from_secs(600))?, "load under load")?;
                        p.total
                    }
                    Mode::Both => {
                        let js = p.store.store(p.layout, 0, &p.src_b, k.clone())?;
                        let jl = p.store.load(p.layout, 0, &p.dst, ka.clone())?;
                        check_done(&js.wait(Duration::from_secs(600))?, "store under load")?;
                        check_done(&jl.wait(Duration::from_secs(600))?, "load under load")?;
                        2 * p.total
                    }
                };
                let done_inside = !load.finished()?;
                if mode != Mode::Load {
                    for key in &k {
                        p.store.pool().remove(key);
                    }
                }
                if !done_inside {
                    break;
                }
                moved += bytes;
                last = Instant::now();
            }
            beside.push(load.ms()?);
            moved_all += moved;
            let secs = last.duration_since(t0).as_secs_f64();
            ensure!(
                moved > 0,
                "shape {}: no copy job finished inside one {:.0} ms matmul loop; raise --load-ms",
                shape.name,
                load.ms()?
            );
            rates.push(moved as f64 / secs / GB);
        }
        let kernel_ns = p.store.cuda_status().map_or(0, |(c, _)| c.kernel_ns) - k0;
        let (am, bm) = (median(&alone), median(&beside));
        let noise = alone
            .iter()
            .map(|x| (x / am - 1.0).abs())
            .fold(0.0, f64::max);
        let gbps = median(&rates);
        let c = ceil[ceiling].as_f64().unwrap_or(f64::NAN);
        out.insert(
            name.into(),
            json!({
                "gbps": gbps,
                "ratio_to_idle_ceiling": gbps / c,
                "matmul_ms_alone": am,
                "matmul_ms_beside": bm,
                "slowdown_pct": 100.0 * (bm / am - 1.0),
                "noise_pct": 100.0 * noise,
                "alone_ms": alone,
                "beside_ms": beside,
                "gbps_rounds": rates,
                "kernel_ms_per_gb": kernel_ns as f64 / 1e6 / (moved_all as f64 / GB).max(1e-9),
            }),
        );
    }
    let st = p.store.cuda_status().map(|(c, _)| c);
    out.insert(
        "auto_switches".into(),
        json!(st.as_ref().map_or(0, |c| c.auto_switches)),
    );
    out.insert(
        "staged_share".into(),
        json!(st.as_ref().map_or(0.0, |c| c.staged_bytes as f64
            / (c.staged_bytes + c.dma_bytes).max(1) as f64)),
    );
    p.store.close();
    // The loop's noise band over all three modes' lone rounds.
    let noise = ["store", "load", "both"]
        .iter()
        .filter_map(|m| out[*m]["noise_pct"].as_f64())
        .fold(0.0, f64::max);
    out.insert("noise_pct".into(), json!(noise));
    let v = Value::Object(out);
    let f = |m: &str, k: &str| v[m][k].as_f64().unwrap_or(f64::NAN);
    println!(
        "{} [{method}] under a full-GPU matmul: store {:.2} GB/s ({:.3}), load {:.2} ({:.3}), both {:.2} ({:.3}); matmul slowdown {:+.2} / {:+.2} / {:+.2} % (noise ±{:.2} %); staged share {:.0} %, auto switches {}",
        shape.name,
        f("store", "gbps"),
        f("store", "ratio_to_idle_ceiling"),
        f("load", "gbps"),
        f("load", "ratio_to_idle_ceiling"),
        f("both", "gbps"),
        f("both", "ratio_to_idle_ceiling"),
        f("store", "slowdown_pct"),
        f("load", "slowdown_pct"),
        f("both", "slowdown_pct"),
        noise,
        100.0 * v["staged_share"].as_f64().unwrap_or(0.0),
        v["auto_switches"].as_u64().unwrap_or(0),
    );
    Ok(v)
}

/// Every `--shapes` shape and `--under-load-methods` method under the matmul load.
fn under_load(
    a: &Args,
    dev: &Arc<Device>,
    shapes: &[Shape],
    host: &mut Pinned,
    ceil: &Value,
) -> Result<Value> {
    let methods = parse_methods(&a.under_load_methods, "--under-load-methods")?;
    let stream = dev.stream()?;
    let (mm, lib) = Matmul::new(dev, &stream, a.matmul_n)?;
    // Calibrate: how many matmuls fill --load-ms.
    let (t0, t1) = (dev.event(true)?, dev.event(true)?);
    mm.queue(3)?;
    t0.record(&stream)?;
    mm.queue(10)?;
    t1.record(&stream)?;
    t1.synchronize()?;
    let one_ms = f64::from(t1.elapsed_ms_since(&t0)?) / 10.0;
    let per_loop = ((a.load_ms as f64 / one_ms).ceil() as usize).max(1);
    let tflops = mm.flops() / (one_ms / 1e3) / 1e12;
    progress!(
        "compute load: {n}×{n}×{n} bf16 matmuls through {lib}, {one_ms:.3} ms each ({tflops:.0} TFLOP/s), {per_loop} per loop ({:.0} ms)",
        per_loop as f64 * one_ms,
        n = a.matmul_n
    );
    let load = Load {
        mm: &mm,
        stream: &stream,
        per_loop,
        start: dev.event(true)?,
        end: dev.event(true)?,
    };
    let mut rows = Vec::new();
    for shape in shapes {
        for &m in &methods {
            rows.push(under_load_shape(a, dev, shape, m, host, ceil, &load)?);
        }
    }
    println!();
    println!(
        "under load ({n}³ bf16 matmul loop, {tflops:.0} TFLOP/s alone; medians of {} rounds): copy GB/s (ratio to the idle ceiling) | matmul slowdown %",
        a.load_rounds,
        n = a.matmul_n
    );
    println!(
        "{:>14} {:>7} | {:>15} {:>15} {:>15} | {:>7} {:>7} {:>7} {:>7}",
        "shape", "method", "store", "load", "both", "st %", "ld %", "both %", "noise"
    );
    for r in &rows {
        let f = |m: &str, k: &str| r[m][k].as_f64().unwrap_or(f64::NAN);
        let cell = |m: &str| format!("{:.1} ({:.3})", f(m, "gbps"), f(m, "ratio_to_idle_ceiling"));
        println!(
            "{:>14} {:>7} | {:>15} {:>15} {:>15} | {:>+7.2} {:>+7.2} {:>+7.2} {:>6.2}%",
            r["shape"].as_str().unwrap_or("?"),
            r["method"].as_str().unwrap_or("?"),
            cell("store"),
            cell("load"),
            cell("both"),
            f("store", "slowdown_pct"),
            f("load", "slowdown_pct"),
            f("both", "slowdown_pct"),
            r["noise_pct"].as_f64().unwrap_or(f64::NAN),
        );
    }
    Ok(json!({
        "matmul_n": a.matmul_n,
        "matmul_ms": one_ms,
        "matmul_tflops": tflops,
        "matmuls_per_loop": per_loop,
        "rounds": a.load_rounds,
        "rows": rows,
    }))
}

/// Registration of a large pool: construction time, a round trip while registration runs, and
/// seconds per GiB.
fn pin_test(a: &Args, dev: &Arc<Device>, prefault: bool) -> Result<Value> {
    let gib = a.pin_gib;
    progress!(
        "registration: a {gib} GiB pool ({}), registered for DMA in 64 MiB chunks",
        if prefault {
            "prefaulted first"
        } else {
            "not prefaulted: registration faults the pages"
        }
    );
    let (layers, nb, piece) = (32u64, 1024u64, 64u64 << 10);
    let kv = dev.alloc(layers * nb * piece)?;
    let t0 = Instant::now();
    let store = EmbeddedStore::new(StoreConfig {
        pool: PoolConfig {
            prefault,
            ..PoolConfig::with_capacity(gib << 30)
        },
        num_workers: a.workers,
        ..StoreConfig::default()
    })?;
    let t_new = t0.elapsed().as_secs_f64();
    let prefault_s = store.pool().placement().prefault_seconds;
    let hugepages = format!("{:?}", store.pool().placement().hugepages_used);
    let t1 = Instant::now();
    // SAFETY: `kv` outlives the store.
    unsafe { store.register_cuda_memory(kv.ptr(), kv.len(), a.device) }?;
    let t_register_call = t1.elapsed().as_secs_f64();
    let layout = store.register_layout(KvLayout::new(vec![GroupLayout::new(
        (0..layers)
            .map(|l| LayerSpec {
                base_addr: kv.ptr() + l * nb * piece,
                num_blocks: nb,
                block_stride: piece,
                block_bytes: piece,
            })
            .collect(),
    )?])?)?;
    // A round trip right away, while the pool is still being registered.
    let kb = KeyBuilder::new("bench-gpu-pin", RankTopology::default())?;
    let ids: Vec<u64> = (0..256).collect();
    let targets: Vec<u64> = (512..768).collect();
    let ks = keys(&kb, 0, &ids);
    let t2 = Instant::now();
    check_done(
        &store
            .store(layout, 0, &ids, ks.clone())?
            .wait(Duration::from_secs(120))?,
        "store",
    )?;
    check_done(
        &store
            .load(layout, 0, &targets, ks)?
            .wait(Duration::from_secs(120))?,
        "load",
    )?;
    let t_roundtrip = t2.elapsed().as_secs_f64();
    let during = store.cuda_status().map(|(_, p)| p).context("no status")?;
    let since_start = t1.elapsed().as_secs_f64();
    ensure!(
        store.wait_pool_registered(Duration::from_secs(600)),
        "registration did not finish in 10 minutes"
    );
    let pin = store.cuda_status().map(|(_, p)| p).context("no status")?;
    if let Some(e) = &pin.error {
        bail!("registration failed: {e}");
    }
    let secs = pin.seconds.unwrap_or(f64::NAN);
    store.close();
    let out = json!({
        "pool_gib": gib,
        "prefault": prefault,
        "hugepages": hugepages,
        "store_new_seconds": t_new,
        "prefault_seconds": prefault_s,
        "register_cuda_memory_seconds": t_register_call,
        "roundtrip_seconds": t_roundtrip,
        "roundtrip_done_after_seconds": since_start,
        "registered_bytes_when_roundtrip_done": during.registered_bytes,
        "registration_seconds": secs,
        "registration_seconds_per_gib": secs / gib as f64,
    });
    println!(
        "registration of a {gib} GiB pool: store created in {t_new:.2} s (prefault {prefault_s:.2} s, pages {hugepages}); register_cuda_memory returned in {:.3} s",
        t_register_call
    );
    println!(
        "  a 256-block round trip (1.07 GB) took {t_roundtrip:.3} s, done {since_start:.2} s after registration began, with {:.1} of {gib} GiB registered",
        during.registered_bytes as f64 / (1u64 << 30) as f64
    );
    println!(
        "  registration: {secs:.2} s, {:.4} s/GiB",
        secs / gib as f64
    );
    Ok(out)
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(
        a.blocks > 0 && a.rounds > 0,
        "--blocks and --rounds must be > 0"
    );
    let method: CopyMethod = a.method.parse()?;
    let shapes = parse_shapes(&a.shapes, a.num_blocks)?;
    // Refuse bad lists before the device is opened.
    if a.sweep {
        parse_kib_list(&a.sweep_kib, "--sweep-kib")?;
        parse_kib_list(&a.sweep_block_kib, "--sweep-block-kib")?;
        parse_methods(&a.sweep_methods, "--sweep-methods")?;
    }
    if a.under_load {
        parse_methods(&a.under_load_methods, "--under-load-methods")?;
    }
    let dev = Device::open(a.device)?;
    let drv = umbp_cuda::driver()?;
    progress!(
        "device {} ({}), driver API {}, {} SMs, {} copy engines, max pitch {}, batched copies: {}",
        a.device,
        dev.name,
        drv.version,
        dev.sm_count,
        dev.copy_engines,
        dev.max_pitch,
        drv.has_batch_copy()
    );
    let max_object = shapes
        .iter()
        .map(|s| s.layers * s.piece)
        .max()
        .unwrap_or(0)
        .max(if a.sweep {
            parse_kib_list(&a.sweep_block_kib, "--sweep-block-kib")?
                .into_iter()
                .max()
                .unwrap_or(0)
                << 10
        } else {
            0
        });
    let host_len = (2 * a.blocks * max_object).max(2 << 30) as usize;
    let mut host = Pinned::new(&dev, host_len)?;
    let scratch = dev.alloc(2 << 30)?;
    let ceil = ceiling(&dev, &mut host, &scratch)?;
    drop(scratch);
    println!(
        "contiguous pinned copies (1 GiB+): H2D {:.2} GB/s, D2H {:.2} GB/s, both at once {:.2} GB/s",
        ceil["h2d_gbps"].as_f64().unwrap_or(0.0),
        ceil["d2h_gbps"].as_f64().unwrap_or(0.0),
        ceil["both_gbps"].as_f64().unwrap_or(0.0)
    );
    let mut results = Vec::new();
    let mut traces = Vec::new();
    let swept = if a.sweep {
        sweep(a, &dev, &mut host, &ceil, &mut traces)?
    } else {
        Vec::new()
    };
    for shape in shapes.iter().filter(|_| !a.sweep) {
        results.push(run_shape(
            a,
            &dev,
            shape,
            method,
            &mut host,
            &ceil,
            &mut traces,
        )?);
        if a.also_dma && method != CopyMethod::Dma {
            results.push(run_shape(
                a,
                &dev,
                shape,
                CopyMethod::Dma,
                &mut host,
                &ceil,
                &mut traces,
            )?);
        }
    }
    let loaded = if a.under_load {
        Some(under_load(a, &dev, &shapes, &mut host, &ceil)?)
    } else {
        None
    };
    drop(host);
    if let Some(path) = &a.trace {
        std::fs::write(path, serde_json::to_vec_pretty(&traces)?)
            .with_context(|| format!("cannot write the trace to {}", path.display()))?;
        progress!("trace written to {}", path.display());
    }
    let pin = if a.pin_gib > 0 {
        Some(vec![pin_test(a, &dev, true)?, pin_test(a, &dev, false)?])
    } else {
        None
    };
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "gpu",
                "device": dev.name,
                "driver_version": drv.version,
                "sm_count": dev.sm_count,
                "copy_engines": dev.copy_engines,
                "ceiling": ceil,
                "shapes": results,
                "sweep": swept,
                "under_load": loaded,
                "registration": pin,
            })
        );
    }
    Ok(())
}
