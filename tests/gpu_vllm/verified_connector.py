"""`UMBPStoreConnector` with the test observers of verifier.py installed in the process vLLM
builds it in: the byte verifier, and the call tracer when `$UMBP_TRACE_OUT` is set. Named in a
test engine's config as `kv_connector="VerifiedUMBPStoreConnector"`,
`kv_connector_module_path="verified_connector"` (this folder on PYTHONPATH)."""

from __future__ import annotations

import os

from verifier import Tracer, Verifier

from umbp.vllm.connector import UMBPStoreConnector

VERIFIER = Verifier()
if os.environ.get("UMBP_VERIFY", "1") == "1":
    VERIFIER.install()
Tracer().install()


class VerifiedUMBPStoreConnector(UMBPStoreConnector):
    """The product's connector, unchanged: only its worker and scheduler sides are observed."""
