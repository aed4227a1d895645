"""The serving bake-off: UMBP against vLLM's native CPU offloading and LMCache, under load, on a
real `vllm serve` (../shared/BAKEOFF.md is the method; docs/serving-bakeoff.md the user's page).

    python tests/gpu_vllm/bench_serve.py --preset gpu-8b --out serve.json
        [--arms none,native,lmcache,umbp-embedded,umbp-standalone]
        [--workloads prefix2,prefix8,random,chat2,chat8,twin] [--deadline-s 1000]

One run = every workload × every arm, on one machine, one after another, the same engine flags
for every arm; only the KV tier differs:

| arm | what the engine gets |
|---|---|
| none | prefix caching, no connector |
| native | `--kv-offloading-backend native --kv-offloading-size D` |
| lmcache | LMCache's multiprocess server (`--l1-size-gb D --eviction-policy LRU`) + its `LMCacheMPConnector` |
| lmcache-local | LMCache in the engine's process (vLLM's `LMCacheConnectorV1`, `LMCACHE_LOCAL_CPU=True`, `LMCACHE_MAX_LOCAL_CPU_SIZE=D`) |
| umbp-embedded | `UMBPStoreConnector`, `mode: embedded`, `total_capacity_bytes: D` |
| umbp-standalone | `umbp_standalone_server --capacity D`, `mode: standalone` |
| umbp-dma | umbp-embedded with `cuda_staging_bytes: 0`: the GPU's copy engines only, no staging kernels |

Each arm gets a fresh engine (and tier server); between points both vLLM's prefix cache and the
tier are dropped (`POST /reset_prefix_cache?reset_external=true`) and every point draws prompts
of its own, the same for every arm. Workloads (working sets in multiples of the GPU KV pool H,
which `--num-gpu-blocks-override` pins):

- `prefixN`: `vllm bench serve --dataset-name prefix_repetition` with prefixes for N×H, at
  rate inf, then at the first arm's measured saturation rate, then at half of it;
- `random`: no reuse (`--dataset-name random`) at rate inf and at 0.8 of the first arm's;
- `chatN`: multi-turn chat (serve_load.chat) with conversations for N×H;
- `twin`: two engines on the one GPU (half its pool each), chat turns round-robin between
  them; the standalone arm's two engines share one server, the others have a tier each.

After the points, a probe (serve_load.probe) sends prompts cold, drops vLLM's own cache and
sends them again: the greedy outputs must match, and in the UMBP arms the project's verifier
(verifier.py, switched on for the probe only through `UMBP_VERIFY_GATE`) checks every restored
block byte for byte against the block stored. Per point: the client's figures, the deltas of
the server's `/metrics` (prompt tokens by source, external hits, the tier's own series), CPU
seconds of the engine's process tree and of the tier's server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import serve_load  # noqa: E402
from common import SHAPES, model_dir, server_bin  # noqa: E402
from serve_engine import Proc, Serve, delta, free_port  # noqa: E402

#: Engine and workload sizes. `gpu-8b`: Llama-3-8B's shape (128 KiB of KV per token) with a
#: 1 GiB GPU pool (8,192 tokens) and a 16 GiB host tier, sized so that every arm's points fit
#: the few minutes of GPU time a session here gets; `cpu-tiny`: the harness's own check on vLLM CPU.
PRESETS: dict[str, dict] = {
    "gpu-8b": dict(
        shape="llama8b",
        block_size=16,
        gpu_blocks=512,
        host_gib=16,
        max_num_seqs=8,
        max_batched_tokens=8192,
        max_model_len=4096,
        engine_timeout=420,
        point_timeout=240,
        prefix=dict(prefix_len=1024, suffix_len=64, output_len=32, uses={2: 3, 8: 2}),
        random=dict(input_len=1024, output_len=64, prompts=96),
        chat=dict(first_len=1024, user_len=128, output_len=32, turns={2: 4, 8: 3}, clients=8),
        twin=dict(ws=2, turns=4, gpu_util=0.42),
        probe=dict(n=3, length=2048, output_len=8),
        slo={"ttft": 300, "tpot": 50},
        warmup=dict(input_len=256, output_len=8, prompts=16),
        extra_engine_args=[],
    ),
    "cpu-tiny": dict(
        shape="tiny-kv",
        block_size=32,  # vLLM CPU's attention takes multiples of 32
        gpu_blocks=80,  # 80 MiB (twin: 40 MiB each), an allocation of its own mapping
        host_gib=1,
        max_num_seqs=4,
        max_batched_tokens=1024,
        max_model_len=1024,
        engine_timeout=600,
        point_timeout=900,
        prefix=dict(prefix_len=256, suffix_len=16, output_len=4, uses={2: 2, 8: 2}),
        random=dict(input_len=128, output_len=4, prompts=16),
        chat=dict(first_len=256, user_len=32, output_len=4, turns={2: 3, 8: 2}, clients=4),
        twin=dict(ws=2, turns=3, gpu_util=None),
        probe=dict(n=2, length=256, output_len=4),
        slo={"ttft": 5000, "tpot": 1000},
        warmup=dict(input_len=64, output_len=2, prompts=4),
        extra_engine_args=["--enforce-eager"],
    ),
}
ARMS = (
    "none",
    "native",
    "lmcache",
    "lmcache-local",
    "umbp-embedded",
    "umbp-standalone",
    "umbp-dma",
)


def kv_bytes_per_token(shape: str) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 2


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.cfg = dict(PRESETS[a.preset])
        for kv in a.set or []:  # e.g. --set host_gib=32
            k, v = kv.split("=", 1)
            self.cfg[k] = json.loads(v)
        self.root = Path(a.keep or tempfile.mkdtemp(prefix="umbp-serve-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.model = model_dir(self.root, self.cfg["shape"], max_len=self.cfg["max_model_len"])
        self.t_end = time.time() + a.deadline_s
        self.h_tokens = self.cfg["gpu_blocks"] * self.cfg["block_size"]
        self.rates: dict[str, float] = {}
        self.prefix = ""  # of log names: "twin-" for the two-engine runs
        self.log = open(self.root / "bench.log", "a")  # noqa: SIM115
        self.res: dict = {
            "kind": "serve",
            "date": time.strftime("%Y-%m-%d"),
            "device": a.device or platform.node(),
            "command": " ".join(sys.argv),
            "preset": a.preset,
            "config": {k: v for k, v in self.cfg.items() if not k.endswith("_timeout")},
            "kv_bytes_per_token": kv_bytes_per_token(self.cfg["shape"]),
            "gpu_pool_tokens": self.h_tokens,
            "versions": versions(),
            "arms": {},
        }

    # -- output ------------------------------------------------------------------------------

    def say(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def save(self) -> None:
        if self.a.out:
            tmp = Path(self.a.out + ".tmp")
            tmp.write_text(json.dumps(self.res, indent=1))
            os.replace(tmp, self.a.out)

    def left(self) -> float:
        return self.t_end - time.time()

    # -- engines -----------------------------------------------------------------------------

    def env(self, arm: str, gib: float | None = None) -> dict:
        env = dict(os.environ)
        env.update(
            PYTHONHASHSEED="0",
            VLLM_SERVER_DEV_MODE="1",
            VLLM_USE_FLASHINFER_SAMPLER="0",
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p),
        )
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM CPU only
        if arm == "lmcache-local":
            # LMCache's own cache in the engine's process, sized like every arm's host budget
            # (read from the environment by LMCache's config; no server, no config file).
            env.update(
                LMCACHE_LOCAL_CPU="True",
                LMCACHE_MAX_LOCAL_CPU_SIZE=str(gib if gib is not None else self.cfg["host_gib"]),
                LMCACHE_CHUNK_SIZE="256",
            )
        if arm.startswith("umbp"):
            env["UMBP_VERIFY"] = "1"
            env["UMBP_VERIFY_GATE"] = str(self.root / f"verify-{arm}.on")
            env["UMBP_VERIFY_OUT"] = str(self.root / f"verify-{arm}.json")
        return env

    def engine_args(self, gpu_blocks: int, gpu_util: float | None) -> list[str]:
        c = self.cfg
        # vLLM keeps one block back (its null block): a pool of N blocks serves N - 1 blocks of
        # one request, so the twin engines' half pools (256 blocks of 16 at gpu-8b) cap the
        # model length below the preset's.
        max_len = min(c["max_model_len"], (gpu_blocks - 1) * c["block_size"])
        args = [
            "--load-format", "dummy", "--dtype", "bfloat16", "--seed", "0",
            "--tokenizer", self.model, "--enable-prefix-caching",
            "--block-size", str(c["block_size"]), "--max-model-len", str(max_len),
            "--max-num-seqs", str(c["max_num_seqs"]),
            "--max-num-batched-tokens", str(c["max_batched_tokens"]),
            "--num-gpu-blocks-override", str(gpu_blocks), "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if gpu_util:
            args += ["--gpu-memory-utilization", str(gpu_util)]
        return args + list(c["extra_engine_args"])

    def tier(self, arm: str, gib: float, tag: str) -> tuple[list[str], Proc | None]:
        """The arm's engine flags, and its server process if it has one (started)."""
        cap = int(gib * (1 << 30))
        if arm == "none":
            return [], None
        if arm == "native":
            return ["--kv-offloading-backend", "native", "--kv-offloading-size", str(gib)], None
        if arm == "lmcache":
            port = free_port()
            srv = Proc(
                [sys.executable, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
                 "--port", str(port), "--l1-size-gb", str(gib),
                 # LMCache 0.5.6 refuses to start without a policy ("Legacy L1 configuration
                 # requires --l1-size-gb and --eviction-policy"); LRU, the first of
                 # the policies it offers.
                 "--eviction-policy", "LRU",
                 # Its metrics need `opentelemetry-exporter-prometheus`, which the GPU
                 # machine's image lacks (the server exits at start without it); off, which
                 # only saves LMCache work. UMBP's arms keep their metrics on.
                 "--disable-metrics"],
                self.root / f"lmcache-{self.prefix}{tag}.log", self.env(arm),
            )  # fmt: skip
            wait_listening(srv, port, 120)
            # LMCache's own connector module (matched to its server) rather than vLLM's
            # in-tree copy, which `--kv-offloading-backend lmcache` would pick.
            ktc = {
                "kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                # As the UMBP arms: a failed load is recomputed, not failed (run D's engine
                # died on vLLM's `fail` path when LMCache's server stopped answering).
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://127.0.0.1",
                    "lmcache.mp.port": port,
                },
            }
            return ["--kv-transfer-config", json.dumps(ktc)], srv
        if arm == "lmcache-local":
            # vLLM's in-tree connector class, which loads LMCache's adapter from its wheel; the
            # cache lives in each engine's process (a twin gets one per engine).
            ktc = {
                "kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
            }
            return ["--kv-transfer-config", json.dumps(ktc)], None
        extra: dict = {"mode": "embedded", "total_capacity_bytes": cap, "lookup_instance": tag}
        if arm == "umbp-dma":
            # No staging slots: every piece moves by the copy engines (DMA), no SM kernels.
            extra["cuda_staging_bytes"] = 0
        srv = None
        if arm == "umbp-standalone":
            folder = self.root / f"server-{self.prefix}{tag}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            sock = folder / "umbp.sock"
            srv = Proc(
                [server_bin() or "umbp_standalone_server", "--address", str(sock),
                 "--capacity", f"{max(1, round(gib))}GiB"],
                folder / "server.log",
            )  # fmt: skip
            deadline = time.time() + 120
            while not sock.exists() and srv.alive() and time.time() < deadline:
                time.sleep(0.05)
            if not sock.exists():
                srv.stop()
                raise RuntimeError(f"umbp_standalone_server did not listen:\n{srv.tail()}")
            extra = {"mode": "standalone", "endpoint": f"unix://{sock}"}
        ktc = {
            "kv_connector": "VerifiedUMBPStoreConnector",
            "kv_connector_module_path": "verified_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        return ["--kv-transfer-config", json.dumps(ktc)], srv

    def start(self, arm: str, tags: list[str], gpu_blocks: int, gib: float, shared: bool):
        """Engines (one per tag) for `arm`, their tier servers, and start-up seconds."""
        servers: list[Proc] = []
        engines: list[Serve] = []
        flags_by_tag = {}
        for i, tag in enumerate(tags):
            if shared and i > 0:
                flags_by_tag[tag] = flags_by_tag[tags[0]]
                continue
            flags, srv = self.tier(arm, gib, tag)
            flags_by_tag[tag] = flags
            if srv:
                servers.append(srv)
        gpu_util = self.cfg["twin"]["gpu_util"] if len(tags) > 1 else None
        try:
            for tag in tags:
                args = self.engine_args(gpu_blocks, gpu_util) + flags_by_tag[tag]
                log = self.root / f"engine-{self.prefix}{arm}-{tag}.log"
                engines.append(Serve(self.model, args, log, self.env(arm, gib)))
            watch = tuple(servers)
            startup = [e.wait_healthy(self.cfg["engine_timeout"], watch) for e in engines]
        except BaseException:
            for p in engines + servers:
                p.stop(grace=5)
            raise
        return engines, servers, startup

    # -- points ------------------------------------------------------------------------------

    def point(self, name: str, engines: list[Serve], servers: list[Proc], load) -> dict:
        for e in engines:
            if not e.reset(external=True):
                self.say(f"  {name}: reset_prefix_cache kept failing")
        time.sleep(0.3)
        m0 = [e.metrics() for e in engines]
        c0 = sum(e.cpu() for e in engines)
        s0 = sum(s.cpu() for s in servers)
        t0 = time.time()
        rec = self.bounded(load, min(self.cfg["point_timeout"], max(30.0, self.left())))
        for e in engines:
            if not e.alive():
                rec.setdefault("error", f"the engine exited:\n{e.tail(800)}")
        rec["wall_s"] = round(time.time() - t0, 2)
        time.sleep(0.5)  # let the last steps' stats reach /metrics
        m1 = [e.metrics() for e in engines]
        d: dict[str, float] = {}
        for a, b in zip(m0, m1):
            for k, v in delta(a, b).items():
                d[k] = round(d.get(k, 0) + v, 6)
        rec["metrics"] = {k: v for k, v in d.items() if v}
        rec["engine_cpu_s"] = round(sum(e.cpu() for e in engines) - c0, 2)
        rec["tier_cpu_s"] = round(sum(s.cpu() for s in servers) - s0, 2)
        rec["engine_rss_gib"] = round(sum(e.rss() for e in engines) / 2**30, 2)
        rec["tier_rss_gib"] = round(sum(s.rss() for s in servers) / 2**30, 2)
        derive(rec, self.res["kv_bytes_per_token"])
        self.say(
            f"  {name}: {rec.get('req_per_s')} req/s, TTFT p50 {rec.get('ttft_p50_ms')} ms p99 "
            f"{rec.get('ttft_p99_ms')} ms, ext hit {rec.get('external_hit_share')}, local hit "
            f"{rec.get('local_hit_share')}, cpu {rec['engine_cpu_s']}+{rec['tier_cpu_s']} s"
            + (f" ERROR {rec['error']}" if "error" in rec else "")
        )
        return rec

    @staticmethod
    def bounded(load, timeout: float) -> dict:
        """`load()` on a thread of its own, given up after `timeout` seconds (a client can
        wait forever on an engine that stopped answering; stopping the engine frees it)."""
        box: dict = {}

        def run() -> None:
            try:
                box["rec"] = load()
            except Exception as e:  # a point that breaks is a result too
                box["rec"] = {"error": f"{type(e).__name__}: {e}"[:1000]}

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(timeout)
        return box.get("rec") or {"error": f"no answer within {timeout:.0f} s"}

    def bench(self, e: Serve, argv: list[str]):
        return lambda: serve_load.vllm_bench(e.base, self.model, argv, self.cfg["slo"], self.log)

    def points_for(self, wl: str) -> list[tuple[str, dict, list[str] | None]]:
        """(point name, its description, its rates) for workload `wl`."""
        if wl.startswith("prefix"):
            ws = int(wl[6:])
            return [(f"{wl}@{r}", {"workload": "prefix", "ws": ws, "rate": r}, None)
                    for r in ("inf", "sat", "half")]  # fmt: skip
        if wl == "random":
            return [(f"random@{r}", {"workload": "random", "ws": 0, "rate": r}, None)
                    for r in ("inf", "0.8")]  # fmt: skip
        if wl.startswith("chat"):
            return [(wl, {"workload": "chat", "ws": int(wl[4:])}, None)]
        raise ValueError(f"unknown workload {wl!r}: prefixN, random, chatN or twin")

    def rate_of(self, desc: dict) -> float | None:
        key = f"{desc['workload']}{desc['ws']}"
        r = desc["rate"]
        if r == "inf":
            return float("inf")
        sat = self.rates.get(key)
        if sat is None:
            return None
        return {"sat": sat, "half": sat / 2, "0.8": 0.8 * sat}[r]

    def load_for(self, e: Serve, desc: dict, seed: int):
        c = self.cfg
        if desc["workload"] == "prefix":
            p, ws = c["prefix"], desc["ws"]
            n_pre = max(2, round(ws * self.h_tokens / p["prefix_len"]))
            n = n_pre * p["uses"][ws]
            desc.update(prefixes=n_pre, prompts=n)
            rate = self.rate_of(desc)
            desc["rate_req_s"] = rate
            argv = [
                "--dataset-name", "prefix_repetition", "--num-prompts", str(n), "--seed", str(seed),
                "--prefix-repetition-prefix-len", str(p["prefix_len"]),
                "--prefix-repetition-suffix-len", str(p["suffix_len"]),
                "--prefix-repetition-num-prefixes", str(n_pre),
                "--prefix-repetition-output-len", str(p["output_len"]),
                "--request-rate", str(rate),
            ]  # fmt: skip
            return self.bench(e, argv)
        if desc["workload"] == "random":
            r = c["random"]
            rate = self.rate_of(desc)
            desc.update(prompts=r["prompts"], rate_req_s=rate)
            argv = [
                "--dataset-name", "random", "--num-prompts", str(r["prompts"]), "--seed", str(seed),
                "--random-input-len", str(r["input_len"]), "--random-output-len",
                str(r["output_len"]), "--request-rate", str(rate),
            ]  # fmt: skip
            return self.bench(e, argv)
        ch, ws = c["chat"], desc["ws"]
        turns = ch["turns"][ws]
        ctx = ch["first_len"] + turns * ch["output_len"] + (turns - 1) * ch["user_len"]
        conv = max(2, round(ws * self.h_tokens / ctx))
        desc.update(conversations=conv, turns=turns, clients=ch["clients"])
        return lambda: serve_load.chat(
            [e.base], self.model, conv, turns, ch["first_len"], ch["user_len"],
            ch["output_len"], ch["clients"], seed, c["slo"],
        )  # fmt: skip

    # -- arms --------------------------------------------------------------------------------

    def run_arm(self, arm: str, workloads: list[str], first_arm: bool) -> dict:
        out: dict = {"points": {}}
        self.res["arms"][arm] = out
        est = self.a.arm_estimate_s
        if self.left() < est:
            out["not_run"] = f"out of time: {self.left():.0f} s left, an arm needs ~{est} s"
            self.say(f"{arm}: {out['not_run']}")
            return out
        self.say(f"{arm}: starting")
        engines, servers = [], []
        try:
            engines, servers, startup = self.start(
                arm, ["e0"], self.cfg["gpu_blocks"], self.cfg["host_gib"], False
            )
            out["startup_s"] = round(startup[0], 1)
            self.say(f"{arm}: healthy after {out['startup_s']} s")
            e = engines[0]
            w = self.cfg["warmup"]
            serve_load.vllm_bench(
                e.base, self.model,
                ["--dataset-name", "random", "--num-prompts", str(w["prompts"]), "--seed", "7",
                 "--random-input-len", str(w["input_len"]), "--random-output-len",
                 str(w["output_len"])],
                {}, self.log,
            )  # fmt: skip
            for wl in workloads:
                for i, (name, desc, _) in enumerate(self.points_for(wl)):
                    if not e.alive():
                        raise RuntimeError(f"the engine exited:\n{e.tail(1500)}")
                    if self.left() < self.a.reserve_s:
                        out["points"][name] = {**desc, "not_run": "out of time"}
                        continue
                    runs = []
                    for r in range(self.a.repeats):
                        if runs and self.left() < self.a.reserve_s:
                            break
                        # Seeds differ between repeats and points, never between arms.
                        seed = 1000 + 100 * len(out["points"]) + i + 10000 * r
                        load = self.load_for(e, desc, seed)
                        if desc.get("rate_req_s", 0) is None:
                            break
                        tag = f" #{r + 1}" if self.a.repeats > 1 else ""
                        runs.append(
                            {
                                "seed": seed,
                                **self.point(f"{arm} {name}{tag}", engines, servers, load),
                            }
                        )
                    if not runs:
                        out["points"][name] = {**desc, "not_run": "no saturation rate measured"}
                        continue
                    rec = {**desc, **combine(runs)}
                    out["points"][name] = rec
                    key = f"{desc['workload']}{desc['ws']}"
                    if (first_arm and key not in self.rates and desc.get("rate") == "inf"
                            and rec.get("req_per_s")):  # fmt: skip
                        self.rates[key] = rec["req_per_s"]
                        self.res["saturation_req_s"] = dict(self.rates)
                    self.save()
            if self.left() > 30:
                out["probe"] = self.check(arm, e)
        except Exception as ex:
            out["error"] = f"{type(ex).__name__}: {ex}"[-3000:]
            self.say(f"{arm}: ERROR {out['error'][-600:]}")
        finally:
            for e in engines:
                out.setdefault("engine_log_tail", e.tail(1500)) if "error" in out else None
                e.stop()
            for s in servers:
                s.stop()
            self.save()
        return out

    def check(self, arm: str, e: Serve) -> dict:
        """The correctness probe; in the UMBP arms with the byte verifier switched on."""
        p = self.cfg["probe"]
        gate = self.root / f"verify-{arm}.on"
        if arm.startswith("umbp"):
            gate.write_text("on")
        try:
            e.reset(external=True)
            rec = serve_load.probe(e, self.model, p["n"], p["length"], p["output_len"], 99)
            if arm.startswith("umbp"):
                time.sleep(1.5)  # the verifier's thread collects its results every 0.2 s
                f = self.root / f"verify-{arm}.json"
                rec["verifier"] = json.loads(f.read_text()) if f.exists() else None
        finally:
            gate.unlink(missing_ok=True)
        v = rec.get("verifier") or {}
        self.say(
            f"{arm} probe: {rec['same_outputs']}/{rec['prompts']} same outputs, restored pass "
            f"{rec['restored_pass_tokens_by_source']}"
            + (f", verifier {v.get('checked')} checked {v.get('mismatched')} wrong" if v else "")
        )
        return rec

    def run_twin(self, arms: list[str]) -> None:
        """Two engines on one GPU, chat turns round-robin between them."""
        tw, ch = self.cfg["twin"], self.cfg["chat"]
        out: dict = {}
        self.res["twin"] = out
        self.prefix = "twin-"
        for arm in arms:
            if self.left() < self.a.arm_estimate_s:
                out[arm] = {"not_run": f"out of time ({self.left():.0f} s left)"}
                continue
            self.say(f"twin {arm}: starting two engines")
            engines, servers = [], []
            shared = arm in ("umbp-standalone", "lmcache")
            gib = self.cfg["host_gib"] if shared else self.cfg["host_gib"] / 2
            try:
                engines, servers, startup = self.start(
                    arm, ["t0", "t1"], self.cfg["gpu_blocks"] // 2, gib, shared
                )
                turns = tw["turns"]
                ctx = ch["first_len"] + turns * ch["output_len"] + (turns - 1) * ch["user_len"]
                conv = max(2, round(tw["ws"] * self.h_tokens / ctx))
                desc = {"workload": "twin", "ws": tw["ws"], "conversations": conv,
                        "turns": turns, "shared_tier": shared, "host_gib_each": gib}  # fmt: skip
                urls = [e.base for e in engines]

                runs = []
                for r in range(self.a.repeats):
                    if runs and self.left() < self.a.reserve_s:
                        break
                    seed = 4242 + 10000 * r

                    def load(urls=urls, conv=conv, turns=turns, seed=seed):
                        return serve_load.chat(
                            urls, self.model, conv, turns, ch["first_len"], ch["user_len"],
                            ch["output_len"], ch["clients"], seed, self.cfg["slo"],
                        )  # fmt: skip

                    tag = f" #{r + 1}" if self.a.repeats > 1 else ""
                    rec = self.point(f"twin {arm}{tag}", engines, servers, load)
                    runs.append({"seed": seed, **rec})
                rec = combine(runs)
                out[arm] = {**desc, "startup_s": [round(s, 1) for s in startup], **rec}
            except Exception as ex:
                out[arm] = {"error": f"{type(ex).__name__}: {ex}"[-3000:]}
                self.say(f"twin {arm}: ERROR {out[arm]['error'][-600:]}")
            finally:
                for e in engines:
                    e.stop()
                for s in servers:
                    s.stop()
                self.save()
        self.prefix = ""


def wait_listening(srv: Proc, port: int, timeout: float) -> None:
    """Until `srv` accepts TCP connections on `port`; raises with its log's tail when it exits
    or does not listen within `timeout` seconds (an engine would wait minutes for it)."""
    import socket

    deadline = time.time() + timeout
    while True:
        if not srv.alive():
            srv.stop()
            raise RuntimeError(f"the tier's server exited at start:\n{srv.tail()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.time() > deadline:
                srv.stop()
                raise RuntimeError(f"the tier's server did not listen in {timeout:.0f} s:\n"
                                   f"{srv.tail()}") from None  # fmt: skip
            time.sleep(0.2)


#: The figures whose spread across repeats the results keep (`<key>_min`, `<key>_max`).
SPREAD = ("req_per_s", "out_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
          "goodput_req_per_s", "external_hit_share", "engine_cpu_s")  # fmt: skip


def combine(runs: list[dict]) -> dict:
    """One point from its repeats: every number is the median of the repeats' (the middle one
    of three; of two, their mean), the `SPREAD` figures also as min and max, and each repeat's
    own record under `repeats`. One repeat is returned as it is."""
    if len(runs) == 1:
        return dict(runs[0])
    ok = [r for r in runs if "error" not in r] or runs
    out: dict = {}
    for k, v in ok[0].items():
        if isinstance(v, dict) and k in ("metrics", "tokens_by_source"):  # counters: summed
            out[k] = {m: round(sum(r.get(k, {}).get(m, 0) for r in ok), 6) for m in v}
        elif not isinstance(v, (int, float, dict)):
            out[k] = v
    for k, v in ok[0].items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        vals = sorted(r[k] for r in ok if isinstance(r.get(k), (int, float)))
        n = len(vals)
        med = vals[n // 2] if n % 2 else (vals[n // 2 - 1] + vals[n // 2]) / 2
        out[k] = round(med, 4) if isinstance(med, float) else med
        if k in SPREAD:
            out[f"{k}_min"], out[f"{k}_max"] = vals[0], vals[-1]
    out["seed"] = [r.get("seed") for r in runs]
    out["repeats"] = runs
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        out["error"] = f"{len(errors)} of {len(runs)} repeats failed: {errors[0]}"[:1000]
    return out


def derive(rec: dict, bpt: int) -> None:
    """Hit shares and restore rates from a point's metric deltas."""
    m = rec.get("metrics", {})
    src = {k.split("[", 1)[1].rstrip("]"): v for k, v in m.items()
           if k.startswith("vllm:prompt_tokens_by_source")}  # fmt: skip
    total = sum(src.values())
    if total:
        rec["local_hit_share"] = round(src.get("local_cache_hit", 0) / total, 4)
        rec["external_hit_share"] = round(src.get("external_kv_transfer", 0) / total, 4)
        rec["tokens_by_source"] = src
    ext = src.get("external_kv_transfer", 0)
    rec["external_tokens"] = ext
    rec["external_gb"] = round(ext * bpt / 1e9, 3)
    for tier, b, s in (
        ("umbp", "vllm:umbp_load_bytes_total", "vllm:umbp_load_seconds_sum"),
        ("native", "vllm:kv_offload_load_bytes_total", "vllm:kv_offload_load_time_total"),
    ):
        if m.get(b) and m.get(s):
            rec["restore_gbps_per_transfer"] = round(m[b] / m[s] / 1e9, 2)
            rec["restore_tier"] = tier


def versions() -> dict:
    out = {"python": platform.python_version()}
    from importlib import metadata

    for mod in ("vllm", "torch", "umbp", "lmcache"):
        try:  # the installed version, without importing it here
            out[mod] = metadata.version(mod)
        except metadata.PackageNotFoundError:
            out[mod] = "not installed"
    try:
        out["gpu"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,pcie.link.gen.max,pcie.link.width.max",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        out["gpu"] = None
    try:
        with open("/proc/cpuinfo") as f:
            out["cpu"] = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None
            )
    except OSError:
        out["cpu"] = None
    out["cpus"] = os.cpu_count()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="gpu-8b", choices=sorted(PRESETS))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--workloads", default="prefix2,prefix8,random,chat2,chat8")
    ap.add_argument("--twin-arms", default="none,umbp-embedded,umbp-standalone")
    ap.add_argument("--set", action="append", help="override a preset field: KEY=JSON")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", default=None, help="folder for logs (default: a temporary one)")
    ap.add_argument("--device", default=None, help="the machine's name for the results")
    ap.add_argument("--deadline-s", type=float, default=3600, help="stop starting work after")
    ap.add_argument("--arm-estimate-s", type=float, default=60, help="skip an arm with less left")
    ap.add_argument("--reserve-s", type=float, default=20, help="skip a point with less left")
    ap.add_argument("--print", default=None, help="print the tables of a results file and exit")
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="runs of each point on the same engine (fresh prompts each, the same for every "
        "arm); the results give the median and each figure's min and max",
    )  # fmt: skip
    ap.add_argument(
        "--saturation-from",
        default=None,
        help="a results file whose measured saturation rates the rate points use (to add arms "
        "to an earlier run on the same machine kind); default: the first arm's `inf` points",
    )
    a = ap.parse_args()
    if a.print:
        print_tables(json.loads(Path(a.print).read_text()))
        return
    run = Run(a)
    if a.saturation_from:
        run.rates = dict(json.loads(Path(a.saturation_from).read_text())["saturation_req_s"])
        run.res["saturation_req_s"] = dict(run.rates)
        run.res["saturation_from"] = a.saturation_from
    arms = [x for x in a.arms.split(",") if x]
    for arm in arms + [x for x in a.twin_arms.split(",") if x]:
        if arm not in ARMS:
            raise SystemExit(f"unknown arm {arm!r}: one of {', '.join(ARMS)}")
    listed = [w for w in a.workloads.split(",") if w]
    workloads = [w for w in listed if w != "twin"]
    # `twin` runs where it is listed: before the arms when first (a deadline then cuts arms,
    # not the two-engine runs), after them otherwise.
    twin_first = bool(listed) and listed[0] == "twin"
    if twin_first:
        run.run_twin([x for x in a.twin_arms.split(",") if x])
    for i, arm in enumerate(arms):
        run.run_arm(arm, workloads, first_arm=i == 0)
    if "twin" in listed and not twin_first:
        run.run_twin([x for x in a.twin_arms.split(",") if x])
    run.res["finished"] = time.strftime("%H:%M:%S")
    run.save()
    print_tables(run.res)


def print_tables(res: dict) -> None:
    arms = list(res["arms"])
    names: list[str] = []
    for arm in arms:
        for n in res["arms"][arm].get("points", {}):
            if n not in names:
                names.append(n)
    print(f"\n{res['device']} · {res['versions'].get('gpu') or res['versions'].get('cpu')}")
    print("| point | arm | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | goodput | "
          "ext hit | local hit | engine CPU s | tier CPU s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in names:
        for arm in arms:
            p = res["arms"][arm].get("points", {}).get(n)
            if not p:
                continue
            if "not_run" in p or "error" in p:
                print(f"| {n} | {arm} | {p.get('not_run') or p.get('error')} |")
                continue

            def f(k: str, p=p) -> str:  # the median, and the range when there were repeats
                if f"{k}_min" in p:
                    return f"{p.get(k)} ({p[k + '_min']}–{p[k + '_max']})"
                return str(p.get(k))

            print(
                f"| {n} | {arm} | {f('req_per_s')} | {f('out_tok_per_s')} | "
                f"{f('ttft_p50_ms')} | {f('ttft_p99_ms')} | {f('tpot_p50_ms')} | "
                f"{f('goodput_req_per_s')} | {f('external_hit_share')} | "
                f"{p.get('local_hit_share')} | {f('engine_cpu_s')} | {p.get('tier_cpu_s')} |"
            )
    for arm in arms:
        a = res["arms"][arm]
        pr = a.get("probe") or {}
        v = pr.get("verifier") or {}
        print(
            f"{arm}: startup {a.get('startup_s')} s; probe {pr.get('same_outputs')}/"
            f"{pr.get('prompts')} same; verifier checked {v.get('checked')} mismatched "
            f"{v.get('mismatched')}; {a.get('error') or a.get('not_run') or ''}"[:400]
        )
    for arm, p in (res.get("twin") or {}).items():
        print(
            f"twin {arm}: {p.get('req_per_s')} req/s TTFT p50 {p.get('ttft_p50_ms')} p99 "
            f"{p.get('ttft_p99_ms')} ext hit {p.get('external_hit_share')} local "
            f"{p.get('local_hit_share')} {p.get('error') or p.get('not_run') or ''}"[:300]
        )


if __name__ == "__main__":
    main()
