//! The client process (`umbp bench server-client`): registers its cache with the server and
//! runs the parent's commands, answering when each began and finished.

use std::io::{BufRead, Write};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use umbp_client::{ClientOptions, StandaloneClient};
use umbp_core::{KeyBuilder, RankTopology};
use umbp_cuda::Device;
use umbp_proto::completion::monotonic_ns;
use umbp_proto::Endpoint;

use super::args::ClientArgs;
use super::cache::{key_sets, move_sets, Cache, Shape, WAIT};

/// `umbp bench server-client`: registers its cache, says `ready`, then runs one command per
/// line of stdin (`store`, `load`, `verify-store`: store then overwrite the loaded half,
/// `verify-load`: load then check it, `quit`), answering `done <start ns> <end ns>`.
pub fn run_client(a: &ClientArgs) -> Result<()> {
    let r = client_main(a);
    if let Err(e) = &r {
        println!("error client {}: {e:#}", a.id);
    }
    r
}

pub(super) fn client_main(a: &ClientArgs) -> Result<()> {
    let shape = Shape {
        blocks: a.blocks,
        layers: a.layers,
        piece: a.piece_bytes,
    };
    let dev = if a.cuda {
        let d = Device::open(a.device)?;
        // This thread fills, clears and reads the cache back.
        d.bind_thread()?;
        Some(d)
    } else {
        None
    };
    let mut cache = Cache::new(&shape, a.id, dev.as_ref())?;
    let mut opts = ClientOptions::new(Endpoint::parse(&a.endpoint)?);
    opts.client_name = format!("umbp bench server client {}", a.id);
    opts.transfer_timeout = WAIT;
    opts.completion_page = !a.replies_only;
    opts.transfer_channel = !a.replies_only && !a.no_channel;
    let client = StandaloneClient::connect(opts)?;
    match &mut cache {
        Cache::Host(h) => {
            let shm = h.fd.take().expect("a new buffer has its memfd");
            client.register_shared_host(shm)?;
        }
        Cache::Cuda { buf, .. } => {
            // SAFETY: `buf` stays allocated until after the client is closed.
            unsafe { client.register_cuda_memory(buf.ptr(), buf.len()) }?;
        }
    }
    let layout = client.register_layout(vec![shape.layer_specs(cache.base())])?;
    let kb = KeyBuilder::new(&a.namespace, RankTopology::default())?;
    let sets = key_sets(&kb, a.id, a.in_flight.max(1), shape.blocks)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut line = String::new();
    let stdin = std::io::stdin();
    loop {
        line.clear();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let cmd = line.trim();
        let (store, verify) = match cmd {
            "store" => (true, false),
            "load" => (false, false),
            "verify-store" => (true, true),
            "verify-load" => (false, true),
            "quit" => break,
            c => bail!("unknown command {c:?} from the parent"),
        };
        let t0 = monotonic_ns();
        let trs = move_sets(&client, (layout.id, &shape), store, &sets, WAIT)?;
        let t1 = monotonic_ns();
        let tm = trs[0]
            .timing()
            .context("an answered transfer has its timing")?;
        if verify {
            if store {
                cache.clobber(&shape)?;
            } else {
                cache.verify(&shape)?;
            }
        }
        let by_page = trs
            .iter()
            .filter(|t| t.timing().is_some_and(|t| t.completion_page));
        // µs, or -1 where the transfer did not record it.
        let us = |d: Option<Duration>| d.map_or(-1, |d| d.as_micros() as i64);
        writeln!(
            out,
            "done {t0} {t1} {} {} {} {} {} {}",
            tm.round_trip.as_micros(),
            tm.server.as_micros(),
            tm.copy.as_micros(),
            by_page.count(),
            us(tm.to_server),
            us(tm.to_caller),
        )?;
        out.flush()?;
    }
    client.close();
    drop(cache);
    Ok(())
}
