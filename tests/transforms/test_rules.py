"""One test per push-down rule: the gradient matches dense jax.grad and the rule ran."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

import pockjax as pj
from pockjax.transforms import pushdown
from tests.helpers import assert_matches_dense

K = jax.random.split(jax.random.PRNGKey(0), 8)
X = jax.random.normal(K[0], (4, 8))
W = {"a": jax.random.normal(K[1], (8, 8)) / 3, "b": jax.random.normal(K[2], (8, 8)) / 3}


def check(loss, scheme, params, *args, rule, **kw):
    info = assert_matches_dense(loss, scheme, params, *args, **kw)
    assert info.rules.get(rule, 0) >= 1, f"{rule} not applied: {info.rules}"
    return info


def test_transpose_and_dot_general():
    check(lambda p, x: jnp.sum(jnp.tanh(x @ p["a"]) ** 2), pj.Scheme({"a": pj.Channels(count=3)}), W, X,
          rule="transpose")


def test_dot_general_batch_dims():
    Wb = {"w": jax.random.normal(K[3], (3, 8, 5))}
    xb = jax.random.normal(K[4], (3, 4, 8))
    loss = lambda p, x: jnp.sum(jnp.tanh(jnp.einsum("bti,bio->bto", x, p["w"])) ** 2)
    info = check(loss, pj.Scheme({"w": pj.Channels(count=2, axis=0)}), Wb, xb, rule="dot_general")
    assert not info.fallbacks


def test_convert_element_type_neg_scalar_mul():
    loss = lambda p, x: jnp.sum(jnp.tanh(-(x.astype(jnp.bfloat16) @ p["a"].astype(jnp.bfloat16))
                                         .astype(jnp.float32) * 0.5))
    for rule in ("convert_element_type", "neg", "mul"):
        check(loss, pj.Scheme({"a": pj.Channels(count=2)}), W, X, rule=rule, rtol=2e-2)


def test_reshape_keeping_the_axis():
    xs = jax.random.normal(K[5], (2, 3, 8))
    loss = lambda p, x: jnp.sum(jnp.tanh((x.reshape(6, 8) @ p["a"]).reshape(2, 3, 8)) ** 2)
    check(loss, pj.Scheme({"a": pj.Channels(count=3, axis="out")}), W, xs, rule="reshape")


def test_add_any_from_weight_tying():
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["a"]) @ p["a"].T)
    check(loss, pj.Scheme({"a": pj.Channels(count=2, axis="out")}), W, X, rule="add_any")


def conv(x, w, groups=1):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


XI = jax.random.normal(K[6], (2, 6, 6, 8))
CP = {"pw": jax.random.normal(K[1], (1, 1, 8, 8)) / 3, "dw": jax.random.normal(K[2], (3, 3, 1, 8)) / 3,
      "g": jax.random.normal(K[3], (3, 3, 2, 8)) / 4}


def cnn(p, x):
    h = jax.nn.relu(conv(x, p["pw"]))
    h = jnp.tanh(conv(h, p["dw"], 8))
    return jnp.sum(jnp.tanh(conv(h, p["g"], 4)) ** 2)


@pytest.mark.parametrize("scheme", [
    pj.Scheme({"pw": pj.Channels(count=2, axis="out")}),
    pj.Scheme({"pw": pj.Channels(count=3, axis="in")}),
    pj.Scheme({"dw": pj.Channels(count=2, axis="out")}),            # depth-wise: whole groups
    pj.Scheme({"g": pj.Channels(count=4, axis="out", last=True)}),  # grouped: 2 of 4 groups
], ids=["out", "in", "depthwise", "grouped"])
def test_conv_general_dilated(scheme):
    check(cnn, scheme, CP, XI, rule="conv_general_dilated")


def test_conv_partial_group_falls_back_correctly():
    info = assert_matches_dense(cnn, pj.Scheme({"g": pj.Channels(count=3, axis="out")}), CP, XI)
    assert info.fallbacks.get("conv_general_dilated") == 1


WS = jax.random.normal(K[7], (4, 8, 8)) / 3


def stacked_static(W, x):
    for i in range(4):
        x = jnp.tanh(x @ W[i])
    return jnp.sum(x ** 2)


def stacked_dynamic(W, x):
    for i in range(4):
        x = jnp.tanh(x @ lax.dynamic_index_in_dim(W, jnp.int32(i), keepdims=False))
    return jnp.sum(x ** 2)


def test_pad_from_static_indexing_of_a_stacked_weight():
    info = check(stacked_static, pj.Scheme({"*": pj.Channels(count=1, axis=0, last=True)}), WS, X, rule="pad")
    # Frozen layers' weight gradients disappear: one backward weight matmul is left.
    dots = [e for e in info.jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 4 + 1  # the forward, and the last layer's weight gradient
    check(stacked_static, pj.Scheme({"*": pj.Channels(count=3, axis="out")}), WS, X, rule="pad")


def test_dynamic_update_slice_from_dynamic_indexing():
    check(stacked_dynamic, pj.Scheme({"*": pj.Channels(count=3, axis="out")}), WS, X,
          rule="dynamic_update_slice")


def test_dynamic_layer_index_falls_back_correctly():
    info = assert_matches_dense(stacked_dynamic, pj.Scheme({"*": pj.Channels(count=1, axis=0)}), WS, X)
    assert info.fallbacks.get("dynamic_update_slice", 0) >= 1


def test_gather_indexing_falls_back_correctly():
    loss = lambda W, x: jnp.sum(jnp.tanh(x @ jnp.take(W, jnp.array(2), axis=0)) ** 2)
    info = assert_matches_dense(loss, pj.Scheme({"*": pj.Channels(count=3, axis="out")}), WS, X)
    assert "scatter-add" in info.fallbacks and "scatter-add" in str(info)


def test_registered_rules_cover_the_listed_primitives():
    for name in ["transpose", "dot_general", "conv_general_dilated", "reshape", "convert_element_type",
                 "neg", "mul", "add_any", "pad", "slice", "split", "squeeze", "broadcast_in_dim",
                 "reduce_sum", "concatenate", "dynamic_slice", "dynamic_update_slice"]:
        assert name in pushdown.RULES


def test_reshape_groups_helpers():
    assert pushdown._box_to_flat(((1, 2), (0, 4)), (3, 4)) == (4, 8)
    assert pushdown._box_to_flat(((0, 3), (0, 2)), (3, 4)) is None
    assert pushdown._flat_to_box(4, 8, (12,)) == ((4, 8),)
    assert pushdown._flat_to_box(4, 8, (3, 4)) == ((1, 2), (0, 4))
    assert pushdown._flat_to_box(2, 6, (3, 4)) is None
