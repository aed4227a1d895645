"""Where CUDA cannot be loaded, asking for it is an error that names CUDA (never a crash),
and nothing CUDA happens in a store that never sees CUDA memory."""

import os
import subprocess
import sys

import pytest

import umbp
from conftest import KvCache, hashes, umbp_command

NO_DRIVER = {**os.environ, "UMBP_LIBCUDA": "/nonexistent/libcuda.so.1"}


def run(code):
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=NO_DRIVER
    )


def test_register_cuda_memory_raises_cuda_error():
    out = run(
        "import umbp\n"
        "s = umbp.EmbeddedStore(16 << 20, prefault=False)\n"
        "try:\n"
        "    s.register_cuda_memory(0x7f0000000000, 4096, 0)\n"
        "except umbp.CudaError as e:\n"
        "    print('CudaError:', e)\n"
        "assert s.cuda_stats() is None\n"
    )
    assert out.returncode == 0, out.stderr
    assert "CudaError:" in out.stdout and "CUDA" in out.stdout, out.stdout
    assert "/nonexistent/libcuda.so.1" in out.stdout
    assert "panicked" not in out.stderr


def test_umbp_bench_gpu_fails_with_a_message_naming_cuda():
    out = subprocess.run(
        [str(umbp_command()), "bench", "gpu"],
        capture_output=True,
        text=True,
        timeout=60,
        env=NO_DRIVER,
    )
    assert out.returncode != 0
    assert "CUDA" in out.stderr and "panicked" not in out.stderr, out.stderr


def test_stream_applies_to_cuda_layouts_only(store, kb):
    cache = KvCache(fill_seed=3)
    store.register_memory(cache.base, cache.buf.nbytes)
    lid = store.register_layout(cache.layout())
    with pytest.raises(umbp.ConfigError, match="stream"):
        store.store(lid, 0, [1], kb.keys(0, hashes([1])), stream=0)
    # Host copies still work and create nothing CUDA.
    assert store.store(lid, 0, [1], kb.keys(0, hashes([1]))).wait() == ["done"]
    assert store.cuda_stats() is None
    assert not store.wait_pool_registered(10)


def test_cuda_options_are_validated_up_front():
    with pytest.raises(umbp.ConfigError, match="cuda_copy_method"):
        umbp.EmbeddedStore(16 << 20, prefault=False, cuda_copy_method="fast")
    with pytest.raises(umbp.ConfigError, match="cuda_pin_chunk_bytes"):
        umbp.EmbeddedStore(16 << 20, prefault=False, cuda_pin_chunk_bytes=1000)
    with pytest.raises(umbp.ConfigError, match="cuda_max_ctas"):
        umbp.EmbeddedStore(16 << 20, prefault=False, cuda_max_ctas=0)
    s = umbp.EmbeddedStore(16 << 20, prefault=False, cuda_copy_method="dma")
    s.close()
