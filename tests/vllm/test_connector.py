"""UMBPStoreConnector on real vLLM CPU engines with a model built at test time."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import sys
import time
from pathlib import Path

import pytest

import umbp
from conftest import (
    COMPUTED,
    assert_as_reference,
    finish,
    prompts,
    reference,
    run_engine,
    wait_for,
)
from umbp.vllm.host import socket_dir
from umbp.vllm.namespace import socket_tag

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import running  # noqa: E402

BLOCK = 128  # vLLM CPU's default block size


def connector(tmp_path: Path, **extra) -> dict:
    return {
        "mode": "embedded",
        "total_capacity_bytes": 64 << 20,
        "lookup_dir": str(tmp_path),
        "dram_prefault": False,
        **extra,
    }


def describe(tmp_path: Path, namespace: str, instance: str = "", workers: int = 1) -> list[dict]:
    """Each worker's pool counters, read through its lookup socket."""
    tag = socket_tag(namespace, instance)
    paths = [umbp.socket_path(socket_dir(tmp_path), tag, 0, w) for w in range(workers)]
    out = []
    for d in umbp.LookupClient(paths, 2000).wait_ready(5000):
        out.append(dict(kv.split("=") for kv in d.split() if "=" in kv))
    return out


def test_restored_prefixes_give_identical_outputs(model, tmp_path):
    """Restored prefixes give what vLLM's own prefix cache gives for the same cached tokens
    (the reference for a restore: conftest.reference); reset_external empties the pools."""
    ps = prompts(3)
    ref = reference(model, {"ps": ps})
    # The usage guide's configuration, through the plugin entry point (no module path).
    r = run_engine(
        {
            "model": model,
            # Prefaulted, so the workers claim their pools' memory (a claims file).
            "connector": connector(tmp_path, dram_prefault=True),
            "steps": [
                {"generate": ps},
                {"reset": False},  # vLLM's own prefix cache only
                {"generate": ps},
                {"reset": True},  # reset_external: clears every worker's pool too
                {"generate": ps},
            ],
        }
    )
    first, _, restored, _, recomputed = r["steps"]
    assert r["block_size"] == BLOCK, r["block_size"]
    for what, run in (("first", first), ("restored", restored), ("recomputed", recomputed)):
        assert_as_reference(run, ref["ps"], what)
    for o in restored:
        full_blocks = (o["prompt_tokens"] - 1) // BLOCK
        assert o["cached"] == full_blocks * BLOCK, restored
    # The prompts share a 600-token head, so only the first one after the reset is fully cold.
    assert recomputed[0]["cached"] == 0, "reset_external must clear the pools"
    # A stopped engine leaves nothing behind: no lookup socket, no memory claims file.
    assert list(socket_dir(tmp_path).iterdir()) == []


def test_a_restarted_embedded_engine_restores_from_its_disk_dir(model, tmp_path):
    """Embedded mode with `disk_dir`: a worker that closes writes its pool to its private
    subdirectory; the same engine started again restores every full block from disk."""
    ps = prompts(2, shared=0, seed=31)
    ref = reference(model, {"ps": ps})["ps"]
    disk = tmp_path / "disk"
    disk.mkdir()
    cfg = connector(tmp_path, disk_dir=str(disk), disk_capacity_bytes=64 << 20)
    spec = {"model": model, "connector": cfg, "steps": [{"generate": ps}]}
    first, second = run_engine(spec), run_engine(spec)
    (before,), (after,) = first["steps"], second["steps"]
    assert [o["cached"] for o in before] == [0, 0]
    block = second["block_size"]  # read from the engine, not assumed
    for o in after:
        assert o["cached"] == (o["prompt_tokens"] - 1) // block * block, after
    # Computed, then restored from disk: the restore is judged against vLLM's own prefix
    # cache with the same cached tokens (on AMX CPUs a full prefill's tokens can differ).
    assert_as_reference(before, ref, "computed")
    assert_as_reference(after, ref, "restored from disk")
    # One worker: one private directory, named as its lookup socket.
    (sub,) = disk.iterdir()
    assert sub.name.startswith("umbp-") and sub.name.endswith("-dp0-w0"), sub.name
    assert list(sub.glob("seg-*.dat")), list(sub.iterdir())


def test_small_pool_evicts_and_outputs_stay_identical(model, tmp_path):
    ps = prompts(6, shared=0, seed=1)
    ref = reference(model, {"ps": ps})["ps"]
    # One block object is 4 layers x 32 KiB; 1 MiB holds 8 of the 6 x 8 blocks stored.
    cfg = connector(tmp_path, key_namespace="small", lookup_instance="small")
    cfg.pop("total_capacity_bytes")
    cfg["capacity_bytes"] = 1 << 20
    r = run_engine(
        {
            "model": model,
            "connector": cfg,
            "module_path": True,
            "steps": [
                {"generate": ps},
                {"reset": False},
                {"generate": ps},
                {"signal": str(tmp_path / "s")},
            ],
        }
    )
    # Each prompt fully restored gives vLLM's own prefix cache's output, one restored in part
    # (the pool evicted the rest) is compared by length (conftest.assert_as_reference).
    assert_as_reference(r["steps"][0], ref, "computed")
    assert_as_reference(r["steps"][2], ref, "restored")
    hits = sum(o["cached"] for o in r["steps"][2])
    possible = sum((o["prompt_tokens"] - 1) // BLOCK * BLOCK for o in r["steps"][2])
    assert hits < possible, "a pool smaller than the working set cannot restore everything"


def test_consumer_never_stores_and_disabled_lookup_never_restores(model, tmp_path):
    ps = prompts(2, shared=0, seed=2)
    for role, extra, expect_objects in (
        ("kv_consumer", {}, False),
        ("kv_both", {"enable_lookup": False}, True),
    ):
        ns = f"role-{role}-{len(extra)}"
        done = tmp_path / f"{ns}.done"
        proc = run_engine(
            {
                "model": model,
                "kv_role": role,
                "connector": connector(tmp_path, key_namespace=ns, **extra),
                "steps": [
                    {"generate": ps},
                    {"reset": False},
                    {"generate": ps},
                    {"signal": str(tmp_path / f"{ns}.ready")},
                    {"wait_for": str(done)},
                ],
            },
            background=True,
        )
        wait_for(tmp_path / f"{ns}.ready")
        objects = int(describe(tmp_path, ns)[0]["objects"])
        done.write_text("go")
        r = finish(proc)
        assert (objects > 0) == expect_objects, (role, extra, objects)
        assert all(o["cached"] == 0 for o in r["steps"][2]), (role, extra, r["steps"][2])


def test_engines_with_different_lookup_instances_never_answer_each_other(model, tmp_path):
    ps = prompts(1, seed=3)
    ns = "shared-model"
    a_ready, b_done = tmp_path / "a.ready", tmp_path / "b.done"
    a = run_engine(
        {
            "model": model,
            "connector": connector(tmp_path, key_namespace=ns, lookup_instance="a"),
            "steps": [
                {"generate": ps},
                {"signal": str(a_ready)},
                {"wait_for": str(b_done)},
                {"reset": False},
                {"generate": ps},
            ],
        },
        background=True,
    )
    wait_for(a_ready)
    b = run_engine(
        {
            "model": model,
            "connector": connector(tmp_path, key_namespace=ns, lookup_instance="b"),
            "steps": [{"generate": ps}],
        }
    )
    b_done.write_text("done")
    ra = finish(a)
    assert b["steps"][0][0]["cached"] == 0, "engine b must not see engine a's pool"
    assert ra["steps"][4][0]["cached"] > 0, "engine a restores its own blocks"
    assert b["steps"][0][0]["tokens"] == ra["steps"][0][0]["tokens"]


def test_tensor_parallel_2_hits_only_when_both_ranks_hold_the_block(model, tmp_path):
    ps = prompts(2, shared=0, seed=4)
    ns = "tp2"
    stored, cleared = tmp_path / "stored", tmp_path / "cleared"
    proc = run_engine(
        {
            "model": model,
            "tp": 2,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            "connector": connector(tmp_path, key_namespace=ns),
            "steps": [
                {"generate": ps},
                {"reset": False},
                {"generate": ps[:1]},  # both ranks hold prompt 0: restored
                {"signal": str(stored)},
                {"wait_for": str(cleared)},
                {"reset": False},
                {"generate": ps},  # rank 1 lost everything: no hits
            ],
        },
        background=True,
        timeout=600,
    )
    wait_for(stored, timeout=600)
    tag = socket_tag(ns, "")
    sockets = [umbp.socket_path(socket_dir(tmp_path), tag, 0, w) for w in range(2)]
    assert all(Path(s).exists() for s in sockets), "one lookup socket per worker"
    stats = describe(tmp_path, ns, workers=2)
    assert all(int(s["objects"]) > 0 for s in stats), stats
    assert umbp.LookupClient(sockets[1:], 2000).clear() > 0
    cleared.write_text("go")
    r = finish(proc, timeout=600)
    first, _, restored, _, _, _, after = r["steps"]
    assert restored[0]["cached"] > 0
    assert restored[0]["tokens"] == first[0]["tokens"]
    assert all(o["cached"] == 0 for o in after), after
    assert [o["tokens"] for o in after] == [o["tokens"] for o in first]


def test_invalid_options_fail_engine_startup(model, tmp_path):
    r = run_engine(
        {
            "model": model,
            "connector": connector(tmp_path, capacity_bytes=1 << 30),  # both capacities
            "steps": [],
        }
    )
    assert "startup_error" in r, r
    out = r["output"]
    assert (
        "ConfigError" in out and "`capacity_bytes` and `total_capacity_bytes` are exclusive" in out
    ), out[-3000:]


def test_kv_events_report_stores_and_evictions(model, tmp_path):
    ps = prompts(6, shared=0, seed=5)
    cfg = connector(tmp_path, key_namespace="events")
    cfg.pop("total_capacity_bytes")
    cfg["capacity_bytes"] = 1 << 20
    r = run_engine(
        {
            "model": model,
            "connector": cfg,
            "kv_events": f"ipc://{tmp_path}/events.sock",
            "steps": [{"generate": ps[:1]}, {"events": 2.0}, {"generate": ps[1:]}, {"events": 3.0}],
        }
    )
    after_first, after_all = r["steps"][1], r["steps"][3]
    assert any(e["type"] == "BlockStored" for e in after_first), after_first
    assert any(e["type"] == "BlockRemoved" for e in after_all), after_all


class PrefixIndex:
    """What a KV-aware router builds from an engine's KV events: stored blocks by hash, each
    with its parent and tokens; a prompt's cached prefix is the chain of blocks whose tokens
    are the prompt's, block by block, each the child of the one before."""

    def __init__(self) -> None:
        self.blocks: dict[str, tuple[str | None, tuple[int, ...]]] = {}

    def feed(self, events: list[dict]) -> None:
        for e in events:
            if e["type"] == "BlockStored":
                bs, parent = e["block_size"], e["parent"]
                assert len(e["tokens"]) == bs * e["n"], e  # every block describes itself
                for i, h in enumerate(e["hashes"]):
                    self.blocks[h] = (parent, tuple(e["tokens"][i * bs : (i + 1) * bs]))
                    parent = h
            else:
                for h in e["hashes"]:
                    self.blocks.pop(h, None)

    def cached_blocks(self, prompt: list[int], bs: int) -> int:
        children: dict[tuple[str | None, tuple[int, ...]], str] = {
            v: h for h, v in self.blocks.items()
        }
        parent, n = None, 0
        for k in range(len(prompt) // bs):
            h = children.get((parent, tuple(prompt[k * bs : (k + 1) * bs])))
            if h is None:
                break
            parent, n = h, n + 1
        return n


def test_self_describing_events_let_a_router_index_umbp_prefixes(model, tmp_path):
    """`self_describing_kv_events`: a router that indexes the pool's events by tokens and
    parents finds every prompt's stored prefix, and drops what the pool evicted; with the
    option off the events are the hash-only ones they were."""
    # Two prompts sharing a prefix, then four of their own (8 blocks of 128 KiB each): a pool
    # of four 1 MiB segments holds about four prompts' blocks, so the last ones evict the
    # first, segment by segment, and keep the newest.
    ps = prompts(2, shared=400, seed=9) + prompts(4, shared=0, seed=10)
    cfg = connector(tmp_path, key_namespace="router", self_describing_kv_events=True)
    cfg.pop("total_capacity_bytes")
    cfg["capacity_bytes"] = 4 << 20
    r = run_engine(
        {
            "model": model,
            "connector": cfg,
            "kv_events": f"ipc://{tmp_path}/events.sock",
            "steps": [
                {"generate": ps[:2]},
                {"events": 2.0},
                {"generate": ps[2:]},
                {"events": 3.0},
            ],
        }
    )
    first, early, later, final = r["steps"]
    bs = next(e["block_size"] for e in early if e["type"] == "BlockStored")
    index = PrefixIndex()
    index.feed(early)
    for o in first:  # every full prompt block of both prompts, shared prefix included
        assert index.cached_blocks(o["prompt_ids"], bs) == len(o["prompt_ids"]) // bs
    index = PrefixIndex()
    index.feed(final)  # every event so far, removals included
    assert any(e["type"] == "BlockRemoved" for e in final), "the small pool evicted nothing"
    for o in later[-1:]:  # the newest prompt is held
        assert index.cached_blocks(o["prompt_ids"], bs) == len(o["prompt_ids"]) // bs
    # Every removal names a block the events stored before it, and the index keeps the rest.
    stored: set[str] = set()
    for e in final:
        if e["type"] == "BlockStored":
            stored.update(e["hashes"])
        else:
            assert set(e["hashes"]) <= stored, e
            stored -= set(e["hashes"])
    assert set(index.blocks) == stored and stored

    off = connector(tmp_path, key_namespace="router-off", lookup_instance="off")
    r = run_engine(
        {
            "model": model,
            "connector": off,
            "kv_events": f"ipc://{tmp_path}/events-off.sock",
            "steps": [{"generate": ps[:1]}, {"events": 2.0}],
        }
    )
    stored = [e for e in r["steps"][1] if e["type"] == "BlockStored"]
    assert stored and all(e["tokens"] == [] and e["parent"] is None for e in stored), stored


def test_data_parallel_2_engines_get_distinct_sockets_and_both_restore(model, tmp_path):
    """`vllm serve --data-parallel-size 2`: two engines of a dense model on one node. vLLM
    resets their data_parallel_rank to 0; the sockets must still differ (the DP index)."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading
    import time
    import urllib.request

    from conftest import ENV

    ns = "dp2"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ktc = {
        "kv_connector": "UMBPStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector(tmp_path, key_namespace=ns),
    }
    cmd = [
        str(Path(sys.executable).parent / "vllm"),
        "serve",
        model,
        "--port",
        str(port),
        "--data-parallel-size",
        "2",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "8192",
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(ktc),
    ]
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_SERVER_DEV_MODE": "1"}
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 (closed in finally)
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"

    def post(path: str, body: dict | None = None) -> dict:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            base + path, data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
        return json.loads(text) if text.strip().startswith("{") else {}

    def both(prompt: str) -> list[dict]:
        """The same prompt twice at once: vLLM's DP balancer gives one to each engine."""
        out: list[dict] = [{}, {}]

        def one(i: int) -> None:
            out[i] = post(
                "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            )

        ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.time() < deadline, "vllm serve never became healthy"
            try:
                with urllib.request.urlopen(base + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(1)
        tag = socket_tag(ns, "")
        sockets = [umbp.socket_path(socket_dir(tmp_path), tag, dp, 0) for dp in range(2)]
        assert all(Path(s).exists() for s in sockets), sockets
        prompt = prompts(1, seed=7)[0]
        first = both(prompt)
        for s in sockets:  # every engine stored the prompt's blocks in its own pool
            d = umbp.LookupClient([s], 2000).wait_ready(5000)[0]
            assert int(dict(kv.split("=") for kv in d.split() if "=" in kv)["objects"]) > 0, d
        post("/reset_prefix_cache")  # vLLM's own caches only
        again = both(prompt)
        for o in again:
            assert o["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
        texts = {o["choices"][0]["text"] for o in first + again}
        assert len(texts) == 1, texts
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            time.sleep(1)
        log.close()


def test_hybrid_model_two_groups_restore_and_outputs_stay_identical(hybrid_model, tmp_path):
    """A model with sliding-window and full-attention layers (two KV cache groups, vLLM's
    hybrid allocator): prompts far longer than the window are stored in both groups, restored
    from UMBP after vLLM's prefix cache is reset, and give the outputs of a run without UMBP."""
    p1, p2 = prompts(2, seed=8)  # p2 shares p1's first 600 tokens (4 blocks)
    p1_longer = p1 + prompts(1, length=300, shared=0, seed=9)[0]  # p1's 8 blocks, then 2 more
    ps = [p1, p1_longer, p2]
    ref = reference(hybrid_model, {"ps": ps})["ps"]
    ns = "hybrid"
    stored, counted = tmp_path / "stored", tmp_path / "counted"
    proc = run_engine(
        {
            "model": hybrid_model,
            "connector": connector(tmp_path, key_namespace=ns),
            "steps": [
                {"generate": ps},
                {"signal": str(stored)},
                {"wait_for": str(counted)},
                {"reset": False},  # vLLM's own prefix cache only
                {"generate": ps[::-1]},
            ],
        },
        background=True,
    )
    wait_for(stored)
    objects = int(describe(tmp_path, ns)[0]["objects"])
    counted.write_text("go")
    r = finish(proc)
    first, restored = r["steps"][0], r["steps"][4][::-1]
    assert_as_reference(first, ref, "computed")
    assert_as_reference(restored, ref, "restored")
    # Every full prompt block of every prompt (8 + 2 + 4 distinct), once per group. p1_longer
    # starts with vLLM's own hit on p1, where the sliding-window group's blocks outside the
    # window are null blocks: its own two blocks must still be stored in that group.
    assert objects == 2 * 14, objects
    for o in restored:
        assert o["cached"] == (o["prompt_tokens"] - 1) // BLOCK * BLOCK, restored


#: Hybrid models with recurrent-state groups: (fixture, tokens per block as vLLM CPU sizes it,
#: engine settings). vLLM CPU 0.32's Mamba2 chunk scan returns no intermediate states, which
#: align mode reads when one step spans several blocks: steps of one block there. The block
#: size follows from the state's size (an attention page must hold it), so the SSM state's
#: dtype is set, not left to defaults ("auto" follows the model's bf16: blocks of 256 tokens
#: for Mamba2, 128 for GDN).
HYBRIDS = {
    "gdn": ("gdn_model", 256, {"mamba_ssm_cache_dtype": "float32"}),
    "mamba2": (
        "mamba2_model",
        384,
        {"max_num_batched_tokens": 384, "mamba_ssm_cache_dtype": "float32"},
    ),
}


@pytest.mark.parametrize(
    "kind, mode, tp",
    [
        ("gdn", "embedded", 1),
        ("gdn", "standalone", 1),
        ("gdn", "embedded", 2),
        ("mamba2", "embedded", 1),
    ],
)
def test_hybrid_state_models_restore_with_identical_outputs(request, tmp_path, kind, mode, tp):
    """Issue 31: gated-delta-net and Mamba2 hybrids (three state groups, one attention group)
    in vLLM's `align` mode. Attention blocks are stored by position, each state group's state
    only where vLLM hands it over; after vLLM's own prefix cache is reset every prompt restores
    as much as vLLM's own prefix cache hits (the last boundary with state in every group), and
    the outputs are those of an engine that computes everything."""
    fixture, block, settings = HYBRIDS[kind]
    model = request.getfixturevalue(fixture)
    engine = {"model": model, "tp": tp, **settings}
    if tp > 1:
        engine["env"] = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per worker
    p1, p2 = prompts(2, seed=21)  # 1100 tokens each, sharing their first 600
    p1_longer = p1 + prompts(1, length=400, shared=0, seed=22)[0]  # vLLM's own hit on p1 first
    ps = [p1, p1_longer, p2]
    # The baseline computes every prompt (no restores), then runs them again: vLLM's own
    # prefix cache hits in the second pass are what a restore must match.
    base = run_engine(
        {**engine, "connector": COMPUTED, "steps": [{"generate": ps}, {"generate": ps[::-1]}]},
        timeout=600,
    )
    assert "steps" in base, base
    with contextlib.ExitStack() as stack:
        if mode == "standalone":
            server = stack.enter_context(running(tmp_path.name, capacity="256MiB"))
            cfg = {"mode": "standalone", "endpoint": f"unix://{server.endpoint}"}
        else:
            cfg = connector(tmp_path, key_namespace=f"hybrid-{kind}")
        r = run_engine(
            {
                **engine,
                "connector": cfg,
                "steps": [
                    {"generate": ps},
                    {"reset": False},  # vLLM's own prefix cache only
                    {"generate": ps[::-1]},
                ],
            },
            timeout=600,
        )
    assert "steps" in r, r
    assert len(r["steps"]) == 3, r["output"][-8000:]  # what the engine said when it died
    first, restored = r["steps"][0], r["steps"][2][::-1]
    ref = {"cold": base["steps"][0], "own": base["steps"][1][::-1]}
    assert_as_reference(first, ref, "computed")
    assert_as_reference(restored, ref, "restored", state_hybrid=True)
    own = [o["cached"] for o in ref["own"]]
    got = [o["cached"] for o in restored]
    ms = lambda run: [round(o["seconds"] * 1000) for o in run]  # noqa: E731
    print(
        f"{kind} hybrid, {mode}, TP {tp}: prompt tokens {[o['prompt_tokens'] for o in restored]}, "
        f"restored {got}, vLLM's own hits {own}; ms computed {ms(first)} restored "
        f"{ms(restored)}"
    )
    assert got == own and all(n > 0 and n % block == 0 for n in got), (got, own)


def test_state_evicted_behind_the_engines_back_shrinks_the_hit(mamba2_model, tmp_path):
    """Issue 31: the pool evicts each group's objects on its own, so the state at a prefix's
    longest boundary can be gone while its attention blocks stay. Here it is evicted in one of
    the three state groups behind the engine's back: the hit shrinks to the last boundary every
    group still holds (never a hit with missing state), and the outputs stay those of an
    engine that computes everything."""
    _, block, settings = HYBRIDS["mamba2"]
    engine = {
        "model": mamba2_model,
        **settings,
        "env": {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},  # collective_rpc of a function
    }
    # vLLM hands over the state at a prompt's last block boundary: a 500-token prefix of p1
    # leaves it after 384 tokens, p1 (1100 tokens) after 768.
    (p1,) = prompts(1, seed=23)
    head = p1[:500]
    # The reference: p1 computed after the head's state (one block) from vLLM's own prefix
    # cache, the hit the restore below shrinks to.
    base = run_engine(
        {**engine, "connector": COMPUTED, "steps": [{"generate": [head]}, {"generate": [p1]}]}
    )
    assert "steps" in base, base
    own = base["steps"][1][0]
    assert own["cached"] == block, own
    evict = {"prompt": p1, "tokens": 2 * block, "state_group": 1}
    r = run_engine(
        {
            **engine,
            "connector": connector(tmp_path, key_namespace="hybrid-evict"),
            "steps": [
                {"generate": [head, p1]},
                {"evict_state": evict},
                {"reset": False},  # vLLM's own prefix cache only
                {"generate": [p1]},
            ],
        },
        timeout=600,
    )
    assert "steps" in r and "error" not in r, r.get("output", r)[-6000:]
    [ev] = r["steps"][1]  # one worker
    restored = r["steps"][3][0]
    print(
        f"state after {2 * block} tokens evicted in one of 3 state groups: {ev}; "
        f"restored {restored['cached']} of {restored['prompt_tokens']} tokens"
    )
    assert ev["before"] == [block, 2 * block], ev
    assert (ev["evicted"], ev["after"]) == (1, [block]), ev
    assert restored["cached"] == block, restored
    assert restored["tokens"] == own["tokens"]


def test_lazy_offload_keeps_storing_over_a_long_run(model, tmp_path):
    """Issue 30 item 7: with `lazy_offload`, blocks are stored as they come up for eviction,
    not after every step. Twelve distinct prompts run one after another in an engine whose
    cache holds four of them, each evicting earlier ones; each step scans 16 blocks of vLLM's
    free queue (the default, twice a step's 1,024 tokens), fewer than the cache's 40. Every
    prompt's blocks must be stored before vLLM evicts them, so after vLLM's own cache is
    dropped each of the first eight (evicted by later ones) restores all its full blocks from
    UMBP, with the outputs of an engine that computes everything. The last four were still in
    vLLM's cache when it was dropped: lazily, nothing made them due for storing."""
    ps = prompts(12, shared=0, seed=30)  # 1100 tokens each: 9 blocks of 128, 8 of them full
    engine = {
        "model": model,
        "num_gpu_blocks_override": 40,
        "max_model_len": 2048,
        "max_num_batched_tokens": 1024,
    }
    # The reference engine's cache holds every prompt, so its second pass hits vLLM's own
    # prefix cache for each: what a full restore must give (the cache's size changes which
    # blocks are used, not what is computed).
    settings = {k: v for k, v in engine.items() if k not in ("model", "num_gpu_blocks_override")}
    ref = reference(model, {"ps": ps}, **settings)["ps"]
    r = run_engine(
        {
            **engine,
            "connector": connector(tmp_path, lazy_offload=True),
            "steps": [{"generate": ps}, {"reset": False}, {"generate": ps}],
        },
        timeout=600,
    )
    assert "steps" in r and "error" not in r, r.get("output", r)[-6000:]
    first, restored = r["steps"][0], r["steps"][2]
    cached = [o["cached"] for o in restored]
    print(f"lazy offload, 12 prompts in a 40-block cache: restored {cached}")
    assert_as_reference(first, ref, "computed")
    assert_as_reference(restored, ref, "restored")
    full = [(o["prompt_tokens"] - 1) // BLOCK * BLOCK for o in restored]
    assert cached[:8] == full[:8], cached


def test_a_killed_worker_leaves_no_socket_behind(model, tmp_path):
    """A worker removes its socket when it shuts down; one killed outright (vLLM's forced kill
    of workers that do not stop in time, the OOM killer) cannot. vLLM then stops the engine,
    and the scheduler side, shut down after the workers, removes the sockets nobody serves."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    engine = run_engine(
        {
            "model": model,
            "connector": connector(tmp_path),
            "steps": [
                {"generate": prompts(1)},
                {"signal": str(ready)},
                {"wait_for": str(go)},
                {"generate": prompts(1, seed=1)},
            ],
        },
        background=True,
    )
    try:
        wait_for(ready)
        (sock,) = socket_dir(tmp_path).glob("*.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(sock))
            cred = c.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        worker_pid = struct.unpack("3i", cred)[0]
        assert worker_pid not in (0, engine.pid)
        os.kill(worker_pid, signal.SIGKILL)
        # vLLM notices the dead worker and shuts the engine down.
        deadline = time.monotonic() + 120
        while sock.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not sock.exists(), f"{sock} was left behind by the killed worker"
    finally:
        go.write_text("go")
        finish(engine)
