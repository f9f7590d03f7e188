import json

import jax.numpy as jnp
import pytest

import pockjax as pj

PARAMS = {
    "blocks_0": {"attn": {"q": {"kernel": jnp.zeros((8, 8)), "bias": jnp.zeros(8)}},
                 "mlp": {"up": {"kernel": jnp.zeros((8, 32))}}},
    "blocks_1": {"mlp": {"up": {"kernel": jnp.zeros((8, 32)), "bias": jnp.zeros(32)}}},
    "head": [jnp.zeros((8, 4)), jnp.zeros(())],
    "step": jnp.zeros((), jnp.int32),
}


def decisions(scheme, params=PARAMS):
    from pockjax.scheme import leaves_with_paths
    named, _ = leaves_with_paths(scheme.resolve(params))
    return dict(named)


def test_first_match_wins_and_default():
    s = pj.Scheme({"blocks_1/**": pj.Full(), "**/bias": pj.Channels(count=2, axis=0)})
    d = decisions(s)
    assert d["blocks_1/mlp/up/bias"] == pj.Full()          # first rule wins
    assert d["blocks_0/attn/q/bias"] == pj.Channels(count=2, axis=0)
    assert d["head/0"] == pj.Frozen()


@pytest.mark.parametrize("pattern,path,hit", [
    ("*/mlp/up/kernel", "blocks_0/mlp/up/kernel", True),
    ("*/kernel", "blocks_0/mlp/up/kernel", False),          # * stays in one component
    ("**/kernel", "blocks_0/mlp/up/kernel", True),
    ("**/kernel", "kernel", True),                            # ** matches zero components
    ("blocks_?/**", "blocks_1/mlp/up/bias", True),
    ("blocks_[01]/mlp/**", "blocks_1/mlp/up/bias", True),
    ("blocks_[!0]/mlp/**", "blocks_0/mlp/up/kernel", False),
    ("head/1", "head/1", True),
    ("blocks_0", "blocks_0/attn/q/bias", False),
])
def test_globs(pattern, path, hit):
    assert (pj.Scheme({pattern: pj.Full()}).match(path) == pj.Full()) is hit


def test_channels_resolution_ratio_count_axes():
    s = pj.Scheme({"blocks_0/mlp/up/kernel": pj.Channels(ratio=0.25, axis="out"),
                   "blocks_1/mlp/up/kernel": pj.Channels(ratio=0.3, axis="in", last=True),
                   "head/0": pj.Channels(count=3, axis=1)})
    d = decisions(s)
    assert d["blocks_0/mlp/up/kernel"] == pj.Channels(count=8, axis=1)
    assert d["blocks_1/mlp/up/kernel"] == pj.Channels(count=3, axis=0, last=True)  # ceil(2.4)
    assert d["blocks_1/mlp/up/kernel"].bounds((8, 32)) == (0, 5, 8)
    assert d["head/0"] == pj.Channels(count=3, axis=1)


def test_channels_of_whole_axis_is_full():
    assert decisions(pj.Scheme({"head/0": pj.Channels(ratio=1.0)}))["head/0"] == pj.Full()


def test_json_round_trip():
    s = pj.Scheme({"**/bias": pj.Full(), "a/b": pj.Channels(ratio=0.125, axis="in", last=True),
                   "c": pj.Channels(count=4, axis=2), "d": pj.Frozen()}, default=pj.Full())
    text = s.to_json()
    assert json.loads(text)["version"] == 1
    assert pj.Scheme.from_json(text) == s


def test_bias_only():
    d = decisions(pj.schemes.bias_only())
    assert {p for p, x in d.items() if x == pj.Full()} == {"blocks_0/attn/q/bias", "blocks_1/mlp/up/bias"}


# -- errors ---------------------------------------------------------------------------


def test_unmatched_pattern_lists_nearest_paths():
    with pytest.raises(pj.SchemeError, match=r"'blocks_0/mlp/down/kernel' matched no parameter; "
                                             r"nearest: 'blocks_0/mlp/up/kernel'"):
        pj.Scheme({"blocks_0/mlp/down/kernel": pj.Full()}).resolve(PARAMS)


def test_channels_on_scalar():
    with pytest.raises(pj.SchemeError, match="'head/1' is a scalar"):
        pj.Scheme({"head/1": pj.Channels(count=1, axis=0)}).resolve(PARAMS)


def test_channels_named_axis_on_vector():
    with pytest.raises(pj.SchemeError, match="'blocks_0/attn/q/bias' has shape \\(8,\\), which has no 'in' axis"):
        pj.Scheme({"blocks_0/attn/q/bias": pj.Channels(count=1, axis="in")}).resolve(PARAMS)


@pytest.mark.parametrize("axis", ["in", "out"])
def test_channels_named_axis_on_a_rank_3_kernel_needs_an_int(axis):
    """A DenseGeneral kernel [emb, heads, head_dim]: 'in' would slice the heads axis."""
    params = {"attn": {"query": {"kernel": jnp.zeros((16, 4, 8))}}, "conv": {"kernel": jnp.zeros((3, 3, 4, 8))}}
    with pytest.raises(pj.SchemeError, match=r"'attn/query/kernel' has shape \(16, 4, 8\) \(rank 3\).*"
                                             r"Give the axis as an int"):
        pj.Scheme({"attn/**": pj.Channels(count=2, axis=axis)}).resolve(params)
    # An int axis works there, and named axes keep working on a conv HWIO kernel.
    got = decisions(pj.Scheme({"attn/**": pj.Channels(count=2, axis=0),
                               "conv/**": pj.Channels(count=2, axis=axis)}), params)
    assert got["attn/query/kernel"] == pj.Channels(count=2, axis=0)
    assert got["conv/kernel"] == pj.Channels(count=2, axis=2 if axis == "in" else 3)


def test_channels_axis_out_of_range():
    with pytest.raises(pj.SchemeError, match="axis 2 is out of range"):
        pj.Scheme({"head/0": pj.Channels(count=1, axis=2)}).resolve(PARAMS)


@pytest.mark.parametrize("ratio", [0.0, -0.5, 1.5, float("nan")])
def test_ratio_outside_unit_interval(ratio):
    with pytest.raises(pj.SchemeError, match="ratio must be in \\(0, 1\\]"):
        pj.Channels(ratio=ratio)


def test_ratio_and_count_exclusive():
    with pytest.raises(pj.SchemeError, match="exactly one of ratio= or count="):
        pj.Channels(ratio=0.5, count=3)
    with pytest.raises(pj.SchemeError, match="exactly one of ratio= or count="):
        pj.Channels()


def test_count_larger_than_axis():
    with pytest.raises(pj.SchemeError, match="'head/0' has 4 channels on axis 1.*count=5 is larger"):
        pj.Scheme({"head/0": pj.Channels(count=5, axis="out")}).resolve(PARAMS)


def test_scheme_that_trains_nothing():
    with pytest.raises(pj.SchemeError, match="trains nothing"):
        pj.Scheme({"head/0": pj.Frozen()}).resolve(PARAMS)


def test_integer_leaf_cannot_train():
    with pytest.raises(pj.SchemeError, match="'step' has dtype int32 and cannot train"):
        pj.Scheme({"step": pj.Full()}).resolve(PARAMS)


def test_low_precision_float_leaves_can_train():
    params = {"bf16": jnp.ones(3, jnp.bfloat16), "f16": jnp.ones(3, jnp.float16)}
    assert pj.Scheme(default=pj.Full()).resolve(params) == {"bf16": pj.Full(), "f16": pj.Full()}


def test_bad_decision_and_json():
    with pytest.raises(pj.SchemeError, match="expected pockjax.Full"):
        pj.Scheme({"a": "full"})
    with pytest.raises(pj.SchemeError, match="does not parse"):
        pj.Scheme.from_json("{not json")
    with pytest.raises(pj.SchemeError, match="unknown decision kind 'half'"):
        pj.Scheme.from_json('{"version": 1, "rules": [{"pattern": "a", "decision": {"kind": "half"}}]}')


def test_a_resolved_scheme_is_kept_per_structure_and_sees_new_layouts():
    """`ResolvedScheme` (what a trainer resolves once): the same decisions as
    `Scheme.resolve`, kept per structure, and resolved again when the axes registered
    for the structure change."""
    import jax

    from pockjax.scheme import register_layouts
    from pockjax.view import ResolvedScheme

    params = {"resolved_once_w": jnp.ones((4, 6)), "resolved_once_b": jnp.ones(6)}
    scheme = pj.Scheme({"resolved_once_w": pj.Channels(count=2, axis="in")})
    resolved = ResolvedScheme(scheme)
    first = resolved(params)
    assert first == jax.tree_util.tree_leaves(scheme.resolve(params))
    assert resolved(params) == first and resolved(params) is not first
    assert [d.axis for d in first if isinstance(d, pj.Channels)] == [0]
    register_layouts(params, {"resolved_once_w": {"in": 1, "out": 0}})
    assert [d.axis for d in resolved(params) if isinstance(d, pj.Channels)] == [1]
    wider = {"resolved_once_w": jnp.ones((8, 6)), "resolved_once_b": jnp.ones(6)}
    assert resolved(wider) == jax.tree_util.tree_leaves(scheme.resolve(wider))
