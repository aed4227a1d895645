//! Two movers (as for two devices) over one pool share its one DMA registration: the pool is
//! registered once, both copy through it, and shutting one mover down leaves the other's
//! copies on registered memory. Needs an NVIDIA GPU; elsewhere it says so and passes (the
//! GPU run carries this binary: see scripts/gpu-device-run.sh).

use std::sync::Arc;
use std::time::Duration;

use umbp_copy::{BlockCopy, Mover};
use umbp_core::{CopyRange, PoolConfig};
use umbp_cuda::{CopyMethod, CudaError, CudaMover, CudaOptions, Device, PoolPinner, SPLIT_BYTES};
use umbp_pool::Pool;

#[test]
fn two_movers_share_one_pinned_pool() {
    let dev = match Device::open(0) {
        Ok(d) => d,
        Err(e @ (CudaError::NoDriver { .. } | CudaError::Call { .. })) => {
            eprintln!("skipped: no CUDA device here ({e})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let pool = Arc::new(Pool::new(PoolConfig::with_capacity(2 * SPLIT_BYTES)).unwrap());
    let pinner =
        Arc::new(PoolPinner::start(Arc::clone(&dev), Arc::clone(&pool), SPLIT_BYTES).unwrap());
    assert!(
        pinner.progress().wait(Duration::from_secs(60)),
        "registration finished"
    );
    let total = pinner.progress().status().registered_bytes;
    assert_eq!(total, pool.memory().1, "the whole pool is registered, once");
    for method in [CopyMethod::Dma, CopyMethod::Staged] {
        let opts = CudaOptions {
            method,
            ..CudaOptions::default()
        };
        let a = CudaMover::new(0, Arc::clone(&pinner), opts.clone()).unwrap();
        let b = CudaMover::new(0, Arc::clone(&pinner), opts).unwrap();
        // 16 pieces of 64 KiB, strided in device memory, into one 1 MiB object.
        const PIECE: u64 = 64 << 10;
        let src = dev.alloc(32 * PIECE).unwrap();
        let dst = dev.alloc(32 * PIECE).unwrap();
        let pattern: Vec<u8> = (0..32 * PIECE).map(|i| (i * 31 % 251) as u8).collect();
        let s = dev.stream().unwrap();
        // SAFETY: our own allocations and a host vector that outlives the synchronised copies.
        unsafe {
            dev.copy_htod(src.ptr(), pattern.as_ptr(), pattern.len() as u64, &s)
                .unwrap();
            dev.memset(dst.ptr(), 0, dst.len(), &s).unwrap();
        }
        s.synchronize().unwrap();
        let ranges = |base: u64| -> Vec<CopyRange> {
            (0..16)
                .map(|i| CopyRange {
                    host_addr: base + 2 * i * PIECE,
                    object_offset: i * PIECE,
                    len: PIECE,
                })
                .collect()
        };
        let mut res = pool.reserve(16 * PIECE).unwrap();
        let (from, to) = (ranges(src.ptr()), ranges(dst.ptr()));
        let store = [BlockCopy {
            object: res.as_mut_ptr(),
            ranges: &from,
        }];
        // SAFETY: the ranges are device memory of device 0 that nothing else uses; the object
        // is our reservation of 16 * PIECE bytes.
        let out = unsafe { a.gather(&store, None) };
        assert_eq!(out, vec![Ok(())]);
        // One device's mover going away leaves the pool registered for the other.
        drop(a);
        assert_eq!(pinner.progress().status().registered_bytes, total);
        let load = [BlockCopy {
            object: res.as_mut_ptr(),
            ranges: &to,
        }];
        // SAFETY: as above, the object read, the ranges written.
        let out = unsafe { b.scatter(&load, None) };
        assert_eq!(out, vec![Ok(())]);
        let mut back = vec![0u8; pattern.len()];
        // SAFETY: our allocation into a host vector that outlives the synchronised copy.
        unsafe {
            dev.copy_dtoh(back.as_mut_ptr(), dst.ptr(), back.len() as u64, &s)
                .unwrap()
        };
        s.synchronize().unwrap();
        for i in 0..32 * PIECE as usize {
            let want = if (i as u64 / PIECE).is_multiple_of(2) {
                pattern[i]
            } else {
                0
            };
            assert_eq!(back[i], want, "byte {i} with {method}");
        }
        assert_eq!(pinner.progress().status().registered_bytes, total);
        drop(b);
    }
    pinner.shutdown();
    assert_eq!(
        pinner.progress().status().registered_bytes,
        0,
        "unregistered by its owner"
    );
}
