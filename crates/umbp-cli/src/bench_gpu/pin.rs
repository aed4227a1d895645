//! `--pin-test`: registering a large pool with and without prefaulting, and a round trip
//! while registration runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use umbp_core::{GroupLayout, KeyBuilder, KvLayout, LayerSpec, PoolConfig, RankTopology};
use umbp_cuda::Device;
use umbp_store::{EmbeddedStore, StoreConfig};

use super::args::Args;
use super::setup::{check_done, keys};
use crate::common::progress;

/// Registration of a large pool: construction time, a round trip while registration runs, and
/// seconds per GiB.
pub(super) fn pin_test(a: &Args, dev: &Arc<Device>, prefault: bool) -> Result<Value> {
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
