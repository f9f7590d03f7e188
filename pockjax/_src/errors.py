"""Errors more than one part raises, defined without JAX (the device job raises them)."""

__all__ = ["NonFiniteLoss"]


class NonFiniteLoss(FloatingPointError):
    """Raised when a training step's loss is NaN or infinite (`fit(...,
    stop_nonfinite=True)`; `pockjax.finetuning.NonFiniteLoss`, a `FinetuneError` too,
    from a fine-tuning run). Nothing after the step before it was saved.

    Args:
      step: the step (1-based).
      loss: its loss.
      message: the message; default "step N: the loss is X".

    Attributes:
      step: the step (1-based).
      loss: its loss.
    """

    def __init__(self, step: int, loss: float, message: str | None = None):
        super().__init__(message or f"step {step}: the loss is {loss}")
        self.step, self.loss = step, loss

    def __reduce__(self):  # pickles (across processes) with its step and loss
        return type(self), (self.step, self.loss, str(self))


NonFiniteLoss.__module__ = "pockjax.train"  # where users import it from
