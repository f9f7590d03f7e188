"""Activation checkpointing as the trainers apply it: `Remat` (what `remat=` becomes),
`checkpointed` (a whole loss under `jax.checkpoint`), `checkpoint_call` (one call under
it, optionally recomputed only once the output's cotangent exists) and `checkpoint_block`
(the public per-block wrapper). `pockjax.train` (`SparseTrainer`), `pockjax.nnx`
(`Trainer(remat=...)`) and `pockjax.models.llama` use them; `pockjax.train` hands them
on too.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from pockjax._src.ties import tie_zero

__all__ = ["Remat", "checkpoint_block", "checkpoint_call", "checkpointed", "POLICY_NAMES"]


# The policies of `jax.checkpoint_policies` a string may name; the others there are
# factories (`save_only_these_names("x")`, ...) whose result is passed as a function.
POLICY_NAMES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                "checkpoint_dots", "checkpoint_dots_with_no_batch_dims", "everything_saveable")


@dataclasses.dataclass(frozen=True)
class Remat:
    """Activation checkpointing as a trainer applies it: `jax.checkpoint` with `policy`
    around `where`, so the backward pass recomputes what the policy does not save
    instead of keeping it from the forward pass.

    Users pass `remat=` as a string or a policy function (`SparseTrainer`,
    `sparse_train`, `pockjax.nnx.Trainer`) and get one of these (`Remat.of`); `report()`
    prints it.

    Attributes:
      policy: the `jax.checkpoint` policy function.
      policy_name: its name, for reports.
      where: what is checkpointed, for reports; default "the whole loss".
      in_loss: True where the loss function checkpoints itself (the NNX trainer wraps
        each block's call) and the trainer only reports it; default False.
    """

    policy: Callable
    policy_name: str
    where: str = "the whole loss"
    in_loss: bool = False

    @classmethod
    def of(cls, remat: Any, where: str = "the whole loss", in_loss: bool = False,
           arg: str = "remat") -> "Remat":
        """The `Remat` of a `remat=` argument.

        Args:
          remat: `"full"` (nothing saved: the backward recomputes everything it reads),
            a policy name of `jax.checkpoint_policies` (`"dots_saveable"`, ...), a policy
            function (`jax.checkpoint_policies.save_only_these_names("block")`), or a
            `Remat` (returned as it is).
          where: what is checkpointed, for reports; default "the whole loss".
          in_loss: whether the loss function checkpoints itself; default False.
          arg: the parameter's name in error messages; default "remat".

        Returns:
          The `Remat`.

        Raises:
          ValueError: `remat` is a string that is neither "full" nor a policy name (a
            policy factory's name gets a hint to call it).
          TypeError: `remat` is neither a string, a callable nor a `Remat`.
        """
        if isinstance(remat, Remat):
            return remat
        if isinstance(remat, str):
            name = "nothing_saveable" if remat == "full" else remat
            if name not in POLICY_NAMES:
                factories = sorted(n for n in dir(jax.checkpoint_policies)
                                   if not n.startswith("_") and n not in POLICY_NAMES)
                hint = (f"; {remat!r} takes arguments: pass its result, e.g. {arg}=jax."
                        f"checkpoint_policies.{remat}(...)" if remat in factories else "")
                raise ValueError(
                    f"{arg}={remat!r} is not a checkpoint policy; give 'full' (nothing saved), "
                    f"one of {', '.join(map(repr, POLICY_NAMES))}, or a policy function such "
                    f"as jax.checkpoint_policies.save_only_these_names('block'){hint}")
            return cls(getattr(jax.checkpoint_policies, name), name, where, in_loss)
        if callable(remat):
            return cls(remat, _policy_name(remat), where, in_loss)
        raise TypeError(f"{arg} must be None, 'full', a policy name ({', '.join(POLICY_NAMES)}) "
                        f"or a jax.checkpoint policy function, got {type(remat).__name__}")

    def __str__(self) -> str:
        inside = "a block" if self.in_loss else "it"
        saved = (f"nothing saved inside {inside}" if self.policy_name == "nothing_saveable"
                 else f"policy {self.policy_name}")
        return f"{self.where} (jax.checkpoint, {saved})"


def _policy_name(policy: Callable) -> str:
    for name in POLICY_NAMES:
        if policy is getattr(jax.checkpoint_policies, name):
            return name
    name = getattr(policy, "__qualname__", None)
    if name is None:  # a policy object, e.g. SaveOnlyTheseNames(saveable_names=...)
        return repr(policy) if len(repr(policy)) <= 80 else type(policy).__name__
    # A factory's result is its local `policy`: name the factory.
    return name.split(".<locals>")[0] + "(...)" if ".<locals>" in name else name


def checkpointed(loss_fn: Callable, remat: Remat | None) -> Callable:
    """`loss_fn` under `jax.checkpoint` with the policy of `remat` (unchanged for None,
    or when the loss checkpoints itself)."""
    if remat is None or remat.in_loss:
        return loss_fn

    @functools.wraps(loss_fn)
    def loss(*args, **kwargs):
        return checkpoint_call(loss_fn, remat.policy, *args, **kwargs)

    return loss


def checkpoint_call(fn: Callable, policy: Callable, *args, recompute_after_cotangent: bool = False,
                    untied: Sequence[int] = (), hoist_closure: bool = False, **kwargs):
    """`fn(*args, **kwargs)` under `jax.checkpoint(policy=policy)`. The array leaves of
    the arguments are the checkpoint's inputs; the other leaves (Python numbers, strings,
    NumPy constants) stay static, as `fn` expects them.

    `recompute_after_cotangent=True` makes the recomputation wait for the output's
    cotangent. XLA's CPU scheduler drops the optimization barriers `jax.checkpoint`
    places and runs a recomputation, which depends on the saved values only, as early as
    it can: right beside the forward pass, so every block's activations are alive at
    once again and checkpointing saves nothing (measured: 141.9 vs 145.9 MiB of
    temporaries, LLaMA 4 x 128 at sequence 512). Here the saved values are tied to the
    cotangent by data (times `1 + 0 * g[0]`, exactly 1), except the positional
    arguments numbered in `untied` (the block's weights: tying would copy them).
    Tying the block's input is enough for a policy that saves nothing inside it.

    `hoist_closure=True` makes the arrays `fn` closes over that may be differentiated
    (a block's weights captured by a lambda) inputs too, untied: a `jax.custom_vjp`
    cannot differentiate a value it closes over."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, jax.core.Tracer))]
    owner = [n for n, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
    owner += [None] * (len(leaves) - len(owner))

    def run(dyn_leaves):
        full = list(leaves)
        for i, x in zip(dyn, dyn_leaves):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(tree, full)
        return fn(*a, **k)

    inputs = [leaves[i] for i in dyn]
    plain = [owner[i] in untied for i in dyn]
    if hoist_closure:
        # The tracers `fn` closes over become inputs, as `jax.closure_convert` does, but
        # without its cache (keyed by this new closure each call, it would keep every
        # call's arguments and weights alive).
        import jax.extend as jex

        closed, out_shape = jax.make_jaxpr(run, return_shape=True)(inputs)
        traced = [i for i, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer)]
        out_tree = jax.tree_util.tree_structure(out_shape)
        n = len(inputs)

        def run(both):
            consts = list(closed.consts)
            for i, c in zip(traced, both[n:]):
                consts[i] = c
            call = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(closed.jaxpr, consts))
            return jax.tree_util.tree_unflatten(out_tree, call(*both[:n]))

        inputs = inputs + [closed.consts[i] for i in traced]
        plain = plain + [True] * len(traced)
    checkpointed_run = jax.checkpoint(run, policy=policy)
    if not recompute_after_cotangent:
        return checkpointed_run(inputs)
    return _late(checkpointed_run, plain)(inputs)


def checkpoint_block(fn: Callable | None = None, *, policy: Any = "full",
                     weights: int | Sequence[int] = 0) -> Callable:
    """Activation checkpointing for one block of a plain loss function.

    The result is `fn` as it is in the forward pass, but its backward pass recomputes the
    block's activations from its inputs instead of keeping them, as
    `pockjax.nnx.Trainer(remat="blocks")` does for the blocks of a module. Use it bare or
    with arguments, as a decorator or a wrapper (see the examples). Values are those of
    `fn` itself.

    The recomputation waits for the block output's cotangent, tied to it by data through
    every input but the weights (see `checkpoint_call`), while the weights are used as
    they are (tying them would copy them). The tie is what makes it save memory on XLA's
    CPU backend, where a plain `jax.checkpoint` around each block saves nothing: its
    recomputation is scheduled beside the forward pass.

    Args:
      fn: the block function; None (`checkpoint_block(policy=...)`) returns a decorator.
      policy: what `remat=` takes: `"full"` (the default: nothing saved inside the
        block), a name from `jax.checkpoint_policies` (`"dots_saveable"`, ...) or a
        policy function; None returns `fn` unchanged.
      weights: the positions of the positional arguments that hold the block's weights,
        an int or a sequence of ints: 0 (the default) for the first, as in
        `block(params, h)`; `()` when the block closes over them. Weights passed by
        keyword are tied, and so copied.

    Returns:
      The checkpointed block, taking `fn`'s arguments; without `fn`, a decorator that
      makes one.

    Raises:
      TypeError: `fn` is a string (a policy passed positionally) or not callable,
        `weights` holds something other than non-negative ints, or `policy` is of
        another type; when the block is called, a `weights` position lies past its
        positional arguments.
      ValueError: `policy` names no checkpoint policy; when the block is called, no
        array input besides the weights is left to tie the recomputation to.

    Examples:
      >>> import jax, jax.numpy as jnp, pockjax as pj
      >>> @pj.checkpoint_block
      ... def block(p, h):
      ...     return h + jax.nn.relu(h @ p["up"]) @ p["down"]
      >>> def loss(params, x):
      ...     h = x
      ...     for name in ("b0", "b1"):
      ...         h = block(params[name], h)
      ...     return jnp.mean(h ** 2)
      >>> p = {"up": jnp.ones((4, 8)) / 8, "down": jnp.ones((8, 4)) / 8}
      >>> g = jax.grad(loss)({"b0": p, "b1": p}, jnp.ones((2, 4)))
      >>> g["b1"]["up"].shape
      (4, 8)
      >>> def loss2(p, x):  # weights closed over, the matmuls' outputs saved
      ...     up = pj.checkpoint_block(lambda h: jax.nn.relu(h @ p["up"]), weights=(),
      ...                              policy="dots_saveable")
      ...     return jnp.sum(up(x))
      >>> jax.grad(loss2)(p, jnp.ones((2, 4)))["up"].shape
      (4, 8)
    """
    if fn is None:
        return functools.partial(checkpoint_block, policy=policy, weights=weights)
    if isinstance(fn, str):
        raise TypeError(f"checkpoint_block takes the block function first and the policy by "
                        f"keyword: pj.checkpoint_block(block, policy={fn!r}) or "
                        f"@pj.checkpoint_block(policy={fn!r})")
    if not callable(fn):
        raise TypeError(f"checkpoint_block wraps a block function, e.g. h = pj.checkpoint_block("
                        f"block)(params, h) or @pj.checkpoint_block above its def; got "
                        f"{type(fn).__name__}")
    untied = (weights,) if isinstance(weights, int) else tuple(weights)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in untied):
        raise TypeError(f"checkpoint_block(weights={weights!r}): give the positions of the "
                        f"arguments holding the block's weights, e.g. weights=0 for "
                        f"block(params, h), or weights=() when the block closes over them")
    if policy is None:
        return fn
    spec = Remat.of(policy, where=getattr(fn, "__name__", "a block"), in_loss=True,
                    arg="policy")

    @functools.wraps(fn)
    def block(*args, **kwargs):
        if any(i >= len(args) for i in untied):
            raise TypeError(f"checkpoint_block({spec.where}, weights={weights!r}): the block "
                            f"was called with {len(args)} positional arguments; weights= "
                            f"numbers positional arguments (weights passed by keyword would "
                            f"be copied in the backward pass: pass them positionally)")
        tied = [a for n, a in enumerate(args) if n not in untied] + list(kwargs.values())
        if not any(isinstance(x, (jax.Array, jax.core.Tracer))
                   for x in jax.tree_util.tree_leaves(tied)):
            raise ValueError(
                f"checkpoint_block({spec.where}, weights={weights!r}): no array input is "
                f"left to tie the recomputation to (the block's activations), so it would be "
                f"recomputed in the forward pass and save nothing; weights= names only the "
                f"arguments holding the weights, e.g. weights=0 for block(params, h) or "
                f"weights=() for block(h) with the weights closed over")
        return checkpoint_call(fn, spec.policy, *args, recompute_after_cotangent=True,
                               untied=untied, hoist_closure=True, **kwargs)

    return block


def _late(f: Callable, untied: list[bool]) -> Callable:
    """`f` (of a list of arrays) whose backward pass starts only once the cotangent of
    its output exists; the inputs marked in `untied` are used as they are."""
    kept: list[bool] = []

    @jax.custom_vjp
    def call(inputs):
        return f(inputs)

    def fwd(inputs):
        out, vjp_fn = jax.vjp(f, inputs)
        plain = [x for x, u in zip(inputs, untied) if u]
        kept[:] = [any(r is x for x in plain) for r in jax.tree_util.tree_leaves(vjp_fn)]
        return out, vjp_fn

    def bwd(vjp_fn, g):
        leaves, tree = jax.tree_util.tree_flatten(vjp_fn)
        anchor = tie_zero([x for x in jax.tree_util.tree_leaves(g) if _floating(x)])
        if anchor is not None:
            leaves = [r if k or not _floating(r) else r * (1 + anchor).astype(r.dtype)
                      for r, k in zip(leaves, kept)]
        return jax.tree_util.tree_unflatten(tree, leaves)(g)

    call.defvjp(fwd, bwd)
    return call


def _floating(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)
