"""Recursion into jit, remat, scan, cond, while, custom_jvp_call and custom_vjp_call."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import pockjax as pj
from tests.helpers import assert_matches_dense, flops

K = jax.random.split(jax.random.PRNGKey(1), 6)
P = {"a": jax.random.normal(K[0], (8, 16)) / 3, "b": jax.random.normal(K[1], (16, 8)) / 4}
X = jax.random.normal(K[2], (5, 8))
SCHEMES = [pj.Scheme({"a": pj.Channels(ratio=0.25, axis="out"), "b": pj.Full()}),
           pj.Scheme({"a": pj.Channels(ratio=0.25, axis="in")}),
           pj.Scheme({"b": pj.Channels(count=2, axis="out", last=True)})]


def all_schemes(loss, rule=None):
    for s in SCHEMES:
        info = assert_matches_dense(loss, s, P, X)
        assert not info.fallbacks, info.fallbacks
        if rule:
            assert info.rules.get(rule, 0) >= 1 or s is SCHEMES[2]
    return info


def _prims(jaxpr, acc=None):
    acc = [] if acc is None else acc
    for e in jaxpr.eqns:
        acc.append(e.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            _prims(sub, acc)
    return acc


def test_jit_is_inlined():
    inner = jax.jit(lambda p, x: jnp.tanh(x @ p["a"]) @ p["b"])
    all_schemes(lambda p, x: jnp.sum(inner(p, x) ** 2), rule="dot_general")


def test_remat_is_kept_and_narrowed():
    f = jax.checkpoint(lambda p, x: jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]))
    loss = lambda p, x: jnp.sum(f(p, x) ** 2)
    all_schemes(loss, rule="remat2")
    info = pj.sparse_grad(loss, SCHEMES[0]).explain(P, X)
    remats = [e for e in info.jaxpr.jaxpr.eqns if e.primitive.name == "remat2"]
    assert remats and remats[0].params["differentiated"]
    # The weight gradient inside the remat body is the narrowed one.
    shapes = [tuple(v.aval.shape) for e in remats for se in e.params["jaxpr"].eqns
              if se.primitive.name == "dot_general" for v in se.outvars]
    assert (4, 8) in shapes or (8, 4) in shapes  # dW of "a" for its 4 kept columns only


def test_cond_branches():
    loss = lambda p, x: jnp.sum((lax.cond(x.sum() > 0, lambda h: jnp.tanh(h @ p["a"]),
                                          lambda h: jnp.sin(h @ p["a"]), x) @ p["b"]) ** 2)
    all_schemes(loss, rule="cond")
    all_schemes(lambda p, x: loss(p, -x))


def test_while_on_the_primal_path():
    def loss(p, x):
        n = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 1.1), (0, x))[1]
        return jnp.sum(jnp.tanh(n @ p["a"]) @ p["b"])
    all_schemes(loss)
    assert "while" in _prims(pj.sparse_grad(loss, SCHEMES[0]).explain(P, X).jaxpr.jaxpr)


def test_custom_jvp():
    loss = lambda p, x: jnp.sum(jax.nn.relu(x @ p["a"]) @ p["b"] ** 2) + jnp.sum(jax.nn.softplus(x @ p["a"]))
    all_schemes(loss)


def test_custom_vjp():
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)
    f.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (2.0 * g * c,))  # deliberately not the true grad
    loss = lambda p, x: jnp.sum(f(x @ p["a"]) @ p["b"])
    all_schemes(loss)


# -- scan over stacked per-layer weights -----------------------------------------------

L, D = 6, 16
WS = jax.random.normal(K[3], (L, D, D)) / np.sqrt(D)
XS = jax.random.normal(K[4], (4, D))


def scanned(W, x, unroll=1):
    x, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, W, unroll=unroll)
    return jnp.mean(x ** 2)


def test_scan_channels_inside_the_body():
    for axis in (1, 2):  # in, out of stacked [layers, in, out] (a rank-3 weight takes int axes)
        info = assert_matches_dense(scanned, pj.Scheme({"*": pj.Channels(ratio=0.25, axis=axis)}), WS, XS)
        assert info.rules.get("scan") and not info.fallbacks


def test_scan_split_for_trained_last_layers():
    s = pj.Scheme({"*": pj.Channels(count=2, axis=0, last=True)})
    info = assert_matches_dense(scanned, s, WS, XS)
    assert info.scans_split == 1
    # The frozen prefix of 4 layers runs forward only: one backward scan, over 2 layers.
    scans = [e for e in info.jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert sorted(e.params["length"] for e in scans) == [2, 2, 4]
    assert sum(e.params["reverse"] for e in scans) == 1


def test_scan_split_frozen_layers_do_no_weight_gradient_work():
    # Only layers 0..1 train: the backward runs through all layers (the carry depends on
    # trained layers) but only two layers compute a weight gradient.
    s = pj.Scheme({"*": pj.Channels(count=2, axis=0)})
    assert_matches_dense(scanned, s, WS, XS)
    unrolled = lambda W, x: scanned(W, x, unroll=True)
    sparse = flops(pj.sparse_grad(unrolled, s), WS, XS)
    dense = flops(jax.grad(unrolled), WS, XS)
    # forward 6 + activation cotangents 5 + weight grads 2 matmuls, against 6 + 5 + 6 for dense.
    assert sparse < dense * (13.5 / 17)


def test_scan_with_shared_weight_carry_falls_back_correctly():
    def loss(p, x):
        h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ p["w"]), None), x, None, length=3)
        return jnp.sum(h ** 2)
    p = {"w": WS[0]}
    info = assert_matches_dense(loss, pj.Scheme({"w": pj.Channels(count=4)}), p, XS)
    assert info.fallbacks.get("scan") == 1
