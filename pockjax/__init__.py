"""pockjax: sparse, efficient fine-tuning for JAX, after PockEngine (MICRO 2023).

The public names below are imported when first used, so `import pockjax` is cheap and
`pockjax.runtime` (running an exported artifact) needs only numpy, safetensors and
IREE's runtime: no JAX, Flax or optax.
"""
import importlib
import sys
import warnings
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Before JAX's backends start: each CPU training step on the calling thread, where its
# scratch memory can be reused from the last step (pockjax/_src/malloc.py).
from pockjax._src.malloc import prepare_dispatch as _prepare_dispatch  # noqa: E402

_prepare_dispatch()

# name -> the module that defines it (a submodule's own name maps to None).
_WHERE = {
    "Scheme": "scheme", "SchemeError": "scheme", "Full": "scheme", "Frozen": "scheme",
    "Channels": "scheme",
    "sparse_grad": "transforms", "sparse_value_and_grad": "transforms",
    "trainable_view": "view", "apply_sparse_updates": "view",
    "TransformInfo": "transforms",
    "TracedValueError": "transforms",
    "sparse_train": "train", "SparseTrainer": "train", "TrainState": "train",
    "Schedule": "schedule", "ScheduledTrainer": "schedule",
    "PrefixCachedTrainer": "prefix", "PrefixCacheError": "prefix", "find_cut": "prefix",
    "TrainReport": "train", "fit": "train", "History": "train", "checkpoint_block": "train",
    "save": "checkpoint", "load": "checkpoint", "CheckpointError": "checkpoint",
    "ExportError": "export.targets",
    "search_scheme": "scheme_search", "SearchReport": "scheme_search",
    "finetune": "finetuning", "FinetuneError": "finetuning", "FinetuneResult": "finetuning",
    "FinetuneOptions": "finetuning",
    "Tokenizer": "tokenizer", "TokenizerError": "tokenizer",
    "count_flops": "flops",
    "compiled_memory": "measure", "tree_bytes": "measure", "format_bytes": "measure",
    "format_flops": "measure",
    "schemes": None, "schedule": None, "prefix": None, "export": None, "runtime": None, "nnx": None, "models": None,
    "data": None,  # JSONL fine-tuning data: formats, prompt masking, batches
    "lowbit": None,  # frozen weights in int8 / int4, dequantized where they are used
    "torch": None,  # PyTorch modules in through torchax (torch imported on first use)
    "keras": None,  # Keras 3 models on its JAX backend (keras imported on first use)
    "onnx": None,  # ONNX files, interpreted into jax.numpy (onnx imported on first use)
    "tf": None,  # TensorFlow SavedModels and tf.functions, through tf2jax (imported on first use)
    "optim": None,  # AdamW with 8- or 16-bit moments; the per-leaf fused update
    "backend": None,  # host training on XLA or IREE's CPU backend, or the faster of the two
}

# Old names, still answered with a DeprecationWarning that names the new one.
_RENAMED = {"search": "search_scheme", "trainable": "trainable_view",
            "apply_updates": "apply_sparse_updates", "flops_of": "count_flops"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(f"pockjax.{name} is renamed pockjax.{new} (same arguments"
                      + (", and count_flops also takes a traced program" if new == "count_flops"
                         else "") + "); the old name will be removed",
                      DeprecationWarning, stacklevel=2)
        return getattr(sys.modules[__name__], new)
    if name not in _WHERE:
        raise AttributeError(f"module 'pockjax' has no attribute {name!r}")
    module = _WHERE[name]
    if name in ("schemes", "search_scheme") and "flax" in sys.modules:
        # Flax is loaded, so its modules may come in: pockjax.nnx registers their converter
        # with the schemes (which take parameter trees and import no Flax themselves).
        importlib.import_module("pockjax.nnx")
    value = (importlib.import_module(f"pockjax.{name}") if module is None else
             getattr(importlib.import_module(f"pockjax.{module}"), name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from pockjax import (backend, export, lowbit, models, nnx, optim, prefix, runtime,  # noqa: F401
                         schedule, schemes)
    from pockjax.measure import compiled_memory, format_bytes, format_flops, tree_bytes  # noqa: F401
    from pockjax.checkpoint import CheckpointError, load, save  # noqa: F401
    from pockjax.export.targets import ExportError  # noqa: F401
    from pockjax.finetuning import (FinetuneError, FinetuneOptions,  # noqa: F401
                                    FinetuneResult, finetune)
    from pockjax.flops import count_flops  # noqa: F401
    from pockjax.tokenizer import Tokenizer, TokenizerError  # noqa: F401
    from pockjax.scheme import Channels, Frozen, Full, Scheme, SchemeError  # noqa: F401
    from pockjax.scheme_search import SearchReport, search_scheme  # noqa: F401
    from pockjax.prefix import PrefixCachedTrainer, PrefixCacheError, find_cut  # noqa: F401
    from pockjax.schedule import Schedule, ScheduledTrainer  # noqa: F401
    from pockjax.train import (History, SparseTrainer, TrainReport, TrainState,  # noqa: F401
                               checkpoint_block, fit, sparse_train)
    from pockjax.transforms import (TracedValueError, TransformInfo,  # noqa: F401
                                    sparse_grad, sparse_value_and_grad)
    from pockjax.view import apply_sparse_updates, trainable_view  # noqa: F401
