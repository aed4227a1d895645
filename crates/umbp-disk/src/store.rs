//! The object store proper (no threads of its own): the index of keys to places on disk, the
//! segments, writing an object now, reading one back, removing, clearing, and rebuilding the
//! index from the directory at start-up.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use std::os::fd::OwnedFd;
use umbp_core::BlockKey;

use umbp_unix::file;
use umbp_unix::safedir::SafeDir;
use umbp_unix::UnixError;

use crate::buf::AlignedBuf;
use crate::config::DiskConfig;
use crate::error::DiskError;
use crate::format::{self, Bad, Record, HEADER_BYTES};
use crate::segment::{self, Segment};
use crate::stats::{add, Counters, DiskStats};

/// The lock file that keeps a second process out of the directory.
pub(crate) const LOCK_FILE: &str = "umbp-disk.lock";
/// At most one warning per this long about failing writes or reads.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// Where an object lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Loc {
    seg: u64,
    offset: u64,
    len: u64,
}

/// The segment being filled.
#[derive(Debug)]
struct Active {
    seg: Arc<Segment>,
    used: u64,
}

/// What reading one key came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadOutcome {
    /// Read, checked and taken by the sink.
    Hit,
    /// Not on disk, or the sink did not take it.
    Miss,
}

/// The store. Locks are taken in the order active → segments → index.
#[derive(Debug)]
pub(crate) struct Store {
    pub cfg: DiskConfig,
    seg_bytes: u64,
    index: RwLock<HashMap<BlockKey, Loc>>,
    segments: Mutex<BTreeMap<u64, Arc<Segment>>>,
    used_bytes: AtomicU64,
    active: Mutex<Option<Active>>,
    next_id: AtomicU64,
    direct: AtomicBool,
    pub c: Counters,
    closed: AtomicBool,
    last_warn: Mutex<Option<Instant>>,
    /// The directory, by descriptor: every file is opened relative to it.
    dir: Arc<SafeDir>,
    /// Held open for the lock.
    _lock: OwnedFd,
}

/// Why the directory (or a file of it) is refused, as [`DiskError::Dir`] says it: the
/// problem, on the path it concerns when that is not the directory itself.
fn refusal(dir: &std::path::Path, e: &UnixError) -> String {
    match e {
        UnixError::Untrusted { path, why } if path == dir => why.clone(),
        UnixError::Untrusted { path, why } => format!("{} {why}", path.display()),
        e => format!(
            "cannot be written ({e}); make it writable by this user or choose another directory"
        ),
    }
}

impl Store {
    /// Opens (creating when missing) the directory, takes its lock, checks the space, rebuilds
    /// the index from the segments found and goes on filling the newest of them, or starts a
    /// fresh segment where there is none with room (so a directory that cannot be written
    /// fails here).
    pub fn open(cfg: DiskConfig) -> Result<Store, DiskError> {
        cfg.validate()?;
        let dir = cfg.dir.clone();
        let dir_err = |why: String| DiskError::Dir {
            dir: dir.clone(),
            why,
        };
        // Checked from / down and opened once; nothing below is reached by path again.
        let sdir = Arc::new(SafeDir::open(&dir, true).map_err(|e| dir_err(refusal(&dir, &e)))?);
        let lock = sdir
            .open_lock(LOCK_FILE)
            .map_err(|e| dir_err(refusal(&dir, &e)))?;
        if !file::try_lock_exclusive(&lock)
            .map_err(|e| dir_err(format!("cannot be locked ({e})")))?
        {
            return Err(DiskError::InUse { dir });
        }
        if SafeDir::has_openat2() == Some(false) {
            log::info!(
                "disk tier {}: the kernel has no openat2 (ENOSYS); files are opened with openat and O_NOFOLLOW instead",
                dir.display()
            );
        }
        let t = Instant::now();
        let store = Store {
            seg_bytes: cfg.effective_segment_bytes(),
            cfg,
            index: RwLock::new(HashMap::new()),
            segments: Mutex::new(BTreeMap::new()),
            used_bytes: AtomicU64::new(0),
            active: Mutex::new(None),
            next_id: AtomicU64::new(1),
            direct: AtomicBool::new(false),
            c: Counters::default(),
            closed: AtomicBool::new(false),
            last_warn: Mutex::new(None),
            dir: sdir,
            _lock: lock,
        };
        let newest_end = store.rebuild()?;
        let took = t.elapsed();
        let space = file::fs_space(&*store.dir).map_err(|e| dir_err(format!("fstatvfs: {e}")))?;
        if space.read_only {
            return Err(dir_err(
                "is on a read-only file system; choose a writable directory".into(),
            ));
        }
        let segments_found = store.segments.lock().len();
        let used = store.used_bytes.load(Ordering::Relaxed);
        if store.cfg.capacity_bytes > space.available.saturating_add(used) {
            return Err(DiskError::NoSpace {
                dir: store.cfg.dir.clone(),
                capacity: store.cfg.capacity_bytes,
                available: space.available,
                used,
            });
        }
        // Restarts go on filling the newest segment: a fresh one at every start would drop
        // the oldest of a full tier each time, and leave a lightly used one mostly empty.
        let active = match newest_end.and_then(|end| store.resume(end)) {
            Some(active) => active,
            None => {
                // A first segment now: an unwritable directory or a full disk fails start-up.
                let seg = store.new_segment().map_err(|e| {
                    dir_err(format!(
                        "cannot be written ({e}); make it writable by this user or choose another directory"
                    ))
                })?;
                Active { seg, used: 0 }
            }
        };
        *store.active.lock() = Some(active);
        let objects = store.index.read().len() as u64;
        add(&store.c.rebuilt_objects, objects);
        add(&store.c.rebuild_us, took.as_micros() as u64);
        log::info!(
            "disk tier {}: {} objects in {} segments ({:.1} GiB of {:.1} GiB) rebuilt in {:.1} ms; {} I/O, segments of {} MiB",
            store.cfg.dir.display(),
            objects,
            segments_found,
            used as f64 / (1u64 << 30) as f64,
            store.cfg.capacity_bytes as f64 / (1u64 << 30) as f64,
            took.as_secs_f64() * 1e3,
            if store.direct.load(Ordering::Relaxed) { "direct (O_DIRECT)" } else { "buffered (the file system refuses O_DIRECT)" },
            store.seg_bytes >> 20
        );
        Ok(store)
    }

    /// Reads every segment's index file into the index; drops segments without a usable one,
    /// and the oldest while they exceed the capacity. Returns where the newest segment's last
    /// indexed object ends (`None` without segments).
    fn rebuild(&self) -> Result<Option<u64>, DiskError> {
        let names = self.dir.names().map_err(|source| DiskError::Io {
            what: "listing",
            path: self.cfg.dir.clone(),
            source,
        })?;
        let mut ids: BTreeMap<u64, (bool, bool)> = BTreeMap::new();
        for name in names {
            if let Some((id, is_idx)) = segment::parse_name(&name) {
                let slot = ids.entry(id).or_default();
                if is_idx {
                    slot.1 = true;
                } else {
                    slot.0 = true;
                }
            }
        }
        let mut index = self.index.write();
        let mut segs = self.segments.lock();
        let mut ends = HashMap::new();
        for (&id, &(dat, idx)) in &ids {
            self.next_id.fetch_max(id + 1, Ordering::Relaxed);
            let (d, i) = segment::names(id);
            if !(dat && idx) {
                let _ = self.dir.remove(&d);
                let _ = self.dir.remove(&i);
                continue;
            }
            let (seg, records) = Segment::open(&self.dir, id, self.cfg.direct_io)?;
            self.direct.store(seg.file.is_direct(), Ordering::Relaxed);
            let Some(records) = records else {
                log::warn!(
                    "disk tier: {} has no readable index of this version; dropping the segment",
                    seg.dat.display()
                );
                seg.drop_files();
                continue;
            };
            let mut keys = Vec::with_capacity(records.len());
            let mut end = 0;
            for r in records {
                if r.offset + format::extent(r.len) > seg.bytes {
                    continue;
                }
                end = end.max(r.offset + format::extent(r.len));
                index.insert(
                    r.key,
                    Loc {
                        seg: id,
                        offset: r.offset,
                        len: r.len,
                    },
                );
                keys.push(r.key);
            }
            *seg.keys.lock() = keys;
            self.used_bytes.fetch_add(seg.bytes, Ordering::Relaxed);
            segs.insert(id, Arc::new(seg));
            ends.insert(id, end);
        }
        while self.used_bytes.load(Ordering::Relaxed) > self.cfg.capacity_bytes {
            let Some((_, oldest)) = segs.pop_first() else {
                break;
            };
            self.drop_segment(&oldest, &mut index);
        }
        Ok(segs
            .last_key_value()
            .and_then(|(id, _)| ends.get(id).copied()))
    }

    /// The newest segment as the one to fill, from `end` on (where its last indexed object
    /// ends: bytes past it belong to no record, a torn write at most). `None` when it is of
    /// another size than segments are made now, has no room left, or its index file cannot
    /// be appended to (logged; a fresh segment is made instead).
    fn resume(&self, end: u64) -> Option<Active> {
        let seg = Arc::clone(self.segments.lock().last_key_value()?.1);
        if seg.bytes != self.seg_bytes || end + format::extent(1) > seg.bytes {
            return None;
        }
        if let Err(e) = seg.resume() {
            log::warn!("disk tier: not resuming {}: {e}", seg.dat.display());
            return None;
        }
        Some(Active { seg, used: end })
    }

    /// A new segment, after dropping the oldest ones as far as it needs room.
    fn new_segment(&self) -> Result<Arc<Segment>, DiskError> {
        {
            let mut segs = self.segments.lock();
            while self.used_bytes.load(Ordering::Relaxed) + self.seg_bytes > self.cfg.capacity_bytes
            {
                let Some((_, oldest)) = segs.pop_first() else {
                    break;
                };
                let mut index = self.index.write();
                self.drop_segment(&oldest, &mut index);
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let seg = Arc::new(Segment::create(
            &self.dir,
            id,
            self.seg_bytes,
            self.cfg.direct_io,
        )?);
        self.direct.store(seg.file.is_direct(), Ordering::Relaxed);
        self.used_bytes.fetch_add(seg.bytes, Ordering::Relaxed);
        self.segments.lock().insert(id, Arc::clone(&seg));
        Ok(seg)
    }

    /// Drops `seg` (already out of `segments`) and its keys from `index`.
    fn drop_segment(&self, seg: &Segment, index: &mut HashMap<BlockKey, Loc>) {
        let keys = seg.drop_files();
        let mut n = 0;
        for k in keys {
            if index.get(&k).is_some_and(|l| l.seg == seg.id) {
                index.remove(&k);
                n += 1;
            }
        }
        self.used_bytes.fetch_sub(seg.bytes, Ordering::Relaxed);
        add(&self.c.segments_evicted, 1);
        add(&self.c.objects_evicted, n);
    }

    /// Whether the index holds `key`.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.read().contains_key(key)
    }

    /// Which of `keys` the index holds.
    pub fn contains_many(&self, keys: &[BlockKey]) -> Vec<bool> {
        let index = self.index.read();
        keys.iter().map(|k| index.contains_key(k)).collect()
    }

    /// Writes `key`'s object of `data` now, through `buf`. `Ok(false)` when the key is on disk
    /// already. Failures are counted (`write_errors`).
    pub fn write(
        &self,
        key: &BlockKey,
        data: &[u8],
        buf: &mut AlignedBuf,
    ) -> Result<bool, DiskError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(DiskError::Closed);
        }
        if self.contains(key) {
            return Ok(false);
        }
        let len = data.len() as u64;
        let ext = format::extent(len);
        if ext > self.seg_bytes {
            return Err(DiskError::TooLarge {
                len,
                segment: self.seg_bytes - HEADER_BYTES,
            });
        }
        let r = self.write_extent(key, data, ext, buf);
        if let Err(e) = &r {
            add(&self.c.write_errors, 1);
            self.warn(&format!("disk tier: a write failed: {e}"));
        }
        r
    }

    fn write_extent(
        &self,
        key: &BlockKey,
        data: &[u8],
        ext: u64,
        buf: &mut AlignedBuf,
    ) -> Result<bool, DiskError> {
        let (seg, offset) = self.reserve(ext)?;
        let b = &mut buf.get(ext as usize)[..ext as usize];
        format::encode_header(b, key, data);
        let h = HEADER_BYTES as usize;
        b[h..h + data.len()].copy_from_slice(data);
        b[h + data.len()..].fill(0);
        seg.file
            .write_all_at(b, offset)
            .map_err(|source| DiskError::Io {
                what: "writing",
                path: seg.dat.clone(),
                source,
            })?;
        let len = data.len() as u64;
        seg.append(&Record {
            key: *key,
            offset,
            len,
        })?;
        let mut index = self.index.write();
        if !seg.alive.load(Ordering::Acquire) {
            return Ok(false);
        }
        index.insert(
            *key,
            Loc {
                seg: seg.id,
                offset,
                len,
            },
        );
        seg.keys.lock().push(*key);
        drop(index);
        add(&self.c.writes, 1);
        add(&self.c.bytes_written, len);
        Ok(true)
    }

    /// Room for `ext` bytes: the active segment and the offset, starting a new segment when it
    /// is full.
    fn reserve(&self, ext: u64) -> Result<(Arc<Segment>, u64), DiskError> {
        let mut a = self.active.lock();
        if let Some(act) = a.as_mut() {
            if act.used + ext <= act.seg.bytes && act.seg.alive.load(Ordering::Acquire) {
                let off = act.used;
                act.used += ext;
                return Ok((Arc::clone(&act.seg), off));
            }
        }
        *a = None;
        let seg = self.new_segment()?;
        *a = Some(Active {
            seg: Arc::clone(&seg),
            used: ext,
        });
        Ok((seg, 0))
    }

    /// Reads `key`'s object through `buf` and hands its checked bytes to `sink` (which says
    /// whether it took them). A damaged object is counted, logged and dropped from the index.
    pub fn read(
        &self,
        key: &BlockKey,
        buf: &mut AlignedBuf,
        sink: &dyn Fn(&BlockKey, &[u8]) -> bool,
    ) -> ReadOutcome {
        let Some(loc) = self.index.read().get(key).copied() else {
            return ReadOutcome::Miss;
        };
        let Some(seg) = self.segments.lock().get(&loc.seg).cloned() else {
            return ReadOutcome::Miss;
        };
        let ext = format::extent(loc.len) as usize;
        let b = &mut buf.get(ext)[..ext];
        match seg.file.read_at(b, loc.offset) {
            Ok(n) if n == ext => {}
            Ok(n) => {
                self.damaged(key, loc, &seg, &format!("short read ({n} of {ext} bytes)"));
                return ReadOutcome::Miss;
            }
            Err(e) => {
                add(&self.c.read_errors, 1);
                self.warn(&format!(
                    "disk tier: reading {} failed: {e}",
                    seg.dat.display()
                ));
                return ReadOutcome::Miss;
            }
        }
        match format::verify(b, key, loc.len) {
            Ok(data) => {
                if sink(key, data) {
                    add(&self.c.hits, 1);
                    add(&self.c.bytes_read, loc.len);
                    ReadOutcome::Hit
                } else {
                    ReadOutcome::Miss
                }
            }
            Err(bad) => {
                let why = match bad {
                    Bad::Header => "bad header",
                    Bad::Key => "another key",
                    Bad::Length => "another length",
                    Bad::Checksum => "checksum mismatch",
                };
                self.damaged(key, loc, &seg, why);
                ReadOutcome::Miss
            }
        }
    }

    fn damaged(&self, key: &BlockKey, loc: Loc, seg: &Segment, why: &str) {
        add(&self.c.corrupt, 1);
        log::warn!(
            "disk tier: object {key:?} at {} offset {}: {why}; a miss, dropped from the index",
            seg.dat.display(),
            loc.offset
        );
        let mut index = self.index.write();
        if index.get(key) == Some(&loc) {
            index.remove(key);
        }
    }

    /// Flips the bits of `mask` in byte `offset` of `key`'s object in its segment file (the
    /// data file, through an ordinary descriptor, synced); whether the disk held the key.
    /// Damage for tests of the integrity checks only.
    #[doc(hidden)]
    pub fn debug_corrupt(&self, key: &BlockKey, offset: u64, mask: u8) -> Result<bool, DiskError> {
        use std::os::unix::fs::FileExt;
        let Some(loc) = self.index.read().get(key).copied() else {
            return Ok(false);
        };
        let Some(seg) = self.segments.lock().get(&loc.seg).cloned() else {
            return Ok(false);
        };
        let at = loc.offset + HEADER_BYTES + offset % loc.len.max(1);
        let flip = || -> std::io::Result<()> {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&seg.dat)?;
            let mut b = [0u8];
            f.read_exact_at(&mut b, at)?;
            b[0] ^= mask;
            f.write_all_at(&b, at)?;
            f.sync_data()
        };
        flip().map_err(|source| DiskError::Fs {
            what: "damaging an object (a test's hook)",
            path: seg.dat.clone(),
            source,
        })?;
        Ok(true)
    }

    /// Forgets `key` (its bytes stay until its segment is dropped). Whether it was held.
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.index.write().remove(key).is_some()
    }

    /// Forgets every key `matches` accepts (their bytes stay until their segments are dropped);
    /// how many.
    pub fn remove_where(&self, matches: impl Fn(&BlockKey) -> bool) -> u64 {
        let mut index = self.index.write();
        let before = index.len();
        index.retain(|k, _| !matches(k));
        (before - index.len()) as u64
    }

    /// Drops every segment and starts an empty one; how many objects were dropped.
    pub fn clear(&self) -> u64 {
        let mut a = self.active.lock();
        *a = None;
        let n = {
            let mut segs = self.segments.lock();
            let mut index = self.index.write();
            let n = index.len() as u64;
            for (_, seg) in std::mem::take(&mut *segs) {
                self.drop_segment(&seg, &mut index);
            }
            index.clear();
            n
        };
        match self.new_segment() {
            Ok(seg) => *a = Some(Active { seg, used: 0 }),
            Err(e) => self.warn(&format!("disk tier: after clearing: {e}")),
        }
        n
    }

    /// Whether [`Store::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Refuses writes from now on.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
    }

    /// Lets another tier open the directory (once no thread writes any more): a closed store
    /// may be kept alive by its owners' handles.
    pub fn release_lock(&self) {
        if let Err(e) = file::unlock(&self._lock) {
            self.warn(&format!("disk tier: releasing the directory's lock: {e}"));
        }
    }

    /// A snapshot of the counters and sizes.
    pub fn stats(&self) -> DiskStats {
        DiskStats {
            capacity_bytes: self.cfg.capacity_bytes,
            used_bytes: self.used_bytes.load(Ordering::Relaxed),
            objects: self.index.read().len() as u64,
            direct_io: u64::from(self.direct.load(Ordering::Relaxed)),
            ..self.c.snapshot()
        }
    }

    /// Logs `msg` as a warning unless one was logged in the last [`WARN_EVERY`].
    pub fn warn(&self, msg: &str) {
        let mut last = self.last_warn.lock();
        if last.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
            *last = Some(Instant::now());
            log::warn!("{msg} (further failures within 10 s are only counted)");
        }
    }
}
