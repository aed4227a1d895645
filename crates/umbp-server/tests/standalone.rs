//! The standalone server with real processes: a server binary and client processes.

mod common;

use std::time::{Duration, Instant};

use common::*;
use umbp_core::KeyOutcome;

/// Child roles of these tests (run when `UMBP_TEST_ROLE` is set).
fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

#[test]
fn bytes_stored_by_one_client_process_load_exactly_in_another() {
    match role().as_deref() {
        Some("store") => {
            let c = client(&role_endpoint());
            let mut cache = cache(&c);
            cache.fill(7);
            let ids: Vec<u64> = (0..BLOCKS).collect();
            let t = c
                .store(cache.layout, 0, &ids, &keys("across", BLOCKS))
                .unwrap();
            assert!(t.wait(None).unwrap().iter().all(|s| *s == KeyOutcome::Done));
            // Every key done: the server's copy worker answered through the completion page.
            assert!(t.timing().unwrap().completion_page, "{:?}", t.timing());
            println!("stored");
            return;
        }
        Some("load") => {
            let c = client(&role_endpoint());
            let cache = cache(&c);
            // Loaded into other blocks than they were stored from: block i gets key i.
            let ids: Vec<u64> = (0..BLOCKS).collect();
            let t = c
                .load(cache.layout, 0, &ids, &keys("across", BLOCKS))
                .unwrap();
            assert!(t.wait(None).unwrap().iter().all(|s| *s == KeyOutcome::Done));
            cache.check(7, &ids);
            let missing = c.load(cache.layout, 0, &[0], &keys("never", 1)).unwrap();
            assert_eq!(missing.wait(None).unwrap(), vec![KeyOutcome::Missing]);
            // Not every key done: the page sends the caller to the reply.
            assert!(!missing.timing().unwrap().completion_page);
            println!("loaded");
            return;
        }
        Some(_) => return,
        None => {}
    }
    let dir = tmpdir("across");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let name = "bytes_stored_by_one_client_process_load_exactly_in_another";
    let mut a = spawn_role(name, "store", &server.endpoint, &[]);
    assert!(a.wait().unwrap().success(), "{}", server.log_text());
    let mut b = spawn_role(name, "load", &server.endpoint, &[]);
    assert!(b.wait().unwrap().success(), "{}", server.log_text());
    let s = stats_settled(&server.endpoint, 0);
    assert_eq!(s.objects, BLOCKS);
    // Every transfer came on the clients' transfer channels, none over gRPC.
    assert_eq!((s.channel_transfers, s.stores + s.loads), (3, 3), "{s:?}");
    let t = Instant::now();
    let mut open = s.transfer_channels;
    while open != 0 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
        open = stats(&server.endpoint).transfer_channels;
    }
    assert_eq!(open, 0, "the channels end with their connections");
    assert_eq!(
        (s.sessions, s.registrations, s.layouts),
        (0, 0, 0),
        "clients exited: {s:?}"
    );
    assert!(server.stop().success());
    assert!(!dir.join("s.sock").exists() && !dir.join("s.sock.fds").exists());
}

#[test]
fn a_client_killed_mid_transfer_leaves_nothing_behind_within_a_second() {
    match role().as_deref() {
        Some("loop") => {
            let c = client(&role_endpoint());
            let mut cache = cache(&c);
            cache.fill(3);
            let ids: Vec<u64> = (0..BLOCKS).collect();
            println!("ready");
            for round in 0u64.. {
                let k = keys(&format!("loop{round}"), BLOCKS);
                let _ = c.store(cache.layout, 0, &ids, &k).unwrap().wait(None);
                let _ = c.load(cache.layout, 0, &ids, &k).unwrap().wait(None);
            }
            return;
        }
        Some("steady") => {
            let c = client(&role_endpoint());
            let mut cache = cache(&c);
            cache.fill(9);
            let ids: Vec<u64> = (0..BLOCKS).collect();
            println!("ready");
            // Until the parent says stop (it creates the file), so it runs across the kill.
            let stop = std::path::PathBuf::from(std::env::var("UMBP_TEST_STOP").unwrap());
            for round in 0u64.. {
                if stop.exists() && round > 0 {
                    break;
                }
                let k = keys(&format!("steady{round}"), BLOCKS);
                let st = c
                    .store(cache.layout, 0, &ids, &k)
                    .unwrap()
                    .wait(None)
                    .unwrap();
                assert!(st.iter().all(KeyOutcome::is_ok), "{st:?}");
                let ld = c
                    .load(cache.layout, 0, &ids, &k)
                    .unwrap()
                    .wait(None)
                    .unwrap();
                assert!(
                    ld.iter()
                        .all(|s| *s == KeyOutcome::Done || *s == KeyOutcome::Missing),
                    "{ld:?}"
                );
            }
            cache.check(9, &ids);
            println!("steady done");
            return;
        }
        Some(_) => return,
        None => {}
    }
    let dir = tmpdir("kill");
    // The channels' readers busy-poll here (the other tests block on the socket): a kill
    // ends a watching reader as it ends a blocked one, and the steady client's bytes are
    // exact through it.
    let server = Server::start(&dir.join("s.sock"), &["--busy-poll-us", "200"]);
    let name = "a_client_killed_mid_transfer_leaves_nothing_behind_within_a_second";
    let mut victim = spawn_role(name, "loop", &server.endpoint, &[]);
    wait_line(&mut victim, "ready");
    let stop = dir.join("stop");
    let mut steady = spawn_role(
        name,
        "steady",
        &server.endpoint,
        &[("UMBP_TEST_STOP", stop.display().to_string())],
    );
    wait_line(&mut steady, "ready");
    std::thread::sleep(Duration::from_millis(300));
    let before = stats(&server.endpoint);
    assert_eq!(before.sessions, 2, "{before:?}");
    victim.kill().unwrap();
    let killed = Instant::now();
    let _ = victim.wait();
    // Only the steady client's own registration and layout may remain.
    let clean = loop {
        let s = stats(&server.endpoint);
        if s.sessions == 1 && s.registrations == 1 && s.layouts == 1 && s.pending_descriptors == 0 {
            break s;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(1),
            "not released within 1 s: {s:?}\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    println!("released {:?} after SIGKILL: {clean:?}", killed.elapsed());
    std::fs::write(&stop, b"").unwrap();
    assert!(
        steady.wait().unwrap().success(),
        "the other client's transfers failed\n{}",
        server.log_text()
    );
    // The steady client exited too: its release may still be running for a moment.
    let t = Instant::now();
    let mut s = stats(&server.endpoint);
    while (s.sessions != 0 || s.transfers_in_flight != 0) && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(5));
        s = stats(&server.endpoint);
    }
    assert_eq!(
        (
            s.sessions,
            s.registrations,
            s.layouts,
            s.reservations,
            s.pinned,
            s.transfers_in_flight
        ),
        (0, 0, 0, 0, 0, 0),
        "{s:?}"
    );
    assert!(
        server.log_text().contains("ConnectionClosed")
            || server.log_text().contains("ProcessExited")
    );
    assert!(server.stop().success());
}

#[test]
fn a_client_re_attaches_by_itself_after_the_server_restarts() {
    let dir = tmpdir("restart");
    let sock = dir.join("s.sock");
    let server = Server::start(&sock, &[]);
    let c = client(&server.endpoint);
    let mut cache = cache(&c);
    cache.fill(1);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    assert!(c
        .store(cache.layout, 0, &ids, &keys("before", BLOCKS))
        .unwrap()
        .wait(None)
        .unwrap()
        .iter()
        .all(KeyOutcome::is_ok));
    let (_, boot1) = c.session().unwrap();
    // A crash: the socket files stay behind and must be found stale and replaced.
    server.kill();
    assert!(sock.exists());
    let server = Server::start(&sock, &[]);
    assert!(server.log_text().contains("stale socket"));
    // The first call fails cleanly, unless the client already saw the session go: the store
    // above was answered through the completion page, and its reply, still on the way when
    // the server died, failed; the call then attaches first.
    let first = answered(c.store(cache.layout, 0, &ids, &keys("after", BLOCKS)));
    let mut ok = match first {
        // Told by its kind (session_lost, or unavailable while the connection broke).
        Err((kind, e)) => {
            assert!(kind.is_disconnect(), "{e} ({kind})");
            None
        }
        Ok(s) => {
            assert_eq!(c.attach_count(), 2, "succeeded on the old session: {s:?}");
            Some(s)
        }
    };
    // ...then the client attaches again and re-registers by itself.
    for _ in 0..50 {
        if ok.is_some() {
            break;
        }
        match answered(c.store(cache.layout, 0, &ids, &keys("after", BLOCKS))) {
            Ok(s) => ok = Some(s),
            Err((kind, e)) => {
                assert!(kind.is_disconnect(), "{e} ({kind})");
                std::thread::sleep(Duration::from_millis(50))
            }
        }
    }
    assert!(ok
        .expect("never re-attached")
        .iter()
        .all(|s| *s == KeyOutcome::Done));
    assert_eq!(c.attach_count(), 2);
    let (_, boot2) = c.session().unwrap();
    assert_ne!(boot1, boot2);
    // Objects of the old server are gone; one stored after the restart restores exactly.
    let gone = c
        .load(cache.layout, 0, &[0], &keys("before", 1))
        .unwrap()
        .wait(None)
        .unwrap();
    assert_eq!(gone, vec![KeyOutcome::Missing]);
    cache.buf.fill(0);
    let back = c
        .load(cache.layout, 0, &ids, &keys("after", BLOCKS))
        .unwrap();
    assert!(back
        .wait(None)
        .unwrap()
        .iter()
        .all(|s| *s == KeyOutcome::Done));
    cache.check(1, &ids);
    // The completion page was registered with the new server too, and a transfer channel
    // opened.
    assert!(back.timing().unwrap().completion_page);
    let s = stats(&server.endpoint);
    assert!(
        s.channel_transfers >= 2 && s.transfer_channels == 1,
        "{s:?}"
    );
    c.close();
    assert!(server.stop().success());
}

#[test]
fn a_live_server_is_never_replaced() {
    let dir = tmpdir("live");
    let sock = dir.join("s.sock");
    let server = Server::start(&sock, &[]);
    let out = std::process::Command::new(server_bin())
        .args([
            "--address",
            sock.to_str().unwrap(),
            "--capacity",
            "16MiB",
            "--prefault",
            "false",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already listens"));
    stats(&server.endpoint);
    // A file that is not a socket is never removed either.
    let plain = dir.join("plain");
    std::fs::write(&plain, b"x").unwrap();
    let out = std::process::Command::new(server_bin())
        .args([
            "--address",
            plain.to_str().unwrap(),
            "--capacity",
            "16MiB",
            "--prefault",
            "false",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a socket"));
    assert!(plain.exists());
    assert!(server.stop().success());
}

#[test]
fn prometheus_metrics_are_served_on_loopback_only_when_asked() {
    use std::io::{Read, Write};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tmpdir("metrics");
    let addr = format!("127.0.0.1:{port}");
    let server = Server::start(&dir.join("s.sock"), &["--metrics-address", &addr]);
    let c = client(&server.endpoint);
    let mut cache = cache(&c);
    cache.fill(2);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    c.store(cache.layout, 0, &ids, &keys("metrics", BLOCKS))
        .unwrap()
        .wait(None)
        .unwrap();
    c.exists(&keys("metrics", BLOCKS)).unwrap();
    let get = |path: &str| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
            .unwrap();
        let mut r = String::new();
        s.read_to_string(&mut r).unwrap();
        r
    };
    // The client's wait may return (through the completion page) a moment before the server
    // counts the transfer.
    let t = Instant::now();
    let mut m = get("/metrics");
    while !m.contains("umbp_transfer_seconds_count{direction=\"store\"} 1")
        && t.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(10));
        m = get("/metrics");
    }
    assert!(m.starts_with("HTTP/1.1 200"), "{m}");
    for needle in [
        "umbp_sessions 1",
        "umbp_registrations 1",
        &format!("umbp_pool_objects {BLOCKS}"),
        "umbp_transfers_total{direction=\"store\"} 1",
        &format!(
            "umbp_transfer_bytes_total{{direction=\"store\"}} {}",
            BLOCKS * BLOCK
        ),
        "umbp_transfer_seconds_count{direction=\"store\"} 1",
        "umbp_lookup_seconds_bucket",
        "umbp_pool_evictions_total 0",
        "umbp_pool_admissions_skipped_total 0",
        "umbp_pool_admissions_forced_total 0",
        "umbp_pool_ghost_hits_total 0",
    ] {
        assert!(m.contains(needle), "{needle} missing in\n{m}");
    }
    assert!(get("/other").starts_with("HTTP/1.1 404"));
    drop(c);
    assert!(server.stop().success());
    // A non-loopback address needs --metrics-allow-remote.
    let out = std::process::Command::new(server_bin())
        .args([
            "--address",
            dir.join("t.sock").to_str().unwrap(),
            "--capacity",
            "16MiB",
            "--prefault",
            "false",
            "--metrics-address",
            "0.0.0.0:9",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-allow-remote"));
    assert!(
        !dir.join("t.sock").exists(),
        "a failed start leaves no socket"
    );
}

#[test]
fn a_session_ends_when_its_process_exits_even_if_a_forked_child_keeps_the_connection() {
    if role().as_deref() == Some("forker") {
        let c = client(&role_endpoint());
        let _cache = cache(&c);
        println!("registered");
        // SAFETY: the child only sleeps and exits (async-signal-safe calls only).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                libc::sleep(5);
                libc::_exit(0);
            }
        }
        // The parent exits at once; the child still holds the connection's socket.
        // SAFETY: _exit ends the process without running destructors (which would detach).
        unsafe { libc::_exit(0) };
    }
    let dir = tmpdir("forker");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let name = "a_session_ends_when_its_process_exits_even_if_a_forked_child_keeps_the_connection";
    let mut p = spawn_role(name, "forker", &server.endpoint, &[]);
    wait_line(&mut p, "registered");
    let _ = p.wait();
    let t = Instant::now();
    loop {
        let s = stats(&server.endpoint);
        if s.sessions == 0 && s.registrations == 0 {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "the session outlived its process: {s:?}\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        server.log_text().contains("ProcessExited"),
        "{}",
        server.log_text()
    );
    assert!(server.stop().success());
}

#[test]
fn sigterm_stops_the_server_cleanly_under_load_and_clear_works_by_namespace() {
    let dir = tmpdir("term");
    let sock = dir.join("s.sock");
    let server = Server::start(&sock, &["--shutdown-grace-ms", "2000"]);
    let c = client(&server.endpoint);
    let mut cache = cache(&c);
    cache.fill(4);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    c.store(cache.layout, 0, &ids, &keys("ns-a", BLOCKS))
        .unwrap()
        .wait(None)
        .unwrap();
    c.store(cache.layout, 0, &ids, &keys("ns-b", BLOCKS))
        .unwrap()
        .wait(None)
        .unwrap();
    assert_eq!(c.clear(Some("test-ns-a")).unwrap(), BLOCKS);
    assert_eq!(
        c.exists(&keys("ns-a", BLOCKS)).unwrap(),
        vec![false; BLOCKS as usize]
    );
    assert_eq!(
        c.exists(&keys("ns-b", BLOCKS)).unwrap(),
        vec![true; BLOCKS as usize]
    );
    assert_eq!(c.clear(None).unwrap(), BLOCKS);
    // Transfers keep coming from another thread while the server is told to stop.
    let c2 = c.clone();
    let layout = cache.layout;
    let worker = std::thread::spawn(move || {
        let (mut ok, mut failed) = (0, 0);
        for round in 0..100_000u64 {
            match answered(c2.store(layout, 0, &ids, &keys(&format!("t{round}"), BLOCKS))) {
                Ok(_) => ok += 1,
                Err(_) => {
                    failed += 1;
                    if failed > 20 {
                        break;
                    }
                }
            }
        }
        (ok, failed)
    });
    std::thread::sleep(Duration::from_millis(300));
    let t = Instant::now();
    let st = server.stop();
    assert!(st.success(), "exit status {st:?}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "stopping took {:?}",
        t.elapsed()
    );
    assert!(
        !sock.exists() && !dir.join("s.sock.fds").exists(),
        "sockets left behind"
    );
    let (ok, failed) = worker.join().unwrap();
    assert!(ok > 0 && failed > 0, "ok {ok} failed {failed}");
}

#[test]
fn a_store_admitted_now_is_kept_on_first_sighting_under_on_reuse() {
    use std::io::{Read, Write};
    use umbp_core::Admit;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let dir = tmpdir("admit-now");
    let server = Server::start(
        &dir.join("s.sock"),
        &["--store-admission", "on_reuse", "--metrics-address", &addr],
    );
    let c = client(&server.endpoint);
    let mut cache = cache(&c);
    cache.fill(3);
    let ids = [0, 1, 2, 3];
    let policy = answered(c.store(cache.layout, 0, &ids, &keys("policy", 4)));
    assert_eq!(policy.unwrap(), vec![KeyOutcome::Skipped; 4]);
    let now = answered(c.store_as(cache.layout, 0, &ids, &keys("now", 4), Admit::Now));
    assert_eq!(now.unwrap(), vec![KeyOutcome::Done; 4]);
    assert_eq!(stats(&server.endpoint).objects, 4);
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut m = String::new();
    s.read_to_string(&mut m).unwrap();
    assert!(m.contains("umbp_pool_admissions_forced_total 4"), "{m}");
    assert!(m.contains("umbp_pool_admissions_skipped_total 4"), "{m}");
    // A load that asks for admission is refused by name.
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let e = rt
        .block_on(g.transfer(umbp_proto::v1::TransferRequest {
            session_id: me.session_id,
            direction: umbp_proto::v1::Direction::Load as i32,
            block_ids: vec![0],
            keys: keys("now", 1)[0].as_bytes().to_vec(),
            admit_now: true,
            ..Default::default()
        }))
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("stores only"), "{e:?}");
    drop(c);
    assert!(server.stop().success());
}
