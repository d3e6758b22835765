"""Scoped rebinding of the global names an upstream function looks up, and Ray actor classes like upstream's."""

import contextlib
import sys
from types import FunctionType, ModuleType
from typing import Any, Iterator, Union


@contextlib.contextmanager
def swapped_globals(owner: Union[ModuleType, FunctionType], **replacements: Any) -> Iterator[None]:
    """Rebind ``replacements`` in the globals seen by ``owner`` (a module, or the function about to be called)
    for the duration of the block, then restore the originals.

    For a function both its ``__globals__`` and its defining module are patched: Ray ships OpenRLHF's
    ``@ray.remote`` classes to workers by value, so in a worker their methods' ``__globals__`` is a copy of the
    module's namespace, not the module's own (rebinding the module attribute alone is invisible to them).
    """
    if isinstance(owner, ModuleType):
        namespaces = [vars(owner)]
    else:
        namespaces = [owner.__globals__]
        module = sys.modules.get(owner.__module__)
        if module is not None and vars(module) is not owner.__globals__:
            namespaces.append(vars(module))
    saved = [(ns, {name: ns[name] for name in replacements}) for ns in namespaces]
    for ns in namespaces:
        ns.update(replacements)
    try:
        yield
    finally:
        for ns, originals in saved:
            ns.update(originals)


def remote_like(upstream_actor_class, cls):
    """``ray.remote`` with the same default options as the upstream actor class."""
    import ray

    options = dict(getattr(upstream_actor_class, "_default_options", None) or {})
    return ray.remote(**options)(cls) if options else ray.remote(cls)
