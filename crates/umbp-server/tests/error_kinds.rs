//! Every refusal carries its kind on each transport (gRPC status details, transfer-channel
//! replies, side-channel refusals), and a lost session is told by that kind, never by the
//! message's words. A real server process; the wire read with the functions the client uses.

mod common;

use std::time::Duration;

use common::*;
use prost::Message;
use umbp_core::ErrorKind;
use umbp_proto::channel::{write_frame, CHANNEL_OPENED};
use umbp_proto::errors::{decode_refusal, kind_of_channel_reply, kind_of_status};
use umbp_proto::{v1, FD_REFUSED};

fn load_request(session_id: u64, transfer_id: u64) -> v1::TransferRequest {
    v1::TransferRequest {
        session_id,
        layout_id: 0,
        direction: v1::Direction::Load as i32,
        block_ids: vec![0],
        keys: keys("kinds", 1)[0].as_bytes().to_vec(),
        transfer_id,
        ..Default::default()
    }
}

#[test]
fn grpc_refusals_carry_their_kind_and_a_lost_session_is_session_lost() {
    let dir = tmpdir("kind-grpc");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let (rt, mut g) = raw(&server.endpoint);

    // A session the server never had.
    let e = rt
        .block_on(g.transfer(load_request(999_999, 0)))
        .unwrap_err();
    assert_eq!(kind_of_status(&e), ErrorKind::SessionLost, "{e:?}");

    // A session attached on another connection is not this one's.
    let (rt2, mut g2) = raw(&server.endpoint);
    let other = attach(&rt2, &mut g2);
    let e = rt
        .block_on(g.transfer(load_request(other.session_id, 0)))
        .unwrap_err();
    assert_eq!(kind_of_status(&e), ErrorKind::SessionLost, "{e:?}");

    // A session that ended (detached): gone.
    let me = attach(&rt, &mut g);
    rt.block_on(g.detach(v1::DetachRequest {
        session_id: me.session_id,
    }))
    .unwrap();
    let e = rt
        .block_on(g.register_layout(v1::RegisterLayoutRequest {
            session_id: me.session_id,
            groups: vec![],
        }))
        .unwrap_err();
    assert_eq!(kind_of_status(&e), ErrorKind::SessionLost, "{e:?}");

    // Refusals of other kinds are not a lost session.
    let me = attach(&rt, &mut g);
    let e = rt
        .block_on(g.transfer(load_request(me.session_id, 0)))
        .unwrap_err();
    assert_eq!(
        kind_of_status(&e),
        ErrorKind::NotFound,
        "no layout 0: {e:?}"
    );
    let e = rt
        .block_on(g.register_layout(v1::RegisterLayoutRequest {
            session_id: me.session_id,
            groups: vec![],
        }))
        .unwrap_err();
    assert_eq!(kind_of_status(&e), ErrorKind::InvalidArgument, "{e:?}");
    let e = rt
        .block_on(g.attach(v1::AttachRequest {
            client_name: "old".into(),
            protocol: umbp_proto::PROTOCOL - 1,
        }))
        .unwrap_err();
    assert_eq!(kind_of_status(&e), ErrorKind::Denied, "{e:?}");
    for k in [
        ErrorKind::NotFound,
        ErrorKind::InvalidArgument,
        ErrorKind::Denied,
    ] {
        assert!(!k.is_disconnect());
    }
    assert!(server.stop().success());
}

#[test]
fn side_channel_refusals_carry_their_kind_and_a_lost_session_is_session_lost() {
    use std::io::{Read, Write};
    let dir = tmpdir("kind-fd");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let refusal = |h: umbp_proto::FdHeader| {
        let mut s = std::os::unix::net::UnixStream::connect(server.endpoint.fd_socket()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&h.encode()).unwrap();
        let mut r = Vec::new();
        let _ = s.read_to_end(&mut r);
        decode_refusal(&r).unwrap_or_else(|| panic!("not a refusal: {r:?}"))
    };
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let secret: [u8; 16] = me.secret.as_slice().try_into().unwrap();

    // Another client's secret: denied, not lost.
    let (kind, m) = refusal(umbp_proto::FdHeader {
        session_id: me.session_id,
        secret: [0; 16],
        count: 0,
    });
    assert_eq!(kind, ErrorKind::Denied, "{m}");

    // The session ended: lost.
    rt.block_on(g.detach(v1::DetachRequest {
        session_id: me.session_id,
    }))
    .unwrap();
    let (kind, m) = refusal(umbp_proto::FdHeader {
        session_id: me.session_id,
        secret,
        count: 0,
    });
    assert_eq!(kind, ErrorKind::SessionLost, "{m}");
    assert!(server.stop().success());
}

#[test]
fn transfer_channel_replies_carry_their_kind_and_a_lost_session_ends_the_channel() {
    let dir = tmpdir("kind-chan");
    let server = Server::start(&dir.join("s.sock"), &[]);
    let (rt, mut g) = raw(&server.endpoint);
    let me = attach(&rt, &mut g);
    let (mut ch, ack) = open_channel(&server, me.session_id, &me.secret);
    assert_eq!(ack, CHANNEL_OPENED.to_le_bytes());

    // Refused transfers come back on the channel with their kind; the channel goes on.
    write_frame(&mut ch, &load_request(me.session_id + 1, 7).encode_to_vec()).unwrap();
    let r = channel_reply(&mut ch).expect("an answer");
    assert_eq!(
        (r.transfer_id, kind_of_channel_reply(&r)),
        (7, ErrorKind::Denied)
    );
    write_frame(&mut ch, &load_request(me.session_id, 8).encode_to_vec()).unwrap();
    let r = channel_reply(&mut ch).expect("an answer");
    assert_eq!(
        (r.transfer_id, kind_of_channel_reply(&r)),
        (8, ErrorKind::NotFound),
        "{}",
        r.message
    );

    // The session ends: the server ends its channel (the client then reads "disconnected",
    // and its next call over gRPC is told session_lost), and a new channel is refused as lost.
    rt.block_on(g.detach(v1::DetachRequest {
        session_id: me.session_id,
    }))
    .unwrap();
    let _ = write_frame(&mut ch, &load_request(me.session_id, 9).encode_to_vec());
    match channel_reply(&mut ch) {
        None => {}
        // The request raced the release: refused as lost.
        Some(r) => assert_eq!(
            (r.transfer_id, kind_of_channel_reply(&r)),
            (9, ErrorKind::SessionLost),
            "{}",
            r.message
        ),
    }
    let (mut s, ack) = open_channel(&server, me.session_id, &me.secret);
    assert_eq!(ack, FD_REFUSED.to_le_bytes());
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut s, &mut rest);
    let answer = [&ack[..], &rest].concat();
    let (kind, m) = decode_refusal(&answer).unwrap();
    assert_eq!(kind, ErrorKind::SessionLost, "{m}");
    assert!(server.stop().success());
}
