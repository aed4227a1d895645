"""vLLM integration: `UMBPStoreConnector`, a V1 KV connector over the UMBP store.

Importing this package does not import vLLM; `umbp.vllm.connector` does.
"""

CONNECTOR_NAME = "UMBPStoreConnector"
CONNECTOR_MODULE = "umbp.vllm.connector"

__all__ = ["CONNECTOR_NAME", "CONNECTOR_MODULE"]
