"""The embedded store through its Python API, on real memory."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import umbp
from conftest import KvCache, hashes, umbp_command


def attach(store, cache):
    store.register_memory(cache.base, cache.buf.nbytes)
    return store.register_layout(cache.layout())


def test_stats_hold_every_counter_of_the_pool_group(store):
    """The embedded dict is rendered from the pool's counter model: each field, by name."""
    s = store.stats()
    fields = dict(umbp.counter_fields())["pool"]
    assert {"hits", "misses", "evictions", "leases", "events_dropped"} <= {f[0] for f in fields}
    for name, kind, series, help_ in fields:
        assert isinstance(s[name], int), name
        assert kind in ("counter", "gauge") and series.startswith("umbp_pool_") and help_, name
    assert s["capacity_bytes"] > 0 and s["eviction_policy"] in ("lru", "s3fifo")


def test_round_trip_is_byte_exact(store, kb):
    src, dst = KvCache(fill_seed=1), KvCache()
    ls, ld = attach(store, src), attach(store, dst)
    rng = np.random.default_rng(0)
    blocks = rng.permutation(src.blocks)[:40].tolist()
    keys = kb.keys(0, hashes(blocks))
    assert store.store(ls, 0, blocks, keys).wait() == ["done"] * 40
    assert store.exists(keys) == [True] * 40
    targets = rng.permutation(dst.blocks)[:40].tolist()
    assert store.load(ld, 0, targets, keys).wait() == ["done"] * 40
    for b, t in zip(blocks, targets):
        assert src.block(b) == dst.block(t)
    s = store.stats()
    assert s["objects"] == 40 and s["puts"] == 40 and s["gets"] == 40
    assert s["bytes_in"] == 40 * src.layers * src.piece


def test_a_job_reports_its_duration_and_object_size(store, kb):
    """What the connector's metrics read off a finished job (vllm:umbp_*_seconds, _bytes)."""
    src = KvCache(fill_seed=2)
    ls = attach(store, src)
    keys = kb.keys(0, hashes(range(8)))
    job = store.store(ls, 0, list(range(8)), keys)
    assert job.object_bytes == src.layers * src.piece
    t0 = time.perf_counter()
    assert job.wait() == ["done"] * 8
    took = time.perf_counter() - t0
    assert job.elapsed_s is not None and 0 < job.elapsed_s <= took + 0.05


def test_per_key_statuses(store, kb):
    src = KvCache(fill_seed=2)
    lid = attach(store, src)
    keys = kb.keys(0, hashes([1, 2, 3]))
    store.store(lid, 0, [1, 2], keys[0:2]).wait()
    assert store.store(lid, 0, [1], keys[0:1]).wait() == ["already_present"]
    job = store.load(lid, 0, [10, 11, 12], keys)
    assert job.wait() == ["done", "done", "missing"]
    assert job.poll() == ["done", "done", "missing"] and job.done and len(job) == 3
    assert store.prefix_hits(keys) == 2


def test_failed_keys_say_why_in_a_word_and_in_words(store, kb):
    src, dst = KvCache(fill_seed=4), KvCache()
    ls = attach(store, src)
    store.register_memory(dst.base, dst.buf.nbytes)
    narrow = store.register_layout([dst.layout()[0][:2]])  # half the layers: half the object
    keys = kb.keys(0, hashes([7, 8]))
    assert store.store(ls, 0, [7, 8], keys).wait() == ["done", "done"]
    job = store.load(narrow, 0, [1, 2], keys)
    assert job.wait() == ["failed", "failed"]
    failures = job.failures()
    assert [(i, kind) for i, kind, _ in failures] == [(0, "size_mismatch"), (1, "size_mismatch")]
    assert all("different layout" in why for _, _, why in failures), failures
    assert job.errors() == [(i, why) for i, _, why in failures]
    ok = store.load(ls, 0, [9], keys[0:1])
    assert ok.wait() == ["done"] and ok.failures() == [] and ok.errors() == []


def test_keys_are_bulk_and_readable(kb):
    keys = kb.keys(3, [b"\x01\xff"])
    assert kb.key_strings(keys) == ["umbp:vllm:v1:pytest-ns:tp0:pcp0:dcp0:pp0:g3:01ff"]
    packed = b"".join(hashes(range(100)))
    many = kb.keys_packed(0, packed, 32)
    assert len(many) == 100
    again = umbp.Keys.from_bytes(many.to_bytes())
    assert again.to_bytes() == many.to_bytes()
    assert len(many[10:20]) == 10
    assert (
        umbp.KeyBuilder("x", tp=1).keys(0, [b"a"]).to_bytes()
        != umbp.KeyBuilder("x", tp=0).keys(0, [b"a"]).to_bytes()
    )
    with pytest.raises(umbp.ConfigError, match="1..=32"):
        kb.keys(0, [b""])
    with pytest.raises(umbp.ConfigError, match="key_namespace"):
        umbp.KeyBuilder("a:b")


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"capacity_bytes": 0}, "capacity_bytes"),
        ({"low_watermark": 0.9, "high_watermark": 0.9}, "dram_low_watermark"),
        ({"high_watermark": 1.5}, "dram_high_watermark"),
        ({"hugepage_size": "4MiB", "use_hugepages": True}, "dram_hugepage_size"),
        ({"numa_node": 4000}, "dram_numa_node"),
        ({"num_workers": 0}, "num_workers"),
        ({"timeout_ms": 0}, "timeout_ms"),
        ({"eviction_policy": "arc"}, "eviction_policy"),
        ({"store_admission": "never"}, "store_admission"),
    ],
)
def test_bad_configuration_names_the_option(kwargs, option):
    args = {"capacity_bytes": 8 << 20, "prefault": False, **kwargs}
    with pytest.raises(umbp.ConfigError) as e:
        umbp.EmbeddedStore(args.pop("capacity_bytes"), **args)
    assert option in str(e.value)
    assert isinstance(e.value, ValueError)


def test_unmet_hugepage_request_falls_back_with_a_warning(caplog):
    caplog.set_level("WARNING")
    # 1 GiB pages are not reserved on this machine: the request must fall back, visibly.
    s = umbp.EmbeddedStore(1 << 30, use_hugepages=True, hugepage_size="1GiB", prefault=False)
    st = s.stats()
    s.close()
    assert st["hugepages_requested"] == "1GiB"
    if st["hugepages_used"] is None:
        assert st["hugepage_fallback"]
        assert any("falling back" in r.getMessage() for r in caplog.records), caplog.text


def test_out_of_range_requests_are_errors_not_crashes(store, kb):
    src = KvCache(fill_seed=3)
    with pytest.raises(umbp.ConfigError, match="register the KV cache"):
        store.register_layout(src.layout())
    store.register_memory(src.base, src.buf.nbytes // 2)
    with pytest.raises(umbp.ConfigError, match="not inside one registered memory region"):
        store.register_layout(src.layout())
    with pytest.raises(umbp.RegistrationError, match="overlaps"):
        store.register_memory(src.base + 8, 64)
    with pytest.raises(umbp.RegistrationError):
        store.deregister_memory(12345)
    lid = store.register_layout([src.layout()[0][:2]])  # the two registered layers
    with pytest.raises(umbp.ConfigError, match="out of range"):
        store.store(lid, 0, [src.blocks], kb.keys(0, [b"k"]))
    with pytest.raises(umbp.ConfigError, match="does not exist"):
        store.store(lid, 1, [0], kb.keys(0, [b"k"]))
    with pytest.raises(umbp.ConfigError, match="keys for"):
        store.store(lid, 0, [0, 1], kb.keys(0, [b"k"]))
    with pytest.raises(umbp.ConfigError):
        store.store(lid, 0, [-1], kb.keys(0, [b"k"]))
    with pytest.raises(umbp.ConfigError, match="no KV layout"):
        store.load(999, 0, [0], kb.keys(0, [b"k"]))


def test_wait_timeout_and_cancel(kb):
    s = umbp.EmbeddedStore(64 << 20, num_workers=1, prefault=False)
    src = KvCache(fill_seed=4, blocks=256, piece=16384)
    lid = attach(s, src)
    jobs = [s.store(lid, 0, list(range(256)), kb.keys(g, hashes(range(256)))) for g in range(1, 8)]
    last = jobs[-1]
    last.cancel()
    for j in jobs[:-1]:
        j.wait(timeout_ms=60_000)
    res = last.wait(timeout_ms=60_000)
    assert "pending" not in res
    # A zero deadline on a fresh big job raises TransferTimeout (a TimeoutError) or succeeds.
    job = s.load(lid, 0, list(range(256)), kb.keys(1, hashes(range(256))))
    try:
        job.wait(timeout_ms=0)
    except umbp.TransferTimeout as e:
        assert isinstance(e, TimeoutError) and "still running" in str(e)
    assert job.wait(timeout_ms=60_000)
    s.close()
    with pytest.raises(umbp.StoreClosedError):
        s.store(lid, 0, [0], kb.keys(0, [b"k"]))
    s.close()  # idempotent


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_on_reuse_keeps_a_block_stored_the_second_time(kb, policy):
    """store_admission="on_reuse": the first store of a key is skipped (answered "skipped",
    counted), the second is kept and loads back byte-exact; stats name the policy."""
    s = umbp.EmbeddedStore(
        64 << 20, prefault=False, eviction_policy=policy, store_admission="on_reuse"
    )
    src, dst = KvCache(fill_seed=7), KvCache()
    ls, ld = attach(s, src), attach(s, dst)
    keys = kb.keys(0, hashes(range(6)))
    assert s.store(ls, 0, list(range(6)), keys).wait() == ["skipped"] * 6
    assert s.exists(keys) == [False] * 6
    assert s.stats()["admissions_skipped"] == 6
    assert s.store(ls, 0, list(range(6)), keys).wait() == ["done"] * 6
    assert s.exists(keys) == [True] * 6
    assert s.load(ld, 0, list(range(10, 16)), keys).wait() == ["done"] * 6
    for b in range(6):
        assert src.block(b) == dst.block(10 + b)
    st = s.stats()
    assert (st["eviction_policy"], st["store_admission"]) == (policy, "on_reuse")
    assert st["admissions_skipped"] == 6
    s.close()


def test_a_store_admitted_now_is_kept_on_first_sighting_under_on_reuse(kb):
    """`admit_now=True` (a request's store hint "now"): kept on the key's first sighting,
    counted in `admissions_forced`; a store without it is still skipped."""
    s = umbp.EmbeddedStore(64 << 20, prefault=False, store_admission="on_reuse")
    src, dst = KvCache(fill_seed=9), KvCache()
    ls, ld = attach(s, src), attach(s, dst)
    policy, now = kb.keys(0, hashes(range(4))), kb.keys(0, hashes(range(4, 8)))
    assert s.store(ls, 0, [0, 1, 2, 3], policy).wait() == ["skipped"] * 4
    assert s.store(ls, 0, [4, 5, 6, 7], now, admit_now=True).wait() == ["done"] * 4
    assert s.exists(now) == [True] * 4 and s.exists(policy) == [False] * 4
    assert s.load(ld, 0, [20, 21, 22, 23], now).wait() == ["done"] * 4
    for b in range(4):
        assert src.block(4 + b) == dst.block(20 + b)
    st = s.stats()
    assert (st["admissions_skipped"], st["admissions_forced"], st["objects"]) == (4, 4, 4)
    s.close()


def test_eviction_under_pressure_keeps_serving(kb):
    s = umbp.EmbeddedStore(4 << 20, num_workers=2, prefault=False, segment_bytes=256 << 10)
    src = KvCache(fill_seed=5)  # 8 KiB objects
    lid = attach(s, src)
    for round_ in range(20):
        keys = kb.keys(round_, hashes(range(64)))
        assert set(s.store(lid, 0, list(range(64)), keys).wait()) <= {"done", "already_present"}
    st = s.stats()
    assert st["evictions"] > 0 and st["used_bytes"] <= st["capacity_bytes"]
    s.close()


def test_blocking_calls_release_the_gil():
    ticks = 0
    done = threading.Event()

    def build():
        s = umbp.EmbeddedStore(512 << 20, prefault=True)
        s.close()
        done.set()

    t = threading.Thread(target=build)
    start = time.monotonic()
    t.start()
    while not done.is_set() and time.monotonic() - start < 60:
        ticks += 1
    t.join()
    # The main thread kept running Python while the store mapped and prefaulted memory.
    assert ticks > 1000


def test_nothing_is_created_at_import_and_fork_is_safe():
    code = (
        "import os, sys\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "import umbp\n"
        "after = len(os.listdir('/proc/self/task'))\n"
        "assert before == after, (before, after)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    s = umbp.EmbeddedStore(8 << 20, prefault=False)\n"
        "    k = umbp.KeyBuilder('f').keys(0, [b'x'])\n"
        "    os._exit(0 if s.exists(k) == [False] else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_stubs_cover_the_module():
    import ast

    import umbp._native as native

    stub = Path(umbp.__file__).with_name("_native.pyi").read_text()
    body = ast.parse(stub).body
    names = {n.name for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    # Another name of a class (`Job = Transfer`).
    names |= {
        t.id
        for n in body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in names
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    public = {n for n in dir(native) if not n.startswith("_")}
    assert names == public


def run_umbp(*args):
    r = subprocess.run(
        [str(umbp_command()), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("policy,most", [("lru", 0.05), ("s3fifo", 0.06)])
def test_umbp_bench_pool_json(policy, most):
    """Metadata stays bounded at small (4 KiB) objects; S3-FIFO's per-entry state and ghost
    set cost about 12% more than LRU's list (docs/benchmarks.md)."""
    out = run_umbp(
        "bench",
        "pool",
        "--objects",
        "5000",
        "--object-bytes",
        "4096",
        "--json",
        "--eviction-policy",
        policy,
    )
    assert out["lookup_keys_per_s"] > 0 and out["metadata_ratio"] < most


def test_umbp_bench_cache_json():
    """Both workloads, every policy and admission at each capacity; only the chat workload has
    conversations, and only on_reuse skips stores. The replay is seeded and evicts
    synchronously, so the same arguments give the same rates on every machine."""
    r = subprocess.run(
        [str(umbp_command()), "bench", "cache", "--prefixes", "64", "--requests", "400"]
        + ["--recovery", "64", "--capacities", "0.5", "--conversations", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    mla = [x for x in rows if x["bench"] == "cache_mla"]
    assert mla and all(x["bytes_ratio_before_after"] == x["tp"] for x in mla), mla
    rows = [x for x in rows if x["bench"] == "cache"]
    got = {(x["workload"], x["eviction_policy"], x["store_admission"]) for x in rows}
    assert got == {
        (w, p, a)
        for w in ("prefixes", "chat")
        for p in ("lru", "s3fifo")
        for a in ("all", "on_reuse")
    }
    for x in rows:
        assert 0 < x["token_hit_rate"] < 1, x
        assert (x["chat_context_hit_rate"] > 0) == (x["workload"] == "chat"), x
        assert (x["admissions_skipped"] > 0) == (x["store_admission"] == "on_reuse"), x


def test_umbp_bench_copy_json():
    out = run_umbp(
        "bench",
        "copy",
        "--layers",
        "4",
        "--blocks",
        "64",
        "--cache-blocks",
        "128",
        "--rounds",
        "1",
        "--json",
    )
    assert {"gbps", "ceiling_gbps", "ratio"} <= out.keys()
    assert out["ratio"] > 0


def test_umbp_without_arguments_explains_itself():
    r = subprocess.run([str(umbp_command())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "bench" in r.stderr
