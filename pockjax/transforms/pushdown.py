"""Slice push-down: compute only the part of each value that is used.

A *box* is a tuple of `(start, stop)` pairs, one per dimension of a value. The pass
walks a jaxpr backwards and records, for every variable, the boxes its consumers
need (a `slice` needs a box of its operand; a `dot_general` whose output is needed
in a box needs boxes of its operands; most other uses need the whole value). It then
re-traces the jaxpr forwards computing, for every needed box, just that part of the
value. Equations nobody needs are dropped on the way (dead-code elimination).

Rules live in one table keyed by primitive name: `pull(eqn, i, box)` says which
(variable, box) pairs computing box `box` of output `i` needs, or returns `None`
when it cannot do better than computing the whole output; `apply(ctx, eqn, i, box)`
emits that computation. A primitive without a rule takes the always-correct path
(compute all of it, then slice) and is counted in `Stats.fallbacks`.

Higher-order primitives recurse: a box of a `scan`, `remat` or `cond` output becomes
an extra output of the rewritten body; `jit` is inlined; `while` bodies are rewritten
in place; `custom_jvp_call`/`custom_vjp_call` (which only remain on the primal path of
a gradient jaxpr) are kept as they are.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.extend.core as jex
import numpy as np
from jax import lax
from jax.extend.core import primitives as P

Box = tuple  # tuple[tuple[int, int], ...]


# --------------------------------------------------------------------------- boxes


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def is_full(box: Box, shape: Sequence[int]) -> bool:
    return all(s == 0 and e == n for (s, e), n in zip(box, shape))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(e - s for s, e in box)


def slice_to_box(x, box: Box, shape: Sequence[int]):
    if is_full(box, shape):
        return x
    return lax.slice(x, [s for s, _ in box], [e for _, e in box])


def _shape(v) -> tuple[int, ...]:
    return tuple(v.aval.shape)


def _is_var(v) -> bool:
    return isinstance(v, jex.Var) and not isinstance(v, jex.DropVar)


def _describe_source(eqn) -> str:
    """The user's source line of an equation, for messages."""
    try:
        from jax._src import source_info_util  # no public equivalent in 0.10
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - best effort only
        return "<unknown source>"


# --------------------------------------------------------------------------- stats


@dataclasses.dataclass
class Stats:
    """What the pass did: rules applied and fallbacks per primitive, equations in and out."""

    rules: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallback_sources: dict = dataclasses.field(default_factory=dict)
    eqns_in: int = 0
    eqns_out: int = 0

    def rule(self, name: str):
        self.rules[name] += 1

    def fallback(self, eqn):
        name = eqn.primitive.name
        self.fallbacks[name] += 1
        self.fallback_sources.setdefault(name, _describe_source(eqn))


# --------------------------------------------------------------------------- rule table


class Rule(NamedTuple):
    pull: Callable  # (eqn, i, box) -> list[(var, box)] | None
    apply: Callable  # (ctx, eqn, i, box) -> value
    slicing: bool = False  # also used for the full box (slice-like primitives)


RULES: dict[str, Rule] = {}


def register(names: str | Sequence[str], pull: Callable, apply: Callable, slicing: bool = False):
    """Register a push-down rule for primitives by name (also usable by other modules)."""
    for name in [names] if isinstance(names, str) else names:
        RULES[name] = Rule(pull, apply, slicing)


def _bind(eqn, invals, **overrides):
    """Re-emit `eqn` on new inputs, with some params changed."""
    params = eqn.primitive.get_bind_params({**eqn.params, **overrides})
    if isinstance(params, tuple):  # (subfuns, params) for some call primitives
        subfuns, params = params
        return eqn.primitive.bind(*subfuns, *invals, **params)
    return eqn.primitive.bind(*invals, **params)


def _rebind_on_pulled(pull):
    """An apply rule for one-operand ops: the op re-bound on its pulled operand box."""
    def apply(ctx, eqn, i, box):
        (v, b), = pull(eqn, i, box)
        return _bind(eqn, [ctx.get(v, b)])
    return apply


def _pulled_itself(pull):
    """An apply rule for slicing ops: the pulled operand box is the result."""
    def apply(ctx, eqn, i, box):
        (v, b), = pull(eqn, i, box)
        return ctx.get(v, b)
    return apply


# -- elementwise ---------------------------------------------------------------

ELEMENTWISE = (
    "neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan "
    "asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs erf erfc erf_inv lgamma "
    "digamma square integer_pow convert_element_type reduce_precision copy copy_p real imag "
    "conj not add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge "
    "add_any select_n clamp stop_gradient"
).split()


def _elementwise_pull(eqn, i, box):
    out_shape = _shape(eqn.outvars[0])
    needs = []
    for v in eqn.invars:
        if not _is_var(v):
            continue
        s = _shape(v)
        if s == out_shape:
            needs.append((v, box))
        elif s == ():
            needs.append((v, ()))
        else:
            return None
    return needs


def _elementwise_apply(ctx, eqn, i, box):
    out_shape = _shape(eqn.outvars[0])
    return _bind(eqn, [ctx.get(v, box if _is_var(v) and _shape(v) == out_shape else None)
                       for v in eqn.invars])


register(ELEMENTWISE, _elementwise_pull, _elementwise_apply)


# -- layout ----------------------------------------------------------------------


def _transpose_pull(eqn, i, box):
    perm = eqn.params["permutation"]
    opbox = [None] * len(perm)
    for d, p in enumerate(perm):
        opbox[p] = box[d]
    return [(eqn.invars[0], tuple(opbox))]


register("transpose", _transpose_pull, _rebind_on_pulled(_transpose_pull))


def _squeeze_pull(eqn, i, box):
    dims = set(d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    it = iter(box)
    opbox = tuple((0, 1) if d in dims else next(it) for d in range(len(_shape(eqn.invars[0]))))
    return [(eqn.invars[0], opbox)]


register("squeeze", _squeeze_pull, _rebind_on_pulled(_squeeze_pull))


def _reshape_groups(in_shape, out_shape):
    """Pairs of (in dims, out dims) ranges with equal products: how a row-major reshape
    regroups dimensions."""
    groups, i, j = [], 0, 0
    while i < len(in_shape) and j < len(out_shape):
        i0, j0 = i, j
        pi, po = in_shape[i], out_shape[j]
        while pi != po:
            if pi < po:
                i += 1
                pi *= in_shape[i]
            else:
                j += 1
                po *= out_shape[j]
        i, j = i + 1, j + 1
        groups.append([range(i0, i), range(j0, j)])
    if groups:  # trailing size-1 dims join the last group
        groups[-1][0] = range(groups[-1][0].start, len(in_shape))
        groups[-1][1] = range(groups[-1][1].start, len(out_shape))
    return groups


def _box_to_flat(box, dims):
    """The flat [a, b) range a box covers, if it is contiguous in row-major order."""
    partial = [k for k, ((s, e), n) in enumerate(zip(box, dims)) if (s, e) != (0, n)]
    if not partial:
        return 0, math.prod(dims)
    k = partial[0]
    if any(box[m][1] - box[m][0] != 1 for m in partial[1:]) or any(
            box[m] != (0, dims[m]) for m in range(k + 1, len(dims))):
        return None
    if any(box[m][1] - box[m][0] != 1 for m in range(k)):
        return None
    stride = math.prod(dims[k + 1:])
    base = sum(box[m][0] * math.prod(dims[m + 1:]) for m in range(k))
    return base + box[k][0] * stride, base + box[k][1] * stride


def _flat_to_box(a, b, dims):
    """A box covering exactly the flat range [a, b) of row-major `dims`, if there is one."""
    for k in range(len(dims)):
        stride = math.prod(dims[k + 1:])
        if a % stride or b % stride:
            continue
        q0, q1 = a // stride, b // stride
        if q0 // dims[k] != (q1 - 1) // dims[k]:
            continue
        box, rest = [], q0 // dims[k]
        for m in range(k - 1, -1, -1):
            box.insert(0, (rest % dims[m], rest % dims[m] + 1))
            rest //= dims[m]
        box.append((q0 % dims[k], q0 % dims[k] + (q1 - q0)))
        box += [(0, n) for n in dims[k + 1:]]
        return tuple(box)
    return None


def _reshape_pull(eqn, i, box):
    if eqn.params.get("dimensions") is not None:
        return None
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    if 0 in in_shape:
        return None
    opbox = []
    for ins, outs in _reshape_groups(in_shape, out_shape):
        flat = _box_to_flat([box[d] for d in outs], [out_shape[d] for d in outs])
        sub = None if flat is None else _flat_to_box(*flat, [in_shape[d] for d in ins])
        if sub is None:
            return None
        opbox += list(sub)
    return [(eqn.invars[0], tuple(opbox))]


def _reshape_apply(ctx, eqn, i, box):
    (v, b), = _reshape_pull(eqn, i, box)
    return _bind(eqn, [ctx.get(v, b)], new_sizes=box_shape(box))


register("reshape", _reshape_pull, _reshape_apply)


def _broadcast_pull(eqn, i, box):
    v = eqn.invars[0]
    if not _is_var(v):
        return []
    out_shape = _shape(eqn.outvars[0])
    opbox = []
    for j, od in enumerate(eqn.params["broadcast_dimensions"]):
        n = _shape(v)[j]
        opbox.append((0, 1) if n == 1 and out_shape[od] != 1 else box[od])
    return [(v, tuple(opbox))] + [(w, full_box(_shape(w))) for w in eqn.invars[1:] if _is_var(w)]


def _broadcast_apply(ctx, eqn, i, box):
    needs = _broadcast_pull(eqn, i, box)
    v = eqn.invars[0]
    x = ctx.get(v, needs[0][1]) if needs else v.val
    return _bind(eqn, [x] + [ctx.get(w, None) for w in eqn.invars[1:]], shape=box_shape(box))


register("broadcast_in_dim", _broadcast_pull, _broadcast_apply)


def _reduce_pull(eqn, i, box):
    v = eqn.invars[0]
    axes = set(eqn.params["axes"])
    it = iter(box)
    opbox = tuple((0, n) if d in axes else next(it) for d, n in enumerate(_shape(v)))
    return [(v, opbox)]


register(["reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"],
         _reduce_pull, _rebind_on_pulled(_reduce_pull))


# -- slicing (these also run for the whole output: they need only part of their input)


def _slice_pull(eqn, i, box):
    strides = eqn.params["strides"]
    if strides is not None and any(s != 1 for s in strides):
        return None
    starts = eqn.params["start_indices"]
    return [(eqn.invars[0], tuple((a + s, a + e) for a, (s, e) in zip(starts, box)))]


register("slice", _slice_pull, _pulled_itself(_slice_pull), slicing=True)


def _split_pull(eqn, i, box):
    axis = eqn.params["axis"]
    off = sum(eqn.params["sizes"][:i])
    opbox = list(box)
    opbox[axis] = (box[axis][0] + off, box[axis][1] + off)
    return [(eqn.invars[0], tuple(opbox))]


register("split", _split_pull, _pulled_itself(_split_pull), slicing=True)


def _unstack_pull(eqn, i, box):
    axis = eqn.params["axis"]
    opbox = list(box)
    opbox.insert(axis, (i, i + 1))
    return [(eqn.invars[0], tuple(opbox))]


def _unstack_apply(ctx, eqn, i, box):
    (v, b), = _unstack_pull(eqn, i, box)
    return lax.squeeze(ctx.get(v, b), (eqn.params["axis"],))


register("unstack", _unstack_pull, _unstack_apply, slicing=True)


def _stack_pull(eqn, i, box):
    axis = eqn.params["axis"]
    s, e = box[axis]
    inner = box[:axis] + box[axis + 1:]
    return [(v, inner) for v in eqn.invars[s:e] if _is_var(v)]


def _stack_apply(ctx, eqn, i, box):
    axis = eqn.params["axis"]
    s, e = box[axis]
    inner = box[:axis] + box[axis + 1:]
    parts = [ctx.get(v, inner) for v in eqn.invars[s:e]]
    return lax.concatenate([lax.expand_dims(p, (axis,)) for p in parts], axis) \
        if len(parts) > 1 else lax.expand_dims(parts[0], (axis,))


register("stack", _stack_pull, _stack_apply)


def _concat_pieces(eqn, box):
    dim = eqn.params["dimension"]
    s, e = box[dim]
    pieces, off = [], 0
    for v in eqn.invars:
        n = _shape(v)[dim]
        lo, hi = max(s, off), min(e, off + n)
        if lo < hi:
            b = list(box)
            b[dim] = (lo - off, hi - off)
            pieces.append((v, tuple(b)))
        off += n
    return pieces


def _concat_pull(eqn, i, box):
    return [(v, b) for v, b in _concat_pieces(eqn, box) if _is_var(v)]


def _concat_apply(ctx, eqn, i, box):
    parts = [ctx.get(v, b) for v, b in _concat_pieces(eqn, box)]
    return parts[0] if len(parts) == 1 else lax.concatenate(parts, eqn.params["dimension"])


register("concatenate", _concat_pull, _concat_apply)


def _pad_pull(eqn, i, box):
    x, pv = eqn.invars
    cfg = eqn.params["padding_config"]
    if any(interior != 0 for _, _, interior in cfg):
        return None
    opbox = []
    for (s, e), (lo, _, _), n in zip(box, cfg, _shape(x)):
        a, b = max(s, lo), min(e, lo + n)
        if a >= b:
            return [(pv, ())] if _is_var(pv) else []
        opbox.append((a - lo, b - lo))
    return ([(x, tuple(opbox))] if _is_var(x) else []) + ([(pv, ())] if _is_var(pv) else [])


def _pad_apply(ctx, eqn, i, box):
    x, pv = eqn.invars
    cfg = eqn.params["padding_config"]
    pad_value = ctx.get(pv, ())
    opbox, new_cfg = [], []
    for (s, e), (lo, _, _), n in zip(box, cfg, _shape(x)):
        a, b = max(s, lo), min(e, lo + n)
        if a >= b:
            return lax.broadcast_in_dim(pad_value, box_shape(box), ())
        opbox.append((a - lo, b - lo))
        new_lo = a - s
        new_cfg.append((new_lo, (e - s) - new_lo - (b - a), 0))
    return lax.pad(ctx.get(x, tuple(opbox)), pad_value, new_cfg)


register("pad", _pad_pull, _pad_apply)


def _dynamic_slice_pull(eqn, i, box):
    x, *idx = eqn.invars
    sizes = eqn.params["slice_sizes"]
    opbox = []
    for (s, e), size, n in zip(box, sizes, _shape(x)):
        if (s, e) != (0, size):
            if size != n:  # only dims the slice spans whole can be narrowed
                return None
        opbox.append((s, e) if size == n else (0, n))
    return [(x, tuple(opbox))] + [(v, ()) for v in idx if _is_var(v)]


def _dynamic_slice_apply(ctx, eqn, i, box):
    x, *idx = eqn.invars
    sizes = eqn.params["slice_sizes"]
    (_, opbox), *_ = _dynamic_slice_pull(eqn, i, box)
    new_sizes = tuple(e - s if size == n else size
                      for (s, e), size, n in zip(box, sizes, _shape(x)))
    return _bind(eqn, [ctx.get(x, opbox)] + [ctx.get(v, ()) for v in idx], slice_sizes=new_sizes)


register("dynamic_slice", _dynamic_slice_pull, _dynamic_slice_apply)


def _dus_pull(eqn, i, box):
    x, upd, *idx = eqn.invars
    for (s, e), n, u in zip(box, _shape(x), _shape(upd)):
        if (s, e) != (0, n) and u != n:
            return None
    needs = [(x, box)] if _is_var(x) else []
    needs += [(upd, _dus_update_box(eqn, box))] if _is_var(upd) else []
    return needs + [(v, ()) for v in idx if _is_var(v)]


def _dus_update_box(eqn, box):
    """The update's box: narrowed only where the update spans the whole axis."""
    x, upd = eqn.invars[:2]
    return tuple(b if u == n else (0, u) for b, n, u in zip(box, _shape(x), _shape(upd)))


def _dus_apply(ctx, eqn, i, box):
    x, upd, *idx = eqn.invars
    return _bind(eqn, [ctx.get(x, box), ctx.get(upd, _dus_update_box(eqn, box))]
                 + [ctx.get(v, ()) for v in idx])


register("dynamic_update_slice", _dus_pull, _dus_apply)


# -- contractions ----------------------------------------------------------------


def _dot_boxes(eqn, box):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    nb = len(lb)
    lfree = [d for d in range(len(_shape(lhs))) if d not in lc and d not in lb]
    rfree = [d for d in range(len(_shape(rhs))) if d not in rc and d not in rb]

    def operand_box(shape, contract, batch, free, offset):
        b = []
        for d, n in enumerate(shape):
            if d in contract:
                b.append((0, n))
            elif d in batch:
                b.append(box[list(batch).index(d)])
            else:
                b.append(box[offset + free.index(d)])
        return tuple(b)

    return (operand_box(_shape(lhs), lc, lb, lfree, nb),
            operand_box(_shape(rhs), rc, rb, rfree, nb + len(lfree)))


def _dot_pull(eqn, i, box):
    lb, rb = _dot_boxes(eqn, box)
    return [(v, b) for v, b in zip(eqn.invars, (lb, rb)) if _is_var(v)]


def _dot_apply(ctx, eqn, i, box):
    lb, rb = _dot_boxes(eqn, box)
    return _bind(eqn, [ctx.get(eqn.invars[0], lb), ctx.get(eqn.invars[1], rb)])


register("dot_general", _dot_pull, _dot_apply)


def _conv_plan(eqn, box):
    """Operand boxes and group counts for a box of a conv output, or None."""
    lhs, rhs = eqn.invars
    dn = eqn.params["dimension_numbers"]
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    out_shape = _shape(eqn.outvars[0])
    for d in ospec[2:]:
        if box[d] != (0, out_shape[d]):
            return None
    G, B = eqn.params["feature_group_count"], eqn.params["batch_group_count"]
    lbox, rbox = list(full_box(_shape(lhs))), list(full_box(_shape(rhs)))
    bs, be = box[ospec[0]]
    fs, fe = box[ospec[1]]
    O = out_shape[ospec[1]]
    if (bs, be) != (0, out_shape[ospec[0]]):
        if B != 1:
            return None
        lbox[lspec[0]] = (bs, be)
    if (fs, fe) != (0, O):
        groups = max(G, B)
        gsize = O // groups
        if groups > 1 and (fs % gsize or fe % gsize):
            return None  # only whole groups can be kept
        rbox[rspec[0]] = (fs, fe)
        g0, g1 = fs // gsize, fe // gsize
        if G > 1:
            cg = _shape(lhs)[lspec[1]] // G
            lbox[lspec[1]] = (g0 * cg, g1 * cg)
            G = g1 - g0
        elif B > 1:
            ng = _shape(lhs)[lspec[0]] // B
            lbox[lspec[0]] = (g0 * ng, g1 * ng)
            B = g1 - g0
    return tuple(lbox), tuple(rbox), G, B


def _conv_pull(eqn, i, box):
    plan = _conv_plan(eqn, box)
    if plan is None:
        return None
    lbox, rbox, _, _ = plan
    return [(v, b) for v, b in zip(eqn.invars, (lbox, rbox)) if _is_var(v)]


def _conv_apply(ctx, eqn, i, box):
    lbox, rbox, G, B = _conv_plan(eqn, box)
    return _bind(eqn, [ctx.get(eqn.invars[0], lbox), ctx.get(eqn.invars[1], rbox)],
                 feature_group_count=G, batch_group_count=B)


register("conv_general_dilated", _conv_pull, _conv_apply)


# --------------------------------------------------------------------------- the pass

class _Ctx:
    """Values of (variable, box) pairs during the forward re-trace."""

    def __init__(self):
        self.env: dict = collections.defaultdict(dict)  # var -> {box: value}

    def get(self, v, box=None):
        if isinstance(v, jex.Literal):
            return v.val
        shape = _shape(v)
        box = full_box(shape) if box is None else tuple(box)
        have = self.env[v]
        if box in have:
            return have[box]
        for b, val in have.items():  # slice from a stored box that contains this one
            if all(s0 <= s and e <= e0 for (s0, e0), (s, e) in zip(b, box)):
                rel = tuple((s - s0, e - s0) for (s0, _), (s, e) in zip(b, box))
                have[box] = slice_to_box(val, rel, box_shape(b))
                return have[box]
        raise AssertionError(f"pockjax internal error: {v} box {box} was not computed")

    def put(self, v, box, val):
        self.env[v][tuple(box)] = val


def _folded_concat(eqn, producers):
    """`x` if this is `concatenate(x[a:b], x[b:c], ...)` covering all of `x`, else None."""
    dim = eqn.params["dimension"]
    src, pos = None, 0
    for v in eqn.invars:
        e = producers.get(v) if _is_var(v) else None
        if e is None or e.primitive.name != "slice" or e.params["strides"] not in (None,) and any(
                s != 1 for s in e.params["strides"]):
            return None
        x = e.invars[0]
        if not _is_var(x) or (src is not None and x is not src) or _shape(x) != _shape(eqn.outvars[0]):
            return None
        src = x
        starts, limits = e.params["start_indices"], e.params["limit_indices"]
        for d, (s, l, n) in enumerate(zip(starts, limits, _shape(x))):
            if d == dim:
                if s != pos:
                    return None
                pos = l
            elif (s, l) != (0, n):
                return None
    return src if src is not None and pos == _shape(src)[dim] else None


def _analyse(jaxpr, out_needs, stats):
    """Backward pass: the boxes needed of every variable, and how each is produced.

    An equation is *narrowed* when it has a rule and none of its outputs is needed
    whole: each needed box is then computed by the rule from boxes of its inputs.
    Otherwise it runs whole and the boxes are sliced from its outputs.
    """
    needs: dict = collections.defaultdict(set)
    for v, boxes in zip(jaxpr.outvars, out_needs):
        if _is_var(v):
            needs[v].update(tuple(b) for b in boxes)
    plans = {}  # id(eqn) -> (whole: bool, {(i, box): [(var, box)]}, wanted)
    producers = {v: e for e in jaxpr.eqns for v in e.outvars if _is_var(v)}
    for eqn in reversed(jaxpr.eqns):
        outs = [(i, v) for i, v in enumerate(eqn.outvars) if _is_var(v) and needs.get(v)]
        if not outs and not eqn.effects:
            continue  # dead
        name = eqn.primitive.name
        src = _folded_concat(eqn, producers) if name == "concatenate" else None
        if src is not None:
            plans[id(eqn)] = ("alias", src, None)
            needs[src].add(full_box(_shape(src)))
            continue
        if name in _CALLS:
            plans[id(eqn)] = (True, {}, [])
            for w in eqn.invars:
                if _is_var(w):
                    needs[w].add(full_box(_shape(w)))
            continue
        rule = RULES.get(name)
        wanted = [(i, box) for i, v in outs for box in needs[v]]
        whole = bool(eqn.effects) or rule is None or any(
            box == full_box(_shape(eqn.outvars[i])) and not rule.slicing for i, box in wanted)
        plan = {}
        if not whole:
            for i, box in wanted:
                try:
                    pulled = rule.pull(eqn, i, box)
                except Exception:  # a rule declines cases it does not cover
                    pulled = None
                if pulled is None:
                    whole, plan = True, {}
                    break
                plan[(i, box)] = pulled
        if whole:
            if any(box != full_box(_shape(eqn.outvars[i])) for i, box in wanted) and not any(
                    box == full_box(_shape(eqn.outvars[i])) for i, box in wanted):
                stats.fallback(eqn)  # only part is used, but no rule could narrow it
            for w in eqn.invars:
                if _is_var(w):
                    needs[w].add(full_box(_shape(w)))
        else:
            for (i, box), pulled in plan.items():
                if box != full_box(_shape(eqn.outvars[i])):
                    stats.rule(name)
                for w, b in pulled:
                    needs[w].add(tuple(b))
        plans[id(eqn)] = (whole, plan, wanted)
    return needs, plans


def _eval(jaxpr, consts, args, out_needs, stats):
    """Forward re-trace computing only the needed boxes; values per outvar per box."""
    needs, plans = _analyse(jaxpr, out_needs, stats)
    ctx = _Ctx()
    for v, x in zip(list(jaxpr.constvars) + list(jaxpr.invars), list(consts) + list(args)):
        if _is_var(v):
            ctx.put(v, full_box(_shape(v)), x)
    for eqn in jaxpr.eqns:
        if id(eqn) not in plans:
            continue
        whole, plan, wanted = plans[id(eqn)]
        name = eqn.primitive.name
        if whole == "alias":
            ctx.put(eqn.outvars[0], full_box(_shape(eqn.outvars[0])), ctx.get(plan))
            continue
        if name in _CALLS:
            _CALL_RULES[name](ctx, eqn, needs, stats)
            continue
        if whole:
            outs = _HIGHER_ORDER.get(name, _bind_generic)(ctx, eqn, stats)
            outs = outs if eqn.primitive.multiple_results else [outs]
            for v, o in zip(eqn.outvars, outs):
                if _is_var(v):
                    ctx.put(v, full_box(_shape(v)), o)
            for i, box in wanted:  # slice right away, so the whole value can die early
                ctx.get(eqn.outvars[i], box)
            continue
        rule = RULES[name]
        for (i, box) in plan:
            ctx.put(eqn.outvars[i], box, rule.apply(ctx, eqn, i, box))
    return [[ctx.get(v, b) if _is_var(v) else v.val for b in boxes]
            for v, boxes in zip(jaxpr.outvars, out_needs)]


def _bind_generic(ctx, eqn, stats):
    return _bind(eqn, [ctx.get(v, None) for v in eqn.invars])


def _avals(vars_):
    return [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in vars_]


def rewrite(closed: jex.ClosedJaxpr, out_needs: Sequence[Sequence[Box]] | None = None,
            stats: Stats | None = None) -> jex.ClosedJaxpr:
    """Re-trace `closed` computing, for output j, the boxes `out_needs[j]` (in order).

    The result takes the original inputs and returns the needed boxes of each output
    flattened in order. With `out_needs=None` every output is needed whole.
    """
    stats = stats if stats is not None else Stats()
    jaxpr, consts = closed.jaxpr, closed.consts
    if out_needs is None:
        out_needs = [[full_box(_shape(v))] if _is_var(v) else [()] for v in jaxpr.outvars]
    out_needs = [[tuple(b) for b in boxes] for boxes in out_needs]

    def fn(*args):
        inner = _inline_jit(jaxpr, consts)
        outs = _eval(inner.jaxpr, inner.consts, args, out_needs, stats)
        return [o for per_var in outs for o in per_var]

    if jaxpr.invars:
        return jax.make_jaxpr(fn)(*_avals(jaxpr.invars))
    return jax.make_jaxpr(fn)()


def _inline_jit(jaxpr, consts) -> jex.ClosedJaxpr:
    """`jaxpr` with nested `jit` calls inlined, as a closed jaxpr over the same inputs."""
    if not any(e.primitive is P.jit_p for e in jaxpr.eqns):
        return jex.ClosedJaxpr(jaxpr, list(consts))

    def inline(e, ins, read):
        if e.primitive is P.jit_p:
            sub = e.params["jaxpr"]
            return interpret(sub.jaxpr, sub.consts, ins, inline)
        return None

    return jax.make_jaxpr(lambda *a: interpret(jaxpr, consts, a, inline))(*_avals(jaxpr.invars))


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
        outs = override(e, ins, read) if override else None
        if outs is None:
            outs = _bind(e, ins)
            outs = outs if e.primitive.multiple_results else [outs]
        for v, o in zip(e.outvars, outs):
            if _is_var(v):
                env[v] = o
        if after:
            after(i, read)
    return [read(v) for v in jaxpr.outvars]


# --------------------------------------------------------------------------- calls
#
# A call rule rewrites the body so that it returns, for each output of the call, the
# whole value if it is needed whole and then each needed box; the rewritten body is
# bound once, so a call never runs twice.


def _body_needs(eqn, needs, body_outvars, inner_box=lambda i, b: b, always_whole=()):
    """Per body output: the list of boxes the rewritten body returns."""
    result = []
    for i, (v, bv) in enumerate(zip(eqn.outvars, body_outvars)):
        boxes = needs.get(v, set()) if _is_var(v) else set()
        fb = full_box(_shape(v))
        bn = [full_box(_shape(bv))] if (i in always_whole or fb in boxes) else []
        for b in sorted(b for b in boxes if b != fb):
            ib = inner_box(i, b)
            if ib is None:  # cannot narrow inside: keep whole, slice outside
                if full_box(_shape(bv)) not in bn:
                    bn.insert(0, full_box(_shape(bv)))
            elif ib not in bn:
                bn.append(ib)
        result.append(bn)
    return result


def _unchanged(body_needs, body_outvars):
    return all(bn == [full_box(_shape(v))] for bn, v in zip(body_needs, body_outvars))


def _store(ctx, eqn, body_needs, outs, outer_box=lambda i, b: b):
    it = iter(outs)
    for i, (bn, v) in enumerate(zip(body_needs, eqn.outvars)):
        for b in bn:
            val = next(it)
            if _is_var(v):
                ctx.put(v, outer_box(i, b), val)


def _scan_rule(ctx, eqn, needs, stats):
    p = eqn.params
    nc, body = p["num_carry"], p["jaxpr"]
    ops = [ctx.get(v, None) for v in eqn.invars]

    def inner_box(i, b):
        if i < nc:  # a carry keeps its shape across iterations
            stats.fallback(eqn)
            return None
        stats.rule("scan")
        return tuple(b[1:])  # the stacked axis is sliced outside, if at all

    body_needs = _body_needs(eqn, needs, body.jaxpr.outvars, inner_box, always_whole=range(nc))
    if _unchanged(body_needs, body.jaxpr.outvars):
        outs = _bind(eqn, ops)
    else:
        new = rewrite(body, body_needs, stats)
        consts = list(new.consts)
        outs = P.scan_p.bind(*consts, *ops, **{
            **p, "jaxpr": jex.ClosedJaxpr(_consts_to_invars(new), []),
            "num_consts": p["num_consts"] + len(consts)})
    _store(ctx, eqn, body_needs, outs,
           lambda i, b: b if i < nc else ((0, _shape(eqn.outvars[i])[0]),) + tuple(b))


def _consts_to_invars(closed: jex.ClosedJaxpr):
    """The open jaxpr of `closed` with its constants turned into leading inputs."""
    j = closed.jaxpr
    return j.replace(constvars=[], invars=list(j.constvars) + list(j.invars))


def _remat_rule(ctx, eqn, needs, stats):
    p = eqn.params
    ops = [ctx.get(v, None) for v in eqn.invars]
    body_needs = _body_needs(eqn, needs, p["jaxpr"].outvars)
    if _unchanged(body_needs, p["jaxpr"].outvars):
        outs = _bind(eqn, ops)
    else:
        stats.rules["remat2"] += 1
        new = rewrite(jex.ClosedJaxpr(p["jaxpr"], []), body_needs, stats)
        # Bound directly (not through jax.checkpoint) to keep `differentiated`, which
        # stops XLA from merging the recomputation with the forward pass.
        outs = P.remat_p.bind(*new.consts, *ops, jaxpr=_consts_to_invars(new),
                              prevent_cse=p["prevent_cse"], differentiated=p["differentiated"],
                              policy=p["policy"])
    _store(ctx, eqn, body_needs, outs)


def _cond_rule(ctx, eqn, needs, stats):
    p = eqn.params
    branches = p["branches"]
    ops = [ctx.get(v, None) for v in eqn.invars]
    body_needs = _body_needs(eqn, needs, branches[0].jaxpr.outvars)
    if _unchanged(body_needs, branches[0].jaxpr.outvars):
        outs = _bind(eqn, ops)
    else:
        stats.rules["cond"] += 1
        new = [rewrite(br, body_needs, stats) for br in branches]
        # Every branch takes the consts of all branches and uses its own.
        all_consts = [c for b in new for c in b.consts]
        const_avals = [jax.core.ShapedArray(np.shape(c), c.dtype) for c in all_consts]
        fixed, offset = [], 0
        for b in new:
            j = _consts_to_invars(b)
            n = len(b.consts)
            fresh = [jex.Var(a) for a in const_avals]
            invars = fresh[:offset] + list(j.invars[:n]) + fresh[offset + n:] + list(j.invars[n:])
            fixed.append(jex.ClosedJaxpr(j.replace(invars=invars), []))
            offset += n
        outs = P.cond_p.bind(ops[0], *all_consts, *ops[1:], **{**p, "branches": tuple(fixed)})
    _store(ctx, eqn, body_needs, outs)


_CALLS = {"scan", "remat2", "cond"}
_CALL_RULES = {"scan": _scan_rule, "remat2": _remat_rule, "cond": _cond_rule}


def _while_rule(ctx, eqn, stats):
    """Rewrite the body and condition (slices inside them); the loop's outputs stay whole."""
    p = eqn.params
    ops = [ctx.get(v, None) for v in eqn.invars]
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = ops[:cn], ops[cn:cn + bn], ops[cn + bn:]
    new_body = rewrite(p["body_jaxpr"], None, stats)
    new_cond = rewrite(p["cond_jaxpr"], None, stats)
    bc, cc = list(new_body.consts), list(new_cond.consts)
    return P.while_p.bind(*cc, *cond_consts, *bc, *body_consts, *init, **{
        **p, "body_jaxpr": jex.ClosedJaxpr(_consts_to_invars(new_body), []),
        "cond_jaxpr": jex.ClosedJaxpr(_consts_to_invars(new_cond), []),
        "body_nconsts": bn + len(bc), "cond_nconsts": cn + len(cc)})


_HIGHER_ORDER = {"while": _while_rule}


def count_eqns(jaxpr) -> int:
    """Equations in a jaxpr, counting those inside sub-jaxprs."""
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for sub in jex.jaxprs_in_params(e.params):
            n += count_eqns(sub)
    return n
