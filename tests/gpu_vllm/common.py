"""What the real-engine GPU tests and the TTFT benchmark share: model folders (config only:
the engine loads dummy weights, nothing is downloaded), prompts, the standalone server and the
engine process.

Needs vLLM's CUDA build importable (the offline bundle: `scripts/gpu-device-run.sh` with
`VLLM_SITE`), PyTorch with a CUDA device, and for standalone mode the server binary
(`$UMBP_SERVER_BIN` or on PATH).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent

#: Model shapes (Hugging Face config fields). `llama8b` is Llama-3-8B's shape (32 layers, 8 KV
#: heads of 128: 64 KiB of K and V per layer and 16-token block at bf16, 2 MiB per block);
#: `llama8b-8l` the same layers but 8 of them (quicker to start, the same pieces);
#: `swa` alternates sliding-window and full attention (two KV cache groups); `mla` is
#: DeepSeek-V2-Lite's latent attention (one 576-wide latent per token and layer).
SHAPES: dict[str, dict] = {
    "llama8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=500000.0,
    ),
}
SHAPES["llama8b-8l"] = dict(SHAPES["llama8b"], num_hidden_layers=8)
#: A few MiB of weights: the harness's own check on vLLM CPU (tests/vllm/test_harness.py).
SHAPES["tiny"] = dict(
    SHAPES["llama8b"],
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
#: As `tiny`, with Llama-8B-sized KV heads (32 KiB of KV per token): the serving bench's shape on
#: vLLM CPU, whose small GPU-pool stand-in is then a tensor of its own mapping (standalone mode
#: shares only page-aligned memory; vLLM CPU allocates small caches on the heap).
SHAPES["tiny-kv"] = dict(
    SHAPES["tiny"], num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=128
)
SHAPES["swa"] = dict(
    SHAPES["llama8b-8l"],
    architectures=["MistralForCausalLM"],
    model_type="mistral",
    sliding_window=1024,
    layer_types=["sliding_attention", "full_attention"] * 4,
)
SHAPES["mla"] = dict(
    architectures=["DeepseekV2ForCausalLM"],
    model_type="deepseek_v2",
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=4,
    first_k_dense_replace=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    rope_theta=10000.0,
)


#: The word-level tokenizer `model_dir` writes beside each config: token i (i >= 3) is the word
#: `w<i>`, words are split on whitespace and decoded joined by spaces, so any list of ids
#: decodes to a text that encodes back to the same ids (`vllm serve` and `vllm bench serve`
#: send text; no hub tokenizer is needed).
SPECIALS = ("<unk>", "<s>", "</s>")
VOCAB = 32000


def write_tokenizer(out: Path, max_len: int) -> None:
    added = [
        dict(id=i, content=t, single_word=False, lstrip=False, rstrip=False, normalized=False,
             special=True)
        for i, t in enumerate(SPECIALS)
    ]  # fmt: skip
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": max_len,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))


def model_dir(root: Path, shape: str, max_len: int = 40960) -> str:
    """Writes `config.json` of `shape` under `root/shape`, with the word-level tokenizer of
    `write_tokenizer`, and returns the folder."""
    out = root / shape
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, max_len)
    cfg = dict(
        SHAPES[shape],
        vocab_size=VOCAB,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        hidden_act="silu",
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(out)


def prompts(n: int, length: int, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """`n` token-id prompts of `length` tokens whose first `shared` tokens are the same."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 32000) for _ in range(shared)]
    return [head + [rng.randrange(3, 32000) for _ in range(length - shared)] for _ in range(n)]


def server_bin() -> str | None:
    return os.environ.get("UMBP_SERVER_BIN") or shutil.which("umbp_standalone_server")


class Server:
    """A real `umbp_standalone_server` on a Unix socket under `folder`."""

    def __init__(self, folder: Path, capacity: str = "48GiB", extra: list[str] | None = None):
        self.folder = folder
        self.sock = folder / "umbp.sock"
        self.log = folder / "server.log"
        self.args = [server_bin() or "umbp_standalone_server", "--address", str(self.sock)]
        self.args += ["--capacity", capacity] + (extra or [])
        if os.environ.get("UMBP_TEST_SERVER_LOG"):  # e.g. "info,umbp_copy=debug"
            self.args += ["--log", os.environ["UMBP_TEST_SERVER_LOG"]]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log, "a") as log:
            # Never the caller's stdout: a pipe held by a server outliving the caller hangs it.
            self.proc = subprocess.Popen(
                self.args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.time() + 60
        while not self.sock.exists() and time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        if not self.sock.exists():
            raise RuntimeError(f"server did not listen: {self.log.read_text()[-2000:]}")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.sock.unlink(missing_ok=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    @property
    def endpoint(self) -> str:
        return f"unix://{self.sock}"


def engine_env(log: Path, sc: dict) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        UMBP_VERIFY_OUT=str(log.with_suffix(".verify.json")),
        PYTHONPATH=os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p),
    )
    env["UMBP_VERIFY"] = "1" if sc.get("verify", True) else "0"
    if sc.get("corrupt_loads"):
        env["UMBP_VERIFY_CORRUPT"] = "1"
    if sc.get("verify_seed"):
        env["UMBP_VERIFY_SEED"] = sc["verify_seed"]
    if sc.get("trace"):
        env["UMBP_TRACE_OUT"] = sc["trace"]
    if not sc.get("multiprocessing", True):
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if sc.get("spin_events"):
        env["UMBP_TEST_SPIN_EVENTS"] = "1"
    return env


_LIVE: set[subprocess.Popen] = set()


def _kill_live(*_args) -> None:
    """Kills every engine process group still running (a caller killed by a timeout must not
    leave an engine holding the GPU for the next one)."""
    for p in list(_LIVE):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    _LIVE.clear()


def _on_term(signum, _frame) -> None:
    _kill_live()
    raise SystemExit(128 + signum)


atexit.register(_kill_live)
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_term)


def start_engine(scenario: dict, log: Path) -> subprocess.Popen:
    """Starts gpu_engine.py on `scenario` in its own process session."""
    sc = dict(scenario)
    log.with_suffix(".verify.json").unlink(missing_ok=True)
    scenario_file = log.with_suffix(".scenario.json")  # prompts are too long for argv
    scenario_file.write_text(json.dumps(sc))
    with open(log, "w") as out:  # the child keeps its own descriptor
        p = subprocess.Popen(
            [sys.executable, str(HERE / "gpu_engine.py"), str(scenario_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=engine_env(log, sc),
            start_new_session=True,
            text=True,
        )
    _LIVE.add(p)
    return p


def finish_engine(proc: subprocess.Popen, log: Path, timeout: float = 600) -> dict:
    """Waits for the engine's result line, then kills its process group."""
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            if proc.poll() is not None:
                break
            if "UMBP_RESULT " in log.read_text(errors="replace"):
                break
            time.sleep(0.2)
        time.sleep(0.2)
        text = log.read_text(errors="replace")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        _LIVE.discard(proc)
    for line in text.splitlines():
        if line.startswith("UMBP_RESULT "):
            return json.loads(line[len("UMBP_RESULT ") :])
    raise RuntimeError(f"the engine gave no result (rc {proc.returncode}):\n{text[-6000:]}")


def run_engine(scenario: dict, log: Path, timeout: float = 600) -> dict:
    return finish_engine(start_engine(scenario, log), log, timeout)


def passes_of(result: dict, name: str) -> dict[int, dict]:
    """Prompt index -> that prompt's record of pass `name`."""
    return {p["prompt"]: p for p in result["passes"] if p["pass"] == name}
