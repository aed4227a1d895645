//! The scheduler's client trusts no one it has not checked: a server of another user gets
//! nothing, and an answer beyond what was asked is a miss.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use umbp_lookup::LookupClient;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("umbp-trust-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn hashes(n: usize) -> Vec<u8> {
    (0..n as u32)
        .flat_map(|i| [i.to_le_bytes(); 4].concat())
        .collect()
}

/// A same-user server that answers every frame with `answer` (code 0).
fn liar(path: &Path, answer: Vec<u8>) {
    let l = UnixListener::bind(path).unwrap();
    std::thread::spawn(move || {
        for c in l.incoming() {
            let Ok(mut c) = c else { return };
            let answer = answer.clone();
            std::thread::spawn(move || loop {
                let mut h = [0u8; 12];
                if c.read_exact(&mut h).is_err() {
                    return;
                }
                let n = u32::from_le_bytes(h[8..12].try_into().unwrap()) as usize;
                let mut body = vec![0u8; n];
                if c.read_exact(&mut body).is_err() {
                    return;
                }
                let mut rep = b"UMBR\0\0\0\0".to_vec();
                rep.extend_from_slice(&(answer.len() as u32).to_le_bytes());
                rep.extend_from_slice(&answer);
                if c.write_all(&rep).is_err() {
                    return;
                }
            });
        }
    });
}

#[test]
fn an_answer_of_more_hits_than_asked_is_a_miss() {
    let d = scratch("liar");
    let p = d.join("w0.sock");
    liar(&p, 1_000_000u32.to_le_bytes().to_vec());
    let c = LookupClient::new(vec![p], Duration::from_secs(5));
    // 4 hashes through the socket, 2,000 through the shared buffer: both answers are lies.
    assert_eq!(c.prefix_hits(0, &hashes(4), 16), 0);
    assert_eq!(c.prefix_hits(0, &hashes(2000), 16), 0);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn an_exists_answer_of_other_values_than_0_and_1_is_a_miss() {
    let d = scratch("liar-exists");
    let p = d.join("w0.sock");
    liar(&p, vec![7, 7, 7, 7]);
    let c = LookupClient::new(vec![p], Duration::from_secs(5));
    assert_eq!(c.exists_all(0, &hashes(4), 16), vec![false; 4]);
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn no_workers_hold_nothing() {
    let c = LookupClient::new(vec![], Duration::from_secs(1));
    assert_eq!(c.exists_all(0, &hashes(3), 16), vec![false; 3]);
    assert_eq!(c.prefix_hits(0, &hashes(3), 16), 0);
}

struct Squatter(Child);

impl Drop for Squatter {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for_lines(report: &Path, pred: impl Fn(&[String]) -> bool) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let lines: Vec<String> = std::fs::read_to_string(report)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        if pred(&lines) || Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_server_of_another_user_gets_no_request_and_no_buffer() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("skipped: needs root and setpriv to run a server as another uid");
        return;
    }
    let d = scratch("squat");
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let sock = d.join("w0.sock");
    let report = d.join("report");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/python/squatter.py"
    );
    let _squatter = Squatter(
        Command::new("/usr/bin/setpriv")
            .args(["--reuid=12345", "--regid=12345", "--clear-groups"])
            .arg("/usr/bin/python3")
            .arg(script)
            .arg(&sock)
            .arg(&report)
            .spawn()
            .unwrap(),
    );
    let lines = wait_for_lines(&report, |l| l.iter().any(|x| x == "ready"));
    assert!(
        lines.iter().any(|x| x == "ready"),
        "squatter did not start: {lines:?}"
    );
    let c = LookupClient::new(vec![sock], Duration::from_secs(5));
    assert_eq!(c.prefix_hits(0, &hashes(4), 16), 0, "small request");
    assert_eq!(
        c.prefix_hits(0, &hashes(2000), 16),
        0,
        "shared-buffer request"
    );
    assert_eq!(c.exists_all(0, &hashes(4), 16), vec![false; 4]);
    assert!(c.wait_ready(Duration::from_millis(300)).is_err());
    drop(c);
    let lines = wait_for_lines(&report, |l| {
        l.iter().filter(|x| x.starts_with("conn")).count() >= 3
    });
    let conns: Vec<&String> = lines.iter().filter(|x| x.starts_with("conn")).collect();
    assert!(conns.len() >= 3, "{lines:?}");
    for l in conns {
        assert_eq!(
            l, "conn 0 0",
            "the squatter got bytes or a descriptor: {lines:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}
