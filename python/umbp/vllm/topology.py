"""The engine's shape as the connector sees it: key namespace, ranks, block size, cache groups.

Both sides of `UMBPStoreConnector` derive one `Topology` from the same vLLM configuration, so
the scheduler and every worker agree on the namespace, the number of workers and the groups a
load restores. Shapes the connector cannot serve are refused here, at start-up, by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from umbp.errors import ConfigError
from umbp.vllm.config import ConnectorConfig
from umbp.vllm.namespace import derive_namespace, socket_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Topology:
    namespace: str
    tag: str
    tp_size: int
    pcp_size: int
    dcp_size: int
    dp_rank: int
    block_size: int  # tokens per block hash (the per-rank block size times DCP)
    num_groups: int
    # Groups stored and restored: the prefix-cacheable groups vLLM transfers (vLLM's own
    # `prefix_cacheable_group_ids`, which is also what it expects a load to restore).
    load_groups: tuple[int, ...] = (0,)
    # Of those, groups of recurrent state (Mamba, gated delta nets) in vLLM's `align` mode: a
    # block holds the state after its last token, so only single boundaries are stored and a
    # hit ends where every such group holds one.
    state_groups: tuple[int, ...] = ()
    eagle_drop: bool = False  # EAGLE-style drafting: drop the last block of a hit
    per_request_failures: bool = False  # several groups: block ids are ambiguous

    @property
    def force_async_loads(self) -> bool:
        # State groups: layers read restored state before a synchronous load could land.
        return self.per_request_failures or bool(self.state_groups)

    @property
    def attention_groups(self) -> tuple[int, ...]:
        """Load groups whose blocks hold the KV of their own tokens."""
        return tuple(g for g in self.load_groups if g not in self.state_groups)

    nnodes: int = 1  # hosts the engine's workers are spread over
    # Consecutive TP ranks whose KV is identical (MLA: all of them). Their keys carry the first
    # rank of the group, so they name one object per block. 1: every rank its own.
    tp_replicas: int = 1
    # Whether the ranks of a replica group share one pool (standalone mode: the server's): the
    # first rank stores, the others skip, all of them load. Embedded mode: every rank keeps its
    # own pool and stores into it, and only the first writes to the remote tier.
    replicas_share_pool: bool = True

    @property
    def workers(self) -> int:
        return self.tp_size * self.pcp_size

    def key_tp(self, tp: int) -> int:
        """The TP rank the keys of TP rank `tp` carry: the first of its replica group."""
        return tp - tp % self.tp_replicas

    def stores_blocks(self, tp: int) -> bool:
        """Whether TP rank `tp` stores blocks in its pool (every rank with a pool of its own;
        of a replica group sharing one, the first)."""
        return not self.replicas_share_pool or self.writes_shared(tp)

    def writes_shared(self, tp: int) -> bool:
        """Whether TP rank `tp` writes the objects its replica group shares (the first rank
        does): the node pool in standalone mode, the remote tier in both modes."""
        return tp % self.tp_replicas == 0

    @property
    def workers_per_host(self) -> int:
        return max(1, -(-self.workers // max(1, self.nnodes)))


@dataclass(frozen=True)
class Ranks:
    """One worker's position in the engine: its TP, PCP and DCP ranks."""

    tp: int = 0
    pcp: int = 0
    dcp: int = 0

    def worker(self, topo: Topology) -> int:
        """The worker's index among the engine's `topo.workers` (its lookup socket)."""
        return self.tp + topo.tp_size * self.pcp


def engine_topology(
    cfg: ConnectorConfig, vllm_config: VllmConfig, kv_cache_config: Any
) -> Topology:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size > 1:
        raise ConfigError(
            f"UMBPStoreConnector does not support pipeline parallelism "
            f"(pipeline_parallel_size={pc.pipeline_parallel_size}); use tensor parallelism, "
            "or run without the connector"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        raise ConfigError("UMBPStoreConnector needs a KV cache with at least one cache group")
    dcp = getattr(pc, "decode_context_parallel_size", 1) or 1
    for i, g in enumerate(groups):
        modes = {getattr(s, "mamba_cache_mode", "none") for s in state_specs(g.kv_cache_spec)}
        if modes - {"align"}:
            raise ConfigError(
                f"UMBPStoreConnector: KV cache group {i} ({state_spec_name(g.kv_cache_spec)}) "
                f"holds Mamba / linear-attention state in mamba_cache_mode="
                f"{sorted(modes - {'align'})[0]!r}, which vLLM cannot prefix-cache; enable "
                "prefix caching with --mamba-cache-mode align (the default with prefix "
                "caching on)"
            )
    sizes = {tokens_per_block(g.kv_cache_spec, dcp) for g in groups}
    if len(sizes) != 1 or None in sizes:
        raise ConfigError(
            "UMBPStoreConnector needs every KV cache group to use one block size "
            f"(got {sorted(map(str, sizes))}); hybrid models with mixed block sizes are not "
            "supported: run them without the connector"
        )
    block_size = sizes.pop()
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, block_size):
        raise ConfigError(
            f"UMBPStoreConnector stores whole {block_size}-token blocks but vLLM hashes every "
            f"{hash_block_size} tokens; unset `prefix_match_unit` (--prefix-match-unit)"
        )
    if cfg.enable_partial_hash_hits:
        unit = getattr(vllm_config.cache_config, "prefix_match_unit", None)
        if unit not in (None, block_size):
            raise ConfigError(
                f"option `enable_partial_hash_hits`: the engine matches prefixes every {unit} "
                f"tokens but UMBP stores whole {block_size}-token blocks; set it to false"
            )
    load_groups = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    if load_groups is None:  # older vLLM: every group that takes part in prefix caching
        load_groups = [
            i
            for i, g in enumerate(groups)
            if getattr(g, "enable_kv_transfer", True)
            and getattr(g.kv_cache_spec, "prefix_cacheable", True)
        ]
    if not load_groups:
        raise ConfigError(
            "UMBPStoreConnector: no KV cache group of this model takes part in prefix caching, "
            "so there is nothing to offload; run without the connector"
        )
    state_groups = []
    for i in load_groups:
        spec = groups[i].kv_cache_spec
        state = state_spec_name(spec)
        if state is None:
            continue
        layers = list(getattr(groups[i], "layer_names", []))
        what = (
            f"KV cache group {i} ({state}, layers {', '.join(layers[:3])}"
            f"{', ...' if len(layers) > 3 else ''})"
        )
        for s in state_specs(spec):
            if getattr(s, "num_speculative_blocks", 0):
                raise ConfigError(
                    f"UMBPStoreConnector: {what} keeps speculative-decoding state blocks; "
                    "hybrid Mamba models with speculative decoding are not supported yet: "
                    "run them without the connector or without speculative decoding"
                )
        if dcp > 1 or getattr(pc, "prefill_context_parallel_size", 1) > 1:
            raise ConfigError(
                f"UMBPStoreConnector: {what} holds Mamba / linear-attention state, which "
                "context parallelism (DCP/PCP) does not split by block; run without it"
            )
        state_groups.append(i)
    if state_groups and eagle_drops_last_block(vllm_config):
        raise ConfigError(
            "UMBPStoreConnector: hybrid Mamba / linear-attention models with EAGLE drafting "
            "are not supported yet (the dropped block would need the state before it); run "
            "without the connector or without the drafter"
        )
    namespace = cfg.key_namespace or derive_namespace(vllm_config, kv_cache_config)
    pcp = getattr(pc, "prefill_context_parallel_size", 1) or 1
    replicas = tp_replicas(kv_cache_config, groups, pc.tensor_parallel_size, pcp, dcp)
    return Topology(
        namespace=namespace,
        tag=socket_tag(namespace, cfg.lookup_instance),
        tp_size=pc.tensor_parallel_size,
        pcp_size=pcp,
        dcp_size=dcp,
        dp_rank=dp_index(pc),
        block_size=block_size,
        num_groups=len(groups),
        load_groups=tuple(load_groups),
        state_groups=tuple(state_groups),
        # With lookahead block hashes (vLLM 0.34, EAGLE / MTP) a hash covers the tokens after
        # its block too, and vLLM keeps the last block of a hit, as the connector then does.
        eagle_drop=eagle_drops_last_block(vllm_config) and not hash_lookahead_tokens(vllm_config),
        per_request_failures=len(groups) > 1,
        nnodes=int(getattr(pc, "nnodes", 1) or 1),
        tp_replicas=replicas,
        replicas_share_pool=cfg.mode == "standalone",
    )


def tp_replicas(kv_cache_config: Any, groups: list[Any], tp: int, pcp: int, dcp: int) -> int:
    """How many consecutive TP ranks hold identical KV in every layer of every group.

    vLLM says so itself (`KVCacheConfig.kv_tp_replicas`, 0.32 and later: from each layer
    spec's `max_tp_shards`, 1 for multi-head latent attention, so MLA's latent cache is the
    same on all TP ranks); the scheduler's config is a copy of a worker's, so both sides agree.
    A vLLM without the field: a model whose every layer is `MLAAttentionSpec` (DeepSeek
    V2/V3, Kimi K2). With context parallelism (DCP splits MLA's tokens across the ranks, PCP
    is untested with it) every rank keeps its own objects, as vLLM's own offloading connector
    does."""
    if tp <= 1 or pcp > 1 or dcp > 1:
        return 1
    given = getattr(kv_cache_config, "kv_tp_replicas", None)
    if given is not None:
        given = int(given)
        return given if given >= 1 and tp % given == 0 else 1
    specs = [s for g in groups for s in layer_specs(g.kv_cache_spec)]
    if specs and all(any(c.__name__ == "MLAAttentionSpec" for c in type(s).__mro__) for s in specs):
        return tp
    return 1


def layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group's spec (`UniformTypeKVCacheSpecs`), or the spec."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) and inner else [spec]


def state_specs(spec: Any) -> list[Any]:
    """The layer specs of `spec` (or `spec` itself) that describe recurrent state (vLLM's
    `MambaSpec`: Mamba, gated delta nets, short convolutions)."""
    return [s for s in layer_specs(spec) if any(c.__name__ == "MambaSpec" for c in type(s).__mro__)]


def state_spec_name(spec: Any) -> str | None:
    """The class name of the state spec in `spec` (see `state_specs`), else None."""
    found = state_specs(spec)
    return type(found[0]).__name__ if found else None


def dp_index(pc: Any) -> int:
    """The engine's data-parallel rank. vLLM resets `data_parallel_rank` to 0 in every engine
    of a dense model (its DP engines are independent) and keeps the real rank in
    `data_parallel_index`; older vLLM has only the rank."""
    index = getattr(pc, "data_parallel_index", None)
    if index is None:
        index = getattr(pc, "data_parallel_rank", 0)
    return int(index or 0)


def tokens_per_block(spec: Any, dcp: int) -> int | None:
    """Tokens one block hash covers: with decode context parallelism a block of `block_size`
    tokens per rank spans `block_size × dcp` tokens (vLLM's `resolve_dcp_kv_block_size`)."""
    size = getattr(spec, "block_size", None)
    if size is None:
        return None
    try:
        from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size
    except ImportError:  # older vLLM
        return size * (dcp if getattr(spec, "dcp_sharded", True) else 1)
    return resolve_dcp_kv_block_size(spec, dcp)


def eagle_drops_last_block(vllm_config: Any) -> bool:
    """Whether vLLM's own prefix cache drops the last matched block (EAGLE-style drafters
    recompute it to rebuild their hidden states)."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    check = getattr(spec, "use_eagle_block_drop", None) or getattr(spec, "use_eagle", None)
    return bool(check()) if callable(check) else False


def hash_lookahead_tokens(vllm_config: Any) -> int:
    """How many tokens after a block its hash also covers (vLLM 0.34's lookahead block
    hashes, on with EAGLE / MTP drafting where the connector declares them; 0 otherwise and
    before 0.34)."""
    return int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
