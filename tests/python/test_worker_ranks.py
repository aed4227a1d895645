"""A worker finds its ranks in vLLM's parallel groups, or refuses to start: it never assumes
rank 0 (with a shared pool, rank 0's keys on another rank's worker would serve that rank's KV
to the wrong rank)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("vllm")

from vllm.distributed import parallel_state as ps  # noqa: E402

from umbp.vllm.topology import Ranks, Topology  # noqa: E402
from umbp.vllm.worker import local_ranks  # noqa: E402


def topo(tp=1, pcp=1, dcp=1, namespace="ns") -> Topology:
    return Topology(
        namespace=namespace,
        tag="t",
        tp_size=tp,
        pcp_size=pcp,
        dcp_size=dcp,
        dp_rank=0,
        block_size=16,
        num_groups=1,
    )


def group(rank: int, world: int):
    return lambda: types.SimpleNamespace(rank_in_group=rank, world_size=world)


def test_uninitialised_groups_are_an_error_naming_the_group():
    # This test process never initialised vLLM's distributed state (as a worker side created
    # outside a vLLM worker would find it): even a one-worker topology is refused.
    with pytest.raises(RuntimeError) as e:
        local_ranks(topo())
    msg = str(e.value)
    assert "tensor parallel rank" in msg and "get_tp_group()" in msg, msg
    assert "rank 0" in msg, msg


def test_each_missing_group_is_named(monkeypatch):
    monkeypatch.setattr(ps, "get_tp_group", group(1, 2))

    def not_initialised():
        raise AssertionError("decode context parallel group is not initialized")

    monkeypatch.setattr(ps, "get_pcp_group", group(0, 1))
    monkeypatch.setattr(ps, "get_dcp_group", not_initialised)
    with pytest.raises(RuntimeError, match=r"decode context parallel rank.*get_dcp_group\(\)"):
        local_ranks(topo(tp=2))
    monkeypatch.delattr(ps, "get_pcp_group")
    with pytest.raises(
        RuntimeError, match="has no `vllm.distributed.parallel_state.get_pcp_group`"
    ):
        local_ranks(topo(tp=2))


def test_ranks_come_from_the_groups_and_must_fit_the_topology(monkeypatch):
    monkeypatch.setattr(ps, "get_tp_group", group(1, 2))
    monkeypatch.setattr(ps, "get_pcp_group", group(1, 2))
    monkeypatch.setattr(ps, "get_dcp_group", group(0, 1))
    t = topo(tp=2, pcp=2)
    r = local_ranks(t)
    assert r == Ranks(tp=1, pcp=1, dcp=0)
    assert r.worker(t) == 3
    # A group of another size than the configuration says: the keys would not match.
    with pytest.raises(RuntimeError, match="tp_size=4"):
        local_ranks(topo(tp=4, pcp=2))
