//! Samples of a process's resident memory and open descriptors, from /proc, and their start,
//! maximum and end over the run (a server's across its restarts).

use serde_json::{json, Value};

/// One sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sample {
    pub(crate) rss_bytes: u64,
    pub(crate) fds: u64,
}

/// Process `pid`'s VmRSS and open descriptors now (None once it is gone).
pub(crate) fn sample(pid: u32) -> Option<Sample> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some(Sample {
        rss_bytes: rss_kib << 10,
        fds,
    })
}

/// The samples of one process (or of one role, such as the server, across restarts).
#[derive(Debug, Clone, Default)]
pub(crate) struct Series {
    pub(crate) first: Option<Sample>,
    pub(crate) last: Option<Sample>,
    pub(crate) max_rss_bytes: u64,
    pub(crate) max_fds: u64,
    pub(crate) count: u64,
}

impl Series {
    pub(crate) fn add(&mut self, s: Sample) {
        self.first.get_or_insert(s);
        self.last = Some(s);
        self.max_rss_bytes = self.max_rss_bytes.max(s.rss_bytes);
        self.max_fds = self.max_fds.max(s.fds);
        self.count += 1;
    }

    /// Samples `pid` into the series (nothing when it is gone).
    pub(crate) fn take(&mut self, pid: Option<u32>) {
        if let Some(s) = pid.and_then(sample) {
            self.add(s);
        }
    }

    pub(crate) fn to_json(&self) -> Value {
        let f = |s: Option<Sample>| s.map(|s| (s.rss_bytes, s.fds));
        json!({
            "samples": self.count,
            "rss_start_bytes": f(self.first).map(|s| s.0),
            "rss_max_bytes": self.max_rss_bytes,
            "rss_end_bytes": f(self.last).map(|s| s.0),
            "fds_start": f(self.first).map(|s| s.1),
            "fds_max": self.max_fds,
            "fds_end": f(self.last).map(|s| s.1),
        })
    }

    /// `start/max/end` of RSS in MiB and of descriptors, for the summary.
    pub(crate) fn show(&self) -> (String, String) {
        match (self.first, self.last) {
            (Some(a), Some(b)) => (
                format!(
                    "{}/{}/{}",
                    a.rss_bytes >> 20,
                    self.max_rss_bytes >> 20,
                    b.rss_bytes >> 20
                ),
                format!("{}/{}/{}", a.fds, self.max_fds, b.fds),
            ),
            _ => ("-".into(), "-".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_samples_and_a_series_keeps_start_max_end() {
        let s = sample(std::process::id()).expect("our own /proc entry");
        assert!(s.rss_bytes > 0 && s.fds >= 3, "{s:?}");
        let mut v = Series::default();
        for (rss, fds) in [(10, 5), (30, 4), (20, 6)] {
            v.add(Sample {
                rss_bytes: rss << 20,
                fds,
            });
        }
        assert_eq!(v.show(), ("10/30/20".to_string(), "5/6/6".to_string()));
        assert_eq!(sample(u32::MAX), None);
    }
}
