//! Segment files: `seg-<id>.dat` holds objects back to back (each a header block and its
//! bytes, every offset 4 KiB-aligned), `seg-<id>.idx` one record per object written in it.
//! A segment is filled by appending, never rewritten, and dropped whole.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use umbp_core::BlockKey;
use umbp_unix::file::IoFile;

use crate::error::DiskError;
use crate::format::{self, Record};

/// The file names of segment `id`.
pub(crate) fn names(dir: &Path, id: u64) -> (PathBuf, PathBuf) {
    (
        dir.join(format!("seg-{id:016x}.dat")),
        dir.join(format!("seg-{id:016x}.idx")),
    )
}

/// The segment id a file name carries, and whether it is the index (`.idx`) or data file.
pub(crate) fn parse_name(name: &str) -> Option<(u64, bool)> {
    let rest = name.strip_prefix("seg-")?;
    let (hex, idx) = if let Some(h) = rest.strip_suffix(".dat") {
        (h, false)
    } else {
        (rest.strip_suffix(".idx")?, true)
    };
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok().map(|id| (id, idx))
}

/// One segment.
#[derive(Debug)]
pub(crate) struct Segment {
    pub id: u64,
    pub file: IoFile,
    /// Its data file's length (what it takes of the capacity).
    pub bytes: u64,
    pub dat: PathBuf,
    idx_path: PathBuf,
    /// The index file, appended to (`None` for a segment found at start-up: never written).
    idx: Mutex<Option<File>>,
    /// False once dropped: objects written to it late are not indexed.
    pub alive: AtomicBool,
    /// The keys indexed in it (to drop from the index with it).
    pub keys: Mutex<Vec<BlockKey>>,
}

impl Segment {
    /// Creates segment `id` in `dir`: a data file of `bytes` reserved on the device and an
    /// index file with its header. A failure leaves no file behind.
    pub fn create(dir: &Path, id: u64, bytes: u64, direct: bool) -> Result<Segment, DiskError> {
        let (dat, idx_path) = names(dir, id);
        let made = (|| {
            let file = IoFile::open(&dat, true, direct).map_err(|source| DiskError::Io {
                what: "creating",
                path: dat.clone(),
                source,
            })?;
            file.reserve(bytes).map_err(|source| DiskError::Io {
                what: "reserving space for",
                path: dat.clone(),
                source,
            })?;
            let mut idx = File::options()
                .create(true)
                .truncate(true)
                .write(true)
                .open(&idx_path)
                .and_then(|mut f| f.write_all(&format::idx_header(bytes)).map(|()| f))
                .map_err(|source| DiskError::Fs {
                    what: "creating",
                    path: idx_path.clone(),
                    source,
                })?;
            idx.flush().ok();
            Ok((file, idx))
        })();
        match made {
            Ok((file, idx)) => Ok(Segment {
                id,
                file,
                bytes,
                dat,
                idx_path,
                idx: Mutex::new(Some(idx)),
                alive: AtomicBool::new(true),
                keys: Mutex::new(Vec::new()),
            }),
            Err(e) => {
                let _ = std::fs::remove_file(&dat);
                let _ = std::fs::remove_file(&idx_path);
                Err(e)
            }
        }
    }

    /// Opens segment `id` found at start-up, with the records of its index file (`None` when
    /// the index is missing, unreadable or of another version).
    pub fn open(
        dir: &Path,
        id: u64,
        direct: bool,
    ) -> Result<(Segment, Option<Vec<Record>>), DiskError> {
        let (dat, idx_path) = names(dir, id);
        let file = IoFile::open(&dat, false, direct).map_err(|source| DiskError::Io {
            what: "opening",
            path: dat.clone(),
            source,
        })?;
        let bytes = file.len().map_err(|source| DiskError::Io {
            what: "reading the size of",
            path: dat.clone(),
            source,
        })?;
        let records = std::fs::read(&idx_path)
            .ok()
            .and_then(|b| format::parse_idx(&b));
        let seg = Segment {
            id,
            file,
            bytes,
            dat,
            idx_path,
            idx: Mutex::new(None),
            alive: AtomicBool::new(true),
            keys: Mutex::new(Vec::new()),
        };
        Ok((seg, records))
    }

    /// Makes a segment found at start-up take objects again (the newest goes on filling
    /// rather than a fresh one being made at every start): its index file is reopened for
    /// appending, cut back to whole records first (a torn last append would misalign every
    /// record after it).
    pub fn resume(&self) -> Result<(), DiskError> {
        let fs = |source| DiskError::Fs {
            what: "reopening",
            path: self.idx_path.clone(),
            source,
        };
        let f = File::options()
            .append(true)
            .open(&self.idx_path)
            .map_err(fs)?;
        let len = f.metadata().map_err(fs)?.len();
        let (head, rec) = (format::IDX_HEADER_BYTES as u64, format::RECORD_BYTES as u64);
        if len < head {
            return Err(DiskError::Fs {
                what: "reopening",
                path: self.idx_path.clone(),
                source: std::io::Error::other("shorter than its header"),
            });
        }
        f.set_len(head + (len - head) / rec * rec).map_err(fs)?;
        *self.idx.lock() = Some(f);
        Ok(())
    }

    /// Appends `rec` to the index file (after the object's bytes are written).
    pub fn append(&self, rec: &Record) -> Result<(), DiskError> {
        let mut idx = self.idx.lock();
        let f = idx.as_mut().ok_or(DiskError::Closed)?;
        f.write_all(&rec.encode()).map_err(|source| DiskError::Fs {
            what: "appending to",
            path: self.idx_path.clone(),
            source,
        })
    }

    /// Marks the segment dropped and removes its files (readers holding it may finish: the
    /// open descriptor keeps the data). Returns its keys.
    pub fn drop_files(&self) -> Vec<BlockKey> {
        self.alive.store(false, Ordering::Release);
        let _ = std::fs::remove_file(&self.dat);
        let _ = std::fs::remove_file(&self.idx_path);
        std::mem::take(&mut *self.keys.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let (d, i) = names(Path::new("/x"), 0x2a);
        let dn = d.file_name().unwrap().to_str().unwrap();
        let inm = i.file_name().unwrap().to_str().unwrap();
        assert_eq!(dn, "seg-000000000000002a.dat");
        assert_eq!(parse_name(dn), Some((42, false)));
        assert_eq!(parse_name(inm), Some((42, true)));
        assert_eq!(parse_name("seg-2a.dat"), None);
        assert_eq!(parse_name("umbp-disk.lock"), None);
    }
}
