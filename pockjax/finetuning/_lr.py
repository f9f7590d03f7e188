"""`finetune --lr auto`: the learning rate chosen by a short run at each rate of
`LR_GRID` from the same weights, scored on the held-out data (`sweep_lr`), and the choice
an earlier run recorded in run.json (`previous_lr`)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from pockjax.finetuning._base import FinetuneError


def sweep_lr(trainer_for: Callable, params, train, held, loaded, *, total: int, batch: int,
             seq: int, seed: int, pad: int, say: Callable[[str], None]) -> dict:
    """A short run (a quarter of the run's `total` steps, 8 to 40) at each rate of
    `LR_GRID` from `params` on the run's first batches, each scored by the loss on
    `held`; the lowest wins (a tie: the smaller rate).

    Args:
      trainer_for: `trainer_for(rate, steps)`: the run's trainer at that rate, its
        schedule over `steps`.
      params: the trainer's parameters (copied for each rate, never donated).
      train, held: the run's training and held-out examples.
      loaded: the `LoadedModel` (its `apply` scores the held-out examples).
      total, batch, seq, seed, pad: the run's length, batch shape, data order and pad id.
      say: where each rate's loss is said.

    Returns:
      What run.json records: `{"chosen", "steps", "losses": {rate: loss or None}}`.

    Raises:
      FinetuneError: no rate gave a finite loss.
    """
    import jax

    from pockjax import lowbit
    from pockjax.data import batch_at, eval_batches
    from pockjax.finetuning._loss import nll_sum
    from pockjax.finetuning._options import LR_GRID

    steps = min(total, max(8, min(40, total // 4)))
    nll = jax.jit(lowbit.at_use(lambda p, b: nll_sum(loaded.apply(p, b["tokens"]),
                                                     b["tokens"], b["mask"])))
    losses = {}
    for rate in LR_GRID:
        trainer = trainer_for(rate, steps)
        state = trainer.init(params, copy=True)
        for step in range(steps):
            state, _ = trainer(state, batch_at(train, step, batch, seq, seed=seed, pad_id=pad))
        total_nll = count = 0.0
        for b in eval_batches(held, batch, seq, pad):
            s, n = nll(state.params, b)
            total_nll, count = total_nll + float(s), count + float(n)
        loss = total_nll / count
        losses[f"{rate:g}"] = loss if math.isfinite(loss) else None
        say(f"--lr auto: {steps} steps at {rate:g}: valid loss {loss:.4f}")
        del state
    finite = {k: v for k, v in losses.items() if v is not None}
    if not finite:
        raise FinetuneError(f"--lr auto: every rate of {', '.join(map(str, LR_GRID))} gave a "
                            f"loss that is not finite; give a smaller --lr")
    best = min(finite, key=lambda k: (finite[k], float(k)))
    say(f"--lr auto: {best} (recorded in run.json)")
    return {"chosen": float(best), "steps": steps, "losses": losses}


def previous_lr(out: Path) -> dict | None:
    """The rate an earlier `--lr auto` run in `out` chose (run.json's `lr_auto`), or None."""
    from pockjax.finetuning._run import RUN

    try:
        return json.loads((Path(out) / RUN).read_text()).get("lr_auto")
    except (OSError, ValueError):
        return None
