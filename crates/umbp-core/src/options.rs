//! The vLLM connector's options (`kv_connector_extra_config`): one schema that owns every
//! option's default, range, documentation and error messages.
//!
//! The connector hands the user's options over as JSON; [`ConnectorOptions::from_json`] checks
//! them against [`SCHEMA`] and returns the typed, defaulted [`ConnectorOptions`]. Every error
//! is a [`CoreError::InvalidOption`] (or [`CoreError::UnknownOption`]) naming the option and
//! saying what to change. The store's own arguments ([`crate::PoolConfig`] and the store's
//! configuration) take their defaults and ranges from the same [`OptionSpec`]s, and
//! `docs/configuration.md`'s option tables are generated from [`SCHEMA`].

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};

use crate::address;
use crate::sizes::{HugepageSize, GIB, MIB};
use crate::CoreError;

/// Which mode an option belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Accepted in every mode.
    Shared,
    /// Embedded mode only (rejected in standalone mode: the server owns the pool).
    Embedded,
    /// Standalone mode only.
    Standalone,
}

impl Scope {
    /// The scope's name as the docs and the schema binding spell it.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Shared => "shared",
            Scope::Embedded => "embedded",
            Scope::Standalone => "standalone",
        }
    }
}

/// What an integer counts, for messages and documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// A plain count (threads, objects, blocks, a node number).
    Count,
    /// Bytes (shown as MiB / GiB where exact).
    Bytes,
    /// Milliseconds.
    Millis,
    /// Seconds.
    Seconds,
}

/// String options with a rule of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextRule {
    /// A key namespace: non-empty, no `:` or whitespace; `"auto"` means derived (unset).
    Namespace,
    /// A lookup instance: no `/` or whitespace (it becomes part of socket names).
    Instance,
    /// An existing directory.
    Directory,
    /// A Unix socket: an absolute path or a `unix://` address (resolved to the path).
    Endpoint,
    /// A Redis / Valkey URL (`redis://`, `redis+cluster://`; checked fully when the store
    /// starts).
    RemoteUrl,
}

/// The type and range of an option's value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Kind {
    /// `true` or `false`.
    Bool,
    /// An integer in `min..=max` (`max` is `u64::MAX` for no upper bound).
    Int {
        /// Smallest value accepted.
        min: u64,
        /// Largest value accepted.
        max: u64,
        /// What it counts.
        unit: Unit,
    },
    /// A fraction of the pool's capacity, in (0, 1].
    Fraction,
    /// One of a few strings.
    Choice(&'static [&'static str]),
    /// A string with a rule.
    Text(TextRule),
    /// A huge page size (see [`HugepageSize`]'s spellings), resolved to `"2MiB"` or `"1GiB"`.
    HugepageSize,
}

/// An option's default value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DefaultValue {
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(u64),
    /// A number.
    Float(f64),
    /// A string.
    Str(&'static str),
    /// No value: derived at run time, optional or required (see `default_doc`).
    Unset,
}

/// One option of the connector: everything about it lives here.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionSpec {
    /// The option's name in `kv_connector_extra_config`.
    pub name: &'static str,
    /// The modes that accept it.
    pub scope: Scope,
    /// Its type and range.
    pub kind: Kind,
    /// Its default.
    pub default: DefaultValue,
    /// Whether `null` is accepted (meaning: unset, i.e. the default).
    pub nullable: bool,
    /// How the docs show the default when the value alone does not say it.
    pub default_doc: Option<&'static str>,
    /// What it does (Markdown, the docs table's "Meaning" column).
    pub doc: &'static str,
    /// Rejections beyond the type and range (Markdown, appended to the "Rejected when" column).
    pub also_rejected: Option<&'static str>,
}

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
pub const REMOTE_WRITES: &[&str] = &["eager", "on_reuse"];

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
          one-off prefixes).",
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
    REMOTE_URL,
    REMOTE_TTL_S,
    REMOTE_WRITE,
    REMOTE_TIMEOUT_MS,
    REMOTE_WRITE_BACKLOG,
    REMOTE_WRITE_MB_PER_S,
    CUDA_STAGING_BYTES,
    ENDPOINT,
    STARTUP_TIMEOUT_MS,
    KV_CACHE_EXPORT,
];

/// The spec of option `name`.
pub fn spec(name: &str) -> Option<&'static OptionSpec> {
    SCHEMA.iter().find(|s| s.name == name)
}

/// A size in bytes as the docs write it: `64 GiB`, `1 MiB`, else the number.
pub fn bytes_text(n: u64) -> String {
    if n >= GIB && n.is_multiple_of(GIB) {
        format!("{} GiB", n / GIB)
    } else if n >= MIB && n.is_multiple_of(MIB) {
        format!("{} MiB", n / MIB)
    } else {
        n.to_string()
    }
}

/// Why a value was refused (becomes the message of a [`CoreError::InvalidOption`]).
type Refusal = String;

impl OptionSpec {
    /// The default as a JSON value (`null` when unset).
    pub fn default_json(&self) -> Value {
        match self.default {
            DefaultValue::Bool(b) => Value::Bool(b),
            DefaultValue::Int(n) => Value::from(n),
            DefaultValue::Float(f) => Number::from_f64(f).map_or(Value::Null, Value::Number),
            DefaultValue::Str(s) => Value::from(s),
            DefaultValue::Unset => Value::Null,
        }
    }

    /// The default of a boolean option.
    ///
    /// # Panics
    /// If the option is not a boolean (a bug the schema's tests catch).
    pub fn default_bool(&self) -> bool {
        match self.default {
            DefaultValue::Bool(b) => b,
            _ => panic!("option `{}` has no boolean default", self.name),
        }
    }

    /// The default of an integer option.
    ///
    /// # Panics
    /// If the option has no integer default.
    pub fn default_u64(&self) -> u64 {
        match self.default {
            DefaultValue::Int(n) => n,
            _ => panic!("option `{}` has no integer default", self.name),
        }
    }

    /// The default of a fraction.
    ///
    /// # Panics
    /// If the option has no numeric default.
    pub fn default_f64(&self) -> f64 {
        match self.default {
            DefaultValue::Float(f) => f,
            _ => panic!("option `{}` has no numeric default", self.name),
        }
    }

    /// The default of a string option.
    ///
    /// # Panics
    /// If the option has no string default.
    pub fn default_str(&self) -> &'static str {
        match self.default {
            DefaultValue::Str(s) => s,
            _ => panic!("option `{}` has no string default", self.name),
        }
    }

    /// The default as the docs show it (Markdown).
    pub fn default_text(&self) -> String {
        if let Some(d) = self.default_doc {
            return d.to_owned();
        }
        match (self.default, self.kind) {
            (
                DefaultValue::Int(n),
                Kind::Int {
                    unit: Unit::Bytes, ..
                },
            ) => bytes_text(n),
            (DefaultValue::Int(n), _) => n.to_string(),
            (DefaultValue::Bool(b), _) => b.to_string(),
            (DefaultValue::Float(f), _) => f.to_string(),
            (DefaultValue::Str(s), _) => format!("`\"{s}\"`"),
            (DefaultValue::Unset, _) => "—".to_owned(),
        }
    }

    /// The type and range in words (the start of every refusal of a value of the wrong type or
    /// out of range), e.g. `an integer in 1..=256`.
    pub fn expected(&self) -> String {
        match self.kind {
            Kind::Bool => "true or false".to_owned(),
            Kind::Int { min, max, unit } => {
                let fmt = |n: u64| match unit {
                    Unit::Bytes if n >= MIB => format!("{n} ({})", bytes_text(n)),
                    _ => n.to_string(),
                };
                if max == u64::MAX {
                    format!("an integer >= {}", fmt(min))
                } else {
                    format!("an integer in {}..={}", fmt(min), fmt(max))
                }
            }
            Kind::Fraction => "a number in (0, 1] (a fraction of capacity, such as 0.9)".to_owned(),
            Kind::Choice(c) => {
                let quoted: Vec<String> = c.iter().map(|s| format!("{s:?}")).collect();
                format!("one of {}", quoted.join(", "))
            }
            Kind::Text(TextRule::Namespace) => {
                "a non-empty string without ':' or whitespace".to_owned()
            }
            Kind::Text(TextRule::Instance) => "a string without '/' or whitespace".to_owned(),
            Kind::Text(TextRule::Directory) => "the path of an existing directory".to_owned(),
            Kind::Text(TextRule::Endpoint) => {
                "an absolute socket path or unix:///absolute/path".to_owned()
            }
            Kind::Text(TextRule::RemoteUrl) => {
                "a redis://, redis+cluster://, rediss:// or rediss+cluster:// URL".to_owned()
            }
            Kind::HugepageSize => "\"2MiB\" or \"1GiB\"".to_owned(),
        }
    }

    /// The docs' "Rejected when" text (Markdown).
    pub fn rejected_text(&self) -> String {
        let base = match self.kind {
            Kind::Bool => "Not a boolean.".to_owned(),
            Kind::Int { min, max, unit } => {
                let fmt = |n: u64| match unit {
                    Unit::Bytes => bytes_text(n),
                    _ => n.to_string(),
                };
                // A node number's u32 bound is no range a user picks: not shown.
                if max == u64::MAX || max == u64::from(u32::MAX) {
                    format!("Not an integer ≥ {}.", fmt(min))
                } else {
                    format!("Not an integer in {}–{}.", fmt(min), fmt(max))
                }
            }
            Kind::Fraction => "Outside (0, 1].".to_owned(),
            Kind::Choice(_) => "Any other value.".to_owned(),
            Kind::Text(TextRule::Namespace) => {
                "Not a string, empty, or contains `:` or whitespace.".to_owned()
            }
            Kind::Text(TextRule::Instance) => {
                "Not a string, or contains `/` or whitespace.".to_owned()
            }
            Kind::Text(TextRule::Directory) => "Not an existing directory.".to_owned(),
            Kind::Text(TextRule::Endpoint) => {
                "A TCP address, a relative path, a directory, a path longer than 103 bytes, or \
                 not a string."
                    .to_owned()
            }
            Kind::Text(TextRule::RemoteUrl) => {
                "Not a `redis://`, `redis+cluster://`, `rediss://` or `rediss+cluster://` URL."
                    .to_owned()
            }
            Kind::HugepageSize => {
                "Not `\"2MiB\"` or `\"1GiB\"` (also accepted: `2M`, `1G`, `2097152`, ...)."
                    .to_owned()
            }
        };
        match self.also_rejected {
            Some(more) => format!("{base} {more}"),
            None => base,
        }
    }

    /// The error for `value`: names the option, says what it must be and what it got.
    fn refuse(&self, why: Refusal) -> CoreError {
        CoreError::option(self.name, why)
    }

    fn must_be(&self, value: &Value) -> CoreError {
        self.refuse(format!("must be {}, got {value}", self.expected()))
    }

    /// Checks one integer against the option's range (the store's arguments use this too).
    pub fn check_u64(&self, n: u64) -> Result<u64, CoreError> {
        match self.kind {
            Kind::Int { min, max, .. } if n < min || n > max => Err(self.must_be(&Value::from(n))),
            _ => Ok(n),
        }
    }

    /// Checks one fraction (the store's watermarks use this too).
    pub fn check_f64(&self, f: f64) -> Result<f64, CoreError> {
        if f > 0.0 && f <= 1.0 {
            Ok(f)
        } else {
            Err(self.refuse(format!("must be {}, got {f}", self.expected())))
        }
    }

    /// The value of this option from the user's `value` (None: not given), defaulted and
    /// resolved (`null` for an unset optional value).
    pub fn resolve(&self, value: Option<&Value>) -> Result<Value, CoreError> {
        let v = match value {
            None => return Ok(self.default_json()),
            Some(Value::Null) if self.nullable => return Ok(self.default_json()),
            Some(v) => v,
        };
        match self.kind {
            Kind::Bool => v.as_bool().map(Value::Bool).ok_or_else(|| self.must_be(v)),
            Kind::Int { .. } => match v.as_u64() {
                Some(n) => self.check_u64(n).map(Value::from),
                None => Err(self.must_be(v)),
            },
            Kind::Fraction => match v.as_f64() {
                Some(f) => self.check_f64(f).map(|_| v.clone()),
                None => Err(self.must_be(v)),
            },
            Kind::Choice(choices) => match v.as_str() {
                Some(s) if choices.contains(&s) => Ok(v.clone()),
                _ => Err(self.must_be(v)),
            },
            Kind::HugepageSize => {
                let text = match v {
                    Value::String(s) => s.clone(),
                    Value::Number(n) if n.is_u64() => n.to_string(),
                    _ => return Err(self.must_be(v)),
                };
                let size: HugepageSize = text.parse()?;
                Ok(Value::from(size.to_string()))
            }
            Kind::Text(rule) => {
                let Some(s) = v.as_str() else {
                    return Err(self.refuse(format!("must be a string, got {v}")));
                };
                check_text(rule, s).map_err(|why| self.refuse(why))
            }
        }
    }
}

fn check_text(rule: TextRule, s: &str) -> Result<Value, Refusal> {
    let has_space = s.chars().any(char::is_whitespace);
    match rule {
        TextRule::Namespace if s == "auto" => Ok(Value::Null),
        TextRule::Namespace if s.is_empty() || s.contains(':') || has_space => Err(format!(
            "must be non-empty, without ':' or whitespace, got {s:?}; pick another namespace \
             or leave it unset to derive it"
        )),
        TextRule::Instance if s.contains('/') || has_space => {
            Err(format!("must not contain '/' or whitespace, got {s:?}"))
        }
        TextRule::Directory if !std::path::Path::new(s).is_dir() => Err(format!(
            "{s:?} is not an existing directory; create it or pick another"
        )),
        TextRule::Endpoint => address::socket_path(s)
            .map(Value::from)
            .map_err(|e| e.to_string()),
        TextRule::RemoteUrl => {
            let scheme = s.split_once("://").map(|(a, _)| a.to_ascii_lowercase());
            match scheme.as_deref() {
                Some(
                    "redis" | "redis+cluster" | "valkey" | "valkey+cluster" | "rediss"
                    | "rediss+cluster" | "valkeys" | "valkeys+cluster",
                ) if !has_space => Ok(Value::from(s)),
                _ => Err(format!(
                    "must be redis://host:port (one server) or \
                     redis+cluster://host:port,host:port (a cluster), rediss:// for TLS, got {:?}",
                    address::redact_url(s)
                )),
            }
        }
        _ => Ok(Value::from(s)),
    }
}

/// Checks that the low watermark is below the high one (the store checks its own with this).
pub fn check_watermarks(high: f64, low: f64) -> Result<(), CoreError> {
    if low >= high {
        return Err(DRAM_LOW_WATERMARK.refuse(format!(
            "{low} must be below `dram_high_watermark` ({high}); lower it or raise the high \
             watermark"
        )));
    }
    Ok(())
}

/// The connector's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A private pool per worker.
    Embedded,
    /// One node-wide server.
    Standalone,
}

impl Mode {
    /// Whether options of `scope` are accepted in this mode.
    pub fn accepts(self, scope: Scope) -> bool {
        matches!(
            (self, scope),
            (_, Scope::Shared)
                | (Mode::Embedded, Scope::Embedded)
                | (Mode::Standalone, Scope::Standalone)
        )
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Mode::Embedded => "embedded",
            Mode::Standalone => "standalone",
        })
    }
}

/// vLLM's `kv_role` as the connector takes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvRole {
    /// Store and restore.
    KvBoth,
    /// Store only.
    KvProducer,
    /// Restore only.
    KvConsumer,
}

/// The connector's validated options, every one set (the other mode's to their defaults).
///
/// Built only by [`ConnectorOptions::from_json`] / [`ConnectorOptions::from_map`], from
/// [`SCHEMA`]; the field names are the option names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorOptions {
    pub mode: Mode,
    pub kv_role: KvRole,
    pub load_async: bool,
    pub lookup_async: bool,
    pub lookup_workers: u32,
    pub kv_event_max_objects: u64,
    pub self_describing_kv_events: bool,
    pub enable_lookup: bool,
    pub save_decode_cache: bool,
    pub lazy_offload: bool,
    pub lazy_offload_max_blocks: Option<u64>,
    pub enable_partial_hash_hits: bool,
    pub num_workers: u32,
    pub timeout_ms: u64,
    pub lookup_timeout_ms: u64,
    pub key_namespace: Option<String>,
    /// None when `total_capacity_bytes` is set.
    pub capacity_bytes: Option<u64>,
    pub total_capacity_bytes: Option<u64>,
    pub lookup_instance: String,
    pub lookup_dir: String,
    pub dram_high_watermark: f64,
    pub dram_low_watermark: f64,
    pub dram_use_hugepages: bool,
    /// `"2MiB"` or `"1GiB"`.
    pub dram_hugepage_size: String,
    pub dram_numa_node: Option<u32>,
    pub dram_prefault: bool,
    /// The socket path (a `unix://` address is resolved to its path).
    pub endpoint: Option<String>,
    pub startup_timeout_ms: u64,
    pub kv_cache_export: String,
    pub remote_url: Option<String>,
    pub remote_ttl_s: u64,
    pub remote_write: String,
    pub remote_timeout_ms: u64,
    pub remote_write_backlog: u64,
    pub remote_write_mb_per_s: u64,
    pub cuda_staging_bytes: u64,
}

impl ConnectorOptions {
    /// Validates `kv_connector_extra_config` given as JSON, and `kv_role` (None: `kv_both`).
    pub fn from_json(extra: &str, kv_role: Option<&str>) -> Result<Self, CoreError> {
        let value: Value = serde_json::from_str(extra).map_err(|e| {
            CoreError::option(
                "kv_connector_extra_config",
                format!("is not valid JSON ({e}); give a JSON object of options"),
            )
        })?;
        let Value::Object(map) = value else {
            return Err(CoreError::option(
                "kv_connector_extra_config",
                format!("must be a JSON object of options, got {value}"),
            ));
        };
        Self::from_map(&map, kv_role)
    }

    /// Validates the options of `map` and `kv_role` (None: `kv_both`).
    pub fn from_map(map: &Map<String, Value>, kv_role: Option<&str>) -> Result<Self, CoreError> {
        let role = kv_role.unwrap_or("kv_both");
        if !KV_ROLES.contains(&role) {
            return Err(CoreError::option(
                "kv_role",
                format!("must be one of {}, got {role:?}", KV_ROLES.join(", ")),
            ));
        }
        let mode = match MODE.resolve(map.get(MODE.name))?.as_str() {
            Some("standalone") => Mode::Standalone,
            _ => Mode::Embedded,
        };
        for name in map.keys() {
            let Some(s) = spec(name) else {
                let mut known: Vec<&str> = SCHEMA
                    .iter()
                    .filter(|s| mode.accepts(s.scope))
                    .map(|s| s.name)
                    .collect();
                known.sort_unstable();
                return Err(CoreError::UnknownOption {
                    option: name.clone(),
                    known: known.join(", "),
                });
            };
            if !mode.accepts(s.scope) {
                return Err(CoreError::option(
                    name.as_str(),
                    match mode {
                        Mode::Standalone if name.starts_with("cuda_") => {
                            "is not accepted in standalone mode: the server does the copies; \
                             start it with --cuda-staging-bytes (UMBP_CUDA_STAGING_BYTES)"
                        }
                        Mode::Standalone if name.starts_with("remote_") => {
                            "is not accepted in standalone mode: the server owns the pool and \
                             its remote tier; start the server with --remote-url \
                             (UMBP_REMOTE_URL) and the other --remote-* flags"
                        }
                        Mode::Standalone => {
                            "is not accepted in standalone mode: the server owns \
                                             the pool; set its size and placement with UMBP_DRAM_* \
                                             on the server"
                        }
                        Mode::Embedded => {
                            "belongs to standalone mode; set \"mode\": \
                                           \"standalone\" or remove it"
                        }
                    },
                ));
            }
        }
        let given = |s: &OptionSpec| map.get(s.name).is_some_and(|v| !v.is_null());
        if mode == Mode::Embedded && given(&CAPACITY_BYTES) && given(&TOTAL_CAPACITY_BYTES) {
            return Err(TOTAL_CAPACITY_BYTES.refuse(
                "options `capacity_bytes` and `total_capacity_bytes` are exclusive; set only one"
                    .to_owned(),
            ));
        }
        let mut out = Map::new();
        out.insert("kv_role".to_owned(), Value::from(role));
        for s in SCHEMA {
            let v = if mode.accepts(s.scope) {
                s.resolve(map.get(s.name))?
            } else {
                s.default_json()
            };
            out.insert(s.name.to_owned(), v);
        }
        let mut opts: ConnectorOptions = serde_json::from_value(Value::Object(out))
            .map_err(|e| CoreError::option("kv_connector_extra_config", e.to_string()))?;
        match mode {
            Mode::Embedded => {
                if opts.total_capacity_bytes.is_some() {
                    opts.capacity_bytes = None;
                }
                check_watermarks(opts.dram_high_watermark, opts.dram_low_watermark)?;
                if (1..MIB).contains(&opts.cuda_staging_bytes) {
                    return Err(CUDA_STAGING_BYTES.refuse(format!(
                        "{} is below 1 MiB; give at least 1 MiB, or 0 for no staging",
                        opts.cuda_staging_bytes
                    )));
                }
            }
            Mode::Standalone => {
                if opts.endpoint.is_none() {
                    return Err(ENDPOINT.refuse(
                        "is required in standalone mode: the server's socket path or unix:// \
                         address"
                            .to_owned(),
                    ));
                }
            }
        }
        Ok(opts)
    }

    /// The options as a JSON object (option name to value).
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("options serialize")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ConnectorOptions, CoreError> {
        ConnectorOptions::from_map(v.as_object().unwrap(), Some("kv_both"))
    }

    fn refusal(v: Value) -> String {
        parse(v).unwrap_err().to_string()
    }

    #[test]
    fn every_field_is_in_the_schema_and_every_default_is_valid() {
        let opts = parse(json!({})).unwrap();
        let Value::Object(fields) = opts.to_json() else {
            unreachable!()
        };
        let mut names: Vec<&str> = fields.keys().map(String::as_str).collect();
        names.retain(|n| *n != "kv_role");
        let mut schema: Vec<&str> = SCHEMA.iter().map(|s| s.name).collect();
        names.sort_unstable();
        schema.sort_unstable();
        assert_eq!(names, schema);
        for s in SCHEMA {
            // A default must pass its own checks (or be an accepted "unset").
            let d = s.default_json();
            assert!(!d.is_null() || s.nullable, "{}", s.name);
            if !d.is_null() && s.kind != Kind::Text(TextRule::Directory) {
                assert_eq!(s.resolve(Some(&d)).unwrap(), d, "{}", s.name);
            }
            assert!(
                !s.doc.is_empty() && s.rejected_text().ends_with('.'),
                "{}",
                s.name
            );
        }
    }

    #[test]
    fn remote_options() {
        let o = parse(json!({})).unwrap();
        assert_eq!(o.remote_url, None);
        assert_eq!(
            (o.remote_write.as_str(), o.remote_timeout_ms),
            ("eager", 200)
        );
        let o = parse(
            json!({"remote_url": "redis+cluster://a:1,b:2", "remote_write": "on_reuse",
                             "remote_ttl_s": 3600}),
        )
        .unwrap();
        assert_eq!(o.remote_url.as_deref(), Some("redis+cluster://a:1,b:2"));
        assert_eq!(
            (o.remote_write.as_str(), o.remote_ttl_s),
            ("on_reuse", 3600)
        );
        let e = refusal(json!({"remote_url": "http://u:secret@h:1"}));
        assert!(
            e.contains("remote_url") && e.contains("redis+cluster://") && !e.contains("secret"),
            "{e}"
        );
        assert!(parse(json!({"remote_url": "rediss://h:1"})).is_ok());
        assert!(refusal(json!({"remote_write": "lazy"})).contains("on_reuse"));
        assert!(refusal(json!({"remote_timeout_ms": 0})).contains("remote_timeout_ms"));
        let e = refusal(
            json!({"mode": "standalone", "endpoint": "/tmp/s", "remote_url": "redis://h:1"}),
        );
        assert!(e.contains("--remote-url"), "{e}");
    }

    #[test]
    fn cuda_staging_bytes() {
        assert_eq!(parse(json!({})).unwrap().cuda_staging_bytes, 256 << 20);
        assert_eq!(
            parse(json!({"cuda_staging_bytes": 0}))
                .unwrap()
                .cuda_staging_bytes,
            0
        );
        let e = refusal(json!({"cuda_staging_bytes": 4096}));
        assert!(
            e.contains("cuda_staging_bytes") && e.contains("1 MiB"),
            "{e}"
        );
        let e = refusal(
            json!({"mode": "standalone", "endpoint": "/tmp/s", "cuda_staging_bytes": 1 << 20}),
        );
        assert!(e.contains("--cuda-staging-bytes"), "{e}");
    }

    #[test]
    fn defaults() {
        let o = parse(json!({})).unwrap();
        assert_eq!(o.mode, Mode::Embedded);
        assert_eq!(o.kv_role, KvRole::KvBoth);
        assert_eq!(
            (o.num_workers, o.timeout_ms, o.lookup_workers),
            (4, 30_000, 2)
        );
        assert_eq!(o.capacity_bytes, Some(64 * GIB));
        assert_eq!((o.dram_high_watermark, o.dram_low_watermark), (0.9, 0.7));
        assert_eq!(o.dram_hugepage_size, "2MiB");
        assert_eq!(
            (o.key_namespace, o.endpoint, o.dram_numa_node),
            (None, None, None)
        );
    }

    #[test]
    fn values_are_resolved() {
        let o = parse(
            json!({"total_capacity_bytes": 8 * GIB, "key_namespace": "auto",
            "dram_hugepage_size": 1_073_741_824u64, "capacity_bytes": null,
            "dram_high_watermark": 1}),
        )
        .unwrap();
        assert_eq!(
            (o.capacity_bytes, o.total_capacity_bytes),
            (None, Some(8 * GIB))
        );
        assert_eq!(o.key_namespace, None);
        assert_eq!(o.dram_hugepage_size, "1GiB");
        assert_eq!(o.dram_high_watermark, 1.0);
        let o = parse(json!({"mode": "standalone", "endpoint": "unix:///r/s.sock"})).unwrap();
        assert_eq!(o.endpoint.as_deref(), Some("/r/s.sock"));
        assert_eq!(o.startup_timeout_ms, 30_000);
    }

    #[test]
    fn refusals_name_the_option_and_what_it_must_be() {
        let e = refusal(json!({"num_workers": 0}));
        assert!(
            e.contains("`num_workers`") && e.contains("1..=256") && e.contains("got 0"),
            "{e}"
        );
        let e = refusal(json!({"num_workers": 2.5}));
        assert!(e.contains("`num_workers`") && e.contains("integer"), "{e}");
        let e = refusal(json!({"load_async": "yes"}));
        assert!(
            e.contains("`load_async`") && e.contains("true or false"),
            "{e}"
        );
        let e = refusal(json!({"kv_event_max_objects": true}));
        assert!(e.contains("`kv_event_max_objects`"), "{e}");
        let e = refusal(json!({"capacity_bytes": 10}));
        assert!(e.contains("`capacity_bytes`") && e.contains("1 MiB"), "{e}");
        let e = refusal(json!({"dram_numa_node": -1}));
        assert!(e.contains("`dram_numa_node`"), "{e}");
        let e = refusal(json!({"dram_low_watermark": 0.95}));
        assert!(
            e.contains("`dram_low_watermark`") && e.contains("below"),
            "{e}"
        );
        let e = refusal(json!({"dram_hugepage_size": "4MiB"}));
        assert!(
            e.contains("dram_hugepage_size") && e.contains("2MiB"),
            "{e}"
        );
        let e = refusal(json!({"lookup_instance": null}));
        assert!(
            e.contains("`lookup_instance`") && e.contains("string"),
            "{e}"
        );
        let e = refusal(json!({"capacity_bytes": GIB, "total_capacity_bytes": 2 * GIB}));
        assert!(
            e.contains("`capacity_bytes` and `total_capacity_bytes` are exclusive"),
            "{e}"
        );
        let e = refusal(json!({"capcity_bytes": 1}));
        assert!(
            e.contains("unknown option `capcity_bytes`") && e.contains("capacity_bytes,"),
            "{e}"
        );
        let e = refusal(json!({"endpoint": "/s.sock"}));
        assert!(e.contains("`endpoint`") && e.contains("standalone"), "{e}");
        let e = refusal(json!({"mode": "standalone", "endpoint": "/s", "dram_prefault": false}));
        assert!(
            e.contains("`dram_prefault`") && e.contains("UMBP_DRAM_"),
            "{e}"
        );
        let e = refusal(json!({"mode": "standalone"}));
        assert!(e.contains("`endpoint`") && e.contains("required"), "{e}");
        let e = refusal(json!({"mode": "standalone", "endpoint": "tcp://1.2.3.4:5"}));
        assert!(e.contains("TCP"), "{e}");
        let e = refusal(json!({"mode": "cluster"}));
        assert!(e.contains("`mode`") && e.contains("\"standalone\""), "{e}");
        let e = ConnectorOptions::from_map(&Map::new(), Some("kv_sideways")).unwrap_err();
        assert!(e.to_string().contains("kv_role"), "{e}");
        let e = ConnectorOptions::from_json("[1]", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("JSON object"), "{e}");
    }

    #[test]
    fn store_arguments_share_the_ranges() {
        assert!(NUM_WORKERS.check_u64(257).is_err() && NUM_WORKERS.check_u64(256).is_ok());
        assert!(TIMEOUT_MS.check_u64(0).is_err());
        assert!(DRAM_HIGH_WATERMARK.check_f64(0.0).is_err());
        assert!(check_watermarks(0.9, 0.9).is_err() && check_watermarks(0.9, 0.7).is_ok());
    }

    #[test]
    fn docs_texts() {
        assert_eq!(CAPACITY_BYTES.default_text(), "64 GiB");
        assert_eq!(DRAM_HUGEPAGE_SIZE.default_text(), "`\"2MiB\"`");
        assert_eq!(NUM_WORKERS.rejected_text(), "Not an integer in 1–256.");
        assert_eq!(
            CAPACITY_BYTES.rejected_text(),
            "Not an integer ≥ 1 MiB. Set together with `total_capacity_bytes`."
        );
        assert_eq!(
            DRAM_NUMA_NODE.rejected_text().split('.').next(),
            Some("Not an integer ≥ 0")
        );
    }
}
