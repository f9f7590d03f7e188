"""Jaxpr passes: sparse gradients, slice push-down, scan splitting."""
from pockjax.transforms.pushdown import RULES, Decline, Stats, register, rewrite
from pockjax.transforms.sparse_grad import (TracedValueError, TransformInfo, apply_updates,
                                            sparse_grad, sparse_value_and_grad, trainable)

__all__ = ["sparse_grad", "sparse_value_and_grad", "trainable", "apply_updates",
           "TransformInfo", "TracedValueError", "RULES", "register", "Decline", "rewrite", "Stats"]
