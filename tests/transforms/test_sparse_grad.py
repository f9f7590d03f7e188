"""sparse_grad against dense jax.grad: API behaviour and property tests."""
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import pockjax as pj
from pockjax._src.jaxpr import describe_source
from pockjax.transforms import TracedValueError
from tests.helpers import assert_matches_dense, assert_trees_close, dense_view


def mlp_params(key, sizes):
    keys = jax.random.split(key, len(sizes))
    return {f"dense_{i}": {"kernel": jax.random.normal(k, (a, b)) / np.sqrt(a), "bias": 0.1 * jnp.ones(b)}
            for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))}


def mlp_loss(params, x, act=jax.nn.gelu):
    for i in range(len(params)):
        x = act(x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"])
    return jnp.mean(x ** 2)


PARAMS = mlp_params(jax.random.PRNGKey(0), [6, 12, 10, 4])
X = jax.random.normal(jax.random.PRNGKey(1), (5, 6))
SCHEME = pj.Scheme({"dense_0/kernel": pj.Channels(ratio=0.5, axis="in"),
                    "dense_1/kernel": pj.Channels(count=3, axis="out", last=True),
                    "dense_2/**": pj.Full()})


def test_structure_frozen_none_channels_sliced():
    g = pj.sparse_grad(mlp_loss, SCHEME)(PARAMS, X)
    assert g["dense_0"]["bias"] is None and g["dense_1"]["bias"] is None
    assert g["dense_0"]["kernel"].shape == (3, 12)
    assert g["dense_1"]["kernel"].shape == (12, 3)
    assert g["dense_2"]["kernel"].shape == (10, 4)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(pj.trainable_view(PARAMS, SCHEME))


def test_matches_dense_jitted_and_not():
    info = assert_matches_dense(mlp_loss, SCHEME, PARAMS, X)
    assert not info.fallbacks
    assert info.rules["dot_general"] >= 2


def test_value_and_grad_and_has_aux():
    def loss_aux(p, x):
        l = mlp_loss(p, x)
        return l, {"l2": l * 2}
    (v, aux), g = pj.sparse_value_and_grad(loss_aux, SCHEME, has_aux=True)(PARAMS, X)
    np.testing.assert_allclose(v, mlp_loss(PARAMS, X), rtol=1e-6)
    np.testing.assert_allclose(aux["l2"], 2 * v, rtol=1e-6)
    assert_trees_close(g, dense_view(mlp_loss, SCHEME, PARAMS, X))
    g2, aux2 = pj.sparse_grad(loss_aux, SCHEME, has_aux=True)(PARAMS, X)
    assert_trees_close(g2, g)


def test_argnums_and_static_arguments():
    def loss(x, params, scale, act_name="gelu"):
        act = {"gelu": jax.nn.gelu, "tanh": jnp.tanh}[act_name]
        return scale * mlp_loss(params, x, act)
    g = pj.sparse_grad(loss, SCHEME, argnums=1)(X, PARAMS, 2.0, act_name="tanh")
    want = pj.trainable_view(jax.grad(loss, argnums=1)(X, PARAMS, 2.0, act_name="tanh"), SCHEME)
    assert_trees_close(g, want)


def test_tuple_argnums_prefix_paths():
    s = pj.Scheme({"0/dense_2/kernel": pj.Full(), "1": pj.Full()})
    loss = lambda p, x: mlp_loss(p, x)
    g = pj.sparse_grad(loss, s, argnums=(0, 1))(PARAMS, X)
    want = pj.trainable_view(jax.grad(loss, argnums=(0, 1))(PARAMS, X), s)
    assert_trees_close(g, want)


def test_trainable_and_apply_updates_write_slices():
    view = pj.trainable_view(PARAMS, SCHEME)
    ones = jax.tree_util.tree_map(jnp.ones_like, view)
    new = pj.apply_sparse_updates(PARAMS, ones, SCHEME)
    k0 = np.asarray(new["dense_0"]["kernel"]) - np.asarray(PARAMS["dense_0"]["kernel"])
    np.testing.assert_allclose(k0[:3], 1, rtol=1e-6)
    assert np.all(k0[3:] == 0)
    k1 = np.asarray(new["dense_1"]["kernel"]) - np.asarray(PARAMS["dense_1"]["kernel"])
    np.testing.assert_allclose(k1[:, -3:], 1, rtol=1e-6)
    assert np.all(k1[:, :-3] == 0)
    assert new["dense_0"]["bias"] is PARAMS["dense_0"]["bias"]


def test_apply_updates_errors_name_the_path():
    view = pj.trainable_view(PARAMS, SCHEME)
    bad = jax.tree_util.tree_map(lambda u: u, view)
    bad["dense_0"]["kernel"] = jnp.ones((4, 12))
    with pytest.raises(pj.SchemeError, match="update for 'dense_0/kernel' has shape \\(4, 12\\), expected"):
        pj.apply_sparse_updates(PARAMS, bad, SCHEME)


def test_non_scalar_loss_raises():
    with pytest.raises(TypeError, match="scalar"):
        pj.sparse_grad(lambda p, x: x @ p["dense_0"]["kernel"], SCHEME)(PARAMS, X)


def test_bad_argnums():
    with pytest.raises(TypeError, match="argnums=3"):
        pj.sparse_grad(mlp_loss, SCHEME, argnums=3)(PARAMS, X)


def test_frozen_parameters_get_no_gradient_work():
    s = pj.Scheme({"dense_2/bias": pj.Full()})
    info = pj.sparse_grad(mlp_loss, s).explain(PARAMS, X)
    # Only the last layer's bias trains: no dot_general in the backward at all.
    n_dots = sum(e.primitive.name == "dot_general" for e in info.jaxpr.jaxpr.eqns)
    assert n_dots == 3  # the three forward matmuls


def test_forward_reuses_the_weight_without_copy():
    info = pj.sparse_grad(mlp_loss, SCHEME).explain(PARAMS, X)
    assert not any(e.primitive.name == "concatenate" for e in info.jaxpr.jaxpr.eqns)


# -- property tests -----------------------------------------------------------------

decision = st.one_of(
    st.just(pj.Full()), st.just(pj.Frozen()),
    st.builds(pj.Channels, ratio=st.sampled_from([0.125, 0.25, 0.5, 0.75]),
              axis=st.sampled_from(["in", "out"]), last=st.booleans()))


def random_scheme(draw_decisions, paths):
    rules = {p: d for p, d in zip(paths, draw_decisions)}
    if all(isinstance(d, pj.Frozen) for d in rules.values()):
        rules[paths[-1]] = pj.Full()
    return pj.Scheme(rules)


@given(sizes=st.lists(st.integers(2, 9), min_size=3, max_size=5), data=st.data(),
       act=st.sampled_from(["gelu", "relu", "tanh"]))
def test_property_random_mlps(sizes, data, act):
    params = mlp_params(jax.random.PRNGKey(len(sizes)), sizes)
    paths = [f"dense_{i}/{n}" for i in range(len(sizes) - 1) for n in ("kernel", "bias")]
    ds = [data.draw(decision) if n.endswith("kernel") else data.draw(st.sampled_from([pj.Full(), pj.Frozen()]))
          for n in paths]
    scheme = random_scheme(ds, paths)
    x = jax.random.normal(jax.random.PRNGKey(7), (3, sizes[0]))
    f = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "tanh": jnp.tanh}[act]
    assert_matches_dense(lambda p, x: mlp_loss(p, x, f), scheme, params, x, eager=False)


def conv(x, w, groups=1):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


@given(chans=st.lists(st.sampled_from([4, 8]), min_size=2, max_size=4), data=st.data(),
       depthwise=st.booleans())
def test_property_random_convnets(chans, data, depthwise):
    keys = jax.random.split(jax.random.PRNGKey(sum(chans)), len(chans) + 1)
    params = {f"conv_{i}": jax.random.normal(k, (3, 3, a, b)) / np.sqrt(9 * a)
              for i, (k, a, b) in enumerate(zip(keys, [3] + chans[:-1], chans))}
    if depthwise:
        params["dw"] = jax.random.normal(keys[-1], (3, 3, 1, chans[-1])) / 3

    def loss(p, x):
        for i in range(len(chans)):
            x = jax.nn.relu(conv(x, p[f"conv_{i}"]))
        if depthwise:
            x = jnp.tanh(conv(x, p["dw"], chans[-1]))
        return jnp.mean(x ** 2)

    paths = list(params)
    scheme = random_scheme([data.draw(decision) for _ in paths], paths)
    x = jax.random.normal(keys[0], (2, 6, 6, 3))
    assert_matches_dense(loss, scheme, params, x, eager=False)


def attention_params(key, d):
    ks = jax.random.split(key, 6)
    return {"q": jax.random.normal(ks[0], (d, d)) / np.sqrt(d), "k": jax.random.normal(ks[1], (d, d)) / np.sqrt(d),
            "v": jax.random.normal(ks[2], (d, d)) / np.sqrt(d), "o": jax.random.normal(ks[3], (d, d)) / np.sqrt(d),
            "norm": jnp.ones(d), "up": jax.random.normal(ks[4], (d, 2 * d)) / np.sqrt(d),
            "down": jax.random.normal(ks[5], (2 * d, d)) / np.sqrt(2 * d)}


def attention_block(p, x, heads):
    B, T, d = x.shape
    h = x * lax.rsqrt(jnp.mean(x ** 2, -1, keepdims=True) + 1e-6) * p["norm"]
    split = lambda t: t.reshape(B, T, heads, d // heads)
    q, k, v = split(h @ p["q"]), split(h @ p["k"]), split(h @ p["v"])
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
    o = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(B, T, d)
    x = x + o @ p["o"]
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


@given(heads=st.sampled_from([1, 2, 4]), data=st.data())
def test_property_random_attention_blocks(heads, data):
    d = 8
    params = attention_params(jax.random.PRNGKey(heads), d)
    paths = list(params)
    ds = [data.draw(decision) if n != "norm" else data.draw(st.sampled_from([pj.Full(), pj.Frozen()]))
          for n in paths]
    scheme = random_scheme(ds, paths)
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 5, d))
    loss = lambda p, x: jnp.mean(attention_block(p, attention_block(p, x, heads), heads) ** 2)
    assert_matches_dense(loss, scheme, params, x, rtol=1e-5, atol=1e-6, eager=False)


# -- explain(): fallbacks name the user's line ---------------------------------------------


def _running_sum(h):
    return jnp.cumsum(h, axis=-1)  # no push-down rule: the fallback explain() reports


_RUNNING_SUM_LINE = _running_sum.__code__.co_firstlineno + 1


@pytest.mark.parametrize("nested_jit", [True, False])
def test_fallback_source_is_the_users_line_through_rebound_equations(nested_jit):
    # Before push-down, nested jits are inlined: every equation in them is re-bound by the
    # pass, which must keep its source info, or explain() names pockjax's own frame.
    running_sum = jax.jit(_running_sum) if nested_jit else _running_sum

    @jax.jit
    def block(w, x):  # the backward of a jit is a jit: it is inlined too
        return jnp.tanh(running_sum(x @ w))

    loss = lambda p, x: jnp.sum(block(p["dense_0"]["kernel"], x) ** 2)
    info = assert_matches_dense(loss, pj.Scheme({"dense_0/kernel": pj.Channels(count=3, axis="out")}),
                                PARAMS, X)
    source = info.fallback_sources["cumsum"]
    assert f"{__file__}:{_RUNNING_SUM_LINE}:" in source and "(_running_sum)" in source, source
    assert "pockjax" not in str(info).replace(__file__, ""), str(info)


def test_equations_the_pass_emits_keep_the_users_line():
    # Rules' output (narrowed dot_generals, slices) carries the line of the equation it replaces.
    info = pj.sparse_grad(mlp_loss, SCHEME).explain(PARAMS, X)
    sources = {describe_source(e) for e in info.jaxpr.jaxpr.eqns}
    pass_files = ("_pass.py", "pushdown.py", "_boxes.py", "_plans.py", "_rules", "_control_flow.py")
    assert not [s for s in sources if any(f in s for f in pass_files)], sources


def _branches(p, x):
    h = x @ p["dense_0"]["kernel"]
    if jnp.sum(h) > 0:  # the line the error quotes
        h = 2 * h
    return jnp.mean(h ** 2)


def _to_int(p, x):
    n = int(jnp.sum(x > 0))  # the line the error quotes
    return jnp.mean((x @ p["dense_0"]["kernel"]) ** 2) * n


def _to_numpy(p, x):
    h = np.asarray(x @ p["dense_0"]["kernel"])  # the line the error quotes
    return jnp.mean(h ** 2)


def _to_index(p, x):
    scale = [1.0, 2.0, 3.0][jnp.argmax(x[0]) % 3]  # the line the error quotes
    return jnp.mean((x @ p["dense_0"]["kernel"]) ** 2) * scale


def _chain(err):
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


@pytest.mark.parametrize("fun,what,line,jax_error", [
    (_branches, "branches in Python on a traced value", "if jnp.sum(h) > 0:",
     jax.errors.TracerBoolConversionError),
    (_to_int, "needs the concrete value of a traced array", "n = int(jnp.sum(x > 0))",
     jax.errors.ConcretizationTypeError),
    (_to_numpy, "converts a traced value to a NumPy array", "h = np.asarray(x @ p",
     jax.errors.TracerArrayConversionError),
    (_to_index, "uses a traced value as a Python index", "scale = [1.0, 2.0, 3.0][jnp.argmax",
     jax.errors.TracerIntegerConversionError),
], ids=["if", "int", "numpy", "index"])
@pytest.mark.parametrize("transform", [pj.sparse_grad, pj.sparse_value_and_grad], ids=["grad", "value_and_grad"])
def test_a_python_decision_on_a_traced_value_names_the_line_and_the_fix(transform, fun, what, line, jax_error):
    with pytest.raises(TracedValueError) as info:
        jax.jit(transform(fun, SCHEME))(PARAMS, X)
    msg = str(info.value)
    assert f"the loss function `{fun.__qualname__}` {what}" in msg, msg
    assert f"{__file__}:" in msg and f"(in {fun.__name__}):\n    {line}" in msg, msg
    assert "jnp.where(cond, a, b)" in msg and "jax.lax.cond" in msg and "static_argnums" in msg, msg
    assert isinstance(info.value, TypeError)
    assert any(type(e) is jax_error for e in _chain(info.value.__cause__)), list(_chain(info.value))
    # the user's own frames stay in the chained error's traceback
    assert any(fun.__code__.co_filename == f.filename and f.name == fun.__name__
               for e in _chain(info.value) for f in traceback.extract_tb(e.__traceback__))


def test_a_python_decision_on_a_traced_value_in_sparse_train():
    trainer = pj.sparse_train(_branches, optimizer=optax.sgd(0.1), scheme=SCHEME)
    with pytest.raises(TracedValueError, match="branches in Python on a traced value"):
        trainer(trainer.init(PARAMS), X)


def test_a_python_decision_on_a_static_argument_is_fine():
    # The fix the error suggests for settings: a Python value is static.
    def loss(p, x, double):
        h = x @ p["dense_0"]["kernel"]
        if double:
            h = 2 * h
        return jnp.mean(h ** 2)
    want = dense_view(loss, SCHEME, PARAMS, X, True)
    sg = pj.sparse_grad(loss, SCHEME)
    assert_trees_close(sg(PARAMS, X, True), want)
    assert_trees_close(jax.jit(sg, static_argnums=2)(PARAMS, X, True), want)
