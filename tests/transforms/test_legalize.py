"""Legalisation for IREE keeps every value: neg-sum, select-and-scatter and batched-gather
rewrites."""
import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pockjax.transforms.legalize import legalize_for_iree


def _legalized(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    fixed, stats = legalize_for_iree(closed)
    return fixed, stats, jex.jaxpr_as_fun(fixed)(*args)


def test_neg_sum_becomes_neg_of_sum():
    def f(x):
        return jnp.sum(-(x - jnp.mean(x, -1, keepdims=True)), axis=-1)

    x = jnp.arange(12.0).reshape(3, 4) ** 2
    fixed, stats, out = _legalized(f, x)
    assert stats == {"neg_sum": 1}
    producers = {v: e.primitive.name for e in fixed.jaxpr.eqns for v in e.outvars}
    assert not any(e.primitive.name == "reduce_sum" and producers.get(e.invars[0]) == "neg"
                   for e in fixed.jaxpr.eqns)
    np.testing.assert_array_equal(out[0], f(x))


@pytest.mark.parametrize("window,strides,padding,reducer,init", [
    ((1, 2, 2, 1), (1, 2, 2, 1), "VALID", lax.max, -jnp.inf),   # plain 2x2 max pool
    ((1, 3, 3, 1), (1, 2, 2, 1), "SAME", lax.max, -jnp.inf),    # overlapping, padded
    ((1, 3, 2, 1), (1, 1, 2, 1), ((0, 0), (1, 1), (0, 1), (0, 0)), lax.max, -jnp.inf),
    ((1, 2, 2, 1), (1, 1, 1, 1), "VALID", lax.min, jnp.inf),    # min pooling
])
def test_pooling_gradients_are_unchanged(window, strides, padding, reducer, init):
    def f(x, w):
        pooled = lax.reduce_window(x, init, reducer, window, strides, padding)
        return jnp.sum(pooled * w)

    rng = np.random.default_rng(0)
    # Few distinct values, so windows have ties: the first extreme element must win.
    x = jnp.asarray(rng.integers(0, 3, (2, 7, 6, 3)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal(jax.eval_shape(
        lambda x: lax.reduce_window(x, init, reducer, window, strides, padding), x).shape),
        jnp.float32)
    grad = jax.grad(f)
    fixed, stats, out = _legalized(grad, x, w)
    assert stats == {"select_and_scatter": 1}
    assert "select_and_scatter_add" not in str(fixed)
    # Overlapping windows add their contributions in another order (rounding only); a
    # wrongly chosen element would be off by a whole gradient value.
    np.testing.assert_allclose(out[0], grad(x, w), rtol=1e-6, atol=1e-6)


def _batched_gathers(closed):
    """The gathers with batching dimensions in `closed`, nested jit calls included."""
    found = []
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "jit":
            found += _batched_gathers(e.params["jaxpr"])
        elif e.primitive.name == "gather" and e.params["dimension_numbers"].operand_batching_dims:
            found.append(e)
    return found


def _assert_same(got, want):
    """Equal values, NaN where NaN, and the same sign on zeros."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


# Labels at the first and the last class, one that jnp wraps (-1), and for the fill and
# clip modes two out of range (10 and -11). Logits with exact zeros of both signs, an
# all-zero row and an infinity, chosen at and beside the label.
LABELS = np.array([0, 9, 0, 9, 3, -1, 10, -11], np.int32)


def _logits():
    x = np.random.default_rng(1).standard_normal((8, 10)).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 9] = -0.0
    x[2] = 0.0
    x[3, 8] = -np.inf
    x[4, 3] = np.inf
    return jnp.asarray(x)


@pytest.mark.parametrize("mode", ["fill", "clip", "promise_in_bounds"])
def test_a_batched_gather_reads_the_same_elements_without_batching_dims(mode):
    x, labels = _logits(), jnp.asarray(LABELS if mode != "promise_in_bounds" else LABELS % 10)

    def f(x, labels):
        return jnp.take_along_axis(x, labels[:, None], axis=1, mode=mode)[:, 0]

    closed = jax.make_jaxpr(f)(x, labels)
    assert len(_batched_gathers(closed)) == 1
    fixed, stats, out = _legalized(f, x, labels)
    assert stats == {"batched_gather": 1} and not _batched_gathers(fixed)
    _assert_same(out[0], f(x, labels))


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_several_batching_dims_and_narrow_indices(axis):
    x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32))
    shape = list(x.shape)
    shape[axis] = 2
    idx = jnp.asarray(np.random.default_rng(3).integers(0, x.shape[axis], shape), jnp.int8)
    f = lambda x, idx: jnp.take_along_axis(x, idx, axis=axis)
    fixed, stats, out = _legalized(f, x, idx)
    assert stats == {"batched_gather": 1} and not _batched_gathers(fixed)
    _assert_same(out[0], f(x, idx))


def test_a_batch_longer_than_the_index_dtype_reaches():
    """int8 indices over 300 rows: the iota columns need int32, so the indices widen."""
    x = jnp.asarray(np.random.default_rng(4).standard_normal((300, 3)).astype(np.float32))
    idx = jnp.asarray(np.arange(300) % 3, jnp.int8)[:, None]
    dn = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(1,),
                                    start_index_map=(1,), operand_batching_dims=(0,),
                                    start_indices_batching_dims=(0,))
    f = lambda x, idx: lax.gather(x, idx, dn, (1, 1), mode="fill")
    fixed, stats, out = _legalized(f, x, idx)
    assert stats == {"batched_gather": 1}
    _assert_same(out[0], f(x, idx))
    _assert_same(out[0], x[np.arange(300), np.arange(300) % 3])


def test_integer_label_cross_entropy_keeps_its_value_and_gradients():
    """optax's integer-label cross entropy, the step IREE's CUDA backend could not compile
    (a batch of 32): the loss and its gradient, legalised, are those of the original, and
    so is the gradient taken through the legalised loss."""
    import optax

    rng = np.random.default_rng(5)
    x = rng.standard_normal((32, 10)).astype(np.float32)
    x[:4] = 0.0                                   # exact-zero logits
    labels = np.arange(32, dtype=np.int32) % 10   # the first and the last class
    labels[:2] = (0, 9)
    x, labels = jnp.asarray(x), jnp.asarray(labels)

    def loss(x, labels):
        return optax.softmax_cross_entropy_with_integer_labels(x, labels).mean()

    step = jax.value_and_grad(loss)
    fixed, stats, out = _legalized(step, x, labels)
    assert stats == {"batched_gather": 1, "batched_scatter_add": 1}
    assert not _batched_gathers(fixed) and not _batched_scatters(fixed)
    value, grad = step(x, labels)
    _assert_same(out[0], value)
    _assert_same(out[1], grad)

    legal_loss, _, _ = _legalized(loss, x, labels)
    through = jax.value_and_grad(lambda x: jex.jaxpr_as_fun(legal_loss)(x, labels)[0])(x)
    _assert_same(through[0], value)
    _assert_same(through[1], grad)


def test_a_sliced_boolean_broadcast_becomes_a_broadcast_of_the_slice():
    """A causal mask broadcast over batch and heads, sliced as push-down slices it (some
    heads, a strided window): the mask itself is sliced, the values are the same."""
    pos = jnp.arange(6)

    def f(scores):
        mask = pos[:, None] >= pos[None, :]                     # [6, 6]
        full = lax.broadcast_in_dim(mask, (2, 3, 6, 6), (2, 3))
        keep = lax.slice(full, (0, 1, 1, 0), (2, 3, 6, 6), (1, 1, 2, 1))
        return jnp.where(keep, scores, -jnp.inf)

    scores = jnp.asarray(np.random.default_rng(6).standard_normal((2, 2, 3, 6)), jnp.float32)
    fixed, stats, out = _legalized(f, scores)
    assert stats == {"slice_of_broadcast": 1}
    _assert_same(out[0], f(scores))
    # Size-1 dimensions the broadcast stretches stay whole.
    g = lambda m: lax.slice(lax.broadcast_in_dim(m, (4, 5), (0, 1)), (1, 2), (3, 5))
    m = jnp.asarray([[True], [False], [True], [False]])
    fixed, stats, out = _legalized(g, m)
    assert stats == {"slice_of_broadcast": 1}
    np.testing.assert_array_equal(out[0], g(m))
    # Other dtypes are left alone.
    _, stats, _ = _legalized(lambda x: lax.slice(jnp.broadcast_to(x, (4, 5)), (1, 0), (3, 5)),
                             jnp.ones(5))
    assert stats == {}


def test_reductions_over_leading_axes_get_a_barrier_for_vulkan_only():
    def f(x):
        mean = jnp.sum(x, (0, 1)) / 64        # batch norm's statistics over N, H (NHWC)
        return (x - mean) * jnp.max(x, 0) + jnp.sum(-x, 0) - jnp.sum(x, -1, keepdims=True)

    x = jnp.asarray(np.random.default_rng(7).standard_normal((4, 16, 8)), jnp.float32)
    closed = jax.make_jaxpr(f)(x)
    fixed, stats = legalize_for_iree(closed, "vulkan")
    assert stats == {"leading_axes_reduction": 3, "neg_sum": 1}
    assert sum(e.primitive.name == "optimization_barrier" for e in fixed.jaxpr.eqns) == 3
    _assert_same(jex.jaxpr_as_fun(fixed)(x)[0], f(x))
    for backend in (None, "cuda", "local"):
        assert legalize_for_iree(closed, backend)[1] == {"neg_sum": 1}


def test_custom_derivative_bodies_are_rewritten_too():
    """The primal body of a custom_vjp / custom_jvp function (MobileNetV2's batch norm has
    a hand-written backward) gets the same rewrites; its value is unchanged."""
    @jax.custom_vjp
    def stats(x):
        return jnp.sum(x, (0, 1)) / 64

    stats.defvjp(lambda x: (stats(x), x.shape), lambda shape, g: (jnp.broadcast_to(g, shape) / 64,))

    @jax.custom_jvp
    def peak(x):
        return jnp.max(x, 0)

    peak.defjvp(lambda p, t: (peak(p[0]), jnp.max(t[0], 0)))

    def f(x):
        return (x - stats(x)) * peak(x)

    x = jnp.asarray(np.random.default_rng(8).standard_normal((4, 16, 8)), jnp.float32)
    closed = jax.make_jaxpr(f)(x)
    assert {e.primitive.name for e in closed.jaxpr.eqns} >= {"custom_vjp_call", "custom_jvp_call"}
    fixed, stats_made = legalize_for_iree(closed, "vulkan")
    assert stats_made == {"leading_axes_reduction": 2}
    _assert_same(jex.jaxpr_as_fun(fixed)(x)[0], f(x))


def _batched_scatters(closed):
    found = []
    for e in closed.jaxpr.eqns:
        if e.primitive.name == "jit":
            found += _batched_scatters(e.params["jaxpr"])
        elif e.primitive.name == "scatter-add" and \
                e.params["dimension_numbers"].operand_batching_dims:
            found.append(e)
    return found


@pytest.mark.parametrize("batch", [1, 2, 3])
def test_the_cross_entropys_gradient_scatters_without_batching_dims(batch):
    """The gradient of optax's integer-label cross-entropy (a batched gather's transpose:
    a batched scatter-add) without batching dimensions: the same values, at batch 1 too,
    where the windows are single elements and the scatter becomes one of scalars; and
    such a step compiles for IREE at batch 1 (it did not: "'iree_linalg_ext.scatter' op
    expected indices to be equal to batch rank or batch rank + 1")."""
    import optax

    rng = np.random.default_rng(batch)
    logits = jnp.asarray(rng.standard_normal((batch, 6, 11)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 11, (batch, 6)), jnp.int32)

    def grad(x, labels):
        return jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(
            x, labels).sum())(x)

    assert _batched_scatters(jax.make_jaxpr(grad)(logits, labels))
    fixed, stats, out = _legalized(grad, logits, labels)
    assert stats["batched_scatter_add"] == 1 and not _batched_scatters(fixed)
    np.testing.assert_allclose(out[0], grad(logits, labels), rtol=1e-6, atol=1e-7)


def test_a_language_models_step_exports_at_batch_1(tmp_path):
    import optax

    import pockjax as pj

    params = {"emb": jnp.ones((16, 8)) * 0.1, "out": jnp.ones((8, 16)) * 0.1}

    def loss(p, b):
        logits = p["emb"][b["tokens"]] @ p["out"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2),
                              scheme=pj.Scheme({"out": pj.Full()}))
    batch = {"tokens": jnp.arange(8, dtype=jnp.int32)[None], "labels": jnp.ones((1, 8), jnp.int32)}
    art = trainer.export(trainer.init(params), batch, target="host-cpu", out_dir=tmp_path / "a")
    from pockjax import runtime

    sess = runtime.load(art.path)
    got = float(sess.step(jax.tree.map(np.asarray, batch))["loss"])
    _, metrics = trainer(trainer.init(params), batch)
    np.testing.assert_allclose(got, float(metrics["loss"]), rtol=1e-6)


@pytest.mark.parametrize("lhs_shape,rhs_shape,spec,groups,settings", [
    ((6, 3, 7, 7), (6, 3, 3, 3), ("NCHW", "OIHW", "NCHW"), 6, {}),
    ((12, 3, 7, 7), (6, 3, 3, 3), ("NCHW", "OIHW", "NCHW"), 6, {}),     # 2 per group
    ((12, 7, 7, 3), (3, 3, 3, 6), ("NHWC", "HWIO", "NHWC"), 3,
     dict(window_strides=(2, 1), padding=((1, 0), (2, 1)), rhs_dilation=(1, 2))),
    ((4, 7, 7, 8), (3, 3, 4, 8), ("CHWN", "HWIO", "CHWN"), 4, {}),
])
def test_a_batch_grouped_conv_becomes_a_depthwise_one(lhs_shape, rhs_shape, spec, groups,
                                                      settings):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=lhs_shape), jnp.float32).at[0].set(0.0)
    w = jnp.asarray(rng.normal(size=rhs_shape), jnp.float32)
    settings = {"window_strides": (1, 1), "padding": ((0, 0), (0, 0)), **settings}

    def f(x, w):
        return lax.conv_general_dilated(x, w, settings["window_strides"], settings["padding"],
                                        rhs_dilation=settings.get("rhs_dilation"),
                                        dimension_numbers=spec, batch_group_count=groups)

    fixed, stats, out = _legalized(f, x, w)
    assert stats == {"batch_grouped_conv": 1}
    convs = [e for e in fixed.jaxpr.eqns if e.primitive is lax.conv_general_dilated_p]
    assert [(e.params["batch_group_count"], e.params["feature_group_count"]) for e in convs] \
        == [(1, groups * x.shape[spec[0].index("C")])]
    np.testing.assert_allclose(out[0], f(x, w), rtol=1e-5, atol=1e-5)


def test_a_depthwise_kernel_gradient_keeps_its_value():
    """The case that meets the rewrite in a training step: `jax.grad` of a depth-wise
    convolution's kernel, over a batch of 3, with stride and padding."""
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(3, 9, 9, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, 1, 4)), jnp.float32)

    def loss(w, x):
        y = lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), feature_group_count=4,
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.sum(jnp.tanh(y) ** 2)

    fixed, stats, out = _legalized(jax.grad(loss), w, x)
    assert stats.get("batch_grouped_conv") == 1
    np.testing.assert_allclose(out[0], jax.grad(loss)(w, x), rtol=1e-5, atol=1e-5)
