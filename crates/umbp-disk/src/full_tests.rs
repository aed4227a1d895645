//! A file system that fills up while the tier runs: a small tmpfs mounted for the test (root
//! only; where mounting is refused the test says so and passes without running), filled by
//! another file once the tier is writing. Segments are preallocated, so the tier notices when
//! it needs a new one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use umbp_core::BlockKey;

use crate::tests::{data, keeper, key, tmpdir};
use crate::{DiskConfig, DiskError, DiskTier, Queued};

/// A tmpfs of `bytes` mounted on a fresh directory, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(tag: &str, bytes: u64) -> Result<Tmpfs, String> {
        let dir = tmpdir(tag);
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            let _ = std::fs::remove_dir(&dir);
            return Err(format!(
                "mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes `path` until the file system is full; the bytes it took.
fn fill(path: &Path) -> u64 {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0x5a_u8; 64 << 10];
    let mut n = 0;
    while f.write_all(&chunk).is_ok() {
        n += chunk.len() as u64;
    }
    let _ = f.flush();
    n
}

#[test]
fn a_file_system_that_fills_up_while_running_drops_counted_writes_and_keeps_reads_exact() {
    let fs = match Tmpfs::mount("full", 40 << 20) {
        Ok(fs) => fs,
        Err(why) => {
            eprintln!("SKIPPED: no file system to fill ({why}); run as root to test this");
            return;
        }
    };
    let dir = fs.0.join("tier");
    let mut cfg = DiskConfig::new(&dir, 24 << 20);
    cfg.segment_bytes = 4 << 20;
    cfg.io_threads = 2;
    let t = DiskTier::open(cfg).unwrap();
    // tmpfs takes O_DIRECT since Linux 6.6 and the tier falls back to buffered I/O on older kernels:
    // either way the segments are preallocated.
    let len = |n: u32| (200 << 10) + n as usize * 512;
    // Written while there is room: two segments' worth.
    let before: Vec<u32> = (0..30).collect();
    for &n in &before {
        assert_eq!(t.enqueue(key(n), Box::new(data(n, len(n)))), Queued::Queued);
    }
    assert!(t.flush(Duration::from_secs(30)));
    assert_eq!(t.stats().writes, 30);
    // Something else fills the file system.
    let filler = fs.0.join("filler");
    let filled = fill(&filler);
    assert!(filled > 0);
    // Write-behind goes on: what fits in the segment being filled is written, then no new
    // segment can be made; every write after that fails, counted, without a crash.
    let after: Vec<u32> = (100..160).collect();
    for &n in &after {
        t.enqueue(key(n), Box::new(data(n, len(n))));
    }
    assert!(t.flush(Duration::from_secs(30)));
    let s = t.stats();
    eprintln!(
        "filler took {} KiB; then {} objects written, {} write errors, {} dropped",
        filled >> 10,
        s.writes,
        s.write_errors,
        s.writes_dropped
    );
    assert!(s.write_errors >= 1, "{s:?}");
    assert!(s.writes < 90, "{s:?}");
    assert_eq!(s.backlog_bytes, 0);
    // A direct write names the file and the cause.
    let e = t.write_now(&key(999), &data(999, len(999))).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, DiskError::Io { .. }), "{msg}");
    assert!(
        msg.contains("reserving space for") && msg.contains("No space left on device"),
        "{msg}"
    );
    // Every lookup answers: what is on disk comes back byte-exact, the rest are misses.
    let keys: Vec<BlockKey> = before.iter().chain(&after).map(|&n| key(n)).collect();
    let (sink, got) = keeper();
    let hit = t.promote_present(&keys, t.deadline(), sink);
    assert!(
        hit[..before.len()].iter().all(|h| *h),
        "what was written before"
    );
    for (n, bytes) in before
        .iter()
        .chain(&after)
        .filter_map(|&n| got.lock().get(&key(n)).map(|b| (n, b.clone())))
    {
        assert_eq!(bytes, data(n, len(n)), "object {n}");
    }
    let s = t.stats();
    assert_eq!(s.hits as usize, hit.iter().filter(|h| **h).count());
    assert_eq!(
        s.writes as usize, s.hits as usize,
        "every object written reads back"
    );
    assert_eq!((s.corrupt, s.read_errors), (0, 0), "{s:?}");
    // Room again: the tier makes a new segment and writes.
    std::fs::remove_file(&filler).unwrap();
    assert!(t.write_now(&key(999), &data(999, len(999))).unwrap());
    assert!(t.contains(&key(999)));
    t.close();
}
