//! `umbp bench cache`: replays a prefix workload (shared prefixes with Zipf popularity, and a
//! burst of one-off prompts twice the pool's size) against the pool at several capacities,
//! for every eviction policy and store admission, and prints token hit rates and bytes
//! stored side by side; then the same with multi-turn conversations mixed in (`--chat-share`
//! of the requests), whose earlier turns are reused after many other requests; then the MLA
//! rows: objects and bytes per cached token at TP 2/4/8 with every rank storing its copy and
//! with MLA stored once.

mod mla;
mod replay;
mod workload;

use anyhow::{ensure, Result};
use serde_json::json;
use umbp_pool::{EvictionPolicy, StoreAdmission, DEFAULT_ADMISSION_WINDOW};

use crate::common::{human_bytes, progress};
use replay::{replay, Outcome, Shape};
use workload::Workload;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Shared prefixes in the population.
    #[arg(long, default_value_t = 512)]
    prefixes: usize,
    /// Blocks per shared prefix.
    #[arg(long, default_value_t = 8)]
    prefix_blocks: u32,
    /// Unique blocks after the prefix in each shared-prefix request.
    #[arg(long, default_value_t = 2)]
    suffix_blocks: u32,
    /// Zipf exponent of the prefixes' popularity.
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Shared-prefix requests before the burst, and again after it.
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// The first shared-prefix requests after the burst that count as its recovery (the
    /// `sh.burst` column: shared prefixes during the burst and this recovery).
    #[arg(long, default_value_t = 512)]
    recovery: usize,
    /// Size of the burst of one-off prompts, in multiples of the pool's capacity.
    #[arg(long, default_value_t = 2.0)]
    burst: f64,
    /// Blocks per one-off prompt.
    #[arg(long, default_value_t = 16)]
    oneoff_blocks: u32,
    /// Share of the requests during the burst that are one-off prompts (the rest reuse
    /// shared prefixes).
    #[arg(long, default_value_t = 0.9)]
    burst_share: f64,
    /// Bytes per block.
    #[arg(long, default_value_t = 8 << 10)]
    block_bytes: u64,
    /// Tokens per block.
    #[arg(long, default_value_t = 16)]
    block_tokens: u64,
    /// Pool capacities, as fractions of the shared prefixes' working set.
    #[arg(long, value_delimiter = ',', default_values_t = vec![0.25, 0.5, 1.0])]
    capacities: Vec<f64>,
    /// Keys the `on_reuse` admission remembers.
    #[arg(long, default_value_t = DEFAULT_ADMISSION_WINDOW)]
    admission_window: usize,
    /// Share of the (non-burst) requests that are a conversation's next turn in the second
    /// workload, "chat" (0: run the first workload only).
    #[arg(long, default_value_t = 0.5)]
    chat_share: f64,
    /// Conversations going on at once in the chat workload: a conversation's next turn comes
    /// after about this many requests divided by the chat share.
    #[arg(long, default_value_t = 64)]
    conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 8)]
    turns: u32,
    /// New blocks per turn (the question and the answer).
    #[arg(long, default_value_t = 4)]
    turn_blocks: u32,
    /// Seed of the trace.
    #[arg(long, default_value_t = 34)]
    seed: u64,
    /// MLA rows: tensor-parallel sizes (0 or none: no MLA rows).
    #[arg(long, value_delimiter = ',', default_values_t = vec![2u16, 4, 8])]
    mla_tp: Vec<u16>,
    /// MLA rows: blocks of the stored prefix (DeepSeek-V3's 1.07 MiB blocks of 16 tokens).
    #[arg(long, default_value_t = 32)]
    mla_blocks: u32,
    /// Print one JSON object per row instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: &Args) -> Result<()> {
    ensure!(
        a.prefixes > 0 && a.prefix_blocks > 0,
        "--prefixes and --prefix-blocks must be > 0"
    );
    ensure!(
        a.block_bytes > 0 && a.oneoff_blocks > 0,
        "--block-bytes and --oneoff-blocks must be > 0"
    );
    ensure!(
        a.burst_share > 0.0 && a.burst_share <= 1.0,
        "--burst-share must be in (0, 1]"
    );
    ensure!(
        a.capacities.iter().all(|c| *c > 0.0),
        "--capacities must be positive"
    );
    ensure!(
        (0.0..1.0).contains(&a.chat_share),
        "--chat-share must be in [0, 1)"
    );
    ensure!(
        a.conversations > 0 && a.turns > 0 && a.turn_blocks > 0,
        "--conversations, --turns and --turn-blocks must be > 0"
    );
    let working_set = a.prefixes as u64 * u64::from(a.prefix_blocks) * a.block_bytes;
    println!(
        "workload: {} shared prefixes x {} blocks (Zipf s={}), {} unique blocks per request, \
         {} requests before and after a burst of one-off prompts ({} blocks each) totalling \
         {}x the pool, {:.0}% of the burst's requests one-off, the {} shared requests after it \
         its recovery; blocks of {} and {} tokens; shared working set {}; seed {}; on_reuse \
         window {} keys; chat workload: {:.0}% of the non-burst requests a turn of one of {} \
         conversations ({} turns of {} new blocks each)",
        a.prefixes,
        a.prefix_blocks,
        a.zipf,
        a.suffix_blocks,
        a.requests,
        a.oneoff_blocks,
        a.burst,
        a.burst_share * 100.0,
        a.recovery,
        human_bytes(a.block_bytes),
        a.block_tokens,
        human_bytes(working_set),
        a.seed,
        a.admission_window,
        a.chat_share * 100.0,
        a.conversations,
        a.turns,
        a.turn_blocks,
    );
    if !a.json {
        println!(
            "{:>8} {:>9} {:>7} {:>9} {:>8} {:>8} {:>8} {:>8} {:>11} {:>9} {:>15} {:>7} {:>6}",
            "workload",
            "capacity",
            "policy",
            "admission",
            "hit tok",
            "shared",
            "sh.burst",
            "chat",
            "stored",
            "skipped",
            "evicted s/main",
            "ghost",
            "secs"
        );
    }
    let workloads: &[(&str, f64)] = if a.chat_share > 0.0 {
        &[("prefixes", 0.0), ("chat", a.chat_share)]
    } else {
        &[("prefixes", 0.0)]
    };
    for &(name, chat_share) in workloads {
        for &frac in &a.capacities {
            let capacity = ((working_set as f64 * frac) as u64).max(a.block_bytes * 64);
            let oneoff_bytes = u64::from(a.oneoff_blocks) * a.block_bytes;
            let w = Workload {
                prefixes: a.prefixes,
                zipf: a.zipf,
                suffix_blocks: a.suffix_blocks,
                oneoff_blocks: a.oneoff_blocks,
                requests: a.requests,
                oneoffs: ((capacity as f64 * a.burst) / oneoff_bytes as f64).ceil() as usize,
                burst_share: a.burst_share,
                recovery: a.recovery,
                chat_share,
                conversations: a.conversations,
                turns: a.turns,
                turn_blocks: a.turn_blocks,
                seed: a.seed,
            };
            let trace = w.trace();
            let shape = Shape {
                capacity_bytes: capacity,
                block_bytes: a.block_bytes,
                block_tokens: a.block_tokens,
                prefix_blocks: a.prefix_blocks,
                admission_window: a.admission_window,
            };
            progress!(
                "{name}, capacity {frac}x ({}): {} requests, {} one-off prompts",
                human_bytes(capacity),
                trace.len(),
                w.oneoffs
            );
            for policy in EvictionPolicy::ALL {
                for admission in StoreAdmission::ALL {
                    let o = replay(&trace, shape, policy, admission)?;
                    print_row(a, name, frac, capacity, policy, admission, &o);
                }
            }
        }
    }
    if !a.json {
        println!(
            "hit tok: tokens found / tokens asked, every request; shared: the same over the \
             shared prefixes' tokens; sh.burst: shared, during the burst and its recovery; \
             chat: the same over conversations' earlier turns; stored: bytes committed"
        );
    }
    mla_rows(a)
}

/// The MLA rows: a DeepSeek-V3-shaped prefix stored by TP ranks, before and after.
fn mla_rows(a: &Args) -> Result<()> {
    let tps: Vec<u16> = a.mla_tp.iter().copied().filter(|t| *t > 0).collect();
    if tps.is_empty() {
        return Ok(());
    }
    if !a.json {
        println!(
            "MLA ({} layers x {} B latent per token, blocks of {} tokens, a {}-block prefix \
             stored by every rank's connector, then looked up and read by every rank):",
            mla::LAYERS,
            mla::LATENT_BYTES,
            a.block_tokens,
            a.mla_blocks
        );
        println!(
            "{:>4} {:>12} {:>9} {:>9} {:>13} {:>8} {:>11}",
            "tp", "keys", "objects", "obj/tok", "bytes/tok", "skipped", "bytes ratio"
        );
    }
    for &tp in &tps {
        let before = mla::mla_row(tp, false, a.mla_blocks, a.block_tokens)?;
        let after = mla::mla_row(tp, true, a.mla_blocks, a.block_tokens)?;
        let ratio = before.bytes_per_token() / after.bytes_per_token();
        for r in [before, after] {
            let keys = if r.once { "once (tp0)" } else { "per rank" };
            if a.json {
                println!(
                    "{}",
                    json!({
                        "bench": "cache_mla",
                        "tp": r.tp,
                        "stored_once": r.once,
                        "objects": r.objects,
                        "bytes": r.bytes,
                        "tokens": r.tokens,
                        "objects_per_token": r.objects_per_token(),
                        "bytes_per_token": r.bytes_per_token(),
                        "skipped_stores": r.skipped,
                        "bytes_ratio_before_after": ratio,
                    })
                );
            } else {
                println!(
                    "{:>4} {:>12} {:>9} {:>9.4} {:>13.0} {:>8} {:>10.2}x",
                    r.tp,
                    keys,
                    r.objects,
                    r.objects_per_token(),
                    r.bytes_per_token(),
                    r.skipped,
                    if r.once { ratio } else { 1.0 },
                );
            }
        }
    }
    Ok(())
}

fn print_row(
    a: &Args,
    workload: &str,
    frac: f64,
    capacity: u64,
    policy: EvictionPolicy,
    admission: StoreAdmission,
    o: &Outcome,
) {
    let s = &o.stats;
    if a.json {
        println!(
            "{}",
            json!({
                "bench": "cache",
                "workload": workload,
                "capacity_fraction": frac,
                "capacity_bytes": capacity,
                "eviction_policy": policy.as_str(),
                "store_admission": admission.as_str(),
                "token_hit_rate": o.hit_rate(),
                "shared_prefix_hit_rate": o.shared_rate(),
                "shared_prefix_hit_rate_burst": o.shared_burst_rate(),
                "chat_context_hit_rate": o.chat_rate(),
                "tokens": o.tokens,
                "tokens_hit": o.tokens_hit,
                "bytes_stored": s.bytes_in,
                "admissions_skipped": s.admissions_skipped,
                "evictions_small": s.evictions_small,
                "evictions_main": s.evictions_main,
                "promotions": s.promotions,
                "ghost_hits": s.ghost_hits,
                "seconds": o.seconds,
            })
        );
        return;
    }
    println!(
        "{:>8} {:>9} {:>7} {:>9} {:>7.1}% {:>7.1}% {:>7.1}% {:>7.1}% {:>11} {:>9} {:>15} {:>7} {:>6.2}",
        workload,
        format!("{frac}x"),
        policy.as_str(),
        admission.as_str(),
        o.hit_rate() * 100.0,
        o.shared_rate() * 100.0,
        o.shared_burst_rate() * 100.0,
        o.chat_rate() * 100.0,
        human_bytes(s.bytes_in),
        s.admissions_skipped,
        format!("{}/{}", s.evictions_small, s.evictions_main),
        s.ghost_hits,
        o.seconds,
    );
}
