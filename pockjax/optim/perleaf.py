"""Is an optax update per-leaf? If so, split it into one small update per parameter.

An optax `update(grads, state, params)` is traced to a jaxpr over the flat inputs
`grads + state + params` of the trainable view. Dependencies are propagated through
its equations; the chain is *per-leaf* when every trainable leaf's update, and the
state it writes, depend only on that leaf's gradient, parameter and state, plus
*shared* state (state whose new value depends on no gradient or parameter, such as
adam's step count or a schedule's counter). Then each leaf gets its own jaxpr (a DCE
of the whole one, found in one pass), which the fused step runs as soon as that leaf's gradient exists.

A chain such as `clip_by_global_norm` makes every update depend on every gradient;
it is reported as global, with the two parameters that tie it together.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.extend.core as jex
from jax.interpreters import partial_eval as pe

from pockjax._src.jaxpr import consts_to_invars, dependencies, is_var

__all__ = ["LeafUpdate", "UpdatePlan", "plan_updates"]


@dataclasses.dataclass(frozen=True)
class LeafUpdate:
    """The update of one trainable leaf.

    `jaxpr` takes `inputs` (indices into the flat `grads + state + params` inputs of
    the whole update) and returns the leaf's update followed by its new state leaves
    (`state_out`, indices into the flat state).

    Attributes:
      leaf: the index of the trainable leaf in the view's flat order.
      jaxpr: the leaf's part of the update.
      inputs: indices into the flat `grads + state + params` inputs that `jaxpr` takes,
        in order.
      state_out: indices into the flat state of the state leaves `jaxpr` returns after
        the update.
    """

    leaf: int
    jaxpr: jex.ClosedJaxpr
    inputs: tuple[int, ...]
    state_out: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """How a training step applies its optimizer: `mode` is "fused" or "global".

    Attributes:
      mode: `"fused"` (every leaf's update runs on its own, as soon as its gradient
        exists) or `"global"` (after the whole backward pass).
      reason: why, one sentence for reports.
      leaves: in fused mode, one `LeafUpdate` per trainable leaf; empty in global mode.
      shared: the jaxpr computing the state that belongs to no single leaf (shared
        state such as a step count, which no gradient or parameter affects), or None
        when there is none.
      shared_inputs: indices into the flat `grads + state + params` inputs that
        `shared` takes.
      shared_out: indices into the flat state of the leaves `shared` returns, in order.
    """

    mode: str
    reason: str
    leaves: tuple[LeafUpdate, ...] = ()
    shared: jex.ClosedJaxpr | None = None       # shared state in -> shared state out
    shared_inputs: tuple[int, ...] = ()
    shared_out: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Bits:
    """Bit positions of the flat inputs `grads (n) + state (m) + params (n)` in the
    dependency masks: leaf i is its gradient's and its parameter's bit, state j one bit."""

    n: int
    m: int

    def leaf(self, i: int) -> int:
        return (1 << i) | (1 << (self.n + self.m + i))

    def state(self, j: int) -> int:
        return 1 << (self.n + j)


class _UnionFind:
    def __init__(self, n):
        self.parent = list(range(n))

    def find(self, a):
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def _sub_jaxprs(closed: jex.ClosedJaxpr, groups: Sequence[Sequence[int]]
                ) -> list[tuple[jex.ClosedJaxpr, list[int]]]:
    """`_sub_jaxpr` of each group of outputs, in one backward pass over the equations
    rather than one dead-code elimination of the whole jaxpr per group (which grows as
    the number of parameters squared): each equation is marked with the groups that read
    its outputs, and each group's DCE then runs over its own equations only. A jaxpr
    with effects takes the plain path."""
    jaxpr = closed.jaxpr
    if jaxpr.effects:
        return [_sub_jaxpr(closed, outs) for outs in groups]
    need: dict = {}
    for g, outs in enumerate(groups):
        for o in outs:
            v = jaxpr.outvars[o]
            if is_var(v):
                need[v] = need.get(v, 0) | (1 << g)
    marks = [0] * len(jaxpr.eqns)
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        e = jaxpr.eqns[i]
        mark = 0
        for v in e.outvars:
            if is_var(v):
                mark |= need.get(v, 0)
        marks[i] = mark
        if mark:
            for v in e.invars:
                if is_var(v):
                    need[v] = need.get(v, 0) | mark
    out = []
    for g, outs in enumerate(groups):
        bit = 1 << g
        own = jaxpr.replace(eqns=[e for e, mark in zip(jaxpr.eqns, marks) if mark & bit])
        out.append(_sub_jaxpr(jex.ClosedJaxpr(own, closed.consts), outs))
    return out


def _sub_jaxpr(closed: jex.ClosedJaxpr, outputs: Sequence[int]) -> tuple[jex.ClosedJaxpr, list[int]]:
    """`closed` restricted to `outputs`, and the inputs it still reads."""
    jaxpr = consts_to_invars(closed.jaxpr)
    n_consts = len(closed.consts)
    jaxpr = jaxpr.replace(outvars=[jaxpr.outvars[i] for i in outputs])
    dced, used = pe.dce_jaxpr(jaxpr, [True] * len(outputs))
    used_consts = [c for c, u in zip(closed.consts, used[:n_consts]) if u]
    inputs = [i for i, u in enumerate(used[n_consts:]) if u]
    # Turn the used constants back into constants of the sub-jaxpr.
    n_used_consts = len(used_consts)
    dced = dced.replace(constvars=dced.invars[:n_used_consts], invars=dced.invars[n_used_consts:])
    return jex.ClosedJaxpr(dced, used_consts), inputs


def plan_updates(optimizer, grads_view, state, params_view, names: Sequence[str]) -> UpdatePlan:
    """Trace `optimizer.update` on the trainable view and decide fused or global.

    `grads_view` and `params_view` have the same structure (the trainable view, with
    None for frozen leaves); `names` are the paths of its array leaves, for messages.

    Args:
      optimizer: the optax `GradientTransformation`.
      grads_view: gradients (arrays or shapes) in the trainable view.
      state: the optimizer state.
      params_view: the parameters in the trainable view.
      names: the paths of the view's array leaves.

    Returns:
      An `UpdatePlan`: "fused" with one `LeafUpdate` per leaf, or "global" naming two
        leaves whose updates are tied.

    Raises:
      ValueError: the optimizer returns updates whose structure is not the view's, or
        changes the structure of its state.
    """
    g_leaves, view_def = jax.tree_util.tree_flatten(grads_view)
    p_leaves = jax.tree_util.tree_leaves(params_view)
    s_leaves, s_def = jax.tree_util.tree_flatten(state)
    n, m = len(g_leaves), len(s_leaves)

    def flat_update(*flat):
        g = jax.tree_util.tree_unflatten(view_def, flat[:n])
        s = jax.tree_util.tree_unflatten(s_def, flat[n:n + m])
        p = jax.tree_util.tree_unflatten(view_def, flat[n + m:])
        u, s2 = optimizer.update(g, s, p)
        u_leaves, u_def = jax.tree_util.tree_flatten(u)
        s2_leaves, s2_def = jax.tree_util.tree_flatten(s2)
        if u_def != view_def:
            raise ValueError(f"the optimizer returned updates with structure {u_def}, "
                             f"expected the trainable view's {view_def}")
        if s2_def != s_def:
            raise ValueError("the optimizer's update changed the structure of its state "
                             f"from {s_def} to {s2_def}")
        return [*u_leaves, *s2_leaves]

    closed = jax.make_jaxpr(flat_update)(*g_leaves, *s_leaves, *p_leaves)
    masks = dependencies(consts_to_invars(closed.jaxpr),
                         [0] * len(closed.consts) + [1 << i for i in range(2 * n + m)])
    u_deps, s_deps = masks[:n], masks[n:]
    bits = _Bits(n, m)
    leaf_bits = 0
    for i in range(n):
        leaf_bits |= bits.leaf(i)

    # Shared state: its new value depends on no gradient or parameter, and only on
    # other shared state (fixpoint from "all candidates").
    shared = {j for j in range(m) if not s_deps[j] & leaf_bits}
    changed = True
    while changed:
        changed = False
        for j in sorted(shared):
            others = [k for k in range(m) if s_deps[j] & bits.state(k) and k not in shared]
            if others:
                shared.discard(j)
                changed = True

    # Components over leaves (0..n-1) and non-shared state (n..n+m-1).
    uf = _UnionFind(n + m)

    def items(mask):
        out = []
        for i in range(n):
            if mask & bits.leaf(i):
                out.append(i)
        for j in range(m):
            if j not in shared and mask & bits.state(j):
                out.append(n + j)
        return out

    for i in range(n):
        for it in items(u_deps[i]):
            uf.union(i, it)
    for j in range(m):
        if j not in shared:
            for it in items(s_deps[j]):
                uf.union(n + j, it)

    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(uf.find(i), []).append(i)
    for leaves in groups.values():
        if len(leaves) > 1:
            a, b = names[leaves[0]], names[leaves[1]]
            return UpdatePlan(
                mode="global",
                reason=f"the update of '{a}' depends on the gradient, parameter or state of "
                       f"'{b}' ({len(leaves)} parameters are tied, e.g. by a global norm); "
                       "the optimizer runs after the whole backward pass")
    # Non-shared state not tied to any leaf is computed with the shared state.
    comp_of_leaf = {uf.find(i): i for i in range(n)}
    leaf_state: dict[int, list[int]] = {i: [] for i in range(n)}
    extra_shared = []
    for j in range(m):
        if j in shared:
            continue
        owner = comp_of_leaf.get(uf.find(n + j))
        if owner is None:
            extra_shared.append(j)
        else:
            leaf_state[owner].append(j)

    shared_out = sorted(shared) + extra_shared
    groups = [[i] + [n + j for j in leaf_state[i]] for i in range(n)]
    subs = _sub_jaxprs(closed, groups + ([[n + j for j in shared_out]] if shared_out else []))
    leaf_updates = [LeafUpdate(i, sub, tuple(inputs), tuple(leaf_state[i]))
                    for i, (sub, inputs) in enumerate(subs[:n])]
    shared_jaxpr, shared_inputs = subs[n] if shared_out else (None, [])
    return UpdatePlan(mode="fused",
                      reason="every parameter's update depends only on its own gradient, "
                             "parameter and state, and on shared scalars",
                      leaves=tuple(leaf_updates), shared=shared_jaxpr,
                      shared_inputs=tuple(shared_inputs), shared_out=tuple(shared_out))
