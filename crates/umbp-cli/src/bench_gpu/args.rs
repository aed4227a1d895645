//! The flags of `umbp bench gpu`.

#[derive(Debug, clap::Args)]
pub struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(super) device: i32,
    /// KV cache shapes, comma-separated: `llama8b` (32 layers × 64 KiB: Llama-3-8B, 8 KV heads,
    /// head 128, bf16, 16-token blocks, TP 1), `tp8-8k` (80 layers × 8 KiB: Llama-3-70B at TP 8)
    /// or `<layers>x<piece_bytes>`; each optionally `:<blocks in the cache>`.
    #[arg(long, default_value = "llama8b,tp8-8k")]
    pub(super) shapes: String,
    /// Blocks in each KV cache unless the shape says.
    #[arg(long, default_value_t = 4096)]
    pub(super) num_blocks: u64,
    /// Random blocks moved each way per round.
    #[arg(long, default_value_t = 1000)]
    pub(super) blocks: u64,
    /// Copy method: auto (the default), dma or staged.
    #[arg(long, default_value = "auto")]
    pub(super) method: String,
    /// Also run every shape with the dma method, for comparison.
    #[arg(long)]
    pub(super) also_dma: bool,
    /// Thread blocks a staging kernel may use (default: the store's default).
    #[arg(long)]
    pub(super) max_ctas: Option<u32>,
    /// Device staging memory per direction, MiB (default: the store's default).
    #[arg(long)]
    pub(super) staging_mib: Option<u64>,
    /// Staging slots per direction (default: the store's default).
    #[arg(long)]
    pub(super) staging_slots: Option<usize>,
    /// Blocks per mover call (default: the store's default).
    #[arg(long)]
    pub(super) batch_blocks: Option<usize>,
    /// Copy worker threads.
    #[arg(long, default_value_t = 4)]
    pub(super) workers: usize,
    /// Run one more, untimed round per shape and write the timeline of its both-directions run
    /// (every kernel, DMA, mover call and host wait) to this JSON file, with a printed summary.
    #[arg(long)]
    pub(super) trace: Option<std::path::PathBuf>,
    /// Timed rounds (the best of each figure is kept).
    #[arg(long, default_value_t = 3)]
    pub(super) rounds: u32,
    /// Also measure registering a pool of this many GiB for DMA (0: skip).
    #[arg(long, default_value_t = 0)]
    pub(super) pin_gib: u64,
    /// Piece-size sweep instead of --shapes: 4, 8, 16, 24, 32, 48, 64, 96, 128 and 256 KiB
    /// pieces in blocks of about 2 MiB (--sweep-block-kib; 2 to 128 layers), each with auto,
    /// dma and staged, then a table of store / load / both-ways figures against the same run's
    /// ceiling.
    #[arg(long)]
    pub(super) sweep: bool,
    /// Piece sizes of the sweep, KiB, comma-separated.
    #[arg(long, default_value = "4,8,16,24,32,48,64,96,128,256")]
    pub(super) sweep_kib: String,
    /// Methods of the sweep, comma-separated.
    #[arg(long, default_value = "auto,dma,staged")]
    pub(super) sweep_methods: String,
    /// Block sizes of the sweep, KiB, comma-separated (layers = block / piece, 2 to 128).
    #[arg(long, default_value = "2048")]
    pub(super) sweep_block_kib: String,
    /// `auto` uses DMA only for pieces averaging at least this many KiB (default: the store's).
    #[arg(long)]
    pub(super) auto_dma_min_piece_kib: Option<u64>,
    /// `auto` uses DMA only for blocks averaging at least this many KiB (default: the store's).
    #[arg(long)]
    pub(super) auto_dma_min_block_kib: Option<u64>,
    /// After the idle rounds, move the same blocks again while a bf16 matmul loop that fills
    /// every SM runs on its own stream (the engine's forward pass): copy GB/s during the load
    /// and the matmul's slowdown against the same loop alone, medians of --load-rounds.
    #[arg(long)]
    pub(super) under_load: bool,
    /// Methods measured under load, comma-separated.
    #[arg(long, default_value = "auto,dma,staged")]
    pub(super) under_load_methods: String,
    /// Rounds under load (each: the matmul loop alone, then beside copies).
    #[arg(long, default_value_t = 5)]
    pub(super) load_rounds: usize,
    /// Matrix size of the matmul load (n × n × n, bf16).
    #[arg(long, default_value_t = 8192)]
    pub(super) matmul_n: usize,
    /// Milliseconds one matmul loop runs (at least 8 idle copy jobs long).
    #[arg(long, default_value_t = 300)]
    pub(super) load_ms: u64,
    /// The pool's checksums (`off`, `sample`, `all`; see `integrity`): with a sum, each
    /// stored object is summed by its copy worker after the DMA, before the commit; a
    /// verified load reads its object once more before the copy. Run once per setting to
    /// compare.
    #[arg(long, default_value = umbp_core::options::INTEGRITY.default_str())]
    pub(super) integrity: String,
    /// Print a JSON object as the last line.
    #[arg(long)]
    pub(super) json: bool,
}
