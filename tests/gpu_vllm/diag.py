"""Diagnostic: real engines in embedded and standalone mode with the byte verifier on."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Server, model_dir, prompts, run_engine  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
root = Path(tempfile.mkdtemp(prefix="umbp-diag-"))
model = model_dir(root, os.environ.get("SHAPE", "llama8b"))
ps = prompts(4, 4096, shared=2048, seed=1) + prompts(4, 16384, seed=2)
shared_srv = None
if os.environ.get("SHARED"):
    (root / "shared-srv").mkdir()
    shared_srv = Server(root / "shared-srv", capacity="64GiB").start()
passes = ["cold", "own", "reset", "restored"]
results = {}
which = os.environ.get("WHICH", "standalone-graphs-mp-10,embedded-graphs-mp-10").split(",")
for name in which:
    mode, graphs, mp, kv = name.split("-")
    sc = dict(
        model=model,
        block_size=int(os.environ.get("BS", "16")),
        eager=graphs == "eager",
        kv_cache_bytes=int(kv) << 30,
        prompts=ps,
        passes=passes,
        max_tokens=4,
        verify=True,
        multiprocessing=mp == "mp",
    )
    srv = None
    if mode == "standalone" and shared_srv is not None:
        sc["connector"] = {"mode": "standalone", "endpoint": shared_srv.endpoint}
    elif mode == "standalone":
        d = root / f"srv-{name}"
        d.mkdir()
        srv = Server(d, capacity="24GiB").start()
        sc["connector"] = {"mode": "standalone", "endpoint": srv.endpoint}
    else:
        sc["connector"] = {"capacity_bytes": 24 << 30}
    t = time.time()
    try:
        r = run_engine(sc, OUT / f"engine-{name}.log", timeout=300)
    except Exception as e:
        r = {"error": str(e)[-3000:]}
    finally:
        if srv is not None:
            srv.stop()
            (OUT / f"server-{name}.log").write_text(srv.log.read_text()[-200000:])
    r["wall_s"] = round(time.time() - t, 1)
    results[name] = r
    summary = {"startup_s": r.get("startup_s"), "error": r.get("error"), "verify": r.get("verify")}
    rows = []
    for p in r.get("passes", []):
        if "tokens" in p:
            rows.append(
                (p["prompt"], p["pass"], p["cached"], p["tokens"][:8], round(p["seconds"], 3))
            )
    print(f"== {name} ({r['wall_s']} s)\n{json.dumps(summary)[:4000]}", flush=True)
    for row in rows:
        print("  ", row, flush=True)
(OUT / "diag.json").write_text(json.dumps(results, indent=1))
