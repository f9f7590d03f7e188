"""Frozen weights in 8 and 4 bits (`pockjax.lowbit`): the formats' rounding, the loss on
quantized weights against the same loss on their dequantized values, the
trainer against plain `jax.grad` + optax, compiled memory, schemes, checkpoints and
`pockjax finetune --frozen-dtype int4`."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax import lowbit

FORMATS = ["int8", "int4", "int4:16", lowbit.Int4(group=32, zero_point=True), "bfloat16"]


def _deq(tree):
    return jax.tree.map(lambda x: lowbit.dequantize(x) if lowbit.is_quantized(x) else x, tree,
                        is_leaf=lowbit.is_quantized)


def _mlp(width=64, layers=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), layers + 2)
    params = {f"l{i}": {"kernel": jax.random.normal(keys[i], (width, width)) / np.sqrt(width),
                        "bias": jnp.full((width,), 0.01 * i)} for i in range(layers)}
    params["embed"] = jax.random.normal(keys[layers], (32, width))
    return params


def _loss(p, b):
    """Uses a quantized weight through a gather, products (one transposed, one inside a
    nested jit) and a reshape."""
    h = p["embed"][b["ids"]] + b["x"]
    for i in range(4):
        layer = p[f"l{i}"]
        if i == 1:
            h = jax.jit(lambda h, w: h @ w)(h, layer["kernel"]) + layer["bias"]
        else:
            h = h @ layer["kernel"] + layer["bias"]
        h = jnp.tanh(h)
    back = h @ p["l0"]["kernel"].T
    flat = p["l2"]["kernel"].reshape(-1)[: h.shape[-1]]
    return jnp.mean((back - b["y"]) ** 2) + jnp.mean(h * flat)


def _batch(width=64, seed=1):
    k = jax.random.split(jax.random.key(seed), 3)
    return {"ids": jax.random.randint(k[0], (8,), 0, 32), "x": jax.random.normal(k[1], (8, width)),
            "y": jax.random.normal(k[2], (8, width))}


def test_rounding_is_within_half_a_step_and_exact_on_the_grid():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    w[:, 3] = 0.0                      # an all-zero output channel
    w[5, 7] = 40.0                     # an outlier
    for fmt in ("int8", "int4", lowbit.Int4(group=16, zero_point=True)):
        q = lowbit.quantize_leaf(w, fmt)
        back = np.asarray(lowbit.dequantize(q))
        assert back.shape == w.shape and back.dtype == w.dtype
        assert np.all(back[:, 3] == 0.0)
        levels = 127 if fmt == "int8" else (15 if getattr(fmt, "zero_point", False) else 7)
        scale = np.asarray(q.scale, np.float32)
        if fmt == "int8":
            step = np.broadcast_to(scale, w.shape)
        else:
            group = 64 // scale.shape[0]
            step = np.repeat(scale, group, axis=0)
        # Half a step, plus the rounding of a zero point (zero-point int4).
        bound = step * (0.5 if levels != 15 else 1.0) + 1e-6
        assert np.all(np.abs(back - w) <= bound), fmt
        if levels != 15:  # symmetric formats: values on the grid come back exactly
            again = np.asarray(lowbit.dequantize(lowbit.quantize_leaf(back, fmt)))
            np.testing.assert_array_equal(again, back)
    # zero-point int4 on groups all on one side of 0 (a norm's scales, a shifted layer),
    # near-constant ones far from 0 too: within a step of the group's own width
    shifted = rng.standard_normal((64, 6)).astype(np.float32) * [1, 1, 1, 1e-3, 1, 0]
    shifted += np.array([3.0, -3.0, 50.0, 7.0, 0.5, -2.0], np.float32)
    for words in (False, True):
        q = lowbit.quantize_leaf(shifted, lowbit.Int4(group=16, zero_point=True))
        q = lowbit.in_words(q) if words else q
        back = np.asarray(lowbit.dequantize(q))
        group_width = np.ptp(shifted.reshape(4, 16, 6), axis=1)
        step = np.maximum(group_width / 15, np.abs(shifted.reshape(4, 16, 6)).max(1) / 120)
        err = np.abs(back - shifted).reshape(4, 16, 6).max(1)
        assert np.all(err <= step * 1.01 + 1e-6), (words, err / np.maximum(step, 1e-9))
    q = lowbit.quantize_leaf(w, "int4")
    assert q.data.dtype == jnp.int8 and q.data.shape == (32, 24) and q.scale.dtype == jnp.bfloat16
    assert q.nbytes < w.nbytes / 6


def test_bad_formats_and_leaves_name_the_problem():
    with pytest.raises(lowbit.QuantizeError, match="unknown format 'int3'"):
        lowbit.format_of("int3")
    with pytest.raises(lowbit.QuantizeError, match="even number"):
        lowbit.format_of("int4:7")
    with pytest.raises(lowbit.QuantizeError, match="'odd'.*even size"):
        lowbit.quantize_leaf(np.ones((5, 4), np.float32), "int4", path="odd")
    with pytest.raises(lowbit.QuantizeError, match="'v'.*rank >= 2"):
        lowbit.quantize_leaf(np.ones(4, np.float32), "int8", path="v")
    # A quantized leaf the scheme would train.
    q = lowbit.quantize(_mlp(), None, "int8")
    with pytest.raises(pj.SchemeError, match="'l0/kernel' is stored quantized"):
        pj.Scheme({"l0/kernel": pj.Full()}, default=pj.Frozen()).resolve(q)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
def test_loss_and_gradients_equal_the_dequantized_models(fmt):
    """To float32 rounding: XLA may fuse a dequantization into the product that reads it,
    which can change the order of a dot's accumulation (measured: 1 ulp in the loss)."""
    params, batch = _mlp(), _batch()
    scheme = pj.Scheme({"l3/**": pj.Full(), "**/bias": pj.Full()}, default=pj.Frozen())
    q = lowbit.quantize(params, scheme, fmt)
    assert sum(lowbit.is_quantized(x) for x in jax.tree.leaves(q, is_leaf=lowbit.is_quantized)) == 4
    deq = _deq(q)

    def on(tree, f):
        return lambda t, b: f({**tree, "l3": t["l3"], **{f"l{i}": {**tree[f"l{i}"], "bias": t[f"b{i}"]}
                                                        for i in range(3)}}, b)

    t = {"l3": q["l3"], **{f"b{i}": q[f"l{i}"]["bias"] for i in range(3)}}
    v1, g1 = jax.jit(jax.value_and_grad(on(q, lowbit.at_use(_loss))))(t, batch)
    v2, g2 = jax.jit(jax.value_and_grad(on(deq, _loss)))(t, batch)
    assert float(v1) == pytest.approx(float(v2), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_sparse_train_equals_jax_grad_and_optax_on_the_dequantized_model():
    params, batch = _mlp(), _batch()
    scheme = pj.Scheme({"l3/**": pj.Full(), "l1/bias": pj.Full()}, default=pj.Frozen())
    opt = optax.adamw(1e-2, weight_decay=0.1)
    trainer = pj.sparse_train(_loss, optimizer=opt, scheme=scheme, frozen_dtype="int4")
    state = trainer.init(params)
    assert lowbit.is_quantized(state.params["l0"]["kernel"])
    assert not lowbit.is_quantized(state.params["l3"]["kernel"])

    deq = _deq(lowbit.quantize(params, scheme, "int4"))
    train = {"l3": deq["l3"], "b1": deq["l1"]["bias"]}
    join = lambda t: {**deq, "l3": t["l3"], "l1": {**deq["l1"], "bias": t["b1"]}}
    ref_state = opt.init(train)
    losses = []
    for _ in range(3):
        state, metrics = trainer(state, batch)
        value, g = jax.value_and_grad(lambda t: _loss(join(t), batch))(train)
        updates, ref_state = opt.update(g, ref_state, train)
        train = optax.apply_updates(train, updates)
        losses.append((float(metrics["loss"]), float(value)))
    for mine, ref in losses:
        assert mine == pytest.approx(ref, rel=1e-6)
    np.testing.assert_allclose(state.params["l3"]["kernel"], train["l3"]["kernel"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(state.params["l1"]["bias"], train["b1"], rtol=1e-5, atol=1e-6)
    # Frozen weights are untouched.
    before = lowbit.quantize(params, scheme, "int4")["l0"]["kernel"]
    np.testing.assert_array_equal(state.params["l0"]["kernel"].data, before.data)
    report = trainer.report(state, batch)
    assert report.trainable_params == 64 * 64 + 2 * 64


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_no_float_copy_of_the_frozen_weights_is_alive(fmt):
    """Eight frozen 512 x 512 layers in int8 or bfloat16: the step's temporaries (and the
    trainer's) stay below two float32 weights, where dequantizing or upcasting them up
    front keeps several alive (XLA hoists a plain bfloat16 weight's upcast: 7 weights'
    float32 copies at once, measured)."""
    width, layers = 512, 8
    keys = jax.random.split(jax.random.key(0), layers + 1)
    params = {f"l{i}": jax.random.normal(keys[i], (width, width)) / np.sqrt(width)
              for i in range(layers)}
    x = jax.random.normal(keys[-1], (4, width))

    def loss(p, x):
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i}"])
        return jnp.mean(h ** 2)

    last = f"l{layers - 1}"
    scheme = pj.Scheme({last: pj.Full()}, default=pj.Frozen())
    q = lowbit.quantize(params, scheme, fmt)
    frozen = {k: v for k, v in q.items() if k != last}
    weight = width * width * 4
    at_use = jax.jit(jax.grad(lambda t, f, x: lowbit.at_use(loss)({**f, last: t}, x)))
    up_front = jax.jit(jax.grad(lambda t, f, x: loss({**_deq(f), last: t}, x)))
    temp = lambda f: f.lower(q[last], frozen, x).compile().memory_analysis().temp_size_in_bytes
    assert temp(at_use) < weight
    assert temp(up_front) > 3 * weight
    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-3), scheme=scheme, frozen_dtype=fmt)
    step = trainer.lower(trainer.init(params), x).compile().memory_analysis()
    assert step.temp_size_in_bytes < 2 * weight


def test_a_quantized_state_saves_and_loads(tmp_path):
    params, batch = _mlp(), _batch()
    scheme = pj.Scheme({"l3/**": pj.Full()}, default=pj.Frozen())
    trainer = pj.sparse_train(_loss, optimizer=optax.adam(1e-2), scheme=scheme, frozen_dtype="int8")
    state, _ = trainer(trainer.init(params), batch)
    pj.save(tmp_path / "s.safetensors", state)
    back = pj.load(tmp_path / "s.safetensors", like=state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert lowbit.is_quantized(back.params["l0"]["kernel"])


def test_finetune_with_int4_frozen_weights(tmp_path):
    """`pockjax finetune --frozen-dtype int4`: the step trains, the loss falls, trained
    weights are written at full precision and frozen ones as the base file holds them."""
    from safetensors.numpy import load_file

    from tests.finetuning.test_finetune import _folder, _jsonl, WORDS

    folder = _folder(tmp_path, "llama")
    rng = np.random.default_rng(1)
    data = _jsonl(tmp_path / "train.jsonl",
                  [{"text": " ".join(rng.choice(WORDS[:12], 10))} for _ in range(16)])
    runs = {dtype: pj.finetune(folder, data, tmp_path / dtype, scheme="last:1", steps=12,
                               batch=4, seq=32, lr=3e-3, frozen_dtype=dtype, progress=False,
                               plot=False, valid=data, eval_every=6)
            for dtype in ("float32", "int4")}
    # validation reads the quantized weights too (dequantized where used)
    assert runs["int4"].valid_loss < runs["int4"].valid_loss_before
    assert runs["int4"].valid_loss == pytest.approx(runs["float32"].valid_loss, rel=0.05)
    first = json.loads((tmp_path / "int4" / "metrics.jsonl").read_text().splitlines()[1])
    assert runs["int4"].train_loss < first["loss"]
    assert runs["int4"].train_loss == pytest.approx(runs["float32"].train_loss, rel=0.05)
    # a quantized weight counts its values, not its packed bytes and scales
    assert runs["int4"].total_params == runs["float32"].total_params
    assert runs["int4"].trainable_params == runs["float32"].trainable_params
    weights = load_file(str(tmp_path / "int4" / "final" / "model.safetensors"))
    base = load_file(str(folder / "model.safetensors"))
    assert weights["model.layers.1.mlp.up_proj.weight"].dtype == np.float32   # trained
    frozen = "model.layers.0.mlp.up_proj.weight"  # the base's own bytes, not the int4 values
    np.testing.assert_array_equal(weights[frozen], base[frozen])


def exportable_trainer(formats, rules=None):
    """`(trainer, params, batch)`: a 4-layer tanh MLP whose last layer and biases train
    (and `rules`' weights as they say) and whose other kernels are stored in `formats`
    (export tests here and for Vulkan)."""
    params, batch = _mlp(), _batch()
    del params["embed"]

    def loss(p, b):
        h = b["x"]
        for i in range(4):
            h = jnp.tanh(h @ p[f"l{i}"]["kernel"] + p[f"l{i}"]["bias"])
        return jnp.mean((h - b["y"]) ** 2)

    scheme = pj.Scheme({**(rules or {}), "l3/**": pj.Full(), "**/bias": pj.Full()},
                       default=pj.Frozen())
    return (pj.sparse_train(loss, optimizer=optax.adam(1e-2), scheme=scheme,
                            frozen_dtype=formats), params, batch)


@pytest.mark.parametrize("frozen_dtype", ["int4", "int8", "bfloat16"])
def test_finetune_stores_each_frozen_weight_as_it_is_read(tmp_path, monkeypatch, frozen_dtype):
    """`load_model(scheme_of=...)` (what `finetune` calls): each frozen weight is stored
    in its format straight from the file's float32 values, equal to quantizing the
    float32 model afterwards; trained weights are the file's float32 values, bit for bit
    (not rounded through bfloat16); and while a weight is read, the arrays alive are
    what was stored so far plus that one tensor's copies, never a whole model."""
    from pockjax.finetuning._formats import frozen_formats
    from pockjax.finetuning._model import load_model
    from pockjax.models.hf import load_llama
    from tests.finetuning.test_finetune import _folder

    folder = _folder(tmp_path, "llama")
    # One weight trains, so the stored model is well under the bfloat16 one.
    scheme_of = lambda shapes, layers: pj.Scheme(  # noqa: E731
        {"layers/1/mlp/down_proj/**": pj.Full()}, default=pj.Frozen())
    reference = pj.nnx.split(load_llama(folder))[1]  # float32, read whole
    scheme = scheme_of(reference, 2)
    before = sum(x.nbytes for x in jax.live_arrays())  # the reference and others' arrays
    seen = []
    convert_leaf = lowbit.quantize_leaf

    def watched(w, fmt, **kw):
        seen.append((sum(x.nbytes for x in jax.live_arrays()) - before,
                     4 * int(np.prod(w.shape))))
        return convert_leaf(w, fmt, **kw)

    monkeypatch.setattr("pockjax.lowbit._store.quantize_leaf", watched)  # store_leaf's
    loaded = load_model(folder, frozen_dtype=frozen_dtype, scheme_of=scheme_of)
    assert loaded.scheme is not None and loaded.scheme.to_json() == scheme.to_json()
    frozen = pj.scheme.leaves_with_paths(scheme.resolve(reference))[0]
    got = [(pj.scheme.path_str(p), x) for p, x in jax.tree_util.tree_flatten_with_path(
        loaded.params, is_leaf=lowbit.is_quantized)[0]]
    want = pj.scheme.leaves_with_paths(reference)[0]
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, x), (_, w), (_, decision) in zip(got, want, frozen):
        if not isinstance(decision, pj.Frozen):
            assert x.dtype == jnp.float32, path
            np.testing.assert_array_equal(np.asarray(x), np.asarray(w), err_msg=path)
        elif w.ndim < 2:
            assert x.dtype == jnp.bfloat16, path
            np.testing.assert_array_equal(np.asarray(x), np.asarray(w.astype(jnp.bfloat16)))
        else:
            # int4 keeps the embedding (and a head) int8 (frozen_formats)
            fmt = lowbit.formats_by_path(frozen_formats(frozen_dtype))(path)
            wide = path in ("embed/embedding", "lm_head/kernel")
            assert isinstance(fmt, lowbit.Int8) == (frozen_dtype == "int8" or
                                                    frozen_dtype == "int4" and wide), path
            expect = convert_leaf(w, fmt, path=path, dtype=jnp.float32)
            assert lowbit.is_quantized(x), path
            for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(expect)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    stored = lowbit.stored_bytes(loaded.params)
    if frozen_dtype != "bfloat16":
        # Loaded whole in bfloat16 first, the model alone would be half the float32 one.
        whole = lowbit.stored_bytes(reference) / 2
        assert seen and stored + 3 * min(t for _, t in seen) < whole
    assert seen
    for alive, tensor in seen:  # the file's tensor, its float32 copy, its transpose
        assert alive <= stored + 3 * tensor, (alive, stored, tensor)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4:16", lowbit.Int4(group=32, zero_point=True),
                                 "bfloat16"], ids=str)
def test_weights_in_32_bit_words_dequantize_to_the_same_values(fmt):
    """`in_words` (what Vulkan exports store): the same float weights bit for bit, on
    shapes whose byte count is not a multiple of 4 and on either input axis; no array
    narrower than 32 bits in the dequantizing computation; the trainer's steps on a
    state in words equal its steps on the bytes."""
    rng = np.random.default_rng(0)
    for shape, axis in [((6, 34, 3), 1), ((34, 5), 0), ((64, 7), -2), ((2, 3, 16, 5), 2)]:
        w = jnp.asarray(rng.standard_normal(shape) * rng.uniform(0.01, 3, shape), jnp.float32)
        q = lowbit.quantize_leaf(w, fmt, axis=axis)
        words = lowbit.in_words({"w": q})["w"]
        assert words.words and words.data.dtype == jnp.int32
        assert words.scale is None if fmt == "bfloat16" else words.scale.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(words.dequantize()), np.asarray(q.dequantize()))
        jaxpr = str(jax.make_jaxpr(lowbit.dequantize)(words))
        assert not any(t in jaxpr for t in ("i8[", "u8[", "bf16[", "i16[")), jaxpr

    params, batch = _mlp(), _batch()
    scheme = pj.Scheme({"l3/**": pj.Full(), "**/bias": pj.Full()}, default=pj.Frozen())
    trainer = pj.sparse_train(_loss, optimizer=optax.adam(1e-2), scheme=scheme, frozen_dtype=fmt)
    a = trainer.init(params)
    b = lowbit.in_words(trainer.init(params))
    for _ in range(3):
        a, ma = trainer(a, batch)
        b, mb = trainer(b, batch)
        assert float(ma["loss"]) == float(mb["loss"])
    np.testing.assert_array_equal(np.asarray(a.params["l3"]["kernel"]),
                                  np.asarray(b.params["l3"]["kernel"]))


def test_the_step_exports_with_quantized_weights_and_runs_as_the_trainer(tmp_path):
    """host-cpu artifact of a step on int8 and zero-point int4 weights (stored as int8 in
    params.irpa): three steps through pockjax.runtime equal the JAX trainer's."""
    trainer, params, batch = exportable_trainer({"l0/**": lowbit.Int4(group=32, zero_point=True),
                                                 "**": "int8"},
                                                {"l1/kernel": pj.Channels(count=16, last=True)})
    state = trainer.init(params)
    assert isinstance(state.params["l0"]["kernel"].fmt, lowbit.Int4)
    assert isinstance(state.params["l1"]["kernel"].fmt, lowbit.Int8)
    assert state.params["l1"]["kernel"].channels == (1, 48, 16)  # trains in part
    pj.export(trainer, state, batch, target="host-cpu", out_dir=tmp_path / "art")
    session = pj.runtime.load(tmp_path / "art", device="local-task")
    for _ in range(3):
        metrics = session.step(batch)
        state, ref = trainer(state, batch)
        assert float(np.asarray(metrics["loss"])) == pytest.approx(float(ref["loss"]), rel=1e-5)
    got = session.params()
    np.testing.assert_allclose(got["l3"]["kernel"], state.params["l3"]["kernel"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(got["l1"]["bias"], state.params["l1"]["bias"], rtol=1e-5,
                               atol=1e-6)


def test_a_weight_trained_in_part_keeps_its_channels_in_float32_and_the_rest_low_bit(tmp_path):
    """Channels leaves on a low-bit base: the trained channels are a float32 master, the
    rest stays in its format, and 3 steps equal jax.grad + optax on the dequantized model
    with those channels trained. The weights are read directly, transposed (`l0`), in a
    nested jit (`l1`) and reshaped outside a product (`l2`)."""
    params, batch = _mlp(), _batch()
    scheme = pj.Scheme({"l0/kernel": pj.Channels(ratio=0.25), "l1/kernel": pj.Channels(count=16, last=True),
                        "l2/kernel": pj.Channels(count=8, axis="in", last=True), "l3/**": pj.Full()},
                       default=pj.Frozen())
    where = {"l0": (1, 0, 16), "l1": (1, 48, 16), "l2": (0, 56, 8)}
    opt = optax.adamw(1e-2, weight_decay=0.1)
    for fmt in ("int8", lowbit.Int4(group=32, zero_point=True), "bfloat16"):
        trainer = pj.sparse_train(_loss, optimizer=opt, scheme=scheme, frozen_dtype={"**": fmt})
        state = trainer.init(params)
        stored = lowbit.quantize(params, scheme, fmt)
        deq = _deq(stored)
        train = {k: jax.lax.slice_in_dim(params[k]["kernel"], s, s + c, axis=a)
                 for k, (a, s, c) in where.items()}
        train["l3"] = deq["l3"]

        def join(t):
            out = {**deq, "l3": t["l3"]}
            for k, (a, s, c) in where.items():
                start = [0, 0]
                start[a] = s
                out[k] = {**deq[k], "kernel": jax.lax.dynamic_update_slice(deq[k]["kernel"], t[k], start)}
            return out

        ref_state = opt.init(train)
        for _ in range(3):
            state, metrics = trainer(state, batch)
            value, g = jax.value_and_grad(lambda t: _loss(join(t), batch))(train)
            updates, ref_state = opt.update(g, ref_state, train)
            train = optax.apply_updates(train, updates)
            assert float(metrics["loss"]) == pytest.approx(float(value), rel=1e-6)
        for k, (a, s, c) in where.items():
            w = state.params[k]["kernel"]
            assert w.channels == (a, s, c) and w.master.dtype == jnp.float32
            # Adam's steps (1e-2) on gradients summed in another order: to 0.1% of a step.
            np.testing.assert_allclose(w.master, train[k], rtol=1e-5, atol=1e-5)
            for x, y in zip(jax.tree.leaves(w)[:-1], jax.tree.leaves(stored[k]["kernel"])[:-1]):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # frozen: as stored
            np.testing.assert_allclose(lowbit.dequantize(w), join(train)[k]["kernel"], rtol=1e-5,
                                       atol=1e-5)
        assert trainer.report(state, batch).trainable_params == 16 * 64 * 2 + 8 * 64 + 64 * 65
    pj.save(tmp_path / "s.safetensors", state)
    back = pj.load(tmp_path / "s.safetensors", like=state)
    assert back.params["l2"]["kernel"].channels == (0, 56, 8)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("axis", ["out", "in"])
def test_a_weight_trained_in_part_gets_the_gradient_of_its_channels_only(axis):
    """The weight gradient of a low-bit weight's trained channels is the product
    restricted to them: no product in the gradient computes the whole weight's. Exact
    zeros: rows of the batch, and trained and frozen channels of the weight."""
    x = jax.random.normal(jax.random.key(0), (8, 128)).at[2:4].set(0.0)
    w = jax.random.normal(jax.random.key(1), (128, 256)) / 16
    params = {"w": w.at[:, -3:].set(0.0).at[-5:, :].set(0.0).at[:, :2].set(0.0)}
    scheme = pj.Scheme({"w": pj.Channels(ratio=0.25, axis=axis, last=True)})
    q = lowbit.quantize(params, scheme, "int4")
    loss = lambda p, x: jnp.sum(jnp.tanh(x @ p["w"]) ** 2)  # noqa: E731
    grad = jax.grad(lambda m: lowbit.at_use(loss)({"w": q["w"].replace(master=m)}, x))
    jaxpr = jax.make_jaxpr(grad)(q["w"].master)
    shapes = []

    def walk(jx):
        for e in jx.eqns:
            if e.primitive.name == "dot_general":
                shapes.append(e.outvars[0].aval.shape)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert (128, 256) not in shapes and shapes, shapes
    a, n = (1, 256) if axis == "out" else (0, 128)
    full = jax.grad(lambda w: loss({"w": w}, x))(lowbit.dequantize(q["w"]))
    np.testing.assert_allclose(grad(q["w"].master), jax.lax.slice_in_dim(full, n * 3 // 4, n, axis=a),
                               rtol=1e-5, atol=1e-6)


def test_finetune_trains_channels_on_an_int4_base(tmp_path):
    """A scheme file with Channels and `--frozen-dtype int4`: each such weight is read
    into an int4 base with its trained channels in float32, and written back with those
    channels as trained and the others as the base file holds them (not the int4
    rounding the step computed with)."""
    from safetensors.numpy import load_file

    from tests.finetuning.test_finetune import _folder, _jsonl, WORDS

    folder = _folder(tmp_path, "llama")
    rng = np.random.default_rng(1)
    data = _jsonl(tmp_path / "train.jsonl",
                  [{"text": " ".join(rng.choice(WORDS[:12], 10))} for _ in range(16)])
    scheme = pj.Scheme({"layers/1/mlp/up_proj/kernel": pj.Channels(ratio=0.25),
                        "layers/1/attn/o_proj/kernel": pj.Channels(ratio=0.5, axis="in")},
                       default=pj.Frozen())
    (tmp_path / "scheme.json").write_text(scheme.to_json())
    run = pj.finetune(folder, data, tmp_path / "run", scheme=str(tmp_path / "scheme.json"), steps=8,
                      batch=4, seq=32, lr=3e-3, frozen_dtype="int4", progress=False, plot=False)
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert run.train_loss < first["loss"]
    before = load_file(str(folder / "model.safetensors"))
    after = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    up = "model.layers.1.mlp.up_proj.weight"  # torch layout [out, in]: "out" is axis 0
    assert after[up].dtype == np.float32
    kept = before[up].shape[0] // 4
    assert not np.allclose(after[up][:kept], before[up][:kept])  # trained
    # the rest: the base file's values, not the int4 values the step read
    np.testing.assert_array_equal(after[up][kept:], before[up][kept:])
    q = lowbit.quantize_leaf(jnp.asarray(before[up].T, jnp.float32), "int4")
    assert not np.array_equal(np.asarray(lowbit.dequantize(q)).T[kept:], before[up][kept:])
    o = "model.layers.1.self_attn.o_proj.weight"  # "in" is axis 1 in the file
    half = before[o].shape[1] // 2
    np.testing.assert_array_equal(after[o][:, half:], before[o][:, half:])
    assert not np.allclose(after[o][:, :half], before[o][:, :half])
    frozen = "model.layers.0.mlp.up_proj.weight"
    np.testing.assert_array_equal(after[frozen], before[frozen])  # the base's bytes


@pytest.mark.parametrize("rows_packed", [True, False], ids=["table-in-rows", "table-in-columns"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_large_products_go_in_pieces_and_lookups_read_their_rows(fmt, rows_packed, monkeypatch):
    """A product with a stored weight larger than `lowbit.PIECE_BYTES` (on either side of
    the product) dequantizes it a piece at a time, forward and backward; a lookup in a
    stored table dequantizes only the rows it reads, ids out of range giving NaN rows as
    `jnp.take` does. The gradient equals `jax.grad` on the dequantized weights, and the
    compiled gradient holds no float copy of the table or of either head."""
    vocab, width = 512, 64
    keys = jax.random.split(jax.random.key(3), 4)
    params = {"embed": jax.random.normal(keys[0], (vocab, width)),
              "w": jax.random.normal(keys[1], (width, width)) / 8,
              "head": jax.random.normal(keys[2], (width, vocab)) / 8,
              "head_t": jax.random.normal(keys[3], (vocab, width)) / 8}
    # Exact zeros: a zero row of the table, zero columns of both heads (a whole piece of
    # `head`), an all-zero output channel of `head_t`.
    params["embed"] = params["embed"].at[5].set(0.0)
    params["head"] = params["head"].at[:, 64:128].set(0.0).at[:, 300].set(0.0)
    params["head_t"] = params["head_t"].at[7].set(0.0)
    ids = jnp.asarray([[0, 5, vocab - 1, 17, 2], [vocab, -1, 3, 3, 64]], jnp.int32)

    def loss(p, ids):
        h = jnp.take(p["embed"], ids, axis=0)             # NaN rows for ids out of range
        h = jnp.tanh(jnp.where(jnp.isnan(h), 0.5, h) @ p["w"])
        logits = h @ p["head"]                              # the weight on the right
        back = jax.lax.dot_general(p["head_t"], h, (((1,), (2,)), ((), ())))  # on the left
        return jnp.mean(jnp.sin(logits)) + jnp.mean(back ** 2)

    scheme = pj.Scheme({"w": pj.Full()}, default=pj.Frozen())
    layouts = {"head_t": {"in": 1, "out": 0}, "embed": {"in": 0 if rows_packed else 1,
                                                        "out": 1 if rows_packed else 0}}
    q = lowbit.quantize(params, scheme, fmt, layouts=layouts)
    frozen = {k: v for k, v in q.items() if k != "w"}
    float_copy = vocab * width * 4
    monkeypatch.setattr("pockjax.lowbit._use.PIECE_BYTES", float_copy // 8)  # at_use's
    grad = jax.jit(jax.grad(lambda t, f, ids: lowbit.at_use(loss)({**f, "w": t}, ids)))
    want = jax.grad(lambda t: loss({**_deq(frozen), "w": t}, ids))(q["w"])
    got = grad(q["w"], frozen, ids)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(want))))
    rows = lowbit.at_use(lambda p, ids: jnp.take(p["embed"], ids, axis=0))(q, ids)
    np.testing.assert_array_equal(rows, jnp.take(_deq(q)["embed"], ids, axis=0))
    # (jnp.take counts a negative id from the end; one past the end reads NaN)
    assert np.isnan(rows[1, 0]).all() and not np.isnan(rows[1, 1:]).any()
    temp = grad.lower(q["w"], frozen, ids).compile().memory_analysis().temp_size_in_bytes
    assert temp < float_copy, (temp, float_copy)  # without pieces: 2.4-2.5 copies


def test_quantize_refuses_a_tree_stored_already():
    q = lowbit.quantize(_mlp(), pj.Scheme({"l3/**": pj.Full()}, default=pj.Frozen()), "int8")
    with pytest.raises(lowbit.QuantizeError, match=r"'embed' is stored already \(4 weights "
                                                   r"are\): quantize the float weights"):
        lowbit.quantize(q, None, "int4")
