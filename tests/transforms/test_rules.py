"""One test per push-down rule: the gradient matches dense jax.grad and the rule ran."""
import dataclasses

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import pytest
from jax import lax

import pockjax as pj
from pockjax._src.jaxpr import is_var, var_shape
from pockjax.transforms import _rules_elementwise, _rules_layout, pushdown
from pockjax.transforms.convolutions import convolutions_kept
from tests.helpers import assert_matches_dense, assert_trees_close, flops


@pytest.fixture(autouse=True)
def _xla_convolutions():
    """The push-down rules are tested on the convolutions JAX writes: `sparse_grad`'s
    rewrite of depth-wise and 1x1 ones (tests/transforms/test_convolutions.py) would
    leave the convolution rule nothing to do here."""
    with convolutions_kept():
        yield

K = jax.random.split(jax.random.PRNGKey(0), 8)
X = jax.random.normal(K[0], (4, 8))
W = {"a": jax.random.normal(K[1], (8, 8)) / 3, "b": jax.random.normal(K[2], (8, 8)) / 3}


def check(loss, scheme, params, *args, rule, **kw):
    info = assert_matches_dense(loss, scheme, params, *args, **kw)
    assert info.rules.get(rule, 0) >= 1, f"{rule} not applied: {info.rules}"
    # A rule that declines is counted as a fallback: catch that here.
    assert rule not in info.fallbacks, f"{rule} fell back: {info.fallbacks} ({info.fallback_sources})"
    return info


def sparse_flops(loss, scheme, params, *args):
    return flops(pj.sparse_grad(loss, scheme), params, *args)


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


def test_reshape_widens_a_spatial_window_and_keeps_channels_narrowed():
    # A 1x1 convolution as [N*H*W, C] @ [C, O] reshaped back to NHWC: a spatial window
    # of the result with 3 channels is not one box of the [N*H*W, O] product, so the
    # rule widens it to all positions and keeps the channels narrowed.
    eqn, = jax.make_jaxpr(lambda y: y.reshape(2, 5, 5, 8))(jnp.zeros((50, 8))).jaxpr.eqns
    rule = pushdown.RULES[lax.reshape_p]
    window = ((0, 2), (1, 4), (1, 4), (0, 3))
    assert isinstance(rule.pull(eqn, 0, window), pushdown.Decline)
    plan = rule(eqn, [(0, window)], None)
    assert isinstance(plan, pushdown.Narrowed), plan
    (key, needs), = plan.pulled.items()
    assert key == (0, ((0, 2), (0, 5), (0, 5), (0, 3)))
    assert needs == [(eqn.invars[0], ((0, 50), (0, 3)))]
    # a box the operand has is not widened
    assert rule(eqn, [(0, ((1, 2), (0, 5), (0, 5), (2, 7)))], None).pulled == {
        (0, ((1, 2), (0, 5), (0, 5), (2, 7))): [(eqn.invars[0], ((25, 50), (2, 7)))]}


def _shifted_windows(p, x):
    """relu, pad, then the 9 shifted windows of a 3x3 depth-wise filter, summed."""
    h = jax.nn.relu(x @ p["a"])
    hp = jnp.pad(h.reshape(2, 4, 4, 8), ((0, 0), (1, 1), (1, 1), (0, 0)))
    y = sum(lax.slice(hp, (0, i, j, 0), (2, i + 4, j + 4, 8)) * p["dw"][i, j]
            for i in range(3) for j in range(3))
    return jnp.sum(jnp.tanh(y) ** 2)


def test_boxes_covering_an_output_compute_it_whole():
    # The 9 windows together want 9 x 16 of the padded image's 36 positions per channel:
    # computed box by box they would pad and recompute most of it 4 times over.
    params = {"a": W["a"], "dw": jax.random.normal(K[3], (3, 3, 8)) / 3}
    x = jax.random.normal(K[4], (32, 8)).at[0].set(0.0)
    info = assert_matches_dense(_shifted_windows, pj.Scheme(default=pj.Full()), params, x)
    assert not info.rules, str(info)  # nothing to narrow: the windows cover the image
    assert_matches_dense(_shifted_windows, pj.Scheme({"a": pj.Channels(count=3, axis="out")},
                                                     default=pj.Full()), params, x)
    # one window alone is narrowed as before
    one = lambda p, x: jnp.sum(jnp.tanh(lax.slice(jnp.pad(jax.nn.relu(x @ p["a"]), 1),
                                                  (1, 1), (3, 9))) ** 2)
    check(one, pj.Scheme({"a": pj.Full()}), {"a": W["a"]}, x, rule="pad")


def test_merged_boxes_the_rule_cannot_pull_are_pulled_one_by_one():
    # [2, 6] -> [12], wanted [3:6] and [6:9]: each is one row's box of the operand and
    # together they fill their bounding box [3:9], which crosses a row (no box of [2, 6]).
    eqn, = jax.make_jaxpr(lambda y: y.reshape(12))(jnp.zeros((2, 6))).jaxpr.eqns
    plan = pushdown.RULES[lax.reshape_p](eqn, [(0, ((3, 6),)), (0, ((6, 9),))], None)
    assert isinstance(plan, pushdown.Narrowed), plan
    assert plan.pulled == {(0, ((3, 6),)): [(eqn.invars[0], ((0, 1), (3, 6)))],
                           (0, ((6, 9),)): [(eqn.invars[0], ((1, 2), (0, 3)))]}


def test_add_any_from_weight_tying():
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["a"]) @ p["a"].T)
    check(loss, pj.Scheme({"a": pj.Channels(count=2, axis="out")}), W, X, rule="add_any")


def conv(x, w, groups=1):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


XI = jax.random.normal(K[6], (2, 6, 6, 8))
CP = {"pw": jax.random.normal(K[1], (1, 1, 8, 8)) / 3, "dw": jax.random.normal(K[2], (3, 3, 1, 8)) / 3,
      "g": jax.random.normal(K[3], (3, 3, 2, 8)) / 4}

POOL = {"pw": CP["pw"], "c": jax.random.normal(K[4], (3, 3, 8, 4)) / 6}


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


def test_conv_partial_group_widens_to_whole_groups():
    # 3 of 8 output channels in groups of 2: the first 2 groups are computed, 3 sliced out.
    info = check(cnn, pj.Scheme({"g": pj.Channels(count=3, axis="out")}), CP, XI, rule="conv_general_dilated")
    assert not info.fallbacks
    weight_grads = [e.outvars[0].aval.shape for e in info.jaxpr.jaxpr.eqns
                    if e.primitive.name == "conv_general_dilated" and e.params["batch_group_count"] > 1]
    assert weight_grads == [(3, 3, 2, 4)]  # of [3, 3, 2, 8]


def strided_shifts_cnn(p, x):
    """A stride-2 depth-wise 3x3 as nine shifted, strided slices (as MobileNetV2 computes it)."""
    h = jax.nn.relu(conv(x, p["pw"]))
    n, hh, ww, c = h.shape
    hp = jnp.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0)))
    y = sum(lax.slice(hp, (0, i, j, 0), (n, i + hh - 1, j + ww - 1, c), (1, 2, 2, 1)) * p["dw"][i, j]
            for i in range(3) for j in range(3))
    return jnp.mean(jnp.tanh(conv(jax.nn.relu(y), p["c"])) ** 2)


@pytest.mark.parametrize("decision", [pj.Channels(count=3, axis="out"), pj.Channels(count=2, axis="out", last=True)],
                         ids=["first", "last"])
def test_pad_with_interior_and_conv_with_a_partial_spatial_box(decision):
    # The slices' transposes pad with interior zeros; the crop of the padding asks them for
    # rows 1..H: from some slices' cotangents only rows 1.. are read, and the conv producing
    # them widens that box to all rows (its kept channels only).
    params = {"pw": CP["pw"], "dw": jax.random.normal(K[5], (3, 3, 8)) / 3, "c": POOL["c"]}
    info = check(strided_shifts_cnn, pj.Scheme({"pw": decision}), params, XI.at[1, 2:].set(0.0), rule="pad")
    assert not info.fallbacks
    assert info.rules.get("conv_general_dilated", 0) >= 2


@pytest.mark.parametrize("cfg", [(2, 1, 1), (-1, 2, 2), (1, -2, 1), (0, 0, 3), (-1, -1, 1), (-1, -1, 0)])
def test_pad_every_box(cfg):
    # Every box of the output of a pad (crops, interior padding), against slicing it whole.
    x = jnp.arange(1.0, 4.0)
    closed = jax.make_jaxpr(lambda x: lax.pad(x, -1.0, [cfg]))(x)
    whole = lax.pad(x, -1.0, [cfg])
    for s in range(whole.shape[0]):
        for e in range(s + 1, whole.shape[0] + 1):
            new = pushdown.rewrite(closed, [[((s, e),)]])
            assert jnp.array_equal(jex.jaxpr_as_fun(new)(x)[0], whole[s:e]), (s, e)


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
    check(stacked_static, pj.Scheme({"*": pj.Channels(count=3, axis=2)}), WS, X, rule="pad")


def test_dynamic_update_slice_from_dynamic_indexing():
    check(stacked_dynamic, pj.Scheme({"*": pj.Channels(count=3, axis=2)}), WS, X,
          rule="dynamic_update_slice")


def test_dynamic_layer_index_falls_back_correctly():
    info = assert_matches_dense(stacked_dynamic, pj.Scheme({"*": pj.Channels(count=1, axis=0)}), WS, X)
    assert info.fallbacks.get("dynamic_update_slice", 0) >= 1


def test_gather_indexing_falls_back_correctly():
    # The kept slice is on the indexed axis: the scatter-add of the gradient cannot narrow.
    loss = lambda W, x: jnp.sum(jnp.tanh(x @ jnp.take(W, jnp.array(2), axis=0)) ** 2)
    info = assert_matches_dense(loss, pj.Scheme({"*": pj.Channels(count=1, axis=0, last=True)}), WS, X)
    assert "scatter-add" in info.fallbacks and "scatter-add" in str(info)


def test_registered_rules_cover_the_listed_primitives():
    for name in ["transpose", "dot_general", "conv_general_dilated", "reshape", "convert_element_type",
                 "neg", "mul", "add_any", "pad", "slice", "split", "squeeze", "broadcast_in_dim",
                 "reduce_sum", "concatenate", "dynamic_slice", "dynamic_update_slice", "scatter-add",
                 "rev", "reduce_window_sum"]:
        assert name in {p.name for p in pushdown.RULES}


def test_the_rule_table_holds_every_rules_modules_rules():
    # The rules live in several modules, each registering into the one table when it is
    # imported; pushdown imports them all. A module left out would lose its rules silently.
    others = {"transpose", "squeeze", "rev", "reshape", "broadcast_in_dim", "reduce_sum", "reduce_max",
              "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_window_sum", "slice", "split",
              "unstack", "stack", "concatenate", "pad", "dynamic_slice", "dynamic_update_slice",
              "scatter-add", "dot_general", "conv_general_dilated", "scan", "remat2", "cond", "while",
              "custom_jvp_call", "custom_vjp_call"}
    assert {p.name for p in pushdown.RULES} == {p.name for p in pushdown.ELEMENTWISE} | others
    assert len(pushdown.RULES) == len(pushdown.ELEMENTWISE) + len(others) == 94
    homes = {getattr(rule, "pull", rule).__module__ for rule in pushdown.RULES.values()}
    assert homes == {m.__name__ for m in pushdown._RULE_MODULES}


def test_reshape_groups_helpers():
    assert _rules_layout._box_to_flat(((1, 2), (0, 4)), (3, 4)) == (4, 8)
    assert _rules_layout._box_to_flat(((0, 3), (0, 2)), (3, 4)) is None
    assert _rules_layout._flat_to_box(4, 8, (12,)) == ((4, 8),)
    assert _rules_layout._flat_to_box(4, 8, (3, 4)) == ((1, 2), (0, 4))
    assert _rules_layout._flat_to_box(2, 6, (3, 4)) is None


# -- scatter-add: the gradient of an embedding lookup ------------------------------

VOCAB, DIM = 16, 8
# Token ids hit the first and last rows and repeat (the scatter adds up duplicates).
TOKENS = jnp.array([[0, 3, 3, 15, 7, 0], [15, 15, 2, 9, 0, 3]])
EMB = {"embed": jax.random.normal(K[0], (VOCAB, DIM)).at[3].set(0.0).at[:, 5].set(0.0),  # exact zeros
       "head": jax.random.normal(K[1], (DIM, VOCAB)) / 3}


def embedding_lm(p, tokens, mode=None):
    h = jnp.take(p["embed"], tokens, axis=0, mode=mode)
    h = h + jnp.tanh(h @ p["embed"].T) @ p["embed"] / VOCAB  # tied weights: a second use
    return -jnp.mean(jax.nn.log_softmax(h @ p["head"])[..., 1])


@pytest.mark.parametrize("decision", [pj.Channels(count=3, axis="out"),
                                      pj.Channels(count=2, axis="out", last=True)],
                         ids=["first", "last"])
def test_scatter_add_from_an_embedding_lookup(decision):
    check(embedding_lm, pj.Scheme({"embed": decision, "head": pj.Full()}), EMB, TOKENS, rule="scatter-add")


@pytest.mark.parametrize("mode", ["fill", "clip"])
def test_scatter_add_out_of_range_tokens(mode):
    # Ids past the table: "fill" drops their update, "clip" adds it to the last row.
    tokens = TOKENS.at[0, 1].set(VOCAB + 4).at[1, 0].set(-1)
    loss = lambda p, t: embedding_lm(p, t, mode)
    check(loss, pj.Scheme({"embed": pj.Channels(count=3, axis="out", last=True)}), EMB, tokens,
          rule="scatter-add")


def test_scatter_add_on_the_indexed_axis_falls_back_correctly():
    info = assert_matches_dense(embedding_lm, pj.Scheme({"embed": pj.Channels(count=4, axis="in")}),
                                EMB, TOKENS)
    assert info.fallbacks.get("scatter-add") == 1


def test_scatter_add_of_a_stacked_weight_keeps_the_window_axes():
    loss = lambda W, x: jnp.sum(jnp.tanh(x @ jnp.take(W, jnp.array(2), axis=0)) ** 2)
    for d in (pj.Channels(count=3, axis=2), pj.Channels(count=2, axis=1, last=True)):
        check(loss, pj.Scheme({"*": d}), WS, X, rule="scatter-add")


def test_scatter_add_rule_cuts_flops(monkeypatch):
    vocab, dim = 256, 64
    k = jax.random.split(K[2], 4)
    params = {"embed": jax.random.normal(k[0], (vocab, dim)) / 8, "up": jax.random.normal(k[1], (dim, 4 * dim)) / 8,
              "down": jax.random.normal(k[2], (4 * dim, dim)) / 16}
    tokens = jax.random.randint(k[3], (4, 32), 0, vocab)

    def lm(p, tokens):
        h = p["embed"][tokens]
        h = h + jax.nn.gelu(h @ p["up"]) @ p["down"]
        return -jnp.mean(jax.nn.log_softmax(h @ p["embed"].T)[..., 0])

    scheme = pj.Scheme({"embed": pj.Channels(count=8, axis="out")})
    with_rule = sparse_flops(lm, scheme, params, tokens)
    monkeypatch.delitem(pushdown.RULES, lax.scatter_add_p)
    without = sparse_flops(lm, scheme, params, tokens)
    assert with_rule < 0.95 * without, (with_rule, without)


# -- elementwise ops with a size-1 (keepdims) operand ---------------------------------


def standardise(w):
    mean = w.mean(axis=(0, 1, 2), keepdims=True)  # [1, 1, 1, out]
    return (w - mean) * lax.rsqrt(w.var(axis=(0, 1, 2), keepdims=True) + 1e-5)


WSP = {"a": jax.random.normal(K[4], (3, 3, 8, 6)).at[..., 2].set(0.0),  # a channel of exact zeros: std 0
       "b": jax.random.normal(K[5], (3, 3, 6, 4))}
XWS = jax.random.normal(K[6], (2, 6, 6, 8)).at[0, :2].set(0.0)


def weight_standardised_cnn(p, x):
    h = jax.nn.relu(conv(x, standardise(p["a"])))
    return jnp.mean(jnp.tanh(conv(h, standardise(p["b"]))) ** 2)


@pytest.mark.parametrize("decision", [pj.Channels(count=2, axis="out"),
                                      pj.Channels(count=2, axis="out", last=True)],
                         ids=["first", "last"])
def test_elementwise_with_a_keepdims_operand(decision):
    # e.g. `mul f32[3,3,8,6], f32[1,1,1,6]`: the size-1 dims keep their whole (0, 1) box.
    info = check(weight_standardised_cnn, pj.Scheme({"a": decision}), WSP, XWS, rule="mul")
    kept = pj.trainable_view(WSP, pj.Scheme({"a": decision}))["a"].shape
    narrowed = [tuple(v.aval.shape for v in e.invars) for e in info.jaxpr.jaxpr.eqns
                if e.primitive.name == "mul" and e.outvars[0].aval.shape == kept]
    assert ((1, 1, 1, kept[3]), kept) in narrowed or (kept, (1, 1, 1, kept[3])) in narrowed, narrowed


@pytest.mark.parametrize("decision", [pj.Channels(count=3, axis="in"), pj.Channels(count=1, axis=0, last=True)],
                         ids=["in", "kernel-row"])
def test_elementwise_with_a_keepdims_operand_across_the_statistics(decision):
    # The kept slice lies along the reduced axes: the statistics' gradients need all of it.
    info = assert_matches_dense(weight_standardised_cnn, pj.Scheme({"a": decision}), WSP, XWS)
    assert not info.fallbacks


def test_elementwise_with_a_keepdims_operand_cuts_flops(monkeypatch):
    scheme = pj.Scheme({"a": pj.Channels(count=2, axis="out"), "b": pj.Channels(count=1, axis="out")})
    with_rule = sparse_flops(weight_standardised_cnn, scheme, WSP, XWS)
    plain = _rules_elementwise._elementwise_pull

    def no_broadcast(eqn, i, box):  # the rule as it was: operands of the output's shape only
        out = var_shape(eqn.outvars[0])
        if any(is_var(v) and var_shape(v) not in ((), out) for v in eqn.invars):
            return pushdown.Decline("an operand of another shape")
        return plain(eqn, i, box)

    for p in pushdown.ELEMENTWISE:
        monkeypatch.setitem(pushdown.RULES, p, dataclasses.replace(pushdown.RULES[p], pull=no_broadcast))
    assert with_rule < 0.8 * sparse_flops(weight_standardised_cnn, scheme, WSP, XWS)


def test_rms_norm_after_a_narrowed_matmul():
    def loss(p, x):
        h = x @ p["a"]
        h = h / jnp.sqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)  # [4, 8] / [4, 1]
        return jnp.sum(jnp.tanh(h @ p["b"]) ** 2)
    for d in (pj.Channels(count=3, axis="out"), pj.Channels(count=3, axis="out", last=True)):
        check(loss, pj.Scheme({"a": d}), W, X.at[1].set(0.0), rule="div")


# -- rev --------------------------------------------------------------------------------


def test_rev_along_the_kept_axis():
    # jnp.flip of the narrowed axis: the last columns of the gradient are the first of the flip.
    loss = lambda p, x: jnp.sum(jnp.tanh(jnp.flip(jnp.tanh(x @ p["a"]), -1) @ p["b"]) ** 2)
    for d in (pj.Channels(count=3, axis="out"), pj.Channels(count=2, axis="out", last=True)):
        info = check(loss, pj.Scheme({"a": d}), W, X.at[0].set(0.0), rule="rev")
        revs = sorted(e.outvars[0].aval.shape for e in info.jaxpr.jaxpr.eqns if e.primitive.name == "rev")
        assert revs == [(4, d.count), (4, 8)]  # the backward's, narrowed; the forward's


CT = {"a": jax.random.normal(K[1], (3, 3, 4, 8)) / 6, "t": jax.random.normal(K[2], (4, 4, 8, 6)) / 8}
XCT = jax.random.normal(K[3], (2, 5, 5, 4)).at[1].set(0.0)


@pytest.mark.parametrize("transpose_kernel", [False, True])
@pytest.mark.parametrize("decision", [pj.Channels(count=3, axis="out"), pj.Channels(count=2, axis="out", last=True)],
                         ids=["first", "last"])
def test_rev_in_the_backward_of_conv_transpose(transpose_kernel, decision):
    def loss(p, x):
        h = jax.nn.relu(conv(x, p["a"]))
        t = jnp.swapaxes(p["t"], 2, 3) if transpose_kernel else p["t"]
        y = lax.conv_transpose(h, t, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                               transpose_kernel=transpose_kernel)
        return jnp.mean(jnp.tanh(y) ** 2)
    info = check(loss, pj.Scheme({"a": decision}), CT, XCT, rule="rev")
    assert not info.fallbacks


# -- reduce_window_sum (average pooling) and interior padding -----------------------------


def avg_pool(x, padding="VALID", stride=2):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, stride, stride, 1), padding) / 4


def pooled_cnn(p, x, padding="VALID", stride=2):
    h = avg_pool(jax.nn.relu(conv(x, p["pw"])), padding, stride)
    return jnp.mean(jnp.tanh(conv(h, p["c"])) ** 2)


@pytest.mark.parametrize("padding,stride", [("VALID", 2), ("SAME", 1)])
@pytest.mark.parametrize("decision", [pj.Channels(count=2, axis="out"), pj.Channels(count=3, axis="out", last=True)],
                         ids=["first", "last"])
def test_reduce_window_sum_over_channels(padding, stride, decision):
    info = check(lambda p, x: pooled_cnn(p, x, padding, stride), pj.Scheme({"pw": decision}), POOL,
                 XI.at[0, :, :, 1].set(0.0), rule="reduce_window_sum")
    assert not info.fallbacks
    if stride > 1:  # the pool's transpose pads with interior zeros on the spatial dims
        assert info.rules.get("pad", 0) >= 1


def test_reduce_window_over_the_kept_axis_falls_back_correctly():
    def loss(p, x):  # a window of 2 along the channels themselves
        h = lax.reduce_window(jnp.tanh(x @ p["a"]), 0.0, lax.add, (1, 2), (1, 1), "VALID")
        return jnp.sum(jnp.tanh(h) ** 2)
    info = assert_matches_dense(loss, pj.Scheme({"a": pj.Channels(count=3, axis="out")}), W, X)
    assert info.fallbacks.get("reduce_window_sum") == 1


def test_reduce_window_sum_rule_cuts_flops(monkeypatch):
    scheme = pj.Scheme({"pw": pj.Channels(count=2, axis="out")})
    with_rule = sparse_flops(pooled_cnn, scheme, POOL, XI)
    monkeypatch.delitem(pushdown.RULES, lax.reduce_window_sum_p)
    assert with_rule < 0.95 * sparse_flops(pooled_cnn, scheme, POOL, XI)


# -- strided slice ----------------------------------------------------------------------


def zero_inserted(h, axis, low=1):
    cfg = [(0, 0, 0)] * h.ndim
    cfg[axis] = (low, 0, 1)
    return lax.pad(h, 0.0, cfg)


@pytest.mark.parametrize("decision", [pj.Channels(count=3, axis="out"), pj.Channels(count=2, axis="out", last=True)],
                         ids=["first", "last"])
def test_strided_slice_along_the_kept_axis(decision):
    # Zero insertion along the columns: its transpose is slice(start=1, stride=2) of them.
    loss = lambda p, x: jnp.sum(jnp.tanh(jnp.tanh(zero_inserted(x @ p["a"], 1)) @ jnp.tile(p["b"], (2, 1))) ** 2)
    check(loss, pj.Scheme({"a": decision}), W, X.at[2].set(0.0), rule="slice")


@pytest.mark.parametrize("decision", [pj.Channels(count=3, axis="out"), pj.Channels(count=2, axis="out", last=True)],
                         ids=["first", "last"])
def test_strided_slice_across_the_kept_axis(decision):
    # Zero-insertion upsampling of the spatial dims: strides there, the box on the channels.
    loss = lambda p, x: jnp.mean(jnp.tanh(conv(zero_inserted(zero_inserted(
        jax.nn.relu(conv(x, p["pw"])), 1, 0), 2, 0), p["c"])) ** 2)
    info = check(loss, pj.Scheme({"pw": decision}), POOL, XI, rule="slice")
    assert not info.fallbacks


def test_strided_slices_taken_whole_keep_their_operand_whole():
    # Pixel unshuffle: x[:, 0::2] and x[:, 1::2] of one tanh. Narrowing each to the rows it
    # reads would compute the tanh twice over overlapping boxes; it is computed once.
    x = jnp.arange(12.0).reshape(3, 4) / 10
    unshuffle = lambda t: t[:, 0::2] * t[:, 1::2]
    new = pushdown.rewrite(jax.make_jaxpr(lambda x: unshuffle(jnp.tanh(x)))(x), None, pushdown.Stats())
    assert [e.outvars[0].aval.shape for e in new.jaxpr.eqns if e.primitive.name == "tanh"] == [(3, 4)]
    assert jnp.array_equal(jex.jaxpr_as_fun(new)(x)[0], unshuffle(jnp.tanh(x)))
    # A box that narrows the strided dim composes with start and stride.
    closed = jax.make_jaxpr(lambda x: jnp.tanh(x)[:, 1::2])(x)
    new = pushdown.rewrite(closed, [[((0, 3), (1, 2))]], pushdown.Stats())
    assert [e.outvars[0].aval.shape for e in new.jaxpr.eqns if e.primitive.name == "tanh"] == [(3, 1)]
    assert jnp.array_equal(jex.jaxpr_as_fun(new)(x)[0], jnp.tanh(x)[:, 3:4])


# -- the rule table ------------------------------------------------------------------------


def test_a_rule_that_raises_surfaces(monkeypatch):
    def broken(eqn, i, box):
        raise ZeroDivisionError("a bug in a rule")

    monkeypatch.setitem(pushdown.RULES, lax.tanh_p, dataclasses.replace(pushdown.RULES[lax.tanh_p], pull=broken))
    closed = jax.make_jaxpr(lambda x: jnp.tanh(x)[:, :2])(X)
    with pytest.raises(ZeroDivisionError, match="a bug in a rule"):
        pushdown.rewrite(closed)


def test_a_rule_returning_none_is_told_to_decline(monkeypatch):
    monkeypatch.setitem(pushdown.RULES, lax.tanh_p,
                        dataclasses.replace(pushdown.RULES[lax.tanh_p], pull=lambda eqn, i, box: None))
    with pytest.raises(TypeError, match=r"Decline\(reason\)"):
        pushdown.rewrite(jax.make_jaxpr(lambda x: jnp.tanh(x)[:, :2])(X))


def test_a_decline_is_counted_with_its_reason():
    # A window along the narrowed axis: the reduce_window_sum rule declines.
    closed = jax.make_jaxpr(lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2), (1, 1), "VALID")[:, :3])(X)
    stats = pushdown.Stats()
    new = pushdown.rewrite(closed, None, stats)
    assert stats.fallbacks["reduce_window_sum"] == 1
    assert stats.fallback_reasons["reduce_window_sum"] == "dim 1 is narrowed and has a window"
    want = lax.reduce_window(X, 0.0, lax.add, (1, 2), (1, 1), "VALID")[:, :3]
    assert jnp.allclose(jex.jaxpr_as_fun(new)(X)[0], want)


def test_a_primitive_without_a_rule_is_computed_whole_and_counted():
    closed = jax.make_jaxpr(lambda x: jnp.cumsum(x, axis=1)[:, :3])(X)
    stats = pushdown.Stats()
    new = pushdown.rewrite(closed, None, stats)
    assert stats.fallbacks["cumsum"] == 1 and stats.fallback_reasons["cumsum"] == "no push-down rule"
    assert jnp.allclose(jex.jaxpr_as_fun(new)(X)[0], jnp.cumsum(X, axis=1)[:, :3])


def test_register_takes_primitives_not_names():
    with pytest.raises(TypeError, match="jax Primitive objects"):
        pushdown.register("tanh", _rules_elementwise._elementwise_pull, _rules_elementwise._elementwise_apply)


# -- cumulative reductions (lax.associative_scan in their derivatives) ------------------------


@pytest.mark.parametrize("cfg", [(0, 1, 2), (1, 2, 2), (0, 3, 2), (2, 2, 2), (1, 7, 3), (0, 0, 1)],
                         ids=lambda c: "%d:%d:%d" % c)
def test_slice_every_box_including_empty_ones(cfg):
    # associative_scan's recursion takes empty strided slices (x[2::2] of a length-2 axis,
    # after an even-length level), whose start lies past the operand's end: an empty box
    # must map to an empty box inside the operand.
    start, limit, stride = cfg
    x = jnp.arange(1.0, 8.0)[:max(limit, 1)]
    closed = jax.make_jaxpr(lambda x: lax.slice(jnp.tanh(x), (start,), (limit,), (stride,)))(x)
    whole = lax.slice(jnp.tanh(x), (start,), (limit,), (stride,))
    m = whole.shape[0]
    for s in range(m + 1):
        for e in range(s, m + 1):
            new = pushdown.rewrite(closed, [[((s, e),)]])
            assert jnp.array_equal(jex.jaxpr_as_fun(new)(x)[0], whole[s:e]), (s, e)


CUMULATIVE = {"cummax": lax.cummax, "cummin": lax.cummin, "cumprod": lax.cumprod,
              "cumsum": lax.cumsum, "cumlogsumexp": lax.cumlogsumexp}
# Every length 1..9, each scanned along one axis of a [2, L, L] activation: the time axis
# (1) or the weight's output channels (2, narrowed by Channels "out"), so that odd and
# even lengths occur on both. (Each length is a separately compiled associative scan: all
# lengths on both axes would double the test's compile time for no new case.)
CUMULATIVE_AXES = {1: 1, 2: 1, 3: 2, 4: 2, 5: 1, 6: 1, 7: 2, 8: 2, 9: 1}


def _cumulative_data():
    """Per length L a weight [3, L] and an input [2, L, 3]. Exact zeros (a zero input row,
    a zero weight entry) and ties (a repeated time step, a repeated weight column) are the
    hard cases of max, min and prod."""
    params, xs = {}, {}
    for L in CUMULATIVE_AXES:
        kw, kx = jax.random.split(jax.random.fold_in(K[0], L))
        w = jax.random.normal(kw, (3, L)) / 2
        w = w.at[:, L - 1].set(w[:, 0]).at[1, 0].set(0.0)
        x = jax.random.normal(kx, (2, L, 3))
        x = x.at[:, L // 2].set(x[:, 0]).at[1, L - 1].set(0.0)
        params[f"w{L}"], xs[f"x{L}"] = w, x
    return params, xs


def _cumulative_loss(op):
    cum = CUMULATIVE[op]

    def loss(p, xs):
        return sum(jnp.sum(cum(jnp.tanh(xs[f"x{L}"] @ p[f"w{L}"]), axis=axis) ** 2)
                   for L, axis in CUMULATIVE_AXES.items())
    return loss


_DENSE_CUMULATIVE: dict = {}


def _dense_cumulative(op):
    """jax.grad of the op's loss, compiled once for all schemes (the compile dominates)."""
    if op not in _DENSE_CUMULATIVE:
        _DENSE_CUMULATIVE[op] = jax.jit(jax.grad(_cumulative_loss(op)))(*_cumulative_data())
    return _DENSE_CUMULATIVE[op]


@pytest.mark.parametrize("decision", [pj.Full(), pj.Channels(ratio=0.5, axis="out"),
                                      pj.Channels(ratio=0.5, axis="in", last=True)],
                         ids=["full", "out", "in"])
@pytest.mark.parametrize("op", list(CUMULATIVE))
def test_cumulative_every_length(op, decision):
    scheme = pj.Scheme(default=decision)
    params, xs = _cumulative_data()
    got = jax.jit(pj.sparse_grad(_cumulative_loss(op), scheme))(params, xs)
    assert_trees_close(got, pj.trainable_view(_dense_cumulative(op), scheme), rtol=1e-5, atol=1e-5)


def test_cummax_after_a_trained_matmul():
    # The reported case: an even-length scan with a trained weight upstream.
    x = jax.random.normal(K[1], (5, 3)).at[2].set(0.0)
    loss = lambda p, x: jnp.sum(lax.cummax(x @ p["w"], axis=1) ** 2)
    params, scheme = {"w": jax.random.normal(K[2], (3, 8))}, pj.Scheme({"w": pj.Full()})
    assert_trees_close(jax.jit(pj.sparse_grad(loss, scheme))(params, x),
                       pj.trainable_view(jax.jit(jax.grad(loss))(params, x), scheme))
