"""Runs one real vLLM engine through passes over a list of prompts; prints one
`UMBP_RESULT {json}` line.

Used by `test_real_engine.py` and `bench_ttft.py` (beside this file) through `common.py`, which
starts it in its own process session (vLLM's helper processes can outlive it) and kills the
group afterwards.

    python gpu_engine.py SCENARIO_JSON_FILE

Scenario keys:
- `model`: a model folder (`common.model_dir`); `block_size`; `eager` (enforce_eager: no
  torch.compile, no CUDA graphs); `kv_cache_bytes`; `max_model_len`; `max_tokens`;
- `connector`: `kv_connector_extra_config`, or null for an engine without UMBP;
- `prompts`: token id lists; `passes`: pass names run for each prompt in turn (every pass of
  a prompt before the next prompt), or `plan`: explicit `[prompt, pass]` pairs. Passes:
  `cold`, `own` (again: vLLM's own prefix cache), `reset` (reset_prefix_cache, retried while
  in-flight stores still hold blocks), `restored` (again, after a reset: UMBP restores),
  `signal:<path>` / `wait:<path>` (write a file / wait for one: the caller kills or restarts
  the server between passes);
- `observe` (default true): use `verified_connector.VerifiedUMBPStoreConnector`, the product's
  connector with the test observers of verifier.py (the byte verifier unless the caller sets
  UMBP_VERIFY=0; the call tracer with UMBP_TRACE_OUT). tp must be 1;
- `corrupt_loads`: change one restored byte of each load before it is checked (the verifier's
  own test: it must report it);
- `spin_events`: CUDA events without blocking sync in the engine (bench_ttft's
  `standalone-spin` mode: standalone mode's event waits as they were before);
- `dump_fingerprints`: a file to save the stored blocks' fingerprints to at the end (needs
  `multiprocessing: false`), which another engine's `verify_seed` reads: its restored blocks
  are then checked against the first engine's stores.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    sc = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(
        model=sc["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=sc.get("block_size", 16),
        max_model_len=sc.get("max_model_len", 40960),
        dtype="bfloat16",
        seed=0,
        enforce_eager=bool(sc.get("eager", False)),
        kv_cache_memory_bytes=int(sc.get("kv_cache_bytes", 8 << 30)),
        max_num_seqs=sc.get("max_num_seqs", 8),
    )
    if sc.get("connector") is not None:
        from vllm.config import KVTransferConfig

        observe = sc.get("observe", True)
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="VerifiedUMBPStoreConnector" if observe else "UMBPStoreConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=sc["connector"],
            kv_connector_module_path="verified_connector" if observe else None,
        )
    t0 = time.time()
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # start-up failures are results too
        emit({"startup_error": f"{type(e).__name__}: {e}"})
        os._exit(0)
    out: dict = {"startup_s": round(time.time() - t0, 1), "passes": []}
    plan = sc.get("plan") or [[i, p] for i in range(len(sc["prompts"])) for p in sc["passes"]]
    try:
        for i, name in plan:
            out["passes"].append(run_pass(llm, name, i, sc, SamplingParams, TokensPrompt))
    except Exception as e:  # e.g. the engine died: report what ran
        out["error"] = f"{type(e).__name__}: {e}"
    if sc.get("dump_fingerprints"):  # the worker is in this process (multiprocessing off)
        from verified_connector import VERIFIER

        VERIFIER.dump(sc["dump_fingerprints"])
    if os.environ.get("UMBP_TRACE_OUT"):
        time.sleep(1.5)  # the tracers write once a second
    path = os.environ.get("UMBP_VERIFY_OUT")
    if path and os.environ.get("UMBP_VERIFY", "1") == "1":
        time.sleep(0.5)  # the engine core's last step
        out["verify"] = json.loads(Path(path).read_text()) if os.path.exists(path) else None
    emit(out)
    os._exit(0)  # skip vLLM's slow teardown; the caller kills the process group


def run_pass(llm, name: str, i: int, sc: dict, SamplingParams, TokensPrompt) -> dict:
    rec: dict = {"prompt": i, "pass": name}
    if name == "reset":
        # vLLM refuses while blocks are held (in-flight stores pin theirs): retry.
        t = time.time()
        ok = False
        while time.time() - t < 60:
            ok = llm.reset_prefix_cache()
            if ok:
                break
            time.sleep(0.05)
        rec["ok"] = ok
        return rec
    if name.startswith("signal:"):
        Path(name.split(":", 1)[1]).write_text("ready")
        return rec
    if name.startswith("wait:"):
        path = Path(name.split(":", 1)[1])
        deadline = time.time() + 300
        while not path.exists() and time.time() < deadline:
            time.sleep(0.05)
        rec["ok"] = path.exists()
        return rec
    ids = sc["prompts"][i]
    sp = SamplingParams(temperature=0.0, max_tokens=sc.get("max_tokens", 8), ignore_eos=True)
    rec["t0"] = time.monotonic()
    o = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
    rec["t1"] = time.monotonic()
    rec["seconds"] = rec["t1"] - rec["t0"]
    rec["tokens"] = list(o.outputs[0].token_ids)
    rec["cached"] = o.num_cached_tokens or 0
    rec["prompt_tokens"] = len(ids)
    return rec


def emit(obj: dict) -> None:
    print("UMBP_RESULT " + json.dumps(obj), flush=True)


if __name__ == "__main__":
    main()
