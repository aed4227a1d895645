//! Tests of layouts: range plans, validation, and the disjointness check against a byte
//! model (property tests).

use super::*;
use proptest::prelude::*;

/// The model of the disjointness check: whether two runs share a byte, byte by byte.
fn bytes_clash(specs: &[LayerSpec]) -> bool {
    let mut seen = std::collections::HashSet::new();
    let mut clash = false;
    for s in specs {
        for b in 0..s.num_blocks {
            for j in 0..s.block_bytes {
                clash |= !seen.insert(s.base_addr + b * s.block_stride + j);
            }
        }
    }
    clash
}

/// A layer-first cache: `layers` layers, each `num_blocks * stride` bytes, back to back.
fn layer_first(layers: u64, num_blocks: u64, block_bytes: u64) -> GroupLayout {
    let layer_bytes = num_blocks * block_bytes;
    GroupLayout::new(
        (0..layers)
            .map(|l| LayerSpec {
                base_addr: 0x10_0000 + l * layer_bytes,
                num_blocks,
                block_stride: block_bytes,
                block_bytes,
            })
            .collect(),
    )
    .unwrap()
}

#[test]
fn layer_first_gives_one_range_per_layer() {
    let g = layer_first(4, 10, 256);
    assert_eq!(g.object_bytes(), 1024);
    let plan = g.plan(&[3, 7]).unwrap();
    assert_eq!(plan.num_blocks(), 2);
    assert_eq!(plan.block(0).len(), 4);
    assert_eq!(plan.pieces_per_block(), 4);
    assert_eq!(
        plan.block(1)[2],
        CopyRange {
            host_addr: 0x10_0000 + 2 * 2560 + 7 * 256,
            object_offset: 512,
            len: 256
        }
    );
}

#[test]
fn plans_build_each_blocks_ranges_on_demand() {
    let g = layer_first(80, 512, 64);
    let expect = |ids: &[u64]| -> Vec<CopyRange> {
        ids.iter()
            .flat_map(|&b| {
                (0..80u64).map(move |l| CopyRange {
                    host_addr: 0x10_0000 + l * 512 * 64 + b * 64,
                    object_offset: l * 64,
                    len: 64,
                })
            })
            .collect()
    };
    let ids: Vec<u64> = (0..400u64).map(|i| (i * 37 + 5) % 512).collect();
    let plan = g.plan(&ids).unwrap();
    assert_eq!(plan.num_blocks(), ids.len());
    assert_eq!(plan.object_bytes(), 80 * 64);
    let (ranges, starts) = plan.to_ranges();
    assert_eq!(ranges, expect(&ids));
    assert_eq!(starts.len(), ids.len() + 1);
    assert_eq!(plan.block(399), expect(&ids[399..]));
    // Appending keeps what the buffer held.
    let mut out = expect(&[1]);
    plan.append_block(0, &mut out);
    assert_eq!(out, expect(&[1, ids[0]]));
    // The same ranges as an explicit plan.
    let explicit = RangePlan::from_ranges(ranges, starts, 80 * 64).unwrap();
    assert_eq!(explicit.block(7), plan.block(7));
    assert_eq!(explicit.pieces_per_block(), 80);
    assert_eq!(explicit.layer_spans(), None);
    let spans = plan.layer_spans().unwrap();
    assert_eq!(spans.len(), 80);
    assert_eq!(spans[1], (0x10_0000 + 512 * 64, 512 * 64));
    assert!(g.plan(&[512]).is_err());
    assert!(RangePlan::from_ranges(vec![], vec![1], 0).is_err());
    assert!(RangePlan::from_ranges(vec![], vec![], 0).is_err());
}

#[test]
fn block_first_merges_into_one_range() {
    // All layers of one block are adjacent: stride = layers * block_bytes.
    let layers = (0..8)
        .map(|l| LayerSpec {
            base_addr: 0x1000 + l * 128,
            num_blocks: 5,
            block_stride: 8 * 128,
            block_bytes: 128,
        })
        .collect();
    let g = GroupLayout::new(layers).unwrap();
    let plan = g.plan(&[4, 0]).unwrap();
    assert_eq!(
        plan.block(0),
        &[CopyRange {
            host_addr: 0x1000 + 4 * 1024,
            object_offset: 0,
            len: 1024
        }]
    );
    assert_eq!(plan.block(1).len(), 1);
    assert_eq!(plan.pieces_per_block(), 1);
    assert_eq!(g.plan(&[]).unwrap().pieces_per_block(), 8);
}

#[test]
fn invalid_layouts_are_rejected() {
    assert!(GroupLayout::new(vec![]).is_err());
    let l = LayerSpec {
        base_addr: 0,
        num_blocks: 4,
        block_stride: 10,
        block_bytes: 20,
    };
    assert!(GroupLayout::new(vec![l]).is_err(), "overlapping blocks");
    let l = LayerSpec {
        base_addr: u64::MAX - 5,
        num_blocks: 2,
        block_stride: 10,
        block_bytes: 10,
    };
    assert!(GroupLayout::new(vec![l]).is_err(), "overflow");
    let g = layer_first(2, 4, 8);
    assert_eq!(
        g.plan(&[4]),
        Err(CoreError::BlockOutOfRange {
            block_id: 4,
            num_blocks: 4
        })
    );
    assert!(KvLayout::new(vec![]).is_err());
    assert!(KvLayout::new(vec![g]).unwrap().group(1).is_err());
}

#[test]
fn validation_checks_registrations() {
    let g = layer_first(2, 4, 8);
    // One region covering exactly both layers.
    let covered = |a: u64, n: u64| a >= 0x10_0000 && a + n <= 0x10_0000 + 64;
    assert!(g.validate_within(covered).is_ok());
    let short = |a: u64, n: u64| a >= 0x10_0000 && a + n <= 0x10_0000 + 63;
    assert!(g.validate_within(short).is_err());
}

#[test]
fn runs_sharing_bytes_are_rejected() {
    let run = |base_addr, block_stride, block_bytes| LayerSpec {
        base_addr,
        num_blocks: 4,
        block_stride,
        block_bytes,
    };
    // Two heads of one block-first layer, interleaved correctly: fine.
    assert!(GroupLayout::new(vec![run(0, 64, 32), run(32, 64, 32)]).is_ok());
    // The second run reaches into the next block's first run.
    let e = GroupLayout::new(vec![run(0, 64, 32), run(40, 64, 32)]).unwrap_err();
    assert!(e.to_string().contains("share bytes"), "{e}");
    // A run shifted by a whole block onto another one's later blocks.
    assert!(GroupLayout::new(vec![run(0, 64, 32), run(128, 64, 32)]).is_err());
    // The same layer registered twice.
    assert!(GroupLayout::new(vec![run(0, 32, 32), run(0, 32, 32)]).is_err());
    // A run whose blocks cross into the next stride's first bytes (stride 64: bytes 60..68
    // reach bytes 0..4 of the next 64, where the other run starts at 2, or at 4: fine).
    let e = GroupLayout::new(vec![run(60, 64, 8), run(66, 64, 4)]).unwrap_err();
    assert!(e.to_string().contains("runs 0 and 1"), "{e}");
    assert!(GroupLayout::new(vec![run(60, 64, 8), run(68, 64, 4)]).is_ok());
    // Different strides that meet in block 3 only.
    assert!(GroupLayout::new(vec![run(0, 100, 10), run(305, 1, 1)]).is_err());
    assert!(GroupLayout::new(vec![run(0, 100, 10), run(400, 1, 1)]).is_ok());
}

/// Issue 29, item 5: the check used to compare every pair of runs whose spans meet (all of
/// them in a block-first layout: 40,000 runs took 5 s) and runs of different strides block
/// by block (two runs of 2^32 blocks: 10 s). Both are bounded now.
#[test]
fn the_disjointness_check_is_bounded() {
    // 65,536 one-byte runs interleaved in every block: the sweep, no pairs.
    let runs: Vec<LayerSpec> = (0..MAX_LAYOUT_RUNS as u64)
        .map(|i| LayerSpec {
            base_addr: 1 << 20 | i,
            num_blocks: 1000,
            block_stride: MAX_LAYOUT_RUNS as u64,
            block_bytes: 1,
        })
        .collect();
    let mut clash = runs.clone();
    assert!(GroupLayout::new(runs).is_ok());
    clash[40_000].block_bytes = 2; // reaches into run 40,001
    let e = GroupLayout::new(clash).unwrap_err().to_string();
    assert!(e.contains("runs 40000 and 40001"), "{e}");

    let run = |base_addr, num_blocks, block_stride| LayerSpec {
        base_addr,
        num_blocks,
        block_stride,
        block_bytes: 1,
    };
    let e = GroupLayout::new(vec![run(0, 1 << 32, 2), run(1, 1 << 32, 3)]).unwrap_err();
    assert!(e.to_string().contains("at most 1073741824"), "{e}");
    // Different strides interleaved over many blocks: refused within the budget.
    let e = GroupLayout::new(vec![run(0, 1 << 25, 2), run(1, 1 << 25, 4)]).unwrap_err();
    assert!(e.to_string().contains("interleave too much"), "{e}");
    // One run too many; too many strides.
    let many = vec![run(0, 1, 1); MAX_LAYOUT_RUNS + 1];
    assert!(GroupLayout::new(many)
        .unwrap_err()
        .to_string()
        .contains("at most 65536"));
    let strides: Vec<LayerSpec> = (0..=MAX_GROUP_STRIDES as u64)
        .map(|i| run(i * 1_000_000, 2, 1 + i))
        .collect();
    let e = GroupLayout::new(strides).unwrap_err();
    assert!(e.to_string().contains("different block strides"), "{e}");
}

proptest! {
    // Clashes that only a run's spill into the next block shows are rare: many cases.
    #![proptest_config(ProptestConfig::with_cases(8192))]

    /// The same with many runs of a few shared strides: the sweep over rows (runs of one
    /// stride, spilling into the next block or not) and the budgeted check across strides.
    #[test]
    fn disjointness_of_shared_strides_matches_a_byte_model(
        runs in proptest::collection::vec((0u64..400, 0usize..4, 1u64..24), 1..12),
        nb in 1u64..6,
    ) {
        const STRIDES: [u64; 4] = [8, 16, 24, 64];
        let specs: Vec<LayerSpec> = runs.iter().map(|&(base, k, len)| LayerSpec {
            base_addr: base, num_blocks: nb, block_stride: STRIDES[k],
            block_bytes: len.min(STRIDES[k]),
        }).collect();
        let clash = bytes_clash(&specs);
        prop_assert_eq!(GroupLayout::new(specs).is_err(), clash);
    }
}

proptest! {
    /// The disjointness check agrees with a byte-by-byte model.
    #[test]
    fn disjointness_matches_a_byte_model(
        runs in proptest::collection::vec((0u64..200, 1u64..40, 1u64..20), 1..5),
        nb in 1u64..6,
    ) {
        let specs: Vec<LayerSpec> = runs.iter().map(|&(base, stride, len)| LayerSpec {
            base_addr: base, num_blocks: nb, block_stride: stride.max(len), block_bytes: len,
        }).collect();
        let clash = bytes_clash(&specs);
        prop_assert_eq!(GroupLayout::new(specs).is_err(), clash);
    }

    /// Whatever the layout, planned ranges cover exactly each layer's run of each block, in
    /// object order, with no gaps.
    #[test]
    fn plan_covers_every_byte(
        layers in 1u64..6, num_blocks in 1u64..20, block_bytes in 1u64..64,
        pad in 0u64..3, blocks in proptest::collection::vec(0u64..20, 0..10),
        block_first in any::<bool>()
    ) {
        let stride = if block_first { layers * block_bytes + pad } else { block_bytes + pad };
        let specs: Vec<_> = (0..layers).map(|l| LayerSpec {
            base_addr: if block_first { 4096 + l * block_bytes } else { 4096 + l * num_blocks * stride },
            num_blocks, block_stride: stride, block_bytes,
        }).collect();
        let g = GroupLayout::new(specs.clone()).unwrap();
        let blocks: Vec<u64> = blocks.into_iter().filter(|b| *b < num_blocks).collect();
        let plan = g.plan(&blocks).unwrap();
        for (i, &b) in blocks.iter().enumerate() {
            let mut expect = Vec::new();
            for (l, s) in specs.iter().enumerate() {
                for j in 0..block_bytes {
                    expect.push((s.base_addr + b * stride + j, l as u64 * block_bytes + j));
                }
            }
            let mut got = Vec::new();
            for r in plan.block(i) {
                for j in 0..r.len { got.push((r.host_addr + j, r.object_offset + j)); }
            }
            prop_assert_eq!(got, expect);
        }
    }
}
