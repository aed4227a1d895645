//! Handing the pool's memory and index to another process ([`Pool::hand_over`]), and taking
//! them over ([`Pool::adopt`]): a server upgraded in place keeps every object without a copy
//! (the image format and its checks are in [`crate::image`]).

use std::os::fd::OwnedFd;
use std::sync::atomic::Ordering;

use umbp_core::PoolConfig;

use super::inner::{owner_tag, shard_of};
use super::types::Adopted;
use super::Pool;
use crate::image::{Geometry, Image, Record};
use crate::region::Region;
use crate::PoolError;

fn refuse(reason: impl Into<String>) -> PoolError {
    PoolError::Image {
        reason: reason.into(),
    }
}

impl Pool {
    /// The geometry a pool taking this one over must have.
    pub fn geometry(&self) -> Geometry {
        Geometry {
            region_bytes: self.inner.region.len() as u64,
            capacity: self.inner.capacity,
            segment_bytes: self.inner.alloc.lock().segment_bytes(),
        }
    }

    /// Closes the pool (reservations are refused from now on, the evictor stops) and returns
    /// its memory (a new descriptor of its memfd) with its image: every committed object, by
    /// shard in eviction order, with its checksum and what its pin has left.
    ///
    /// The caller must have stopped every writer first: a reservation not committed by now is
    /// not in the image, and the taker may hand its slot to another object. Readers may go on
    /// (the memory stays mapped here until the pool is dropped). Fails when the pool is not
    /// memfd-backed (`MemoryBacking::Memfd`): anonymous memory cannot be handed over.
    pub fn hand_over(&self, generation: u64) -> Result<(OwnedFd, Image), PoolError> {
        let fd = self
            .memfd()
            .ok_or_else(|| {
                refuse(
                    "the pool's memory is anonymous; only a memfd-backed pool (dram_backing \
                     memfd, the server's --hand-over) can be handed over",
                )
            })?
            .try_clone()
            .map_err(|e| refuse(format!("cannot duplicate the pool's memfd: {e}")))?;
        let geometry = self.geometry();
        self.close();
        // Every shard at once, so the image is one instant of the index.
        let shards: Vec<_> = self.inner.shards.iter().map(|s| s.write()).collect();
        let mut records = Vec::with_capacity(shards.iter().map(|s| s.live()).sum());
        for shard in &shards {
            for idx in shard.live_ids() {
                let e = shard.entry(idx);
                records.push(Record {
                    key: e.key,
                    slot: e.slot,
                    len: e.len,
                    sum: shard.sum(idx),
                    pin_ms: shard.keep_left_ms(idx),
                    place: Some(shard.place(idx)),
                });
            }
        }
        Ok((
            fd,
            Image {
                generation,
                geometry,
                records,
            },
        ))
    }

    /// A pool of `cfg` over memory another pool handed over (`memfd`, with its `image`
    /// bytes): every object of the image is served from where it is, byte for byte, in the
    /// same eviction order (each in the queue it held, with its use count), pinned ones
    /// pinned for the time they had left. Refuses (and maps
    /// nothing further) an image it cannot trust or a geometry not its own; the error says
    /// why and what to change, and the caller starts an empty pool instead.
    pub fn adopt(
        cfg: PoolConfig,
        memfd: OwnedFd,
        image: &[u8],
    ) -> Result<(Pool, Adopted), PoolError> {
        let region = Region::adopt(&cfg, memfd)?;
        let pool = Pool::with_region(cfg, region)?;
        let img = Image::decode(image, pool.geometry()).map_err(refuse)?;
        let inner = &pool.inner;
        let mut got = Adopted {
            generation: img.generation + 1,
            objects: 0,
            bytes: 0,
            pinned: 0,
        };
        // Oldest first across every shard, so each queue's order is the giver's pool-wide
        // (a format-1 image has no ranks: its order is kept).
        let mut records: Vec<&Record> = img.records.iter().collect();
        records.sort_by_key(|r| r.place.map_or(0, |p| p.rank));
        for r in records {
            let fp = r.key.fingerprint();
            let si = shard_of(fp);
            // The shard's lock before the allocator's, as commits take them.
            let mut shard = inner.shards[si].write();
            if shard.find(&r.key, fp).is_some() {
                return Err(refuse("the image lists a key twice: it is inconsistent"));
            }
            let mut alloc = inner.alloc.lock();
            if alloc.claim(r.slot).is_none() {
                return Err(refuse(format!(
                    "the image's object at offset {} ({} bytes) overlaps another or does not \
                     fit the allocator: it is inconsistent",
                    r.slot.offset, r.slot.bytes
                )));
            }
            let tick = inner.tick.fetch_add(1, Ordering::Relaxed);
            let idx = shard.insert_placed(r.key, fp, r.slot, r.len, tick, r.place);
            shard.set_sum(idx, r.sum);
            alloc.set_owner(r.slot, owner_tag(si, idx));
            drop(alloc);
            if r.pin_ms > 0 && shard.keep(idx, r.pin_ms) == umbp_core::PinOutcome::Pinned {
                got.pinned += 1;
            }
            got.objects += 1;
            got.bytes += r.len;
        }
        inner
            .counters
            .objects
            .fetch_add(got.objects, Ordering::Relaxed);
        Ok((pool, got))
    }
}
