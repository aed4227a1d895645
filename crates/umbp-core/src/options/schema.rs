//! The schema table: one [`OptionSpec`] constant per connector option, [`SCHEMA`] listing
//! them in the docs' order, and [`spec`] to find one by name.

use super::spec::{DefaultValue, Kind, OptionSpec, Scope, TextRule, Unit};
use crate::sizes::{GIB, MIB};

/// Shorthand for an integer kind without an upper bound.
const fn at_least(min: u64, unit: Unit) -> Kind {
    Kind::Int {
        min,
        max: u64::MAX,
        unit,
    }
}

/// Shorthand for a boolean option.
const fn flag(name: &'static str, default: bool, doc: &'static str) -> OptionSpec {
    OptionSpec {
        name,
        scope: Scope::Shared,
        kind: Kind::Bool,
        default: DefaultValue::Bool(default),
        nullable: false,
        default_doc: None,
        doc,
        also_rejected: None,
    }
}

/// The two modes.
pub const MODES: &[&str] = &["embedded", "standalone"];
/// The `kv_role`s the connector accepts.
pub const KV_ROLES: &[&str] = &["kv_both", "kv_producer", "kv_consumer"];

/// `mode`.
pub const MODE: OptionSpec = OptionSpec {
    name: "mode",
    scope: Scope::Shared,
    kind: Kind::Choice(MODES),
    default: DefaultValue::Str("embedded"),
    nullable: false,
    default_doc: None,
    doc: "`\"embedded\"`: a private pool per worker. `\"standalone\"`: the node's \
          `umbp_standalone_server` owns one pool every engine on the node shares (see \
          [standalone.md](standalone.md#the-vllm-connector-in-standalone-mode)).",
    also_rejected: None,
};
/// `load_async`.
pub const LOAD_ASYNC: OptionSpec = flag(
    "load_async",
    true,
    "Restore in the background while the request waits (vLLM schedules it once the load is \
     done); false: restore before the step's forward pass. Models with several KV cache \
     groups (hybrid models, Mamba / linear-attention state among them) always restore in the \
     background.",
);
/// `lookup_async`.
pub const LOOKUP_ASYNC: OptionSpec = flag(
    "lookup_async",
    false,
    "Look up off the scheduler thread; vLLM asks again until the lookup is done. The answer is \
     used only if the request's lookup range and block hashes are still the ones looked up \
     (else it is looked up again), and it is dropped when the request finishes.",
);
/// `lookup_workers`.
pub const LOOKUP_WORKERS: OptionSpec = OptionSpec {
    name: "lookup_workers",
    scope: Scope::Shared,
    kind: Kind::Int {
        min: 1,
        max: 64,
        unit: Unit::Count,
    },
    default: DefaultValue::Int(2),
    nullable: false,
    default_doc: None,
    doc: "Threads that run `lookup_async` lookups (the in-tree class's option name; ignored \
          without `lookup_async`).",
    also_rejected: None,
};
/// `kv_event_max_objects`.
pub const KV_EVENT_MAX_OBJECTS: OptionSpec = OptionSpec {
    name: "kv_event_max_objects",
    scope: Scope::Shared,
    kind: at_least(0, Unit::Count),
    default: DefaultValue::Int(65536),
    nullable: false,
    default_doc: None,
    doc: "Most objects tracked for KV events; when full, new stored events are suppressed until \
          tracked objects leave the pool. Storage and lookups go on.",
    also_rejected: None,
};
/// `self_describing_kv_events`.
pub const SELF_DESCRIBING_KV_EVENTS: OptionSpec = flag(
    "self_describing_kv_events",
    false,
    "With vLLM's KV events on, each `BlockStored` of the pool (medium `CPU`) carries its \
     blocks' token ids, the parent block hash, the block size, the LoRA adapter and the cache \
     group, as vLLM's offloading connector sends them (without `extra_keys` and \
     `lookahead_token_ids`), so a KV-aware router can index UMBP-held prefixes; false: block \
     hashes only. Blocks stored by `lazy_offload` and recurrent-state blocks stay hash-only.",
);
/// `enable_lookup`.
pub const ENABLE_LOOKUP: OptionSpec = flag(
    "enable_lookup",
    true,
    "Restore from the pool; false: store only.",
);
/// `save_decode_cache`.
pub const SAVE_DECODE_CACHE: OptionSpec = flag(
    "save_decode_cache",
    false,
    "Also store blocks filled by decoding (default: prompt blocks only).",
);
/// `store_priority_skip_above`.
pub const STORE_PRIORITY_SKIP_ABOVE: OptionSpec = OptionSpec {
    name: "store_priority_skip_above",
    scope: Scope::Shared,
    kind: Kind::Priority,
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("none"),
    doc: "Blocks of requests whose vLLM `priority` is above this are never stored (batch jobs, \
          crawls: a burst of one-off prompts cannot flush the shared prefixes); they still \
          restore, and count in `vllm:umbp_store_hint_skipped_blocks`. vLLM's priority is an \
          integer, lower served first, 0 by default (vLLM schedules by it under \
          `--scheduling-policy priority`). A request's `kv_transfer_params` \
          `{\"umbp_store\": ...}` overrides it (see \
          [per-request store hints](#per-request-store-hints)). Not applied to `lazy_offload` \
          stores.",
    also_rejected: Some("Below `store_priority_admit_at_most`."),
};
/// `store_priority_admit_at_most`.
pub const STORE_PRIORITY_ADMIT_AT_MOST: OptionSpec = OptionSpec {
    name: "store_priority_admit_at_most",
    scope: Scope::Shared,
    kind: Kind::Priority,
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("none"),
    doc: "Blocks of requests whose vLLM `priority` is at most this are kept on their first \
          sighting even where the pool's store admission is `on_reuse` (the embedded \
          `store_admission`, or the server's `--store-admission`): interactive or premium \
          traffic restores on its second run. Counted in `vllm:umbp_store_hint_now_blocks` and \
          the pool's `admissions_forced`. Not applied to `lazy_offload` stores.",
    also_rejected: None,
};
/// `lazy_offload`.
pub const LAZY_OFFLOAD: OptionSpec = flag(
    "lazy_offload",
    false,
    "Instead of storing every completed block after each step, store cached blocks as they \
     come up for eviction: each step walks vLLM's free queue from its head (next to evict \
     first) and stores the hashed blocks not stored yet; once stored they go back to the head, \
     where they were (vLLM 0.34's `free_blocks(..., evict_first=True)`, or the same move on \
     older vLLM).",
);
/// `lazy_offload_max_blocks`.
pub const LAZY_OFFLOAD_MAX_BLOCKS: OptionSpec = OptionSpec {
    name: "lazy_offload_max_blocks",
    scope: Scope::Shared,
    kind: at_least(1, Unit::Count),
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("2 × ⌈max_num_batched_tokens / block_size⌉"),
    doc: "Most free-queue blocks examined per step in lazy mode, from the head. A step evicts \
          at most ⌈max_num_batched_tokens / block_size⌉ blocks, so at least that many keeps \
          every block stored before vLLM evicts it.",
    also_rejected: Some(
        "With `lazy_offload`, fewer than ⌈max_num_batched_tokens / block_size⌉ (start-up \
         `ConfigError` naming the minimum).",
    ),
};
/// `enable_partial_hash_hits`.
pub const ENABLE_PARTIAL_HASH_HITS: OptionSpec = OptionSpec {
    also_rejected: Some("True where the engine matches prefixes at a finer unit than the block."),
    ..flag(
        "enable_partial_hash_hits",
        false,
        "Hits that end inside a block. UMBP stores whole blocks, so this is accepted only where \
         the engine's prefix-match unit is the block size (then it changes nothing).",
    )
};
/// `num_workers`: copy threads per worker (also the store's `num_workers`).
pub const NUM_WORKERS: OptionSpec = OptionSpec {
    name: "num_workers",
    scope: Scope::Shared,
    kind: Kind::Int {
        min: 1,
        max: 256,
        unit: Unit::Count,
    },
    default: DefaultValue::Int(4),
    nullable: false,
    default_doc: None,
    doc: "Copy threads per worker (embedded mode; in standalone mode the server's `--workers` \
          copy for every engine).",
    also_rejected: None,
};
/// `timeout_ms`: the deadline of synchronous waits (also the store's `timeout_ms`).
pub const TIMEOUT_MS: OptionSpec = OptionSpec {
    name: "timeout_ms",
    scope: Scope::Shared,
    kind: at_least(1, Unit::Millis),
    default: DefaultValue::Int(30_000),
    nullable: false,
    default_doc: None,
    doc: "Deadline of a synchronous load; a load that misses it fails the step (its blocks are \
          never used half-written). In standalone mode also each transfer's deadline at the \
          server: one past it stays pending with its blocks held, and new transfers fail at \
          once, until the server answers.",
    also_rejected: None,
};
/// `lookup_timeout_ms`.
pub const LOOKUP_TIMEOUT_MS: OptionSpec = OptionSpec {
    name: "lookup_timeout_ms",
    scope: Scope::Shared,
    kind: at_least(1, Unit::Millis),
    default: DefaultValue::Int(1000),
    nullable: false,
    default_doc: None,
    doc: "Deadline of each scheduler lookup. A lookup past it is a miss, and that worker's \
          (standalone: the server's) lookups miss at once until its late answer arrives.",
    also_rejected: None,
};
/// `key_namespace`.
pub const KEY_NAMESPACE: OptionSpec = OptionSpec {
    name: "key_namespace",
    scope: Scope::Shared,
    kind: Kind::Text(TextRule::Namespace),
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("derived"),
    doc: "Overrides the namespace derived from the model, revision, effective model config, KV \
          layout, cache groups, TP/PCP/DCP topology and draft model (the DP rank is never part \
          of it). Use it to separate weight versions that share a model path. `\"auto\"` (the \
          in-tree class's default) means derived.",
    also_rejected: None,
};
/// `capacity_bytes`: each worker's pool (also the store's `capacity_bytes`).
pub const CAPACITY_BYTES: OptionSpec = OptionSpec {
    name: "capacity_bytes",
    scope: Scope::Embedded,
    kind: at_least(MIB, Unit::Bytes),
    default: DefaultValue::Int(64 * GIB),
    nullable: true,
    default_doc: None,
    doc: "Pool size of each worker.",
    also_rejected: Some("Set together with `total_capacity_bytes`."),
};
/// `total_capacity_bytes`.
pub const TOTAL_CAPACITY_BYTES: OptionSpec = OptionSpec {
    name: "total_capacity_bytes",
    scope: Scope::Embedded,
    kind: at_least(MIB, Unit::Bytes),
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("—"),
    doc: "Pool size of the engine, split evenly across its workers (instead of \
          `capacity_bytes`).",
    also_rejected: Some(
        "Set together with `capacity_bytes`; a share of each worker below the minimum.",
    ),
};
/// `lookup_instance`.
pub const LOOKUP_INSTANCE: OptionSpec = OptionSpec {
    name: "lookup_instance",
    scope: Scope::Embedded,
    kind: Kind::Text(TextRule::Instance),
    default: DefaultValue::Str(""),
    nullable: false,
    default_doc: None,
    doc: "Tells apart independent engines serving the same model on one host (DP ranks are told \
          apart already). Two engines with the same namespace and instance on one host are \
          refused at start-up (the socket is in use).",
    also_rejected: None,
};
/// `lookup_dir`.
pub const LOOKUP_DIR: OptionSpec = OptionSpec {
    name: "lookup_dir",
    scope: Scope::Embedded,
    kind: Kind::Text(TextRule::Directory),
    default: DefaultValue::Str("/tmp"),
    nullable: false,
    default_doc: None,
    doc: "Where this user's private socket directory `umbp-<uid>/` is made (0700, checked on \
          every use; see [vllm.md](vllm.md#security-one-host-embedded-mode)). The per-worker \
          lookup sockets in it are named `umbp-<tag>-dp<DP rank>-w<worker>.sock`, where the tag \
          hashes the namespace and `lookup_instance`; beside them, a `.claims` file per running \
          engine for the memory check over its workers. A stopped engine leaves neither.",
    also_rejected: Some(
        "The private directory is not a real directory owned by this user with mode 700.",
    ),
};
/// `dram_high_watermark` (also the store's `high_watermark`).
pub const DRAM_HIGH_WATERMARK: OptionSpec = OptionSpec {
    name: "dram_high_watermark",
    scope: Scope::Embedded,
    kind: Kind::Fraction,
    default: DefaultValue::Float(0.9),
    nullable: false,
    default_doc: None,
    doc: "Occupancy (fraction of the pool) above which background eviction starts.",
    also_rejected: None,
};
/// `dram_low_watermark` (also the store's `low_watermark`).
pub const DRAM_LOW_WATERMARK: OptionSpec = OptionSpec {
    name: "dram_low_watermark",
    scope: Scope::Embedded,
    kind: Kind::Fraction,
    default: DefaultValue::Float(0.7),
    nullable: false,
    default_doc: None,
    doc: "Occupancy background eviction brings the pool down to.",
    also_rejected: Some("Not below `dram_high_watermark`."),
};
/// `dram_use_hugepages` (also the store's `use_hugepages`).
pub const DRAM_USE_HUGEPAGES: OptionSpec = OptionSpec {
    scope: Scope::Embedded,
    ..flag(
        "dram_use_hugepages",
        false,
        "Back each worker's pool with explicit huge pages; without reserved huge pages it falls \
         back to normal pages with a warning (see the store table below).",
    )
};
/// `dram_hugepage_size` (also the store's `hugepage_size`).
pub const DRAM_HUGEPAGE_SIZE: OptionSpec = OptionSpec {
    name: "dram_hugepage_size",
    scope: Scope::Embedded,
    kind: Kind::HugepageSize,
    default: DefaultValue::Str("2MiB"),
    nullable: false,
    default_doc: None,
    doc: "Huge page size to ask for with `dram_use_hugepages`.",
    also_rejected: None,
};
/// `dram_numa_node` (also the store's `numa_node`).
pub const DRAM_NUMA_NODE: OptionSpec = OptionSpec {
    name: "dram_numa_node",
    scope: Scope::Embedded,
    kind: Kind::Int {
        min: 0,
        max: u32::MAX as u64,
        unit: Unit::Count,
    },
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("none"),
    doc: "Bind each worker's pool to this NUMA node (`mbind`, strict).",
    also_rejected: Some("The node does not exist (found when the pool is made)."),
};
/// `dram_prefault` (also the store's `prefault`).
pub const DRAM_PREFAULT: OptionSpec = OptionSpec {
    scope: Scope::Embedded,
    ..flag(
        "dram_prefault",
        true,
        "Populate every page of each worker's pool at start-up so copies never page-fault (see \
         the store table below); false: pages are populated by the first copy that touches them.",
    )
};
/// The eviction policies (`umbp_core::caching::EvictionPolicy`).
pub const EVICTION_POLICIES: &[&str] = &["s3fifo", "lru"];
/// The store admissions (`umbp_core::caching::StoreAdmission`).
pub const STORE_ADMISSIONS: &[&str] = &["all", "on_reuse"];

/// `eviction_policy` (also the store's and the server's).
pub const EVICTION_POLICY: OptionSpec = OptionSpec {
    name: "eviction_policy",
    scope: Scope::Embedded,
    kind: Kind::Choice(EVICTION_POLICIES),
    default: DefaultValue::Str("s3fifo"),
    nullable: false,
    default_doc: None,
    doc: "Which objects eviction takes first. `\"s3fifo\"`: a small probation queue, a main \
          queue of objects used again and a ghost set, so a burst of one-off prompts leaves \
          without flushing the shared prefixes, but a new block nobody reads while about a tenth \
          of the pool is written after it leaves first; `\"lru\"`: exact least recently used, \
          better where conversations come back after long gaps (see \
          [benchmarks.md](benchmarks.md#eviction-policy-and-store-admission-umbp-bench-cache) for \
          both workloads and why `s3fifo` is the default).",
    also_rejected: None,
};
/// `store_admission` (also the store's and the server's).
pub const STORE_ADMISSION: OptionSpec = OptionSpec {
    name: "store_admission",
    scope: Scope::Embedded,
    kind: Kind::Choice(STORE_ADMISSIONS),
    default: DefaultValue::Str("all"),
    nullable: false,
    default_doc: None,
    doc: "Which stored blocks the pool keeps. `\"all\"`: every one; `\"on_reuse\"`: a block \
          the second time its key is stored or looked up within the last 2^20 keys seen (the \
          first store is skipped: its blocks answer `\"skipped\"`, counted in \
          `admissions_skipped`; writes far fewer bytes for a few points of hit rate).",
    also_rejected: None,
};
/// The `integrity` settings (`umbp_core::integrity::Integrity`).
pub const INTEGRITIES: &[&str] = &["off", "sample", "all"];

/// `integrity` (also the store's and the server's).
pub const INTEGRITY: OptionSpec = OptionSpec {
    name: "integrity",
    scope: Scope::Embedded,
    kind: Kind::Choice(INTEGRITIES),
    default: DefaultValue::Str("off"),
    nullable: false,
    default_doc: None,
    doc: "End-to-end checksums of the pool's objects (XXH3-64, computed by the copy threads \
          while the bytes pass them, by the disk and remote tiers from the bytes they read). \
          `\"all\"`: every load verifies its object before copying it out; `\"sample\"`: one \
          load in `integrity_sample_every`; `\"off\"`: no checksums. A mismatch fails that \
          block's load (vLLM recomputes it), removes the object and counts in \
          `corrupt_detected` (`umbp_corrupt_detected_total`). Off by default: summing every \
          store cost 12-25 % of the host copy's store rate here (`\"sample\"` loads cost \
          nothing measurable, `\"all\"` loads 36-40 %; see \
          [benchmarks.md](benchmarks.md#integrity-checksums-umbp-bench-copy---verify)).",
    also_rejected: None,
};
/// `integrity_sample_every`.
pub const INTEGRITY_SAMPLE_EVERY: OptionSpec = OptionSpec {
    name: "integrity_sample_every",
    scope: Scope::Embedded,
    kind: Kind::Int {
        min: 1,
        max: 1 << 20,
        unit: Unit::Count,
    },
    default: DefaultValue::Int(16),
    nullable: false,
    default_doc: None,
    doc: "With `integrity: \"sample\"`, one load in this many verifies its object (1: every \
          load, as `\"all\"`).",
    also_rejected: None,
};
/// `endpoint`.
pub const ENDPOINT: OptionSpec = OptionSpec {
    name: "endpoint",
    scope: Scope::Standalone,
    kind: Kind::Text(TextRule::Endpoint),
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("— (required)"),
    doc: "The server's socket.",
    also_rejected: Some("Missing."),
};
/// `startup_timeout_ms`.
pub const STARTUP_TIMEOUT_MS: OptionSpec = OptionSpec {
    name: "startup_timeout_ms",
    scope: Scope::Standalone,
    kind: at_least(1, Unit::Millis),
    default: DefaultValue::Int(30_000),
    nullable: false,
    default_doc: None,
    doc: "How long start-up (each worker and the scheduler) waits for the server to answer; \
          then it fails, naming the endpoint.",
    also_rejected: None,
};

/// The `kv_cache_export` choices.
pub const KV_CACHE_EXPORTS: &[&str] = &["auto", "fd", "ipc"];

/// `kv_cache_export`.
pub const KV_CACHE_EXPORT: OptionSpec = OptionSpec {
    name: "kv_cache_export",
    scope: Scope::Standalone,
    kind: Kind::Choice(KV_CACHE_EXPORTS),
    default: DefaultValue::Str("auto"),
    nullable: false,
    default_doc: None,
    doc: "How the server reaches a CUDA KV cache, declared to vLLM 0.34 and later \
          (`kv_cache_access`; earlier versions ignore it): `\"fd\"` exportable memory the \
          server imports through file descriptors, which keeps vLLM's extensible KV cache (vLLM \
          then refuses `kv_cache_memory_bytes`, `num_gpu_blocks_override` and \
          `--no-enable-extensible-kv-cache`); `\"ipc\"` legacy CUDA IPC, for which vLLM \
          allocates the cache as 0.33 did (its extensible cache off); `\"auto\"` `fd` on CUDA, \
          `ipc` elsewhere.",
    also_rejected: None,
};

/// The `remote_write` policies.
pub const REMOTE_WRITES: &[&str] = &["eager", "on_reuse", "never"];

/// `remote_url`.
pub const REMOTE_URL: OptionSpec = OptionSpec {
    name: "remote_url",
    scope: Scope::Embedded,
    kind: Kind::Text(TextRule::RemoteUrl),
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("— (off)"),
    doc: "A shared remote tier behind each worker's pool, on an existing Redis or Valkey: \
          `redis://[user:password@]host:port[/db]` for one server, \
          `redis+cluster://[user:password@]host:port,host:port,...` for a cluster (seed nodes); \
          `rediss://` and `rediss+cluster://` for TLS. \
          Lookups fetch what the pool misses from it; stores are written to it behind the \
          engine (see [remote.md](remote.md)). In standalone mode the server takes it \
          (`--remote-url`, `UMBP_REMOTE_URL`).",
    also_rejected: Some("Another scheme, several hosts without `+cluster`, a cluster URL with a `/db` (found when the store starts)."),
};
/// `remote_ttl_s`.
pub const REMOTE_TTL_S: OptionSpec = OptionSpec {
    name: "remote_ttl_s",
    scope: Scope::Embedded,
    kind: Kind::Int {
        min: 0,
        max: 315_360_000,
        unit: Unit::Seconds,
    },
    default: DefaultValue::Int(0),
    nullable: false,
    default_doc: Some("0 (no expiry)"),
    doc: "Expiry of objects written to the remote tier, in seconds; 0 leaves eviction to the \
          remote's own `maxmemory-policy` (`allkeys-lru` recommended).",
    also_rejected: None,
};
/// `remote_write`.
pub const REMOTE_WRITE: OptionSpec = OptionSpec {
    name: "remote_write",
    scope: Scope::Embedded,
    kind: Kind::Choice(REMOTE_WRITES),
    default: DefaultValue::Str("eager"),
    nullable: false,
    default_doc: None,
    doc: "When objects go to the remote tier: `\"eager\"` every stored object; `\"on_reuse\"` \
          an object the second time a lookup hits it in the pool (spares the network for \
          one-off prefixes); `\"never\"` only reads what other nodes wrote. With MLA at \
          tensor parallelism the ranks share one object per block, written by the first rank \
          of each replica group only (the others read it).",
    also_rejected: None,
};
/// `remote_timeout_ms`.
pub const REMOTE_TIMEOUT_MS: OptionSpec = OptionSpec {
    name: "remote_timeout_ms",
    scope: Scope::Embedded,
    kind: Kind::Int {
        min: 1,
        max: 60_000,
        unit: Unit::Millis,
    },
    default: DefaultValue::Int(200),
    nullable: false,
    default_doc: None,
    doc: "How long a lookup waits for the remote tier (what has not arrived by then is a \
          miss), and the bound of each connect and answer. Keep it below `lookup_timeout_ms`.",
    also_rejected: None,
};
/// `remote_write_backlog`.
pub const REMOTE_WRITE_BACKLOG: OptionSpec = OptionSpec {
    name: "remote_write_backlog",
    scope: Scope::Embedded,
    kind: at_least(MIB, Unit::Bytes),
    default: DefaultValue::Int(256 * MIB),
    nullable: false,
    default_doc: None,
    doc: "Bytes of objects waiting to be written to the remote tier; past it, new objects are \
          not written (counted as `writes_dropped`).",
    also_rejected: None,
};
/// `remote_write_mb_per_s`.
pub const REMOTE_WRITE_MB_PER_S: OptionSpec = OptionSpec {
    name: "remote_write_mb_per_s",
    scope: Scope::Embedded,
    kind: at_least(0, Unit::Count),
    default: DefaultValue::Int(0),
    nullable: false,
    default_doc: Some("0 (no limit)"),
    doc: "Upper bound of the remote tier's write rate, in MB/s (10^6 bytes), per worker.",
    also_rejected: None,
};

/// `disk_dir`.
pub const DISK_DIR: OptionSpec = OptionSpec {
    name: "disk_dir",
    scope: Scope::Embedded,
    kind: Kind::Text(TextRule::Directory),
    default: DefaultValue::Unset,
    nullable: true,
    default_doc: Some("— (off)"),
    doc: "A local disk tier under each worker's pool (see [disk.md](disk.md)): objects the \
          pool evicts are written behind to this directory, and lookups read what the pool \
          misses back from it (before the remote tier). Each worker uses its own subdirectory \
          `umbp-<tag>-dp<DP rank>-w<worker>` (the tag as in the lookup sockets' names), made \
          when missing, and finds what an earlier run of the same engine left there (a worker \
          that closes cleanly writes its pool there too). In standalone mode the server takes it (`--disk-dir`, `UMBP_DISK_DIR`).",
    also_rejected: Some(
        "Not writable, or its file system has less room than `disk_capacity_bytes` (found when \
         the store starts).",
    ),
};
/// `disk_capacity_bytes`.
pub const DISK_CAPACITY_BYTES: OptionSpec = OptionSpec {
    name: "disk_capacity_bytes",
    scope: Scope::Embedded,
    kind: at_least(32 * MIB, Unit::Bytes),
    default: DefaultValue::Int(64 * GIB),
    nullable: false,
    default_doc: None,
    doc: "Bytes of `disk_dir` each worker's disk tier may fill: segment files of capacity / 16 \
          (16 to 256 MiB), preallocated, so start-up fails when the file system has less room; \
          past it the oldest segment is dropped. With `disk_dir` only.",
    also_rejected: None,
};
/// `disk_write_mb_per_s`.
pub const DISK_WRITE_MB_PER_S: OptionSpec = OptionSpec {
    name: "disk_write_mb_per_s",
    scope: Scope::Embedded,
    kind: at_least(0, Unit::Count),
    default: DefaultValue::Int(0),
    nullable: false,
    default_doc: Some("0 (no limit)"),
    doc: "Upper bound of the disk tier's write rate, in MB/s (10^6 bytes), per worker; \
          what the backlog cannot hold is not written (counted as `writes_dropped`).",
    also_rejected: None,
};
/// `disk_write`'s values.
pub const DISK_WRITES: &[&str] = &["on_evict", "eager"];
/// `disk_write`.
pub const DISK_WRITE: OptionSpec = OptionSpec {
    name: "disk_write",
    scope: Scope::Embedded,
    kind: Kind::Choice(DISK_WRITES),
    default: DefaultValue::Str("on_evict"),
    nullable: false,
    default_doc: None,
    doc: "When objects go to the disk tier: `\"on_evict\"` when the pool evicts them; \
          `\"eager\"` also as soon as they are stored (still written behind within the backlog \
          and `disk_write_mb_per_s`, never waited for; the evictor then frees objects on disk at \
          once), so a crash or power loss loses only the last moments' objects, at the price \
          of writing every stored object once. See [disk.md](disk.md#eager-or-on-eviction).",
    also_rejected: None,
};
/// `disk_close_write_s`.
pub const DISK_CLOSE_WRITE_S: OptionSpec = OptionSpec {
    name: "disk_close_write_s",
    scope: Scope::Embedded,
    kind: Kind::Int {
        min: 0,
        max: 3600,
        unit: Unit::Seconds,
    },
    default: DefaultValue::Int(30),
    nullable: false,
    default_doc: None,
    doc: "How long closing a store (a clean engine or server stop) may spend writing the pool's \
          objects the disk tier lacks, so a restart finds them; past it the rest are not \
          written (logged with the count). 0: nothing is written on close (objects still \
          queued are dropped).",
    also_rejected: None,
};

/// `cuda_staging_bytes`.
pub const CUDA_STAGING_BYTES: OptionSpec = OptionSpec {
    name: "cuda_staging_bytes",
    scope: Scope::Embedded,
    kind: at_least(0, Unit::Bytes),
    default: DefaultValue::Int(256 * MIB),
    nullable: false,
    default_doc: None,
    doc: "GPU memory per direction for the CUDA copy path's staging slots (two slots; 2 × this \
          per GPU in all), allocated when a worker registers a CUDA KV cache, after vLLM has \
          sized its own memory: leave this much free (lower `gpu_memory_utilization`) or lower \
          it. Smaller slots copy as fast while the GPU is idle but slower while it computes \
          (128 MiB slots moved 46-53 GB/s beside a full-GPU matmul, 16 MiB slots 12-34; see \
          docs/benchmarks.md). 0: the copy engines only (no staging kernels). Where the GPU is \
          out of memory, smaller slots are used, with a warning.",
    also_rejected: Some("Between 0 and 1 MiB."),
};

/// Every option, in the order of the docs' tables.
pub const SCHEMA: &[OptionSpec] = &[
    MODE,
    LOAD_ASYNC,
    LOOKUP_ASYNC,
    LOOKUP_WORKERS,
    KV_EVENT_MAX_OBJECTS,
    SELF_DESCRIBING_KV_EVENTS,
    ENABLE_LOOKUP,
    SAVE_DECODE_CACHE,
    STORE_PRIORITY_SKIP_ABOVE,
    STORE_PRIORITY_ADMIT_AT_MOST,
    LAZY_OFFLOAD,
    LAZY_OFFLOAD_MAX_BLOCKS,
    ENABLE_PARTIAL_HASH_HITS,
    NUM_WORKERS,
    TIMEOUT_MS,
    LOOKUP_TIMEOUT_MS,
    KEY_NAMESPACE,
    CAPACITY_BYTES,
    TOTAL_CAPACITY_BYTES,
    LOOKUP_INSTANCE,
    LOOKUP_DIR,
    DRAM_HIGH_WATERMARK,
    DRAM_LOW_WATERMARK,
    DRAM_USE_HUGEPAGES,
    DRAM_HUGEPAGE_SIZE,
    DRAM_NUMA_NODE,
    DRAM_PREFAULT,
    EVICTION_POLICY,
    STORE_ADMISSION,
    INTEGRITY,
    INTEGRITY_SAMPLE_EVERY,
    REMOTE_URL,
    REMOTE_TTL_S,
    REMOTE_WRITE,
    REMOTE_TIMEOUT_MS,
    REMOTE_WRITE_BACKLOG,
    REMOTE_WRITE_MB_PER_S,
    DISK_DIR,
    DISK_CAPACITY_BYTES,
    DISK_WRITE_MB_PER_S,
    DISK_WRITE,
    DISK_CLOSE_WRITE_S,
    CUDA_STAGING_BYTES,
    ENDPOINT,
    STARTUP_TIMEOUT_MS,
    KV_CACHE_EXPORT,
];

/// The spec of option `name`.
pub fn spec(name: &str) -> Option<&'static OptionSpec> {
    SCHEMA.iter().find(|s| s.name == name)
}
