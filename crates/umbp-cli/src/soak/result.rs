//! What an arm's run comes to: the chaos it went through, the audit's findings, and the
//! verdict: every missing key explained (cleared, lost at a crash, or covered by the
//! counters' losses), every identity holding, every byte right.

use serde_json::{json, Value};

use super::arm::Arm;
use super::counts::Counts;
use super::findings::{AuditFindings, Chaos};

/// The figures of one arm's run, and its verdict.
#[derive(Debug, Clone)]
pub(crate) struct ArmResult {
    pub(crate) name: &'static str,
    pub(crate) counts: Counts,
    pub(crate) chaos: Chaos,
    /// Pool objects committed and evicted, over every pool process.
    pub(crate) puts: u64,
    pub(crate) evictions: u64,
    /// Distinct keys the audit found missing, and of those lost at a crash (a SIGKILL came
    /// after the last time a client saw them present).
    pub(crate) missing: u64,
    pub(crate) lost_at_crash: u64,
    /// Losses the counters report (dropped writes, dropped disk segments, unreadable
    /// objects), plus the close allowance.
    pub(crate) counted_losses: u64,
    /// Missing keys neither a crash nor the counters explain.
    pub(crate) unaccounted_keys: u64,
    /// Identity checks run, and the sum of the gating identities' differences.
    pub(crate) checks: u32,
    pub(crate) identity_off: u64,
    /// The largest difference of the identities that are reported only, and its name.
    pub(crate) info_off: Option<(&'static str, u64)>,
    /// Hits on a cleared key of a client's own namespace with no restart since the clear
    /// (the clear did not take it), and those after a restart (the disk tier finds cleared
    /// objects again when it restarts: documented).
    pub(crate) hits_after_clear: u64,
    pub(crate) resurrected: u64,
    pub(crate) problems: Vec<String>,
}

impl ArmResult {
    /// Everything that makes the soak fail.
    pub(crate) fn unaccounted(&self) -> u64 {
        self.unaccounted_keys + self.identity_off + self.hits_after_clear
    }

    pub(crate) fn ok(&self) -> bool {
        self.counts.wrong_bytes == 0 && self.unaccounted() == 0 && self.problems.is_empty()
    }

    /// Lines saying what failed (empty when it passed).
    pub(crate) fn failures(&self) -> Vec<String> {
        let mut v = Vec::new();
        let c = &self.counts;
        if c.wrong_bytes > 0 {
            v.push(format!(
                "{}: {} wrong bytes in {} keys",
                self.name, c.wrong_bytes, c.wrong_keys
            ));
        }
        if self.unaccounted_keys > 0 {
            v.push(format!(
                "{}: {} missing keys unaccounted (no crash or counted loss explains them)",
                self.name, self.unaccounted_keys
            ));
        }
        if self.identity_off > 0 {
            v.push(format!(
                "{}: counter identities off by {} in total",
                self.name, self.identity_off
            ));
        }
        if self.hits_after_clear > 0 {
            v.push(format!(
                "{}: {} hits on keys a clear had removed",
                self.name, self.hits_after_clear
            ));
        }
        v.extend(self.problems.iter().cloned());
        v
    }

    pub(crate) fn to_json(&self, arm: &Arm) -> Value {
        let c = &self.counts;
        json!({
            "arm": self.name,
            "ok": self.ok(),
            "operations": c.store_ops + c.load_ops + c.lookup_ops,
            "counts": c.json(),
            "gb_moved": (c.bytes_stored + c.bytes_loaded) as f64 / 1e9,
            "wrong_keys": c.wrong_keys,
            "wrong_bytes": c.wrong_bytes,
            "lost_after_hit": c.lost_after_hit,
            "failed_restart": c.failed_restart,
            "failed_other": c.failed_other,
            "unaccounted": self.unaccounted(),
            "unaccounted_keys": self.unaccounted_keys,
            "identity_checks": self.checks,
            "identity_off": self.identity_off,
            "identities_reported": arm.identities.iter().filter(|(_, i)| !i.gating).map(|(n, i)| json!({
                "check": n, "identity": i.name, "left": i.left as i64, "right": i.right as i64,
            })).collect::<Vec<_>>(),
            "hits_after_clear": self.hits_after_clear,
            "resurrected_after_restart": self.resurrected,
            "restarts": self.chaos.restarts,
            "kills": self.chaos.kills,
            "clears": self.chaos.clears,
            "cleared_objects": self.chaos.cleared_objects,
            "pool_processes": arm.lives().iter().map(|s| s.json()).collect::<Vec<_>>(),
            "pool_puts": self.puts,
            "pool_evictions": self.evictions,
            "audit_distinct_missing": self.missing,
            "lost_at_crash": self.lost_at_crash,
            "counted_losses": self.counted_losses,
            "close_allowance": self.chaos.close_allowance,
            "pool_process": arm.pool_series.to_json(),
            "client_processes": arm.client_series().iter().map(|(id, s)| {
                let mut v = s.to_json();
                v["client"] = json!(id);
                v
            }).collect::<Vec<_>>(),
            "problems": self.problems,
        })
    }
}

/// How the audit's findings are explained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Explained {
    pub(crate) lost_at_crash: u64,
    pub(crate) unaccounted_keys: u64,
    pub(crate) hits_after_clear: u64,
    pub(crate) resurrected: u64,
}

/// A missing key is lost at a crash when a SIGKILL came after the last time a client saw it
/// present; the other missing keys must be covered by `counted` losses. A hit after a clear
/// is a resurrection when a restart came between the clear and the hit.
pub(crate) fn explain(f: &AuditFindings, chaos: &Chaos, counted: u64) -> Explained {
    let crashed_after = |seen: u64| chaos.kill_times.iter().any(|k| *k > seen);
    let lost_at_crash = f.missing.values().filter(|s| crashed_after(**s)).count() as u64;
    let unexplained = f.missing.len() as u64 - lost_at_crash;
    let restarted_between = |a: u64, b: u64| chaos.restart_times.iter().any(|r| *r > a && *r < b);
    let resurrected = f
        .clear_hits
        .iter()
        .filter(|h| restarted_between(h.2, h.3))
        .count() as u64;
    Explained {
        lost_at_crash,
        unaccounted_keys: unexplained.saturating_sub(counted),
        hits_after_clear: f.clear_hits.len() as u64 - resurrected,
        resurrected,
    }
}

/// Judges a finished arm.
pub(crate) fn evaluate(arm: &Arm) -> ArmResult {
    let chaos = arm.chaos.clone();
    let summed = arm.summed();
    let counted_losses = summed.counted_losses() + chaos.close_allowance;
    let e = explain(&arm.audit, &chaos, counted_losses);
    let identity_off = arm
        .identities
        .iter()
        .filter(|(_, i)| i.gating)
        .map(|(_, i)| i.diff())
        .sum();
    let info_off = arm
        .identities
        .iter()
        .filter(|(_, i)| !i.gating)
        .map(|(_, i)| (i.name, i.diff()))
        .max_by_key(|x| x.1);
    ArmResult {
        name: arm.name,
        counts: arm.totals(),
        chaos,
        puts: summed.puts,
        evictions: summed.evictions,
        missing: arm.audit.missing.len() as u64,
        lost_at_crash: e.lost_at_crash,
        counted_losses,
        unaccounted_keys: e.unaccounted_keys,
        checks: arm.checks,
        identity_off,
        info_off,
        hits_after_clear: e.hits_after_clear,
        resurrected: e.resurrected,
        problems: arm.problems.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_keys_are_explained_by_a_later_crash_or_by_counted_losses() {
        let mut f = AuditFindings::default();
        // Two clients report key (0, 1): the later sighting (after the kill) counts.
        f.add(&json!({"missing": [[0, 1, 100], [1, 5, 100], [1, 6, 300]], "clear_hits": []}));
        f.add(&json!({"missing": [[0, 1, 250]], "clear_hits": []}));
        let chaos = Chaos {
            kill_times: vec![200],
            restart_times: vec![200],
            ..Chaos::default()
        };
        // (1, 5) was last seen before the kill; (0, 1) and (1, 6) after it.
        let e = explain(&f, &chaos, 0);
        assert_eq!((e.lost_at_crash, e.unaccounted_keys), (1, 2));
        assert_eq!(explain(&f, &chaos, 1).unaccounted_keys, 1);
        assert_eq!(explain(&f, &chaos, 5).unaccounted_keys, 0);
        // Without the kill nothing is lost at a crash.
        let e = explain(&f, &Chaos::default(), 0);
        assert_eq!((e.lost_at_crash, e.unaccounted_keys), (0, 3));
    }

    #[test]
    fn a_hit_after_a_clear_is_a_resurrection_only_across_a_restart() {
        let mut f = AuditFindings::default();
        f.add(&json!({"missing": [], "clear_hits": [[1, 2, 100, 150], [1, 3, 100, 300]]}));
        let chaos = Chaos {
            restart_times: vec![200],
            ..Chaos::default()
        };
        let e = explain(&f, &chaos, 0);
        assert_eq!((e.hits_after_clear, e.resurrected), (1, 1));
    }
}
