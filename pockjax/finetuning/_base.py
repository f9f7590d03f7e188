"""What the parts of the fine-tuning job share: its errors and the values its options
take.

`pockjax.finetuning` (the job), `pockjax.finetuning._model` (the model folder),
`pockjax.finetuning._run` (the run folder) and `pockjax.finetuning._cli` (the command lines)
raise these errors and check options against these values; `pockjax.finetuning`
re-exports them.
"""
from __future__ import annotations

from pockjax._src import errors

FRONTENDS = ("auto", "flax", "torch")
"""The model code `finetune(frontend=...)` (`--frontend`) runs, as `load_model` reads it."""
SCHEDULES = ("cosine", "linear", "constant")
"""The learning-rate decays `finetune(schedule=...)` (`--schedule`) takes."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""`--scheme lora:R`'s targets on pockjax's Flax LLaMA: every linear layer of a block."""


class FinetuneError(RuntimeError):
    """Raised when a fine-tuning run cannot start or go on; the message says why and what
    to do."""


class NonFiniteLoss(FinetuneError, errors.NonFiniteLoss):
    """Raised when the loss becomes NaN or infinite; the last good checkpoint is left as
    it was. Also a `pockjax.train.NonFiniteLoss` (`step`, `loss`)."""

    def __init__(self, step: int, loss: float, message: str):
        errors.NonFiniteLoss.__init__(self, step, loss, message)

    def __reduce__(self):
        return type(self), (self.step, self.loss, str(self))


class ProcessLost(FinetuneError):
    """Raised on the other processes of a run over several when one of them stops (killed,
    preempted, its host down): the collective it no longer answers failed. The message
    names the last complete checkpoint; every process starts again with `--resume`.
    `pockjax finetune` exits at once after saying so, without JAX's shutdown barrier
    (which waits for the lost process and then aborts with the runtime's own log)."""


class Interrupted(FinetuneError):
    """Raised when Ctrl-C or SIGTERM (a scheduler stopping the job) stops the run; a
    checkpoint of the last completed step was written (where a step completed).

    Attributes:
      signal: 'Ctrl-C' or 'SIGTERM'.
    """

    def __init__(self, message: str, signal: str = "Ctrl-C"):
        super().__init__(message)
        self.signal = signal

    def __reduce__(self):
        return type(self), (str(self), self.signal)

    @property
    def exit_status(self) -> int:
        """128 + the signal's number, as a shell reports a command the signal stopped."""
        return 143 if self.signal == "SIGTERM" else 130
