//! The tier's directory as another user would attack it: links planted where the next
//! segments go, a directory or lock file of another uid, a directory others can write.

use std::os::unix::fs::{lchown, symlink, PermissionsExt};
use std::time::Duration;

use crate::segment;
use crate::tests::{data, key, small, tmpdir};
use crate::{DiskError, DiskTier, Queued};

fn is_root() -> bool {
    umbp_unix::peer::effective_uid() == 0
}

fn chmod(p: &std::path::Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn links_planted_for_the_next_segments_are_never_followed() {
    let d = tmpdir("planted");
    let outside = tmpdir("planted-outside");
    let victim = outside.join("root-only");
    std::fs::write(&victim, b"precious").unwrap();
    chmod(&victim, 0o600);
    let t = DiskTier::open(small(&d)).unwrap();
    // The first segment is open; plant links for the next ones (as whoever could write the
    // directory before it was checked), at the target of each name the tier will make.
    for id in 2..40 {
        let (dat, idx) = segment::names(id);
        symlink(&victim, d.join(&dat)).unwrap();
        symlink(outside.join(format!("made-{id}")), d.join(&idx)).unwrap();
    }
    for n in 0..200 {
        let _ = t.enqueue(key(n), Box::new(data(n, 64 << 10)));
    }
    assert!(t.flush(Duration::from_secs(30)));
    let s = t.stats();
    assert!(s.write_errors > 0, "{s:?}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    let made: Vec<_> = std::fs::read_dir(&outside)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(made, ["root-only"], "the tier created files through links");
    // The planted links are still links (nothing replaced them by following them).
    assert!(std::fs::symlink_metadata(d.join(segment::names(2).0))
        .unwrap()
        .file_type()
        .is_symlink());
    drop(t);
    std::fs::remove_dir_all(&d).unwrap();
    std::fs::remove_dir_all(&outside).unwrap();
}

#[test]
fn a_directory_others_can_write_is_refused_with_what_to_change() {
    let d = tmpdir("open-to-all");
    chmod(&d, 0o777);
    let e = DiskTier::open(small(&d)).unwrap_err();
    assert!(matches!(e, DiskError::Dir { .. }), "{e}");
    assert!(e.to_string().contains("chmod go-w"), "{e}");
    assert!(
        !d.join(crate::store::LOCK_FILE).exists(),
        "nothing was made there"
    );
    chmod(&d, 0o700);
    // A segment file that is a link (planted before the directory was made private) stops
    // start-up by name rather than being opened.
    let victim = d.join("elsewhere");
    std::fs::write(&victim, b"x").unwrap();
    let (dat, idx) = segment::names(1);
    symlink(&victim, d.join(&dat)).unwrap();
    std::fs::write(d.join(&idx), b"").unwrap();
    let e = DiskTier::open(small(&d)).unwrap_err().to_string();
    assert!(e.contains(&dat), "{e}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"x");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_directory_link_or_lock_file_of_another_uid_is_refused() {
    if !is_root() {
        eprintln!("skipped: needs root to give files to another uid");
        return;
    }
    let d = tmpdir("other-uid");
    let theirs = d.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    chmod(&theirs, 0o700);
    lchown(&theirs, Some(12345), Some(12345)).unwrap();
    let e = DiskTier::open(small(&theirs)).unwrap_err().to_string();
    assert!(
        e.contains("owned by uid 12345") && e.contains("chown"),
        "{e}"
    );
    // Their link to a directory of ours.
    let ours = d.join("ours");
    std::fs::create_dir(&ours).unwrap();
    let link = d.join("link");
    symlink(&ours, &link).unwrap();
    lchown(&link, Some(12345), Some(12345)).unwrap();
    let e = DiskTier::open(small(&link)).unwrap_err().to_string();
    assert!(e.contains("symbolic link owned by uid 12345"), "{e}");
    // Their lock file in our directory: they could hold its lock and keep the tier out.
    let lock = ours.join(crate::store::LOCK_FILE);
    std::fs::write(&lock, b"").unwrap();
    lchown(&lock, Some(12345), Some(12345)).unwrap();
    let e = DiskTier::open(small(&ours)).unwrap_err().to_string();
    assert!(
        e.contains("umbp-disk.lock") && e.contains("owned by uid 12345") && e.contains("remove it"),
        "{e}"
    );
    std::fs::remove_file(&lock).unwrap();
    let t = DiskTier::open(small(&ours)).unwrap();
    assert_eq!(t.enqueue(key(1), Box::new(data(1, 4096))), Queued::Queued);
    assert!(t.flush(Duration::from_secs(10)));
    let mode = std::fs::metadata(&lock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "nobody else may open the lock file");
    drop(t);
    std::fs::remove_dir_all(&d).unwrap();
}
