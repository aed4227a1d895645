//! From a strided tensor view of one layer's KV cache to the contiguous runs of one block.
//!
//! An engine hands over each layer's KV cache as a tensor view: a base address, a shape and
//! strides, with one dimension indexing blocks. Which bytes belong to block `b` depends on the
//! strides alone: in some layouts a block of a layer is one contiguous run, in others (heads or
//! layers outside the block dimension, e.g. vLLM's `LHBNC` and `BHLNC`) it is several runs
//! spread over the allocation. [`TensorView::layer_runs`] finds those runs from the strides,
//! coalescing every dimension that is contiguous with the ones inside it, and refuses a view
//! whose elements could overlap or that it cannot describe.

use crate::layout::LayerSpec;
use crate::CoreError;

/// A strided view of one layer's KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorView {
    /// The tensor's name (a layer name), used in errors.
    pub name: String,
    /// Address of the view's first element.
    pub addr: u64,
    /// Bytes of one element.
    pub elem_bytes: u64,
    /// Size of each dimension.
    pub shape: Vec<u64>,
    /// Stride of each dimension, in elements.
    pub strides: Vec<i64>,
    /// The dimension that indexes blocks. Its size is the number of blocks, or a whole
    /// multiple `r` of it when a block is split into `r` consecutive rows (attention kernels
    /// whose block is smaller than the cache manager's).
    pub block_dim: usize,
}

/// One dimension in bytes.
#[derive(Debug, Clone, Copy)]
struct Dim {
    size: u64,
    stride: u64,
}

impl TensorView {
    fn err(&self, message: impl Into<String>) -> CoreError {
        CoreError::TensorLayout {
            tensor: self.name.clone(),
            message: message.into(),
        }
    }

    /// The runs of one block of this view, as layer specs (one per run, in address order,
    /// each at its own base address with the block stride), for a cache of `num_blocks`
    /// blocks. `expected_block_bytes`, when given, is what the engine says one block of this
    /// layer holds; the runs must add up to it.
    pub fn layer_runs(
        &self,
        num_blocks: u64,
        expected_block_bytes: Option<u64>,
    ) -> Result<Vec<LayerSpec>, CoreError> {
        let nd = self.shape.len();
        if nd == 0 || self.strides.len() != nd {
            return Err(self.err(format!(
                "shape {:?} and strides {:?} must have the same, non-zero number of dimensions",
                self.shape, self.strides
            )));
        }
        if self.block_dim >= nd {
            return Err(self.err(format!(
                "block dimension {} is outside its {nd} dimensions",
                self.block_dim
            )));
        }
        if self.elem_bytes == 0 || num_blocks == 0 {
            return Err(self.err("element size and number of blocks must be > 0"));
        }
        let rows = self.shape[self.block_dim];
        if rows == 0 || !rows.is_multiple_of(num_blocks) {
            return Err(self.err(format!(
                "dimension {} has {rows} rows, which is not a whole multiple of the cache's \
                 {num_blocks} blocks",
                self.block_dim
            )));
        }
        let split = rows / num_blocks;
        let mut dims = Vec::with_capacity(nd + 2);
        let mut block_stride = 0u64;
        for (d, (&size, &stride)) in self.shape.iter().zip(&self.strides).enumerate() {
            if stride < 0 {
                return Err(self.err(format!(
                    "dimension {d} has a negative stride ({stride}); only views with \
                     non-negative strides can be copied"
                )));
            }
            let stride = (stride as u64)
                .checked_mul(self.elem_bytes)
                .ok_or_else(|| self.err("a stride overflows 64 bits"))?;
            if d == self.block_dim {
                block_stride = stride
                    .checked_mul(split)
                    .ok_or_else(|| self.err("the block stride overflows 64 bits"))?;
                if split > 1 {
                    // The `split` rows of one block: a dimension inside the block.
                    dims.push(Dim {
                        size: split,
                        stride,
                    });
                }
            } else if size == 0 {
                return Err(self.err(format!("dimension {d} is empty")));
            } else if size > 1 {
                dims.push(Dim { size, stride });
            }
        }
        // The bytes of one element are the innermost dimension.
        dims.push(Dim {
            size: self.elem_bytes,
            stride: 1,
        });
        dims.sort_by_key(|d| (d.stride, d.size));
        let block_bytes = dims
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(d.size))
            .ok_or_else(|| self.err("one block's bytes overflow 64 bits"))?;

        // No two elements of the view may share memory: with every dimension (the block one
        // too) sorted by stride, each must step past everything the smaller ones span.
        let mut all = dims.clone();
        if num_blocks > 1 {
            all.push(Dim {
                size: num_blocks,
                stride: block_stride,
            });
            all.sort_by_key(|d| (d.stride, d.size));
        }
        let mut reach = 1u64; // bytes spanned by the dimensions so far (one element's first byte)
        for d in &all {
            if d.stride < reach {
                return Err(self.err(format!(
                    "its elements overlap or interleave (shape {:?}, strides {:?} in elements \
                     of {} bytes): UMBP copies only views where every dimension steps past \
                     the ones inside it",
                    self.shape, self.strides, self.elem_bytes
                )));
            }
            reach = (d.size - 1)
                .checked_mul(d.stride)
                .and_then(|x| x.checked_add(reach))
                .ok_or_else(|| self.err("the view's span overflows 64 bits"))?;
        }

        // Coalesce from the innermost dimension while each one continues the run.
        let mut run = 1u64;
        let mut outer = dims.as_slice();
        while let Some((d, rest)) = outer.split_first() {
            if d.stride != run {
                break;
            }
            run *= d.size;
            outer = rest;
        }
        // Every combination of the remaining dimensions is one run.
        let count: u64 = outer.iter().map(|d| d.size).product();
        const MAX_RUNS: u64 = 1 << 16;
        if count > MAX_RUNS {
            return Err(self.err(format!(
                "one block is {count} separate runs of {run} bytes (more than {MAX_RUNS}); \
                 use a layout where a block's bytes are less scattered"
            )));
        }
        let mut offsets = vec![0u64];
        for d in outer {
            offsets = offsets
                .iter()
                .flat_map(|&o| (0..d.size).map(move |i| o + i * d.stride))
                .collect();
        }
        offsets.sort_unstable();
        let total = count * run;
        debug_assert_eq!(total, block_bytes);
        if let Some(want) = expected_block_bytes {
            if want != total {
                return Err(self.err(format!(
                    "one block of the view holds {total} bytes but the engine's spec says \
                     {want}; the tensor does not match its KV cache spec"
                )));
            }
        }
        offsets
            .into_iter()
            .map(|off| {
                Ok(LayerSpec {
                    base_addr: self
                        .addr
                        .checked_add(off)
                        .ok_or_else(|| self.err("an address overflows 64 bits"))?,
                    num_blocks,
                    block_stride,
                    block_bytes: run,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn view(shape: &[u64], strides: &[i64], elem: u64, block_dim: usize) -> TensorView {
        TensorView {
            name: "layer.0".into(),
            addr: 1 << 20,
            elem_bytes: elem,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            block_dim,
        }
    }

    /// Contiguous strides of `shape` laid out in `order` (outermost first).
    fn strides_for(shape: &[u64], order: &[usize]) -> Vec<i64> {
        let mut s = vec![0i64; shape.len()];
        let mut cur = 1i64;
        for &d in order.iter().rev() {
            s[d] = cur;
            cur *= shape[d] as i64;
        }
        s
    }

    #[test]
    fn block_first_dims_inside_make_one_run() {
        // [B, H, N, C] contiguous: one run of H*N*C elements per block.
        let v = view(
            &[10, 4, 16, 8],
            &strides_for(&[10, 4, 16, 8], &[0, 1, 2, 3]),
            2,
            0,
        );
        let runs = v.layer_runs(10, Some(4 * 16 * 8 * 2)).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].block_bytes, 1024);
        assert_eq!(runs[0].block_stride, 1024);
    }

    #[test]
    fn heads_outside_blocks_make_one_run_per_head() {
        // LHBNC's layer view: [B, H, N, C] with H outermost in memory.
        let shape = [10, 4, 16, 8];
        let v = view(&shape, &strides_for(&shape, &[1, 0, 2, 3]), 2, 0);
        let runs = v.layer_runs(10, None).unwrap();
        assert_eq!(runs.len(), 4);
        for (h, r) in runs.iter().enumerate() {
            assert_eq!(r.base_addr, (1 << 20) + h as u64 * 10 * 256);
            assert_eq!(r.block_bytes, 256);
            assert_eq!(r.block_stride, 256);
        }
    }

    #[test]
    fn kernel_block_splits_fold_into_the_manager_block() {
        // 3 kernel rows per manager block, contiguous: still one run per manager block.
        let shape = [30, 2, 16, 8];
        let v = view(&shape, &strides_for(&shape, &[0, 1, 2, 3]), 1, 0);
        let runs = v.layer_runs(10, Some(3 * 256)).unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].block_stride, 3 * 256);
        assert_eq!(runs[0].block_bytes, 3 * 256);
        assert!(
            v.layer_runs(7, None).is_err(),
            "30 rows are not a multiple of 7"
        );
    }

    #[test]
    fn unplannable_views_are_refused_by_name() {
        let shape = [10, 4, 16, 8];
        // Overlapping: a zero stride on a dimension of size 4.
        let e = view(&shape, &[512, 0, 8, 1], 2, 0)
            .layer_runs(10, None)
            .unwrap_err();
        assert!(e.to_string().contains("layer.0"), "{e}");
        assert!(e.to_string().contains("overlap"), "{e}");
        // Negative strides.
        assert!(view(&shape, &[512, -128, 8, 1], 2, 0)
            .layer_runs(10, None)
            .is_err());
        // Blocks overlapping each other.
        assert!(view(&shape, &[8, 128, 8, 1], 2, 0)
            .layer_runs(10, None)
            .is_err());
        // Wrong spec size.
        let ok = strides_for(&shape, &[0, 1, 2, 3]);
        let e = view(&shape, &ok, 2, 0)
            .layer_runs(10, Some(1000))
            .unwrap_err();
        assert!(e.to_string().contains("1000"), "{e}");
        // Mismatched ranks, block dimension out of range.
        assert!(view(&shape, &ok[..3], 2, 0).layer_runs(10, None).is_err());
        assert!(view(&shape, &ok, 2, 4).layer_runs(10, None).is_err());
    }

    proptest! {
        /// For any permutation of a 5-dimensional cache (layers outside or inside), any block
        /// dimension and padding between blocks, the runs of each block cover exactly the
        /// bytes the view addresses for that block, and nothing else.
        #[test]
        fn runs_cover_exactly_each_blocks_bytes(
            sizes in proptest::collection::vec(1u64..4, 4),
            perm in Just(vec![0usize, 1, 2, 3]).prop_shuffle(),
            nb in 1u64..5, split in 1u64..3, elem in prop_oneof![Just(1u64), Just(2), Just(4)],
            pad in 0i64..3, block_pos in 0usize..4,
        ) {
            // Dimension 0 is the block dimension before the permutation moves it.
            let mut shape = sizes.clone();
            shape[0] = nb * split;
            let mut strides = strides_for(&shape, &perm);
            // Pad the block stride (if blocks are outermost, this leaves gaps between them).
            if perm[0] == 0 { strides[0] += pad; }
            // Put the block dimension at `block_pos`.
            let mut order: Vec<usize> = (1..4).collect();
            order.insert(block_pos, 0);
            let shape: Vec<u64> = order.iter().map(|&d| shape[d]).collect();
            let strides: Vec<i64> = order.iter().map(|&d| strides[d]).collect();
            let v = view(&shape, &strides, elem, block_pos);
            let runs = v.layer_runs(nb, None).unwrap();
            for b in 0..nb {
                // Expected: every element of rows b*split..(b+1)*split, in any order.
                let mut want = Vec::new();
                let other: Vec<usize> = (0..4).filter(|&d| d != block_pos).collect();
                for row in b * split..(b + 1) * split {
                    let mut idx = [0u64; 3];
                    loop {
                        let mut e = row as i64 * strides[block_pos];
                        for (k, &d) in other.iter().enumerate() { e += idx[k] as i64 * strides[d]; }
                        for j in 0..elem { want.push(v.addr + e as u64 * elem + j); }
                        let mut k = 0;
                        while k < 3 { idx[k] += 1; if idx[k] < shape[other[k]] { break; } idx[k] = 0; k += 1; }
                        if k == 3 { break; }
                    }
                }
                want.sort_unstable();
                let mut got: Vec<u64> = runs.iter()
                    .flat_map(|r| (0..r.block_bytes).map(move |j| r.base_addr + b * r.block_stride + j))
                    .collect();
                got.sort_unstable();
                prop_assert_eq!(got, want);
            }
        }
    }
}
