"""Public names defined in private modules take the public module as their home.

A package (`pockjax.train`, `pockjax.prefix`, ...) keeps its implementation in private
modules (`pockjax.train._fit`, `pockjax.prefix._cut`) and its `__init__` hands on the
public names. `claim(globals())` at the end of the facade sets those classes' and
functions' `__module__` to the facade, so tracebacks, reprs and help() say
`pockjax.finetuning.FinetuneError`, a name a user can import, as JAX does for its own
public API. Imports nothing, so the JAX-free runtime can use it.
"""
import inspect

__all__ = ["claim"]


def claim(namespace: dict) -> None:
    """Make the module whose globals are `namespace` the home of the public names in
    its `__all__` that a private module defines.

    Args:
      namespace: the facade module's `globals()` (with `__name__` and `__all__`).
    """
    home = namespace["__name__"]
    for name in namespace.get("__all__", ()):
        obj = namespace.get(name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        module = getattr(obj, "__module__", "") or ""
        if module.startswith("pockjax.") and any(p.startswith("_") for p in module.split(".")[1:]):
            obj.__module__ = home
