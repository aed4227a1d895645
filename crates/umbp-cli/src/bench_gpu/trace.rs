//! The trace summary: busy intervals, overlap of the two DMA streams, and per-direction
//! figures of a traced both-directions run.

use serde_json::{json, Value};
use umbp_cuda::{CopyMethod, TraceSpan};

/// Merged busy intervals of `spans` (start, end), sorted.
pub(super) fn merged(mut spans: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
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
pub(super) fn overlap(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
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
pub(super) fn summarize_trace(shape: &str, method: CopyMethod, spans: &[TraceSpan]) -> Value {
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
