"""Export the training step through StableHLO to IREE: targets, lowering, artifacts.

Names are imported when first used: `pockjax.export.manifest` and
`pockjax.export.targets` need neither JAX nor the compiler, so the runtime can read
artifacts on a device that has only IREE's runtime.

The package itself is callable: `pockjax.export(trainer, state, batch, target=...)` is
`pockjax.export.export(...)`.
"""
import importlib
import sys
import types

__all__ = ["export", "Artifact", "read_manifest", "TARGETS", "Target", "resolve_target",
           "ExportError"]

_WHERE = {"export": "artifact", "Artifact": "artifact", "read_manifest": "manifest",
          "TARGETS": "targets", "Target": "targets", "resolve_target": "targets",
          "ExportError": "targets"}


# What exporting needs beyond the runtime-only install (`pip install --no-deps`).
_FULL_INSTALL = ("jax", "jaxlib", "optax", "flax")


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'pockjax.export' has no attribute {name!r}")
    try:
        module = importlib.import_module(f"pockjax.export.{_WHERE[name]}")
    except ModuleNotFoundError as e:
        if e.name not in _FULL_INSTALL:
            raise
        raise ModuleNotFoundError(
            f"pockjax.export.{name} needs {e.name}, which this install lacks: a runtime-only "
            "install runs artifacts (pockjax.runtime) but cannot export them. Install the "
            "full pockjax: pip install 'pockjax[export]' (from a checkout: pip install "
            "'.[export]')", name=e.name) from None
    value = getattr(module, name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _CallableModule(types.ModuleType):
    """`pockjax.export(...)` exports a trainer's step; the package's names stay reachable."""

    def __call__(self, trainer, state, batch, target: str = "host-cpu", out_dir: str = "export",
                 gpu: str | None = None, extra_flags=(), progress: bool = False):
        """`pockjax.export.export(...)`: the same arguments (all but `prefix`), return
        value and errors."""
        return self.export(trainer, state, batch, target=target, out_dir=out_dir, gpu=gpu,
                           extra_flags=extra_flags, progress=progress)


sys.modules[__name__].__class__ = _CallableModule
