//! `--under-load`: copies beside a matmul loop on the same GPU, the loop's slowdown and the
//! copies' rate, per shape and method.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use serde_json::{json, Value};
use umbp_cuda::{CopyMethod, Device, Event, Stream};

use super::args::Args;
use super::setup::{check_done, keys, prepare, Pinned};
use super::shapes::{parse_methods, Shape, GB};
use crate::common::progress;
use crate::cublas::Matmul;

/// The compute load: a matmul loop on its own stream, timed by events.
pub(super) struct Load<'a> {
    pub(super) mm: &'a Matmul,
    pub(super) stream: &'a Stream,
    pub(super) per_loop: usize,
    pub(super) start: Event,
    pub(super) end: Event,
}

impl Load<'_> {
    pub(super) fn queue(&self) -> Result<()> {
        self.start.record(self.stream)?;
        self.mm.queue(self.per_loop)?;
        self.end.record(self.stream)?;
        Ok(())
    }

    pub(super) fn finished(&self) -> Result<bool> {
        Ok(self.end.query()?)
    }

    pub(super) fn ms(&self) -> Result<f64> {
        self.end.synchronize()?;
        Ok(f64::from(self.end.elapsed_ms_since(&self.start)?))
    }
}

pub(super) fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

#[derive(Clone, Copy, PartialEq)]
pub(super) enum Mode {
    Store,
    Load,
    Both,
}

/// Copy rate and matmul time of one shape and method, with the matmul loop alone and beside
/// back-to-back jobs of `mode`. Only jobs that finish inside the loop's run count.
pub(super) fn under_load_shape(
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
pub(super) fn under_load(
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
