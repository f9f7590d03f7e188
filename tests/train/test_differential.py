"""Differential tests: every training path against one independent reference.

The reference is deliberately plain: dense `jax.grad` of the loss, the kept slice of
each trained leaf cut with numpy indexing (its range derived here from the scheme's
own words, not from pockjax), the same optax chain on those slices, and the new
slices written back by numpy indexing. Nothing of pockjax's gradient transform,
trainable view or update placement is used.

Hypothesis generates the models (MLP, conv, attention with an embedding and tied
output, a scanned stack; ReLU, ReLU6 and smooth activations; biases; a weight read
twice), the schemes (Full, Frozen, Channels on named and integer axes, first or last
range, by ratio or count), the optimizers (sgd, momentum, adam, adamw, a schedule,
clip_by_global_norm) and the data, which is never only random normals: exact-zero
rows and columns (a reader whose first element is 0), dead ReLU units, zero padding
under a mask. Each case checks three steps: losses, parameters and optimizer state;
frozen leaves and untrained channels must stay bit-identical.

Paths: `sparse_train` (all models), `pj.nnx.Trainer` (an NNX MLP, with and without
batch norm), a mesh trainer on 4 host devices (data-parallel and FSDP) and the
host-cpu IREE artifact (a smaller sample: each case compiles a module).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pockjax as pj

STEPS = 3
_SETTINGS = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --------------------------------------------------------------------------- models
# Each model: params (a nested dict of float32 numpy arrays), loss(params, batch), and
# batch(rng, data) -> dict of numpy arrays, where `data` names the adversarial traits.

ACTIVATIONS = {
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "tanh": jnp.tanh,
    "gelu": jax.nn.gelu,
}


def _normal(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _zero_some(rng, x, data):
    """Exact zeros where a reader's first element sits: the first example, the first
    feature (column) or channel, and trailing padding rows."""
    x = np.array(x)
    if "zero_first_row" in data:
        x[0] = 0
    if "zero_first_col" in data:
        x[..., 0] = 0
    if "padding" in data:
        x[-2:] = 0
    return x


def _mask(b, data):
    m = np.ones((b,), np.float32)
    if "padding" in data:
        m[-2:] = 0
    return m


def mlp(rng, act="relu", depth=2, bias=True, tied=False, data=()):
    d = [6, 8, 8, 5][:depth + 1] if depth < 3 else [6, 8, 8, 8, 5]
    params = {}
    for i in range(depth):
        params[f"l{i}"] = {"w": _normal(rng, (d[i], d[i + 1]), 0.6)}
        if bias:
            b = _normal(rng, (d[i + 1],), 0.1)
            if "dead_units" in data:
                b[0] = -50.0  # the first unit of every layer never fires under ReLU
            params[f"l{i}"]["b"] = b
    if tied:  # the first kernel read twice: an autoencoder-style decoder on its transpose
        params["dec_b"] = np.zeros((d[0],), np.float32)
    f = ACTIVATIONS[act]

    def loss(p, batch):
        h = batch["x"]
        for i in range(depth):
            h = h @ p[f"l{i}"]["w"] + (p[f"l{i}"]["b"] if bias else 0.0)
            h = f(h)
        err = jnp.sum((h - batch["y"]) ** 2, axis=-1)
        if tied:
            z = f(batch["x"] @ p["l0"]["w"]) @ p["l0"]["w"].T + p["dec_b"]
            err = err + jnp.sum((z - batch["x"]) ** 2, axis=-1)
        return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    def batch(rng):
        b = 8
        x = _zero_some(rng, _normal(rng, (b, d[0]), 1.0), data)
        return {"x": x, "y": _normal(rng, (b, d[depth]), 1.0), "mask": _mask(b, data)}

    return params, loss, batch


def conv(rng, act="relu", depth=2, bias=True, tied=False, data=()):
    c = [3, 4, 8][:depth + 1] if depth < 3 else [3, 4, 4, 8]
    params = {}
    for i in range(depth):
        params[f"c{i}"] = {"w": _normal(rng, (3, 3, c[i], c[i + 1]), 0.4)}
        if bias:
            b = _normal(rng, (c[i + 1],), 0.1)
            if "dead_units" in data:
                b[0] = -50.0
            params[f"c{i}"]["b"] = b
    params["head"] = {"w": _normal(rng, (c[depth], 4), 0.5)}
    f = ACTIVATIONS[act]

    def loss(p, batch):
        h = batch["x"]
        for i in range(depth):
            h = jax.lax.conv_general_dilated(h, p[f"c{i}"]["w"], (2, 2) if i == 0 else (1, 1),
                                             "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            h = f(h + (p[f"c{i}"]["b"] if bias else 0.0))
        logits = jnp.mean(h, axis=(1, 2)) @ p["head"]["w"]
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        return jnp.sum(ce * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    def batch(rng):
        b = 8
        x = _zero_some(rng, _normal(rng, (b, 6, 6, c[0]), 1.0), data)
        y = rng.integers(0, 4, (b,)).astype(np.int32)
        y[0], y[-1] = 0, 3  # the first and last class
        return {"x": x, "y": y, "mask": _mask(b, data)}

    return params, loss, batch


def attention(rng, act="gelu", depth=1, bias=True, tied=True, data=()):
    vocab, dim, seq = 11, 8, 6
    params = {"emb": _normal(rng, (vocab, dim), 0.5)}
    for i in range(depth):
        params[f"b{i}"] = {n: _normal(rng, (dim, dim), 0.4) for n in ("q", "k", "v", "o")}
        params[f"b{i}"]["up"] = _normal(rng, (dim, 2 * dim), 0.4)
        params[f"b{i}"]["down"] = _normal(rng, (2 * dim, dim), 0.4)
        if bias:
            params[f"b{i}"]["up_b"] = _normal(rng, (2 * dim,), 0.1)
            if "dead_units" in data:
                params[f"b{i}"]["up_b"][0] = -50.0
    if not tied:
        params["out"] = _normal(rng, (dim, vocab), 0.5)
    f = ACTIVATIONS[act]

    def loss(p, batch):
        tok, pad = batch["tokens"], batch["mask"]
        h = p["emb"][tok]
        causal = jnp.tril(jnp.ones((seq, seq), bool))
        allowed = causal[None] & (pad[:, None, :] > 0)
        for i in range(depth):
            blk = p[f"b{i}"]
            hn = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-5)
            q, k, v = hn @ blk["q"], hn @ blk["k"], hn @ blk["v"]
            s = jnp.einsum("bqd,bkd->bqk", q, k) / math.sqrt(dim)
            s = jnp.where(allowed, s, -1e9)
            h = h + jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(s, axis=-1), v) @ blk["o"]
            u = hn @ blk["up"] + (blk["up_b"] if bias else 0.0)
            h = h + f(u) @ blk["down"]
        logits = h @ (p["emb"].T if tied else p["out"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tok[:, 1:])
        m = pad[:, 1:]
        return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)

    def batch(rng):
        b = 4
        tok = rng.integers(1, vocab, (b, seq)).astype(np.int32)
        mask = np.ones((b, seq), np.float32)
        if "padding" in data:  # right-padded with token 0 (an embedding row no one else uses)
            tok[-1, 3:], mask[-1, 3:] = 0, 0
            tok[0, 5:], mask[0, 5:] = 0, 0
        if "zero_first_row" in data:
            tok[0, 0] = 0
        if "zero_first_col" in data:
            tok[:, 0] = vocab - 1  # the last row of the table, at every sequence start
        return {"tokens": tok, "mask": mask}

    return params, loss, batch


def scanned(rng, act="relu", depth=3, bias=True, tied=False, data=()):
    dim = 8
    params = {"stack": _normal(rng, (depth, dim, dim), 0.5), "head": _normal(rng, (dim, 3), 0.5)}
    if bias:
        params["stack_b"] = _normal(rng, (depth, dim), 0.1)
        if "dead_units" in data:
            params["stack_b"][:, 0] = -50.0
    f = ACTIVATIONS[act]

    def loss(p, batch):
        def body(h, layer):
            w, b = layer
            return f(h @ w + b), None

        bs = p["stack_b"] if bias else jnp.zeros((depth, dim))
        h, _ = jax.lax.scan(body, batch["x"], (p["stack"], bs))
        err = jnp.sum((h @ p["head"] - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    def batch(rng):
        b = 8
        x = _zero_some(rng, _normal(rng, (b, dim), 1.0), data)
        return {"x": x, "y": _normal(rng, (b, 3), 1.0), "mask": _mask(b, data)}

    return params, loss, batch


MODELS = {"mlp": mlp, "conv": conv, "attention": attention, "scanned": scanned}

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.05, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.3),
    "schedule": lambda: optax.sgd(optax.exponential_decay(0.1, 1, 0.5), momentum=0.5),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2)),
}

DATA_TRAITS = ("zero_first_row", "zero_first_col", "padding", "dead_units")

# --------------------------------------------------------------------------- the reference


def _paths(params):
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return ["/".join(str(k.key) for k in path) for path, _ in flat]


def kept_index(decision, shape):
    """The numpy index of a Channels leaf's trained range, derived from its definition:
    axis "out" is the last axis, "in" the one before it; `ratio` rounds up to whole
    channels; the range is the first channels, or the last ones with `last=True`."""
    axis = {"out": -1, "in": -2}.get(decision.axis, decision.axis) % len(shape)
    n = shape[axis]
    k = decision.count if decision.count is not None else math.ceil(decision.ratio * n)
    start = n - k if decision.last else 0
    index = [slice(None)] * len(shape)
    index[axis] = slice(start, start + k)
    return tuple(index)


def _decision_at(rules: dict, default, path):
    return rules.get(path, default)


def _view(decisions, treedef, tree):
    """The kept slices of `tree` (None for frozen leaves), cut by numpy indexing."""
    out = []
    for d, x in zip(decisions, jax.tree_util.tree_leaves(tree)):
        x = np.asarray(x)
        out.append(None if isinstance(d, pj.Frozen) else
                   x[kept_index(d, x.shape)] if isinstance(d, pj.Channels) else x)
    return jax.tree_util.tree_unflatten(treedef, out)


@functools.lru_cache(maxsize=64)
def _compiled(fun, value_and_grad=False):
    """`jax.jit(fun)` (of its `jax.value_and_grad`), made once per function, so that the
    reference does not dispatch op by op."""
    return jax.jit(jax.value_and_grad(fun) if value_and_grad else fun)


def reference_step(loss, optimizer, rules, default, params, batch, opt_state=None):
    """One step of dense jax.grad + optax on the kept slices, written back by numpy
    indexing. `rules` maps exact "/"-joined paths to decisions; `opt_state` None starts
    the chain. Returns (loss value, new params, new opt_state); the state is the chain's
    over the trainable view (None for frozen leaves)."""
    treedef = jax.tree_util.tree_structure(params)
    decisions = [_decision_at(rules, default, p) for p in _paths(params)]
    if opt_state is None:
        opt_state = optimizer.init(_view(decisions, treedef, params))
    value, grads = _compiled(loss, value_and_grad=True)(params, batch)
    updates, opt_state = _compiled(optimizer.update)(
        _view(decisions, treedef, grads), opt_state, _view(decisions, treedef, params))
    new = []
    for d, x, u in zip(decisions, jax.tree_util.tree_leaves(params),
                       jax.tree_util.tree_leaves(updates, is_leaf=lambda v: v is None)):
        x = np.array(x)
        if isinstance(d, pj.Channels):
            idx = kept_index(d, x.shape)
            x[idx] = x[idx] + np.asarray(u)
        elif not isinstance(d, pj.Frozen):
            x = x + np.asarray(u)
        new.append(x)
    return float(value), jax.tree_util.tree_unflatten(treedef, new), opt_state


def reference_run(loss, optimizer, rules, default, params, batches):
    """`reference_step` over `batches`: (losses, params, opt_state)."""
    params = jax.tree_util.tree_map(np.array, params)
    losses, opt_state = [], None
    for batch in batches:
        value, params, opt_state = reference_step(loss, optimizer, rules, default, params,
                                                  batch, opt_state)
        losses.append(value)
    return losses, params, opt_state


# --------------------------------------------------------------------------- comparison


def _close(got, want, what, rtol=2e-5, atol=2e-6):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, reference {want.shape}"
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol + rtol * scale, err_msg=what)


def assert_like_reference(start, rules, default, got_losses, got_params, got_state,
                          want_losses, want_params, want_state):
    _close(got_losses, want_losses, "losses")
    for path, d, x0, x, w in zip(_paths(start), [_decision_at(rules, default, p) for p in _paths(start)],
                                 jax.tree_util.tree_leaves(start),
                                 jax.tree_util.tree_leaves(got_params),
                                 jax.tree_util.tree_leaves(want_params)):
        x, x0 = np.asarray(x), np.asarray(x0)
        _close(x, w, f"parameter '{path}' ({d!r})")
        # What does not train is bit-identical to the start.
        if isinstance(d, pj.Frozen):
            np.testing.assert_array_equal(x, x0, err_msg=f"frozen '{path}' changed")
        elif isinstance(d, pj.Channels):
            keep = np.zeros(x.shape, bool)
            keep[kept_index(d, x.shape)] = True
            np.testing.assert_array_equal(x[~keep], x0[~keep],
                                          err_msg=f"untrained channels of '{path}' changed ({d!r})")
    if got_state is not None:
        g_leaves, g_def = jax.tree_util.tree_flatten(got_state)
        w_leaves, w_def = jax.tree_util.tree_flatten(want_state)
        assert g_def == w_def, f"optimizer state structure:\n{g_def}\n{w_def}"
        for i, (a, b) in enumerate(zip(g_leaves, w_leaves)):
            _close(a, b, f"optimizer state leaf {i}")


# --------------------------------------------------------------------------- strategies


def _channels(draw, shape, named_ok: bool):
    ndim = len(shape)
    if named_ok and ndim >= 2:
        axis = draw(st.sampled_from(["in", "out", -1, 0]))
    elif named_ok:
        axis = draw(st.sampled_from(["out", 0]))
    else:
        axis = draw(st.integers(-ndim, ndim - 1))
    n = shape[{"out": -1, "in": -2}.get(axis, axis) % ndim]
    last = draw(st.booleans())
    if draw(st.booleans()):
        return pj.Channels(count=draw(st.integers(1, n)), axis=axis, last=last)
    return pj.Channels(ratio=draw(st.sampled_from([0.25, 0.5, 1 / 3, 1.0])), axis=axis, last=last)


@st.composite
def cases(draw, models=tuple(MODELS), optimizers=tuple(OPTIMIZERS)):
    """(model name, params, loss, batches, rules, default, optimizer name)."""
    name = draw(st.sampled_from(models))
    data = tuple(t for t in DATA_TRAITS if draw(st.booleans()))
    kwargs = dict(act=draw(st.sampled_from(list(ACTIVATIONS))), bias=draw(st.booleans()),
                  depth=draw(st.integers(1, 3)), data=data)
    if name in ("mlp", "attention"):
        kwargs["tied"] = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    params, loss, make_batch = MODELS[name](rng, **kwargs)
    batches = [make_batch(rng) for _ in range(STEPS)]
    rules = {}
    for path, x in zip(_paths(params), jax.tree_util.tree_leaves(params)):
        kind = draw(st.sampled_from(["full", "frozen", "channels", "channels"]))
        if kind == "full":
            rules[path] = pj.Full()
        elif kind == "frozen":
            rules[path] = pj.Frozen()
        else:
            # Named axes mean dense [in, out] / conv HWIO features; a stacked (scanned)
            # kernel takes integer axes.
            rules[path] = _channels(draw, x.shape, named_ok=x.ndim <= 2 or path.startswith("c"))
    if all(isinstance(d, pj.Frozen) for d in rules.values()):
        first = _paths(params)[0]
        rules[first] = pj.Full()
    return name, params, loss, batches, rules, pj.Frozen(), draw(st.sampled_from(optimizers))


def _scheme(rules, default):
    return pj.Scheme({p: d for p, d in rules.items()}, default=default)


def _jax_trainer_run(loss, opt_name, rules, default, params, batches, **kw):
    trainer = pj.sparse_train(loss, optimizer=OPTIMIZERS[opt_name](), scheme=_scheme(rules, default), **kw)
    state = trainer.init(jax.tree_util.tree_map(jnp.asarray, params))
    losses = []
    for batch in batches:
        state, metrics = trainer(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == len(batches)
    return losses, jax.device_get(state.params), jax.device_get(state.opt_state)


# --------------------------------------------------------------------------- the repro


@pytest.mark.parametrize("axis", ["in", "out"])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_first_channels_written_at_the_start_when_a_reader_starts_with_zero(axis, opt_name):
    """Issue 15's repro: a reader whose first element is exactly 0 (ReLU output,
    zero-padded input) must not move the write of a first-channels slice to the end."""
    rng = np.random.default_rng(0)
    params = {"w1": _normal(rng, (4, 8), 1.0), "w2": _normal(rng, (8, 3), 1.0)}
    x = _normal(rng, (5, 4), 1.0)
    x[0] = 0

    def loss(p, x):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)

    rules = {"w1": pj.Channels(count=2, axis=axis)}
    got = _jax_trainer_run(loss, opt_name, rules, pj.Frozen(), params, [x])
    want = reference_run(loss, OPTIMIZERS[opt_name](), rules, pj.Frozen(), params, [x])
    assert_like_reference(params, rules, pj.Frozen(), *got, *want)


# --------------------------------------------------------------------------- sparse_train


@settings(max_examples=28, **_SETTINGS)
@given(cases())
def test_sparse_train_equals_the_reference(case):
    name, params, loss, batches, rules, default, opt_name = case
    want = reference_run(loss, OPTIMIZERS[opt_name](), rules, default, params, batches)
    got = _jax_trainer_run(loss, opt_name, rules, default, params, batches)
    assert_like_reference(params, rules, default, *got, *want)


# --------------------------------------------------------------------------- mesh trainer


@settings(max_examples=6, **_SETTINGS)
@given(cases(models=("mlp", "conv")), st.sampled_from([None, "data"]))
def test_mesh_trainer_equals_the_reference(case, param_axis):
    name, params, loss, batches, rules, default, opt_name = case
    mesh = jax.make_mesh((4,), ("data",))
    want = reference_run(loss, OPTIMIZERS[opt_name](), rules, default, params, batches)
    got = _jax_trainer_run(loss, opt_name, rules, default, params, batches, mesh=mesh,
                           param_axis=param_axis)
    assert_like_reference(params, rules, default, *got, *want)


# --------------------------------------------------------------------------- NNX trainer


def _nnx_mlp(seed, act, batch_norm, dead):
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            # No bias before batch norm: its gradient is zero up to rounding, which
            # Adam would scale up to steps of the learning rate's size on both sides.
            self.l0 = nnx.Linear(6, 8, use_bias=not batch_norm, rngs=rngs)
            self.norm = nnx.BatchNorm(8, rngs=rngs) if batch_norm else nnx.LayerNorm(8, rngs=rngs)
            self.l1 = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return self.l1(ACTIVATIONS[act](self.norm(self.l0(x))))

    model = MLP(nnx.Rngs(seed))
    if dead and not batch_norm:
        model.l0.bias[...] = model.l0.bias[...].at[0].set(-50.0)
    if dead:
        model.l1.bias[...] = model.l1.bias[...].at[0].set(-50.0)
    return model


@settings(max_examples=6, **_SETTINGS)
@given(st.integers(0, 100), st.sampled_from(list(ACTIVATIONS)), st.booleans(),
       st.sets(st.sampled_from(DATA_TRAITS)), st.sampled_from(list(OPTIMIZERS)),
       st.lists(st.sampled_from(["full", "frozen", "in", "out", "out_last", "int0"]),
                min_size=6, max_size=6))
def test_nnx_trainer_equals_the_reference(seed, act, batch_norm, data, opt_name, kinds):
    from flax import nnx

    model = _nnx_mlp(seed, act, batch_norm, "dead_units" in data)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    params = jax.tree_util.tree_map(np.asarray, params)
    rules = {}
    for path, x, kind in zip(_paths(params), jax.tree_util.tree_leaves(params), kinds):
        if kind == "full":
            rules[path] = pj.Full()
        elif kind == "frozen":
            rules[path] = pj.Frozen()
        elif kind == "int0":
            rules[path] = pj.Channels(count=1, axis=0)
        elif kind == "in" and x.ndim == 2:
            rules[path] = pj.Channels(ratio=0.5, axis="in")
        else:
            rules[path] = pj.Channels(count=3, axis="out", last=kind == "out_last")
    rng = np.random.default_rng(seed)
    batches = [{"x": _zero_some(rng, _normal(rng, (8, 6), 1.0), data), "y": _normal(rng, (8, 4), 1.0)}
               for _ in range(STEPS)]

    def loss_fn(m, batch):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    # The reference carries the module's other state (batch statistics) step to step
    # itself, by merging and splitting the module with Flax.
    def pure(p, batch, rest):
        m = nnx.merge(graphdef, p, rest) if rest else nnx.merge(graphdef, p)
        value = loss_fn(m, batch)
        return value, nnx.to_pure_dict(nnx.state(m, nnx.Not(nnx.Param))) if rest else rest

    opt = OPTIMIZERS[opt_name]()
    ref_params, ref_rest, losses, state = params, rest, [], None
    for batch in batches:
        new_rest = pure(ref_params, batch, ref_rest)[1]
        value, ref_params, state = reference_step(
            lambda p, b: pure(p, b, ref_rest)[0], opt, rules, pj.Frozen(), ref_params, batch, state)
        losses.append(value)
        ref_rest = new_rest

    trainer = pj.nnx.Trainer(_nnx_mlp(seed, act, batch_norm, "dead_units" in data), loss_fn,
                             optimizer=OPTIMIZERS[opt_name](), scheme=_scheme(rules, pj.Frozen()))
    got_losses = [float(trainer(b)["loss"]) for b in batches]
    assert_like_reference(params, rules, pj.Frozen(), got_losses, jax.device_get(trainer.params()),
                          jax.device_get(trainer.state.opt_state), losses, ref_params, state)
    if batch_norm:
        for a, b in zip(jax.tree_util.tree_leaves(trainer.rest), jax.tree_util.tree_leaves(ref_rest)):
            _close(a, b, "batch statistics")


# --------------------------------------------------------------------------- host-cpu artifact


@settings(max_examples=4, **_SETTINGS)
@given(case=cases())
def test_host_cpu_artifact_equals_the_reference(tmp_path_factory, case):
    from pockjax import runtime

    name, params, loss, batches, rules, default, opt_name = case
    want = reference_run(loss, OPTIMIZERS[opt_name](), rules, default, params, batches)
    trainer = pj.sparse_train(loss, optimizer=OPTIMIZERS[opt_name](), scheme=_scheme(rules, default))
    state = trainer.init(jax.tree_util.tree_map(jnp.asarray, params))
    out = tmp_path_factory.mktemp(name)
    art = trainer.export(state, batches[0], target="host-cpu", out_dir=out / "artifact")
    sess = runtime.load(art.path, device="local-task")
    losses = [float(sess.step(b)["loss"]) for b in batches]
    # The session's checkpoint holds parameters and optimizer state in the JAX layout.
    sess.save(out / "ckpt.safetensors")
    got = pj.load(out / "ckpt.safetensors", like=state)
    assert int(got.step) == len(batches)
    assert_like_reference(params, rules, default, losses, jax.device_get(got.params),
                          jax.device_get(got.opt_state), *want)


def test_host_cpu_artifact_with_a_schedule_equals_the_reference(tmp_path):
    """A schedule's step count is shared optimizer state written in place; the per-leaf
    updates read the old count, so its write must wait for them (IREE would otherwise
    schedule it first; the export's hazard check refused the artifact)."""
    from pockjax import runtime

    params, loss, make_batch = mlp(np.random.default_rng(3), depth=1, bias=False,
                                   data=("zero_first_row",))
    batches = [make_batch(np.random.default_rng(i)) for i in range(STEPS)]
    rules = {"l0/w": pj.Full()}
    trainer = pj.sparse_train(loss, optimizer=OPTIMIZERS["schedule"](), scheme=_scheme(rules, pj.Frozen()))
    state = trainer.init(jax.tree_util.tree_map(jnp.asarray, params))
    art = trainer.export(state, batches[0], target="host-cpu", out_dir=tmp_path / "artifact")
    sess = runtime.load(art.path, device="local-task")
    losses = [float(sess.step(b)["loss"]) for b in batches]
    sess.save(tmp_path / "ckpt.safetensors")
    got = pj.load(tmp_path / "ckpt.safetensors", like=state)
    want = reference_run(loss, OPTIMIZERS["schedule"](), rules, pj.Frozen(), params, batches)
    assert_like_reference(params, rules, pj.Frozen(), losses, jax.device_get(got.params),
                          jax.device_get(got.opt_state), *want)
