"""`@sparse_train`: one compiled training step with fused, in-place optimizer updates.

    @pj.sparse_train(optimizer=optax.adamw(1e-3), scheme=scheme)
    def trainer(params, batch):
        return loss

    state = trainer.init(params)
    state, metrics = trainer(state, batch)

The step is one `jax.jit` program: the forward, the sparse backward of `sparse_grad`,
and the optimizer on the trainable view. If the optax chain is per-leaf (decided by
`pockjax.optim.perleaf`), each parameter is updated right after its gradient and its
last read (`pockjax.optim.fused`); otherwise after the whole backward pass. The state
is donated, so parameters and optimizer state are updated in place.

`remat=` puts the loss under `jax.checkpoint` (activation checkpointing, see `Remat`);
`pockjax.nnx.Trainer(remat="blocks")` checkpoints each block of a module instead, and
`checkpoint_block` each block of a plain loss function.

The pieces live in this package and their public names are handed on here:
`_trainer` (`SparseTrainer`), `_build` (`sparse_train`), `_state` (`TrainState` and the
checks made on a state), `_report` (`TrainReport` and the memory breakdown of
`SparseTrainer.report`), `_fit` (`fit`, `History`); `Remat` and `checkpoint_block` come
from `pockjax.remat`.
"""
from pockjax._src.home import claim
from pockjax.remat import Remat, checkpoint_block, checkpoint_call, checkpointed  # noqa: F401
from pockjax.train._fit import (History, NonFiniteLoss, compile_cache_dir, compile_seconds, fit,
                                peak_rss_gib, use_compile_cache)
from pockjax.train._report import TrainReport
from pockjax.train._state import TrainState, abstract_arrays
from pockjax.train._build import sparse_train, step_variant
from pockjax.train._trainer import SparseTrainer

__all__ = ["TrainState", "SparseTrainer", "sparse_train", "step_variant", "fit", "History", "TrainReport",
           "Remat", "checkpoint_block", "NonFiniteLoss", "peak_rss_gib", "compile_cache_dir",
           "use_compile_cache", "compile_seconds", "abstract_arrays"]

# The docstring examples of the names defined in the package's modules, run with this
# module's own (`doctest.testmod(pockjax.train)`, tests/test_docs.py).
__test__ = {"checkpoint_block": checkpoint_block, "sparse_train": sparse_train,
            "SparseTrainer": SparseTrainer}

claim(globals())  # public names defined in the private modules above live here
