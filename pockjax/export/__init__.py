"""Export the training step through StableHLO to IREE: targets, lowering, artifacts.

Names are imported when first used: `pockjax.export.manifest` and
`pockjax.export.targets` need neither JAX nor the compiler, so the runtime can read
artifacts on a device that has only IREE's runtime.
"""
import importlib

__all__ = ["export", "Artifact", "read_manifest", "TARGETS", "Target", "resolve_target",
           "ExportError"]

_WHERE = {"export": "artifact", "Artifact": "artifact", "read_manifest": "manifest",
          "TARGETS": "targets", "Target": "targets", "resolve_target": "targets",
          "ExportError": "targets"}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'pockjax.export' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pockjax.export.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
