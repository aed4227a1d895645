//! The opt-in Prometheus endpoint (`--metrics-address`): `GET /metrics` over TCP, which any
//! local uid can reach, so it is held to a few descriptors of the server's reserve and can
//! neither exhaust the server nor spin it:
//!
//! - at most [`MAX_CONNECTIONS`] connections at once; past that nothing more is accepted
//!   (connections wait in the kernel's backlog, holding no descriptor of the server's);
//! - a connection has [`REQUEST_DEADLINE`] in all to send its request and take the answer,
//!   however it trickles its bytes, then it is closed;
//! - a failed `accept` (out of descriptors, say) is retried after a pause, logged at most once
//!   a second.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::ratelog::{RateLimited, ACCEPT_BACKOFF};

/// Connections of the metrics port open at once, at most: 16.
pub(crate) const MAX_CONNECTIONS: usize = 16;
/// How long one connection may take, request and answer together: 5 s.
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// Bytes of a request head read at most: 8 KiB.
const MAX_HEAD: usize = 8192;

static ACCEPT_FAILED: RateLimited = RateLimited::new();

/// Serves `GET /metrics` on `listener` until `stop` changes; every other path is a 404.
pub(crate) async fn serve(
    listener: TcpListener,
    render: Arc<dyn Fn() -> String + Send + Sync>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        // A free slot first: a full house leaves new connections in the backlog.
        let slot = tokio::select! {
            _ = stop.changed() => return,
            s = Arc::clone(&slots).acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => return,
            },
        };
        let accepted = tokio::select! {
            _ = stop.changed() => return,
            a = listener.accept() => a,
        };
        let sock = match accepted {
            Ok((sock, _)) => sock,
            Err(e) => {
                ACCEPT_FAILED.log(|skipped| {
                    tracing::warn!(
                        skipped,
                        "metrics port: accept failed: {e}; retrying in 100 ms"
                    );
                });
                drop(slot);
                tokio::time::sleep(ACCEPT_BACKOFF).await;
                continue;
            }
        };
        let render = Arc::clone(&render);
        tokio::spawn(async move {
            let _ = tokio::time::timeout(REQUEST_DEADLINE, answer(sock, render)).await;
            drop(slot);
        });
    }
}

/// Reads one request head and answers it.
async fn answer(mut sock: TcpStream, render: Arc<dyn Fn() -> String + Send + Sync>) {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut n = 0;
    while n < buf.len() && !buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
        match sock.read(&mut buf[n..]).await {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    let req = String::from_utf8_lossy(&buf[..n]);
    let path = req.split_whitespace().nth(1).unwrap_or("");
    let (status, body) =
        if req.starts_with("GET ") && (path == "/metrics" || path.starts_with("/metrics?")) {
            ("200 OK", render())
        } else {
            (
                "404 Not Found",
                "only GET /metrics is served here\n".to_string(),
            )
        };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = sock.write_all(head.as_bytes()).await;
    let _ = sock.write_all(body.as_bytes()).await;
    let _ = sock.shutdown().await;
}

/// Binds the metrics listener, refusing a non-loopback address unless allowed.
pub(crate) async fn bind(
    addr: SocketAddr,
    allow_remote: bool,
) -> Result<TcpListener, crate::error::ServerError> {
    if !addr.ip().is_loopback() && !allow_remote {
        return Err(crate::error::ServerError::Config(format!(
            "--metrics-address {addr} is not a loopback address; pass --metrics-allow-remote to expose metrics beyond this host"
        )));
    }
    TcpListener::bind(addr)
        .await
        .map_err(|e| crate::error::ServerError::Config(format!("--metrics-address {addr}: {e}")))
}
