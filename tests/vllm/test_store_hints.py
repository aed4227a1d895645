"""Per-request store hints (issue 34): a request's vLLM `priority` against
`store_priority_skip_above` / `store_priority_admit_at_most`, and its `kv_transfer_params`'
`umbp_store`, decided by the connector's scheduler over vLLM's own `Request`,
`SchedulerOutput` and `BlockPool`, and carried out by its worker into a real pool (embedded) or
a real `umbp_standalone_server` (standalone).
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
from pathlib import Path

import pytest
import test_shapes as shapes
import torch
from test_shapes import BS, Engine, _new_req, full, kv_config, matched, vllm_config
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from conftest import prompts, run_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from standalone_server import running  # noqa: E402

# test_shapes' fixtures: its tiny model's config, and vLLM's parallel groups of one worker.
model_config = shapes.model_config
parallel_groups = shapes.parallel_groups

BLOCKS = 3


def request(e: Engine, rid: str, seed: int, priority: int = 0, params=None) -> Request:
    tokens = [(seed * 7919 + i) % 251 + 1 for i in range(BLOCKS * BS + 1)]
    extra = None if params is None else {"kv_transfer_params": params}
    sp = SamplingParams(max_tokens=1, extra_args=extra)
    return Request(rid, tokens, sp, None, priority=priority, block_hasher=e.hasher)


def schedule(e: Engine, req: Request, first_block: int):
    """The request's first step: its prompt computed into blocks `first_block`.. (all its
    full blocks); the metadata the scheduler builds for it."""
    assert matched(e, req)[0] == 0
    so = SchedulerOutput.make_empty()
    ids = list(range(first_block, first_block + BLOCKS + 1))
    so.scheduled_new_reqs = [_new_req(req, (ids,))]
    so.num_scheduled_tokens = {req.request_id: req.num_tokens}
    return e.sched.build_connector_meta(so)


def store(e: Engine, meta) -> list[str]:
    """The worker's stores of `meta`, waited for: every block's status."""
    e.worker.bind_connector_metadata(meta)
    e.worker.wait_for_save()
    jobs = e.worker._worker.stores
    statuses = [s for t in meta.stores for s in jobs[t.store_id].wait(10_000)]
    e.worker.clear_connector_metadata()
    return statuses


def held(e: Engine, req: Request) -> list[bool]:
    w = e.worker._worker
    return w.store.exists(w.keys.keys(0, list(req.block_hashes[:BLOCKS])))


def counters(e: Engine) -> dict:
    s = e.sched.get_kv_connector_stats()
    return {} if s is None else dict(s.data["c"])


def test_priority_above_the_skip_threshold_stores_nothing_and_still_restores(
    model_config, tmp_path
):
    vc = vllm_config(model_config, tmp_path, store_priority_skip_above=5)
    e = Engine(vc, kv_config((["attn.0"], full())))
    try:
        batch = request(e, "batch", seed=1, priority=9)
        meta = schedule(e, batch, first_block=1)
        assert meta.stores == []
        assert counters(e).get("store_hint_skipped_blocks") == BLOCKS
        assert held(e, batch) == [False] * BLOCKS
        # At the threshold: stored as usual (store_admission "all").
        normal = request(e, "normal", seed=2, priority=5)
        meta = schedule(e, normal, first_block=5)
        assert [(t.admit_now, len(t.block_ids)) for t in meta.stores] == [(False, BLOCKS)]
        assert store(e, meta) == ["done"] * BLOCKS
        # A skipped request's loads still happen: the same prompt at priority 9 hits.
        again = request(e, "batch-again", seed=2, priority=9)
        assert matched(e, again)[0] == BLOCKS * BS
    finally:
        e.close()


def test_admit_now_under_on_reuse_stores_on_first_sighting(model_config, tmp_path):
    vc = vllm_config(
        model_config, tmp_path, store_admission="on_reuse", store_priority_admit_at_most=0
    )
    e = Engine(vc, kv_config((["attn.0"], full())))
    try:
        urgent = request(e, "urgent", seed=3, priority=-1)
        meta = schedule(e, urgent, first_block=1)
        assert [t.admit_now for t in meta.stores] == [True]
        assert store(e, meta) == ["done"] * BLOCKS
        assert held(e, urgent) == [True] * BLOCKS
        # Above the threshold the pool's on_reuse admission decides: the first sighting is
        # skipped (the lookup's first missing key counts as seen, the others do not).
        later = request(e, "later", seed=4, priority=1)
        meta = schedule(e, later, first_block=5)
        assert [t.admit_now for t in meta.stores] == [False]
        assert store(e, meta) == ["done"] + ["skipped"] * (BLOCKS - 1)
        assert counters(e).get("store_hint_now_blocks") == BLOCKS
        # "urgent"'s lookup had made its first block seen: two first sightings were forced.
        st = e.worker._worker.store.stats()
        assert st["admissions_forced"] == BLOCKS - 1, st
    finally:
        e.close()


@pytest.mark.parametrize(
    ("priority", "params", "planned"),
    [
        (9, {"umbp_store": "now"}, [True]),  # over the skip threshold, asked to store now
        (-5, {"umbp_store": "skip"}, []),  # under the admit threshold, asked to skip
        (9, {"umbp_store": "default"}, [False]),  # as the pool says, whatever the priority
        (-5, {"umbp_store": "default"}, [False]),
        (9, {"other": 1}, []),  # no hint: the priority decides
    ],
)
def test_kv_transfer_params_override_the_priority(
    model_config, tmp_path, priority, params, planned
):
    vc = vllm_config(
        model_config,
        tmp_path,
        store_admission="on_reuse",
        store_priority_skip_above=5,
        store_priority_admit_at_most=0,
    )
    e = Engine(vc, kv_config((["attn.0"], full())))
    try:
        req = request(e, "r", seed=5, priority=priority, params=params)
        meta = schedule(e, req, first_block=1)
        assert [t.admit_now for t in meta.stores] == planned
        skipped = counters(e).get("store_hint_skipped_blocks", 0)
        assert skipped == (BLOCKS if planned == [] else 0)
        statuses = store(e, meta)
        if planned == [True]:
            assert statuses == ["done"] * BLOCKS
    finally:
        e.close()


def test_a_bad_hint_is_warned_about_once_and_ignored(model_config, tmp_path, caplog):
    vc = vllm_config(model_config, tmp_path, store_priority_skip_above=5)
    e = Engine(vc, kv_config((["attn.0"], full())))
    try:
        caplog.set_level(logging.WARNING, logger="umbp.vllm")
        metas = [
            schedule(e, request(e, f"r{i}", seed=10 + i, priority=p, params=params), 1 + 4 * i)
            for i, (p, params) in enumerate(
                [(0, {"umbp_store": "later"}), (9, {"umbp_store": "later"}), (0, {"umbp_store": 3})]
            )
        ]
        # Ignored: the priority decides (stored, skipped above 5, stored).
        assert [len(m.stores) for m in metas] == [1, 0, 1]
        warned = [r.getMessage() for r in caplog.records if "umbp_store" in r.getMessage()]
        assert len(warned) == 2, warned  # "later" once, 3 once
        assert "'later' is not one of 'default', 'now', 'skip'" in warned[0], warned
    finally:
        e.close()


def test_standalone_admit_now_passes_the_servers_on_reuse(model_config, tmp_path):
    """Standalone mode: the scheduler's "now" travels with the store to the server, whose
    `--store-admission on_reuse` keeps it on first sighting; priority above the skip
    threshold sends nothing."""
    with running(tmp_path.name, extra_args=["--store-admission", "on_reuse"]) as srv:
        vc = vllm_config(
            model_config,
            tmp_path,
            mode="standalone",
            endpoint=srv.endpoint,
            store_priority_admit_at_most=0,
            store_priority_skip_above=5,
        )
        # The server maps the KV cache's pages: a mapping of its own, as vLLM's allocation
        # is. An explicit private anonymous mapping (Python's default is MAP_SHARED, which has
        # no descriptor to share): a large torch.zeros can come from the heap of an allocator
        # the process preloads (vLLM CPU's tcmalloc), which registration refuses.
        kc = kv_config((["attn.0"], full()))
        shape = (kc.num_blocks, 2, BS, 2, 32)
        mapping = mmap.mmap(-1, 40 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        room = torch.frombuffer(mapping, dtype=torch.uint8)
        cache = room[: math.prod(shape) * 2].view(torch.bfloat16).view(shape)
        e = Engine(vc, kc, caches={"attn.0": cache})
        try:
            urgent = request(e, "urgent", seed=20, priority=0)
            meta = schedule(e, urgent, first_block=1)
            assert [t.admit_now for t in meta.stores] == [True]
            assert store(e, meta) == ["done"] * BLOCKS
            batch = request(e, "batch", seed=21, priority=6)
            assert schedule(e, batch, first_block=5).stores == []
            assert e.worker._worker.store.client.stats()["objects"] == BLOCKS
            c = counters(e)
            assert (c.get("store_hint_now_blocks"), c.get("store_hint_skipped_blocks")) == (
                BLOCKS,
                BLOCKS,
            )
            # Restored from the server on its second run.
            again = request(e, "urgent-again", seed=20, priority=3)
            assert matched(e, again)[0] == BLOCKS * BS
        finally:
            e.close()


def test_a_real_engine_stores_by_priority_under_on_reuse(model, tmp_path):
    """vLLM CPU with `--scheduling-policy priority` and `store_admission: on_reuse`: the
    priority-0 prompt is kept on its first run and restored on its second; the priority-9 one
    (a batch job) is never stored; the priority-3 one gets on_reuse as it is (its first block,
    which its lookup made seen). A `kv_transfer_params` "skip" wins over priority 0."""
    block = 128  # vLLM CPU's default block size
    a, b, c, d = prompts(4, length=700, shared=0, seed=34)
    run = [
        {"prompt": a, "priority": 0},
        {"prompt": b, "priority": 9},
        {"prompt": c, "priority": 3},
        {"prompt": d, "priority": 0, "kv_transfer_params": {"umbp_store": "skip"}},
    ]
    r = run_engine(
        {
            "model": model,
            "scheduling_policy": "priority",
            "log_stats": True,
            "module_path": True,  # also where the package is not installed (no entry point)
            "connector": {
                "mode": "embedded",
                "total_capacity_bytes": 64 << 20,
                "lookup_dir": str(tmp_path),
                "dram_prefault": False,
                "store_admission": "on_reuse",
                "store_priority_admit_at_most": 0,
                "store_priority_skip_above": 5,
            },
            "steps": [{"generate": run}, {"reset": False}, {"generate": run}, {"metrics": True}],
        }
    )
    assert "steps" in r and "error" not in r, r
    first, _, second, metrics = r["steps"]
    full = [o["prompt_tokens"] // block for o in first]
    cached = [o["cached"] for o in second]
    assert cached[0] == ((first[0]["prompt_tokens"] - 1) // block) * block, cached
    assert cached[1] == 0 and cached[3] == 0, cached
    assert cached[2] == block, cached
    assert metrics.get("vllm:umbp_store_hint_now_blocks") == full[0], metrics
    # b and d on both runs.
    assert metrics.get("vllm:umbp_store_hint_skipped_blocks") == 2 * (full[1] + full[3]), metrics
