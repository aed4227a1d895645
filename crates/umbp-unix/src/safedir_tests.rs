//! `SafeDir` against directories, links and files of the shapes an attacker would leave.

use std::os::unix::fs::{lchown, symlink, PermissionsExt};

use super::*;

/// A fresh directory (mode 0700) under /tmp, which is root's and sticky.
fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("umbp-safedir-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir(&d).unwrap();
    chmod(&d, 0o700);
    d
}

fn chmod(p: &Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn why(r: Result<SafeDir, UnixError>) -> String {
    match r {
        Err(e @ UnixError::Untrusted { .. }) => e.to_string(),
        Err(e) => panic!("not a refusal: {e}"),
        Ok(d) => panic!("{} was accepted", d.path().display()),
    }
}

fn is_root() -> bool {
    crate::peer::effective_uid() == 0
}

#[test]
fn a_private_directory_is_opened_and_created_with_its_parents() {
    let d = tmpdir("ok");
    SafeDir::open(&d, false).unwrap();
    let deep = d.join("a/b/../b/c");
    let sd = SafeDir::open(&deep, true).unwrap();
    assert_eq!(sd.path(), deep);
    let made = std::fs::metadata(d.join("a/b/c")).unwrap();
    assert!(made.is_dir() && made.permissions().mode() & 0o777 == 0o700);
    let e = why(SafeDir::open(&d.join("absent"), false));
    assert!(e.contains("does not exist"), "{e}");
    let e = why(SafeDir::open(Path::new("rel/dir"), true));
    assert!(e.contains("absolute"), "{e}");
    std::fs::write(d.join("file"), b"").unwrap();
    let e = why(SafeDir::open(&d.join("file"), false));
    assert!(e.contains("not a directory"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_directory_others_can_write_is_refused_and_a_sticky_parent_is_not() {
    let d = tmpdir("modes");
    let own = d.join("own");
    std::fs::create_dir(&own).unwrap();
    chmod(&own, 0o777);
    let e = why(SafeDir::open(&own, false));
    assert!(e.contains("mode 0777") && e.contains("chmod go-w"), "{e}");
    chmod(&own, 0o1777); // sticky is no excuse for the directory itself
    assert!(why(SafeDir::open(&own, false)).contains("mode 1777"));
    // A sticky world-writable parent (as /tmp) is fine; a group-writable one is not.
    let inner = own.join("tier");
    std::fs::create_dir(&inner).unwrap();
    chmod(&inner, 0o700);
    SafeDir::open(&inner, false).unwrap();
    chmod(&own, 0o775);
    let e = why(SafeDir::open(&inner, false));
    assert!(e.starts_with(&format!("{}:", own.display())), "{e}");
    assert!(e.contains("without the sticky bit"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn directories_and_links_of_another_uid_are_refused() {
    if !is_root() {
        eprintln!("skipped: needs root to give files to another uid");
        return;
    }
    let d = tmpdir("owners");
    let theirs = d.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    chmod(&theirs, 0o700);
    lchown(&theirs, Some(12345), Some(12345)).unwrap();
    let e = why(SafeDir::open(&theirs, false));
    assert!(
        e.contains("owned by uid 12345") && e.contains("chown"),
        "{e}"
    );
    // Below a directory of theirs, even one of ours is refused: they could swap it.
    let below = theirs.join("mine");
    std::fs::create_dir(&below).unwrap();
    chmod(&below, 0o700);
    let e = why(SafeDir::open(&below, false));
    assert!(e.starts_with(&format!("{}:", theirs.display())), "{e}");
    // A link of theirs to a good directory is refused; one of ours is followed, and its
    // target judged.
    let good = d.join("good");
    std::fs::create_dir(&good).unwrap();
    let link = d.join("link");
    symlink(&good, &link).unwrap();
    SafeDir::open(&link, false).unwrap();
    lchown(&link, Some(12345), Some(12345)).unwrap();
    let e = why(SafeDir::open(&link, false));
    assert!(e.contains("symbolic link owned by uid 12345"), "{e}");
    let link2 = d.join("link2");
    symlink("theirs", &link2).unwrap();
    assert!(why(SafeDir::open(&link2, false)).contains("owned by uid 12345"));
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn files_are_never_opened_through_links_and_new_ones_are_exclusive() {
    let d = tmpdir("files");
    let sd = SafeDir::open(&d, false).unwrap();
    let victim = d.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    symlink(&victim, d.join("seg")).unwrap();
    for create in [Create::No, Create::IfMissing, Create::New] {
        let e = sd
            .open_file("seg", Access::ReadWrite, create, false)
            .unwrap_err();
        assert!(
            matches!(e.errno(), Some(libc::ELOOP) | Some(libc::EEXIST)),
            "{create:?}: {e}"
        );
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert!(SafeDir::has_openat2().is_some());
    let (fd, _) = sd
        .open_file("new", Access::ReadWrite, Create::New, true)
        .unwrap();
    drop(fd);
    let meta = std::fs::metadata(d.join("new")).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let e = sd
        .open_file("new", Access::ReadWrite, Create::New, false)
        .unwrap_err();
    assert_eq!(e.errno(), Some(libc::EEXIST));
    for bad in ["", ".", "..", "a/b", "../victim"] {
        assert!(sd.open_file(bad, Access::Read, Create::No, false).is_err());
    }
    let mut names = sd.names().unwrap();
    names.sort();
    assert_eq!(names, ["new", "seg", "victim"]);
    sd.remove("seg").unwrap();
    assert!(victim.exists(), "removing a link leaves its target");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn the_fallback_without_openat2_refuses_links_too() {
    let d = tmpdir("fallback");
    let sd = SafeDir::open(&d, false).unwrap();
    std::fs::write(d.join("victim"), b"x").unwrap();
    symlink(d.join("victim"), d.join("seg")).unwrap();
    // As where openat2 answers ENOSYS (other tests may run meanwhile: either way is safe).
    OPENAT2.store(2, Ordering::Relaxed);
    let e = sd
        .open_file("seg", Access::ReadWrite, Create::IfMissing, false)
        .unwrap_err();
    let made = sd.open_file("fresh", Access::ReadWrite, Create::New, false);
    OPENAT2.store(0, Ordering::Relaxed);
    assert_eq!(e.errno(), Some(libc::ELOOP), "{e}");
    assert_eq!(std::fs::read(d.join("victim")).unwrap(), b"x");
    made.unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_lock_file_of_another_uid_is_refused_and_a_wide_one_narrowed() {
    let d = tmpdir("lock");
    let sd = SafeDir::open(&d, false).unwrap();
    std::fs::write(d.join("l"), b"").unwrap();
    chmod(&d.join("l"), 0o666);
    drop(sd.open_lock("l").unwrap());
    let mode = std::fs::metadata(d.join("l")).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    if is_root() {
        lchown(d.join("l"), Some(12345), None).unwrap();
        let e = sd.open_lock("l").unwrap_err().to_string();
        assert!(
            e.contains("owned by uid 12345") && e.contains("remove it"),
            "{e}"
        );
    }
    std::fs::remove_dir_all(&d).unwrap();
}
