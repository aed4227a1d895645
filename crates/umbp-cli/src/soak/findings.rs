//! What an arm's chaos and its clients' audits found, kept apart from the verdict
//! (`result`) so that the arm can gather them without depending on the verdict.

use std::collections::HashMap;

use serde_json::Value;

/// Restarts and clears an arm went through.
#[derive(Debug, Clone, Default)]
pub(crate) struct Chaos {
    pub(crate) restarts: u64,
    /// Of the restarts, SIGKILLs.
    pub(crate) kills: u64,
    /// When each restart (and each kill) began (monotonic ns).
    pub(crate) restart_times: Vec<u64>,
    pub(crate) kill_times: Vec<u64>,
    pub(crate) clears: u64,
    pub(crate) cleared_objects: u64,
    /// Missing keys explained by disk segments a clean stop may have dropped after the last
    /// counters were read (see `Arm::close_allowance`).
    pub(crate) close_allowance: u64,
}

/// The client processes' audits, merged: keys not found (with the latest time any client saw
/// them present) and hits after clears (key, clear's end, when seen).
#[derive(Debug, Clone, Default)]
pub(crate) struct AuditFindings {
    pub(crate) missing: HashMap<(u32, u32), u64>,
    pub(crate) clear_hits: Vec<(u32, u32, u64, u64)>,
}

impl AuditFindings {
    /// Adds one client process's `audit` answer.
    pub(crate) fn add(&mut self, v: &Value) {
        let n = |x: &Value| x.as_u64().unwrap_or(0);
        for m in v["missing"].as_array().into_iter().flatten() {
            let key = (n(&m[0]) as u32, n(&m[1]) as u32);
            let seen = self.missing.entry(key).or_insert(0);
            *seen = (*seen).max(n(&m[2]));
        }
        for h in v["clear_hits"].as_array().into_iter().flatten() {
            self.clear_hits
                .push((n(&h[0]) as u32, n(&h[1]) as u32, n(&h[2]), n(&h[3])));
        }
    }
}
