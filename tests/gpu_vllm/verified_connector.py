"""`UMBPStoreConnector` with the test observers of verifier.py installed in the process vLLM
builds it in: the byte verifier, and the call tracer when `$UMBP_TRACE_OUT` is set. Named in a
test engine's config as `kv_connector="VerifiedUMBPStoreConnector"`,
`kv_connector_module_path="verified_connector"` (this folder on PYTHONPATH)."""

from __future__ import annotations

import os

from verifier import Tracer, Verifier

from umbp.vllm.connector import UMBPStoreConnector

if os.environ.get("UMBP_TEST_SPIN_EVENTS") == "1":
    # The TTFT bench's `standalone-spin` mode: every CUDA event of this process made without
    # blocking sync, as standalone mode's were before (a helper thread's wait spins in the
    # driver), to measure what the blocking-sync event changed in the same run.
    import torch

    class _SpinEvent(torch.cuda.Event):
        def __new__(cls, *args, **kwargs):
            if len(args) > 1:  # (enable_timing, blocking, ...)
                args = (args[0], False, *args[2:])
            else:
                kwargs["blocking"] = False
            return super().__new__(cls, *args, **kwargs)

    torch.cuda.Event = _SpinEvent

VERIFIER = Verifier()
if os.environ.get("UMBP_VERIFY", "1") == "1":
    VERIFIER.install()
Tracer().install()


class VerifiedUMBPStoreConnector(UMBPStoreConnector):
    """The product's connector, unchanged: only its worker and scheduler sides are observed."""
