//! The KV cache shapes: the `--shapes` list, the sweep's shapes, and the parsing of the
//! `--sweep-*` and `--*-methods` lists.

use anyhow::{bail, ensure, Context, Result};
use umbp_cuda::CopyMethod;

/// The sweep's shape for `piece` bytes and blocks of about `block` bytes (2 to 128 layers).
pub(super) fn sweep_shape(piece: u64, block: u64, blocks: u64) -> Shape {
    let layers = (block / piece).clamp(2, 128);
    Shape {
        name: format!("{layers}x{piece}"),
        layers,
        piece,
        num_blocks: (3 * blocks).next_multiple_of(1024),
    }
}

/// A comma-separated list of positive KiB numbers (`what` names the option in errors).
pub(super) fn parse_kib_list(v: &str, what: &str) -> Result<Vec<u64>> {
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
pub(super) fn parse_methods(v: &str, what: &str) -> Result<Vec<CopyMethod>> {
    v.split(',')
        .map(|s| {
            s.trim()
                .parse::<CopyMethod>()
                .map_err(|_| anyhow::anyhow!("{what}: {s:?} is not one of auto, dma, staged"))
        })
        .collect()
}
pub(super) const GB: f64 = 1e9;

pub(super) struct Shape {
    pub(super) name: String,
    pub(super) layers: u64,
    pub(super) piece: u64,
    pub(super) num_blocks: u64,
}

pub(super) fn parse_shapes(spec: &str, default_blocks: u64) -> Result<Vec<Shape>> {
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
