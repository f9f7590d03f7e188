"""The training step as one StableHLO module with its state in named parameters.

JAX lowers two flat functions with fixed shapes:

- step(mutable..., frozen..., batch...) -> (mutable'..., loss, aux...), with the
  mutable state (step counter, trainable parameters, optimizer state) donated;
- eval(trainable..., frozen..., batch...) -> loss.

Both become private functions of one module. Frozen weights are immutable `util.global`s
bound to named parameters (`#flow.parameter.named<"model"::"params/...">`, stored in
`params.irpa`), and so is the initial value of the mutable state. The mutable state
itself travels as donated arguments, which IREE updates in place (a mutable global would
be double-buffered: a fresh resource for the new value every step). Public functions:

- `train_step(state..., batch...) -> (state'..., loss, aux...)`, the state donated;
- `eval(trainable..., batch...) -> loss`;
- `init() -> (state...)`, the initial state from the parameters;
- `frozen() -> (frozen weights...)`.

`lower_step(..., tie_weights=True)` makes each matmul's read of a trained weight wait
for the matmul's other operand (`tie_weight_reads`), so that with data tiling IREE packs
the weight when the matmul runs instead of packing every trained weight at the step's
start; `export` keeps it for the CPU targets when the compiled plan allocates less.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
from jax.extend.core import primitives as P

from pockjax import lowbit
from pockjax._src.jaxpr import avals, bind, interpret, is_var
from pockjax._src.ties import tie_zero
from pockjax.export.manifest import SCOPE
from pockjax.export.targets import ExportError
from pockjax.optim import fused
from pockjax.scheme import Frozen, leaves_with_paths
from pockjax.transforms import convolutions, dot_layout
from pockjax.transforms.legalize import legalize_for_iree
from pockjax.view import trained_indices


__all__ = ["Slot", "Lowered", "lower_step", "tie_weight_reads"]


@dataclasses.dataclass(frozen=True)
class Slot:
    """One named tensor: a state global or a batch input.

    Attributes:
      name: the tensor's name: `"step"`, `"params/<path>"`, `"opt_state/<path>"`, or a
        batch input's path (`"batch"` for a batch that is one array).
      shape: its fixed shape.
      dtype: its dtype's name (`"float32"`, `"int32"`, ...).
      role: `"frozen"`, `"trainable"`, `"optimizer"`, `"step"` or `"batch"`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # "frozen", "trainable", "optimizer", "step" or "batch"

    def mlir_type(self) -> str:
        """The tensor's MLIR type.

        Returns:
          The type as MLIR text, e.g. `tensor<16x64xf32>`.

        Raises:
          ExportError: the dtype cannot be exported.
        """
        return _tensor_type(self.shape, self.dtype)


def in_place(slot: Slot) -> bool:
    """Whether the exported `train_step` updates this state slot in its own buffer: every
    array of the state; scalars get a new buffer each step (see `lower_step`)."""
    return len(slot.shape) > 0


@dataclasses.dataclass
class Lowered:
    """The lowered training step: the module's text and the tensors it reads and returns.

    Attributes:
      mlir: the StableHLO module (`train_step`, `eval`, `init`, `frozen` and, with a
        prefix, `prefix`) as text.
      mutable: `train_step`'s donated state (step count, trainable parameters,
        optimizer state), in argument order.
      frozen: the frozen weights, in the order `frozen()` returns them.
      batch: `train_step`'s and `eval`'s batch inputs.
      outputs: `train_step`'s outputs after the state: `"loss"`, then `"aux/<path>"`.
      values: the initial value of every state tensor, by name.
      prefix_inputs: with a prefix (`lower_step(prefix=...)`), the inputs of `prefix`,
        named as in the original batch; empty otherwise.
      prefix_outputs: with a prefix, the names of its outputs (`"cut/<i>"`); empty
        otherwise.
    """

    mlir: str
    mutable: list[Slot]       # train_step's donated state, in argument order
    frozen: list[Slot]        # frozen weights, in the order of `frozen()`
    batch: list[Slot]
    outputs: list[str]        # train_step's outputs after the state: "loss", "aux/<path>"
    values: dict[str, np.ndarray]   # the initial value of every state tensor, by name
    # With a prefix (`lower_step(prefix=...)`): prefix(batch...) -> cut values, its inputs
    # named as in the original batch.
    prefix_inputs: list[Slot] = dataclasses.field(default_factory=list)
    prefix_outputs: list[str] = dataclasses.field(default_factory=list)

    @property
    def state(self) -> list[Slot]:
        """Every state tensor: the frozen weights, then the mutable state."""
        return self.frozen + self.mutable

    @property
    def donated(self) -> dict[int, str]:
        """`train_step`'s arguments updated in their own buffers: index -> state name."""
        return {i: s.name for i, s in enumerate(self.mutable) if in_place(s)}


_MLIR_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                "int32": "i32", "int64": "i64", "int16": "i16", "int8": "i8", "uint8": "ui8",
                "uint32": "ui32", "bool": "i1"}


def _tensor_type(shape, dtype) -> str:
    if dtype not in _MLIR_DTYPES:
        raise ExportError(f"dtype {dtype} cannot be exported; supported: {', '.join(_MLIR_DTYPES)}")
    dims = "".join(f"{d}x" for d in shape)
    return f"tensor<{dims}{_MLIR_DTYPES[dtype]}>"


def _dtype(x) -> str:
    return str(jnp.dtype(jnp.result_type(x)))


def _check_static(batch):
    for path, x in leaves_with_paths(batch)[0]:
        if not hasattr(x, "shape") or any(not isinstance(d, (int, np.integer)) for d in np.shape(x)):
            raise ExportError(f"batch input '{path or 'batch'}' has a dynamic or unknown shape "
                              f"({getattr(x, 'shape', type(x).__name__)}); IREE needs fixed shapes. "
                              "Export one artifact per batch shape (pad the last batch)")


def _module_body(text: str, prefix: str) -> tuple[str, str]:
    """The functions of a JAX-lowered module with its symbols renamed `prefix + name`,
    and the new name of its `main`."""
    start = text.index("\n", text.index("module @")) + 1  # after the header line
    end = text.rstrip().rindex("}")
    body = text[start:end]
    body = body.replace("func.func public @main(", "func.func private @main(", 1)
    # Rename only the symbols the module defines at its top level (functions, meshes...)
    # and their uses, so no other `@` in the text changes.
    defined = re.findall(r"^  [\w.]+ (?:(?:public|private|nested) )?@([A-Za-z_][\w$.]*)", body,
                         flags=re.MULTILINE)
    if "main" not in defined:
        raise ExportError("the lowered StableHLO module's layout was not recognised (no "
                          "top-level @main found); please report this with your JAX version")
    names = "|".join(re.escape(n) for n in sorted(set(defined), key=len, reverse=True))
    body = re.sub(rf"@({names})(?![\w$.])", lambda m: "@" + prefix + m.group(1), body)
    return body, prefix + "main"


def tie_weight_reads(closed: jex.ClosedJaxpr, weights) -> jex.ClosedJaxpr:
    """`closed` with each matmul's read of a trained weight tied to its other operand.

    Each top-level matmul's read of a trained weight (inputs `weights` of `closed`,
    also through `pockjax.optim.fused.VIEWS`, e.g. a Channels slice or a transpose) is
    tied by data to the matmul's other operand: the weight plus an exact zero (-0.0, so
    `-0.0` weights stay as they are) computed from one element of it
    (`pockjax._src.ties.tie_zero`). Matmuls inside loop, cond and remat bodies, and
    matmuls of two trained weights, are left as they are.

    With data tiling (the CPU targets) IREE packs a matmul's weight operand into its tile
    layout in a dispatch of its own. A trained weight is a step input, so IREE can
    schedule its packs at the step's start, where the forward and the transposed
    backward packs of every trained weight live together. Tied to the activation
    (forward) or the incoming gradient (backward), a pack runs when its matmul is
    reached and its buffer is freed after it; the add fuses into the pack, which reads
    the weight anyway. Frozen weights are not touched (their packs are hoisted into the
    initializer once). Where IREE does not pack, the add is a copy of its own, so
    `export` compares the two compiled plans (`pockjax.export.artifact._tied_if_smaller`).

    Args:
      closed: the traced function.
      weights: the indices of its inputs that are trained weights.

    Returns:
      The rewritten function as a new `ClosedJaxpr`, or `closed` itself when no
      input in `weights` (or a view of one) exists.
    """
    jaxpr = closed.jaxpr
    from_weight = {jaxpr.invars[k] for k in weights}
    for e in jaxpr.eqns:
        if (e.primitive.name in fused.VIEWS and is_var(e.invars[0])
                and e.invars[0] in from_weight):
            from_weight.update(e.outvars)
    if not from_weight:
        return closed

    def tied(w, other):
        if not jnp.issubdtype(w.dtype, jnp.inexact) or not np.size(other):
            return w
        return w + tie_zero([other]).astype(w.dtype)

    def override(e, ins, read):
        if e.primitive is not P.dot_general_p:
            return None
        a, b = (is_var(v) and v in from_weight for v in e.invars)
        if a == b:  # neither operand is a trained weight, or both are
            return None
        ins = [tied(ins[0], ins[1]), ins[1]] if a else [ins[0], tied(ins[1], ins[0])]
        return [bind(e, ins)]

    return jax.make_jaxpr(lambda *x: interpret(jaxpr, closed.consts, x, override))(
        *avals(jaxpr.invars))


def _legalized(fn, *avals_, backend=None, weights=()):
    """`fn` traced once at `avals_` and rewritten by `legalize_for_iree` for `backend`, as a
    function; the matmul reads of the inputs `weights` are tied to their other operands
    (`tie_weight_reads`)."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*avals_)
    fixed, _ = legalize_for_iree(closed, backend)
    if weights:
        fixed = tie_weight_reads(fixed, weights)
    out_def = jax.tree_util.tree_structure(out_shape)

    def run(*args):
        flat = jax.tree_util.tree_leaves(args)
        return jax.tree_util.tree_unflatten(out_def, jex.jaxpr_as_fun(fixed)(*flat))

    return run


def lower_step(trainer, state, batch, *, donate: bool = True,
               placement: str | None = None, ties: str = "data",
               backend: str | None = None, tie_weights: bool = False,
               prefix=None) -> Lowered:
    """Lower `trainer`'s step and eval for `state` and `batch` into one module.

    The module is legalised for IREE (`pockjax.transforms.legalize`) and its HAL device
    `backend`. A trainer with a mesh layout is lowered without it: an artifact runs on
    one device.

    `donate=False` and `placement="global", ties="barrier"` build the alternatives the
    in-place step is measured against: new buffers for the new state, and one barrier
    before all updates.

    Args:
      trainer: the `SparseTrainer` whose step and loss are lowered.
      state: its `TrainState`; it fixes the state's shapes and dtypes, and its values
        become `Lowered.values`.
      batch: an example batch with fixed shapes.
      donate: donate the mutable state to `train_step` so IREE updates it in place;
        False gives the new state new buffers.
      placement: passed to `trainer.step`: `"global"` forces one barrier before all
        updates; None: the update the trainer chooses.
      ties: how each in-place write is ordered after the parameter's last reads,
        `"data"` (default) or `"barrier"`; see `pockjax.optim.fused.fused_step`.
      backend: a `Target`'s `backend` (`"local"`, `"vulkan"`, `"cuda"`); None: the
        rewrites every backend gets.
      tie_weights: tie each matmul's read of a trained weight to its other operand
        (`tie_weight_reads`).
      prefix: the step is a prefix cache's suffix (`pockjax.prefix`), whose batch is
        `{"batch": batch, "cut": values}`, and `prefix(params, batch) -> values` becomes
        the module's `prefix` function, reading the frozen weights and the original
        batch. None: no prefix function.

    Returns:
      The `Lowered` module with its state, batch and output names.

    Raises:
      ExportError: a batch input with a dynamic or unknown shape, a dtype that cannot be
        exported, a `prefix` whose batch is not `{"batch": ..., "cut": [...]}`, or a
        lowered module whose layout is not recognised.
    """
    # Weight gradients as JAX writes them: IREE's Vulkan code generation computes the
    # swapped form wrong (pockjax.transforms.dot_layout). Convolutions stay convolutions:
    # IREE 3.13's CPU code generation fails on depth-wise ones' shifted slices
    # (pockjax.transforms.convolutions).
    with dot_layout.transposed_dots_kept(), convolutions.convolutions_kept():
        return _lower_step(trainer, state, batch, donate=donate, placement=placement,
                           ties=ties, backend=backend, tie_weights=tie_weights, prefix=prefix)


def _lower_step(trainer, state, batch, *, donate, placement, ties, backend, tie_weights,
                prefix) -> Lowered:
    _check_static(batch)
    if trainer.layout is not None:
        # An artifact runs on one device: the same step without the mesh layout.
        trainer = trainer.replace(layout=None)
    decisions = trainer.decisions(state.params)
    named_params, params_def = leaves_with_paths(state.params)
    named_opt, opt_def = leaves_with_paths(state.opt_state)
    named_batch, batch_def = leaves_with_paths(batch)
    frozen_idx = [i for i, d in enumerate(decisions) if isinstance(d, Frozen)]
    train_idx = trained_indices(decisions)

    mutable: list[tuple[Slot, Any]] = [(Slot("step", (), "int32", "step"), state.step)]
    mutable += [(Slot(f"params/{named_params[i][0]}", tuple(np.shape(named_params[i][1])),
                      _dtype(named_params[i][1]), "trainable"), named_params[i][1]) for i in train_idx]
    mutable += [(Slot(f"opt_state/{p}", tuple(np.shape(x)), _dtype(x), "optimizer"), x)
                for p, x in named_opt]
    frozen = [(Slot(f"params/{named_params[i][0]}", tuple(np.shape(named_params[i][1])),
                    _dtype(named_params[i][1]), "frozen"), named_params[i][1]) for i in frozen_idx]
    batch_slots = [Slot(p or "batch", tuple(np.shape(x)), _dtype(x), "batch") for p, x in named_batch]
    n_train = len(train_idx)

    def params_from(train_leaves, frozen_leaves):
        leaves = [None] * len(decisions)
        for i, x in zip(train_idx, train_leaves):
            leaves[i] = x
        for i, x in zip(frozen_idx, frozen_leaves):
            leaves[i] = x
        return jax.tree_util.tree_unflatten(params_def, leaves)

    aux_paths: list[str] = []

    def flat_step(mut, frz, batch_leaves):
        step, train, opt = mut[0], mut[1:1 + n_train], mut[1 + n_train:]
        st = state.replace(step=step, params=params_from(train, frz),
                           opt_state=jax.tree_util.tree_unflatten(opt_def, opt))
        new, metrics = trainer.step_variant(st, jax.tree_util.tree_unflatten(batch_def, batch_leaves),
                                            placement=placement, ties=ties)
        new_params = jax.tree_util.tree_leaves(new.params)
        aux = leaves_with_paths(metrics.get("aux"))[0] if "aux" in metrics else []
        aux_paths[:] = [f"aux/{p}" if p else "aux" for p, _ in aux]
        return ([new.step, *[new_params[i] for i in train_idx],
                 *jax.tree_util.tree_leaves(new.opt_state)], metrics["loss"], [x for _, x in aux])

    def flat_eval(train, frz, batch_leaves):
        # On quantized frozen weights (pockjax.lowbit) as the step reads them.
        out = lowbit.at_use(trainer.loss_fn)(params_from(train, frz),
                              jax.tree_util.tree_unflatten(batch_def, batch_leaves))
        return out[0] if trainer.has_aux else out

    aval = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
    mut_avals = [aval(x) for _, x in mutable]
    frz_avals = [aval(x) for _, x in frozen]
    batch_avals = [aval(x) for _, x in named_batch]
    # Inputs are flattened as (mutable..., frozen..., batch...); the trained weights are
    # the step's mutable inputs 1..n_train and eval's first n_train.
    step_fn = _legalized(flat_step, mut_avals, frz_avals, batch_avals, backend=backend,
                         weights=range(1, 1 + n_train) if tie_weights else ())
    eval_fn = _legalized(flat_eval, mut_avals[1:1 + n_train], frz_avals, batch_avals,
                         backend=backend, weights=range(n_train) if tie_weights else ())
    # keep_unused: the module's signatures list every input, used or not (batch-norm
    # running statistics, for one, do not enter a training-mode loss).
    step_text = jax.jit(step_fn, donate_argnums=0 if donate else (), keep_unused=True).lower(
        mut_avals, frz_avals, batch_avals).as_text(debug_info=False)
    eval_text = jax.jit(eval_fn, keep_unused=True).lower(
        mut_avals[1:1 + n_train], frz_avals, batch_avals).as_text(debug_info=False)
    step_body, step_main = _module_body(step_text, "step_")
    eval_body, eval_main = _module_body(eval_text, "eval_")
    pre_slots, pre_outputs, pre_body, pre_main = [], [], "", None
    if prefix is not None:
        if not (isinstance(batch, dict) and set(batch) == {"batch", "cut"}):
            raise ExportError("a prefix cache's suffix takes {'batch': ..., 'cut': [...]} as "
                              "its batch")
        pre_named, pre_def = leaves_with_paths(batch["batch"])
        pre_slots = [Slot(p or "batch", tuple(np.shape(x)), _dtype(x), "batch")
                     for p, x in pre_named]
        pre_avals = [aval(x) for _, x in pre_named]
        pre_outputs = [f"cut/{i}" for i in range(len(batch["cut"]))]

        def flat_prefix(frz, pre_leaves):
            train = [jnp.zeros(a.shape, a.dtype) for a in mut_avals[1:1 + n_train]]
            return list(prefix(params_from(train, frz),
                               jax.tree_util.tree_unflatten(pre_def, pre_leaves)))

        pre_fn = _legalized(flat_prefix, frz_avals, pre_avals, backend=backend)
        pre_text = jax.jit(pre_fn, keep_unused=True).lower(frz_avals, pre_avals).as_text(
            debug_info=False)
        pre_body, pre_main = _module_body(pre_text, "prefix_")
        pre_types = [_tensor_type(a.shape, str(a.dtype)) for a in
                     jax.eval_shape(flat_prefix, frz_avals, pre_avals)]

    mut_slots = [s for s, _ in mutable]
    frz_slots = [s for s, _ in frozen]
    train_slots = mut_slots[1:1 + n_train]
    _, loss_aval, aux_avals = jax.eval_shape(flat_step, mut_avals, frz_avals, batch_avals)
    out_types = [_tensor_type(a.shape, str(a.dtype)) for a in [loss_aval, *aux_avals]]
    types = lambda slots: [s.mlir_type() for s in slots]
    args = lambda prefix, slots: [f"%{prefix}{i}" for i in range(len(slots))]

    # Frozen weights and the initial mutable state are immutable named parameters.
    lines = ["module @pockjax_train {"]
    gname = {}
    for i, s in enumerate(frz_slots):
        gname[s.name] = f"f{i}"
    for i, s in enumerate(mut_slots):
        gname[s.name] = f"i{i}"
    for s in frz_slots + mut_slots:
        lines.append(f'  util.global private @{gname[s.name]} = '
                     f'#flow.parameter.named<"{SCOPE}"::"{s.name}"> : {s.mlir_type()}')

    def loads(slots, prefix):
        return [f"    %{prefix}{i} = util.global.load @{gname[s.name]} : {s.mlir_type()}"
                for i, s in enumerate(slots)]

    # A scalar of the state (the step count, an optimizer's count) gets a new buffer each
    # step instead of its own: the per-parameter updates read an optimizer's old count,
    # and IREE can fuse that read into an update kernel it schedules after the count's
    # in-place write (seen with a schedule); a data tie from those kernels would keep
    # their whole outputs alive. Four bytes per step do not matter.
    def signature(slots, prefix, attrs=False):
        return [f"%{prefix}{i}: {s.mlir_type()}"
                + (f" {{tf.aliasing_output = {i} : i32}}" if attrs and in_place(s) else "")
                for i, s in enumerate(slots)]

    def call(name, callee, params, ins, in_slots, results):
        lines.append(f"  func.func public @{name}({', '.join(params)}) -> ({', '.join(results)}) {{")
        lines.extend(loads(frz_slots, "f"))
        lines.append(f"    %r:{len(results)} = func.call @{callee}({', '.join(ins)}) : "
                     f"({', '.join(types(in_slots))}) -> ({', '.join(results)})")
        lines.append(f"    return {', '.join(f'%r#{i}' for i in range(len(results)))} : "
                     f"{', '.join(results)}")
        lines.append("  }")

    # train_step(state..., batch...) -> (state'..., loss, aux...), the state donated:
    # IREE updates it in place.
    call("train_step", step_main,
         signature(mut_slots, "s", attrs=donate) + signature(batch_slots, "b"),
         args("s", mut_slots) + args("f", frz_slots) + args("b", batch_slots),
         mut_slots + frz_slots + batch_slots, types(mut_slots) + out_types)
    # eval(trainable..., batch...) -> loss
    call("eval", eval_main, signature(train_slots, "s") + signature(batch_slots, "b"),
         args("s", train_slots) + args("f", frz_slots) + args("b", batch_slots),
         train_slots + frz_slots + batch_slots, out_types[:1])
    if pre_main is not None:  # prefix(batch...) -> cut values
        call("prefix", pre_main, signature(pre_slots, "b"),
             args("f", frz_slots) + args("b", pre_slots), frz_slots + pre_slots, pre_types)
    # init() -> the initial mutable state; frozen() -> the frozen weights.
    for name, slots, prefix in (("init", mut_slots, "i"), ("frozen", frz_slots, "f")):
        lines.append(f"  func.func public @{name}() -> ({', '.join(types(slots))}) {{")
        lines.extend(loads(slots, prefix))
        lines.append(f"    return {', '.join(args(prefix, slots))} : {', '.join(types(slots))}"
                     if slots else "    return")
        lines.append("  }")
    lines.append(step_body)
    lines.append(eval_body)
    if pre_body:
        lines.append(pre_body)
    lines.append("}")

    values = {s.name: np.asarray(jax.device_get(x)) for s, x in frozen + mutable}
    return Lowered("\n".join(lines) + "\n", mut_slots, frz_slots, batch_slots,
                   ["loss", *aux_paths], values, pre_slots, pre_outputs)
