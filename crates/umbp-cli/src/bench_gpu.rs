//! `umbp bench gpu`: KV blocks between a CUDA KV cache and the pool, beside the contiguous
//! pinned-copy ceiling and a naive one-copy-per-piece baseline measured in the same run.
//!
//! The flags are in `args`, the shapes in `shapes`, the setup of a shape in `setup`, one
//! measured shape in `shape_run`, its trace summary in `trace`, `--sweep` in `sweep`,
//! `--under-load` in `load` and `--pin-test` in `pin`; this file runs them and prints the
//! report.

mod args;
mod load;
mod pin;
mod setup;
mod shape_run;
mod shapes;
mod sweep;
mod trace;

use anyhow::{ensure, Context, Result};
use serde_json::json;
use umbp_cuda::{CopyMethod, Device};

use crate::common::progress;

pub use args::Args;

use load::under_load;
use pin::pin_test;
use setup::{ceiling, Pinned};
use shape_run::run_shape;
use shapes::{parse_kib_list, parse_methods, parse_shapes};
use sweep::sweep;

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
