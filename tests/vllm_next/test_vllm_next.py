"""The connector against the Python objects of vLLM releases that cannot run here (0.33.0
and 0.34.0: their GPU builds need other torch versions, and there is no CPU build of them
here): each release's pure-Python part is unpacked by `scripts/vllm_overlay.py` and put first
on PYTHONPATH (`./scripts/test.sh` does both, once per release), over the venv's torch and
vLLM CPU 0.32.

    PYTHONPATH=$(python scripts/vllm_overlay.py --version 0.34.0) python -m pytest tests/vllm_next

Skipped when another vLLM is first on the path; tests of 0.34's additions skip on 0.33.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
RELEASES = ("0.33.0", "0.34.0")
if vllm.__version__ not in RELEASES:
    pytest.skip(
        f"needs the Python files of vLLM {' or '.join(RELEASES)} first on PYTHONPATH (found "
        f"{vllm.__version__}): PYTHONPATH=$(python scripts/vllm_overlay.py --version ...)",
        allow_module_level=True,
    )
V034 = vllm.__version__ == "0.34.0"
needs_034 = pytest.mark.skipif(not V034, reason="vLLM 0.34's additions")

from vllm.config.kv_transfer import KVTransferConfig  # noqa: E402

from umbp.errors import ConfigError  # noqa: E402
from umbp.vllm import plugin  # noqa: E402
from umbp.vllm.config import ConnectorConfig  # noqa: E402
from umbp.vllm.connector import UMBPStoreConnector  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hook_signatures import check_overridden_hooks  # noqa: E402

#: The same specs, built with the arguments vLLM 0.32, 0.33 and 0.34 have in common.
SPECS = """
import torch
from vllm.v1 import kv_cache_interface as k
from umbp.vllm.namespace import spec_fields
bf16 = torch.bfloat16
specs = {
    "full": k.FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=bf16),
    "window": k.SlidingWindowSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=bf16, sliding_window=256
    ),
    "mla": k.MLAAttentionSpec(
        block_size=64, num_kv_heads=1, head_size=576, dtype=bf16, cache_dtype_str="auto"
    ),
    "mamba": k.MambaSpec(
        block_size=256, shapes=((3, 512), (4, 64, 64)), dtypes=(bf16, torch.float32),
        mamba_cache_mode="align",
    ),
}
print(json.dumps({n: spec_fields(s) for n, s in specs.items()}))
"""


def test_every_overridden_hook_matches_this_release():
    checked = set(check_overridden_hooks(UMBPStoreConnector))
    # 0.33's additions (0.34 calls the last two outside sleep mode too), then 0.34's.
    assert {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"} <= checked
    new = {"kv_cache_access", "may_load_async", "supports_lookahead_block_hashes"}
    assert new <= checked if V034 else not new & checked


def ktc(extra: dict) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="UMBPStoreConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )


@needs_034
def test_kv_cache_access_per_mode_and_option(monkeypatch):
    """vLLM 0.34 asks the connector class how it reaches the KV cache before allocating it.
    Embedded mode copies in the worker (`IN_PROCESS`: any allocation, the extensible cache
    included). Standalone mode follows `kv_cache_export`: `fd` (`auto` on CUDA) asks for
    exportable memory, which vLLM allocates with POSIX descriptor handles, the handle type
    tests/gpu_vllm/test_extensible_cache.py gives vLLM 0.34's allocator on the GPU; `ipc` (`auto`
    elsewhere, where vLLM refuses `EXPORTS_FD`) the cache as 0.33 allocated it."""
    from vllm.config.kv_transfer import KVCacheAccess
    from vllm.platforms import current_platform

    plugin.register()  # takes vLLM 0.34's own UMBPStoreConnector name over, with a warning
    ep = {"mode": "standalone", "endpoint": "unix:///tmp/umbp.sock"}
    embedded = ktc({"capacity_bytes": 1 << 30})
    assert embedded.kv_cache_access() == KVCacheAccess.IN_PROCESS
    assert not embedded.registers_kv_cache_memory()
    assert ktc(ep).kv_cache_access() == KVCacheAccess.LEGACY_IPC  # auto, off CUDA
    assert ktc({**ep, "kv_cache_export": "ipc"}).kv_cache_access() == KVCacheAccess.LEGACY_IPC
    fd = ktc({**ep, "kv_cache_export": "fd"})
    assert fd.kv_cache_access() == KVCacheAccess.EXPORTS_FD
    assert fd.registers_kv_cache_memory()  # vLLM maps each layer segment as one allocation
    # vLLM's own helper turns the declaration into the allocator's handle types.
    from vllm.utils.vmm_driver import MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR as POSIX_FD

    assert POSIX_FD == 0x1  # what the GPU test passes
    handle_types = _export_handle_types()
    assert handle_types(fd) == POSIX_FD and handle_types(embedded) == 0
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    assert ktc(ep).kv_cache_access() == KVCacheAccess.EXPORTS_FD  # auto, on CUDA
    assert ktc({**ep, "kv_cache_export": "ipc"}).kv_cache_access() == KVCacheAccess.LEGACY_IPC
    # An option that does not parse is left for the connector's start-up to refuse by name.
    assert ktc({**ep, "kv_cache_export": "dmabuf"}).kv_cache_access() == KVCacheAccess.LEGACY_IPC
    with pytest.raises(ConfigError, match="kv_cache_export"):
        ConnectorConfig.parse({**ep, "kv_cache_export": "dmabuf"})


def _export_handle_types():
    """vLLM 0.34's `kv_cache_export_handle_types(vllm_config)`, over a bare config."""
    from types import SimpleNamespace

    from vllm.v1.worker.extensible_kv_cache import kv_cache_export_handle_types

    return lambda cfg: kv_cache_export_handle_types(SimpleNamespace(kv_transfer_config=cfg))


def test_a_cache_shared_with_vllm_032_engines():
    """The namespace describes a cache group by the spec fields that are not at their
    defaults: 0.34's new fields (`kv_head_major_slots`, `is_draft`, `state_alignment`, ...)
    at their defaults and its `StrEnum`s leave it as 0.32 made it, so engines of 0.32, 0.33
    and 0.34 with the same layout share objects."""
    here = subprocess.run(
        [sys.executable, "-c", "import json\n" + SPECS], capture_output=True, text=True
    )
    assert here.returncode == 0, here.stderr[-2000:]
    env = dict(os.environ)
    overlay = str(Path(vllm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != Path(overlay)
    )
    before = subprocess.run(
        [sys.executable, "-c", "import json, vllm\nassert vllm.__version__ == '0.32.0'\n" + SPECS],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert before.returncode == 0, before.stderr[-2000:]
    new, old = json.loads(here.stdout.splitlines()[-1]), json.loads(before.stdout.splitlines()[-1])
    assert new == old
    assert new["mamba"]["mamba_cache_mode"] == "align" and new["full"]["head_size"] == 128


@needs_034
def test_vllm_034_turns_lookahead_hashes_on_with_this_connector():
    """0.34 resolves the hash lookahead from the connector class's answer (0.33 turned it off
    for every connector): with an EAGLE drafter and this connector, block hashes cover the
    next token (`num_prefill_lookahead_tokens`)."""
    import types

    from vllm.config import VllmConfig

    plugin.register()
    spec = types.SimpleNamespace(
        use_eagle_block_drop=lambda: True, disable_lookahead_block_hashes=False
    )
    fake = types.SimpleNamespace(
        speculative_config=spec,
        kv_transfer_config=ktc({"capacity_bytes": 1 << 30}),
        num_prefill_lookahead_tokens=1,
    )
    assert UMBPStoreConnector.supports_lookahead_block_hashes(fake.kv_transfer_config)
    assert VllmConfig._resolve_num_hash_lookahead_tokens(fake) == 1
