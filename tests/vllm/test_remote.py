"""The remote tier on real vLLM CPU engines: engines with separate embedded pools (each engine
stands in for a node) and one real three-node Redis cluster (tests/redis_cluster.py). One
engine computes; the others start with empty pools and restore from the cluster, also when an
object is corrupted or a cluster node is stopped (the tests run in this order: the last one
corrupts every object)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from conftest import assert_as_reference, finish, prompts, reference, run_engine, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_cluster import redis_cluster  # noqa: E402

BLOCK = 128  # vLLM CPU's default block size

PROMPTS = {
    "shared": prompts(3, seed=40),
    "own": prompts(3, shared=0, seed=41),
}


def full_blocks(o: dict) -> int:
    return (o["prompt_tokens"] - 1) // BLOCK * BLOCK


def remote(cluster, **extra) -> dict:
    # Generous: the engine, three Redis nodes and the test share 2 cores.
    return {
        "total_capacity_bytes": 64 << 20,
        "remote_url": cluster.url,
        "remote_timeout_ms": 3000,
        **extra,
    }


@pytest.fixture(scope="module")
def cluster():
    with redis_cluster(3) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(model):
    """Each prompt set computed and then from vLLM's own prefix cache (conftest.reference)."""
    ref = reference(model, PROMPTS)
    assert ref["block_size"] == BLOCK, f"this engine's blocks are {ref['block_size']} tokens"
    return ref


def settled_keys(cluster, settle: float = 1.5, timeout: float = 120) -> int:
    """Waits until the cluster holds objects and their number stops changing."""
    deadline = time.monotonic() + timeout
    last, since = -1, time.monotonic()
    while True:
        n = len(cluster.keys())
        if n != last:
            last, since = n, time.monotonic()
        elif n > 0 and time.monotonic() - since >= settle:
            return n
        assert time.monotonic() < deadline, f"the cluster's objects never settled ({n})"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def node_a(model, cluster, tmp_path_factory, baseline):
    """Engine A computes every prompt set and stays up until its writes are in the cluster."""
    d = tmp_path_factory.mktemp("node-a")
    stored, go = d / "stored", d / "go"
    proc = run_engine(
        {
            "model": model,
            "connector": remote(cluster),
            "steps": [
                {"generate": PROMPTS["shared"]},
                {"generate": PROMPTS["own"]},
                {"reset": False},  # waits for A's stores into its pool
                {"signal": str(stored)},
                {"wait_for": str(go)},
            ],
        },
        background=True,
    )
    while not stored.exists():
        if proc.poll() is not None:  # it failed before computing: show why
            r = finish(proc)
            raise AssertionError(r.get("startup_error") or r["output"][-4000:])
        time.sleep(0.2)
    n = settled_keys(cluster)
    go.write_text("go")
    r = finish(proc)
    assert "error" not in r, r.get("error")
    assert_as_reference(r["steps"][0], baseline["shared"], "A shared")
    assert_as_reference(r["steps"][1], baseline["own"], "A own")
    print(f"engine A wrote {n} objects to the cluster")
    return n


def test_another_engine_restores_every_full_block_from_the_remote_tier(
    model, cluster, node_a, baseline
):
    r = run_engine(
        {"model": model, "connector": remote(cluster), "steps": [{"generate": PROMPTS["shared"]}]}
    )
    assert "error" not in r, r.get("error")
    run = r["steps"][0]
    assert_as_reference(run, baseline["shared"], "restored from the remote tier")
    assert [o["cached"] for o in run] == [full_blocks(o) for o in run], run
    print("B restored from the cluster:", [(o["cached"], round(o["seconds"], 3)) for o in run])


def test_a_stopped_cluster_node_means_misses_within_the_timeout(model, cluster, node_a, baseline):
    victim = 0
    cluster.stop_node(victim)
    try:
        r = run_engine(
            {
                "model": model,
                "connector": remote(cluster, remote_timeout_ms=300),
                "steps": [{"generate": PROMPTS["shared"]}],
            }
        )
    finally:
        cluster.resume_node(victim)
    assert "error" not in r, r.get("error")
    run = r["steps"][0]
    assert_as_reference(run, baseline["shared"], "with a stopped node")
    cached, full = [o["cached"] for o in run], [full_blocks(o) for o in run]
    print(
        "with a stopped node:",
        [(c, f, round(o["seconds"], 3)) for c, f, o in zip(cached, full, run)],
    )
    # A third of the slots is unreachable: these prompts' blocks are not all restored.
    assert sum(cached) < sum(full), (cached, full)
    # Nothing waits longer than the timeout per lookup (and the back-off after it).
    assert all(o["seconds"] < 20 for o in run), run


def test_corrupted_remote_objects_are_misses(model, cluster, node_a, baseline):
    # Flip one payload byte of every object, as an operator with redis-cli could: lengths and
    # headers stay, only the checksums disagree.
    names = cluster.keys()
    assert len(names) == node_a
    for k in names:
        assert cluster.cli(cluster.ports[0], "setrange", k, "200", "X").strip().isdigit()
    r = run_engine(
        {"model": model, "connector": remote(cluster), "steps": [{"generate": PROMPTS["own"]}]}
    )
    assert "error" not in r, r.get("error")
    run = r["steps"][0]
    assert tokens(run) == tokens(baseline["own"]["cold"]), "wrong KV restored"
    assert all(o["cached"] == 0 for o in run), [o["cached"] for o in run]
