//! `umbp ping|stats|clear` and `umbp bench lookup|server` against real server processes.
//!
//! The server binary is `UMBP_SERVER_BIN` when set, else `umbp_standalone_server` next to the
//! `umbp` binary under test (cargo builds it there with the workspace); without one the tests
//! that need it print SKIP.

use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn umbp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(args)
        .env_remove("UMBP_STANDALONE_ADDRESS")
        .output()
        .expect("run umbp")
}

fn server_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("UMBP_SERVER_BIN") {
        return Some(p.into());
    }
    let p = PathBuf::from(env!("CARGO_BIN_EXE_umbp")).with_file_name("umbp_standalone_server");
    p.is_file().then_some(p)
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn ping_of_an_absent_server_fails_and_names_the_fix() {
    let out = umbp(&["ping", "--endpoint", "/nonexistent-umbp/x.sock"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("no socket at /nonexistent-umbp/x.sock"),
        "{err}"
    );
    assert!(err.contains("UMBP_STANDALONE_ADDRESS"), "{err}");
    let out = umbp(&["stats", "--endpoint", "tcp://1.2.3.4:5"]);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("--endpoint"), "{err}");
}

#[test]
fn bench_server_cuda_without_a_gpu_skips() {
    let out = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(["bench", "server", "--cuda", "--json"])
        .env("UMBP_LIBCUDA", "/nonexistent/libcuda.so.1")
        .output()
        .expect("run umbp");
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(stdout.starts_with("SKIP"), "{stdout}");
    let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(last["skipped"], true);
}

#[test]
fn operations_against_a_running_server() {
    let Some(bin) = server_bin() else {
        eprintln!("SKIP: no umbp_standalone_server (set UMBP_SERVER_BIN)");
        return;
    };
    let dir = std::env::temp_dir().join(format!("umbp-cli-ops-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s.sock");
    let mut server = Command::new(&bin)
        .args([
            "--capacity",
            "64MiB",
            "--prefault",
            "false",
            "--workers",
            "1",
        ])
        .arg("--address")
        .arg(&sock)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let ep = sock.display().to_string();
    let t0 = Instant::now();
    while umbp(&["ping", "--endpoint", &ep]).status.code() != Some(0) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the server did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = umbp(&["ping", "--endpoint", &ep]);
    let s = text(&out.stdout);
    assert!(
        s.contains("boot id") && s.contains("version") && s.contains("uptime"),
        "{s}"
    );
    let out = umbp(&["stats", "--endpoint", &ep, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["capacity_bytes"], 64u64 << 20);
    assert_eq!(v["sessions"], 0, "stats attaches no session");
    let out = umbp(&["stats", "--endpoint", &ep]);
    assert!(text(&out.stdout).contains("64.00 MiB"));
    let out = Command::new(env!("CARGO_BIN_EXE_umbp"))
        .args(["clear", "--namespace", "nobody"])
        .env("UMBP_STANDALONE_ADDRESS", &ep)
        .output()
        .unwrap();
    assert!(
        text(&out.stdout).contains("removed 0 objects of namespace \"nobody\""),
        "{}",
        text(&out.stderr)
    );
    // SAFETY: signalling the server this test started and has not reaped.
    unsafe { libc::kill(server.id() as libc::pid_t, libc::SIGTERM) };
    assert!(server.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn benches_start_a_private_server_and_report() {
    let Some(bin) = server_bin() else {
        eprintln!("SKIP: no umbp_standalone_server (set UMBP_SERVER_BIN)");
        return;
    };
    let bin = bin.display().to_string();
    let out = umbp(&[
        "bench",
        "lookup",
        "--keys",
        "512",
        "--iters",
        "20",
        "--warmup",
        "2",
        "--json",
        "--server-bin",
        &bin,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(s.lines().last().unwrap()).unwrap();
    assert_eq!(v["bench"], "lookup");
    assert!(v["exists"]["p99_us"].as_f64().unwrap() > 0.0);
    assert!(v["exists_across_ranks_prefix"]["p50_us"].as_f64().is_some());
    let out = umbp(&[
        "bench",
        "server",
        "--clients",
        "1,2",
        "--blocks",
        "8",
        "--layers",
        "2",
        "--rounds",
        "1",
        "--block-kib",
        "16",
        "--json",
        "--server-bin",
        &bin,
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let s = text(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(s.lines().last().unwrap()).unwrap();
    assert_eq!(v["bench"], "server");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        for k in ["server_store_gbps", "embedded_load_gbps", "ceiling_gbps"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k} in {r}");
        }
    }
    assert!(s.contains("server/ceiling"), "{s}");
}
