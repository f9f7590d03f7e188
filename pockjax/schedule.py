"""Scheme schedules: which parameters train changes with the step.

A `Schedule` is a list of schemes that take turns, each training for `every` steps
(block-coordinate fine-tuning in the manner of LISA and BAdam: at any moment only one
group of blocks has gradients, masters and optimizer state, so memory is that of the
largest scheme in the list, while over the run every block trains).

`sparse_train(loss, optimizer=..., scheme=schedule)` returns a `ScheduledTrainer`. It
compiles one step per distinct scheme, the first time that scheme's turn comes, and
reuses it on every later turn. At a switch the optimizer state starts again for the
new scheme's leaves (Adam's moments at zero and its bias correction from step 1), as
BAdam does; keeping every leaf's state across switches would hold the optimizer state
of every leaf that ever trains, which is full training's memory. Learning-rate
schedules inside the optax chain (`optax.scale_by_schedule`, `inject_hyperparams`)
continue from the global step, so the rate follows the run, not the turn.

Examples:
  >>> import jax.numpy as jnp, optax, pockjax as pj
  >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  >>> schedule = pj.schemes.schedule([pj.Scheme({"a": pj.Full()}),
  ...                                 pj.Scheme({"b": pj.Full()})], every=2)
  >>> [schedule.index(step) for step in range(6)]
  [0, 0, 1, 1, 0, 0]
  >>> trainer = pj.sparse_train(lambda p, x: jnp.sum((p["a"] * p["b"] - x) ** 2),
  ...                           optimizer=optax.sgd(0.1), scheme=schedule)
  >>> state = trainer.init(params)
  >>> for _ in range(3):
  ...     state, metrics = trainer(state, jnp.zeros(2))
  >>> int(state.step), state.scheme == schedule.schemes[1]
  (3, True)
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from pockjax.scheme import Scheme, SchemeError

__all__ = ["Schedule", "ScheduledTrainer"]

ORDERS = ("cycle", "random")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Schemes that take turns: `schemes[index(step)]` trains at (0-based) step `step`.

    Frozen (immutable and hashable). `pockjax.schemes.schedule` and
    `pockjax.schemes.blockwise` build one; `sparse_train(..., scheme=schedule)` trains it.

    Args:
      schemes: the schemes, in turn order (any sequence of `Scheme`s; stored as a tuple).
      every: steps each turn lasts, a positive whole number.
      order: "cycle" (the default: the list's order, again and again) or "random" (each
        round, every scheme once, in an order drawn from `seed` and the round number, as
        in LISA and BAdam).
      seed: the random order's seed (unused with "cycle"); default 0.

    Attributes:
      schemes: the schemes, as a tuple, in turn order.
      every: steps each turn lasts.
      order: "cycle" or "random".
      seed: the random order's seed.

    Raises:
      SchemeError: `schemes` is empty or holds something other than `Scheme`s, `every`
        is not a positive whole number, or `order` is not "cycle" or "random".
    """

    schemes: tuple[Scheme, ...]
    every: int
    order: str = "cycle"
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "schemes", tuple(self.schemes))
        if not self.schemes or not all(isinstance(s, Scheme) for s in self.schemes):
            raise SchemeError(f"a schedule takes a non-empty list of Schemes, got "
                              f"{[type(s).__name__ for s in self.schemes]}")
        if not isinstance(self.every, (int, np.integer)) or self.every < 1:
            raise SchemeError(f"a schedule's `every` is the steps a turn lasts: a positive "
                              f"whole number, got {self.every!r}")
        if self.order not in ORDERS:
            raise SchemeError(f"a schedule's order is one of {ORDERS}, got {self.order!r}")

    def index(self, step: int) -> int:
        """Which scheme trains at (0-based) step `step`.

        Args:
          step: the 0-based step number (an int, or anything `int()` takes).

        Returns:
          The scheme's position in `schemes`.
        """
        turn, n = int(step) // self.every, len(self.schemes)
        if self.order == "cycle":
            return turn % n
        order = np.random.default_rng([self.seed, turn // n]).permutation(n)
        return int(order[turn % n])

    def at(self, step: int) -> Scheme:
        """The scheme that trains at (0-based) step `step`.

        Args:
          step: the 0-based step number.

        Returns:
          `schemes[index(step)]`.
        """
        return self.schemes[self.index(step)]

    def resolve(self, params) -> None:
        """Check every scheme against `params` (`Scheme.resolve` on each).

        Args:
          params: the model's parameter pytree.

        Raises:
          SchemeError: a scheme does not fit `params`; the message starts with the
            scheme's position in the schedule.
        """
        for i, scheme in enumerate(self.schemes):
            try:
                scheme.resolve(params)
            except SchemeError as e:
                raise SchemeError(f"the schedule's scheme {i}: {e}") from None

    def to_json(self) -> str:
        """The schedule as JSON text.

        Returns:
          A JSON object with `every`, `order`, `seed` and `schemes` (each scheme's
          `Scheme.to_json` object).
        """
        import json
        return json.dumps({"every": self.every, "order": self.order, "seed": self.seed,
                           "schemes": [json.loads(s.to_json()) for s in self.schemes]})

    def __repr__(self) -> str:
        return (f"Schedule({len(self.schemes)} schemes, every={self.every}, "
                f"order={self.order!r})")


def _continue_schedules(opt_state, step: int):
    """`opt_state` with the step counts of its learning-rate schedules set to `step`
    (Adam's own count stays where init put it: its moments start again)."""
    import jax
    import jax.numpy as jnp
    import optax

    kinds = (optax.ScaleByScheduleState, optax.InjectHyperparamsState,
             optax.InjectStatefulHyperparamsState)

    def one(node):
        if isinstance(node, kinds):
            return node._replace(count=jnp.full_like(node.count, step))
        return node

    return jax.tree_util.tree_map(one, opt_state, is_leaf=lambda x: isinstance(x, kinds))


class ScheduledTrainer:
    """A `SparseTrainer` per scheme of a `Schedule`, switched as the step count passes
    each turn's end.

    Made by `sparse_train(..., scheme=schedule)`; used like a `SparseTrainer`:
    `state = trainer.init(params)`, `state, metrics = trainer(state, batch)`. A state
    always holds the scheme it was last stepped with (`state.scheme`). Schemes that
    appear more than once in the schedule share one trainer (and one compiled step).

    Args:
      trainer: the `SparseTrainer` whose loss, optimizer and settings every scheme's
        trainer copies (`trainer.replace(scheme=...)`); its own scheme is not used.
      schedule: the `Schedule` to follow.

    Attributes:
      schedule: the `Schedule` followed.
    """

    def __init__(self, trainer, schedule: Schedule):
        self.schedule = schedule
        self._base = trainer
        self._trainers: list[Any] = []   # one per distinct scheme, in first-seen order
        self._which: list[int] = []      # schedule index -> position in _trainers
        for scheme in schedule.schemes:
            for k, t in enumerate(self._trainers):
                if t.scheme == scheme:
                    self._which.append(k)
                    break
            else:
                self._which.append(len(self._trainers))
                self._trainers.append(trainer.replace(scheme=scheme))
        self._last = None        # the state the last call returned, and its step count:
        self._last_step = 0      # the next call reads no step count back from the device

    @property
    def scheme(self) -> Schedule:
        """The `Schedule` (the counterpart of `SparseTrainer.scheme`)."""
        return self.schedule

    @property
    def base(self):
        """The `SparseTrainer` this schedule's trainers were made from (its loss,
        optimizer and settings; its own scheme is not used)."""
        return self._base

    @property
    def trainers(self) -> list:
        """The `SparseTrainer` of each distinct scheme."""
        return list(self._trainers)

    def trainer_at(self, step: int):
        """The `SparseTrainer` that runs (0-based) step `step`.

        Args:
          step: the 0-based step number.

        Returns:
          The trainer of the scheme `schedule.at(step)`.
        """
        return self._trainers[self._which[self.schedule.index(step)]]

    def init(self, params, *, copy: bool = True, step: int = 0):
        """The state to start (or resume) at `step`: that of the scheme whose turn ran
        the step before it (`SparseTrainer.init`).

        With `step > 0` the state's step count is set to `step` and the step counts of
        the learning-rate schedules in the optimizer state (`optax.scale_by_schedule`,
        `inject_hyperparams`) follow it; the rest of the optimizer state starts fresh.

        Args:
          params: the model's parameter pytree.
          copy: as in `SparseTrainer.init`: True (the default) copies the parameters,
            False hands them over to the state.
          step: the step count the run has reached (0, the default, for a new run).

        Returns:
          A `TrainState` for the scheme of step `max(step - 1, 0)`.

        Raises:
          SchemeError: a scheme of the schedule does not fit `params`.
        """
        self.schedule.resolve(params)
        trainer = self.trainer_at(max(step - 1, 0))
        state = trainer.init(params, copy=copy)
        if step:
            state = self._at_step(state, step)
        return state

    @staticmethod
    def _at_step(state, step: int):
        import jax.numpy as jnp
        return state.replace(step=jnp.full_like(state.step, step),
                             opt_state=_continue_schedules(state.opt_state, step))

    def switch(self, state, step: int):
        """`state` made for the scheme that runs step `step`: the same parameters, new
        optimizer state for that scheme's leaves.

        A state that already holds that scheme is returned as it is. Otherwise, when the
        base trainer donates (`donate=True`, the default) the old optimizer state is
        deleted first, as a step would, so two never coexist.

        Args:
          state: a `TrainState` of one of the schedule's schemes.
          step: the 0-based step about to run.

        Returns:
          The `TrainState` for step `step`'s scheme, its step count set to `step`.
        """
        trainer = self.trainer_at(step)
        if state.scheme == trainer.scheme:
            return state
        if self._base.donate:
            import jax
            for x in jax.tree_util.tree_leaves(state.opt_state):
                if hasattr(x, "delete") and not x.is_deleted():
                    x.delete()
        new = trainer.init(state.params, copy=False)
        return self._at_step(new, step)

    def __call__(self, state, batch):
        """One training step, switching scheme first where the step starts a new turn.

        The step count is read from `state` once for a state this trainer did not
        return (a restored checkpoint), and tracked on the host after that.

        Args:
          state: the `TrainState` (from `init`, or a previous call's).
          batch: the step's batch, as the loss function takes it.

        Returns:
          `(new state, metrics)`, as `SparseTrainer.__call__` returns them.
        """
        if state is self._last:
            step = self._last_step
        else:  # a state from elsewhere (a restored checkpoint): read its count once
            step = int(state.step)
        state = self.switch(state, step)
        state, metrics = self.trainer_at(step)(state, batch)
        self._last, self._last_step = state, step + 1
        return state, metrics

    def explain(self, state, batch):
        """`SparseTrainer.explain` for the scheme `state` holds.

        Args:
          state: a `TrainState` of one of the schedule's schemes.
          batch: a batch of the training shape.

        Returns:
          The `TransformInfo` of that scheme's step.

        Raises:
          SchemeError: `state.scheme` is not one of the schedule's schemes.
        """
        return self.trainer_of(state).explain(state, batch)

    def report(self, state, batch, **kw):
        """`SparseTrainer.report` for the scheme `state` holds: `state` and `batch` as in
        `explain`, `**kw` passed on to `SparseTrainer.report`, and the same `SchemeError`
        for a state of another scheme.

        Returns:
          The `TrainReport` of that scheme's step.
        """
        return self.trainer_of(state).report(state, batch, **kw)

    def trainer_of(self, state):
        """The `SparseTrainer` of the scheme `state` holds.

        Args:
          state: a `TrainState`.

        Returns:
          The trainer whose scheme equals `state.scheme`.

        Raises:
          SchemeError: `state.scheme` is not one of the schedule's schemes.
        """
        for t in self._trainers:
            if t.scheme == state.scheme:
                return t
        raise SchemeError(f"this state was made for {state.scheme!r}, which is not in "
                          f"{self.schedule!r}")

    def __repr__(self) -> str:
        return f"ScheduledTrainer({self.schedule!r}, {len(self._trainers)} distinct schemes)"
