"""Jaxpr passes: sparse gradients, slice push-down, scan splitting."""
import warnings

from pockjax.transforms.pushdown import RULES, Decline, Stats, register, rewrite
from pockjax.transforms.sparse_grad import (TracedValueError, TransformInfo,
                                            apply_sparse_updates, sparse_grad,
                                            sparse_value_and_grad, trainable_view)

__all__ = ["sparse_grad", "sparse_value_and_grad", "trainable_view", "apply_sparse_updates",
           "TransformInfo", "TracedValueError", "RULES", "register", "Decline", "rewrite", "Stats"]

# Old names, answered with a DeprecationWarning that names the new one.
_RENAMED = {"trainable": "trainable_view", "apply_updates": "apply_sparse_updates"}


def __getattr__(name: str):
    if name in _RENAMED:
        warnings.warn(f"pockjax.transforms.{name} is renamed {_RENAMED[name]} (same arguments); "
                      "the old name will be removed", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'pockjax.transforms' has no attribute {name!r}")
