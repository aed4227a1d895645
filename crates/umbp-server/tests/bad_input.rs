//! Hostile and broken input: every bad request gets an error with a message, the server keeps
//! serving the others, and no memory is touched.

mod common;

use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::*;
use proptest::prelude::*;
use prost::Message;
use tonic::Code;
use umbp_proto::v1;

/// The kind (what clients decide on) and message of a refusal.
fn kind_and_message<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
) -> (umbp_core::ErrorKind, String) {
    let e = r.expect_err("the server accepted bad input");
    assert!(!e.message().is_empty(), "an error without a message: {e:?}");
    (
        umbp_proto::errors::kind_of_status(&e),
        e.message().to_string(),
    )
}

fn code_and_message<T: std::fmt::Debug>(
    r: Result<tonic::Response<T>, tonic::Status>,
) -> (Code, String) {
    let e = r.expect_err("the server accepted bad input");
    assert!(!e.message().is_empty(), "an error without a message: {e:?}");
    (e.code(), e.message().to_string())
}

#[test]
fn bad_requests_get_errors_with_messages_and_touch_nothing() {
    let dir = tmpdir("bad");
    let server = Server::start(&dir.join("s.sock"), &["--max-message-bytes", "1048576"]);
    // A victim client whose memory must never change.
    let victim = client(&server.endpoint);
    let mut vc = cache(&victim);
    vc.fill(5);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    assert!(vc.stores_all(&victim, &ids, "victim"));

    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let sid = me.session_id;

    // Unknown session, and the victim's session from another connection.
    let (c, m) = code_and_message(rt.block_on(g.register_layout(v1::RegisterLayoutRequest {
        session_id: 999_999,
        groups: vec![],
    })));
    assert_eq!(c, Code::FailedPrecondition, "{m}");
    assert!(m.contains("not attached"), "{m}");
    let (victim_sid, _) = victim.session().unwrap();
    let (c, m) = code_and_message(rt.block_on(g.transfer(v1::TransferRequest {
        session_id: victim_sid,
        layout_id: 0,
        direction: v1::Direction::Load as i32,
        ..Default::default()
    })));
    assert_eq!(
        c,
        Code::FailedPrecondition,
        "another connection's session: {m}"
    );

    // Layout ids of another session (the victim's are among the first few) are unknown here.
    for layout_id in 0..8 {
        let (c, m) = code_and_message(rt.block_on(g.transfer(v1::TransferRequest {
            session_id: sid,
            layout_id,
            direction: v1::Direction::Load as i32,
            block_ids: vec![0],
            keys: keys("victim", 1)[0].as_bytes().to_vec(),
            ..Default::default()
        })));
        assert_eq!(c, Code::NotFound, "layout {layout_id}: {m}");
    }

    // A layout in a region of another session, and one in no region at all.
    for region_id in 0..8 {
        let (c, m) = code_and_message(rt.block_on(g.register_layout(v1::RegisterLayoutRequest {
            session_id: sid,
            groups: vec![v1::LayoutGroup {
                runs: vec![v1::LayoutRun {
                    region_id,
                    offset: 0,
                    num_blocks: 4,
                    block_stride: 4096,
                    block_bytes: 4096,
                }],
            }],
        })));
        assert_eq!(c, Code::InvalidArgument, "{m}");
        assert!(
            m.contains("another session") || m.contains("not registered"),
            "{m}"
        );
    }

    // A range outside a registration of this very session.
    let own = client(&server.endpoint);
    let oc = cache(&own);
    let outside = own.register_layout(vec![vec![umbp_core::LayerSpec {
        base_addr: oc.buf.as_ptr() as u64,
        num_blocks: BLOCKS + 1,
        block_stride: BLOCK,
        block_bytes: BLOCK,
    }]]);
    assert!(format!("{}", outside.unwrap_err()).contains("lies in no memory"));

    // Unknown region, unknown descriptor ticket, bogus CUDA IPC handle, garbage VMM request.
    let (k, m) = kind_and_message(
        rt.block_on(g.deregister_memory(v1::DeregisterMemoryRequest {
            session_id: sid,
            region_id: 424_242,
        })),
    );
    // The kind the embedded store gives an unknown region too.
    assert_eq!(k, umbp_core::ErrorKind::Registration, "{m}");
    let (c, m) = code_and_message(rt.block_on(g.register_host_memory(
        v1::RegisterHostMemoryRequest {
            session_id: sid,
            ticket: 77,
            length: 4096,
        },
    )));
    assert_eq!(c, Code::NotFound, "{m}");
    assert!(m.contains("ticket"), "{m}");
    let (_, m) = code_and_message(rt.block_on(g.register_cuda_ipc(v1::RegisterCudaIpcRequest {
        session_id: sid,
        device: Some(v1::CudaDevice { uuid: vec![7; 16] }),
        handle: vec![0xab; 64],
        allocation_bytes: 1 << 20,
        offset: 0,
        length: 4096,
    })));
    assert!(m.contains("CUDA") || m.contains("device"), "{m}");
    let (c, m) = code_and_message(rt.block_on(g.register_cuda_ipc(v1::RegisterCudaIpcRequest {
        session_id: sid,
        handle: vec![1; 3],
        ..Default::default()
    })));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    let (c, m) = code_and_message(rt.block_on(g.register_cuda_vmm(v1::RegisterCudaVmmRequest {
        session_id: sid,
        device: Some(v1::CudaDevice { uuid: vec![1; 16] }),
        chunks: vec![v1::VmmChunk {
            ticket: 5,
            offset: 0,
            size: 2 << 20,
        }],
        offset: 0,
        length: 1,
    })));
    assert!(
        c == Code::NotFound || c == Code::FailedPrecondition,
        "{c:?} {m}"
    );

    // Completion pages: an unknown ticket; a slot named by a session without a page.
    let (c, m) = code_and_message(rt.block_on(g.register_completion_page(
        v1::RegisterCompletionPageRequest {
            session_id: sid,
            ticket: 78,
            length: 65536,
        },
    )));
    assert_eq!(c, Code::NotFound, "{m}");
    assert!(m.contains("ticket"), "{m}");
    let (c, m) = code_and_message(rt.block_on(g.transfer(v1::TransferRequest {
        session_id: sid,
        direction: v1::Direction::Store as i32,
        completion_slot: 1,
        ..Default::default()
    })));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("no completion page"), "{m}");

    // Malformed transfers and lookups.
    let (c, m) = code_and_message(rt.block_on(g.transfer(v1::TransferRequest {
        session_id: sid,
        keys: vec![1; 65],
        ..Default::default()
    })));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    let (c, m) = code_and_message(rt.block_on(g.transfer(v1::TransferRequest {
        session_id: sid,
        keys: vec![1; 64],
        block_ids: vec![1, 2],
        ..Default::default()
    })));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    let (c, m) = code_and_message(rt.block_on(g.exists(v1::ExistsRequest {
        keys: None,
        ..Default::default()
    })));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    let (c, m) = code_and_message(rt.block_on(g.exists(v1::ExistsRequest {
        keys: Some(v1::KeySet {
            namespace: "a:b".into(),
            hash_bytes: 8,
            hashes: vec![0; 16],
            ..Default::default()
        }),
        ranks: vec![v1::Ranks::default()],
        ..Default::default()
    })));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    let (k, m) = kind_and_message(rt.block_on(g.attach(v1::AttachRequest {
        client_name: "old".into(),
        protocol: 999,
    })));
    assert_eq!(k, umbp_core::ErrorKind::Denied, "{m}");

    // An oversized message is refused; the server goes on.
    let (c, m) = code_and_message(rt.block_on(g.exists(v1::ExistsRequest {
        keys: Some(v1::KeySet {
            packed: vec![0; 2 << 20],
            ..Default::default()
        }),
        ..Default::default()
    })));
    assert!(
        matches!(
            c,
            Code::ResourceExhausted | Code::OutOfRange | Code::Internal
        ),
        "{c:?} {m}"
    );

    // The victim's memory and objects are untouched; it still works.
    vc.check(5, &ids);
    vc.buf.fill(0);
    assert!(vc.loads_all(&victim, &ids, "victim"));
    vc.check(5, &ids);
    assert!(stats(&server.endpoint).objects >= BLOCKS);
    assert!(server.stop().success());
}

#[test]
fn the_descriptor_side_channel_refuses_garbage_and_strangers() {
    use std::io::{Read, Write};
    let dir = tmpdir("fds");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let fd_path = server.endpoint.fd_socket();
    let refused = |bytes: &[u8]| {
        let mut s = std::os::unix::net::UnixStream::connect(&fd_path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(bytes).unwrap();
        let mut r = Vec::new();
        let _ = s.read_to_end(&mut r);
        assert!(
            r.len() > 8 && r[..8] == umbp_proto::FD_REFUSED.to_le_bytes(),
            "{r:?}"
        );
        String::from_utf8_lossy(&r[8..]).into_owned()
    };
    assert!(refused(b"hello").contains("header"));
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    // The right session with a wrong secret, no descriptors attached.
    let h = umbp_proto::FdHeader {
        session_id: me.session_id,
        secret: [0; 16],
        count: 1,
    };
    let m = refused(&h.encode());
    assert!(
        m.contains("announced") || m.contains("another client"),
        "{m}"
    );
    assert_eq!(stats(&server.endpoint).pending_descriptors, 0);
    assert!(server.stop().success());
}

#[test]
fn other_users_are_refused_with_a_message() {
    if std::env::var(ROLE).as_deref() == Ok("stranger") {
        let (rt, mut g) = raw(&role_endpoint());
        let e = rt.block_on(g.ping(v1::PingRequest {})).unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        assert!(e.message().contains("--allow-uid"), "{}", e.message());
        println!("refused: {}", e.message());
        return;
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        println!("SKIP: needs root to run a client as another uid");
        return;
    }
    let dir = tmpdir("uid");
    // SAFETY: chmod of a directory this test created.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    // A socket others may connect to: the server itself must refuse them.
    let server = Server::start(&dir.join("s.sock"), &["--socket-mode", "666"]);
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        "other_users_are_refused_with_a_message",
        "--nocapture",
    ])
    .env(ROLE, "stranger")
    .env("UMBP_TEST_ENDPOINT", server.endpoint.path());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(|| {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("refused: uid 65534"));
    // The server goes on serving its own user.
    stats(&server.endpoint);
    assert!(server.stop().success());
}

/// Issue 29, item 9: a client trusted whoever listened at its socket path. Another user who
/// bound the path first (a shared directory, no server running) got the client's memory
/// descriptors. Now the client checks the listener's uid before it sends anything.
#[test]
fn a_client_sends_nothing_to_a_socket_of_another_user() {
    use std::io::{BufRead, Read};
    if std::env::var(ROLE).as_deref() == Ok("squatter") {
        let path = role_endpoint().path().to_path_buf();
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        l.set_nonblocking(true).unwrap();
        println!("listening");
        let done = path.with_extension("done");
        let (mut open, mut received) = (Vec::new(), 0usize);
        while !done.exists() {
            if let Ok((c, _)) = l.accept() {
                c.set_nonblocking(true).unwrap();
                open.push(c);
            }
            for c in &mut open {
                let mut b = [0u8; 4096];
                while let Ok(n @ 1..) = c.read(&mut b) {
                    received += n;
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        println!("received {received} bytes on {} connections", open.len());
        return;
    }
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        println!("SKIP: needs root to listen as another uid");
        return;
    }
    let dir = tmpdir("squat");
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let sock = dir.join("s.sock");
    let mut c = std::process::Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        "a_client_sends_nothing_to_a_socket_of_another_user",
        "--nocapture",
    ])
    .env(ROLE, "squatter")
    .env("UMBP_TEST_ENDPOINT", &sock)
    .stdout(std::process::Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        c.pre_exec(|| {
            if libc::setgid(65534) != 0 || libc::setuid(65534) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut squatter = c.spawn().unwrap();
    let mut out = std::io::BufReader::new(squatter.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("listening") {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the squatter did not start"
        );
    }
    let mut opts = umbp_client::ClientOptions::new(
        umbp_proto::Endpoint::parse(sock.to_str().unwrap()).unwrap(),
    );
    opts.startup_timeout = Duration::from_secs(5);
    let Err(e) = umbp_client::StandaloneClient::connect(opts) else {
        panic!("a client connected to another user's socket");
    };
    let e = e.to_string();
    assert!(
        e.contains("uid 65534") && e.contains("UMBP_SERVER_UIDS"),
        "{e}"
    );
    std::fs::write(sock.with_extension("done"), b"").unwrap();
    let mut rest = String::new();
    out.read_to_string(&mut rest).unwrap();
    assert!(squatter.wait().unwrap().success());
    assert!(rest.contains("received 0 bytes"), "{rest}");
}

/// Sends `count` duplicates of `/dev/null` to the side channel as session `sid` (one message)
/// and returns the server's answer.
fn send_descriptors(server: &Server, sid: u64, secret: &[u8], count: u32) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    let null = std::fs::File::open("/dev/null").unwrap();
    send_fds(server, sid, secret, &vec![null.as_raw_fd(); count as usize])
}

/// Sends `fds` to the side channel as session `sid` (one message); the server's answer.
fn send_fds(server: &Server, sid: u64, secret: &[u8], fds: &[i32]) -> Vec<u8> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let s = std::os::unix::net::UnixStream::connect(server.endpoint.fd_socket()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let count = fds.len() as u32;
    let mut header = umbp_proto::FdHeader {
        session_id: sid,
        secret: secret.try_into().unwrap(),
        count,
    }
    .encode();
    let payload = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: header.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its pointers are set to live buffers below, and the
    // control message is written within `space` bytes of `cbuf`.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        assert!(libc::sendmsg(s.as_raw_fd(), &msg, 0) >= 0);
    }
    let mut r = Vec::new();
    let _ = (&s).read_to_end(&mut r);
    r
}

/// Issue 29, item 7: 30,000 Attach calls on one connection (a pidfd each) reached the
/// server's descriptor limit, and descriptors sent over the side channel could be left unused
/// without end. Both are capped, with a message, and the server goes on.
#[test]
fn sessions_per_connection_and_unused_descriptors_are_capped() {
    let dir = tmpdir("caps");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let (rt, mut g) = raw(&server.endpoint);
    let mut sessions = Vec::new();
    for _ in 0..64 {
        sessions.push(attach(&rt, &mut g));
    }
    let (k, m) = kind_and_message(rt.block_on(g.attach(v1::AttachRequest {
        client_name: "one more".into(),
        protocol: umbp_proto::PROTOCOL,
    })));
    assert_eq!(k, umbp_core::ErrorKind::Denied, "{m}");
    assert!(m.contains("64 sessions"), "{m}");
    // Another connection still attaches.
    let other = client(&server.endpoint);

    let me = &sessions[0];
    for _ in 0..16 {
        let r = send_descriptors(&server, me.session_id, &me.secret, 64);
        assert_eq!(r.len(), 64 * 8, "tickets for 64 descriptors: {r:?}");
    }
    let r = send_descriptors(&server, me.session_id, &me.secret, 1);
    assert_eq!(r[..8], umbp_proto::FD_REFUSED.to_le_bytes(), "{r:?}");
    let m = String::from_utf8_lossy(&r[8..]);
    assert!(m.contains("1024 descriptors not yet named"), "{m}");
    assert_eq!(stats(&server.endpoint).pending_descriptors, 1024);
    drop(other);
    assert!(server.stop().success());
}

/// Issue 29, item 6: every connection to the descriptor socket held a server thread for up to
/// 5 s while it waited for the header (700 idle ones made registrations take 3-5 s, 3,000 made
/// them fail). Now headers are awaited on the runtime, holding no thread, for 2 s at most.
/// (Issue 46 took away the cap of 64 waiting connections per uid, which stopped the uid's own
/// clients too: a silent connection now holds one descriptor of its uid's budget, 2 s at most.)
#[test]
fn idle_side_channel_connections_hold_no_threads_and_expire() {
    use std::io::Read;
    let dir = tmpdir("idle");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let idle: Vec<_> = (0..100)
        .map(|_| std::os::unix::net::UnixStream::connect(server.endpoint.fd_socket()).unwrap())
        .collect();
    // A client of the same uid registers its memory and stores meanwhile.
    let c = client(&server.endpoint);
    let mut cc = cache(&c);
    cc.fill(1);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    assert!(cc.stores_all(&c, &ids, "idle"));
    let answers: Vec<String> = idle
        .into_iter()
        .map(|mut s| {
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut r = Vec::new();
            s.read_to_end(&mut r).unwrap();
            String::from_utf8_lossy(r.get(8..).unwrap_or_default()).into_owned()
        })
        .collect();
    let timed_out = answers
        .iter()
        .filter(|m| m.contains("no header within") && m.contains("the most a connection may wait"))
        .count();
    assert_eq!(timed_out, 100, "{answers:?}");
    drop(c);
    assert!(server.stop().success());
}

/// Issue 29, item 8: a transfer-channel frame announced (16 MiB) and never finished held its
/// whole buffer and its channel for ever (48 such frames: 135 MiB). Now the rest of a frame
/// must come within 5 s of its length, and only the bytes that came are held.
#[test]
fn a_half_sent_channel_frame_ends_its_channel() {
    use std::io::{Read, Write};
    let dir = tmpdir("half-frame");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let (mut s, ack) = open_channel(&server, me.session_id, &me.secret);
    assert_eq!(ack, umbp_proto::channel::CHANNEL_OPENED.to_le_bytes());
    s.write_all(&(1u32 << 20).to_le_bytes()).unwrap();
    s.write_all(&[0u8; 10]).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest)
        .expect("the server ends the channel (not a read timeout)");
    assert!(server
        .log_text()
        .contains("of a 1048576-byte frame came within 5 s"));
    // The session and the server go on.
    rt.block_on(g.detach(v1::DetachRequest {
        session_id: me.session_id,
    }))
    .unwrap();
    assert!(server.stop().success());
}

/// Issue 29, item 10: `--remote-url` put the remote's password in every local user's `ps`.
/// `--remote-url-file` keeps it out of the command line (and the log shows the URL redacted).
#[test]
fn the_remote_password_can_stay_out_of_the_command_line() {
    let dir = tmpdir("remote-url");
    let url_file = dir.join("remote-url");
    // Nothing listens on port 1: the tier is down, which is fine here.
    std::fs::write(&url_file, "redis://umbp:hunter2-secret@127.0.0.1:1\n").unwrap();
    let server = Server::start(
        &dir.join("s.sock"),
        &["--remote-url-file", url_file.to_str().unwrap()],
    );
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", server.child.id())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains("hunter2"));
    let log = server.log_text();
    assert!(log.contains("remote tier"), "{log}");
    assert!(!log.contains("hunter2"), "{log}");
    assert!(server.stop().success());
}

/// Issue 29, item 2: one `Exists` request of 1M one-byte hashes × 100 ranks (1.1 MB on the
/// wire) used to make the server build 1e8 keys (6.4 GB) before looking anything up. Now it is
/// refused with the limit named, a request at the limits is answered one rank at a time, and
/// the server, limited to 2 GiB of address space here, stays up throughout.
#[test]
fn an_exists_request_cannot_make_the_server_build_unbounded_keys() {
    let dir = tmpdir("exists-bound");
    let server = Server::start_limited(&dir.join("s.sock"), &[], Some(2 << 30));
    let (rt, mut g) = raw(&server.endpoint);
    let lookup = |blocks: usize, ranks: usize| v1::ExistsRequest {
        keys: Some(v1::KeySet {
            namespace: "hostile".into(),
            hash_bytes: 1,
            hashes: vec![7; blocks],
            ..Default::default()
        }),
        ranks: (0..ranks as u32)
            .map(|tp| v1::Ranks {
                tp,
                ..Default::default()
            })
            .collect(),
        prefix_only: true,
        ..Default::default()
    };
    let (c, m) = code_and_message(rt.block_on(g.exists(lookup(1 << 20, 100))));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("4194304 keys") && m.contains("in parts"), "{m}");
    let (c, m) = code_and_message(rt.block_on(g.exists(lookup((1 << 20) + 1, 1))));
    assert_eq!(c, Code::InvalidArgument, "{m}");
    assert!(m.contains("1048576"), "{m}");
    // At the limits: answered (nothing stored), the keys built one rank at a time.
    for prefix_only in [true, false] {
        let r = rt
            .block_on(g.exists(v1::ExistsRequest {
                prefix_only,
                ..lookup(1 << 20, 2)
            }))
            .expect("a lookup at the limits is answered")
            .into_inner();
        assert_eq!(r.prefix, 0);
    }
    stats(&server.endpoint);
    assert!(server.stop().success(), "{}", server_log_tail(&dir));
}

fn server_log_tail(dir: &std::path::Path) -> String {
    let t = std::fs::read_to_string(dir.join("s.log")).unwrap_or_default();
    t[t.len().saturating_sub(2000)..].to_string()
}

/// Issue 29, item 11: a newline in `client_name` wrote a line of the client's choosing into
/// the server's log. The name is logged with its control characters escaped.
#[test]
fn a_client_name_cannot_forge_a_log_line() {
    let dir = tmpdir("name");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let (rt, mut g) = raw(&server.endpoint);
    let me = rt
        .block_on(g.attach(v1::AttachRequest {
            client_name: "evil\n2026-01-01T00:00:00Z ERROR umbp_server: forged".into(),
            protocol: umbp_proto::PROTOCOL,
        }))
        .unwrap()
        .into_inner();
    rt.block_on(g.detach(v1::DetachRequest {
        session_id: me.session_id,
    }))
    .unwrap();
    assert!(server.stop().success());
    let log = std::fs::read_to_string(dir.join("s.log")).unwrap();
    assert!(
        log.contains("evil\\n2026"),
        "the name is not in the log:\n{log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00Z")),
        "a forged line:\n{log}"
    );
}

/// A memfd of `len` bytes sealed against shrinking, as clients share memory; `populated`: every
/// page allocated, else all holes.
fn sealed_memfd(len: u64, populated: bool) -> std::os::fd::OwnedFd {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: plain system calls on a descriptor made here, checked one by one.
    unsafe {
        let fd = libc::memfd_create(
            c"bad-input".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        );
        assert!(fd >= 0);
        let fd = OwnedFd::from_raw_fd(fd);
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as i64), 0);
        if populated {
            // Written, as a client's KV cache is (fallocate alone leaves pages the kernel
            // reports as holes until they are written).
            let zeros = vec![0u8; 1 << 20];
            for at in (0..len).step_by(zeros.len()) {
                let n = zeros.len().min((len - at) as usize);
                let w = libc::pwrite(fd.as_raw_fd(), zeros.as_ptr().cast(), n, at as i64);
                assert_eq!(w, n as isize);
            }
        }
        assert_eq!(
            libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SHRINK),
            0
        );
        fd
    }
}

/// Registers `fd` (`len` bytes) for raw session `me`; the server's answer.
fn register_raw_memfd(
    server: &Server,
    rt: &tokio::runtime::Runtime,
    g: &mut v1::store_client::StoreClient<tonic::transport::Channel>,
    me: &v1::AttachReply,
    fd: &std::os::fd::OwnedFd,
    len: u64,
) -> Result<tonic::Response<v1::RegisterMemoryReply>, tonic::Status> {
    use std::os::fd::AsRawFd;
    let r = send_fds(server, me.session_id, &me.secret, &[fd.as_raw_fd()]);
    assert_eq!(r.len(), 8, "a ticket: {r:?}");
    let ticket = u64::from_le_bytes(r[..8].try_into().unwrap());
    rt.block_on(g.register_host_memory(v1::RegisterHostMemoryRequest {
        session_id: me.session_id,
        ticket,
        length: len,
    }))
}

/// Issue 29, item 3: a client registered a sparse memfd and loaded one object into 1,024 of
/// its blocks; the server's copies allocated the pages, charged to the server's memory cgroup,
/// and the server was OOM-killed. Memory with holes is now refused at registration (UMBP's
/// clients allocate every page first, charged to themselves).
#[test]
fn memory_the_client_never_allocated_is_refused() {
    let dir = tmpdir("sparse");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let len = 64 << 20;
    let (k, m) = kind_and_message(register_raw_memfd(
        &server,
        &rt,
        &mut g,
        &me,
        &sealed_memfd(len, false),
        len,
    ));
    assert_eq!(k, umbp_core::ErrorKind::Registration, "{m}");
    assert!(m.contains("not populated"), "{m}");
    register_raw_memfd(&server, &rt, &mut g, &me, &sealed_memfd(len, true), len)
        .expect("populated memory is accepted");
    // The client library populates what it shares (alloc_shared_host starts sparse).
    let c = client(&server.endpoint);
    let shm = umbp_client::host_share::alloc_shared_host(len).unwrap();
    c.register_shared_host(shm).unwrap();
    drop(c);
    assert!(server.stop().success());
}

/// Issue 29, item 5: RegisterLayout compared every pair of runs whose spans meet, on a
/// runtime thread (40,000 interleaved runs: 5 s; several such requests stopped every client),
/// and runs of different strides block by block (two runs of 2^32 blocks in a 34-byte request:
/// 10 s). Now 65,536 interleaved runs register at once and the second layout is refused.
#[test]
fn register_layout_is_bounded() {
    use umbp_core::LayerSpec;
    const MAX_LAYOUT_RUNS: usize = 65_536; // umbp_core::MAX_LAYOUT_RUNS
    let dir = tmpdir("layout-bound");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let c = client(&server.endpoint);
    let len: u64 = 8 << 20;
    let shm = umbp_client::host_share::alloc_shared_host(len).unwrap();
    let base = shm.span_addr();
    c.register_shared_host(shm).unwrap();
    let n = MAX_LAYOUT_RUNS as u64;
    let interleaved: Vec<LayerSpec> = (0..n)
        .map(|i| LayerSpec {
            base_addr: base + i,
            num_blocks: 64,
            block_stride: n,
            block_bytes: 1,
        })
        .collect();
    let info = c
        .register_layout(vec![interleaved])
        .expect("65,536 interleaved runs");
    assert_eq!(info.object_bytes, vec![n]);
    // Refused on sight: a raw request, since the client library checks each run's fit itself.
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let fd = sealed_memfd(len, true);
    let region = register_raw_memfd(&server, &rt, &mut g, &me, &fd, len)
        .unwrap()
        .into_inner()
        .region_id;
    let run = |offset: u64, block_stride: u64| v1::LayoutRun {
        region_id: region,
        offset,
        num_blocks: 1 << 32,
        block_stride,
        block_bytes: 1,
    };
    let layout = |runs: Vec<v1::LayoutRun>| v1::RegisterLayoutRequest {
        session_id: me.session_id,
        groups: vec![v1::LayoutGroup { runs }],
    };
    // Even bytes and odd bytes: disjoint, and the old check compared them block by block.
    let (code, m) =
        code_and_message(rt.block_on(g.register_layout(layout(vec![run(0, 2), run(1, 4)]))));
    assert_eq!(code, Code::InvalidArgument, "{m}");
    assert!(m.contains("at most 1073741824"), "{m}");
    let small = v1::LayoutRun {
        num_blocks: 1,
        ..run(0, 1)
    };
    let (code, m) =
        code_and_message(rt.block_on(g.register_layout(layout(vec![small; MAX_LAYOUT_RUNS + 1]))));
    assert_eq!(code, Code::InvalidArgument, "{m}");
    assert!(m.contains("at most 65536"), "{m}");
    stats(&server.endpoint);
    drop(c);
    assert!(server.stop().success());
}

/// A valid message of each request type, encoded (the fuzzer mutates these).
fn valid_bodies(sid: u64) -> Vec<(&'static str, Vec<u8>)> {
    let key = keys("fuzz", 2);
    let packed: Vec<u8> = key.iter().flat_map(|k| k.as_bytes().to_vec()).collect();
    vec![
        ("Ping", v1::PingRequest {}.encode_to_vec()),
        ("Stats", v1::StatsRequest {}.encode_to_vec()),
        (
            "Exists",
            v1::ExistsRequest {
                keys: Some(v1::KeySet {
                    packed: packed.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "Exists",
            v1::ExistsRequest {
                keys: Some(v1::KeySet {
                    namespace: "ns".into(),
                    hash_bytes: 8,
                    hashes: vec![3; 64],
                    group: 0,
                    packed: vec![],
                }),
                ranks: vec![
                    v1::Ranks {
                        tp: 1,
                        ..Default::default()
                    };
                    3
                ],
                prefix_only: true,
                ..Default::default()
            }
            .encode_to_vec(),
        ),
        (
            "RegisterLayout",
            v1::RegisterLayoutRequest {
                session_id: sid,
                groups: vec![v1::LayoutGroup {
                    runs: vec![v1::LayoutRun {
                        region_id: 1,
                        offset: 0,
                        num_blocks: 2,
                        block_stride: 64,
                        block_bytes: 64,
                    }],
                }],
            }
            .encode_to_vec(),
        ),
        (
            "Transfer",
            v1::TransferRequest {
                session_id: sid,
                layout_id: 1,
                group: 0,
                direction: 2,
                block_ids: vec![0, 1],
                keys: packed,
                timeout_ms: 50,
                transfer_id: 3,
                completion_slot: 2,
                completion_seq: 9,
                admit_now: false,
            }
            .encode_to_vec(),
        ),
        (
            "RegisterCompletionPage",
            v1::RegisterCompletionPageRequest {
                session_id: sid,
                ticket: 1,
                length: 65536,
            }
            .encode_to_vec(),
        ),
        (
            "RegisterHostMemory",
            v1::RegisterHostMemoryRequest {
                session_id: sid,
                ticket: 1,
                length: 4096,
            }
            .encode_to_vec(),
        ),
        (
            "RegisterCudaIpc",
            v1::RegisterCudaIpcRequest {
                session_id: sid,
                device: Some(v1::CudaDevice { uuid: vec![1; 16] }),
                handle: vec![2; 64],
                allocation_bytes: 1 << 20,
                offset: 0,
                length: 4096,
            }
            .encode_to_vec(),
        ),
        (
            "RegisterCudaVmm",
            v1::RegisterCudaVmmRequest {
                session_id: sid,
                device: Some(v1::CudaDevice { uuid: vec![1; 16] }),
                chunks: vec![v1::VmmChunk {
                    ticket: 1,
                    offset: 0,
                    size: 1 << 21,
                }],
                offset: 0,
                length: 4096,
            }
            .encode_to_vec(),
        ),
        (
            "DeregisterMemory",
            v1::DeregisterMemoryRequest {
                session_id: sid,
                region_id: 1,
            }
            .encode_to_vec(),
        ),
        (
            "CancelTransfer",
            v1::CancelTransferRequest {
                session_id: sid,
                transfer_id: 3,
            }
            .encode_to_vec(),
        ),
        (
            "Clear",
            v1::ClearRequest {
                namespace: "test-fuzz-nothing".into(),
            }
            .encode_to_vec(),
        ),
    ]
}

#[test]
fn fuzzed_requests_never_break_the_server() {
    let dir = tmpdir("fuzz");
    let server = Server::start(&dir.join("s.sock"), &["--max-message-bytes", "1048576"]);
    let victim = client(&server.endpoint);
    let mut vc = cache(&victim);
    vc.fill(11);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    assert!(vc.stores_all(&victim, &ids, "keep"));
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let ch = {
        let _g = rt.enter();
        umbp_client::unix_channel(&server.endpoint)
    };
    let bodies = valid_bodies(me.session_id);
    let answered = std::sync::atomic::AtomicU64::new(0);
    // A Clear whose flipped bytes still decode (as another namespace, or as none: the whole
    // pool) is a valid request that may remove the victim's objects.
    let cleared = std::sync::atomic::AtomicBool::new(false);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 400,
        ..ProptestConfig::default()
    });
    let strategy = (
        0..METHODS.len(),
        0..bodies.len(),
        prop::collection::vec(any::<u8>(), 0..300),
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        any::<bool>(),
    );
    runner
        .run(&strategy, |(method, body, random, flips, use_random)| {
            // Random bytes to a random method, or a valid message with bytes flipped, sent to
            // its own method or another.
            let (name, mut bytes) = if use_random {
                (METHODS[method], random)
            } else {
                let (n, b) = &bodies[body];
                (
                    if method % 3 == 0 { METHODS[method] } else { *n },
                    b.clone(),
                )
            };
            for (at, v) in flips {
                if !bytes.is_empty() {
                    let i = at % bytes.len();
                    bytes[i] ^= v;
                }
            }
            let r = rt.block_on(async {
                tokio::time::timeout(Duration::from_secs(10), raw_call(ch.clone(), name, bytes))
                    .await
            });
            let r = r.expect("the server did not answer a fuzzed request within 10 s");
            if let Err(s) = &r {
                prop_assert!(
                    !s.message().is_empty() || s.code() == Code::Ok,
                    "{name}: an error without a message: {s:?}"
                );
                prop_assert!(
                    s.code() != Code::Unavailable,
                    "{name}: the server went away: {s:?}"
                );
            }
            if name == "Clear" && r.is_ok() {
                cleared.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        })
        .unwrap();
    assert!(answered.into_inner() >= 400);
    // Still serving, the victim's objects and memory intact (stored again where a fuzzed
    // Clear was accepted).
    if cleared.into_inner() {
        assert!(vc.stores_all(&victim, &ids, "keep"));
    }
    vc.buf.fill(0);
    assert!(vc.loads_all(&victim, &ids, "keep"));
    vc.check(11, &ids);
    let s = stats(&server.endpoint);
    assert_eq!((s.reservations, s.pinned), (0, 0), "{s:?}");
    assert!(server.stop().success());
}

#[test]
fn decoding_random_bytes_as_any_request_never_panics() {
    proptest!(ProptestConfig { cases: 2000, ..ProptestConfig::default() }, |(b in prop::collection::vec(any::<u8>(), 0..512))| {
        let _ = v1::TransferRequest::decode(b.as_slice());
        let _ = v1::ExistsRequest::decode(b.as_slice());
        let _ = v1::RegisterLayoutRequest::decode(b.as_slice());
        let _ = v1::RegisterCudaVmmRequest::decode(b.as_slice());
        let _ = v1::RegisterCudaIpcRequest::decode(b.as_slice());
        let _ = v1::RegisterCompletionPageRequest::decode(b.as_slice());
        let _ = umbp_proto::FdHeader::decode(&b);
    });
}

/// Live channels one session may have (the server's `MAX_CHANNELS_PER_SESSION`).
const CHANNELS_PER_SESSION: usize = 4;

/// Opens a transfer channel of session `sid` (a side-channel header of no descriptors) and
/// returns the socket with the server's 8-byte answer.
#[test]
fn transfer_channels_refuse_strangers_and_bad_frames_and_the_server_goes_on() {
    use umbp_proto::channel::write_frame;
    let dir = tmpdir("chan");
    let server = Server::start(&dir.join("s.sock"), &["--max-message-bytes", "1048576"]);
    let victim = client(&server.endpoint);
    let mut vc = cache(&victim);
    vc.fill(3);
    let ids: Vec<u64> = (0..BLOCKS).collect();
    assert!(vc.stores_all(&victim, &ids, "chan-victim"));
    // The victim's own transfers came on its channel.
    assert!(stats(&server.endpoint).channel_transfers >= 1);
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let sid = me.session_id;

    // A wrong secret, or another session's id with this secret: refused, no channel.
    let (_, ack) = open_channel(&server, sid, &[0; 16]);
    assert_eq!(ack, umbp_proto::FD_REFUSED.to_le_bytes());
    let (victim_sid, _) = victim.session().unwrap();
    let (_, ack) = open_channel(&server, victim_sid, &me.secret);
    assert_eq!(ack, umbp_proto::FD_REFUSED.to_le_bytes());

    // A request naming another session is refused on the channel, which goes on; one of this
    // session with an unknown layout gets its error; a frame that is not a request ends it.
    let (mut ch, ack) = open_channel(&server, sid, &me.secret);
    assert_eq!(ack, umbp_proto::channel::CHANNEL_OPENED.to_le_bytes());
    let req = |session_id, transfer_id| v1::TransferRequest {
        session_id,
        layout_id: 0,
        direction: v1::Direction::Load as i32,
        block_ids: vec![0],
        keys: keys("chan-victim", 1)[0].as_bytes().to_vec(),
        transfer_id,
        ..Default::default()
    };
    write_frame(&mut ch, &req(victim_sid, 7).encode_to_vec()).unwrap();
    let r = channel_reply(&mut ch).expect("an answer");
    assert_eq!(
        (r.transfer_id, r.code),
        (7, Code::PermissionDenied as i32),
        "{r:?}"
    );
    assert!(!r.message.is_empty());
    write_frame(&mut ch, &req(sid, 8).encode_to_vec()).unwrap();
    let r = channel_reply(&mut ch).expect("an answer");
    assert_eq!((r.transfer_id, r.code), (8, Code::NotFound as i32), "{r:?}");
    write_frame(&mut ch, &[0xff; 40]).unwrap();
    let r = channel_reply(&mut ch).expect("an answer");
    assert_eq!(r.code, Code::InvalidArgument as i32, "{r:?}");
    assert!(channel_reply(&mut ch).is_none(), "the channel ended");

    // An oversized frame, a cut one and random bytes end only that channel.
    let (mut ch, _) = open_channel(&server, sid, &me.secret);
    std::io::Write::write_all(&mut ch, &(64u32 << 20).to_le_bytes()).unwrap();
    assert!(channel_reply(&mut ch).is_none());
    let mut rng = rand::rng();
    for n in [1usize, 3, 5, 64, 700] {
        let (mut ch, ack) = open_channel(&server, sid, &me.secret);
        assert_eq!(ack, umbp_proto::channel::CHANNEL_OPENED.to_le_bytes());
        let junk: Vec<u8> = (0..n).map(|_| rand::Rng::random::<u8>(&mut rng)).collect();
        // A junk length may make the server end the channel before all of it is read.
        let _ = std::io::Write::write_all(&mut ch, &junk);
        drop(ch);
        // Every one of them ends (no thread left behind): only the victim's stays open.
        let t = std::time::Instant::now();
        while stats(&server.endpoint).transfer_channels != 1 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "a channel did not end"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    // At most a few channels per session at once.
    let held: Vec<_> = (0..CHANNELS_PER_SESSION)
        .map(|_| open_channel(&server, sid, &me.secret))
        .collect();
    assert!(held
        .iter()
        .all(|(_, a)| *a == umbp_proto::channel::CHANNEL_OPENED.to_le_bytes()));
    let (_, ack) = open_channel(&server, sid, &me.secret);
    assert_eq!(
        ack,
        umbp_proto::FD_REFUSED.to_le_bytes(),
        "one channel too many"
    );
    drop(held);

    // The server still serves the victim, whose memory and objects are untouched.
    vc.buf.fill(0);
    assert!(vc.loads_all(&victim, &ids, "chan-victim"));
    vc.check(3, &ids);
    let s = stats(&server.endpoint);
    assert_eq!((s.reservations, s.pinned), (0, 0), "{s:?}");
    assert!(server.stop().success());
}
