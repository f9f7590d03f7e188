"""FLOPs of a program, counted on its jaxpr with loops times their trip count.

XLA's `compiled.cost_analysis()` counts the body of a while loop once, whatever its
trip count; a `lax.scan` lowers to one, so a scanned model's FLOPs come out divided
by its number of layers, and a scan that pockjax splits at the trained boundary
(`transforms/scan_split.py`) counts one body per piece: more than the dense scan.
This module counts the jaxpr that is lowered instead:

- `scan` bodies times `length`; a `while` shaped like `fori_loop` (a counter compared
  with `lt` against a bound, stepped by a literal) times its trip count where the
  start and bound are constants, else once, and `FlopCount.unknown_trip_loops` says so;
- `cond` the costliest branch (as XLA does); calls (`jit`, `closed_call`, `remat`,
  `custom_jvp_call`, `custom_vjp_call`) their callee; `shard_map` its body times the
  number of shards, so a count is always of the whole program, never per device;
- per primitive, XLA's conventions, so that loop-free programs agree with
  `cost_analysis()`: `dot_general` 2 x output elements x contracted size; a
  convolution 2 x multiply-adds that read real input (padding and the holes of input
  dilation excluded); elementwise arithmetic, comparisons, selects and dtype
  conversions 1 per output element; transcendental functions (exp, log, tanh, sqrt,
  pow, erf, ...) are counted apart in `transcendentals`, not in `flops`; reductions
  1 per input element not in the output; windowed reductions window size - 1 per
  output element; scatter-add 1 per update; data movement (reshape, slice, gather,
  transpose, pad, concatenate, ...) 0.

A primitive with no rule counts 0 and is named in `FlopCount.unknown_primitives`.
The count runs on the jaxpr after dead-code elimination, like the compiled program;
XLA's own simplifications (common subexpressions, algebraic rewrites, fused
converts) are not repeated, so on matmul- and convolution-dominated programs the
two agree within a few percent, and exactly on loops once XLA's body is multiplied
out.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> count_flops(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((2, 3)), jnp.ones((3, 4))))
  48.0
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Callable, Mapping

import jax
import jax.extend.core as jex
import numpy as np
from jax.extend.core import primitives as P
from jax.interpreters import partial_eval as pe

from pockjax._src.jaxpr import consts_to_invars
from pockjax.transforms.sparse_grad import GradProgram

__all__ = ["FlopCount", "analyze_flops", "count_flops"]


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """What `analyze_flops` counted: `flops` (as XLA's "flops"), `transcendentals`,
    `flops` by primitive name, primitives with no rule (counted 0), and how many
    while loops had no known trip count (their body counted once).

    Two counts add with `+` (fields summed, sets joined).

    Attributes:
      flops: floating-point operations, as XLA's cost analysis reports "flops".
      transcendentals: transcendental operations (exp, log, tanh, ...), not in `flops`.
      by_primitive: primitive name -> its share of `flops`.
      unknown_primitives: names of the primitives with no rule (counted 0).
      unknown_trip_loops: how many while loops had no known trip count.
    """

    flops: float = 0.0
    transcendentals: float = 0.0
    by_primitive: Mapping[str, float] = dataclasses.field(default_factory=dict)
    unknown_primitives: frozenset = frozenset()
    unknown_trip_loops: int = 0

    def __add__(self, other: "FlopCount") -> "FlopCount":
        by = dict(self.by_primitive)
        for k, v in other.by_primitive.items():
            by[k] = by.get(k, 0.0) + v
        return FlopCount(self.flops + other.flops, self.transcendentals + other.transcendentals,
                         by, self.unknown_primitives | other.unknown_primitives,
                         self.unknown_trip_loops + other.unknown_trip_loops)

    def times(self, n: float) -> "FlopCount":
        """The cost of running this `n` times (what the flags say is not multiplied).

        Args:
          n: how many times.

        Returns:
          A `FlopCount` with `flops`, `transcendentals` and `by_primitive` times `n`;
            `unknown_primitives` and `unknown_trip_loops` as they are.
        """
        return dataclasses.replace(self, flops=self.flops * n, transcendentals=self.transcendentals * n,
                                   by_primitive={k: v * n for k, v in self.by_primitive.items()})


def count_flops(program, *args, **kwargs) -> float:
    """FLOPs of a program, or of one call of a function, loops counted times their trip
    count.

    Args:
      program: what to count: a `Jaxpr`, a `ClosedJaxpr`, a `jax.stages.Traced` from
        `jax.jit(f).trace(...)`, the `GradProgram` of `sparse_grad(f, scheme).trace(...)`
        (which computes the value and the gradients); or a function (jitted or not, e.g.
        a `pockjax.sparse_grad` function), counted on the jaxpr `jax.jit` lowers for
        `program(*args, **kwargs)`.
      *args: with a function: its positional arguments (arrays or
        `jax.ShapeDtypeStruct`s).
      **kwargs: with a function: its keyword arguments.

    Returns:
      The FLOPs, a float (`analyze_flops(program, *args, **kwargs).flops`).

    Raises:
      TypeError: `program` is none of these, or arguments come with a program that is
        not a function.
    """
    return analyze_flops(program, *args, **kwargs).flops


def flops_of(fn: Callable, *args, **kwargs) -> float:
    """Deprecated: `count_flops(fn, *args, **kwargs)` counts a function's call."""
    warnings.warn("pockjax.flops_of is deprecated: count_flops(fn, *args) counts a function's "
                  "call", DeprecationWarning, stacklevel=2)
    return count_flops(fn, *args, **kwargs)


_PROGRAMS = (jax.stages.Traced, GradProgram, jex.ClosedJaxpr, jex.Jaxpr)


def _trace(fn: Callable, *args, **kwargs):
    # Only a jitted function's `trace` is a `jax.stages` trace; other callables have
    # their own (`sparse_grad`'s returns its `GradProgram`).
    return (fn if isinstance(fn, jax.stages.Wrapped) else jax.jit(fn)).trace(*args, **kwargs)


def analyze_flops(program, *args, **kwargs) -> FlopCount:
    """`count_flops` with the details: transcendentals, FLOPs by primitive, and what
    could not be counted exactly.

    Dead code is dropped first, as the compiler drops it.

    Args:
      program: a `Jaxpr`, a `ClosedJaxpr`, a `jax.stages.Traced` (`jax.jit(f).trace(...)`),
        a `GradProgram` (`sparse_grad(f, scheme).trace(...)`), or a function called with
        `*args` and `**kwargs` (as `count_flops`).
      *args: with a function: its positional arguments.
      **kwargs: with a function: its keyword arguments.

    Returns:
      The `FlopCount` of one run of the program.

    Raises:
      TypeError: `program` is none of these, or arguments come with a program that is
        not a function.
    """
    if not isinstance(program, _PROGRAMS) and callable(program):
        program = _trace(program, *args, **kwargs)
    elif args or kwargs:
        raise TypeError(f"count_flops takes arguments only with a function to call; got a "
                        f"{type(program).__name__} and {len(args) + len(kwargs)} argument(s)")
    if isinstance(program, jax.stages.Traced):
        program = program.jaxpr
    elif isinstance(program, GradProgram):  # `sparse_grad(f, scheme).trace(*args)`
        program = program.info.jaxpr
    if isinstance(program, jex.ClosedJaxpr):
        jaxpr, consts = program.jaxpr, list(program.consts)
    elif isinstance(program, jex.Jaxpr):
        jaxpr, consts = program, [None] * len(program.constvars)
    else:
        raise TypeError(f"analyze_flops takes a Jaxpr, a ClosedJaxpr, a jax.stages.Traced "
                        f"(jax.jit(f).trace(*args)) or a sparse_grad GradProgram "
                        f"(sparse_grad(f, scheme).trace(*args)) or a function, got {type(program).__name__}")
    # Dead code is not compiled: drop it first (recursing into calls and loops).
    n_consts = len(jaxpr.constvars)
    whole = consts_to_invars(jaxpr)
    dced, used = pe.dce_jaxpr(whole, [True] * len(whole.outvars))
    used_consts = [c for c, u in zip(consts, used[:n_consts]) if u]
    known = {v: c for v, c in zip(dced.invars, used_consts) if c is not None}
    return _count(dced, known)


# -- the walk ------------------------------------------------------------------

Rule = Callable[[jex.JaxprEqn], tuple]          # first order: eqn -> (flops, transcendentals)
HigherRule = Callable[[jex.JaxprEqn, list], FlopCount]  # eqn, known input values -> count

FLOP_RULES: dict[jex.Primitive, Rule] = {}
FLOP_HIGHER_ORDER: dict[jex.Primitive, HigherRule] = {}
# Primitives that are not exported by `jax.extend` are matched by name.
FLOP_RULES_BY_NAME: dict[str, Rule] = {}
FLOP_HIGHER_ORDER_BY_NAME: dict[str, HigherRule] = {}


def _count(jaxpr: jex.Jaxpr, known: dict | None = None) -> FlopCount:
    """The cost of one run of `jaxpr`; `known` maps some of its variables to
    concrete values (used for loop bounds only)."""
    known = dict(known or {})
    total = FlopCount()
    by: dict[str, float] = {}
    flops = trans = 0.0
    unknown: set[str] = set()

    def value(v):
        return v.val if isinstance(v, jex.Literal) else known.get(v)

    for eqn in jaxpr.eqns:
        prim, name = eqn.primitive, eqn.primitive.name
        higher = FLOP_HIGHER_ORDER.get(prim) or FLOP_HIGHER_ORDER_BY_NAME.get(name)
        if higher is not None:
            total = total + higher(eqn, [value(v) for v in eqn.invars])
            continue
        rule = FLOP_RULES.get(prim) or FLOP_RULES_BY_NAME.get(name)
        if rule is None:
            subs = list(jex.jaxprs_in_params(eqn.params))
            unknown.add(name)
            for sub in subs:  # an unknown higher-order primitive: its callees, once
                total = total + _count(sub)
            continue
        f, t = rule(eqn)
        if f:
            by[name] = by.get(name, 0.0) + f
        flops, trans = flops + f, trans + t
        _fold(eqn, value, known)
    return total + FlopCount(flops, trans, by, frozenset(unknown))


# Integer scalar arithmetic is folded so that a loop bound computed from constants
# (`fori_loop(0, jnp.int32(n))` converts its bounds) is still known.
_FOLD = {P.add_p: np.add, P.sub_p: np.subtract, P.mul_p: np.multiply, P.max_p: np.maximum,
         P.min_p: np.minimum, P.neg_p: np.negative, P.convert_element_type_p: lambda x: x}


def _fold(eqn, value, known):
    fn = _FOLD.get(eqn.primitive)
    if fn is None or len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape != ():
        return
    args = [value(v) for v in eqn.invars]
    if all(a is not None and np.ndim(a) == 0 for a in args):
        known[eqn.outvars[0]] = fn(*[np.asarray(a) for a in args])


def _size(v) -> int:
    return int(math.prod(getattr(v.aval, "shape", ())))


# -- first-order rules -----------------------------------------------------------

def _free(eqn):
    return 0.0, 0.0


for _p in (P.reshape_p, P.broadcast_in_dim_p, P.transpose_p, P.squeeze_p, P.slice_p,
           P.dynamic_slice_p, P.dynamic_update_slice_p, P.gather_p, P.scatter_p, P.concatenate_p,
           P.pad_p, P.rev_p, P.iota_p, P.copy_p, P.device_put_p, P.sharding_constraint_p,
           P.bitcast_convert_type_p, P.stop_gradient_p, P.create_token_p, P.after_all_p,
           P.axis_index_p, P.psum_p, P.pmax_p, P.pmin_p, P.all_gather_p, P.all_to_all_p,
           P.ppermute_p, P.name_p, P.empty2_p, P.real_p, P.imag_p, P.complex_p):
    FLOP_RULES[_p] = _free
for _n in ("optimization_barrier", "split", "mesh_cast", "reshard", "pvary", "pbroadcast",
           "platform_index", "random_wrap", "random_unwrap"):
    FLOP_RULES_BY_NAME[_n] = _free
# Collectives move data; their reductions are not counted (their cost is the bytes).


def _elementwise(eqn):
    return float(_size(eqn.outvars[0])), 0.0


for _p in (P.add_p, P.add_jaxvals_p, P.sub_p, P.mul_p, P.div_p, P.rem_p, P.max_p, P.min_p,
           P.neg_p, P.abs_p, P.sign_p, P.floor_p, P.ceil_p, P.round_p, P.is_finite_p, P.nextafter_p,
           P.eq_p, P.ne_p, P.lt_p, P.le_p, P.gt_p, P.ge_p, P.and_p, P.or_p, P.not_p, P.xor_p,
           P.select_n_p, P.clamp_p, P.square_p, P.conj_p, P.shift_left_p, P.shift_right_logical_p,
           P.shift_right_arithmetic_p, P.population_count_p, P.clz_p, P.reduce_precision_p):
    FLOP_RULES[_p] = _elementwise


def _convert(eqn):
    # A conversion to the same dtype (a weak-type change) is no operation in HLO.
    same = eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype
    return (0.0 if same else float(_size(eqn.outvars[0]))), 0.0


FLOP_RULES[P.convert_element_type_p] = _convert


def _transcendental(eqn):
    return 0.0, float(_size(eqn.outvars[0]))


for _p in (P.exp_p, P.exp2_p, P.log_p, P.log1p_p, P.expm1_p, P.tanh_p, P.sin_p, P.cos_p, P.tan_p,
           P.asin_p, P.acos_p, P.atan_p, P.sinh_p, P.cosh_p, P.asinh_p, P.acosh_p, P.atanh_p,
           P.atan2_p, P.sqrt_p, P.rsqrt_p, P.cbrt_p, P.pow_p, P.erf_p, P.erfc_p, P.erf_inv_p,
           P.lgamma_p, P.digamma_p):
    FLOP_RULES[_p] = _transcendental


def _logistic(eqn):
    n = float(_size(eqn.outvars[0]))
    return 3 * n, n  # 1 / (1 + exp(-x))


FLOP_RULES[P.logistic_p] = _logistic


def _integer_pow(eqn):
    y = eqn.params["y"]
    k = abs(int(y))
    muls = max(k.bit_length() - 1 + bin(k).count("1") - 1, 0)  # by repeated squaring
    return float(_size(eqn.outvars[0])) * (muls + (y < 0)), 0.0


FLOP_RULES[P.integer_pow_p] = _integer_pow


def _reduction(eqn):
    return float(_size(eqn.invars[0]) - _size(eqn.outvars[0])), 0.0


for _p in (P.reduce_sum_p, P.reduce_max_p, P.reduce_min_p, P.reduce_prod_p, P.reduce_and_p,
           P.reduce_or_p, P.reduce_xor_p, P.argmax_p, P.argmin_p):
    FLOP_RULES[_p] = _reduction


def _reduce(eqn):
    """A generic `reduce` (several operands reduced together): its computation's cost
    per input element not in the output."""
    per = _closed_count(eqn.params["jaxpr"])
    n = _size(eqn.invars[0]) - _size(eqn.outvars[0])
    return per.flops * n, per.transcendentals * n


FLOP_RULES[P.reduce_p] = _reduce


def _cumulative(eqn):
    return float(_size(eqn.outvars[0])), 0.0


for _p in (P.cumsum_p, P.cumprod_p, P.cummax_p, P.cummin_p, P.cumlogsumexp_p):
    FLOP_RULES[_p] = _cumulative


def _reduce_window(eqn):
    window = math.prod(eqn.params["window_dimensions"])
    return float(_size(eqn.outvars[0])) * (window - 1), 0.0


for _p in (P.reduce_window_sum_p, P.reduce_window_max_p, P.reduce_window_min_p, P.reduce_window_p,
           P.select_and_gather_add_p):
    FLOP_RULES[_p] = _reduce_window


def _select_and_scatter(eqn):
    # Per source element: select over its window, then one add into the output.
    window = math.prod(eqn.params["window_dimensions"])
    return float(_size(eqn.invars[0])) * window, 0.0


for _p in (P.select_and_scatter_add_p, P.select_and_scatter_p):
    FLOP_RULES[_p] = _select_and_scatter


def _scatter_combine(eqn):
    return float(_size(eqn.invars[2])), 0.0  # operand, indices, updates


for _p in (P.scatter_add_p, P.scatter_mul_p, P.scatter_min_p, P.scatter_max_p):
    FLOP_RULES[_p] = _scatter_combine


def _sort(eqn):
    n = eqn.invars[0].aval.shape[eqn.params["dimension"]] if eqn.invars[0].aval.shape else 1
    return float(_size(eqn.invars[0])) * max(math.ceil(math.log2(max(n, 1))), 1), 0.0


FLOP_RULES[P.sort_p] = _sort


def _dot_general(eqn):
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    k = math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
    return 2.0 * _size(eqn.outvars[0]) * k, 0.0


FLOP_RULES[P.dot_general_p] = _dot_general


def _conv(eqn):
    """2 x the multiply-adds that read real input, as XLA's cost analysis counts them:
    per spatial dimension, the (output position, kernel tap) pairs that land on an
    input element rather than on padding or a hole of the input dilation."""
    p = eqn.params
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    dn = p["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    n = len(lhs_spec) - 2
    strides = p["window_strides"] or (1,) * n
    lhs_dil = p["lhs_dilation"] or (1,) * n
    rhs_dil = p["rhs_dilation"] or (1,) * n
    valid = 1
    for i in range(n):
        size_in, taps, size_out = lhs[lhs_spec[2 + i]], rhs[rhs_spec[2 + i]], out[out_spec[2 + i]]
        pos = (np.arange(size_out)[:, None] * strides[i] - p["padding"][i][0]
               + np.arange(taps)[None, :] * rhs_dil[i])
        hit = (pos >= 0) & (pos % lhs_dil[i] == 0) & (pos // lhs_dil[i] < size_in)
        valid *= int(hit.sum())
    in_features = lhs[lhs_spec[1]] // p["feature_group_count"]
    batch = lhs[lhs_spec[0]] // p["batch_group_count"]
    return 2.0 * valid * in_features * rhs[rhs_spec[0]] * batch, 0.0


FLOP_RULES[P.conv_general_dilated_p] = _conv


# -- higher-order rules ------------------------------------------------------------

def _call(param: str) -> HigherRule:
    """A call runs its callee once; constants known outside stay known inside."""
    def rule(eqn, known_in):
        sub = eqn.params[param]
        jaxpr = sub.jaxpr if isinstance(sub, jex.ClosedJaxpr) else sub
        known = {v: k for v, k in zip(jaxpr.invars, known_in) if k is not None}
        if isinstance(sub, jex.ClosedJaxpr):
            known.update(zip(jaxpr.constvars, sub.consts))
        return _count(jaxpr, known)
    return rule


for _p, _param in ((P.jit_p, "jaxpr"), (P.closed_call_p, "call_jaxpr"), (P.call_p, "call_jaxpr"),
                   (P.remat_p, "jaxpr"), (P.custom_jvp_call_p, "call_jaxpr"),
                   (P.custom_vjp_call_p, "call_jaxpr")):
    FLOP_HIGHER_ORDER[_p] = _call(_param)
FLOP_HIGHER_ORDER_BY_NAME["core_call"] = _call("call_jaxpr")


def _closed_count(closed) -> FlopCount:
    jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
    consts = closed.consts if isinstance(closed, jex.ClosedJaxpr) else ()
    return _count(jaxpr, dict(zip(jaxpr.constvars, consts)))


def _scan(eqn, known_in):
    return _closed_count(eqn.params["jaxpr"]).times(eqn.params["length"])


FLOP_HIGHER_ORDER[P.scan_p] = _scan


def _cond(eqn, known_in):
    """The costliest branch, as XLA counts a conditional."""
    return max((_closed_count(b) for b in eqn.params["branches"]), key=lambda c: c.flops)


FLOP_HIGHER_ORDER[P.cond_p] = _cond


def _while(eqn, known_in):
    p = eqn.params
    body, cond = _closed_count(p["body_jaxpr"]), _closed_count(p["cond_jaxpr"])
    trips = _trip_count(eqn, known_in)
    if trips is None:
        return body + cond + FlopCount(unknown_trip_loops=1)
    return body.times(trips) + cond.times(trips + 1)


FLOP_HIGHER_ORDER[P.while_p] = _while


def _trip_count(eqn, known_in) -> int | None:
    """Trips of a `fori_loop`-shaped while: the condition is `counter < bound`, the
    body adds a positive literal to the counter, and start and bound are known."""
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    if len(cond.eqns) != 1 or cond.eqns[0].primitive is not P.lt_p \
            or cond.eqns[0].outvars[0] is not cond.outvars[0]:
        return None
    cond_in = list(cond.invars)
    carry_known = known_in[cn + bn:]
    lhs, rhs = cond.eqns[0].invars

    def known_at(v):
        """The value of a variable of the condition before the first trip, and its
        carry index (None for a constant of the condition)."""
        if isinstance(v, jex.Literal):
            return v.val, None
        if v in cond.constvars:
            return p["cond_jaxpr"].consts[cond.constvars.index(v)], None
        i = cond_in.index(v)
        return (known_in[i], None) if i < cn else (carry_known[i - cn], i - cn)

    start, counter = known_at(lhs)
    bound, bound_carry = known_at(rhs)
    if counter is None or start is None or bound is None:
        return None
    producers = {o: e for e in body.eqns for o in e.outvars}
    out = body.outvars[counter]
    step_eqn = None if isinstance(out, jex.Literal) else producers.get(out)
    counter_in = body.invars[bn + counter]
    if step_eqn is None or step_eqn.primitive is not P.add_p:
        return None
    a, b = step_eqn.invars
    step = b if a is counter_in else a if b is counter_in else None
    if not isinstance(step, jex.Literal) or not np.ndim(step.val) == 0 or step.val <= 0:
        return None
    if bound_carry is not None and body.outvars[bound_carry] is not body.invars[bn + bound_carry]:
        return None  # the bound changes inside the loop
    return max(0, -(-(int(bound) - int(start)) // int(step.val)))


def _shard_map(eqn, known_in):
    """The body runs once per shard, on per-shard shapes: times the number of shards."""
    p = eqn.params
    mesh, axes = p["mesh"], p.get("newly_manual_axes", p.get("manual_axes"))
    shards = mesh.size if axes is None else math.prod(mesh.shape[a] for a in axes)
    return _closed_count(eqn.params["jaxpr"]).times(shards)


FLOP_HIGHER_ORDER_BY_NAME["shard_map"] = _shard_map
