"""MobileNetV2: architecture and paths, a torch reference forward, batch norm, sparse
gradients against dense `jax.grad`, and a short sparse training run."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

import pockjax as pj
from pockjax.models.mobilenetv2 import (INVERTED_RESIDUAL_SETTINGS, ConvBN, MobileNetV2,
                                        blocks_with_expansion, make_divisible)
from tests.helpers import MOBILENETV2_STAGES, assert_matches_dense

WIDTH, SIZE, CLASSES, BATCH = 0.35, 32, 10, 4


def _flat(tree) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
            for path, leaf in leaves}


@functools.lru_cache(maxsize=None)
def _abstract(**kwargs) -> MobileNetV2:
    """Shapes only (`nnx.eval_shape`); shared between tests, which must not modify it."""
    return nnx.eval_shape(lambda: MobileNetV2(rngs=nnx.Rngs(0), **kwargs))


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, params, rest, x):
    """Logits and the module's new non-parameter state, through split/merge."""
    model = pj.nnx.merge(graphdef, params, rest)
    logits = model(x)
    return logits, pj.nnx.split(model)[2]


def _run(model: MobileNetV2, x) -> jax.Array:
    """`model(x)`, compiled, with the state updates written back into `model`."""
    graphdef, params, rest = pj.nnx.split(model)
    logits, rest = _apply(graphdef, params, rest, x)
    nnx.update(model, rest)
    return logits


def _materialize(abstract: MobileNetV2, seed: int = 0) -> MobileNetV2:
    """Values for an abstract model, drawn in numpy as its initialisers draw them (an eager
    init compiles every initialiser shape by shape, which dominates a short test run)."""
    rng = np.random.default_rng(seed)
    graphdef, params, rest = pj.nnx.split(abstract)

    def draw(path, leaf):
        name, shape = path[-1].key, leaf.shape
        if name == "kernel" and len(shape) == 4:  # Kaiming normal, fan out
            value = rng.normal(0, np.sqrt(2.0 / (shape[0] * shape[1] * shape[3])), shape)
        elif name == "kernel":
            value = rng.normal(0, 0.01, shape)
        else:
            value = np.full(shape, 1.0 if name in ("scale", "var") else 0.0)
        return jnp.asarray(value, leaf.dtype)

    params = jax.tree_util.tree_map_with_path(draw, params)
    return pj.nnx.merge(graphdef, params, jax.tree_util.tree_map_with_path(draw, rest))


@pytest.fixture(scope="module")
def model() -> MobileNetV2:
    """A small model in training mode; tests work on `nnx.clone`s of it."""
    return _materialize(_abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=SIZE))


@pytest.fixture(scope="module")
def short_model() -> MobileNetV2:
    """The same, with fewer blocks of the same kinds, for the tests that compile gradients."""
    return _materialize(_abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=SIZE,
                                  settings=MOBILENETV2_STAGES))


@pytest.fixture(scope="module")
def batch():
    k = jax.random.PRNGKey(1)
    x = jax.random.normal(k, (BATCH, SIZE, SIZE, 3))
    y = jax.random.randint(jax.random.fold_in(k, 1), (BATCH,), 0, CLASSES)
    return x, y


# --------------------------------------------------------------------------- architecture


def test_parameter_count_matches_torchvision():
    params = nnx.state(_abstract(), nnx.Param)
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)) == 3_504_872


@pytest.mark.parametrize("width", [0.35, 0.5, 1.0])
@pytest.mark.parametrize("size,feature", [(32, 4), (64, 4), (96, 6), (224, 7)])
def test_output_shapes(width, size, feature):
    abstract = _abstract(num_classes=CLASSES, width_mult=width, input_size=size)
    graphdef, state = nnx.split(abstract)
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)

    logits = jax.eval_shape(lambda state, x: nnx.merge(graphdef, state)(x), state, x)
    assert logits.shape == (2, CLASSES) and logits.dtype == jnp.float32
    assert size // abstract.total_stride == feature


@pytest.mark.parametrize("size,feature", [(32, 4), (64, 4), (96, 6), (100, 7), (224, 7)])
def test_feature_map_is_at_least_4x4(size, feature):
    abstract = _abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=size)
    graphdef, state = nnx.split(abstract)
    x = jax.ShapeDtypeStruct((2, size, size, 3), jnp.float32)
    features = jax.eval_shape(lambda state, x: nnx.merge(graphdef, state).features(x), state, x)
    assert features.shape == (2, feature, feature, 1280)


@pytest.mark.parametrize("size,total_stride", [
    (4, 1), (8, 2), (16, 4), (32, 8), (64, 16), (96, 16), (127, 16), (128, 32), (224, 32)])
def test_small_inputs_drop_the_earliest_strides(size, total_stride):
    m = _abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=size)
    assert m.total_stride == total_stride
    assert size // total_stride >= 4
    # The stride-2 layers in order: stem, then the first block of stages 2, 3, 4 and 6.
    stage_starts = np.cumsum([n for _, _, n, _ in INVERTED_RESIDUAL_SETTINGS])
    firsts = [int(stage_starts[i]) for i in (0, 1, 2, 4)]
    layers = [m.stem.conv.strides[0]] + [m.blocks[i].depthwise.conv.strides[0] for i in firsts]
    halving = int(np.log2(total_stride))
    assert layers == [1] * (5 - halving) + [2] * halving
    others = [b.depthwise.conv.strides[0] for i, b in enumerate(m.blocks) if i not in firsts]
    assert others == [1] * len(others)


def test_parameter_and_batch_stat_paths():
    m = _abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=SIZE)
    expansions = [t for t, _, n, _ in INVERTED_RESIDUAL_SETTINGS for _ in range(n)]
    layers = ["stem", "head"]
    for i, t in enumerate(expansions):
        layers += [f"blocks/{i}/{part}" for part in ("expand", "depthwise", "project")
                   if part != "expand" or t != 1]
    expected = {f"{layer}/conv/kernel" for layer in layers}
    expected |= {f"{layer}/bn/{name}" for layer in layers for name in ("scale", "bias")}
    expected |= {"classifier/kernel", "classifier/bias"}
    assert set(pj.nnx.param_paths(m)) == expected
    assert set(pj.nnx.param_paths(m, nnx.BatchStat)) == {
        f"{layer}/bn/{name}" for layer in layers for name in ("mean", "var")}
    assert len(m.blocks) == 17
    assert blocks_with_expansion() == MobileNetV2.blocks_with_expansion() == tuple(range(1, 17))
    assert all(f"blocks/{i}/expand/conv/kernel" in expected for i in blocks_with_expansion())
    assert "blocks/0/expand/conv/kernel" not in expected
    dw = m.blocks[5].depthwise.conv
    assert dw.kernel.shape == (3, 3, 1, m.blocks[5].expand.conv.out_features)


def test_depthwise_shifts_equal_the_grouped_convolution():
    """The default shifted-slice depth-wise layers compute what grouped convolutions do,
    forward and backward, at stride 1 and 2 (same weights from the same seed). In float64:
    this model's float32 gradients at initialisation are off by up to 1.6% of the largest
    one whichever way the convolution runs (batch norm makes them ill-conditioned)."""
    def loss(m, x):
        y = m(x)
        return jnp.mean(y ** 2), y

    # One compiled program a method: the logits come out of the gradient's forward pass.
    both = nnx.jit(nnx.grad(loss, has_aux=True))
    out = {}
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3), jnp.float64)
        for method in ("shifts", "conv"):
            m = MobileNetV2(CLASSES, width_mult=0.35, input_size=32, depthwise=method,
                            settings=MOBILENETV2_STAGES, rngs=nnx.Rngs(0))
            nnx.update(m, jax.tree_util.tree_map(lambda a: a.astype(jnp.float64),
                                                 nnx.state(m)))
            grads, logits = both(m, x)
            out[method] = (logits, grads)
        assert out["shifts"][0].dtype == jnp.float64
    np.testing.assert_allclose(out["shifts"][0], out["conv"][0], rtol=1e-10, atol=1e-12)
    g_s, g_c = ([np.asarray(g) for g in jax.tree_util.tree_leaves(nnx.to_pure_dict(out[k][1]))]
                for k in ("shifts", "conv"))
    scale = max(float(np.max(np.abs(g))) for g in g_c)
    for a, b in zip(g_s, g_c):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10 * scale)
    with pytest.raises(ValueError, match="'shifts' or 'conv'"):
        MobileNetV2(CLASSES, width_mult=0.35, input_size=32, depthwise="fft", rngs=nnx.Rngs(0))


def test_channel_rounding_follows_torchvision():
    assert [make_divisible(32 * w) for w in (0.35, 0.5, 0.75, 1.0, 1.4)] == [16, 16, 24, 32, 48]
    m = _abstract(num_classes=CLASSES, width_mult=1.4, input_size=SIZE)
    assert m.last_channels == make_divisible(1280 * 1.4) == 1792


def test_conv_bn_initialises_as_torchvision():
    layer = ConvBN(64, 384, rngs=nnx.Rngs(0))  # a 1x1 expand conv
    kernel = np.asarray(layer.conv.kernel[...])
    assert kernel.shape == (1, 1, 64, 384) and layer.conv.bias is None
    np.testing.assert_allclose(kernel.std(), np.sqrt(2.0 / 384), rtol=0.02)  # Kaiming, fan out
    assert abs(kernel.mean()) < 0.05 * kernel.std()
    np.testing.assert_array_equal(layer.bn.scale[...], np.ones(384))
    np.testing.assert_array_equal(layer.bn.bias[...], np.zeros(384))
    assert (layer.bn.momentum, layer.bn.epsilon, layer.bn.use_running_average) == (0.9, 1e-5, False)
    depthwise = ConvBN(96, 96, 3, stride=2, groups=96, rngs=nnx.Rngs(0))
    assert depthwise.conv.kernel.shape == (3, 3, 1, 96)
    assert depthwise.conv.padding == ((1, 1), (1, 1)) and depthwise.conv.strides == (2, 2)
    assert depthwise.conv.feature_group_count == depthwise.conv.in_features == 96


@pytest.mark.parametrize("shape,hint", [
    ((2, 3, SIZE, SIZE), "NCHW"),
    ((SIZE, SIZE, 3), "x[None]"),
    ((2, 64, 64, 3), "input_size=64"),
    ((2, SIZE, SIZE, 1), ""),
    ((2, SIZE * SIZE * 3), ""),
])
def test_wrong_input_shape_names_expected_and_found(model, shape, hint):
    with pytest.raises(ValueError, match=r"expects NHWC inputs of shape \[N, 32, 32, 3\]") as e:
        model(jnp.zeros(shape))
    assert f"found {shape}" in str(e.value) and hint in str(e.value)


@pytest.mark.parametrize("kwargs,match", [
    ({"input_size": 3}, "input_size >= 4"),
    ({"width_mult": 0.0}, "width_mult > 0"),
    ({"dropout": 1.0}, "dropout < 1"),
    ({"settings": ()}, "settings as rows"),
    ({"settings": ((6, 24, 2),)}, r"settings as rows .*got \(\(6, 24, 2\),\)"),
    ({"settings": ((6, 24, 2, 3),)}, r"stride s in \(1, 2\)"),
])
def test_bad_configuration_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _abstract(**kwargs)


def test_fewer_stages_build_a_shallower_network_of_the_same_blocks():
    m = _abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=SIZE,
                  settings=MOBILENETV2_STAGES)
    assert len(m.blocks) == sum(n for _, _, n, _ in MOBILENETV2_STAGES) == 6
    assert blocks_with_expansion(MOBILENETV2_STAGES) == (1, 2, 3, 4, 5)
    assert [b.expand is not None for b in m.blocks] == [False] + [True] * 5
    assert [b.depthwise.conv.strides[0] for b in m.blocks] == [1, 2, 1, 2, 1, 1]
    assert [b.residual for b in m.blocks] == [False, False, True, False, True, False]
    assert m.total_stride == 8
    rules = [p for p, _ in pj.schemes.mobilenetv2(m, last=2, classifier=False).rules]
    assert rules == ["blocks/4/expand/conv/kernel", "blocks/5/expand/conv/kernel"]


# --------------------------------------------------------------------------- torch reference


def _torch_reference(params, stats, x, *, stem_stride: int, stage_strides):
    """MobileNetV2 written out with torch.nn.functional (NCHW, OIHW kernels), eval mode."""
    F = torch.nn.functional
    t = lambda a: torch.from_numpy(np.array(a, np.float32))

    def conv_bn(h, p, s, *, stride=1, depthwise=False, relu6=True):
        w = t(p["conv"]["kernel"]).permute(3, 2, 0, 1)  # HWIO -> OIHW
        h = F.conv2d(h, w, stride=stride, padding=(w.shape[-1] - 1) // 2,
                     groups=h.shape[1] if depthwise else 1)
        h = F.batch_norm(h, t(s["bn"]["mean"]), t(s["bn"]["var"]), t(p["bn"]["scale"]),
                         t(p["bn"]["bias"]), training=False, eps=1e-5)
        return F.relu6(h) if relu6 else h

    h = conv_bn(t(x).permute(0, 3, 1, 2), params["stem"], stats["stem"], stride=stem_stride)
    i = 0
    for (expansion, _, n, _), stride in zip(INVERTED_RESIDUAL_SETTINGS, stage_strides):
        for r in range(n):
            p, s = params["blocks"][i], stats["blocks"][i]
            y = conv_bn(h, p["expand"], s["expand"]) if expansion != 1 else h
            y = conv_bn(y, p["depthwise"], s["depthwise"], stride=stride if r == 0 else 1,
                        depthwise=True)
            y = conv_bn(y, p["project"], s["project"], relu6=False)
            h = h + y if (stride == 1 or r > 0) and y.shape == h.shape else y
            i += 1
    h = conv_bn(h, params["head"], stats["head"]).mean(dim=(2, 3))
    return h @ t(params["classifier"]["kernel"]) + t(params["classifier"]["bias"])


def _randomize_batch_norm(params, rest, seed=0):
    """Non-trivial scale/bias and running statistics, so eval mode has something to use."""
    rng = np.random.default_rng(seed)
    draw = {"scale": lambda s: rng.uniform(0.5, 1.5, s), "bias": lambda s: rng.normal(0, 0.1, s),
            "mean": lambda s: rng.normal(0, 0.1, s), "var": lambda s: rng.uniform(0.5, 2.0, s)}

    def fill(path, leaf):
        name = path[-1].key
        if path[-2].key != "bn":
            return leaf
        return jnp.asarray(draw[name](leaf.shape), leaf.dtype)

    return (jax.tree_util.tree_map_with_path(fill, params),
            jax.tree_util.tree_map_with_path(fill, rest))


def test_eval_logits_match_a_torch_reference(model, batch):
    m = nnx.clone(model)
    m.eval()
    graphdef, params, rest = pj.nnx.split(m)
    params, rest = _randomize_batch_norm(params, rest)
    params["classifier"]["kernel"] = params["classifier"]["kernel"] * 50.0
    x, _ = batch
    logits, new_rest = _apply(graphdef, params, rest, x)
    # Input 32: the stem and stage 2 run at stride 1 (total stride 8, a 4x4 feature map).
    want = _torch_reference(params, rest, x, stem_stride=1,
                            stage_strides=[1, 1, 2, 2, 1, 2, 1]).numpy()
    assert np.std(want) > 0.1
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-4,
                               atol=1e-4 * np.max(np.abs(want)))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(new_rest),
                                                    jax.tree.leaves(rest)))


# --------------------------------------------------------------------------- batch norm


def test_training_forward_updates_running_statistics(model, batch):
    """running = 0.9 * running + 0.1 * batch statistic, with the biased (divide by n) batch
    variance, as flax computes it (torch's BatchNorm would use the unbiased one)."""
    m = nnx.clone(model)
    x, _ = batch
    _run(m, x)  # running statistics away from their initial 0 / 1
    x2 = 1.5 * jax.random.normal(jax.random.PRNGKey(7), x.shape) + 0.3
    graphdef, params, old = pj.nnx.split(m)

    @jax.jit
    def conv_outputs(params, rest, x):
        probe = pj.nnx.merge(graphdef, params, rest)
        stem = probe.stem.conv(x)
        h = probe.stem(x)
        for block in probe.blocks:
            h = block(h)
        return stem, probe.head.conv(h)

    stem_z, head_z = conv_outputs(params, old, x2)
    _run(m, x2)
    for layer, z in [("stem", stem_z), ("head", head_z)]:
        z = np.asarray(z, np.float64)
        old_mean = np.asarray(old[layer]["bn"]["mean"])
        old_var = np.asarray(old[layer]["bn"]["var"])
        bn = getattr(m, layer).bn
        np.testing.assert_allclose(bn.mean[...], 0.9 * old_mean + 0.1 * z.mean((0, 1, 2)),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bn.var[...], 0.9 * old_var + 0.1 * z.var((0, 1, 2)),
                                   rtol=1e-5, atol=1e-6)
        # n = 64 values per channel at the head: the unbiased variance would differ by 1/63.
        gap = 0.1 * (z.var((0, 1, 2), ddof=1) - z.var((0, 1, 2)))
        unbiased = 0.9 * old_var + 0.1 * z.var((0, 1, 2), ddof=1)
        assert np.all(np.abs(bn.var[...] - unbiased) > 0.5 * gap), layer
    new = pj.nnx.split(m)[2]
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new))]
    assert all(changed)


def test_eval_mode_uses_running_statistics_and_is_per_image(model, batch):
    m = nnx.clone(model)
    x, _ = batch
    train_full = _run(m, x)
    m.eval()
    assert m.stem.bn.use_running_average and m.blocks[3].project.bn.use_running_average
    before = pj.nnx.split(m)[2]
    eval_full = _run(m, x)
    eval_one = _run(m, x[:1])
    assert not np.allclose(eval_full, train_full, atol=1e-3)
    np.testing.assert_allclose(eval_one, eval_full[:1], rtol=1e-5, atol=1e-6)
    after = pj.nnx.split(m)[2]
    assert all(np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))

    m.train()
    assert not m.stem.bn.use_running_average
    np.testing.assert_allclose(_run(m, x), train_full, rtol=1e-5, atol=1e-6)


def test_split_keeps_batch_stats_as_rest(model, batch):
    m = nnx.clone(model)
    graphdef, params, rest = pj.nnx.split(m)
    rest_paths = set(_flat(rest))
    assert rest_paths == {p for p in pj.nnx.param_paths(m, nnx.BatchStat)}
    assert all(p.endswith(("bn/mean", "bn/var")) for p in rest_paths)
    assert not any(p.endswith(("bn/mean", "bn/var")) for p in _flat(params))
    # The merged module owns new statistics; the caller's arrays stay as they were.
    x, _ = batch
    _, new = _apply(graphdef, params, rest, x)
    assert not np.array_equal(new["stem"]["bn"]["mean"], rest["stem"]["bn"]["mean"])
    assert np.array_equal(rest["stem"]["bn"]["mean"], m.stem.bn.mean[...])


def test_dropout_is_random_in_training_only(model, batch):
    abstract = _abstract(num_classes=CLASSES, width_mult=WIDTH, input_size=SIZE, dropout=0.5)
    assert abstract.dropout.rate == 0.5 and abstract.dropout.rngs is not None
    assert model.dropout.rate == 0.0 and model.dropout.rngs is None
    m = nnx.clone(model)
    m.dropout = nnx.Dropout(0.5, rngs=nnx.Rngs(3))  # as MobileNetV2(dropout=0.5) builds it
    x, _ = batch
    first, second = _run(m, x), _run(m, x)
    assert not np.allclose(first, second)
    m.eval()
    assert m.dropout.deterministic


# --------------------------------------------------------------------------- sparse gradients


LAST_EXPANSIONS = blocks_with_expansion(MOBILENETV2_STAGES)[-4:]


def _pockengine(decision) -> pj.Scheme:
    """PockEngine's MobileNetV2 scheme: the first point-wise conv of the last blocks, and
    the classifier; everything else frozen."""
    return pj.Scheme({**{f"blocks/{i}/expand/conv/kernel": decision for i in LAST_EXPANSIONS},
                      "classifier/**": pj.Full()}, default=pj.Frozen())


SCHEMES = {
    "pockengine": (_pockengine(pj.Full()), set()),
    "pockengine-channels-out": (_pockengine(pj.Channels(ratio=0.25, axis="out")), {"mul"}),
    "pockengine-channels-in": (_pockengine(pj.Channels(ratio=0.25, axis="in")), set()),
    "bias-and-bn": (pj.Scheme({"**/bn/scale": pj.Full(), "**/bn/bias": pj.Full(),
                               "classifier/bias": pj.Full()}, default=pj.Frozen()), set()),
}


@pytest.fixture(scope="module")
def training_loss(short_model):
    """Cross-entropy through `merge` in training mode, with the split parameters.

    The loss is jitted so the dense reference gradient compiles once instead of
    dispatching op by op; sparse_grad inlines the jit.
    """
    graphdef, params, rest = pj.nnx.split(short_model)

    @jax.jit
    def loss(params, batch):
        x, y = batch
        logits = pj.nnx.merge(graphdef, params, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss, params


@pytest.mark.parametrize("name", list(SCHEMES))
def test_sparse_gradient_matches_sliced_dense(training_loss, batch, name):
    scheme, known_fallbacks = SCHEMES[name]
    loss, params = training_loss
    # In float64: at initialisation this model's float32 gradients are off by up to 1.6%
    # of the largest one (batch norm makes them ill-conditioned), so two float32 programs
    # that round differently disagree by more than any transform error would show.
    with jax.enable_x64(True):
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        batch = (jnp.asarray(batch[0], jnp.float64), batch[1])
        info = assert_matches_dense(loss, scheme, params, batch, rtol=1e-9, atol=1e-12)
    # Fallbacks are correct (computed whole, then sliced); the channels-out scheme has one
    # batch-norm multiply that no rule narrows. New ones are regressions.
    assert set(info.fallbacks) <= known_fallbacks, str(info)
    assert info.trainable_params < info.total_params
    if "channels" in name:
        assert len(info.channels) == len(LAST_EXPANSIONS)
        assert info.rules.get("dot_general", 0) >= len(LAST_EXPANSIONS)


def test_sparse_gradient_through_the_chunked_depthwise_weight_gradient(short_model, batch,
                                                                       monkeypatch):
    """Large layers take the depth-wise weight gradient over chunks of images in a loop
    (forced here for every layer, one image per chunk): sparse_grad through that loop,
    with depth-wise kernels trained whole and by channels, equals the sliced dense
    gradient."""
    from pockjax.models import _mobilenetv2_kernels as kernels

    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_CHUNK_BYTES", 1)
    monkeypatch.setattr(kernels, "_WEIGHT_GRAD_MIN_CHUNKS", 2)
    last = blocks_with_expansion(MOBILENETV2_STAGES)[-1]
    scheme = pj.Scheme({"blocks/1/depthwise/conv/kernel": pj.Channels(ratio=0.5, axis="out"),
                        f"blocks/{last}/depthwise/conv/kernel": pj.Full(),
                        "blocks/2/depthwise/bn/scale": pj.Full()}, default=pj.Frozen())
    graphdef, params, rest = pj.nnx.split(short_model)

    def loss(params, batch):  # traced anew: the chunk settings above apply
        x, y = batch
        logits = pj.nnx.merge(graphdef, params, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    with jax.enable_x64(True):
        params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float64), params)
        x = np.array(batch[0], np.float64)
        x[0] = 0.0  # an all-zero image (first slice), and zeros in the last one
        x[-1, ::2] = 0.0
        batch = (jnp.asarray(x), batch[1])
        assert "scan" in str(jax.make_jaxpr(jax.grad(loss))(params, batch))
        info = assert_matches_dense(loss, scheme, params, batch, rtol=1e-9, atol=1e-12)
    assert len(info.channels) == 1
    # No rule narrows the loop: the channel-trained kernel's gradient is computed whole
    # there and then sliced (correct; at most one depth-wise weight gradient's work).
    assert info.fallbacks == {"scan": 1}, str(info)


# --------------------------------------------------------------------------- training


def test_trainer_trains_sparse_scheme_and_carries_batch_stats(short_model, batch):
    m = nnx.clone(short_model)
    scheme = _pockengine(pj.Channels(ratio=0.25, axis="in"))
    before_params, before_rest = (_flat(t) for t in pj.nnx.split(m)[1:])

    def loss_fn(module, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(module(x), y).mean()

    trainer = pj.nnx.Trainer(m, loss_fn, optimizer=optax.adam(1e-2), scheme=scheme)
    losses = [float(trainer(batch)["loss"]) for _ in range(4)]
    assert losses[-1] < losses[0], losses

    after = _flat(trainer.params())
    decisions = _flat(scheme.resolve(pj.nnx.split(m)[1]))
    for path, decision in decisions.items():
        old, new = np.asarray(before_params[path]), np.asarray(after[path])
        if decision == pj.Frozen():
            assert np.array_equal(old, new), path
        elif isinstance(decision, pj.Channels):
            kept = [slice(None)] * old.ndim
            kept[decision.axis] = slice(0, decision.count)
            frozen = [slice(None)] * old.ndim
            frozen[decision.axis] = slice(decision.count, None)
            assert not np.array_equal(old[tuple(kept)], new[tuple(kept)]), path
            assert np.array_equal(old[tuple(frozen)], new[tuple(frozen)]), path
        else:
            assert not np.array_equal(old, new), path
    rest = _flat(trainer.rest)
    assert all(not np.array_equal(before_rest[p], rest[p]) for p in rest)

    trainer.update(m)
    assert all(np.array_equal(v, after[p]) for p, v in _flat(pj.nnx.split(m)[1]).items())
    assert all(np.array_equal(v, rest[p]) for p, v in _flat(pj.nnx.split(m)[2]).items())
