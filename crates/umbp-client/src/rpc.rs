//! The gRPC side of the client: its runtime, the channel to the server's socket, one call
//! with a deadline, and how a failed call's status becomes a [`ClientError`].

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::Runtime;
use tonic::transport::{Channel, Endpoint as TonicEndpoint};
use tonic::Status;
use umbp_proto::v1::store_client::StoreClient;
use umbp_proto::{errors, Endpoint};

use crate::error::{ClientError, Result};
use crate::options::ClientOptions;
use crate::peer;

/// The client's runtime. One runtime thread: the request, the connection and the answer stay
/// on it, so a transfer costs the fewest thread wake-ups (measured on the H200 host, a 4 KiB
/// transfer's round trip beyond the server's own time: 2 threads 180-225 µs, 1 thread
/// 130-165 µs).
pub(crate) fn runtime() -> Result<Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("umbp-client")
        .enable_all()
        .build()
        .map_err(ClientError::Runtime)
}

/// The gRPC client of the server at `opts.endpoint`, on a channel of `rt` that keeps its
/// current connection's descriptor in `socket`.
pub(crate) fn store_client(
    rt: &Runtime,
    opts: &ClientOptions,
    socket: &CurrentSocket,
) -> StoreClient<Channel> {
    let channel = {
        let _g = rt.enter();
        channel_with(&opts.endpoint, Arc::clone(socket))
    };
    StoreClient::new(channel)
        .max_decoding_message_size(opts.max_message_bytes)
        .max_encoding_message_size(opts.max_message_bytes)
}

/// Runs one RPC of `grpc` on `rt` with a deadline; `name` names it in errors. When it fails
/// because the session is gone, `on_session_lost` runs before the error is returned.
pub(crate) fn call<T, F, Fut>(
    rt: &Runtime,
    grpc: &StoreClient<Channel>,
    endpoint: &Endpoint,
    name: &'static str,
    timeout: Duration,
    f: F,
    on_session_lost: impl FnOnce(),
) -> Result<T>
where
    F: FnOnce(StoreClient<Channel>) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, Status>>,
{
    let fut = f(grpc.clone());
    match rt.block_on(async { tokio::time::timeout(timeout, fut).await }) {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => {
            if session_lost(&s) {
                on_session_lost();
            }
            Err(status_error(name, endpoint, s))
        }
        Err(_) => Err(ClientError::Timeout {
            what: name,
            ms: timeout.as_millis() as u64,
        }),
    }
}

/// The error of a call the server (or the connection) failed with `s`, by the kind the
/// server sent: the server or the connection gone is [`ClientError::Disconnected`], anything
/// else a refusal of that kind.
pub(crate) fn status_error(call: &'static str, endpoint: &Endpoint, s: Status) -> ClientError {
    ClientError::from_server(
        call,
        endpoint,
        errors::kind_of_status(&s),
        s.message().to_string(),
    )
}

/// A gRPC channel to the server at `endpoint` over its Unix socket, connected lazily (for
/// tools that speak the protocol directly). Must be called inside a Tokio runtime.
pub fn unix_channel(endpoint: &Endpoint) -> Channel {
    channel_with(endpoint, Arc::default())
}

/// A descriptor of the channel's current connection (a duplicate), so that [`close`] can
/// shut the socket down: the server then sees the connection end and releases the session
/// at once, even while calls of this client are still in flight.
///
/// [`close`]: crate::StandaloneClient::close
pub(crate) type CurrentSocket = Arc<Mutex<Option<OwnedFd>>>;

fn channel_with(endpoint: &Endpoint, current: CurrentSocket) -> Channel {
    let path = endpoint.path().to_path_buf();
    TonicEndpoint::from_static("http://umbp.invalid")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector_lazy(tower::service_fn(move |_| {
            let (path, current) = (path.clone(), Arc::clone(&current));
            async move {
                let s = tokio::net::UnixStream::connect(&path).await?;
                // Nothing goes to a process of another user (a reconnection too).
                peer::check_server(s.as_fd(), &path).map_err(|e| {
                    std::io::Error::new(std::io::ErrorKind::PermissionDenied, e.to_string())
                })?;
                // The channel makes one connection at a time: a new one replaces the last.
                *current.lock() = Some(s.as_fd().try_clone_to_owned()?);
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
}

/// Shuts down the socket `current` holds a descriptor of (both directions: every call on it
/// fails, and the server sees the connection end).
pub(crate) fn shut_down(current: &CurrentSocket) {
    if let Some(fd) = current.lock().take() {
        let _ = std::os::unix::net::UnixStream::from(fd).shutdown(std::net::Shutdown::Both);
    }
}

/// Whether a failed call means the session is gone (the server must be attached again): the
/// server forgot it, or the server or the connection went away.
pub(crate) fn session_lost(s: &Status) -> bool {
    errors::kind_of_status(s).is_disconnect()
}
