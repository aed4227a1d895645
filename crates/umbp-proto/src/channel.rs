//! Framing of the transfer channel: a side-channel connection (opened with an [`FdHeader`]
//! of zero descriptors, answered by 8 zero bytes) that then carries `TransferRequest` frames
//! from the client and `ChannelReply` frames from the server. A frame is a 4-byte
//! little-endian length and that many bytes of one protobuf message. The channel exists so
//! that a transfer is sent by the calling thread itself and read by a server thread blocked
//! on the socket: no async runtime hand-off on either end.
//!
//! [`FdHeader`]: crate::FdHeader

use std::io::{Read, Write};

/// The answer to a header that opened a transfer channel.
pub const CHANNEL_OPENED: u64 = 0;

/// Writes one frame holding `msg`.
pub fn write_frame(w: &mut impl Write, msg: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(msg.len())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
    let mut buf = Vec::with_capacity(4 + msg.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(msg);
    w.write_all(&buf)
}

/// The frame of `msg`, encoded once straight after its length (no second copy of the
/// message, which [`write_frame`] would make).
pub fn encode_frame(msg: &impl prost::Message) -> Vec<u8> {
    let n = msg.encoded_len();
    let mut buf = Vec::with_capacity(4 + n);
    buf.extend_from_slice(&(n as u32).to_le_bytes());
    msg.encode(&mut buf)
        .expect("a Vec with room for the encoded length takes the message");
    buf
}

/// Reads a frame's 4-byte length and checks it against `max`; None at a clean end of the
/// stream (before a frame).
pub fn read_frame_len(r: &mut impl Read, max: usize) -> std::io::Result<Option<usize>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the stream ended inside a frame's length",
                ))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes, over the limit of {max}"),
        ));
    }
    Ok(Some(len))
}

/// Reads one frame of at most `max` bytes; None at a clean end of the stream (before a frame).
/// The buffer grows with the bytes that come, never to the announced length up front.
pub fn read_frame(r: &mut impl Read, max: usize) -> std::io::Result<Option<Vec<u8>>> {
    let Some(len) = read_frame_len(r, max)? else {
        return Ok(None);
    };
    let mut msg = Vec::new();
    r.take(len as u64).read_to_end(&mut msg)?;
    if msg.len() < len {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the stream ended inside a frame",
        ));
    }
    Ok(Some(msg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_oversized_or_cut_ones_fail() {
        let mut b = Vec::new();
        write_frame(&mut b, b"hello").unwrap();
        write_frame(&mut b, b"").unwrap();
        let mut r = b.as_slice();
        assert_eq!(read_frame(&mut r, 16).unwrap().unwrap(), b"hello");
        assert_eq!(read_frame(&mut r, 16).unwrap().unwrap(), b"");
        assert!(read_frame(&mut r, 16).unwrap().is_none());
        let mut big = Vec::new();
        write_frame(&mut big, &[0; 32]).unwrap();
        assert!(read_frame(&mut big.as_slice(), 16).is_err());
        assert!(read_frame(&mut &b[..3], 16).is_err());
        assert!(read_frame(&mut &b[..6], 16).is_err());
    }

    #[test]
    fn an_encoded_frame_is_the_written_frame_of_the_encoded_message() {
        use prost::Message;
        let req = crate::v1::TransferRequest {
            session_id: 3,
            block_ids: (0..300).collect(),
            keys: vec![7; 300 * crate::KEY_BYTES],
            transfer_id: 9,
            ..Default::default()
        };
        let mut written = Vec::new();
        write_frame(&mut written, &req.encode_to_vec()).unwrap();
        assert_eq!(encode_frame(&req), written);
        let back = read_frame(&mut written.as_slice(), 1 << 20)
            .unwrap()
            .unwrap();
        assert_eq!(
            crate::v1::TransferRequest::decode(back.as_slice()).unwrap(),
            req
        );
    }
}
