//! Running a server: binding its sockets, creating the pool, serving gRPC, the side channel
//! and metrics until told to stop, then draining and releasing everything.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_stream::StreamExt;
use umbp_store::EmbeddedStore;

use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::state::State;
use crate::{listen, metrics, ratelog, service, sessions, side};

/// Serves until `shutdown` resolves, then stops: new transfers are refused, in-flight ones
/// get `shutdown_grace` to finish, then every session is released, the socket files are
/// removed and the pool is closed.
pub async fn serve(
    cfg: ServerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    cfg.store.validate()?;
    let path = cfg.endpoint.path().to_path_buf();
    let fd_path = cfg.endpoint.fd_socket();
    let listener = listen::bind(&path, cfg.socket_mode)?;
    let listener_ino = listen::inode(&path);
    let fd_listener = match listen::bind(&fd_path, cfg.socket_mode) {
        Ok(l) => l,
        Err(e) => {
            listen::unlink_if_ours(&path, listener_ino);
            return Err(e);
        }
    };
    let fd_ino = listen::inode(&fd_path);
    let unlink = || {
        listen::unlink_if_ours(&path, listener_ino);
        listen::unlink_if_ours(&fd_path, fd_ino);
    };
    if let Some(g) = cfg.access.allow_gid {
        for p in [&path, &fd_path] {
            if let Err(e) = std::os::unix::fs::chown(p, None, Some(g)) {
                unlink();
                return Err(ServerError::Config(format!(
                    "cannot give {} to group {g}: {e}",
                    p.display()
                )));
            }
        }
    }
    let t = Instant::now();
    let store = match EmbeddedStore::new(cfg.store.clone()) {
        Ok(s) => Arc::new(s),
        Err(e) => {
            unlink();
            return Err(e.into());
        }
    };
    let boot_id = umbp_core::key::hex(&sessions::random_bytes()[..8]);
    let m = Arc::new(metrics::Metrics::default());
    let sessions = Arc::new(sessions::Sessions::new(Arc::clone(&store), Arc::clone(&m)));
    let state = Arc::new(State {
        store: Arc::clone(&store),
        sessions: Arc::clone(&sessions),
        metrics: Arc::clone(&m),
        boot_id: boot_id.clone(),
        started: Instant::now(),
        access: cfg.access.clone(),
        endpoint: cfg.endpoint.clone(),
        max_message_bytes: cfg.max_message_bytes,
        busy_poll: cfg.busy_poll,
        draining: AtomicBool::new(false),
        in_flight: AtomicU64::new(0),
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    if let Some(addr) = cfg.metrics_address {
        let l = match metrics::bind(addr, cfg.metrics_allow_remote).await {
            Ok(l) => l,
            Err(e) => {
                unlink();
                return Err(e);
            }
        };
        let st = Arc::clone(&state);
        let render: Arc<dyn Fn() -> String + Send + Sync> =
            Arc::new(move || st.metrics.render(&st.gauges()));
        tracing::info!(%addr, "Prometheus metrics at http://{addr}/metrics");
        tasks.push(tokio::spawn(metrics::serve(l, render, stop_rx.clone())));
    }
    tasks.push(tokio::spawn(side::serve(
        fd_listener,
        Arc::clone(&state),
        stop_rx.clone(),
    )));
    let p = store.stats()?;
    tracing::info!(
        address = %cfg.endpoint,
        boot_id = %boot_id,
        capacity_bytes = p.capacity_bytes,
        placement = ?p.placement,
        workers = cfg.store.num_workers,
        took_ms = t.elapsed().as_millis() as u64,
        "UMBP standalone server ready"
    );
    let on_close: listen::OnClose = {
        let s = Arc::clone(&sessions);
        Arc::new(move |conn| s.end_connection(conn))
    };
    static ACCEPT_FAILED: ratelog::RateLimited = ratelog::RateLimited::new();
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener)
        .then(move |r| {
            let accepted = r.and_then(|s| listen::accept(s, Arc::clone(&on_close)));
            async move {
                if let Err(e) = &accepted {
                    ACCEPT_FAILED.log(|skipped| {
                        tracing::warn!(skipped, "accept failed: {e}; retrying in 100 ms");
                    });
                    // Out of descriptors, say: wait for some to close rather than spin.
                    tokio::time::sleep(ratelog::ACCEPT_BACKOFF).await;
                }
                accepted
            }
        })
        .filter_map(|r| r.ok().map(Ok::<_, std::io::Error>));
    let svc = umbp_proto::v1::store_server::StoreServer::new(service::Service {
        state: Arc::clone(&state),
    })
    .max_decoding_message_size(cfg.max_message_bytes)
    .max_encoding_message_size(cfg.max_message_bytes);
    let (grace_tx, grace_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = {
        let state = Arc::clone(&state);
        async move {
            shutdown.await;
            tracing::info!("stopping: new transfers are refused, in-flight ones finish");
            state.draining.store(true, Ordering::Release);
            let _ = grace_tx.send(());
        }
    };
    let server = tonic::transport::Server::builder()
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, drain);
    tokio::pin!(server);
    let served = tokio::select! {
        r = &mut server => Some(r),
        _ = grace_rx => None,
    };
    let result = match served {
        Some(r) => r.map_err(|e| ServerError::Serve(e.to_string())),
        None => {
            // The graceful shutdown waits for connections to end, and clients keep theirs
            // open: give in-flight transfers the grace period, then stop regardless.
            let deadline = Instant::now() + cfg.shutdown_grace;
            while state.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let left = state.in_flight.load(Ordering::Acquire);
            if left > 0 {
                tracing::warn!(
                    transfers = left,
                    "grace period over: cancelling transfers still in flight"
                );
            }
            match tokio::time::timeout(Duration::from_millis(100), &mut server).await {
                Ok(r) => r.map_err(|e| ServerError::Serve(e.to_string())),
                Err(_) => Ok(()),
            }
        }
    };
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    unlink();
    let st = Arc::clone(&sessions);
    let _ = tokio::task::spawn_blocking(move || st.end_all()).await;
    store.close();
    tracing::info!("stopped");
    result
}
