//! The opt-in Prometheus endpoint (`--metrics-address`): `GET /metrics` over TCP, answered by
//! hyper's HTTP/1 server with the text `crate::metrics` renders. Any local uid can reach it, so
//! it is held to a few descriptors of the server's reserve and can neither exhaust the server
//! nor spin it:
//!
//! - at most [`MAX_CONNECTIONS`] connections at once; past that nothing more is accepted
//!   (connections wait in the kernel's backlog, holding no descriptor of the server's);
//! - a connection has [`REQUEST_DEADLINE`] in all to send its request and take the answer,
//!   however it trickles its bytes, then it is closed;
//! - a failed `accept` (out of descriptors, say) is retried after a pause, logged at most once
//!   a second.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONNECTION, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

use crate::ratelog::{RateLimited, ACCEPT_BACKOFF};

/// Connections of the metrics port open at once, at most: 16.
pub(crate) const MAX_CONNECTIONS: usize = 16;
/// How long one connection may take, request and answer together: 5 s.
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// Bytes of a request head read at most: 8 KiB (hyper's smallest read buffer).
const MAX_HEAD: usize = 8192;
/// Header lines of a request read at most.
const MAX_HEADERS: usize = 32;

/// What a scrape answers: the body and its content type.
pub(crate) type Render = Arc<dyn Fn() -> (String, &'static str) + Send + Sync>;

static ACCEPT_FAILED: RateLimited = RateLimited::new();

/// Serves `GET /metrics` on `listener` until `stop` changes; every other path is a 404.
pub(crate) async fn serve(
    listener: TcpListener,
    render: Render,
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

/// Answers one request on `sock` (hyper's HTTP/1 server, no keep-alive), then closes it.
async fn answer(sock: TcpStream, render: Render) {
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let render = Arc::clone(&render);
        async move { Ok::<_, Infallible>(respond(&req, &render)) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        .max_buf_size(MAX_HEAD)
        .max_headers(MAX_HEADERS)
        .serve_connection(TokioIo::new(sock), service)
        .await;
}

fn respond(req: &Request<Incoming>, render: &Render) -> Response<Full<Bytes>> {
    let (status, body, content_type) =
        if req.method() == Method::GET && req.uri().path() == "/metrics" {
            let (body, content_type) = render();
            (StatusCode::OK, body, content_type)
        } else {
            (
                StatusCode::NOT_FOUND,
                "only GET /metrics is served here\n".to_string(),
                "text/plain; charset=utf-8",
            )
        };
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(
        CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    h.insert(CONNECTION, hyper::header::HeaderValue::from_static("close"));
    r
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
