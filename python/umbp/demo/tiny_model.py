"""Builds a small random-weight Llama with a byte-level tokenizer, offline.

No model hub is needed: the tokenizer maps every byte to one token (plus three specials) and
the weights are random, seeded, so every build with the same arguments is identical. Greedy
outputs of such a model are deterministic, which is what the tests and the demo compare.

    python -m umbp.demo.tiny_model OUT_DIR [--layers 4] [--hidden 128] [--seed 0]
        [--sliding-window TOKENS]

With a sliding window, even layers use sliding-window attention and odd layers full attention
(Llama's `layer_types`), so vLLM's hybrid allocator gives the model two KV cache groups.
"""

from __future__ import annotations

import argparse
import json
import os

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>")


def _tokenizer(max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({s: len(SPECIAL_TOKENS) + i for i, s in enumerate(byte_symbols)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=max_len,
    )


def build(
    out_dir: str,
    layers: int = 4,
    hidden: int = 128,
    seed: int = 0,
    max_len: int = 8192,
    sliding_window: int | None = None,
) -> str:
    """Writes the model to `out_dir` (skipped when an identical build is already there)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    stamp = {"layers": layers, "hidden": hidden, "seed": seed, "max_len": max_len, "v": 1}
    if sliding_window is not None:
        stamp["sliding_window"] = sliding_window
    stamp_path = os.path.join(out_dir, "umbp-build.json")
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f) == stamp:
                return out_dir
    tokenizer = _tokenizer(max_len)
    heads = max(1, hidden // 32)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=32,
        max_position_embeddings=max_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wide weights: greedy outputs depend visibly on the whole prompt
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model = model.to(torch.bfloat16)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = "bfloat16"
    if sliding_window is not None:  # read by vLLM's Llama; the weights do not depend on it
        cfg["sliding_window"] = sliding_window
        cfg["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    with open(stamp_path, "w") as f:
        json.dump(stamp, f)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--sliding-window", type=int, default=None)
    a = ap.parse_args()
    print(build(a.out, a.layers, a.hidden, a.seed, a.max_len, a.sliding_window))


if __name__ == "__main__":
    main()
