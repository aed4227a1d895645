"""The `vllm.general_plugins` entry point: registers `UMBPStoreConnector` with vLLM.

vLLM runs general plugins in every process it starts. Registration is idempotent: a second call
is a no-op, and a connector of the same name that is not ours (vLLM 0.33 ships a dormant in-tree
class called `UMBPStoreConnector`) is replaced so that this package stays in control.
"""

from __future__ import annotations

import importlib
import logging

from umbp.vllm import CONNECTOR_MODULE, CONNECTOR_NAME

logger = logging.getLogger("umbp.vllm")


def _ours() -> type:
    module = importlib.import_module(CONNECTOR_MODULE)
    return module.UMBPStoreConnector


_ours._umbp_loader = True  # type: ignore[attr-defined]


def register() -> None:
    """Registers the connector (safe to call any number of times)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:  # vLLM not installed, or too old for V1 connectors
        return
    registry = getattr(KVConnectorFactory, "_registry", None)
    existing = registry.get(CONNECTOR_NAME) if isinstance(registry, dict) else None
    if existing is not None:
        if getattr(existing, "_umbp_loader", False):
            return
        # Another class holds the name (an in-tree one): take it over, lazily.
        registry[CONNECTOR_NAME] = _ours
        logger.info("umbp: %s now resolves to %s", CONNECTOR_NAME, CONNECTOR_MODULE)
        return
    if isinstance(registry, dict):
        registry[CONNECTOR_NAME] = _ours
    else:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
