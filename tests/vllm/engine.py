"""Runs one real vLLM CPU engine through a scenario and prints the results as JSON.

Used by the tests through `run_engine()` (conftest.py), which starts it in its own process
session and kills the whole group afterwards (vLLM's helper processes can outlive it).

    python engine.py '<scenario json>'

Scenario keys: model, max_model_len, max_num_batched_tokens, mamba_ssm_cache_dtype,
scheduling_policy,
num_gpu_blocks_override (vLLM's KV cache size in blocks), attention_backend (vLLM's name of one,
e.g. CPU_MLA), connector (kv_connector_extra_config,
or null for no connector), kv_role, module_path (use kv_connector_module_path instead of the
plugin), tp, max_tokens, kv_events (an ipc:// endpoint to publish KV events to), log_stats
(vLLM's stat logging on, for the "metrics" step), steps: a list of {"generate": [prompt, ...]}
(a prompt may be {"prompt": text, "priority": n, "kv_transfer_params": {...}}),
{"reset": bool reset_external}, {"signal": path}, {"wait_for": path}, {"sleep": seconds},
{"metrics": true} (the connector's counters as vLLM summed them over its workers:
{"vllm:umbp_...": value}; needs log_stats), {"events": seconds to wait for KV events},
{"shutdown": true} (shuts the engine down, connector included, and records the seconds it took;
with VLLM_ENABLE_V1_MULTIPROCESSING=0 that is the engine's own shutdown, in this process),
{"evict_state": {"prompt": p, "tokens": n, "state_group": i}} (in every worker, evicts from
UMBP's pool the state stored after the first n tokens of an already generated prompt p in the
i-th state group, behind the engine's back; records per worker the token counts with state in
every state group, before and after; needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 and an
embedded-mode engine). A step that raises (e.g. the engine died) ends the scenario; the result
then has "error".
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time


def main() -> None:
    sc = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=sc["model"],
        enable_prefix_caching=True,
        max_model_len=sc.get("max_model_len", 8192),
        dtype="bfloat16",
        seed=0,
        enforce_eager=True,
        tensor_parallel_size=sc.get("tp", 1),
        disable_log_stats=not sc.get("log_stats", False),
    )
    for key in (
        "max_num_batched_tokens",
        "mamba_ssm_cache_dtype",
        "num_gpu_blocks_override",
        "scheduling_policy",
    ):
        if sc.get(key):
            kwargs[key] = sc[key]
    if sc.get("attention_backend"):  # e.g. CPU_MLA where vLLM CPU would pick AMX_MLA
        kwargs["attention_backend"] = sc["attention_backend"]
    if sc.get("connector") is not None:
        from vllm.config import KVTransferConfig

        ktc = dict(
            kv_connector="UMBPStoreConnector",
            kv_role=sc.get("kv_role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=sc["connector"],
        )
        if sc.get("module_path"):
            ktc["kv_connector_module_path"] = "umbp.vllm.connector"
        kwargs["kv_transfer_config"] = KVTransferConfig(**ktc)
    events: list = []
    if sc.get("kv_events"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=sc["kv_events"]
        )
        threading.Thread(target=collect_events, args=(sc["kv_events"], events), daemon=True).start()
    t0 = time.time()
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # startup failures are results too
        print(
            "UMBP_RESULT " + json.dumps({"startup_error": f"{type(e).__name__}: {e}"}), flush=True
        )
        return
    out: dict = {"startup_s": time.time() - t0, "steps": [], **engine_facts(llm)}
    # logprobs=0: each sampled token's own log-probability, compared with the reference's.
    sp = SamplingParams(temperature=0.0, max_tokens=sc.get("max_tokens", 8), logprobs=0)
    try:
        run_steps(llm, sc, sp, out, events)
    except Exception as e:  # e.g. the engine died: report what ran
        out["error"] = f"{type(e).__name__}: {e}"
    print("UMBP_RESULT " + json.dumps(out), flush=True)
    os._exit(0)  # skip vLLM's slow teardown; the harness kills the process group


def run_steps(llm, sc: dict, sp, out: dict, events: list) -> None:
    from vllm import SamplingParams

    prompt_ids: dict[str, list[int]] = {}
    for step in sc["steps"]:
        if "generate" in step:
            res = []
            for item in step["generate"]:
                p, psp, kw = prompt_args(item, sp)
                t = time.time()
                o = llm.generate([p], psp, use_tqdm=False, **kw)[0]
                prompt_ids[p] = list(o.prompt_token_ids)
                res.append(
                    {
                        "prompt_ids": list(o.prompt_token_ids),
                        "tokens": list(o.outputs[0].token_ids),
                        "logprobs": sampled_logprobs(o.outputs[0]),
                        "cached": o.num_cached_tokens or 0,
                        "prompt_tokens": len(o.prompt_token_ids),
                        "seconds": time.time() - t,
                    }
                )
            out["steps"].append(res)
        elif "reset" in step:
            # vLLM refuses while blocks are held (our in-flight stores pin theirs): retry.
            ok = False
            for _ in range(100):
                ok = llm.reset_prefix_cache(reset_connector=bool(step["reset"]))
                if ok:
                    break
                time.sleep(0.1)
            out["steps"].append(ok)
        elif "signal" in step:
            with open(step["signal"], "w") as f:
                f.write("ready")
            out["steps"].append(None)
        elif "wait_for" in step:
            deadline = time.time() + 600
            while not os.path.exists(step["wait_for"]) and time.time() < deadline:
                time.sleep(0.1)
            out["steps"].append(None)
        elif "sleep" in step:
            time.sleep(step["sleep"])
            out["steps"].append(None)
        elif "metrics" in step:
            counters: dict[str, float] = {}
            for m in llm.get_metrics():
                if m.name.startswith("vllm:umbp_") and hasattr(m, "value"):
                    counters[m.name] = counters.get(m.name, 0) + m.value
            out["steps"].append(counters)
        elif "shutdown" in step:
            t = time.time()
            llm.llm_engine.engine_core.shutdown()
            out["steps"].append(time.time() - t)
        elif "evict_state" in step:
            e = step["evict_state"]
            args = (prompt_ids[e["prompt"]], e["tokens"], e["state_group"])
            out["steps"].append(llm.collective_rpc(evict_state, args=args))
        elif "events" in step:
            # Steps hand finished stores to the scheduler, which publishes their events: keep
            # stepping for the wait (a store still copying at one step lands at a later one).
            deadline = time.time() + step["events"]
            while time.time() < deadline:
                llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)
                time.sleep(0.25)
            out["steps"].append(list(events))


def engine_facts(llm) -> dict:
    """What the tests must read from the engine rather than assume (they differ between
    CPUs: vLLM CPU picks other kernels and block sizes where the CPU has AMX): the KV cache's
    block size (every group's, for hybrid models), and the attention backend when named."""
    vc = llm.llm_engine.vllm_config
    facts = {
        "block_size": vc.cache_config.block_size,
        # vLLM CPU turns its own prefix caching off for MLA on its reference backend.
        "prefix_caching": bool(vc.cache_config.enable_prefix_caching),
    }
    attn = getattr(vc, "attention_config", None)
    backend = getattr(attn, "backend", None)
    facts["attention_backend"] = getattr(backend, "name", backend)
    return facts


def sampled_logprobs(completion) -> list[float] | None:
    """Each sampled token's log-probability (None when not asked for)."""
    if not completion.logprobs:
        return None
    return [float(step[t].logprob) for step, t in zip(completion.logprobs, completion.token_ids)]


def prompt_args(item, sp):
    """A "generate" item's prompt, its sampling parameters (with its `kv_transfer_params`)
    and `LLM.generate`'s other arguments (its `priority`)."""
    if isinstance(item, str):
        return item, sp, {}
    kw = {"priority": [item["priority"]]} if "priority" in item else {}
    if "kv_transfer_params" in item:
        sp = sp.clone()
        sp.extra_args = {**(sp.extra_args or {}), "kv_transfer_params": item["kv_transfer_params"]}
    return item["prompt"], sp, kw


def evict_state(worker, token_ids: list[int], tokens: int, nth: int) -> dict:
    """Runs in a vLLM worker (`collective_rpc`): drops from the connector's pool the state
    stored after `tokens` tokens of the prompt `token_ids` in the `nth` state group, as pool
    eviction would. The prompt's block hashes are vLLM's own: its block hasher, from the
    NONE_HASH the engine derives (from a fixed seed for its default sha256 hashes; worker
    processes never derive it, so it is derived here the same way)."""
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import Request

    w = get_kv_transfer_group()._worker
    bs, groups = w.topo.block_size, w.topo.state_groups
    hash_fn = get_hash_fn_by_name(worker.vllm_config.cache_config.prefix_caching_hash_algo)
    if not hasattr(kcu, "NONE_HASH"):
        kcu.init_none_hash(hash_fn)
    hasher = kcu.get_request_block_hasher(bs, hash_fn)
    req = Request("umbp-evict", token_ids, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    hashes = list(req.block_hashes)

    def with_state() -> list[int]:
        held = [w.store.exists(w.keys.keys(g, hashes)) for g in groups]
        return [(k + 1) * bs for k in range(len(hashes)) if all(h[k] for h in held)]

    before = with_state()
    key = w.keys.keys(groups[nth], [hashes[tokens // bs - 1]])
    evicted = w.store.evict(key)
    return {"before": before, "evicted": evicted, "after": with_state()}


def collect_events(endpoint: str, sink: list) -> None:
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    while True:
        parts = sub.recv_multipart()
        batch = dec.decode(parts[-1])
        for ev in batch.events:
            name = type(ev).__name__
            if name in ("BlockStored", "BlockRemoved") and getattr(ev, "medium", None) == "CPU":
                e = {"type": name, "n": len(ev.block_hashes), "hashes": _hexes(ev.block_hashes)}
                e["group"] = getattr(ev, "group_idx", None)
                if name == "BlockStored":
                    parent = ev.parent_block_hash
                    e["parent"] = None if parent is None else _hexes([parent])[0]
                    e["tokens"], e["block_size"] = list(ev.token_ids), ev.block_size
                sink.append(e)


def _hexes(hashes) -> list[str]:
    """Block hashes as JSON text (vLLM sends bytes, or ints with VLLM_KV_EVENTS_USE_INT_...)."""
    return [h.hex() if isinstance(h, bytes) else f"{h:x}" for h in hashes]


if __name__ == "__main__":
    main()
