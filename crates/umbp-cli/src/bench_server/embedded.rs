//! The embedded baseline and the ceiling: the same caches and moves through one in-process
//! store, and plain copies of the same pieces.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use umbp_core::{BlockKey, GroupLayout, KeyBuilder, KvLayout, RankTopology};
use umbp_cuda::Device;
use umbp_store::{EmbeddedStore, Session};

use super::cache::{key_sets, move_sets, Cache, Run, Shape, WAIT};

/// Embedded mode: one session and one cache per client, in this process.
pub(super) struct EmbeddedRun<'s> {
    pub(super) store: &'s EmbeddedStore,
    pub(super) shape: Shape,
    pub(super) vs: Vec<Virtual>,
}

pub(super) struct Virtual {
    /// Declared before the cache: released first.
    pub(super) session: Session,
    pub(super) layout: u32,
    /// One key set per transfer in flight.
    pub(super) sets: Vec<Vec<BlockKey>>,
    pub(super) cache: Cache,
}

impl<'s> EmbeddedRun<'s> {
    pub(super) fn new(
        r: &Run<'_>,
        store: &'s EmbeddedStore,
        dev: Option<&Arc<Device>>,
    ) -> Result<Self> {
        let kb = KeyBuilder::new("bench-server-embedded", RankTopology::default())?;
        let mut vs = Vec::with_capacity(r.clients);
        for id in 0..r.clients as u32 {
            let cache = Cache::new(&r.shape, id, dev)?;
            let session = store.open_session()?;
            match (&cache, dev) {
                (Cache::Host(h), _) => {
                    // SAFETY: `cache` outlives the session (dropped after it, see `Virtual`).
                    unsafe { session.register_memory(h.addr, h.len) }?;
                }
                (Cache::Cuda { buf, .. }, Some(d)) => {
                    // SAFETY: as above.
                    unsafe { session.register_cuda_memory(buf.ptr(), buf.len(), d.ordinal()) }?;
                }
                (Cache::Cuda { .. }, None) => unreachable!("CUDA caches need a device"),
            }
            let layout = session.register_layout(KvLayout::new(vec![GroupLayout::new(
                r.shape.layer_specs(cache.base()),
            )?])?)?;
            vs.push(Virtual {
                session,
                layout,
                sets: key_sets(&kb, id, r.a.in_flight, r.shape.blocks)?,
                cache,
            });
        }
        if dev.is_some() {
            ensure!(
                store.wait_pool_registered(Duration::from_secs(300)),
                "the embedded pool's CUDA registration did not finish in 300 s"
            );
        }
        Ok(EmbeddedRun {
            store,
            shape: r.shape,
            vs,
        })
    }

    /// Every client's job of one direction at once; seconds from the first submit to the
    /// last finish.
    pub(super) fn direction(&self, store_dir: bool) -> Result<f64> {
        let barrier = Barrier::new(self.vs.len());
        let times: Vec<Result<(Instant, Instant)>> = std::thread::scope(|s| {
            let hs: Vec<_> = self
                .vs
                .iter()
                .map(|v| {
                    let barrier = &barrier;
                    s.spawn(move || -> Result<(Instant, Instant)> {
                        barrier.wait();
                        let t0 = Instant::now();
                        let (layout, shape) = (v.layout, &self.shape);
                        move_sets(&v.session, (layout, shape), store_dir, &v.sets, WAIT)?;
                        Ok((t0, Instant::now()))
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("a benchmark thread panicked"))
                .collect()
        });
        let times: Vec<(Instant, Instant)> = times.into_iter().collect::<Result<_>>()?;
        let first = times
            .iter()
            .map(|t| t.0)
            .min()
            .expect("one client at least");
        let last = times
            .iter()
            .map(|t| t.1)
            .max()
            .expect("one client at least");
        Ok((last - first).as_secs_f64())
    }

    pub(super) fn round(&self, verify: bool) -> Result<(f64, f64)> {
        let s = self.direction(true)?;
        if verify {
            for v in &self.vs {
                v.cache.clobber(&self.shape)?;
            }
        }
        let l = self.direction(false)?;
        if verify {
            for v in &self.vs {
                v.cache.verify(&self.shape)?;
            }
        }
        self.store.clear()?;
        Ok((s, l))
    }
}

/// The ceiling: one thread per client copying that client's stored half of every layer into
/// its loaded half (the same bytes in the same pieces as a transfer moves), once per transfer
/// in flight, in the embedded run's host caches. Seconds of (libc memcpy, streaming copy).
pub(super) fn ceiling_round(emb: &EmbeddedRun<'_>, passes: u32) -> (f64, f64) {
    let shape = emb.shape;
    let half = (shape.blocks * shape.piece) as usize;
    let piece = shape.piece as usize;
    let run = |streaming: bool| -> f64 {
        let t0 = Instant::now();
        std::thread::scope(|s| {
            for v in &emb.vs {
                let Cache::Host(h) = &v.cache else { continue };
                s.spawn(move || {
                    let m = h.bytes_mut();
                    for l in (0..passes).flat_map(|_| 0..shape.layers) {
                        let at = shape.layer_offset(l) as usize;
                        let (src, dst) = m[at..at + 2 * half].split_at_mut(half);
                        for (dp, sp) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                            if streaming {
                                // SAFETY: equal-length pieces of two disjoint halves.
                                unsafe {
                                    umbp_copy::memcpy::copy(dp.as_mut_ptr(), sp.as_ptr(), dp.len())
                                };
                            } else {
                                dp.copy_from_slice(sp);
                            }
                        }
                    }
                    umbp_copy::memcpy::fence();
                });
            }
        });
        t0.elapsed().as_secs_f64()
    };
    (run(false), run(true))
}
