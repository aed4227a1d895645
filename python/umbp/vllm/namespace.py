"""Key namespaces and lookup socket names, derived from the engine's configuration.

The namespace covers everything that makes two engines' KV bytes differ for the same block
hash: the model and revision, the effective model config (dtype, quantization, the HF config
with overrides applied), the KV layout and cache groups, the TP/PCP/DCP topology, the draft
model, and random weights (`load_format="dummy"`: its KV is not the checkpoint's). The
data-parallel rank is deliberately left out so DP ranks share objects.

What it leaves out on purpose: settings that change only the rounding of the same computation
(torch.compile or eager, CUDA graphs, batch sizes, attention backends). Engines that differ
only there share objects, as vLLM's own prefix cache shares blocks computed in different
batches; a block restored from another such engine can differ from this engine's own result
in its last bits (see docs/vllm.md, "Exactness").
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
from typing import Any


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except TypeError:
        if isinstance(obj, dict):
            return {str(k): _jsonable(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [_jsonable(v) for v in obj]
        return repr(obj)


def scheduler_spec(spec: Any) -> Any:
    """The group spec as the scheduler sees it.

    vLLM hands the scheduler a copy of a worker's KV cache config in which a group of mixed
    layer specs (`UniformTypeKVCacheSpecs`) is replaced by its first layer's spec
    (`generate_scheduler_kv_cache_config`). Both sides describe a group by this spec, so they
    derive one namespace (and one socket name); the per-layer specs follow from the model's
    HF config, which is part of the namespace.
    """
    specs = getattr(spec, "kv_cache_specs", None)
    if isinstance(specs, dict) and specs:
        return next(iter(specs.values()))
    return spec


def spec_fields(spec: Any) -> dict[str, Any]:
    """What decides a cache group's bytes and their meaning: the spec's type and every field
    of it that is not at its declared default (dtype, heads, head sizes, block size, window,
    state shapes, ...). A field a newer vLLM adds at its default (0.34's
    `kv_head_major_slots`, `state_alignment`) leaves the namespace as it was, so engines of
    two vLLM releases with the same layout share objects; a field set to anything else splits
    it, as it may change the bytes."""
    out: dict[str, Any] = {"type": type(spec).__name__}
    if not dataclasses.is_dataclass(spec):
        out["repr"] = repr(spec)
        return out
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name, None)
        if f.default is not dataclasses.MISSING and _same(value, f.default):
            continue
        if f.default_factory is not dataclasses.MISSING and _same(value, f.default_factory()):
            continue
        out[f.name] = _canonical(value)
    return out


def _canonical(value: Any) -> Any:
    """Enum members by class and name (vLLM 0.34 made some enums `StrEnum`s, whose JSON
    would otherwise be their value where 0.33's was their repr)."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return _jsonable(value)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # e.g. tensors: never equal to a default
        return False


#: HF config entries that say where and by which transformers the config was read, not what
#: the model computes (they change with every transformers release).
_HF_BOOKKEEPING = ("transformers_version",)


def hf_fields(hf_dict: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v for k, v in hf_dict.items() if k not in _HF_BOOKKEEPING and not str(k).startswith("_")
    }


def namespace_fields(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The inputs of the derived namespace."""
    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    pc = vllm_config.parallel_config
    hf = getattr(mc, "hf_config", None)
    hf_dict = hf.to_dict() if hf is not None and hasattr(hf, "to_dict") else {}
    spec = getattr(vllm_config, "speculative_config", None)
    draft = getattr(spec, "model", None) if spec is not None else None
    groups = []
    for g in getattr(kv_cache_config, "kv_cache_groups", []) or []:
        groups.append(
            {"layers": list(g.layer_names), "spec": spec_fields(scheduler_spec(g.kv_cache_spec))}
        )
    fields = {
        "format": "umbp-kv-v2",
        "model": mc.model,
        "revision": getattr(mc, "revision", None),
        "dtype": str(getattr(mc, "dtype", None)),
        "quantization": getattr(mc, "quantization", None),
        "hf_config": _jsonable(hf_fields(hf_dict)),
        "hf_overrides": _jsonable(getattr(mc, "hf_overrides", None)),
        "cache_dtype": str(getattr(cc, "cache_dtype", None)),
        "block_size": getattr(cc, "block_size", None),
        "kv_cache_layout": getattr(cc, "kv_cache_layout", None),
        "cache_groups": groups,
        "tp": pc.tensor_parallel_size,
        "pcp": getattr(pc, "prefill_context_parallel_size", 1),
        "dcp": getattr(pc, "decode_context_parallel_size", 1),
        "draft_model": draft,
    }
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    if lookahead:
        # Block hashes that also cover the next tokens (vLLM 0.34, EAGLE / MTP): other keys
        # for the same bytes; only added here, so other engines' namespaces are as before.
        fields["hash_lookahead_tokens"] = lookahead
    load = getattr(getattr(vllm_config, "load_config", None), "load_format", None)
    if str(getattr(load, "value", load)) == "dummy":
        # Random weights: their KV must never be served to (or taken from) an engine of the
        # same model with its real weights. Only added here, so real engines' namespaces are
        # as before.
        fields["weights"] = "dummy"
    return fields


def derive_namespace(vllm_config: Any, kv_cache_config: Any) -> str:
    """`<model name>-<16 hex digits of the fields' digest>`."""
    fields = namespace_fields(vllm_config, kv_cache_config)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    base = str(fields["model"]).rstrip("/").rsplit("/", 1)[-1]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", base)[:40] or "model"
    return f"{base}-{digest}"


def socket_tag(namespace: str, lookup_instance: str) -> str:
    """A short tag naming one engine's lookup sockets (namespace + lookup_instance)."""
    return hashlib.sha256(f"{namespace}\0{lookup_instance}".encode()).hexdigest()[:12]
