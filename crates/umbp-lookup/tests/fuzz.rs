//! Random and mutated frames against a live lookup server (bounded: runs in `cargo test`). After
//! every input the server must still answer a well-formed lookup on a fresh connection, and a
//! client fed random replies by a fake worker must return (a miss or an answer), never hang or
//! panic.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use umbp_lookup::{LookupClient, LookupServer};

mod common;
use common::AllHeld;

fn frame(magic: &[u8; 4], op: u8, body: &[u8]) -> Vec<u8> {
    let mut f = magic.to_vec();
    f.extend_from_slice(&[op, 0, 0, 0]);
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(body);
    f
}

fn hashes_body(group: u32, hl: u32, n: usize) -> Vec<u8> {
    let mut b = group.to_le_bytes().to_vec();
    b.extend_from_slice(&hl.to_le_bytes());
    b.extend(std::iter::repeat_n(7u8, hl as usize * n));
    b
}

fn shm_body(off: u64, len: u64) -> Vec<u8> {
    let mut b = 0u32.to_le_bytes().to_vec();
    b.extend_from_slice(&32u32.to_le_bytes());
    b.extend_from_slice(&off.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
    b
}

fn valid_requests() -> Vec<Vec<u8>> {
    vec![
        frame(b"UMBL", 1, &[]),
        frame(b"UMBL", 4, &[]),
        frame(b"UMBL", 2, &hashes_body(0, 32, 4)),
        frame(b"UMBL", 3, &hashes_body(1, 16, 9)),
        frame(b"UMBL", 5, &[]),
        frame(b"UMBL", 6, &shm_body(0, 64)),
        frame(b"UMBL", 7, &shm_body(32, 32)),
    ]
}

/// Up to four frames, each valid or mutated, or plain random bytes.
fn request_stream() -> impl Strategy<Value = Vec<u8>> {
    let one = (
        0..7usize,
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..5),
        proptest::option::of(any::<usize>()),
    )
        .prop_map(|(i, flips, cut)| {
            let mut f = valid_requests().swap_remove(i);
            for (at, v) in flips {
                let n = f.len();
                f[at % n] = v;
            }
            if let Some(c) = cut {
                f.truncate(c % (f.len() + 1));
            }
            f
        });
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..200),
        proptest::collection::vec(one, 1..4).prop_map(|v| v.concat()),
    ]
}

fn server() -> &'static (LookupServer, LookupClient) {
    static S: std::sync::OnceLock<(LookupServer, LookupClient)> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("umbp-lookup-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.sock");
        let s = LookupServer::bind(&path, Arc::new(AllHeld("fuzz worker"))).unwrap();
        let c = LookupClient::new(vec![path], Duration::from_secs(5));
        (s, c)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn the_server_survives_random_and_mutated_frames(input in request_stream()) {
        let (srv, client) = server();
        let mut s = UnixStream::connect(srv.path()).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        s.write_all(&input).unwrap();
        // Read whatever comes back (answers, errors, or the server closing the connection).
        let mut sink = [0u8; 4096];
        while let Ok(n) = s.read(&mut sink) {
            if n == 0 {
                break;
            }
        }
        drop(s);
        prop_assert_eq!(client.prefix_hits(0, &[1u8; 64], 32), 2);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// A fake worker answers every request with random or mutated reply bytes.
    #[test]
    fn the_client_survives_random_replies(
        reply in prop_oneof![
            proptest::collection::vec(any::<u8>(), 0..64),
            (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..12), any::<u32>(), any::<bool>())
                .prop_map(|(st, body, len, honest)| {
                    let mut f = frame(b"UMBR", st, &body);
                    if !honest {
                        f[8..12].copy_from_slice(&len.to_le_bytes());
                    }
                    f
                }),
        ]
    ) {
        let dir = std::env::temp_dir().join(format!("umbp-lookup-fuzzc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fake.sock");
        let _ = std::fs::remove_file(&path);
        let l = UnixListener::bind(&path).unwrap();
        let fake = std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let mut h = [0u8; 4096];
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let _ = s.read(&mut h);
                let _ = s.write_all(&reply);
            }
        });
        let c = LookupClient::new(vec![path.clone()], Duration::from_millis(200));
        let _ = c.prefix_hits(0, &[1u8; 64], 32);
        fake.join().unwrap();
        let _ = std::fs::remove_file(&path);
    }
}
