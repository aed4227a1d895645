//! The connector's validated options: [`ConnectorOptions`] built from the user's JSON by
//! checking every option against the schema, with the checks across options (the mode's
//! scope, exclusive capacities, watermarks, the standalone endpoint).

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::check::check_watermarks;
use super::schema::{
    spec, CAPACITY_BYTES, CUDA_STAGING_BYTES, ENDPOINT, EVICTION_POLICY, KV_ROLES, MODE, SCHEMA,
    STORE_ADMISSION, STORE_PRIORITY_SKIP_ABOVE, TOTAL_CAPACITY_BYTES,
};
use super::spec::{OptionSpec, Scope};
use crate::sizes::MIB;
use crate::CoreError;

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
    pub store_priority_skip_above: Option<i64>,
    pub store_priority_admit_at_most: Option<i64>,
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
    /// `"s3fifo"` or `"lru"`.
    pub eviction_policy: String,
    /// `"all"` or `"on_reuse"`.
    pub store_admission: String,
    /// `"off"`, `"sample"` or `"all"`.
    pub integrity: String,
    pub integrity_sample_every: u64,
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
    pub disk_dir: Option<String>,
    pub disk_capacity_bytes: u64,
    pub disk_write_mb_per_s: u64,
    /// `"on_evict"` or `"eager"`.
    pub disk_write: String,
    pub disk_close_write_s: u64,
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
                        Mode::Standalone if name.starts_with("disk_") => {
                            "is not accepted in standalone mode: the server owns the pool and \
                             its disk tier; start the server with --disk-dir (UMBP_DISK_DIR), \
                             --disk-capacity (UMBP_DISK_CAPACITY), --disk-write-mb-per-s \
                             (UMBP_DISK_WRITE_MB_PER_S), --disk-write (UMBP_DISK_WRITE) and \
                             --disk-close-write-s (UMBP_DISK_CLOSE_WRITE_S)"
                        }
                        Mode::Standalone if name.starts_with("integrity") => {
                            "is not accepted in standalone mode: the server owns the pool and \
                             its checksums; start it with --integrity (UMBP_INTEGRITY) and \
                             --integrity-sample-every (UMBP_INTEGRITY_SAMPLE_EVERY)"
                        }
                        Mode::Standalone
                            if name == EVICTION_POLICY.name || name == STORE_ADMISSION.name =>
                        {
                            "is not accepted in standalone mode: the server owns the pool; \
                             start it with --eviction-policy (UMBP_EVICTION_POLICY) or \
                             --store-admission (UMBP_STORE_ADMISSION)"
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
        if let (Some(skip), Some(now)) = (
            opts.store_priority_skip_above,
            opts.store_priority_admit_at_most,
        ) {
            if now > skip {
                return Err(STORE_PRIORITY_SKIP_ABOVE.refuse(format!(
                    "{skip} is below `store_priority_admit_at_most` ({now}), so priorities \
                     {} to {now} would be both skipped and stored at once; raise it to at least \
                     {now} or lower the other",
                    skip + 1
                )));
            }
        }
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
