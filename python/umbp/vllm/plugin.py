"""The `vllm.general_plugins` entry point: registers `UMBPStoreConnector` with vLLM.

vLLM runs general plugins in every process it starts. Registration is idempotent: a second call
is a no-op. vLLM 0.33 ships an in-tree class of the same name (for AMD's MORI runtime), which it
does not register by name; should a vLLM register one, this plugin takes the name over, so that
the documented `"kv_connector": "UMBPStoreConnector"` keeps meaning this package, and says so at
WARNING with the two ways to keep vLLM's class (docs/vllm.md, "The connector's name").
"""

from __future__ import annotations

import importlib
import inspect
import logging

from umbp.vllm import CONNECTOR_MODULE, CONNECTOR_NAME

logger = logging.getLogger("umbp.vllm")

#: The plugin's name in `vllm.general_plugins` (pyproject.toml), as `VLLM_PLUGINS` lists it.
PLUGIN_NAME = "umbp"


def _ours() -> type:
    module = importlib.import_module(CONNECTOR_MODULE)
    return module.UMBPStoreConnector


_ours._umbp_loader = True  # type: ignore[attr-defined]


def _module_of(loader: object) -> str | None:
    """The module a vLLM registry loader imports (vLLM's `register_connector` closes over
    `module_path`), or None when it cannot be told."""
    try:
        found = inspect.getclosurevars(loader).nonlocals.get("module_path")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return found if isinstance(found, str) and found else None


def _takeover_message(existing: object) -> str:
    module = _module_of(existing)
    where = f"vLLM's class in `{module}`" if module else "the class vLLM registered"
    keep = (
        f'set "kv_connector_module_path": "{module}" in --kv-transfer-config'
        if module
        else 'set "kv_connector_module_path" to the module of vLLM\'s class in --kv-transfer-config'
    )
    return (
        f"umbp: the connector name {CONNECTOR_NAME} now means {CONNECTOR_MODULE}."
        f"{CONNECTOR_NAME} (the umbp package), not {where}. To keep vLLM's class: {keep} (a "
        f"module path takes priority over connector names), or leave `{PLUGIN_NAME}` out of "
        "VLLM_PLUGINS so that this plugin does not run"
    )


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
        # Another class holds the name (an in-tree one): take it over, lazily, and say so
        # loudly: a user who meant vLLM's class gets this package's instead.
        registry[CONNECTOR_NAME] = _ours
        logger.warning("%s", _takeover_message(existing))
        return
    if isinstance(registry, dict):
        registry[CONNECTOR_NAME] = _ours
    else:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
