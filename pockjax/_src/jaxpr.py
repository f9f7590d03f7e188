"""The jaxpr toolbox every pass uses: one interpreter, jit inlining, re-binding an
equation with the user's source info, avals and small predicates.

- `interpret(jaxpr, consts, args, override=, after=)` evaluates a jaxpr by binding each
  equation (inside `as_source`, so what it emits keeps the user's source line);
  `override` replaces an equation's evaluation, `after` runs after each one.
- `inline_calls` inlines nested `jit` and `closed_call` calls; `bind` re-emits one
  equation on new inputs.
- `dependencies` says which inputs (as bitmasks) each output depends on.
- `consts_to_invars` turns a closed jaxpr's constants into leading inputs.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.extend.core as jex
from jax.extend.core import primitives as P

__all__ = ["interpret", "inline_calls", "bind", "as_source", "describe_source", "avals", "var_shape",
           "is_var", "consts_to_invars", "producers", "call_body", "dependencies"]

try:  # JAX 0.10 has no public API to read or set an equation's source info
    from jax._src import source_info_util as _source_info
except ImportError:  # pragma: no cover - a later JAX moved it: messages lose the user's line
    _source_info = None


def var_shape(v) -> tuple[int, ...]:
    return tuple(v.aval.shape)


def is_var(v) -> bool:
    return isinstance(v, jex.Var) and not isinstance(v, jex.DropVar)


def describe_source(eqn) -> str:
    """The user's source line of an equation, for messages."""
    try:
        return _source_info.summarize(eqn.source_info) or "<unknown source>"
    except Exception:  # pragma: no cover - best effort only
        return "<unknown source>"


_enclosing_traceback = contextvars.ContextVar("pockjax_enclosing_traceback", default=None)


@contextlib.contextmanager
def as_source(eqn):
    """A context in which the equations bound for `eqn` carry `eqn`'s source info.

    Without it every re-bound equation would name the pass's own frame as its source
    (a later pass's messages would point at this file, not the user's line). Like
    `jax.core.eval_jaxpr`: the traceback is the equation's own and its name stack is
    appended to the current one (that of the enclosing call when a `jit` is inlined).
    An equation traced inside a library's jit (`jnp.cumsum`, `jnp.var`) may have no
    user frame at all; it takes the enclosing equation's traceback, the user's call.
    Enter it once per equation: nested for the same equation it repeats the name stack.
    """
    info = getattr(eqn, "source_info", None)
    if _source_info is None or info is None:
        yield
        return
    traceback = info.traceback
    if traceback is None or _source_info.user_frame(traceback) is None:
        traceback = _enclosing_traceback.get() or traceback
    token = _enclosing_traceback.set(traceback)
    try:
        with _source_info.user_context(
                traceback, name_stack=_source_info.current_name_stack() + info.name_stack):
            yield
    finally:
        _enclosing_traceback.reset(token)


def bind(eqn, invals, **overrides):
    """Re-emit `eqn` on new inputs, with some params changed.

    Callers bind inside `as_source(eqn)` (`interpret` and the pass do) so the new
    equation keeps the user's source line.
    """
    params = eqn.primitive.get_bind_params({**eqn.params, **overrides})
    if isinstance(params, tuple):  # (subfuns, params) for some call primitives
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *invals, **params)
    return eqn.primitive.bind(*invals, **params)


def avals(vars_):
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in vars_]


def inline_calls(jaxpr, consts) -> jex.ClosedJaxpr:
    """`jaxpr` with nested plain calls (`jit`, `closed_call`: see `call_body`) inlined, as
    a closed jaxpr over the same inputs."""
    if not any(e.primitive in _CALL_BODIES for e in jaxpr.eqns):
        return jex.ClosedJaxpr(jaxpr, list(consts))

    def inline(e, ins, read):
        sub = call_body(e)
        return None if sub is None else interpret(sub.jaxpr, sub.consts, ins, inline)

    return jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, inline))(*avals(jaxpr.invars))


def interpret(jaxpr, consts, args, override=None, after=None):
    """Evaluate `jaxpr` by binding each equation; `override(eqn, ins, read)` may return
    the equation's outputs itself (or None to bind it as it is); `after(i, read)` runs
    after equation `i` (and once with i = -1 before the first)."""
    env = {}
    read = lambda v: v.val if isinstance(v, jex.Literal) else env[v]
    for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args)):
        env[v] = x
    if after:
        after(-1, read)
    for i, e in enumerate(jaxpr.eqns):
        ins = [read(v) for v in e.invars]
        with as_source(e):  # also for what `override` emits, e.g. an inlined jit's body
            outs = override(e, ins, read) if override else None
            if outs is None:
                outs = bind(e, ins)
                outs = outs if e.primitive.multiple_results else [outs]
        for v, o in zip(e.outvars, outs):
            if is_var(v):
                env[v] = o
        if after:
            after(i, read)
    return [read(v) for v in jaxpr.outvars]


def consts_to_invars(jaxpr: jex.Jaxpr | jex.ClosedJaxpr) -> jex.Jaxpr:
    """The open jaxpr with its constants turned into leading inputs."""
    j = jaxpr.jaxpr if isinstance(jaxpr, jex.ClosedJaxpr) else jaxpr
    return j.replace(constvars=[], invars=[*j.constvars, *j.invars])


_CALL_BODIES = {P.jit_p: "jaxpr", P.closed_call_p: "call_jaxpr"}


def call_body(eqn) -> jex.ClosedJaxpr | None:
    """The body of a plain call equation (`jit`, `closed_call`) as a closed jaxpr, whose
    inputs and outputs are the equation's; None for any other equation."""
    param = _CALL_BODIES.get(eqn.primitive)
    if param is None:
        return None
    body = eqn.params[param]
    return body if isinstance(body, jex.ClosedJaxpr) else jex.ClosedJaxpr(body, [])


def producers(jaxpr) -> dict:
    """Each variable defined by an equation of `jaxpr` -> that equation's index."""
    return {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars if is_var(v)}


def dependencies(jaxpr: jex.Jaxpr, in_masks, own=None, seen=None) -> list[int]:
    """The bitmask each output of `jaxpr` depends on, given a bitmask per input.

    An equation's outputs depend on the union of its inputs' masks (and on `own(i)`, bits
    equation `i` adds itself, if given); plain calls (`call_body`) are followed into their
    bodies; other higher-order primitives (scan, while, cond) make every output depend on
    every input. `seen(i, mask)`, if given, gets the union of equation `i`'s input masks.
    Constants depend on nothing.
    """
    env = dict(zip(jaxpr.invars, in_masks))
    read = lambda v: env.get(v, 0) if is_var(v) else 0
    for i, e in enumerate(jaxpr.eqns):
        ins = [read(v) for v in e.invars]
        union = 0
        for m in ins:
            union |= m
        if seen is not None:
            seen(i, union)
        sub = call_body(e)
        outs = dependencies(sub.jaxpr, ins) if sub is not None else [union] * len(e.outvars)
        extra = own(i) if own is not None else 0
        for v, m in zip(e.outvars, outs):
            if is_var(v):
                env[v] = m | extra
    return [read(v) for v in jaxpr.outvars]
