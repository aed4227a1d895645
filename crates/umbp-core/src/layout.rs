//! KV cache layouts and range planning.
//!
//! An engine's KV cache for one cache group is a list of runs ([`LayerSpec`]): for run `r` and
//! block `b` the bytes are `block_bytes` at `base_addr + b * block_stride`. A layer whose block is
//! one contiguous run is one spec; a layer whose block is scattered (heads or layers outside the
//! block dimension) is one spec per run ([`crate::TensorView::layer_runs`] finds them). One pool
//! object holds one block of one group: every run, concatenated in order. No two runs of a group
//! may share a byte, in any block: [`GroupLayout::new`] checks it.
//! [`GroupLayout::plan`] turns block ids into the scatter/gather ranges that move those bytes,
//! merging runs that are adjacent on both sides (a block-first layout becomes one range per block).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::CoreError;

/// The most runs one layout may have, over all its groups: 65,536 (vLLM's largest layouts have
/// a few hundred: two per layer, or one per layer and head where heads are scattered).
pub const MAX_LAYOUT_RUNS: usize = 1 << 16;
/// The most blocks one run may have: 1,073,741,824 (more than any KV cache holds).
pub const MAX_RUN_BLOCKS: u64 = 1 << 30;
/// The most different block strides one group's runs may use: 64 (a group's layers share
/// their page size, so real layouts have one or two).
pub const MAX_GROUP_STRIDES: usize = 64;
/// How much work the check of runs of *different* strides may do in one group before it
/// refuses the layout: 16,777,216 blocks compared or runs looked up (runs of different strides
/// that interleave are not a layout any engine makes; runs of one stride cost none of it).
const MAX_MIXED_STRIDE_WORK: u64 = 1 << 24;

/// One run of the KV cache: where block 0's run starts, how far apart blocks are, and how many
/// bytes the run holds in each block (a whole layer's block where that is contiguous).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Address of block 0 of this layer.
    pub base_addr: u64,
    /// Number of blocks the cache holds.
    pub num_blocks: u64,
    /// Distance in bytes between consecutive blocks of this layer.
    pub block_stride: u64,
    /// Bytes of one block of this layer (one contiguous run).
    pub block_bytes: u64,
}

/// Whether some block of run `a` shares a byte with some block of run `b` (both of
/// `num_blocks` blocks, so every block of one run is at most `block_stride` long unless there
/// is a single block).
fn runs_overlap(a: &LayerSpec, b: &LayerSpec) -> bool {
    let (x, y) = if a.base_addr <= b.base_addr {
        (a, b)
    } else {
        (b, a)
    };
    let nb = x.num_blocks;
    let d = y.base_addr - x.base_addr;
    if nb == 1 {
        return d < x.block_bytes;
    }
    if x.block_stride == y.block_stride {
        // Block b' of y starts d + (b' - b) * s after block b of x; with both runs at most s
        // long, only the two block distances that bring it within (-s, s) can overlap.
        let s = x.block_stride;
        let (m0, r) = (d / s, d % s);
        let near = m0 < nb && r < x.block_bytes;
        let before = m0 + 1 < nb && s - r < y.block_bytes;
        return near || before;
    }
    // Different strides: for each block of x, the blocks of y that start inside it or end
    // inside it.
    (0..nb).any(|i| {
        let lo = x.base_addr + i * x.block_stride;
        let hi = lo + x.block_bytes;
        // The first block of y that ends after `lo`.
        let first = (lo + 1)
            .saturating_sub(y.base_addr + y.block_bytes)
            .div_ceil(y.block_stride);
        first < nb && y.base_addr + first * y.block_stride < hi
    })
}

/// Two runs of `layers` (indices of runs of one stride, `class`) that share a byte, if any.
///
/// With stride `s`, byte `x` lies in row `x / s` at phase `x % s`. A run whose block 0 starts
/// at row `q`, phase `p`, covers phases `[p, min(p + len, s))` of rows `q .. q + nb` and, when
/// its blocks cross a row's end, phases `[0, p + len - s)` of rows `q + 1 ..= q + nb`: one or
/// two rectangles in (row, phase). Two runs share a byte exactly when two of their rectangles
/// meet. A sweep over rows keeps the phase intervals of the rectangles that cover the current
/// row, which are disjoint as long as nothing clashed, so each new one is compared with its two
/// neighbours only: O(n log n). With one block per run (`nb == 1`) all runs lie in row 0.
fn same_stride_clash(layers: &[LayerSpec], class: &[usize]) -> Option<(usize, usize)> {
    let nb = layers[class[0]].num_blocks;
    // (row, 0 = leaves / 1 = enters, phase start, phase end, run); rows as u128: no overflow.
    let mut events: Vec<(u128, u8, u64, u64, usize)> = Vec::with_capacity(class.len() * 4);
    for &i in class {
        let l = &layers[i];
        let (q, p, s) = if nb == 1 {
            (0, l.base_addr, u64::MAX)
        } else {
            (
                l.base_addr / l.block_stride,
                l.base_addr % l.block_stride,
                l.block_stride,
            )
        };
        let (q, rows) = (u128::from(q), u128::from(nb));
        // block_bytes <= stride (checked before), so p + len <= 2s - 1 and at most one spill.
        let first_end = p.saturating_add(l.block_bytes).min(s);
        events.push((q, 1, p, first_end, i));
        events.push((q + rows, 0, p, first_end, i));
        let spill = (u128::from(p) + u128::from(l.block_bytes)).saturating_sub(u128::from(s));
        if spill > 0 {
            let spill = spill as u64;
            events.push((q + 1, 1, 0, spill, i));
            events.push((q + 1 + rows, 0, 0, spill, i));
        }
    }
    events.sort_unstable();
    let mut active: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
    for (_, enters, start, end, i) in events {
        if enters == 0 {
            active.remove(&start);
            continue;
        }
        if let Some((_, &(e, j))) = active.range(..=start).next_back() {
            if e > start {
                return Some((j, i));
            }
        }
        if let Some((&st, &(_, j))) = active.range(start..).next() {
            if st < end {
                return Some((j, i));
            }
        }
        active.insert(start, (end, i));
    }
    None
}

/// The error for runs `i` and `j` sharing bytes.
fn clash(layers: &[LayerSpec], i: usize, j: usize) -> CoreError {
    let (i, j) = (i.min(j), i.max(j));
    CoreError::InvalidLayout(format!(
        "runs {i} and {j} of one cache group share bytes (run {i}: {:#x}, stride {}, {} bytes; \
         run {j}: {:#x}, stride {}, {} bytes); each byte of a block must belong to exactly one run",
        layers[i].base_addr,
        layers[i].block_stride,
        layers[i].block_bytes,
        layers[j].base_addr,
        layers[j].block_stride,
        layers[j].block_bytes
    ))
}

impl LayerSpec {
    /// First byte past the last block of this layer.
    fn end(&self) -> Option<u64> {
        (self.num_blocks - 1)
            .checked_mul(self.block_stride)?
            .checked_add(self.block_bytes)?
            .checked_add(self.base_addr)
    }
}

/// One contiguous piece of a copy: `len` bytes at `host_addr` in the engine's memory and at
/// `object_offset` inside a pool object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRange {
    /// Address in registered engine memory.
    pub host_addr: u64,
    /// Offset inside the pool object.
    pub object_offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// The copy ranges of many blocks. A plan made from a layout holds the block ids and the
/// layout's layers and builds a block's ranges when asked ([`RangePlan::append_block`]), so
/// submitting a job costs one pass over its block ids, not one per range (a 1,000-block,
/// 80-layer job is 80,000 ranges). A plan can also be a list of explicit ranges.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangePlan {
    object_bytes: u64,
    source: Source,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    Layout {
        layers: Arc<[LayerSpec]>,
        offsets: Arc<[u64]>,
        block_ids: Vec<u64>,
    },
    Ranges {
        ranges: Vec<CopyRange>,
        starts: Vec<usize>,
    },
}

impl RangePlan {
    /// A plan of explicit ranges: block `i`'s are `ranges[starts[i]..starts[i + 1]]`.
    pub fn from_ranges(
        ranges: Vec<CopyRange>,
        starts: Vec<usize>,
        object_bytes: u64,
    ) -> Result<Self, CoreError> {
        let ok = starts.first() == Some(&0)
            && starts.last() == Some(&ranges.len())
            && starts.windows(2).all(|w| w[0] <= w[1]);
        if !ok {
            return Err(CoreError::InvalidLayout(format!(
                "range plan: starts must rise from 0 to the number of ranges ({}), one more entry than blocks",
                ranges.len()
            )));
        }
        Ok(RangePlan {
            object_bytes,
            source: Source::Ranges { ranges, starts },
        })
    }

    /// Number of blocks planned.
    pub fn num_blocks(&self) -> usize {
        match &self.source {
            Source::Layout { block_ids, .. } => block_ids.len(),
            Source::Ranges { starts, .. } => starts.len().saturating_sub(1),
        }
    }

    /// Size of one block's object.
    pub fn object_bytes(&self) -> u64 {
        self.object_bytes
    }

    /// The ranges of one planned block, as [`RangePlan::append_block`] makes them: for a
    /// layout, those of the first block (layers merge alike in every block when they share a
    /// block stride, as engines lay them out); for explicit ranges, the most of any block.
    pub fn pieces_per_block(&self) -> usize {
        match &self.source {
            Source::Layout { layers, .. } => {
                if self.num_blocks() == 0 {
                    return layers.len();
                }
                let mut first = Vec::with_capacity(layers.len());
                self.append_block(0, &mut first);
                first.len()
            }
            Source::Ranges { starts, .. } => {
                starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0)
            }
        }
    }

    /// Appends the ranges of the `i`-th planned block to `out` (runs adjacent in both memories
    /// merged).
    pub fn append_block(&self, i: usize, out: &mut Vec<CopyRange>) {
        match &self.source {
            Source::Layout {
                layers,
                offsets,
                block_ids,
            } => {
                let b = block_ids[i];
                let start = out.len();
                for (l, &off) in layers.iter().zip(offsets.iter()) {
                    let addr = l.base_addr + b * l.block_stride;
                    if out.len() > start {
                        let last = out.last_mut().expect("non-empty");
                        if last.host_addr + last.len == addr && last.object_offset + last.len == off
                        {
                            last.len += l.block_bytes;
                            continue;
                        }
                    }
                    out.push(CopyRange {
                        host_addr: addr,
                        object_offset: off,
                        len: l.block_bytes,
                    });
                }
            }
            Source::Ranges { ranges, starts } => {
                out.extend_from_slice(&ranges[starts[i]..starts[i + 1]]);
            }
        }
    }

    /// The ranges of the `i`-th planned block.
    pub fn block(&self, i: usize) -> Vec<CopyRange> {
        let mut v = Vec::new();
        self.append_block(i, &mut v);
        v
    }

    /// Every block's ranges and where each block's start (one more entry than blocks).
    pub fn to_ranges(&self) -> (Vec<CopyRange>, Vec<usize>) {
        let mut ranges = Vec::new();
        let mut starts = Vec::with_capacity(self.num_blocks() + 1);
        for i in 0..self.num_blocks() {
            starts.push(ranges.len());
            self.append_block(i, &mut ranges);
        }
        starts.push(ranges.len());
        (ranges, starts)
    }

    /// For a plan made from a layout: each layer's whole span `(addr, len)` (every block of
    /// the plan lies inside these), so memory can be checked once per layer. `None` for a plan
    /// of explicit ranges.
    pub fn layer_spans(&self) -> Option<Vec<(u64, u64)>> {
        match &self.source {
            Source::Layout { layers, .. } => Some(
                layers
                    .iter()
                    .map(|l| {
                        let end = l.end().expect("checked when the layout was made");
                        (l.base_addr, end - l.base_addr)
                    })
                    .collect(),
            ),
            Source::Ranges { .. } => None,
        }
    }
}

/// The layout of one KV cache group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupLayout {
    layers: Arc<[LayerSpec]>,
    object_offsets: Arc<[u64]>,
    object_bytes: u64,
    num_blocks: u64,
}

impl GroupLayout {
    /// Validates `layers` and computes where each layer's run sits in an object.
    pub fn new(layers: Vec<LayerSpec>) -> Result<Self, CoreError> {
        let Some(first) = layers.first() else {
            return Err(CoreError::InvalidLayout(
                "a cache group needs at least one layer".into(),
            ));
        };
        let num_blocks = first.num_blocks;
        if layers.len() > MAX_LAYOUT_RUNS {
            return Err(CoreError::InvalidLayout(format!(
                "a cache group of {} runs; a layout may have at most {MAX_LAYOUT_RUNS}",
                layers.len()
            )));
        }
        if num_blocks > MAX_RUN_BLOCKS {
            return Err(CoreError::InvalidLayout(format!(
                "runs of {num_blocks} blocks; a run may have at most {MAX_RUN_BLOCKS}"
            )));
        }
        let mut object_offsets = Vec::with_capacity(layers.len());
        let mut object_bytes: u64 = 0;
        for (i, l) in layers.iter().enumerate() {
            if l.num_blocks == 0 || l.block_bytes == 0 {
                return Err(CoreError::InvalidLayout(format!(
                    "layer {i}: num_blocks and block_bytes must be > 0 (got {} and {})",
                    l.num_blocks, l.block_bytes
                )));
            }
            if l.num_blocks != num_blocks {
                return Err(CoreError::InvalidLayout(format!(
                    "layer {i} has {} blocks but layer 0 has {num_blocks}: layers of one group share block ids",
                    l.num_blocks
                )));
            }
            if l.num_blocks > 1 && l.block_stride < l.block_bytes {
                return Err(CoreError::InvalidLayout(format!(
                    "layer {i}: block_stride {} is smaller than block_bytes {}, so blocks would overlap",
                    l.block_stride, l.block_bytes
                )));
            }
            if l.end().is_none() {
                return Err(CoreError::InvalidLayout(format!(
                    "layer {i}: the last block ends past the address space"
                )));
            }
            object_offsets.push(object_bytes);
            object_bytes = object_bytes
                .checked_add(l.block_bytes)
                .ok_or_else(|| CoreError::InvalidLayout("object size overflows 64 bits".into()))?;
        }
        Self::check_disjoint(&layers)?;
        Ok(GroupLayout {
            layers: layers.into(),
            object_offsets: object_offsets.into(),
            object_bytes,
            num_blocks,
        })
    }

    /// Fails when two runs share a byte in some blocks (an object would hold the same bytes
    /// twice and a load would write them twice, or a run was planned wrongly).
    ///
    /// Runs of one stride are checked together in O(n log n) ([`same_stride_clash`]), so an
    /// interleaved (block-first) layout of many runs costs no pairwise comparisons. Runs of
    /// different strides are compared pairwise where their spans meet, block by block, within
    /// a budget ([`MAX_MIXED_STRIDE_WORK`]).
    fn check_disjoint(layers: &[LayerSpec]) -> Result<(), CoreError> {
        let nb = layers[0].num_blocks;
        // With one block the stride means nothing: every run is one interval.
        let stride = |i: usize| if nb == 1 { 0 } else { layers[i].block_stride };
        let mut classes: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
        for i in 0..layers.len() {
            classes.entry(stride(i)).or_default().push(i);
        }
        if classes.len() > MAX_GROUP_STRIDES {
            return Err(CoreError::InvalidLayout(format!(
                "the group's runs use {} different block strides, more than the {MAX_GROUP_STRIDES} a layout may have",
                classes.len()
            )));
        }
        for class in classes.values() {
            if let Some((i, j)) = same_stride_clash(layers, class) {
                return Err(clash(layers, i, j));
            }
        }
        // Runs of different strides, sorted by base within each stride.
        let sorted: Vec<Vec<usize>> = classes
            .into_values()
            .map(|mut c| {
                c.sort_by_key(|&i| layers[i].base_addr);
                c
            })
            .collect();
        let end = |i: usize| layers[i].end().expect("checked before");
        let mut work: u64 = 0;
        let mut spend = |w: u64| {
            work += w;
            if work > MAX_MIXED_STRIDE_WORK {
                return Err(CoreError::InvalidLayout(format!(
                    "runs of different block strides interleave too much to be checked (more than {MAX_MIXED_STRIDE_WORK} blocks compared or runs looked up); give the group's runs one stride, or register the interleaved ones as separate groups"
                )));
            }
            Ok(())
        };
        for (a, ca) in sorted.iter().enumerate() {
            for (b, cb) in sorted.iter().enumerate() {
                if a == b {
                    continue;
                }
                // Every pair whose spans meet has one run's base inside the other's span:
                // here, `j`'s base inside `i`'s span (the other way round when a and b swap).
                for &i in ca {
                    spend(1)?;
                    let from = cb.partition_point(|&j| layers[j].base_addr < layers[i].base_addr);
                    let meeting = cb[from..]
                        .iter()
                        .take_while(|&&j| layers[j].base_addr < end(i));
                    for &j in meeting {
                        spend(nb)?;
                        if runs_overlap(&layers[i], &layers[j]) {
                            return Err(clash(layers, i, j));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// What one block of this group costs to copy: runs, ranges after merging, piece sizes.
    pub fn summary(&self) -> LayoutSummary {
        let ranges = self.plan(&[0]).expect("block 0 exists").block(0);
        LayoutSummary {
            runs: self.layers.len(),
            ranges_per_block: ranges.len(),
            min_piece: ranges.iter().map(|r| r.len).min().unwrap_or(0),
            max_piece: ranges.iter().map(|r| r.len).max().unwrap_or(0),
            object_bytes: self.object_bytes,
        }
    }

    /// The layers, in object order.
    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// Bytes of one block's object.
    pub fn object_bytes(&self) -> u64 {
        self.object_bytes
    }

    /// Blocks in the cache.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Checks every layer's whole span against `covered(addr, len)`, which says whether
    /// `[addr, addr + len)` lies inside one registered memory region.
    pub fn validate_within(&self, covered: impl Fn(u64, u64) -> bool) -> Result<(), CoreError> {
        for (i, l) in self.layers.iter().enumerate() {
            let end = l.end().expect("checked in new");
            if !covered(l.base_addr, end - l.base_addr) {
                return Err(CoreError::InvalidLayout(format!(
                    "layer {i}: bytes {:#x}..{end:#x} are not inside one registered memory region; \
                     register the KV cache tensor before the layout",
                    l.base_addr
                )));
            }
        }
        Ok(())
    }

    /// Plans the ranges of `block_ids` (checked against the number of blocks; the ranges are
    /// built when a copy needs them).
    pub fn plan(&self, block_ids: &[u64]) -> Result<RangePlan, CoreError> {
        if let Some(&b) = block_ids.iter().find(|&&b| b >= self.num_blocks) {
            return Err(CoreError::BlockOutOfRange {
                block_id: b,
                num_blocks: self.num_blocks,
            });
        }
        Ok(RangePlan {
            object_bytes: self.object_bytes,
            source: Source::Layout {
                layers: Arc::clone(&self.layers),
                offsets: Arc::clone(&self.object_offsets),
                block_ids: block_ids.to_vec(),
            },
        })
    }
}

/// What copying one block of a group involves (see [`GroupLayout::summary`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayoutSummary {
    /// Runs the group was registered with.
    pub runs: usize,
    /// Copy ranges of one block after merging runs adjacent on both sides (block 0).
    pub ranges_per_block: usize,
    /// Smallest range, bytes.
    pub min_piece: u64,
    /// Largest range, bytes.
    pub max_piece: u64,
    /// Bytes of one block's object.
    pub object_bytes: u64,
}

/// Every cache group's layout; group `g` is `groups()[g]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    groups: Vec<GroupLayout>,
}

impl KvLayout {
    /// A layout of one or more groups.
    pub fn new(groups: Vec<GroupLayout>) -> Result<Self, CoreError> {
        if groups.is_empty() {
            return Err(CoreError::InvalidLayout(
                "a KV layout needs at least one cache group".into(),
            ));
        }
        let runs: usize = groups.iter().map(|g| g.layers.len()).sum();
        if runs > MAX_LAYOUT_RUNS {
            return Err(CoreError::InvalidLayout(format!(
                "a layout of {runs} runs; a layout may have at most {MAX_LAYOUT_RUNS}"
            )));
        }
        Ok(KvLayout { groups })
    }

    /// The groups, indexed by group id.
    pub fn groups(&self) -> &[GroupLayout] {
        &self.groups
    }

    /// One group's layout.
    pub fn group(&self, group: u32) -> Result<&GroupLayout, CoreError> {
        self.groups.get(group as usize).ok_or_else(|| {
            CoreError::InvalidLayout(format!(
                "cache group {group} does not exist: the layout has {} groups",
                self.groups.len()
            ))
        })
    }

    /// Checks every group with [`GroupLayout::validate_within`].
    pub fn validate_within(&self, covered: impl Fn(u64, u64) -> bool) -> Result<(), CoreError> {
        self.groups
            .iter()
            .try_for_each(|g| g.validate_within(&covered))
    }
}

#[cfg(test)]
mod tests;
