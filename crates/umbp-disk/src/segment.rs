//! Segment files: `seg-<id>.dat` holds objects back to back (each a header block and its
//! bytes, every offset 4 KiB-aligned), `seg-<id>.idx` one record per object written in it.
//! A segment is filled by appending, never rewritten, and dropped whole. Every file is opened
//! relative to the tier's directory descriptor without following links
//! ([`umbp_unix::safedir`]), and a new one is made exclusively (mode 0600).

use std::fs::File;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use umbp_core::BlockKey;
use umbp_unix::file::IoFile;
use umbp_unix::safedir::{Access, Create, SafeDir};

use crate::error::DiskError;
use crate::format::{self, Record};

/// The file names of segment `id` (data, index).
pub(crate) fn names(id: u64) -> (String, String) {
    (format!("seg-{id:016x}.dat"), format!("seg-{id:016x}.idx"))
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
    /// The data file's path, for messages.
    pub dat: PathBuf,
    idx_path: PathBuf,
    dir: Arc<SafeDir>,
    dat_name: String,
    idx_name: String,
    /// The index file, appended to (`None` for a segment found at start-up: never written).
    idx: Mutex<Option<File>>,
    /// False once dropped: objects written to it late are not indexed.
    pub alive: AtomicBool,
    /// The keys indexed in it (to drop from the index with it).
    pub keys: Mutex<Vec<BlockKey>>,
}

impl Segment {
    /// Creates segment `id` in `dir`: a data file of `bytes` reserved on the device and an
    /// index file with its header, both new (a name that exists already is refused, never
    /// reused). A failure leaves no file of its own behind.
    pub fn create(
        dir: &Arc<SafeDir>,
        id: u64,
        bytes: u64,
        direct: bool,
    ) -> Result<Segment, DiskError> {
        let (dat_name, idx_name) = names(id);
        let (dat, idx_path) = (dir.show(&dat_name), dir.show(&idx_name));
        let mut made_dat = false;
        let made = (|| {
            let file = IoFile::open_in(dir, &dat_name, Create::New, direct).map_err(|source| {
                DiskError::Io {
                    what: "creating",
                    path: dat.clone(),
                    source,
                }
            })?;
            made_dat = true;
            file.reserve(bytes).map_err(|source| DiskError::Io {
                what: "reserving space for",
                path: dat.clone(),
                source,
            })?;
            let (fd, _) = dir
                .open_file(&idx_name, Access::Append, Create::New, false)
                .map_err(|source| DiskError::Io {
                    what: "creating",
                    path: idx_path.clone(),
                    source,
                })?;
            let mut idx = File::from(fd);
            if let Err(source) = idx.write_all(&format::idx_header(bytes)) {
                let _ = dir.remove(&idx_name);
                return Err(DiskError::Fs {
                    what: "writing the header of",
                    path: idx_path.clone(),
                    source,
                });
            }
            Ok((file, idx))
        })();
        match made {
            Ok((file, idx)) => Ok(Segment {
                id,
                file,
                bytes,
                dat,
                idx_path,
                dir: Arc::clone(dir),
                dat_name,
                idx_name,
                idx: Mutex::new(Some(idx)),
                alive: AtomicBool::new(true),
                keys: Mutex::new(Vec::new()),
            }),
            Err(e) => {
                if made_dat {
                    let _ = dir.remove(&dat_name);
                }
                Err(e)
            }
        }
    }

    /// Opens segment `id` found at start-up, with the records of its index file (`None` when
    /// the index is missing, unreadable or of another version).
    pub fn open(
        dir: &Arc<SafeDir>,
        id: u64,
        direct: bool,
    ) -> Result<(Segment, Option<Vec<Record>>), DiskError> {
        let (dat_name, idx_name) = names(id);
        let (dat, idx_path) = (dir.show(&dat_name), dir.show(&idx_name));
        let file = IoFile::open_in(dir, &dat_name, Create::No, direct).map_err(|source| {
            DiskError::Io {
                what: "opening",
                path: dat.clone(),
                source,
            }
        })?;
        let bytes = file.len().map_err(|source| DiskError::Io {
            what: "reading the size of",
            path: dat.clone(),
            source,
        })?;
        let records = match dir.open_file(&idx_name, Access::Read, Create::No, false) {
            Ok((fd, _)) => {
                let mut b = Vec::new();
                File::from(fd)
                    .read_to_end(&mut b)
                    .ok()
                    .and_then(|_| format::parse_idx(&b))
            }
            // Another user's file, or a link, in the tier's own directory: refused by name.
            Err(source @ umbp_unix::UnixError::Untrusted { .. }) => {
                return Err(DiskError::Io {
                    what: "opening",
                    path: idx_path,
                    source,
                })
            }
            Err(_) => None,
        };
        let seg = Segment {
            id,
            file,
            bytes,
            dat,
            idx_path,
            dir: Arc::clone(dir),
            dat_name,
            idx_name,
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
        let f = self
            .dir
            .open_file(&self.idx_name, Access::Append, Create::No, false)
            .map(|(fd, _)| File::from(fd))
            .map_err(|e| fs(e.to_io()))?;
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
        let _ = self.dir.remove(&self.dat_name);
        let _ = self.dir.remove(&self.idx_name);
        std::mem::take(&mut *self.keys.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let (dn, inm) = names(0x2a);
        assert_eq!(dn, "seg-000000000000002a.dat");
        assert_eq!(parse_name(&dn), Some((42, false)));
        assert_eq!(parse_name(&inm), Some((42, true)));
        assert_eq!(parse_name("seg-2a.dat"), None);
        assert_eq!(parse_name("umbp-disk.lock"), None);
    }
}
