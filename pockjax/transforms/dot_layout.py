"""Weight gradients in the layout XLA's CPU backend multiplies fastest.

JAX's transpose rule for `y = x @ w` gives the weight gradient as
`transpose(dot_general(g, x))`: the product of the output gradient and the input, over
the tokens, then swapped into `w`'s layout. XLA's CPU backend keeps that form and
materialises `g` transposed for it, and the product then runs at about half the speed
of the same contraction written `dot_general(x, g)` (measured on the quality benchmark's
small LLaMA: its full fine-tuning step 1.04 -> 0.80 s, `benchmarks/results/edge_speed.md`).

`swap_transposed_dots` rewrites every `transpose(dot_general(a, b))` whose permutation
only swaps the two operands' free dimensions (and whose product has no other use) into
`dot_general(b, a)`: the same sums in the layout the result is wanted in. `sparse_grad`
runs it on every gradient program it builds, except inside `transposed_dots_kept()`,
which `pockjax.export` lowers under: IREE 3.13's Vulkan code generation computes the
swapped form wrong on the export tests' transformer (its first loss 1.89 against 3.50
on lavapipe; host-cpu and XLA agree), so artifacts keep JAX's form.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars

import jax
import jax.extend.core as jex
from jax import lax
from jax.interpreters import partial_eval as pe

from pockjax._src.jaxpr import avals, interpret, is_var, producers

__all__ = ["swap_transposed_dots", "transposed_dots_kept", "enabled"]

_SWAP = contextvars.ContextVar("pockjax_swap_transposed_dots", default=True)


def enabled() -> bool:
    """Whether gradient programs traced now get their transposed dots swapped."""
    return _SWAP.get()


@contextlib.contextmanager
def transposed_dots_kept():
    """A context in which `sparse_grad` keeps JAX's `transpose(dot_general(g, x))` weight
    gradients (programs lowered for IREE)."""
    token = _SWAP.set(False)
    try:
        yield
    finally:
        _SWAP.reset(token)


def _swapped_permutation(dims, lhs_rank: int, rhs_rank: int) -> tuple[int, ...]:
    """The permutation of `dot_general(lhs, rhs, dims)`'s output that is
    `dot_general(rhs, lhs, swapped dims)`'s output: batch, then rhs free, then lhs free."""
    (lc, rc), (lb, rb) = dims
    nb = len(lb)
    nlf = lhs_rank - len(lc) - nb
    nrf = rhs_rank - len(rc) - nb
    return tuple(range(nb)) + tuple(nb + nlf + k for k in range(nrf)) + \
        tuple(nb + k for k in range(nlf))


def _swappable(jaxpr) -> dict[int, int]:
    """Transpose equation index -> the index of the `dot_general` it undoes the operand
    order of (that product used by the transpose alone)."""
    uses = collections.Counter(v for e in jaxpr.eqns for v in e.invars if is_var(v))
    uses.update(v for v in jaxpr.outvars if is_var(v))
    made_by = producers(jaxpr)
    found = {}
    for i, e in enumerate(jaxpr.eqns):
        if e.primitive is not lax.transpose_p or not is_var(e.invars[0]):
            continue
        j = made_by.get(e.invars[0])
        if j is None or uses[e.invars[0]] != 1:
            continue
        d = jaxpr.eqns[j]
        if d.primitive is not lax.dot_general_p:
            continue
        lhs, rhs = (len(v.aval.shape) for v in d.invars)
        perm = tuple(e.params["permutation"])
        if perm != tuple(range(len(perm))) and \
                perm == _swapped_permutation(d.params["dimension_numbers"], lhs, rhs):
            found[i] = j
    return found


def swap_transposed_dots(closed: jex.ClosedJaxpr) -> tuple[jex.ClosedJaxpr, int]:
    """`closed` with each operand-swapping `transpose(dot_general(a, b))` at its top level
    written as `dot_general(b, a)`, and how many were; the same values (the products
    sum the same terms), in the layout XLA's CPU backend multiplies fastest."""
    jaxpr = closed.jaxpr
    found = _swappable(jaxpr)
    if not found:
        return closed, 0
    index_of = {id(e): i for i, e in enumerate(jaxpr.eqns)}

    def override(e, ins, read):
        index = index_of.get(id(e))
        if index not in found:
            return None
        d = jaxpr.eqns[found[index]]
        (lc, rc), (lb, rb) = d.params["dimension_numbers"]
        precision = d.params.get("precision")
        if isinstance(precision, tuple):
            precision = precision[::-1]
        a, b = (read(v) for v in d.invars)
        return [lax.dot_general(b, a, ((rc, lc), (rb, lb)), precision=precision,
                                preferred_element_type=d.params.get("preferred_element_type"))]

    rewritten = jax.make_jaxpr(lambda *args: interpret(jaxpr, closed.consts, args, override))(
        *avals(jaxpr.invars))
    dced, _ = pe.dce_jaxpr(rewritten.jaxpr, [True] * len(rewritten.jaxpr.outvars),
                           instantiate=True)
    if len(dced.invars) != len(rewritten.jaxpr.invars):
        dced = dced.replace(invars=rewritten.jaxpr.invars)
    return jex.ClosedJaxpr(dced, rewritten.consts), len(found)
