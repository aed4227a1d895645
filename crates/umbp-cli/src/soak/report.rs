//! The soak's progress lines (stderr) and its one-screen summary (stdout).

use std::time::Duration;

use super::args::{show_duration, Args};
use super::arm::Arm;
use super::result::ArmResult;
use crate::common::human_bytes;

/// One progress line: every arm's figures so far.
pub(crate) fn progress(elapsed: Duration, arms: &[Arm]) {
    let parts: Vec<String> = arms
        .iter()
        .map(|a| {
            let c = a.totals();
            let (rss, fds) = a
                .pool_series
                .last
                .map_or(("-".into(), "-".into()), |s| {
                    (format!("{} MiB", s.rss_bytes >> 20), s.fds.to_string())
                });
            format!(
                "{}: {} ops, {:.2} GB, hits {}, misses {}, wrong {}, lost {}, failed {}+{}, restarts {} ({} killed), objects {}, rss {rss}, fds {fds}",
                a.name,
                c.store_ops + c.load_ops + c.lookup_ops,
                (c.bytes_stored + c.bytes_loaded) as f64 / 1e9,
                c.lookup_hits,
                c.load_misses,
                c.wrong_bytes,
                c.lost_after_hit,
                c.failed_restart,
                c.failed_other,
                a.chaos.restarts,
                a.chaos.kills,
                a.current().objects,
            )
        })
        .collect();
    eprintln!(
        "[umbp soak] {} {}",
        show_duration(elapsed),
        parts.join(" | ")
    );
}

/// The summary: one column per arm.
pub(crate) fn summary(a: &Args, ran: Duration, arms: &[Arm], results: &[ArmResult]) {
    println!(
        "umbp soak: {} (asked {}), seed {}; blocks of {} × {} KiB; pool {}, disk tier {}; {} client(s) per arm",
        show_duration(ran),
        show_duration(a.duration),
        a.seed,
        a.layers,
        a.piece_kib,
        human_bytes(a.pool_mib << 20),
        human_bytes(a.disk_mib << 20),
        a.clients,
    );
    // A space before every cell: a wider figure pushes its row out, never into its
    // neighbour.
    let w = 18;
    let head: String = results.iter().map(|r| format!(" {:>w$}", r.name)).collect();
    println!("  {:<38}{head}", "");
    let row = |label: &str, f: &dyn Fn(&ArmResult) -> String| {
        let cells: String = results.iter().map(|r| format!(" {:>w$}", f(r))).collect();
        println!("  {label:<38}{cells}");
    };
    row("operations", &|r| {
        let c = &r.counts;
        (c.store_ops + c.load_ops + c.lookup_ops).to_string()
    });
    row("  stores / loads / lookups", &|r| {
        let c = &r.counts;
        format!("{}/{}/{}", c.store_ops, c.load_ops, c.lookup_ops)
    });
    row("GB moved (stored + loaded)", &|r| {
        let c = &r.counts;
        format!(
            "{:.2}+{:.2}",
            c.bytes_stored as f64 / 1e9,
            c.bytes_loaded as f64 / 1e9
        )
    });
    row("keys stored / already there", &|r| {
        format!("{}/{}", r.counts.keys_stored, r.counts.keys_already)
    });
    row("keys loaded and checked", &|r| {
        r.counts.keys_loaded.to_string()
    });
    row("lookup hits / keys asked", &|r| {
        format!("{}/{}", r.counts.lookup_hits, r.counts.lookup_keys)
    });
    row("load misses (seen present before)", &|r| {
        format!("{} ({})", r.counts.load_misses, r.counts.expected_misses)
    });
    row("lost after hit", &|r| r.counts.lost_after_hit.to_string());
    row("WRONG keys / bytes", &|r| {
        format!("{}/{}", r.counts.wrong_keys, r.counts.wrong_bytes)
    });
    row("failed (server restart) / other", &|r| {
        format!("{}/{}", r.counts.failed_restart, r.counts.failed_other)
    });
    row("restarts (SIGKILL)", &|r| {
        format!("{} ({})", r.chaos.restarts, r.chaos.kills)
    });
    row("clears (objects removed)", &|r| {
        format!("{} ({})", r.chaos.clears, r.chaos.cleared_objects)
    });
    row("pool puts / evictions", &|r| {
        format!("{}/{}", r.puts, r.evictions)
    });
    row("audit: keys / loadable / not found", &|r| {
        let c = &r.counts;
        format!("{}/{}/{}", c.audit_keys, c.audit_present, c.audit_missing)
    });
    row("  distinct keys not found", &|r| r.missing.to_string());
    row("  of them lost at a crash", &|r| {
        r.lost_at_crash.to_string()
    });
    row("  counted losses (cover the rest)", &|r| {
        r.counted_losses.to_string()
    });
    row("UNACCOUNTED keys", &|r| r.unaccounted_keys.to_string());
    row("identity checks / off by", &|r| {
        format!("{}/{}", r.checks, r.identity_off)
    });
    row("HITS after a clear (restarted since)", &|r| {
        format!("{} ({})", r.hits_after_clear, r.resurrected)
    });
    for (arm, r) in arms.iter().zip(results) {
        if let Some((name, off)) = r.info_off.filter(|x| x.1 > 0) {
            println!(
                "  {} (reported, not gating): \"{name}\" off by up to {off}",
                arm.name
            );
        }
    }
    println!("  RSS MiB and open fds, start/max/end:");
    for arm in arms {
        let (rss, fds) = arm.pool_series.show();
        let what = if arm.name == "server" {
            "server (across restarts)"
        } else {
            "embedded process"
        };
        println!(
            "    {:<30} rss {rss:>16}  fds {fds:>12}",
            format!("{}: {what}", arm.name)
        );
        for (id, s) in arm.client_series() {
            let (rss, fds) = s.show();
            println!(
                "    {:<30} rss {rss:>16}  fds {fds:>12}",
                format!("{}: client {id}", arm.name)
            );
        }
    }
    let failures: Vec<String> = results.iter().flat_map(ArmResult::failures).collect();
    if failures.is_empty() {
        println!("  verdict: OK (0 wrong bytes, 0 unaccounted)");
    } else {
        println!("  verdict: FAILED");
        for f in failures {
            println!("    {f}");
        }
    }
}
