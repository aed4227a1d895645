"""The check that every hook `UMBPStoreConnector` overrides has the parameters of the vLLM it
runs on (tests/vllm for the installed vLLM CPU, tests/vllm_next for the next release's
objects)."""

from __future__ import annotations

import inspect


def check_overridden_hooks(connector: type) -> list[str]:
    """Asserts that every member of `connector` that vLLM's `KVConnectorBase_V1` (or
    `SupportsHMA`) defines has the same kind and parameters (names, kinds, defaults), and that
    every abstract hook is implemented. Returns the names checked."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    bases = [base.KVConnectorBase_V1]
    if getattr(base, "SupportsHMA", None) is not None:
        bases.append(base.SupportsHMA)
    checked = []
    for name, ours in vars(connector).items():
        theirs_owner = next((b for b in bases if name in vars(b)), None)
        if theirs_owner is None or name.startswith("__"):
            continue
        theirs = inspect.getattr_static(theirs_owner, name)
        assert type(ours) is type(theirs), f"{name}: {type(ours)} vs {type(theirs)}"
        if isinstance(ours, property):
            ours, theirs = ours.fget, theirs.fget
        elif isinstance(ours, (classmethod, staticmethod)):
            ours, theirs = ours.__func__, theirs.__func__
        if not callable(ours):
            continue
        a, b = inspect.signature(ours), inspect.signature(theirs)
        shape = [(p.name, p.kind, p.default) for p in a.parameters.values()]
        want = [(p.name, p.kind, p.default) for p in b.parameters.values()]
        assert shape == want, f"{name}{a} does not match vLLM's {name}{b}"
        checked.append(name)
    abstract = set(getattr(base.KVConnectorBase_V1, "__abstractmethods__", ()))
    assert abstract <= set(checked), abstract - set(checked)
    for name in ("get_num_new_matched_tokens", "update_state_after_alloc", "start_load_kv"):
        assert name in checked
    return checked
