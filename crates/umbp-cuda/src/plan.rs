//! Copy planning: pure functions from a batch of blocks to the copies the driver is asked for.
//!
//! * [`runs`]: the DMA plan. Pieces adjacent on both sides merge into one copy (a block-first
//!   layout with neighbouring pool objects becomes one large copy); pieces of equal length at
//!   constant strides on both sides fold into one strided (2-D, or 3-D when a stride is above
//!   the device's maximum pitch) copy: in a layer-first layout, one copy per block.
//! * [`staged`]: the staging plan. The pieces of many blocks are gathered on the device into a
//!   staging slot laid out like the pool objects, and each run of neighbouring pool objects
//!   is then one DMA.
//!
//! Every copy is cut at [`crate::pin::SPLIT_BYTES`] boundaries of the pool, so none straddles
//! two host registrations.

use umbp_copy::BlockCopy;

/// `len` bytes at `dev` (CUDA memory) and at `host` (pool memory), from block `block` of the
/// batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Device address.
    pub dev: u64,
    /// Pool address.
    pub host: u64,
    /// Bytes.
    pub len: u64,
    /// Index of the block in the batch.
    pub block: u32,
}

/// `count` copies of `len` bytes: copy `i` is at `dev + i * dev_stride` and
/// `host + i * host_stride`. `count == 1` is one plain copy (strides unused).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Device address of the first copy.
    pub dev: u64,
    /// Pool address of the first copy.
    pub host: u64,
    /// Bytes of each copy.
    pub len: u64,
    /// Device distance between copies.
    pub dev_stride: u64,
    /// Pool distance between copies.
    pub host_stride: u64,
    /// Number of copies.
    pub count: u64,
    /// First block of the batch the run touches.
    pub first_block: u32,
    /// Last block of the batch the run touches.
    pub last_block: u32,
}

impl Run {
    /// Bytes moved.
    pub fn bytes(&self) -> u64 {
        self.len * self.count
    }
}

/// The pieces of a batch, block after block, in range order.
pub fn pieces(blocks: &[BlockCopy<'_>]) -> Vec<Piece> {
    let mut out = Vec::with_capacity(blocks.iter().map(|b| b.ranges.len()).sum());
    for (i, b) in blocks.iter().enumerate() {
        for r in b.ranges {
            out.push(Piece {
                dev: r.host_addr,
                host: b.object as u64 + r.object_offset,
                len: r.len,
                block: i as u32,
            });
        }
    }
    out
}

fn granule(host: u64, base: u64, g: u64) -> u64 {
    host.saturating_sub(base) / g
}

/// Cuts every piece whose pool side crosses a multiple of `g` bytes from `base`.
pub fn split(pieces: &[Piece], base: u64, g: u64) -> Vec<Piece> {
    let mut out = Vec::with_capacity(pieces.len());
    for &p in pieces {
        let mut p = p;
        while p.len > 0 {
            let next = base + (granule(p.host, base, g) + 1) * g;
            let n = if p.host < base {
                p.len
            } else {
                p.len.min(next - p.host)
            };
            out.push(Piece { len: n, ..p });
            p.dev += n;
            p.host += n;
            p.len -= n;
        }
    }
    out
}

/// The DMA plan of `pieces` (already [`split`]): merges pieces adjacent on both sides, then
/// folds equal-length pieces at constant strides into runs. Nothing crosses a granule.
pub fn runs(pieces: &[Piece], base: u64, g: u64) -> Vec<Run> {
    // Merge neighbours.
    let mut merged: Vec<(Piece, u32)> = Vec::with_capacity(pieces.len());
    for &p in pieces {
        if let Some((c, last)) = merged.last_mut() {
            if c.dev + c.len == p.dev
                && c.host + c.len == p.host
                && granule(c.host, base, g) == granule(p.host, base, g)
            {
                c.len += p.len;
                *last = p.block;
                continue;
            }
        }
        merged.push((p, p.block));
    }
    // Fold strided runs.
    let mut out: Vec<Run> = Vec::with_capacity(merged.len());
    for (p, last) in merged {
        if let Some(r) = out.last_mut() {
            if p.len == r.len && granule(p.host, base, g) == granule(r.host, base, g) {
                if r.count == 1 {
                    if p.dev >= r.dev + r.len && p.host >= r.host + r.len {
                        r.dev_stride = p.dev - r.dev;
                        r.host_stride = p.host - r.host;
                        r.count = 2;
                        r.last_block = last;
                        continue;
                    }
                } else if Some(p.dev) == r.dev.checked_add(r.count * r.dev_stride)
                    && Some(p.host) == r.host.checked_add(r.count * r.host_stride)
                {
                    r.count += 1;
                    r.last_block = last;
                    continue;
                }
            }
        }
        out.push(Run {
            dev: p.dev,
            host: p.host,
            len: p.len,
            dev_stride: 0,
            host_stride: 0,
            count: 1,
            first_block: p.block,
            last_block: last,
        });
    }
    out
}

/// How to express a stride of `stride` bytes between rows of `len` bytes with pitches of at
/// most `max_pitch`: `(pitch, height)` with `pitch * height == stride` and
/// `len <= pitch <= max_pitch` (height 1 when the stride itself fits). A 3-D copy with one row
/// per slice then steps `pitch * height` bytes between slices. `None` when no such factoring
/// exists.
pub fn pitch_for(stride: u64, len: u64, max_pitch: u64) -> Option<(u64, u64)> {
    if stride <= max_pitch {
        return Some((stride, 1));
    }
    let first = stride.div_ceil(max_pitch);
    for k in first..first + (1 << 16) {
        let p = stride / k;
        if p < len {
            return None;
        }
        if stride.is_multiple_of(k) && p <= max_pitch {
            return Some((p, k));
        }
    }
    None
}

/// One gather/scatter descriptor: `len` bytes at device address `dev` and at `off` in the
/// staging slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Desc {
    /// Device address.
    pub dev: u64,
    /// Offset in the slot.
    pub off: u64,
    /// Bytes.
    pub len: u64,
}

/// One DMA between the staging slot and the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dma {
    /// Pool address.
    pub host: u64,
    /// Offset in the slot.
    pub off: u64,
    /// Bytes.
    pub len: u64,
}

/// What one staging slot carries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slice {
    /// Gather/scatter descriptors.
    pub descs: Vec<Desc>,
    /// DMAs, each inside one granule.
    pub dmas: Vec<Dma>,
    /// The blocks of the batch it carries.
    pub blocks: Vec<usize>,
    /// Bytes of the slot used.
    pub used: u64,
}

/// Start offsets of DMA runs in a slot are aligned to this (keeps the kernel on its 16-byte
/// vector path).
pub const STAGE_ALIGN: u64 = 256;

/// The staging plan of a batch, in slices of at most `slot_bytes` and `max_descs` descriptors;
/// `None` when one block's object is larger than a slot or has more ranges than `max_descs`.
/// Blocks are taken in pool address order, so objects that neighbour each other in the pool
/// (in either order in the batch) share one DMA.
pub fn staged(
    blocks: &[BlockCopy<'_>],
    slot_bytes: u64,
    max_descs: usize,
    base: u64,
    g: u64,
) -> Option<Vec<Slice>> {
    let mut out = Vec::new();
    staged_into(blocks, slot_bytes, max_descs, base, g, &mut out).then_some(out)
}

/// [`staged`] into `out`, reusing the slices and vectors a previous plan left there (a mover
/// keeps them between calls: a 16,384-piece plan built in fresh memory spent most of its
/// 250-330 µs faulting in pages, against about 60 µs in memory already touched). Returns false
/// (and leaves `out` empty) where [`staged`] returns `None`.
pub fn staged_into(
    blocks: &[BlockCopy<'_>],
    slot_bytes: u64,
    max_descs: usize,
    base: u64,
    g: u64,
    out: &mut Vec<Slice>,
) -> bool {
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by_key(|&i| blocks[i].object as u64);
    // Slices `0..used` of `out` hold this plan; later ones are spares from earlier plans.
    let mut used = 0usize;
    let take = |out: &mut Vec<Slice>, used: &mut usize| {
        if *used == out.len() {
            out.push(Slice::default());
        }
        let s = &mut out[*used];
        s.descs.clear();
        s.dmas.clear();
        s.blocks.clear();
        s.used = 0;
        *used += 1;
        *used - 1
    };
    let mut cur = take(out, &mut used);
    // Pool address just past the previous object, if the current DMA may grow.
    let mut host_end: Option<u64> = None;
    for i in order {
        let b = &blocks[i];
        let extent = b.extent();
        if extent > slot_bytes || b.ranges.len() > max_descs {
            out.clear();
            return false;
        }
        let host = b.object as u64;
        let contiguous = host_end == Some(host);
        let mut off = if contiguous {
            out[cur].used
        } else {
            out[cur].used.div_ceil(STAGE_ALIGN) * STAGE_ALIGN
        };
        if off + extent > slot_bytes || out[cur].descs.len() + b.ranges.len() > max_descs {
            cur = take(out, &mut used);
            off = 0;
            host_end = None;
        }
        let s = &mut out[cur];
        if host_end == Some(host) {
            s.dmas.last_mut().expect("a DMA is open").len += extent;
        } else {
            s.dmas.push(Dma {
                host,
                off,
                len: extent,
            });
        }
        s.descs.extend(b.ranges.iter().map(|r| Desc {
            dev: r.host_addr,
            off: off + r.object_offset,
            len: r.len,
        }));
        s.blocks.push(i);
        s.used = off + extent;
        host_end = Some(host + extent);
    }
    if out[cur].blocks.is_empty() {
        used -= 1;
    }
    out.truncate(used);
    // Cut DMAs at granule boundaries.
    for s in out.iter_mut() {
        if s.dmas.iter().all(|d| within_granule(d, base, g)) {
            continue;
        }
        let mut cut = Vec::with_capacity(s.dmas.len() + 1);
        for d in &s.dmas {
            for p in split(
                &[Piece {
                    dev: d.off,
                    host: d.host,
                    len: d.len,
                    block: 0,
                }],
                base,
                g,
            ) {
                cut.push(Dma {
                    host: p.host,
                    off: p.dev,
                    len: p.len,
                });
            }
        }
        s.dmas = cut;
    }
    true
}

/// Whether [`split`] would leave DMA `d` as it is: not empty, and inside one registration
/// granule of `g` bytes from `base` or outside the registered span.
fn within_granule(d: &Dma, base: u64, g: u64) -> bool {
    if d.len == 0 {
        return false; // [`split`] drops it
    }
    if g == 0 || d.host < base {
        return true;
    }
    (d.host - base) / g == (d.host - base + d.len - 1) / g
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use umbp_core::CopyRange;

    const G: u64 = 1 << 20;

    fn expand_pieces(ps: &[Piece]) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for p in ps {
            for j in 0..p.len {
                v.push((p.dev + j, p.host + j));
            }
        }
        v
    }

    fn expand_runs(rs: &[Run]) -> Vec<(u64, u64)> {
        let mut v = Vec::new();
        for r in rs {
            for i in 0..r.count {
                for j in 0..r.len {
                    v.push((r.dev + i * r.dev_stride + j, r.host + i * r.host_stride + j));
                }
            }
        }
        v
    }

    #[test]
    fn layer_first_blocks_become_one_strided_run_each() {
        // 4 layers, layer stride 1 MiB, 4 KiB pages; objects of 16 KiB in the pool.
        let ranges: Vec<Vec<CopyRange>> = [3u64, 9]
            .iter()
            .map(|&b| {
                (0..4)
                    .map(|l| CopyRange {
                        host_addr: 0x1000_0000 + l * G + b * 4096,
                        object_offset: l * 4096,
                        len: 4096,
                    })
                    .collect()
            })
            .collect();
        let objs = [0x7000_0000u64, 0x7000_8000];
        let blocks: Vec<BlockCopy<'_>> = ranges
            .iter()
            .zip(objs)
            .map(|(r, o)| BlockCopy {
                object: o as *mut u8,
                ranges: r,
            })
            .collect();
        let ps = split(&pieces(&blocks), 0x7000_0000, G);
        let rs = runs(&ps, 0x7000_0000, G);
        assert_eq!(rs.len(), 2, "{rs:?}");
        assert_eq!(
            rs[0],
            Run {
                dev: 0x1000_0000 + 3 * 4096,
                host: 0x7000_0000,
                len: 4096,
                dev_stride: G,
                host_stride: 4096,
                count: 4,
                first_block: 0,
                last_block: 0
            }
        );
        assert_eq!(rs[1].first_block, 1);
    }

    #[test]
    fn block_first_neighbours_merge_into_one_copy() {
        let r: Vec<Vec<CopyRange>> = (0..3u64)
            .map(|b| {
                vec![CopyRange {
                    host_addr: 0x1000 + b * 8192,
                    object_offset: 0,
                    len: 8192,
                }]
            })
            .collect();
        let blocks: Vec<BlockCopy<'_>> = r
            .iter()
            .enumerate()
            .map(|(b, r)| BlockCopy {
                object: (0x10_0000 + b as u64 * 8192) as *mut u8,
                ranges: r,
            })
            .collect();
        let rs = runs(&split(&pieces(&blocks), 0x10_0000, G), 0x10_0000, G);
        assert_eq!(rs.len(), 1);
        assert_eq!((rs[0].len, rs[0].count), (3 * 8192, 1));
        assert_eq!((rs[0].first_block, rs[0].last_block), (0, 2));
    }

    #[test]
    fn copies_never_cross_a_granule() {
        let p = Piece {
            dev: 0x5000,
            host: 0x10_0000 + G - 100,
            len: 300,
            block: 0,
        };
        let s = split(&[p], 0x10_0000, G);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].len, s[1].len, s[1].host), (100, 200, 0x10_0000 + G));
        let rs = runs(&s, 0x10_0000, G);
        assert_eq!(rs.len(), 2, "the halves must not merge again");
    }

    #[test]
    fn pitches_above_the_limit_are_factored() {
        assert_eq!(pitch_for(1000, 10, 2000), Some((1000, 1)));
        // 2.44 GiB stride, 64 KiB rows, 2 GiB - 1 limit.
        let s = 40_000u64 * 65536;
        let (p, h) = pitch_for(s, 65536, (1 << 31) - 1).unwrap();
        assert!(p * h == s && (65536..(1 << 31)).contains(&p), "{p} {h}");
        // A prime stride has no factoring.
        assert_eq!(pitch_for(4_294_967_311, 4096, (1 << 31) - 1), None);
    }

    #[test]
    fn staging_mirrors_neighbouring_objects() {
        let r: Vec<Vec<CopyRange>> = (0..4u64)
            .map(|b| {
                (0..2)
                    .map(|l| CopyRange {
                        host_addr: 0x100_0000 + l * G + b * 512,
                        object_offset: l * 512,
                        len: 512,
                    })
                    .collect()
            })
            .collect();
        // Objects 0,1 adjacent; 2 elsewhere; 3 adjacent to 2.
        let objs = [0x10_0000u64, 0x10_0400, 0x20_0000, 0x20_0400];
        let blocks: Vec<BlockCopy<'_>> = r
            .iter()
            .zip(objs)
            .map(|(r, o)| BlockCopy {
                object: o as *mut u8,
                ranges: r,
            })
            .collect();
        let s = staged(&blocks, 1 << 20, 1024, 0x10_0000, G).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(
            s[0].dmas,
            vec![
                Dma {
                    host: 0x10_0000,
                    off: 0,
                    len: 2048
                },
                Dma {
                    host: 0x20_0000,
                    off: 2048,
                    len: 2048
                }
            ]
        );
        assert_eq!(s[0].descs.len(), 8);
        // A slot of 3 KiB forces a second slice.
        let s = staged(&blocks, 3072, 1024, 0x10_0000, G).unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].blocks, vec![0, 1, 2]);
        assert_eq!(s[1].blocks, vec![3]);
        assert!(staged(&blocks, 512, 1024, 0x10_0000, G).is_none());
        // Neighbours in the pool share a DMA whatever their order in the batch.
        let rev: Vec<BlockCopy<'_>> = blocks.iter().rev().copied().collect();
        let s = staged(&rev, 1 << 20, 1024, 0x10_0000, G).unwrap();
        assert_eq!(s[0].dmas.len(), 2);
        assert_eq!(s[0].blocks, vec![3, 2, 1, 0]);
    }

    proptest! {
        /// Runs move exactly the bytes of the pieces, none crosses a granule, and strided runs
        /// have strides no smaller than their rows.
        #[test]
        fn runs_cover_pieces(
            layers in 1u64..6, nblocks in 1usize..6, len in 1u64..300,
            layer_gap in 0u64..3, adjacent in any::<bool>(), first_block in any::<bool>(),
            obj_gap in 0u64..3,
        ) {
            let base = 0x100_0000u64;
            let g = 4096u64;
            let ranges: Vec<Vec<CopyRange>> = (0..nblocks as u64).map(|b| {
                (0..layers).map(|l| CopyRange {
                    host_addr: if first_block {
                        0x9000_0000 + b * layers * len + l * len
                    } else {
                        0x9000_0000 + l * (len + layer_gap) * 64 + b * 3 * (len + layer_gap)
                    },
                    object_offset: l * len,
                    len,
                }).collect()
            }).collect();
            let obj_bytes = layers * len;
            let blocks: Vec<BlockCopy<'_>> = ranges.iter().enumerate().map(|(b, r)| BlockCopy {
                object: (base + 1000 + b as u64 * (obj_bytes + if adjacent { 0 } else { obj_gap * 16 + 16 })) as *mut u8,
                ranges: r,
            }).collect();
            let ps = pieces(&blocks);
            let sp = split(&ps, base, g);
            let rs = runs(&sp, base, g);
            prop_assert_eq!(expand_runs(&rs), expand_pieces(&ps));
            for r in &rs {
                let first = (r.host - base) / g;
                let last = (r.host + (r.count - 1) * r.host_stride + r.len - 1 - base) / g;
                prop_assert_eq!(first, last);
                if r.count > 1 {
                    prop_assert!(r.dev_stride >= r.len && r.host_stride >= r.len);
                }
            }
            // Staging: descriptors and DMAs together move the same bytes.
            if let Some(slices) = staged(&blocks, 1 << 16, 64, base, g) {
                let mut got = Vec::new();
                for s in &slices {
                    for d in &s.descs {
                        for j in 0..d.len {
                            // Find the DMA holding this slot byte.
                            let dma = s.dmas.iter().find(|m| d.off + j >= m.off && d.off + j < m.off + m.len);
                            prop_assert!(dma.is_some());
                            let m = dma.unwrap();
                            got.push((d.dev + j, m.host + (d.off + j - m.off)));
                        }
                    }
                    for m in &s.dmas {
                        prop_assert_eq!((m.host - base) / g, (m.host + m.len - 1 - base) / g);
                        prop_assert!(m.off + m.len <= 1 << 16);
                    }
                }
                let mut want = expand_pieces(&ps);
                want.sort_unstable();
                got.sort_unstable();
                prop_assert_eq!(got, want);
                let mut seen: Vec<usize> = slices.iter().flat_map(|s| s.blocks.clone()).collect();
                seen.sort_unstable();
                prop_assert_eq!(seen, (0..nblocks).collect::<Vec<_>>());
                // A plan into a buffer an earlier, different plan left (as a mover reuses
                // them) is the same plan: nothing of the earlier one is left in it.
                let mut reused = Vec::new();
                // Earlier plans: one of many small slices (spares left over), one that fails
                // (a block larger than a 64-byte slot) and must leave nothing behind.
                prop_assert!(staged_into(&blocks, 1 << 12, layers as usize, base, g, &mut reused));
                prop_assert_eq!(reused.len(), nblocks);
                let fits = staged_into(&blocks, 64, 64, base, g, &mut reused);
                prop_assert!(fits || reused.is_empty());
                prop_assert!(staged_into(&blocks[..nblocks.div_ceil(2)], 1 << 12, layers as usize, base, g, &mut reused));
                prop_assert!(staged_into(&blocks, 1 << 16, 64, base, g, &mut reused));
                prop_assert_eq!(&reused, &slices);
                prop_assert!(staged_into(&blocks[..1], 1 << 16, 64, base, g, &mut reused));
                prop_assert_eq!(reused, staged(&blocks[..1], 1 << 16, 64, base, g).unwrap());
            }
        }
    }
}
