"""pockjax: sparse, efficient fine-tuning for JAX, after PockEngine (MICRO 2023)."""
from pockjax import models, nnx, runtime, schemes
from pockjax.checkpoint import CheckpointError, load, save
from pockjax import export
from pockjax.export import ExportError
from pockjax._report import compiled_memory, format_bytes, format_flops, tree_bytes
from pockjax.flops import count_flops, flops_of
from pockjax.scheme import Channels, Frozen, Full, Scheme, SchemeError
from pockjax.scheme_search import SearchReport, search
from pockjax.train import History, SparseTrainer, TrainReport, TrainState, fit, sparse_train
from pockjax.transforms import (TransformInfo, apply_updates, sparse_grad, sparse_value_and_grad,
                                trainable)

__version__ = "0.1.0"

__all__ = [
    "Scheme", "SchemeError", "Full", "Frozen", "Channels", "schemes",
    "sparse_grad", "sparse_value_and_grad", "trainable", "apply_updates", "TransformInfo",
    "sparse_train", "SparseTrainer", "TrainState", "TrainReport", "fit", "History",
    "save", "load", "CheckpointError", "export", "ExportError", "runtime", "nnx", "models",
    "search", "SearchReport", "count_flops", "flops_of",
    "compiled_memory", "tree_bytes", "format_bytes", "format_flops",
]
