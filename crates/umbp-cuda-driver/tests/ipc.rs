//! CUDA memory shared between two real processes: this test binary re-executes itself as the
//! child (`--exact <test>` with UMBP_IPC_TEST_ROLE set), hands it the export over a Unix socket
//! (descriptors with SCM_RIGHTS), and each side checks what the other wrote.
//!
//! 1. Legacy IPC: the parent's cuMemAlloc memory, a sub-range at an odd offset, opened by the
//!    child with `ImportedIpc`.
//! 2. VMM: three cuMemCreate allocations mapped back to back, a range over all three, mapped by
//!    the child with `ImportedVmm`.
//! 3. Errors: handles of nothing and of freed memory, bad chunk layouts, memory that was not
//!    created exportable.
//!
//! Needs an NVIDIA GPU; elsewhere every test prints `SKIP: ...` and passes. Run it with
//! `--nocapture` to see what the driver says about each pointer and each refused handle.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use umbp_cuda_driver::ipc::{describe_pointer, VmmAllocation};
use umbp_cuda_driver::{
    device_by_uuid, export_device_range, vmm_granularity, CudaError, Device, DeviceExport,
    ImportedIpc, ImportedVmm,
};

const ROLE: &str = "UMBP_IPC_TEST_ROLE";
const SOCK: &str = "UMBP_IPC_TEST_SOCK";
const MIB: u64 = 1 << 20;

fn role() -> Option<String> {
    std::env::var(ROLE).ok()
}

/// Device 0, or `None` (after printing SKIP) where this machine has no CUDA.
fn gpu() -> Option<Arc<Device>> {
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e) if role().is_some() => panic!("child: CUDA is not usable here: {e}"),
        Err(
            e @ (CudaError::NoDriver { .. } | CudaError::Call { .. } | CudaError::Device { .. }),
        ) => {
            println!("SKIP: no CUDA device here ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

/// The first pattern: every byte depends on its position (so a shifted copy shows).
fn pat1(i: u64) -> u8 {
    (i.wrapping_mul(7) + (i >> 8).wrapping_mul(13) + (i >> 16).wrapping_mul(101) + 1) as u8
}

/// The second pattern: differs from the first at every byte.
fn pat2(i: u64) -> u8 {
    !pat1(i)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex<const N: usize>(s: &str) -> [u8; N] {
    assert_eq!(s.len(), 2 * N, "{s}");
    std::array::from_fn(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap())
}

fn parse(msg: &str) -> HashMap<String, String> {
    msg.split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn num(m: &HashMap<String, String>, k: &str) -> u64 {
    m[k].parse().unwrap()
}

/// Sends one frame (u32 length, then the text) with `fds` attached (SCM_RIGHTS).
fn send(s: &UnixStream, text: &str, fds: &[RawFd]) {
    let mut frame = (text.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(text.as_bytes());
    let mut iov = libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: frame.len(),
    };
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; the pointers set below outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = cbuf.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer holds one cmsg with room for `fds`, as sized above.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
            std::ptr::copy_nonoverlapping(
                fds.as_ptr(),
                libc::CMSG_DATA(c).cast::<RawFd>(),
                fds.len(),
            );
        }
    }
    // SAFETY: `msg` describes valid buffers; the socket is ours.
    let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    assert_eq!(
        n as usize,
        frame.len(),
        "sendmsg: {}",
        std::io::Error::last_os_error()
    );
}

/// Receives one frame and the descriptors that came with it; `None` at end of stream.
fn recv(s: &UnixStream) -> std::io::Result<Option<(String, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; 64 << 10];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    const MAX_FDS: usize = 64;
    // SAFETY: pure size computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; the pointers set below outlive the recvmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` describes valid buffers; received descriptors are close-on-exec.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`; each SCM_RIGHTS
    // message holds (cmsg_len - CMSG_LEN(0)) / sizeof(int) descriptors, now ours to own.
    unsafe {
        let header = libc::CMSG_LEN(0) as usize;
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let count =
                    ((*c).cmsg_len as usize).saturating_sub(header) / std::mem::size_of::<RawFd>();
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    assert!(
        msg.msg_flags & libc::MSG_CTRUNC == 0,
        "descriptors were lost"
    );
    let mut got = buf[..n as usize].to_vec();
    if got.is_empty() {
        return Ok(None);
    }
    let mut r = s;
    while got.len() < 4 {
        let mut b = [0u8; 1];
        r.read_exact(&mut b)?;
        got.push(b[0]);
    }
    let len = u32::from_le_bytes(got[..4].try_into().unwrap()) as usize;
    if got.len() < 4 + len {
        let mut rest = vec![0u8; 4 + len - got.len()];
        r.read_exact(&mut rest)?;
        got.extend_from_slice(&rest);
    }
    Ok(Some((
        String::from_utf8(got[4..4 + len].to_vec()).unwrap(),
        fds,
    )))
}

/// Starts this test binary again as the child running `test` in `role`, with one end of a
/// socket pair.
fn spawn(test: &str, role: &str) -> (Child, UnixStream) {
    let (ours, theirs) = UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(SOCK, fd.to_string());
    // SAFETY: only fcntl (async-signal-safe) runs between fork and exec: the child keeps its
    // end of the socket across exec; the parent's copy stays close-on-exec, so no other child
    // of this process inherits it.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop(theirs);
    ours.set_read_timeout(Some(Duration::from_secs(180)))
        .unwrap();
    (child, ours)
}

/// The child's reply; the child's failure (its output is above) fails the test.
fn reply(child: &mut Child, s: &UnixStream) -> String {
    let r = recv(s);
    match r {
        Ok(Some((text, _))) => {
            let status = child.wait().unwrap();
            assert!(
                status.success(),
                "the child failed ({status}) after replying {text}"
            );
            text
        }
        other => {
            let _ = child.kill();
            let status = child.wait().unwrap();
            panic!(
                "the child did not reply ({other:?}); it ended with {status}: see its output above"
            );
        }
    }
}

/// The child's end of the socket.
fn child_socket() -> UnixStream {
    let fd: RawFd = std::env::var(SOCK).unwrap().parse().unwrap();
    // SAFETY: the parent handed us this descriptor (see `spawn`); nothing else owns it.
    let s = unsafe { UnixStream::from_raw_fd(fd) };
    s.set_read_timeout(Some(Duration::from_secs(180))).unwrap();
    s
}

/// Pieces of `[addr, addr + len)` that never cross a 2 MiB boundary: one pageable-memory copy
/// may not span two physical allocations of a VMM range (the driver answers
/// CUDA_ERROR_INVALID_VALUE, measured on the H200), and VMM allocations start and end on
/// granularity (2 MiB) boundaries.
fn pieces(addr: u64, len: u64) -> Vec<(u64, u64)> {
    const G: u64 = 2 << 20;
    let mut out = Vec::new();
    let mut at = addr;
    while at < addr + len {
        let end = ((at / G + 1) * G).min(addr + len);
        out.push((at, end - at));
        at = end;
    }
    out
}

fn upload(dev: &Arc<Device>, dst: u64, data: &[u8]) {
    let s = dev.stream().unwrap();
    for (at, n) in pieces(dst, data.len() as u64) {
        // SAFETY: `[at, at + n)` is device memory of `dev` that nothing else uses meanwhile;
        // `data` outlives the synchronised copy.
        unsafe { dev.copy_htod(at, data[(at - dst) as usize..].as_ptr(), n, &s) }.unwrap();
    }
    s.synchronize().unwrap();
}

fn download(dev: &Arc<Device>, src: u64, len: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    let s = dev.stream().unwrap();
    for (at, n) in pieces(src, len) {
        // SAFETY: `[at, at + n)` is device memory of `dev`; `out` outlives the synchronised
        // copy.
        unsafe { dev.copy_dtoh(out[(at - src) as usize..].as_mut_ptr(), at, n, &s) }.unwrap();
    }
    s.synchronize().unwrap();
    out
}

/// Asserts `got[i] == want(base + i)` for every byte, naming the first mismatch.
fn verify(what: &str, got: &[u8], base: u64, want: impl Fn(u64) -> u8) {
    let bad = got
        .iter()
        .enumerate()
        .filter(|&(i, &b)| b != want(base + i as u64))
        .count();
    if bad > 0 {
        let (i, b) = got
            .iter()
            .enumerate()
            .find(|&(i, &b)| b != want(base + i as u64))
            .unwrap();
        panic!(
            "{what}: {bad} of {} bytes differ; the first at {} holds {b:#04x}, not {:#04x}",
            got.len(),
            base + i as u64,
            want(base + i as u64)
        );
    }
    println!("{what}: all {} bytes verified", got.len());
}

// ---- 1. legacy IPC -------------------------------------------------------------------------

#[test]
fn legacy_ipc_between_two_processes() {
    if role().as_deref() == Some("legacy") {
        return legacy_child();
    }
    let Some(dev) = gpu() else { return };
    const SIZE: u64 = 64 * MIB;
    let buf = dev.alloc(SIZE).unwrap();
    let host: Vec<u8> = (0..SIZE).map(pat1).collect();
    upload(&dev, buf.ptr(), &host);
    let (off, len) = (3 * MIB + 123, 40 * MIB + 7);
    println!("parent: {}", describe_pointer(buf.ptr() + off));
    let exp = export_device_range(buf.ptr() + off, len).unwrap();
    let DeviceExport::Legacy {
        device_uuid,
        handle,
        allocation_bytes,
        offset,
        length,
    } = &exp
    else {
        panic!("cuMemAlloc memory exports as a legacy IPC handle: {exp:?}");
    };
    assert_eq!(
        (*offset, *length),
        (off, len),
        "offset from the allocation's start"
    );
    assert!(*allocation_bytes >= SIZE, "{allocation_bytes}");
    assert_eq!(device_uuid, &dev.uuid().unwrap());
    assert_eq!(device_by_uuid(device_uuid).unwrap(), 0);
    // A range past the allocation is refused.
    let e = export_device_range(buf.ptr() + SIZE - MIB, 2 * MIB).unwrap_err();
    println!("parent: past the allocation: {e}");

    let (mut child, sock) = spawn("legacy_ipc_between_two_processes", "legacy");
    send(
        &sock,
        &format!(
            "uuid={} handle={} alloc={allocation_bytes} offset={offset} length={length}",
            hex(device_uuid),
            hex(handle)
        ),
        &[],
    );
    let r = reply(&mut child, &sock);
    assert_eq!(r, "ok");
    // The child wrote the second pattern over exactly the exported range.
    let back = download(&dev, buf.ptr(), SIZE);
    verify("parent: before the range", &back[..off as usize], 0, pat1);
    verify(
        "parent: the range the child wrote",
        &back[off as usize..(off + len) as usize],
        off,
        pat2,
    );
    verify(
        "parent: after the range",
        &back[(off + len) as usize..],
        off + len,
        pat1,
    );
}

fn legacy_child() {
    let sock = child_socket();
    let (msg, _) = recv(&sock).unwrap().expect("the parent's message");
    let m = parse(&msg);
    let uuid: [u8; 16] = unhex(&m["uuid"]);
    let handle: [u8; 64] = unhex(&m["handle"]);
    let (alloc, offset, length) = (num(&m, "alloc"), num(&m, "offset"), num(&m, "length"));
    let ord = device_by_uuid(&uuid).unwrap();
    let imp = ImportedIpc::open(ord, &handle, alloc).unwrap();
    assert_eq!(imp.len(), alloc);
    let dev = Device::open(ord).unwrap();
    println!("child: imported {:#x}+{}", imp.addr(), imp.len());
    println!("child: {}", describe_pointer(imp.addr() + offset));
    // What the store runs at registration.
    dev.check_device_range(imp.addr() + offset, length).unwrap();
    dev.check_device_range(imp.addr(), imp.len()).unwrap();
    let e = dev
        .check_device_range(imp.addr() + offset, imp.len())
        .unwrap_err();
    println!("child: past the imported allocation: {e}");
    let got = download(&dev, imp.addr() + offset, length);
    verify("child: the parent's pattern", &got, offset, pat1);
    let mine: Vec<u8> = (offset..offset + length).map(pat2).collect();
    upload(&dev, imp.addr() + offset, &mine);
    drop(imp);
    send(&sock, "ok", &[]);
}

// ---- 2. VMM --------------------------------------------------------------------------------

#[test]
fn vmm_between_two_processes() {
    if role().as_deref() == Some("vmm") {
        return vmm_child();
    }
    let Some(dev) = gpu() else { return };
    let g = vmm_granularity(0).unwrap();
    let chunk = 2 * g;
    let alloc = VmmAllocation::create(0, &[chunk; 3], true).unwrap();
    let total = alloc.len();
    assert_eq!(total, 3 * chunk);
    println!(
        "parent: granularity {g}, three chunks of {chunk} at {:#x}",
        alloc.addr()
    );
    for c in 0..3 {
        println!("parent: {}", describe_pointer(alloc.addr() + c * chunk + 5));
    }
    let host: Vec<u8> = (0..total).map(pat1).collect();
    upload(&dev, alloc.addr(), &host);
    // Registration accepts a range over the three mappings.
    dev.check_device_range(alloc.addr(), total).unwrap();
    dev.check_device_range(alloc.addr() + 100, total - 200)
        .unwrap();
    // A range inside the second chunk: one chunk, offset from its start.
    match export_device_range(alloc.addr() + chunk + 5, 100).unwrap() {
        DeviceExport::Vmm {
            chunks,
            offset,
            length,
            ..
        } => {
            assert_eq!(chunks.len(), 1);
            assert_eq!((chunks[0].offset, chunks[0].size), (0, chunk));
            assert_eq!((offset, length), (5, 100));
        }
        other => panic!("VMM memory exports as descriptors: {other:?}"),
    }
    // A range over all three chunks.
    let off = g / 2 + 77;
    let len = total - off - g / 3;
    let exp = export_device_range(alloc.addr() + off, len).unwrap();
    let DeviceExport::Vmm {
        device_uuid,
        chunks,
        offset,
        length,
    } = &exp
    else {
        panic!("VMM memory exports as descriptors: {exp:?}");
    };
    assert_eq!((*offset, *length), (off, len));
    let layout: Vec<(u64, u64)> = chunks.iter().map(|c| (c.offset, c.size)).collect();
    assert_eq!(layout, vec![(0, chunk), (chunk, chunk), (2 * chunk, chunk)]);

    let (mut child, sock) = spawn("vmm_between_two_processes", "vmm");
    let list: Vec<String> = layout.iter().map(|(o, s)| format!("{o}:{s}")).collect();
    let fds: Vec<RawFd> = chunks.iter().map(|c| c.fd.as_raw_fd()).collect();
    send(
        &sock,
        &format!(
            "uuid={} offset={offset} length={length} chunks={}",
            hex(device_uuid),
            list.join(",")
        ),
        &fds,
    );
    let r = reply(&mut child, &sock);
    assert_eq!(r, "ok");
    let back = download(&dev, alloc.addr(), total);
    verify("parent: before the range", &back[..off as usize], 0, pat1);
    verify(
        "parent: the range the child wrote",
        &back[off as usize..(off + len) as usize],
        off,
        pat2,
    );
    verify(
        "parent: after the range",
        &back[(off + len) as usize..],
        off + len,
        pat1,
    );
}

fn vmm_child() {
    let sock = child_socket();
    let (msg, fds) = recv(&sock).unwrap().expect("the parent's message");
    let m = parse(&msg);
    let uuid: [u8; 16] = unhex(&m["uuid"]);
    let (offset, length) = (num(&m, "offset"), num(&m, "length"));
    let layout: Vec<(u64, u64)> = m["chunks"]
        .split(',')
        .map(|c| {
            let (o, s) = c.split_once(':').unwrap();
            (o.parse().unwrap(), s.parse().unwrap())
        })
        .collect();
    assert_eq!(fds.len(), layout.len(), "one descriptor per chunk");
    let ord = device_by_uuid(&uuid).unwrap();
    let dev = Device::open(ord).unwrap();
    let g = vmm_granularity(ord).unwrap();
    let list: Vec<(BorrowedFd<'_>, u64, u64)> = fds
        .iter()
        .zip(&layout)
        .map(|(fd, &(o, s))| (fd.as_fd(), o, s))
        .collect();
    // Layouts that are not the export's are refused, and leave nothing behind.
    let e = ImportedVmm::map(ord, &[list[0], (list[2].0, 2 * list[0].2, list[2].2)]).unwrap_err();
    println!("child: a gap between chunks: {e}");
    assert!(matches!(e, CudaError::Import { .. }), "{e:?}");
    let e = ImportedVmm::map(ord, &[(list[1].0, list[1].1, list[1].2)]).unwrap_err();
    println!("child: not from offset 0: {e}");
    if g > 1 {
        let e = ImportedVmm::map(ord, &[(list[0].0, 0, g / 2)]).unwrap_err();
        println!("child: half a granule: {e}");
    }
    let map = ImportedVmm::map(ord, &list).unwrap();
    assert_eq!(map.len(), layout.iter().map(|c| c.1).sum::<u64>());
    // The mapping holds its own references: the descriptors can go.
    drop(list);
    drop(fds);
    println!("child: mapped {:#x}+{}", map.addr(), map.len());
    for &(o, _) in &layout {
        println!("child: {}", describe_pointer(map.addr() + o + 5));
    }
    // What the store runs at registration: the range spans every chunk.
    dev.check_device_range(map.addr() + offset, length).unwrap();
    dev.check_device_range(map.addr(), map.len()).unwrap();
    println!(
        "child: a range past the mapped chunks: {:?}",
        dev.check_device_range(map.addr(), map.len() + 4096)
    );
    let got = download(&dev, map.addr() + offset, length);
    verify("child: the parent's pattern", &got, offset, pat1);
    let mine: Vec<u8> = (offset..offset + length).map(pat2).collect();
    upload(&dev, map.addr() + offset, &mine);
    drop(map);
    send(&sock, "ok", &[]);
}

// ---- 3. errors -----------------------------------------------------------------------------

#[test]
fn bad_handles_and_layouts_are_errors() {
    if role().as_deref() == Some("errors") {
        return errors_child();
    }
    let Some(dev) = gpu() else { return };
    let g = vmm_granularity(0).unwrap();

    // cuMemAlloc memory: registration still refuses a range past the allocation.
    let b1 = dev.alloc(MIB).unwrap();
    let b2 = dev.alloc(MIB).unwrap();
    println!("parent: {}", describe_pointer(b1.ptr()));
    dev.check_device_range(b1.ptr(), MIB).unwrap();
    let e = dev.check_device_range(b1.ptr(), MIB + 4096).unwrap_err();
    println!("parent: past a cuMemAlloc allocation: {e}");
    assert!(matches!(e, CudaError::BadMemory { .. }), "{e:?}");
    drop(b2);

    // Host memory is not exported.
    let host = vec![0u8; 4096];
    let e = export_device_range(host.as_ptr() as u64, 4096).unwrap_err();
    println!("parent: host memory: {e}");

    // VMM memory created without POSIX descriptors as a handle type.
    let plain = VmmAllocation::create(0, &[g, g], false).unwrap();
    println!("parent: {}", describe_pointer(plain.addr()));
    dev.check_device_range(plain.addr(), plain.len()).unwrap();
    let e = export_device_range(plain.addr() + 10, g).unwrap_err();
    println!("parent: not exportable: {e}");
    assert!(
        matches!(e, CudaError::Export { .. }) && e.to_string().contains("requestedHandleTypes"),
        "{e}"
    );

    // Real descriptors in a layout that is not the export's.
    let ok = VmmAllocation::create(0, &[g, g], true).unwrap();
    let DeviceExport::Vmm { chunks, .. } = export_device_range(ok.addr(), ok.len()).unwrap() else {
        panic!("VMM memory exports as descriptors");
    };
    assert_eq!(chunks.len(), 2);
    let (a, b) = (chunks[0].fd.as_fd(), chunks[1].fd.as_fd());
    for (what, layout) in [
        ("a gap", vec![(a, 0, g), (b, 2 * g, g)]),
        ("not from 0", vec![(b, g, g)]),
        ("overlapping", vec![(a, 0, g), (b, g / 2, g)]),
        ("no chunks", vec![]),
    ] {
        let e = ImportedVmm::map(0, &layout).unwrap_err();
        println!("parent: {what}: {e}");
        assert!(matches!(e, CudaError::Import { .. }), "{e:?}");
    }
    if g > 1 {
        let e = ImportedVmm::map(0, &[(a, 0, g / 2)]).unwrap_err();
        println!("parent: half a granule: {e}");
    }
    // A descriptor that is not CUDA's: the driver refuses it, and the reservation made before
    // is given back.
    let null = std::fs::File::open("/dev/null").unwrap();
    let e = ImportedVmm::map(0, &[(null.as_fd(), 0, g)]).unwrap_err();
    println!("parent: /dev/null as a chunk: {e}");

    // A legacy handle of memory freed before the child opens it, and 64 random bytes.
    let victim = dev.alloc(64 * MIB).unwrap();
    let DeviceExport::Legacy {
        handle: freed,
        allocation_bytes,
        device_uuid,
        ..
    } = export_device_range(victim.ptr(), MIB).unwrap()
    else {
        panic!("cuMemAlloc memory exports as a legacy IPC handle");
    };
    drop(victim);
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(std::process::id());
    let random: [u8; 64] = std::array::from_fn(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    });
    let (mut child, sock) = spawn("bad_handles_and_layouts_are_errors", "errors");
    send(
        &sock,
        &format!(
            "uuid={} alloc={allocation_bytes} freed={} random={}",
            hex(&device_uuid),
            hex(&freed),
            hex(&random)
        ),
        &[],
    );
    let r = reply(&mut child, &sock);
    println!("parent: the child says {r}");
    let m = parse(&r);
    assert_eq!(m["random"], "err", "{r}");
    if m["freed"] != "err" {
        println!(
            "NOTE: this driver opened the IPC handle of an allocation freed before the open \
             ({r}); ImportedIpc::open cannot tell such a handle from a live one"
        );
    }
}

fn errors_child() {
    let sock = child_socket();
    let (msg, _) = recv(&sock).unwrap().expect("the parent's message");
    let m = parse(&msg);
    let uuid: [u8; 16] = unhex(&m["uuid"]);
    let alloc = num(&m, "alloc");
    let ord = device_by_uuid(&uuid).unwrap();
    let e = device_by_uuid(&[0xee; 16]).unwrap_err();
    println!("child: an unknown UUID: {e}");
    assert!(matches!(e, CudaError::UnknownDevice { .. }), "{e:?}");
    let e = ImportedIpc::open(ord, &[0; 64], 0).unwrap_err();
    println!("child: a zero size: {e}");

    let random: [u8; 64] = unhex(&m["random"]);
    let random = match ImportedIpc::open(ord, &random, alloc) {
        Err(e) => {
            println!("child: 64 random bytes: {e}");
            "err".to_owned()
        }
        Ok(imp) => format!("opened:{:#x}+{}", imp.addr(), imp.len()),
    };
    let freed: [u8; 64] = unhex(&m["freed"]);
    let freed = match ImportedIpc::open(ord, &freed, alloc) {
        Err(e) => {
            println!("child: a freed allocation's handle: {e}");
            "err".to_owned()
        }
        // Not touched: whatever it maps is not the parent's any more.
        Ok(imp) => format!("opened:{:#x}+{}", imp.addr(), imp.len()),
    };
    // The device is still usable after the refusals.
    let dev = Device::open(ord).unwrap();
    let b = dev.alloc(MIB).unwrap();
    let data: Vec<u8> = (0..MIB).map(pat1).collect();
    upload(&dev, b.ptr(), &data);
    verify(
        "child: after the refusals",
        &download(&dev, b.ptr(), MIB),
        0,
        pat1,
    );
    send(&sock, &format!("random={random} freed={freed}"), &[]);
}
