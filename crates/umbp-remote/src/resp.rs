//! A RESP2 reply reader that never holds more than it allows, whatever the peer claims.
//!
//! The `redis` crate's parser buffers a bulk string whole before it hands it over (and then
//! copies it): a peer that declares a 512 MiB value, honest or not, costs the reader 1 GiB.
//! Here every declared length is checked before anything is allocated for it, and the bytes
//! of an allowed bulk string are taken as they arrive (memory follows what the peer really
//! sent, never what it announced). A reply past a bound is an error that leaves the stream
//! unusable: its connection is dropped.
//!
//! The bound on one bulk string is set per thread ([`with_bulk_limit`]): the fetch path
//! allows what its `GETRANGE` asked for (the largest object a registered layout can hold and
//! its header); everything else gets [`CONTROL_BULK`].

use std::cell::Cell;
use std::io::{self, Read};

use redis::{ErrorKind, RedisError, RedisResult, Value};

/// The bound on one bulk string outside [`with_bulk_limit`] (and the least within it): enough
/// for `CLUSTER NODES` of thousands of nodes, a `SCAN` page or a command's answer.
pub(crate) const CONTROL_BULK: u64 = 1 << 20;
/// All the bulk strings of one reply together, unless one bulk string may be longer.
const CONTROL_TOTAL: u64 = 16 << 20;
/// Elements of one reply, nested ones included (a `SCAN` page has about a thousand).
const MAX_ELEMENTS: u64 = 1 << 18;
/// Nesting of arrays (`CLUSTER SLOTS` uses three levels).
const MAX_DEPTH: u32 = 8;
/// A status, error or integer line, or a length.
const MAX_LINE: usize = 64 << 10;
/// Bytes read from the stream at once, and the most taken for a bulk string before its bytes
/// arrive.
const CHUNK: usize = 64 << 10;

/// What [`is_too_long`] looks for in an error.
const TOO_LONG: &str = "UMBP: the remote's reply is longer than it may be";

thread_local! {
    static BULK_LIMIT: Cell<u64> = const { Cell::new(CONTROL_BULK) };
}

/// Runs `f` with bulk strings of up to `limit` bytes allowed on this thread (at least
/// [`CONTROL_BULK`]); the bound in force before is restored afterwards.
pub(crate) fn with_bulk_limit<R>(limit: u64, f: impl FnOnce() -> R) -> R {
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            BULK_LIMIT.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(BULK_LIMIT.with(|l| l.replace(limit.max(CONTROL_BULK))));
    f()
}

/// Whether `e` (or a pipeline's error that lists it) is a reply refused for its length.
pub(crate) fn is_too_long(e: &RedisError) -> bool {
    e.to_string().contains(TOO_LONG)
}

fn too_long(what: String) -> RedisError {
    RedisError::from((ErrorKind::Parse, TOO_LONG, what))
}

fn protocol(what: String) -> RedisError {
    RedisError::from((ErrorKind::Parse, "the remote's reply is not RESP2", what))
}

/// What one reply may still take.
struct Budget {
    bulk: u64,
    total: u64,
    elements: u64,
}

/// Reads replies from a byte stream, buffered.
#[derive(Debug)]
pub(crate) struct Reader {
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

impl Default for Reader {
    fn default() -> Self {
        Reader {
            buf: vec![0; CHUNK].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }
}

impl Reader {
    /// The next reply from `src`. An error of the stream or of the reply's form leaves the
    /// stream unusable (the caller drops the connection); a server's error reply is a value
    /// (`Value::ServerError`), as the `redis` crate gives it.
    pub(crate) fn reply(&mut self, src: &mut impl Read) -> RedisResult<Value> {
        let bulk = BULK_LIMIT.with(Cell::get);
        let mut b = Budget {
            bulk,
            total: bulk.max(CONTROL_TOTAL),
            elements: MAX_ELEMENTS,
        };
        self.value(src, &mut b, 0)
    }

    fn fill(&mut self, src: &mut impl Read) -> io::Result<()> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let n = loop {
            match src.read(&mut self.buf[self.end..]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r?,
            }
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the remote closed the connection in the middle of a reply",
            ));
        }
        self.end += n;
        Ok(())
    }

    /// One line without its CRLF, at most [`MAX_LINE`] bytes.
    fn line(&mut self, src: &mut impl Read) -> RedisResult<Vec<u8>> {
        let mut seen = 0;
        loop {
            let window = &self.buf[self.start + seen..self.end];
            if let Some(i) = window.iter().position(|&c| c == b'\n') {
                let at = self.start + seen + i;
                if at == self.start || self.buf[at - 1] != b'\r' {
                    return Err(protocol("a line ends without CRLF".into()));
                }
                let line = self.buf[self.start..at - 1].to_vec();
                self.start = at + 1;
                return Ok(line);
            }
            seen = self.end - self.start;
            if seen >= MAX_LINE {
                return Err(too_long(format!("a line of over {MAX_LINE} bytes")));
            }
            if self.start > 0 && self.end == self.buf.len() {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            self.fill(src)?;
        }
    }

    fn number(&mut self, src: &mut impl Read) -> RedisResult<i64> {
        let line = self.line(src)?;
        std::str::from_utf8(&line)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| protocol(format!("{:?} is not a number", lossy(&line))))
    }

    /// `n` bytes and the CRLF after them, taken as they arrive.
    fn bulk(&mut self, src: &mut impl Read, n: usize) -> RedisResult<Vec<u8>> {
        let mut out = Vec::with_capacity(n.min(CHUNK));
        while out.len() < n {
            if self.start == self.end {
                self.fill(src)?;
            }
            let take = (n - out.len()).min(self.end - self.start);
            out.extend_from_slice(&self.buf[self.start..self.start + take]);
            self.start += take;
        }
        while self.end - self.start < 2 {
            self.fill(src)?;
        }
        if &self.buf[self.start..self.start + 2] != b"\r\n" {
            return Err(protocol("a bulk string is longer than declared".into()));
        }
        self.start += 2;
        Ok(out)
    }

    fn value(&mut self, src: &mut impl Read, b: &mut Budget, depth: u32) -> RedisResult<Value> {
        if self.start == self.end {
            self.fill(src)?;
        }
        let kind = self.buf[self.start];
        self.start += 1;
        match kind {
            b'+' => {
                let line = self.line(src)?;
                Ok(if line == b"OK" {
                    Value::Okay
                } else {
                    Value::SimpleString(lossy(&line))
                })
            }
            b'-' => {
                // The crate's own parser, on this one bounded line: its error kinds (MOVED,
                // ASK, ...) are what the cluster client acts on.
                let mut raw = vec![b'-'];
                raw.extend(self.line(src)?);
                raw.extend_from_slice(b"\r\n");
                redis::parse_redis_value(&raw)
            }
            b':' => Ok(Value::Int(self.number(src)?)),
            b'$' => {
                let n = self.number(src)?;
                if n < 0 {
                    return Ok(Value::Nil);
                }
                let n = n as u64;
                if n > b.bulk || n > b.total {
                    return Err(too_long(format!(
                        "a bulk string of {n} bytes, where {} are allowed (the largest object a registered layout holds, and its header)",
                        b.bulk.min(b.total)
                    )));
                }
                b.total -= n;
                Ok(Value::BulkString(self.bulk(src, n as usize)?))
            }
            b'*' => {
                let n = self.number(src)?;
                if n < 0 {
                    return Ok(Value::Nil);
                }
                let n = n as u64;
                if n > b.elements || depth >= MAX_DEPTH {
                    return Err(too_long(format!(
                        "an array of {n} elements at depth {depth} ({} elements and {MAX_DEPTH} levels allowed)",
                        b.elements
                    )));
                }
                b.elements -= n;
                let mut items = Vec::with_capacity((n as usize).min(1024));
                for _ in 0..n {
                    items.push(self.value(src, b, depth + 1)?);
                }
                Ok(Value::Array(items))
            }
            other => Err(protocol(format!(
                "a reply starts with {:?}; UMBP speaks RESP2 to the remote",
                other as char
            ))),
        }
    }
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream that hands out at most `step` bytes per read.
    struct Trickle<'a> {
        data: &'a [u8],
        step: usize,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
            let n = self.step.min(out.len()).min(self.data.len());
            out[..n].copy_from_slice(&self.data[..n]);
            self.data = &self.data[n..];
            Ok(n)
        }
    }

    fn all(data: &[u8], step: usize) -> Vec<RedisResult<Value>> {
        let mut src = Trickle { data, step };
        let mut r = Reader::default();
        let mut out = Vec::new();
        while !src.data.is_empty() || r.start < r.end {
            let v = r.reply(&mut src);
            let stop = v.is_err();
            out.push(v);
            if stop {
                break;
            }
        }
        out
    }

    #[test]
    fn reads_every_resp2_kind_however_it_is_split() {
        let big = vec![b'x'; 200_000];
        let mut data = b"+OK\r\n+PONG\r\n:-42\r\n$-1\r\n*-1\r\n$0\r\n\r\n".to_vec();
        data.extend(format!("${}\r\n", big.len()).bytes());
        data.extend(&big);
        data.extend(b"\r\n*2\r\n$3\r\nabc\r\n*1\r\n:7\r\n-MOVED 3999 127.0.0.1:6381\r\n");
        for step in [1, 3, 4096, usize::MAX] {
            let got: Vec<Value> = all(&data, step).into_iter().map(|v| v.unwrap()).collect();
            assert_eq!(got.len(), 9, "step {step}");
            assert_eq!(got[0], Value::Okay);
            assert_eq!(got[1], Value::SimpleString("PONG".into()));
            assert_eq!(got[2], Value::Int(-42));
            assert_eq!((&got[3], &got[4]), (&Value::Nil, &Value::Nil));
            assert_eq!(got[5], Value::BulkString(Vec::new()));
            assert_eq!(got[6], Value::BulkString(big.clone()));
            assert_eq!(
                got[7],
                Value::Array(vec![
                    Value::BulkString(b"abc".to_vec()),
                    Value::Array(vec![Value::Int(7)])
                ])
            );
            let e = format!("{:?}", got[8]);
            assert!(
                matches!(got[8], Value::ServerError(_)) && e.contains("3999"),
                "{e}"
            );
        }
    }

    #[test]
    fn a_declared_length_past_the_bound_is_refused_before_anything_is_taken() {
        // Only the header arrives: the refusal does not wait for (or allocate) the bytes.
        let r = all(b"$536870912\r\n", usize::MAX);
        assert!(is_too_long(r[0].as_ref().unwrap_err()), "{r:?}");
        let r = with_bulk_limit(4 << 20, || all(b"$4194305\r\n", usize::MAX));
        assert!(is_too_long(r[0].as_ref().unwrap_err()));
        // Within the bound, the value is read.
        let mut data = b"$3000000\r\n".to_vec();
        data.extend(vec![7u8; 3_000_000]);
        data.extend(b"\r\n");
        let r = with_bulk_limit(4 << 20, || all(&data, 1 << 20));
        assert!(matches!(&r[0], Ok(Value::BulkString(v)) if v.len() == 3_000_000));
        // And the bound is back to the control one afterwards.
        assert!(is_too_long(all(&data, 1 << 20)[0].as_ref().unwrap_err()));
    }

    #[test]
    fn arrays_lines_and_totals_are_bounded() {
        let r = all(b"*1000000000\r\n", usize::MAX);
        assert!(is_too_long(r[0].as_ref().unwrap_err()));
        let deep = "*1\r\n".repeat(20) + ":1\r\n";
        assert!(is_too_long(
            all(deep.as_bytes(), usize::MAX)[0].as_ref().unwrap_err()
        ));
        let long = format!("+{}\r\n", "a".repeat(MAX_LINE + 10));
        assert!(is_too_long(
            all(long.as_bytes(), 999)[0].as_ref().unwrap_err()
        ));
        // 20 bulk strings of 1 MiB: each allowed, together past the 16 MiB a reply may hold.
        let mut data = b"*20\r\n".to_vec();
        for _ in 0..20 {
            data.extend(format!("${}\r\n", CONTROL_BULK).bytes());
            data.extend(vec![0u8; CONTROL_BULK as usize]);
            data.extend(b"\r\n");
        }
        assert!(is_too_long(all(&data, 1 << 20)[0].as_ref().unwrap_err()));
    }

    #[test]
    fn malformed_replies_are_errors_not_panics() {
        for bad in [
            &b"?what\r\n"[..],
            b"$3\r\nabcdef\r\n",
            b":12x\r\n",
            b"+no cr\n",
            b"$5\r\nab",
            b"%1\r\n",
        ] {
            let r = all(bad, 2);
            assert!(r.last().unwrap().is_err(), "{bad:?}: {r:?}");
        }
    }
}
