//! `--sweep`: every piece size, block size and method of the sweep lists, each one run as
//! a shape.

use std::sync::Arc;

use anyhow::Result;
use serde_json::Value;
use umbp_cuda::Device;

use super::args::Args;
use super::setup::Pinned;
use super::shape_run::run_shape;
use super::shapes::{parse_kib_list, parse_methods, sweep_shape};

pub(super) fn sweep(
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
