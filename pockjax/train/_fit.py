"""The training loop: `fit` runs a step function over batches with a progress bar,
evaluations, saves and Ctrl-C handling, and returns a `History`; `NonFiniteLoss` is its
stop on a NaN loss and `peak_rss_gib` the memory figure it shows. Re-exported from
`pockjax.train`; `pockjax.nnx.Trainer.fit` and `pockjax.finetuning` run it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable

import jax
import numpy as np

from pockjax._src.errors import NonFiniteLoss
from pockjax._src.interrupt import InterruptAfter, noted_signals, signal_name, stop_on_sigterm
from pockjax.train._state import TrainState

if TYPE_CHECKING:
    from pockjax.train._trainer import SparseTrainer


@dataclasses.dataclass
class History:
    """What a `fit` run did.

    Attributes:
      loss: the losses of its steps as float32 (skipped steps left out).
      seconds: training seconds, from the first step's start.
      steps: steps run in this call.
      interrupted: whether Ctrl-C or SIGTERM stopped it (the state returned is the one
        after the last completed step).
      valid: the evaluations, as `(step, seconds, value)`.
      skipped: steps skipped for a non-finite loss or gradient.
      tokens: the tokens counted (with `fit(tokens=...)`).
    """

    loss: np.ndarray
    seconds: float
    steps: int
    interrupted: bool = False
    valid: list = dataclasses.field(default_factory=list)
    skipped: int = 0
    tokens: int = 0
    stopped_by: str | None = None  # 'Ctrl-C' or 'SIGTERM' where interrupted

    @property
    def steps_per_second(self) -> float:
        """Steps per training second (NaN where no time passed)."""
        return self.steps / self.seconds if self.seconds > 0 else float("nan")


def _deleted(tree) -> bool:
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(tree))


def peak_rss_gib() -> float:
    """The process's peak resident memory so far.

    Returns:
      GiB, from Linux's VmHWM, else `ru_maxrss` (read as KiB).
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


_COMPILE_SECONDS = [0.0]  # tracing, lowering and compiling in this process, summed


def _count_compile(event: str, seconds: float, **_) -> None:
    if event.startswith("/jax/core/compile/"):
        _COMPILE_SECONDS[0] += seconds


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_seconds() -> float:
    """Seconds this process has spent tracing, lowering and compiling with JAX so far
    (JAX's own compile events): the difference over a step is its compilation."""
    return _COMPILE_SECONDS[0]


def compile_cache_dir() -> str:
    """The folder of pockjax's persistent compilation cache: `$POCKJAX_CACHE_DIR/jax`, else
    `$XDG_CACHE_HOME/pockjax/jax` (`~/.cache/pockjax/jax`)."""
    import os

    root = os.environ.get("POCKJAX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "pockjax")
    return os.path.join(root, "jax")


def use_compile_cache() -> str | None:
    """Turn on JAX's persistent compilation cache in `compile_cache_dir()`, so a second
    run of the same shapes loads its compiled steps instead of compiling them; a cache
    folder the user set (`JAX_COMPILATION_CACHE_DIR`, `jax.config`) is kept. Returns the
    folder in use (None where it cannot be made). Compiled programs are the same either
    way."""
    import os

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    path = compile_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:  # a read-only home: run without the cache
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def fit(trainer: SparseTrainer, state: TrainState, batches: Iterable | Callable, steps: int | None = None,
        *, progress: bool = True, log_every: int = 10, desc: str = "train", start: int = 0,
        evaluate: Callable | None = None, eval_every: int | None = None,
        save: Callable | None = None, save_every: int | None = None,
        on_record: Callable[[dict], None] | None = None, stop_nonfinite: bool = False,
        tokens: Callable[[int], int] | None = None,
        compile_cache: bool = True, agree_stop: Callable[[int], int] | None = None,
        **unknown) -> tuple[TrainState, History]:
    """Run `trainer` (a `SparseTrainer`, or any `step(state, batch) -> (state, metrics)`)
    from step `start` to step `steps`, or until the batches run out.

    Each step's loss is read back after the next step is dispatched, so where dispatch is
    asynchronous (a GPU) the loop adds no wait to the compiled step. A progress bar (unless `progress=False`) shows the loss, tokens/s
    (with `tokens`), peak memory and the time left. Ctrl-C stops the run after the step
    in flight, and so does SIGTERM (a scheduler stopping the job; where no other handler
    is installed): `save` gets the state after the last completed step, and it is
    returned with `History.interrupted` set (the state passed in was donated to the first step, so
    this return value is the run's only state).

    A warning is issued when the batches run out before `steps`, and when Ctrl-C or
    SIGTERM stops the run.

    Args:
      trainer: the step: a `SparseTrainer`, or any `step(state, batch) -> (state,
        metrics)` whose metrics have `"loss"`.
      state: the state it starts from.
      batches: an iterable of batches, or a function of the (0-based) step giving its
        batch (then `steps` is needed; a resumed run continues the data where it
        stopped).
      steps: the step count to reach, >= 0; None (the default): until the batches run
        out.
      progress: show the progress bar (the default).
      log_every: the bar's refresh interval in steps; default 10.
      desc: the bar's label; default "train".
      start: the step count `state` has reached (a resumed run); default 0.
      evaluate: `evaluate(state) -> float` (a held-out loss), run before the first step
        when `start` is 0, every `eval_every` steps and after the last.
      eval_every: steps between evaluations; None (the default): before the first and
        after the last step only.
      save: `save(state)`, run every `save_every` steps, after the last and on Ctrl-C
        or SIGTERM, each time after the losses up to that step were read (and found
        finite).
      save_every: steps between saves; None (the default): after the last step (and
        on Ctrl-C or SIGTERM) only.
      on_record: gets a dict per step (`step`, `loss`, `seconds` since the first step,
        `tokens`; the first step's also `compile_seconds`, the tracing and compiling it
        took), per skipped step (`step`, `skipped`: True, `loss`: None: the step's
        metrics said `skipped`, see `sparse_train(skip_nonfinite=True)`) and per
        evaluation (`step`, `valid_loss`, `seconds`).
      stop_nonfinite: raise `NonFiniteLoss` at the first NaN or infinite loss, before
        anything after the step before it is saved.
      tokens: `tokens(step)`, the tokens in the (0-based) step's batch, for tokens/s.
      compile_cache: use JAX's persistent compilation cache (`use_compile_cache`: a
        folder under the user's cache directory), so a second run of the same shapes
        does not compile again; default True. False leaves JAX's settings as they are.
      agree_stop: for a run over several processes: called by every process after every
        step with the stop its own signals asked for (0 none, 1 Ctrl-C, 2 SIGTERM),
        it returns the largest over the processes (a collective); every process then
        stops after the same step, which each saves. None (the default): a signal stops
        this process after its step in flight.

    Returns:
      `(state, History)`: the state after the last completed step and what the run did.

    Raises:
      ValueError: `steps` is negative, or `batches` is a function and `steps` is None.
      TypeError: an unknown keyword; `prefix_cache=` (other than False or None, the
        cache off) names the trainer that replaces it.
      NonFiniteLoss: with `stop_nonfinite`, a step's loss is NaN or infinite.
    """
    from tqdm.auto import tqdm

    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if compile_cache:
        use_compile_cache()
    if unknown.get("prefix_cache", True) in (False, None):
        del unknown["prefix_cache"]  # the cache off, as without it
    if unknown:
        name = next(iter(unknown))
        if name == "prefix_cache":
            raise TypeError("fit takes a trainer and runs it: for the prefix cache, wrap the "
                            "trainer first, pj.prefix.PrefixCachedTrainer(trainer, "
                            "budget_bytes=..., auto=...), pass that to fit and close() it "
                            "after")
        raise TypeError(f"fit() got an unexpected keyword argument {name!r}")
    if callable(batches) and not hasattr(batches, "__iter__"):
        if steps is None:
            raise ValueError("batches given as a function of the step need steps= (the step "
                             "count to reach)")
        get = batches
        it = (get(i) for i in range(start, steps))
        total = steps
    else:
        total = steps if steps is not None else (start + len(batches) if hasattr(batches, "__len__")
                                                 else None)
        it = iter(batches) if steps is None else itertools.islice(iter(batches), max(steps - start, 0))
    losses: list[float] = []
    valid: list[tuple[int, float, float]] = []
    unread: list[tuple[int, Any, int, float | None]] = []
    skipped = tokens_done = 0
    interrupted = False
    step = start
    emit = on_record or (lambda record: None)
    bar = tqdm(total=total, initial=start, disable=not progress, unit="step", desc=desc,
               dynamic_ncols=True)
    began = None

    def clock() -> float:
        return 0.0 if began is None else round(time.perf_counter() - began, 3)

    def read(entry) -> None:
        """A finished step's loss: recorded, or a stop on a non-finite one."""
        nonlocal skipped
        at, metrics, ntok, done = entry
        loss = float(metrics["loss"])
        if hasattr(metrics, "get") and bool(metrics.get("skipped", False)):
            skipped += 1
            emit({"step": at, "skipped": True, "loss": None})
            return
        if stop_nonfinite and not np.isfinite(loss):
            raise NonFiniteLoss(at, loss)
        losses.append(loss)
        record = {"step": at, "loss": loss, "seconds": clock() if done is None else done}
        if at == start + 1:
            record["compile_seconds"] = round(compiled_at_first[0], 3)
        if ntok is not None:
            record["tokens"] = ntok
        emit(record)
        if (at - start) % max(log_every, 1) == 0 or at == total:
            rate = f", {tokens_done / max(clock(), 1e-9):,.0f} tok/s" if tokens else ""
            bar.set_postfix_str(f"loss {loss:.4g}{rate}, peak {peak_rss_gib():.2f} GiB",
                                refresh=False)

    def read_all() -> None:
        with InterruptAfter():  # a record taken is a record written
            while unread:
                read(unread.pop(0))

    def evaluation(state, at) -> None:
        value = float(evaluate(state))
        valid.append((at, clock(), value))
        emit({"step": at, "valid_loss": value, "seconds": clock()})

    compiled_at_first = [0.0]  # the first step's compilation, seconds
    stopped_by = None
    saved_at = start
    agreed = noted_signals() if agree_stop is not None else contextlib.nullcontext()
    with stop_on_sigterm(), agreed as noted:  # a scheduler's SIGTERM saves as Ctrl-C does
        try:
            if evaluate is not None and start == 0:
                evaluation(state, 0)
            began = time.perf_counter()
            for batch in it:
                ntok = tokens(step) if tokens is not None else None
                with InterruptAfter():
                    before = compile_seconds()
                    state, metrics = trainer(state, batch)
                    if step == start:
                        compiled_at_first[0] = compile_seconds() - before
                        if progress:
                            bar.set_postfix_str(f"compiled the step in "
                                                f"{compiled_at_first[0]:.1f} s", refresh=False)
                    step += 1
                    # A step that ran within the call (one CPU device) ended now;
                    # one dispatched asynchronously ends by the time its loss is read.
                    ready = getattr(metrics["loss"], "is_ready", lambda: True)()
                    unread.append((step, metrics, ntok, clock() if ready else None))
                    # The step's records and its checkpoint are held as the step is: a
                    # signal between taking a record and writing it would lose the step
                    # from the log.
                    while len(unread) > 1:
                        read(unread.pop(0))
                    tokens_done += ntok or 0
                    bar.update(1)
                    last = step == total
                    if save is not None and ((save_every and step % save_every == 0) or last):
                        read_all()
                        save(state)
                        saved_at = step
                if noted is not None and not last:  # every process stops after one step
                    code = agree_stop(noted.code)
                    if code:
                        raise noted.error(code)
                if evaluate is not None and eval_every and step % eval_every == 0 and not last:
                    read_all()
                    evaluation(state, step)
            read_all()
            jax.block_until_ready(state)
        except KeyboardInterrupt as e:
            if _deleted(state):  # a second Ctrl-C inside a step: its input is gone
                raise
            interrupted, stopped_by = True, signal_name(e)
            bar.close()
            read_all()
            jax.block_until_ready(state)
            if save is not None and step > saved_at:
                save(state)
        finally:
            bar.close()
    seconds = time.perf_counter() - began if began is not None else 0.0
    if interrupted:
        warnings.warn(f"fit: interrupted ({stopped_by}) after {step - start} steps; returning the "
                      f"state after step {step}", stacklevel=2)
    else:
        if total is not None and step < total:
            warnings.warn(f"fit: the batches ran out after {step - start} of {total - start} "
                          f"steps", stacklevel=2)
        if evaluate is not None and step > start:
            evaluation(state, step)
    return state, History(np.asarray(losses, dtype=np.float32), seconds, step - start,
                          interrupted, valid, skipped, tokens_done, stopped_by)
