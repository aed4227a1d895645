//! Running a server: binding its sockets, creating the pool, serving gRPC, the side channel
//! and metrics until told to stop, then draining and releasing everything.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umbp_store::EmbeddedStore;

use crate::budget::{self, Budget};
use crate::config::ServerConfig;
use crate::error::ServerError;
use crate::state::State;
use crate::{handover, listen, metrics, metrics_port, service, sessions, side};

/// The descriptor budgets of a server of `cfg` (see `budget`): the process's limit, raised
/// to its hard limit, less a reserve for the server's own files (its disk segments among
/// them); half of it per uid unless `--max-fds-per-uid` says otherwise.
fn descriptor_budget(cfg: &ServerConfig) -> (Arc<Budget>, usize) {
    let limit = budget::raise_nofile();
    let disk = cfg
        .store
        .disk
        .as_ref()
        .map_or(0, |d| 2 * d.max_segments() as usize + 8);
    let reserve = budget::RESERVE + metrics_port::MAX_CONNECTIONS + disk;
    let total = limit.saturating_sub(reserve).max(64);
    let per_uid = cfg.max_fds_per_uid.unwrap_or(total / 2).clamp(1, total);
    (Budget::new(total, per_uid), limit)
}

/// Serves until `shutdown` resolves, then stops: new transfers are refused, in-flight ones
/// get `shutdown_grace` to finish, then every session is released, the socket files are
/// removed and the pool is closed.
pub async fn serve(
    mut cfg: ServerConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), ServerError> {
    if cfg.take_over {
        // A server that took a pool over can hand it on to the next one.
        cfg.hand_over = true;
    }
    if cfg.hand_over {
        cfg.store.pool.backing = umbp_core::MemoryBacking::Memfd;
    }
    cfg.store.validate()?;
    let path = cfg.endpoint.path().to_path_buf();
    let fd_path = cfg.endpoint.fd_socket();
    let t = Instant::now();
    // A pool handed over (through an exec or systemd's store, or asked of the running server)
    // is adopted before binding: the running server holds the endpoint until it has let go.
    let handed = match handover::inherited() {
        Some(h) => Some((h, None)),
        None if cfg.take_over => {
            // What a store's start measures (the host copy, ~0.1-0.3 s) is measured before
            // the running server is asked to stop, not while nobody serves.
            let workers = cfg.store.num_workers;
            let _ = tokio::task::spawn_blocking(move || {
                umbp_copy::memcpy::calibrate(workers);
            })
            .await;
            let p = path.clone();
            match tokio::task::spawn_blocking(move || handover::take_over(&p)).await {
                Ok(Some((h, stream))) => Some((h, Some(stream))),
                _ => None,
            }
        }
        None => None,
    };
    let mut early = None;
    if let Some((h, stream)) = handed {
        tracing::info!(
            asked_ms = t.elapsed().as_millis() as u64,
            "the pool to take over arrived"
        );
        early = Some(adopt_or_new(&cfg, h, t)?);
        if let Some(stream) = stream {
            let _ = tokio::task::spawn_blocking(move || {
                handover::finish_taking(stream, Duration::from_secs(30))
            })
            .await;
        }
    }
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
    let ho_path = handover::socket_path(&path);
    let ho_listener = if cfg.hand_over {
        // The server's own user only (and root): whoever takes the pool gets every object.
        match listen::bind(&ho_path, 0o600) {
            Ok(l) => Some(l),
            Err(e) => {
                listen::unlink_if_ours(&path, listener_ino);
                listen::unlink_if_ours(&fd_path, fd_ino);
                return Err(e);
            }
        }
    } else {
        None
    };
    let ho_ino = listen::inode(&ho_path);
    let unlink = || {
        listen::unlink_if_ours(&path, listener_ino);
        listen::unlink_if_ours(&fd_path, fd_ino);
        listen::unlink_if_ours(&ho_path, ho_ino);
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
    let (store, generation) = match early {
        Some((s, g)) => (Arc::new(s), g),
        None => match EmbeddedStore::new(cfg.store.clone()) {
            Ok(s) => (Arc::new(s), 0),
            Err(e) => {
                unlink();
                return Err(e.into());
            }
        },
    };
    let (budget, nofile) = descriptor_budget(&cfg);
    let lookups = match crate::lookup_pool::LookupPool::new(lookup_threads(&cfg)) {
        Ok(l) => l,
        Err(e) => {
            unlink();
            return Err(ServerError::Config(format!(
                "cannot start the lookup threads: {e}"
            )));
        }
    };
    let (fds_total, fds_per_uid) = budget.limits();
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
        budget: Arc::clone(&budget),
        lookups,
    });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    if let Some(addr) = cfg.metrics_address {
        let l = match metrics_port::bind(addr, cfg.metrics_allow_remote).await {
            Ok(l) => l,
            Err(e) => {
                unlink();
                return Err(e);
            }
        };
        let st = Arc::clone(&state);
        let render: metrics_port::Render =
            Arc::new(move || (st.metrics.render(&st.gauges()), metrics::CONTENT_TYPE));
        tracing::info!(%addr, "Prometheus metrics at http://{addr}/metrics");
        tasks.push(tokio::spawn(metrics_port::serve(
            l,
            render,
            stop_rx.clone(),
        )));
    }
    tasks.push(tokio::spawn(sweep(Arc::clone(&budget), stop_rx.clone())));
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
        fds_for_clients = fds_total,
        fds_per_uid,
        rlimit_nofile = nofile,
        "UMBP standalone server ready"
    );
    let on_close: listen::OnClose = {
        let s = Arc::clone(&sessions);
        Arc::new(move |conn| s.end_connection(conn))
    };
    let (conn_tx, conn_rx) = tokio::sync::mpsc::channel(64);
    tasks.push(tokio::spawn(listen::accept_loop(
        listener,
        listen::Acceptor {
            budget: Arc::clone(&budget),
            access: cfg.access.clone(),
            on_close,
        },
        conn_tx,
        stop_rx.clone(),
    )));
    let incoming = tokio_stream::wrappers::ReceiverStream::new(conn_rx);
    let svc = umbp_proto::v1::store_server::StoreServer::new(service::Service {
        state: Arc::clone(&state),
    })
    .max_decoding_message_size(cfg.max_message_bytes)
    .max_encoding_message_size(cfg.max_message_bytes);
    let (taker_tx, mut taker_rx) = tokio::sync::mpsc::channel::<std::os::unix::net::UnixStream>(1);
    if let Some(l) = ho_listener {
        tasks.push(tokio::spawn(accept_takers(
            l,
            cfg.access.own_uid,
            taker_tx,
            stop_rx.clone(),
        )));
    }
    let taker: Arc<parking_lot::Mutex<Option<std::os::unix::net::UnixStream>>> = Arc::default();
    let (grace_tx, grace_rx) = tokio::sync::oneshot::channel::<()>();
    let drain = {
        let state = Arc::clone(&state);
        let taker = Arc::clone(&taker);
        async move {
            tokio::select! {
                _ = shutdown => {}
                Some(s) = taker_rx.recv() => {
                    tracing::info!("a new server asks to take the pool over");
                    *taker.lock() = Some(s);
                }
            }
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
    let taker = taker.lock().take();
    if taker.is_none() {
        unlink();
    }
    let st = Arc::clone(&sessions);
    let _ = tokio::task::spawn_blocking(move || st.end_all()).await;
    state.lookups.close();
    let t_stop = Instant::now();
    match taker {
        Some(stream) => {
            let s = Arc::clone(&store);
            let given = tokio::task::spawn_blocking(move || {
                let g = handover::give(&stream, &s, generation);
                (g, stream)
            })
            .await;
            match given {
                Ok((handover::Given::Taken, stream)) => {
                    // Gone from the endpoint before the taker (waiting for this connection
                    // to close) binds it.
                    unlink();
                    drop(stream);
                    tracing::info!(
                        took_ms = t_stop.elapsed().as_millis() as u64,
                        "the pool was handed over; stopped"
                    );
                    return result;
                }
                Ok((handover::Given::Refused(why), _)) => {
                    tracing::warn!("the pool was not handed over: {why}");
                    unlink();
                }
                Ok((handover::Given::Orphaned { pool, image }, _)) => {
                    tracing::error!(
                        "the new server went before it took the pool; running this server \
                         again with it"
                    );
                    let why = handover::reexec_adopting(&pool, &image);
                    tracing::error!("{why}; the pool is lost");
                    unlink();
                }
                Err(e) => {
                    tracing::error!("the hand-over failed: {e}");
                    unlink();
                }
            }
        }
        None if cfg.hand_over && handover::under_systemd() => {
            match handover::park_in_systemd(&store, generation) {
                Ok(n) => tracing::info!(
                    objects = n,
                    took_ms = t_stop.elapsed().as_millis() as u64,
                    "the pool is in systemd's descriptor store for the next start"
                ),
                Err(why) => tracing::warn!("the pool was not kept for the next start: {why}"),
            }
        }
        None => {}
    }
    store.close();
    tracing::info!("stopped");
    result
}

/// A store around a pool handed over (`h`), or an empty one when there is none or it cannot
/// be used (logged with the reason), and its hand-over generation.
fn adopt_or_new(
    cfg: &ServerConfig,
    h: Result<handover::Handed, String>,
    t: Instant,
) -> Result<(EmbeddedStore, u64), ServerError> {
    match h {
        Ok(h) => match EmbeddedStore::adopt(cfg.store.clone(), h.pool, &h.image) {
            Ok((s, got)) => {
                tracing::info!(
                    objects = got.objects,
                    bytes = got.bytes,
                    pinned = got.pinned,
                    generation = got.generation,
                    took_ms = t.elapsed().as_millis() as u64,
                    "took over the pool of {}",
                    h.from
                );
                return Ok((s, got.generation));
            }
            Err(e) => tracing::warn!("{e}; starting with an empty pool"),
        },
        Err(why) => {
            tracing::warn!("could not take a pool over: {why}; starting with an empty pool")
        }
    }
    Ok((EmbeddedStore::new(cfg.store.clone())?, 0))
}

/// Accepts takers on the hand-over socket: the server's own user or root, with the request
/// line; the first one is handed to `tx` (the server then stops and hands its pool over).
async fn accept_takers(
    l: tokio::net::UnixListener,
    own_uid: u32,
    tx: tokio::sync::mpsc::Sender<std::os::unix::net::UnixStream>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        let conn = tokio::select! {
            _ = stop.changed() => return,
            c = l.accept() => c,
        };
        let Ok((conn, _)) = conn else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        let Ok(std_conn) = conn.into_std() else {
            continue;
        };
        let ok = tokio::task::spawn_blocking(move || {
            let uid = umbp_unix::peer::peer_credentials(&std_conn).map(|c| c.uid);
            let allowed = matches!(uid, Ok(u) if u == own_uid || u == 0);
            if !allowed {
                tracing::warn!(?uid, "refused a hand-over request from another user");
                return None;
            }
            let _ = std_conn.set_nonblocking(false);
            handover::read_request(&std_conn).then_some(std_conn)
        })
        .await;
        if let Ok(Some(s)) = ok {
            let _ = tx.send(s).await;
            return;
        }
    }
}

/// Lookup threads: a quarter of the cores (one to four), which leaves the rest to the copy
/// workers; eight with a remote or disk tier, where a lookup may wait on the network or the
/// drive.
fn lookup_threads(cfg: &ServerConfig) -> usize {
    if cfg.store.remote.is_some() || cfg.store.disk.is_some() {
        return 8;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / 4).clamp(1, 4)
}

/// Closes silent connections past their deadline, and refused ones once they were told,
/// every 100 ms until `stop` changes.
async fn sweep(budget: Arc<Budget>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {
                budget.handshakes.expire();
            }
        }
    }
}
