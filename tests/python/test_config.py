"""Connector option validation (no vLLM needed)."""

import ast
import dataclasses
import inspect
import types
from pathlib import Path

import pytest

import umbp
from umbp import ConfigError
from umbp.vllm.config import ConnectorConfig, parse_endpoint


def test_defaults_match_the_documentation(tmp_path):
    c = ConnectorConfig.parse({}, "kv_both")
    assert (c.mode, c.load_async, c.lookup_async, c.enable_lookup) == (
        "embedded",
        True,
        False,
        True,
    )
    assert (c.kv_event_max_objects, c.num_workers, c.timeout_ms) == (65536, 4, 30000)
    assert (c.save_decode_cache, c.lazy_offload, c.enable_partial_hash_hits) == (
        False,
        False,
        False,
    )
    assert c.lookup_dir == "/tmp" and c.worker_capacity(4) == 64 << 30
    assert c.stores and c.restores


def test_total_capacity_is_split_across_workers():
    c = ConnectorConfig.parse({"total_capacity_bytes": 8 << 30}, "kv_both")
    assert c.worker_capacity(4) == 2 << 30
    with pytest.raises(ConfigError, match="total_capacity_bytes"):
        ConnectorConfig.parse({"total_capacity_bytes": 2 << 20}, None).worker_capacity(4)


def test_roles():
    assert not ConnectorConfig.parse({}, "kv_consumer").stores
    assert not ConnectorConfig.parse({}, "kv_producer").restores
    assert not ConnectorConfig.parse({"enable_lookup": False}, "kv_both").restores
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorConfig.parse({}, "kv_sideways")


@pytest.mark.parametrize(
    "extra, option",
    [
        ({"capcity_bytes": 1}, "capcity_bytes"),  # unknown (typo)
        ({"load_async": "yes"}, "load_async"),  # wrong type
        ({"num_workers": 0}, "num_workers"),  # out of range
        ({"num_workers": 2.5}, "num_workers"),
        ({"timeout_ms": -1}, "timeout_ms"),
        ({"kv_event_max_objects": True}, "kv_event_max_objects"),
        ({"capacity_bytes": 1 << 30, "total_capacity_bytes": 1 << 31}, "total_capacity_bytes"),
        ({"capacity_bytes": 10}, "capacity_bytes"),
        ({"dram_high_watermark": 1.2}, "dram_high_watermark"),
        ({"dram_low_watermark": 0.95}, "dram_low_watermark"),
        ({"dram_hugepage_size": "4MiB"}, "dram_hugepage_size"),
        ({"dram_numa_node": -1}, "dram_numa_node"),
        ({"lookup_dir": "/nonexistent/dir"}, "lookup_dir"),
        ({"lookup_instance": "a b"}, "lookup_instance"),
        ({"key_namespace": "a:b"}, "key_namespace"),
        ({"mode": "cluster"}, "mode"),
        ({"endpoint": "/run/x.sock"}, "standalone"),
        ({"mode": "standalone"}, "endpoint"),
        (
            {"mode": "standalone", "endpoint": "/s.sock", "capacity_bytes": 1 << 30},
            "capacity_bytes",
        ),
        ({"mode": "standalone", "endpoint": "/s.sock", "dram_prefault": False}, "dram_prefault"),
        ({"mode": "standalone", "endpoint": "tcp://1.2.3.4:5"}, "endpoint"),
        ({"mode": "standalone", "endpoint": "relative.sock"}, "endpoint"),
    ],
)
def test_invalid_options_name_the_option(extra, option):
    with pytest.raises(ConfigError) as e:
        ConnectorConfig.parse(extra, "kv_both")
    assert option in str(e.value)


def test_standalone_endpoints():
    assert parse_endpoint("unix:///run/umbp/node.grpc.sock") == "/run/umbp/node.grpc.sock"
    assert parse_endpoint("/run/umbp/node.grpc.sock") == "/run/umbp/node.grpc.sock"
    c = ConnectorConfig.parse({"mode": "standalone", "endpoint": "unix:///r/s.sock"}, "kv_both")
    assert (c.endpoint, c.startup_timeout_ms, c.lookup_timeout_ms) == ("/r/s.sock", 30000, 1000)


def test_pipeline_parallelism_is_rejected():
    pytest.importorskip("vllm")
    from umbp.vllm.topology import engine_topology

    pc = types.SimpleNamespace(pipeline_parallel_size=2, tensor_parallel_size=1)
    vc = types.SimpleNamespace(parallel_config=pc)
    with pytest.raises(ConfigError, match="pipeline"):
        engine_topology(ConnectorConfig.parse({}, None), vc, None)


def test_namespace_covers_the_model_config():
    from umbp.vllm.namespace import derive_namespace, socket_tag

    def cfg(dtype="bfloat16", tp=1, model="/m/llama-8b"):
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(
                model=model, revision=None, dtype=dtype, quantization=None, hf_config=None
            ),
            cache_config=types.SimpleNamespace(block_size=16, cache_dtype="auto"),
            parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0),
        )

    a = derive_namespace(cfg(), None)
    assert a.startswith("llama-8b-") and a == derive_namespace(cfg(), None)
    assert a != derive_namespace(cfg(dtype="float16"), None)
    assert a != derive_namespace(cfg(tp=2), None)
    dp1 = cfg()
    dp1.parallel_config.data_parallel_rank = 1
    assert a == derive_namespace(dp1, None), "the DP rank is not part of the namespace"
    assert socket_tag(a, "x") != socket_tag(a, "y")
    # Random weights (load_format="dummy", benchmarks) never share objects with real ones.
    dummy = cfg()
    dummy.load_config = types.SimpleNamespace(load_format="dummy")
    assert a != derive_namespace(dummy, None)
    real = cfg()
    real.load_config = types.SimpleNamespace(load_format="safetensors")
    assert a == derive_namespace(real, None), "real weights keep the namespace they had"


def test_plugin_registration_is_idempotent_and_takes_over_an_in_tree_name(caplog):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from umbp.vllm import plugin

    reg = KVConnectorFactory._registry
    saved = reg.pop("UMBPStoreConnector", None)
    caplog.set_level("INFO", logger="umbp.vllm")
    try:

        class UMBPStoreConnector:  # stands in for vLLM 0.33's dormant in-tree class
            pass

        reg["UMBPStoreConnector"] = lambda: UMBPStoreConnector
        plugin.register()
        plugin.register()  # vLLM runs plugins in every process, sometimes twice
        cls = reg["UMBPStoreConnector"]()
        assert cls.__module__ == "umbp.vllm.connector"
        # The takeover is logged once, at WARNING, with both ways to keep vLLM's class.
        (record,) = [r for r in caplog.records if "UMBPStoreConnector" in r.getMessage()]
        assert record.levelname == "WARNING"
        msg = record.getMessage()
        assert "kv_connector_module_path" in msg and "VLLM_PLUGINS" in msg and "`umbp`" in msg
    finally:
        reg.pop("UMBPStoreConnector", None)
        if saved is not None:
            reg["UMBPStoreConnector"] = saved


def test_plugin_takeover_warning_names_the_module_of_vllms_class(caplog):
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from umbp.vllm import plugin

    reg = KVConnectorFactory._registry
    saved = reg.pop("UMBPStoreConnector", None)
    caplog.set_level("WARNING", logger="umbp.vllm")
    try:
        # Registered the way vLLM registers its in-tree connectors.
        in_tree = "vllm.distributed.kv_transfer.kv_connector.v1.umbp"
        KVConnectorFactory.register_connector("UMBPStoreConnector", in_tree, "UMBPStoreConnector")
        plugin.register()
        (record,) = caplog.records
        assert f'"kv_connector_module_path": "{in_tree}"' in record.getMessage()
    finally:
        reg.pop("UMBPStoreConnector", None)
        if saved is not None:
            reg["UMBPStoreConnector"] = saved


def test_key_namespace_auto_means_derived():
    # vLLM's in-tree class documents "auto" as its default: it must not become a literal
    # namespace that every model would share.
    assert ConnectorConfig.parse({"key_namespace": "auto"}, "kv_both").key_namespace is None
    assert ConnectorConfig.parse({"key_namespace": "v2"}, "kv_both").key_namespace == "v2"


def test_lookup_workers_is_the_in_tree_option_name():
    assert ConnectorConfig.parse({}, "kv_both").lookup_workers == 2
    assert ConnectorConfig.parse({"lookup_workers": 8}, "kv_both").lookup_workers == 8
    for bad in (0, 1.5, "4", 1000):
        with pytest.raises(ConfigError, match="lookup_workers"):
            ConnectorConfig.parse({"lookup_workers": bad}, "kv_both")


# ---------------------------------------------------------------------------------------------
# One schema (crates/umbp-core/src/options/schema.rs) for checks, defaults, the store and the docs
# ---------------------------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_docs_option_tables_are_the_schema():
    from umbp.vllm import config

    text = DOCS.read_text(encoding="utf-8")
    assert config.render_docs(text) == text, (
        "docs/configuration.md's option tables differ from the schema; run "
        "`python -m umbp.vllm.config --write docs/configuration.md`"
    )
    lines = text.splitlines()
    for s in config.SCHEMA:  # every option is in one table, once
        row = f"| `{s['name']}` | {s['default_doc']} |"
        assert sum(line.startswith(row) for line in lines) == 1, s["name"]


def test_connector_config_fields_are_the_schemas_options():
    from umbp.vllm import config

    fields = {f.name for f in dataclasses.fields(ConnectorConfig)} - {
        "extra",
        "kv_role",
        "source_json",
    }
    assert fields == set(config.OPTIONS)
    parsed = ConnectorConfig.parse({}, None)
    for s in config.SCHEMA:
        if s["scope"] != "standalone":
            assert getattr(parsed, s["name"]) == s["default"], s["name"]


#: The store's keyword arguments that are connector options under another name.
STORE_ARGS = {
    "high_watermark": "dram_high_watermark",
    "low_watermark": "dram_low_watermark",
    "use_hugepages": "dram_use_hugepages",
    "hugepage_size": "dram_hugepage_size",
    "numa_node": "dram_numa_node",
    "prefault": "dram_prefault",
    "num_workers": "num_workers",
    "timeout_ms": "timeout_ms",
}


#: The native constructors' arguments that are connector options (argument: option).
OPTION_ARGS = {
    "EmbeddedStore": {
        **STORE_ARGS,
        **{
            name: name
            for name in (
                "remote_url",
                "remote_ttl_s",
                "remote_write",
                "remote_timeout_ms",
                "remote_write_backlog",
                "remote_write_mb_per_s",
                "disk_dir",
                "disk_capacity_bytes",
                "disk_write_mb_per_s",
                "disk_write",
                "disk_close_write_s",
                "cuda_staging_bytes",
            )
        },
    },
    "StandaloneClient": {
        "startup_timeout_ms": "startup_timeout_ms",
        "lookup_timeout_ms": "lookup_timeout_ms",
        "timeout_ms": "timeout_ms",
    },
    "LookupClient": {"timeout_ms": "lookup_timeout_ms"},
}

STUB = Path(umbp.__file__).with_name("_native.pyi")


def _stub_defaults(fn: ast.FunctionDef) -> dict[str, ast.expr]:
    """The stub function's parameters that have a default, and that default's expression."""
    a = fn.args
    positional = a.posonlyargs + a.args
    out = dict(zip([p.arg for p in positional[len(positional) - len(a.defaults) :]], a.defaults))
    out.update((p.arg, d) for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None)
    return out


def _stub_functions():
    """(native object, stub FunctionDef) of every function and method the stub declares."""
    for node in ast.parse(STUB.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef):
            yield getattr(umbp._native, node.name), node
        elif isinstance(node, ast.ClassDef):
            cls = getattr(umbp._native, node.name)
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    yield (cls if item.name == "__init__" else getattr(cls, item.name)), item


def test_option_arguments_repeat_no_default():
    """The schema alone holds option defaults: the native constructors take None for "the
    option's default" (resolved in Rust) and the stubs say `...`."""
    from umbp.vllm import config

    body = ast.parse(STUB.read_text(encoding="utf-8")).body
    stubs = {n.name: n for n in body if isinstance(n, ast.ClassDef)}
    for cls, args in OPTION_ARGS.items():
        params = inspect.signature(getattr(umbp._native, cls)).parameters
        init = next(f for f in stubs[cls].body if getattr(f, "name", "") == "__init__")
        stub = _stub_defaults(init)
        for arg, option in args.items():
            assert option in config.OPTIONS, option
            assert params[arg].default is None, f"{cls}({arg}=...): a literal default"
            assert isinstance(stub[arg], ast.Constant) and stub[arg].value is Ellipsis, (
                f"_native.pyi {cls}({arg}=...): write `= ...`, the default is the schema's"
            )


def test_stub_defaults_are_the_native_ones():
    """A literal default in the stub is the native one; a native None is `None` or `...`."""
    checked = 0
    for native, fn in _stub_functions():
        try:
            params = inspect.signature(native).parameters
        except (TypeError, ValueError):
            continue  # no text signature (a property, a dunder without one)
        stub = _stub_defaults(fn)
        for name, node in stub.items():
            where = f"_native.pyi {fn.name}({name}=...)"
            assert name in params, f"{where}: the native signature has no {name}"
            default = params[name].default
            assert default is not inspect.Parameter.empty, f"{where}: natively required"
            if default is Ellipsis:
                continue  # a Rust expression the native signature cannot show
            if isinstance(node, ast.Constant) and node.value is Ellipsis:
                assert default is None, f"{where}: native default {default!r}, not None"
                continue
            assert ast.literal_eval(node) == default, f"{where}: native default {default!r}"
            checked += 1
        for name, p in params.items():
            if p.default is not inspect.Parameter.empty and name not in ("self",):
                assert name in stub, f"_native.pyi {fn.name}: {name} has a default natively"
    assert checked > 0


def test_store_table_shows_the_connector_defaults():
    from umbp.vllm import config

    rows = {}
    for line in DOCS.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[1].startswith("`") and cells[1] != "—":
            rows[cells[0].split()[0].strip("`")] = (cells[1].strip("`"), cells[2])
    for arg, option in STORE_ARGS.items():
        assert rows[arg] == (option, config.OPTIONS[option]["default_doc"]), arg


@pytest.mark.parametrize(
    "option, value, store_arg",
    [
        ("num_workers", 0, "num_workers"),
        ("num_workers", 257, "num_workers"),
        ("timeout_ms", 0, "timeout_ms"),
        ("dram_high_watermark", 1.5, "high_watermark"),
    ],
)
def test_connector_and_store_refuse_with_one_message(option, value, store_arg):
    with pytest.raises(ConfigError) as connector:
        ConnectorConfig.parse({option: value}, "kv_both")
    with pytest.raises(ConfigError) as store:
        umbp.EmbeddedStore(8 << 20, prefault=False, **{store_arg: value})
    assert str(connector.value) == str(store.value)
    assert f"`{option}`" in str(store.value) and str(value) in str(store.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), object(), {1, 2}])
def test_values_json_cannot_carry_are_refused_by_name(value):
    with pytest.raises(ConfigError, match="dram_high_watermark"):
        ConnectorConfig.parse({"dram_high_watermark": value}, "kv_both")


def test_null_means_unset_only_for_optional_options():
    c = ConnectorConfig.parse({"capacity_bytes": None, "dram_numa_node": None}, None)
    assert c.worker_capacity(1) == 64 << 30 and c.dram_numa_node is None
    with pytest.raises(ConfigError, match="num_workers"):
        ConnectorConfig.parse({"num_workers": None}, None)
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorConfig.parse({}, 3)  # type: ignore[arg-type]


def test_a_workers_store_is_built_from_the_users_options_in_rust(tmp_path):
    """The connector hands the user's JSON to Rust once (`EmbeddedStore.for_connector`): the
    options reach the pool, the disk tier and the copy engine with nothing re-typed between."""
    (tmp_path / "disk").mkdir()
    extra = {
        "disk_dir": str(tmp_path / "disk"),
        "disk_capacity_bytes": 64 << 20,
        "eviction_policy": "lru",
        "store_admission": "on_reuse",
        "integrity": "sample",
        "integrity_sample_every": 7,
        "num_workers": 2,
    }
    cfg = ConnectorConfig.parse(extra, "kv_both")
    with umbp.EmbeddedStore.for_connector(
        cfg.source_json, cfg.kv_role, capacity_bytes=8 << 20, disk_subdir="umbp-t-dp0-w1"
    ) as store:
        s = store.stats()
        assert s["capacity_bytes"] == 8 << 20
        assert (s["eviction_policy"], s["store_admission"]) == ("lru", "on_reuse")
        assert (s["integrity"], s["integrity_sample_every"]) == ("sample", 7)
        assert store.disk_stats()["capacity_bytes"] == 64 << 20
        assert (tmp_path / "disk" / "umbp-t-dp0-w1").is_dir()
    # A bad option is refused by name there too, as the connector's parse refuses it.
    with pytest.raises(ConfigError, match="eviction_policy"):
        umbp.EmbeddedStore.for_connector(
            '{"eviction_policy": "fifo"}', capacity_bytes=8 << 20, disk_subdir="x"
        )
