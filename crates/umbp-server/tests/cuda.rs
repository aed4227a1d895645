//! CUDA memory through the server (needs an NVIDIA GPU; prints SKIP otherwise): a client
//! process stores from its device memory, another loads into its own, by legacy IPC handle
//! (cuMemAlloc memory) and by exported descriptors (cuMemCreate + cuMemMap memory, as
//! PyTorch's expandable segments allocate), bytes compared exactly.

mod common;

use std::sync::Arc;

use common::*;
use umbp_core::{KeyOutcome, LayerSpec};
use umbp_cuda::ipc::VmmAllocation;
use umbp_cuda::Device;

/// 96 KiB blocks: some straddle the 2 MiB boundaries between a VMM range's physical
/// allocations, so the server's copies must handle a piece spanning two allocations.
const CUDA_BLOCK: u64 = 96 << 10;
const CUDA_BLOCKS: u64 = 96;

enum Mem {
    Legacy(umbp_cuda::DeviceBuffer),
    Vmm(VmmAllocation),
}

impl Mem {
    fn addr(&self) -> u64 {
        match self {
            Mem::Legacy(b) => b.ptr(),
            Mem::Vmm(v) => v.addr(),
        }
    }
}

fn alloc(dev: &Arc<Device>, kind: &str) -> Mem {
    let len = CUDA_BLOCK * CUDA_BLOCKS;
    match kind {
        "legacy" => Mem::Legacy(dev.alloc(len).unwrap()),
        _ => {
            let g = umbp_cuda::vmm_granularity(0).unwrap();
            // Three physical allocations mapped back to back, like expandable segments.
            let chunk = (len / 3).div_ceil(g) * g;
            Mem::Vmm(VmmAllocation::create(0, &[chunk, chunk, chunk], true).unwrap())
        }
    }
}

/// Pieces that never cross a 2 MiB boundary (a pageable-memory copy may not span two physical
/// allocations of a VMM range: CUDA_ERROR_INVALID_VALUE on the H200).
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

fn host_pattern(seed: u64) -> Vec<u8> {
    (0..CUDA_BLOCKS * CUDA_BLOCK)
        .map(|i| pattern(seed, i / CUDA_BLOCK, i % CUDA_BLOCK))
        .collect()
}

/// The client's side: `store` uploads a pattern and stores every block; `load` loads into
/// fresh device memory and compares.
fn run_role(role: &str, kind: &str) {
    let dev = Device::open(0).unwrap();
    let stream = dev.stream().unwrap();
    let mem = alloc(&dev, kind);
    // Registered from one block in, so the registration starts inside the allocation.
    let base = mem.addr() + CUDA_BLOCK;
    let blocks = CUDA_BLOCKS - 1;
    let c = client(&role_endpoint());
    // SAFETY: the memory lives until the end of this function.
    unsafe { c.register_cuda_memory(base, blocks * CUDA_BLOCK) }.unwrap();
    let layout = c
        .register_layout(vec![vec![LayerSpec {
            base_addr: base,
            num_blocks: blocks,
            block_stride: CUDA_BLOCK,
            block_bytes: CUDA_BLOCK,
        }]])
        .unwrap();
    let ids: Vec<u64> = (0..blocks).collect();
    let k = keys(&format!("cuda-{kind}"), blocks);
    let want = host_pattern(42);
    let n = (blocks * CUDA_BLOCK) as usize;
    if role == "store" {
        for (at, len) in pieces(base, n as u64) {
            // SAFETY: `want` outlives the synchronised copy; the piece is inside `mem`.
            unsafe { dev.copy_htod(at, want[(at - base) as usize..].as_ptr(), len, &stream) }
                .unwrap();
        }
        stream.synchronize().unwrap();
        let st = c.store(layout.id, 0, &ids, &k).unwrap().wait(None).unwrap();
        assert!(st.iter().all(|s| *s == KeyOutcome::Done), "{st:?}");
    } else {
        let st = c.load(layout.id, 0, &ids, &k).unwrap().wait(None).unwrap();
        assert!(st.iter().all(|s| *s == KeyOutcome::Done), "{st:?}");
        let mut got = vec![0u8; n];
        for (at, len) in pieces(base, n as u64) {
            // SAFETY: `got` outlives the synchronised copy; the piece is inside `mem`.
            unsafe { dev.copy_dtoh(got[(at - base) as usize..].as_mut_ptr(), at, len, &stream) }
                .unwrap();
        }
        stream.synchronize().unwrap();
        assert!(
            got == want[..n],
            "bytes differ after the load through the server"
        );
    }
    let s = c.stats().unwrap();
    assert_eq!(s.cuda_imports, 1, "{s:?}");
    println!("{role} {kind}: ok");
}

fn cuda_across_processes(kind: &str, test: &str) {
    if let Ok(role) = std::env::var(ROLE) {
        return run_role(&role, kind);
    }
    if let Err(e) = Device::open(0) {
        println!("SKIP: no CUDA device ({e})");
        return;
    }
    let dir = tmpdir(&format!("cuda-{kind}"));
    let server = Server::start(&dir.join("s.sock"), &[]);
    for role in ["store", "load"] {
        let mut c = spawn_role(test, role, &server.endpoint, &[]);
        assert!(
            c.wait().unwrap().success(),
            "{role} failed\n{}",
            server.log_text()
        );
    }
    let s = stats_settled(&server.endpoint, 0);
    assert_eq!(
        (s.sessions, s.registrations, s.cuda_imports),
        (0, 0, 0),
        "imports closed with the sessions: {s:?}"
    );
    assert!(server.stop().success());
}

#[test]
fn cuda_memory_by_ipc_handle_restores_exactly_across_processes() {
    cuda_across_processes(
        "legacy",
        "cuda_memory_by_ipc_handle_restores_exactly_across_processes",
    );
}

#[test]
fn cuda_vmm_memory_by_exported_descriptors_restores_exactly_across_processes() {
    cuda_across_processes(
        "vmm",
        "cuda_vmm_memory_by_exported_descriptors_restores_exactly_across_processes",
    );
}
