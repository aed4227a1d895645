//! One shape and method measured: the store's moves each way and both at once against the
//! naive baseline and the ceiling, with the bytes checked, and the traced round.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};
use umbp_cuda::{CopyMethod, Device};

use super::args::Args;
use super::setup::{check_done, keys, prepare, Pinned, Prepared};
use super::shapes::{Shape, GB};
use super::trace::summarize_trace;
use crate::common::progress;

pub(super) fn run_shape(
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
