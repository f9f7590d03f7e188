"""pockjax: sparse, efficient fine-tuning for JAX, after PockEngine (MICRO 2023).

The public names below are imported when first used, so `import pockjax` is cheap and
`pockjax.runtime` (running an exported artifact) needs only numpy, safetensors and
IREE's runtime: no JAX, Flax or optax.
"""
import importlib
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# name -> the module that defines it (a submodule's own name maps to None).
_WHERE = {
    "Scheme": "scheme", "SchemeError": "scheme", "Full": "scheme", "Frozen": "scheme",
    "Channels": "scheme",
    "sparse_grad": "transforms", "sparse_value_and_grad": "transforms", "trainable": "transforms",
    "apply_updates": "transforms", "TransformInfo": "transforms",
    "TracedValueError": "transforms",
    "sparse_train": "train", "SparseTrainer": "train", "TrainState": "train",
    "Schedule": "schedule", "ScheduledTrainer": "schedule",
    "PrefixCachedTrainer": "prefix", "PrefixCacheError": "prefix", "find_cut": "prefix",
    "TrainReport": "train", "fit": "train", "History": "train", "checkpoint_block": "train",
    "save": "checkpoint", "load": "checkpoint", "CheckpointError": "checkpoint",
    "ExportError": "export.targets",
    "search": "scheme_search", "SearchReport": "scheme_search",
    "finetune": "finetuning", "FinetuneError": "finetuning", "FinetuneResult": "finetuning",
    "Tokenizer": "tokenizer", "TokenizerError": "tokenizer",
    "count_flops": "flops", "flops_of": "flops",
    "compiled_memory": "_report", "tree_bytes": "_report", "format_bytes": "_report",
    "format_flops": "_report",
    "schemes": None, "schedule": None, "prefix": None, "export": None, "runtime": None, "nnx": None, "models": None,
    "data": None,  # JSONL fine-tuning data: formats, prompt masking, batches
    "lowbit": None,  # frozen weights in int8 / int4, dequantized where they are used
    "torch": None,  # PyTorch modules in through torchax (torch imported on first use)
    "backend": None,  # host training on XLA or IREE's CPU backend, or the faster of the two
}

__all__ = [n for n in _WHERE if not n.startswith("_")]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'pockjax' has no attribute {name!r}")
    module = _WHERE[name]
    if name in ("schemes", "search") and "flax" in sys.modules:
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
    from pockjax import (backend, export, lowbit, models, nnx, prefix, runtime,  # noqa: F401
                         schedule, schemes)
    from pockjax._report import compiled_memory, format_bytes, format_flops, tree_bytes  # noqa: F401
    from pockjax.checkpoint import CheckpointError, load, save  # noqa: F401
    from pockjax.export.targets import ExportError  # noqa: F401
    from pockjax.finetuning import FinetuneError, FinetuneResult, finetune  # noqa: F401
    from pockjax.flops import count_flops, flops_of  # noqa: F401
    from pockjax.tokenizer import Tokenizer, TokenizerError  # noqa: F401
    from pockjax.scheme import Channels, Frozen, Full, Scheme, SchemeError  # noqa: F401
    from pockjax.scheme_search import SearchReport, search  # noqa: F401
    from pockjax.prefix import PrefixCachedTrainer, PrefixCacheError, find_cut  # noqa: F401
    from pockjax.schedule import Schedule, ScheduledTrainer  # noqa: F401
    from pockjax.train import (History, SparseTrainer, TrainReport, TrainState,  # noqa: F401
                               checkpoint_block, fit, sparse_train)
    from pockjax.transforms import (TracedValueError, TransformInfo,  # noqa: F401
                                    apply_updates, sparse_grad, sparse_value_and_grad,
                                    trainable)
