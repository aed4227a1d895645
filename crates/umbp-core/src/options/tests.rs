//! Tests of the options: the schema's defaults and ranges, refusals and their messages,
//! and the connector's checks across options.

use serde_json::{json, Map, Value};

use super::*;
use crate::sizes::GIB;
use crate::CoreError;

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
    let e =
        refusal(json!({"mode": "standalone", "endpoint": "/tmp/s", "remote_url": "redis://h:1"}));
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
    let e =
        refusal(json!({"mode": "standalone", "endpoint": "/tmp/s", "cuda_staging_bytes": 1 << 20}));
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
    let e = refusal(json!({"mode": "standalone", "endpoint": "/s", "eviction_policy": "lru"}));
    assert!(e.contains("--eviction-policy"), "{e}");
    assert!(refusal(json!({"eviction_policy": "arc"})).contains("s3fifo"));
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

#[test]
fn store_priority_thresholds() {
    let o = parse(json!({})).unwrap();
    assert_eq!(
        (o.store_priority_skip_above, o.store_priority_admit_at_most),
        (None, None)
    );
    // vLLM priorities are any integer, negative too.
    let o =
        parse(json!({"store_priority_skip_above": 5, "store_priority_admit_at_most": -2})).unwrap();
    assert_eq!(
        (o.store_priority_skip_above, o.store_priority_admit_at_most),
        (Some(5), Some(-2))
    );
    assert!(
        parse(json!({"store_priority_skip_above": 3, "store_priority_admit_at_most": 3})).is_ok()
    );
    let e = refusal(json!({"store_priority_skip_above": 1, "store_priority_admit_at_most": 4}));
    assert!(
        e.contains("store_priority_skip_above")
            && e.contains("store_priority_admit_at_most")
            && e.contains("2 to 4"),
        "{e}"
    );
    let e = refusal(json!({"store_priority_admit_at_most": "high"}));
    assert!(
        e.contains("store_priority_admit_at_most") && e.contains("an integer"),
        "{e}"
    );
    assert!(refusal(json!({"store_priority_skip_above": 1.5})).contains("an integer"));
    // Shared: accepted in standalone mode too (the scheduler decides).
    let o = parse(json!({"mode": "standalone", "endpoint": "/tmp/s",
                         "store_priority_admit_at_most": 0}))
    .unwrap();
    assert_eq!(o.store_priority_admit_at_most, Some(0));
}
