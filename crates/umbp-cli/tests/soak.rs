//! `umbp soak` against a real server process (and an embedded store): a short run with a
//! clean restart and a SIGKILL finds nothing wrong and nothing unaccounted; a run whose client
//! flips one loaded byte fails, and so does one whose objects vanish uncounted.
//!
//! The server binary is `UMBP_SERVER_BIN` when set, else `umbp_standalone_server` next to the
//! `umbp` binary under test (cargo builds it there with the workspace); without one the tests
//! print SKIP.

use std::path::PathBuf;
use std::process::{Command, Output};

fn server_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UMBP_SERVER_BIN") {
        return Some(p.into());
    }
    let p = PathBuf::from(env!("CARGO_BIN_EXE_umbp")).with_file_name("umbp_standalone_server");
    p.is_file().then_some(p)
}

/// Runs `umbp soak` with a small pool, disk and key space and the given flags.
fn soak(bin: &std::path::Path, flags: &[&str]) -> (Output, serde_json::Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .arg("soak")
        .arg("--server-bin")
        .arg(bin)
        .args([
            "--pool-mib",
            "16",
            "--disk-mib",
            "256",
            "--layers",
            "4",
            "--piece-kib",
            "16",
            "--slots",
            "8",
            "--max-batch",
            "8",
            "--private-keys",
            "128",
            "--shared-keys",
            "256",
            "--sample-every",
            "1s",
            "--progress-every",
            "5s",
            "--json",
        ])
        .args(flags)
        .env_remove("UMBP_STANDALONE_ADDRESS")
        .output()
        .expect("run umbp soak");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let last = stdout.lines().last().unwrap_or_default();
    let v = serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "the last line is not JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, v)
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn a_short_soak_with_restarts_and_clears_finds_nothing_wrong() {
    let Some(bin) = server_bin() else {
        eprintln!("SKIP: no umbp_standalone_server (set UMBP_SERVER_BIN)");
        return;
    };
    // 2 clients per arm for 16 s: a SIGTERM restart at 6 s and a SIGKILL at 12 s of the
    // server (clean restarts of the embedded store), clears every 4 s. The keys' blocks
    // (512 of 64 KiB) are twice the pool, so it evicts to disk.
    let (out, v) = soak(
        &bin,
        &[
            "--mode",
            "both",
            "--duration",
            "16s",
            "--clients",
            "2",
            "--restart-every",
            "6s",
            "--kill-every",
            "2",
            "--clear-every",
            "4s",
            "--check-every",
            "5s",
        ],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert_eq!(v["ok"], true, "{all}");
    assert_eq!(v["wrong_bytes"], 0, "{all}");
    assert_eq!(v["unaccounted"], 0, "{all}");
    let arms = v["arms"].as_array().unwrap();
    assert_eq!(arms.len(), 2);
    for arm in arms {
        let c = &arm["counts"];
        // Work was done and checked: loads, lookup hits and an audit of every key kept.
        assert!(c["keys_loaded"].as_u64().unwrap() > 0, "{arm}");
        assert!(c["lookup_hits"].as_u64().unwrap() > 0, "{arm}");
        assert!(c["audit_present"].as_u64().unwrap() > 0, "{arm}");
        assert!(arm["restarts"].as_u64().unwrap() >= 1, "{arm}");
        assert!(arm["clears"].as_u64().unwrap() >= 1, "{arm}");
        assert!(arm["identity_checks"].as_u64().unwrap() >= 2, "{arm}");
        assert!(arm["pool_evictions"].as_u64().unwrap() > 0, "{arm}");
        assert!(
            arm["pool_process"]["samples"].as_u64().unwrap() > 0,
            "{arm}"
        );
    }
    let server = &arms[0];
    assert_eq!(server["arm"], "server");
    assert_eq!(server["kills"], 1, "{server}");
    assert_eq!(server["client_processes"].as_array().unwrap().len(), 2);
    // The summary names every figure a reader needs.
    let stdout = String::from_utf8_lossy(&out.stdout);
    for label in [
        "WRONG keys / bytes",
        "UNACCOUNTED keys",
        "lost after hit",
        "verdict: OK",
    ] {
        assert!(stdout.contains(label), "{label:?} missing from\n{stdout}");
    }
}

#[test]
fn a_flipped_byte_fails_the_soak() {
    let Some(bin) = server_bin() else {
        eprintln!("SKIP: no umbp_standalone_server (set UMBP_SERVER_BIN)");
        return;
    };
    let (out, v) = soak(
        &bin,
        &[
            "--inject-wrong",
            "--duration",
            "6s",
            "--clients",
            "1",
            "--restart-every",
            "0",
            "--clear-every",
            "0",
        ],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert_eq!(v["ok"], false, "{all}");
    // Exactly the one byte the client flipped, in one key.
    assert_eq!(v["wrong_bytes"], 1, "{all}");
    assert_eq!(v["arms"][0]["wrong_keys"], 1, "{all}");
    assert!(all.contains("verdict: FAILED"), "{all}");
    assert!(all.contains("1 wrong bytes in 1 keys"), "{all}");
}

#[test]
fn objects_removed_behind_the_clients_backs_fail_the_soak() {
    let Some(bin) = server_bin() else {
        eprintln!("SKIP: no umbp_standalone_server (set UMBP_SERVER_BIN)");
        return;
    };
    // Before the audit the parent clears the shared namespace without counting it: the keys
    // the clients saw there are missing with nothing to explain them, and the pool's objects
    // no longer equal puts - evictions - removed.
    let (out, v) = soak(
        &bin,
        &[
            "--inject-loss",
            "--duration",
            "5s",
            "--clients",
            "1",
            "--restart-every",
            "0",
            "--clear-every",
            "0",
        ],
    );
    let all = text(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert_eq!(v["wrong_bytes"], 0, "{all}");
    let arm = &v["arms"][0];
    assert!(arm["unaccounted_keys"].as_u64().unwrap() > 0, "{all}");
    assert!(arm["identity_off"].as_u64().unwrap() > 0, "{all}");
    assert!(all.contains("missing keys unaccounted"), "{all}");
}
