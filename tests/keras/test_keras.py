"""`pockjax.keras`: Keras 3 models (JAX backend) as params + a pure function. Gradients
against dense `jax.grad`; the trainer against Keras's own `train_on_batch` (BatchNorm
statistics and dropout's seed state carried); named axes of every kernel layout; the
trained model written back, saved as `.keras` and loaded under another backend; the
step exported to IREE and run there."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import pockjax as pj
import pockjax.keras as pk  # before keras: chooses Keras's JAX backend
import keras  # noqa: E402  (after pockjax.keras)
from pockjax.scheme import SchemeError
from tests.helpers import assert_matches_dense

ROOT = Path(__file__).resolve().parents[2]


def _cnn(seed=0):
    """Conv, BatchNorm, depthwise conv, dropout and a head: MobileNetV2's pieces."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, name="conv1")(inp)
    x = keras.layers.BatchNormalization(name="bn1")(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.DepthwiseConv2D(3, name="dw")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.25, name="drop")(x)
    out = keras.layers.Dense(4, name="head")(x)
    return keras.Model(inp, out, name="cnn")


def _attention(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6, 8))
    x = keras.layers.MultiHeadAttention(2, 4, name="mha")(inp, inp)
    x = keras.layers.LayerNormalization(name="ln")(x + inp)
    x = keras.layers.Dense(16, activation="gelu", name="up")(x)
    x = keras.layers.Conv1D(8, 1, name="down")(x)
    out = keras.layers.Dense(5, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, out, name="attn")


def _images(n=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8, 8, 3)).astype(np.float32)
    x[0, :4] = 0.0  # exact zeros in the first example
    return x, rng.integers(0, 4, n).astype(np.int32)


XENT = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_named_axes_follow_each_kernel_layout():
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(6, 3, name="conv")(inp)
    x = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="dw")(x)
    x = keras.layers.Conv2DTranspose(5, 3, name="up")(x)
    x = keras.layers.SeparableConv2D(4, 3, name="sep")(x)
    x = keras.layers.Dense(3, name="head")(keras.layers.Flatten()(x))
    model = keras.Model(inp, x)
    params, _ = pk.functional(model)
    both = lambda axis: pj.Scheme({"**/*kernel": pj.Channels(count=1, axis=axis)})  # noqa: E731
    got = {a: pj.scheme.leaves_with_paths(both(a).resolve(params))[0] for a in ("in", "out")}
    axes = {a: {p: d.axis for p, d in got[a] if p.endswith("kernel")} for a in got}
    assert axes["in"] == {"conv/kernel": 2, "dw/kernel": 2, "up/kernel": 3,
                          "sep/depthwise_kernel": 2, "sep/pointwise_kernel": 2,
                          "head/kernel": 0}
    assert axes["out"] == {"conv/kernel": 3, "dw/kernel": 2, "up/kernel": 2,
                           "sep/depthwise_kernel": 2, "sep/pointwise_kernel": 3,
                           "head/kernel": 1}
    # MultiHeadAttention's EinsumDense kernels: read from their equations
    params, _ = pk.functional(_attention())
    for path, want in {"mha/query/kernel": (0, 1), "mha/attention_output/kernel": (0, 2),
                       "down/kernel": (1, 2), "up/kernel": (0, 1)}.items():
        for axis, a in zip(("in", "out"), want):
            leaves = dict(pj.scheme.leaves_with_paths(both(axis).resolve(params))[0])
            assert leaves[path].axis == a, (path, axis)
    # a kernel whose layout is unknown is refused by name
    lstm = keras.Sequential([keras.Input((4, 3)), keras.layers.LSTM(5, name="lstm")])
    lparams, _ = pk.functional(lstm)
    with pytest.raises(SchemeError, match=r"lstm/lstm_cell/kernel.*LSTMCell.*layout unknown"):
        pj.Scheme({"**/lstm_cell/kernel": pj.Channels(count=1, axis="out")}).resolve(lparams)


@pytest.mark.parametrize("make", [_cnn, _attention])
def test_sparse_grad_equals_jax_grad(make):
    model = make()
    params, apply = pk.functional(model)
    if make is _cnn:
        x, y = _images()
        scheme = pj.Scheme({"head/**": pj.Full(), "dw/kernel": pj.Channels(ratio=0.5, axis="out"),
                            "conv1/kernel": pj.Channels(ratio=0.25, axis="in"),
                            "bn1/gamma": pj.Full()})
    else:
        rng = np.random.default_rng(1)
        x, y = rng.normal(size=(3, 6, 8)).astype(np.float32), rng.integers(0, 5, 3)
        scheme = pj.Scheme({"mha/query/kernel": pj.Channels(count=1, axis="out"),
                            "mha/attention_output/kernel": pj.Channels(count=1, axis="in"),
                            "down/kernel": pj.Channels(ratio=0.5, axis="out"),
                            "head/**": pj.Full()})

    def loss(p, batch):
        out, _ = apply.stateful(p, apply.state, batch[0], training=True)
        return XENT(batch[1], out)

    assert_matches_dense(loss, scheme, params, (x, y), rtol=1e-5, atol=1e-6)


def test_trainer_equals_keras_own_training_with_its_state():
    # Keras's train_on_batch with SGD on the same model: the layers the scheme freezes
    # are Keras's non-trainable ones (BatchNorm stays trainable, so both run it in
    # training mode); the moving statistics and the dropout seed advance the same way.
    ours, theirs = _cnn(), _cnn()
    theirs.set_weights(ours.get_weights())
    for name in ("conv1", "dw"):
        theirs.get_layer(name).trainable = False
    theirs.compile(optimizer=keras.optimizers.SGD(0.1), loss=XENT)
    scheme = pj.Scheme({"conv1/**": pj.Frozen(), "dw/**": pj.Frozen()}, default=pj.Full())
    trainer = pk.Trainer(ours, XENT, optimizer=optax.sgd(0.1), scheme=scheme)
    batches = [_images(seed=s) for s in range(3)]
    for x, y in batches:
        want = theirs.train_on_batch(x, y)
        got = trainer((x, y))
        np.testing.assert_allclose(float(got["loss"]), want, rtol=1e-5)
    trainer.update(ours)
    for a, b in zip(ours.variables, theirs.variables):  # the seed generators' names differ
        assert a.path.split("/")[-1] == b.path.split("/")[-1]
        np.testing.assert_allclose(np.asarray(a.value), np.asarray(b.value), rtol=1e-5,
                                   atol=1e-6, err_msg=a.path)
    before = _cnn().get_layer("conv1").kernel
    np.testing.assert_array_equal(np.asarray(ours.get_layer("conv1").kernel.value),
                                  np.asarray(before.value))


def test_fit_saves_a_keras_file_that_another_backend_loads(tmp_path):
    model = _cnn()
    scheme = pj.Scheme({"head/**": pj.Full(), "dw/kernel": pj.Channels(ratio=0.5, axis="out")})
    trainer = pk.Trainer(model, XENT, optimizer=optax.adam(1e-2), scheme=scheme)
    history = trainer.fit([_images(8, seed=s % 2) for s in range(30)], progress=False)
    assert history.loss[-5:].mean() < history.loss[:5].mean()
    trainer.update(model)
    path = tmp_path / "tuned.keras"
    model.save(path)
    x, _ = _images(seed=7)
    want = np.asarray(trainer.apply.stateful(trainer.params(), trainer.model_state, x,
                                             training=False)[0])
    np.testing.assert_allclose(keras.saving.load_model(path).predict(x, verbose=0), want,
                               rtol=1e-5, atol=1e-6)
    np.save(tmp_path / "x.npy", x)
    code = ("import keras, numpy as np, sys; m = keras.saving.load_model(sys.argv[1]); "
            "print(keras.config.backend()); "
            "np.save(sys.argv[2], np.asarray(m(np.load(sys.argv[3]), training=False).detach()))")
    done = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "y.npy"),
                           str(tmp_path / "x.npy")], env={**os.environ, "KERAS_BACKEND": "torch"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "torch", done.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-4, atol=1e-5)


def test_host_cpu_artifact_continues_the_jax_trainer(tmp_path):
    pytest.importorskip("iree.compiler")
    model = _cnn()
    scheme = pj.Scheme({"head/**": pj.Full(), "dw/kernel": pj.Channels(ratio=0.5, axis="out"),
                        "bn1/**": pj.Full()})
    trainer = pk.Trainer(model, XENT, optimizer=optax.adamw(1e-2), scheme=scheme)
    batch = _images(seed=3)
    trainer.export(batch, target="host-cpu", out_dir=str(tmp_path))
    sess = pj.runtime.load(str(tmp_path))
    state = trainer.model_state
    for s in range(2):
        x, y = _images(seed=s)
        b = {"batch": (x, y), "model_state": state}
        out = sess.step(jax.tree_util.tree_map(np.asarray, b))
        metrics = trainer((x, y))
        np.testing.assert_allclose(np.asarray(out["loss"]), np.asarray(metrics["loss"]),
                                   rtol=1e-4)
        state = trainer.model_state
    got = dict(pj.scheme.leaves_with_paths(sess.params())[0])
    for path, want in pj.scheme.leaves_with_paths(trainer.params())[0]:
        np.testing.assert_allclose(got[path], np.asarray(want), rtol=1e-4, atol=1e-5,
                                   err_msg=path)


def test_two_models_of_one_structure_share_their_state_paths():
    """Keras names seed generators by a process-wide counter (`seed_generator_1` in the
    second model); their state is named by the owning layer instead, so the state of one
    model loads into another of the same structure, and an artifact exported from one
    takes the other's state."""
    first, second = _cnn(), _cnn()
    _, apply_first = pk.functional(first)
    _, apply_second = pk.functional(second)
    assert apply_first.state_paths == apply_second.state_paths
    assert "drop/seed_generator_state" in apply_first.state_paths
    state = jax.tree_util.tree_map(lambda a: a + 1, apply_first.state)
    pk.load_state(second, pk.functional(second)[0], state)
    np.testing.assert_array_equal(second.get_layer("bn1").moving_mean.numpy(),
                                  np.asarray(state["bn1"]["moving_mean"]))
    np.testing.assert_array_equal(second.get_layer("drop").seed_generator.state.numpy(),
                                  np.asarray(state["drop"]["seed_generator_state"]))


def test_refusals_name_what_to_do():
    with pytest.raises(TypeError, match="needs a Keras model, got dict"):
        pk.functional({"w": 1})
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="is not built"):
        pk.functional(unbuilt)
    with pytest.raises(TypeError, match=r"keras.losses.get\('mse'\)"):
        pk.Trainer(_cnn(), "mse", optimizer=optax.sgd(0.1))
    trainer = pk.Trainer(_cnn(), XENT, optimizer=optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"\(x, y\) or \(x, y, sample_weight\)"):
        trainer(_images()[0])
    # Keras on another backend: the message says how to get the JAX one
    code = "import keras, pockjax.keras as pk; pk.functional(keras.Sequential())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "KERAS_BACKEND": "torch"}, timeout=300, cwd=ROOT)
    assert "needs Keras 3 on its JAX backend; Keras here runs on 'torch'. Set " \
           "KERAS_BACKEND=jax" in done.stderr, done.stderr[-2000:]


def test_a_mesh_trains_as_one_device():
    # data-parallel and FSDP over the suite's 4 CPU devices: BatchNorm's statistics are
    # over the whole batch either way, and the model's state is replicated
    scheme = pj.Scheme({"head/**": pj.Full(), "bn1/**": pj.Full(),
                        "dw/kernel": pj.Channels(ratio=0.5, axis="out")})
    batches = [_images(8, seed=s) for s in range(3)]
    runs = {}
    for name, kw in {"one": {}, "data": dict(mesh=jax.make_mesh((4,), ("data",))),
                     "fsdp": dict(mesh=jax.make_mesh((4,), ("data",)), param_axis="data")}.items():
        trainer = pk.Trainer(_cnn(), XENT, optimizer=optax.adam(1e-2), scheme=scheme, **kw)
        losses = [float(trainer(b)["loss"]) for b in batches]
        runs[name] = (losses, trainer.params(), trainer.model_state)
    for name in ("data", "fsdp"):
        np.testing.assert_allclose(runs[name][0], runs["one"][0], rtol=1e-5)
        for (p, a), (_, b) in zip(*(pj.scheme.leaves_with_paths(runs[n][1:])[0]
                                    for n in (name, "one"))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}: {p}")


def test_the_paper_mobilenetv2_scheme_on_keras_applications_paths():
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                           classes=5, classifier_activation=None)
    params, _ = pk.functional(model)
    resolved = dict(pj.scheme.leaves_with_paths(
        pj.schemes.mobilenetv2(params, last=2, norms=True).resolve(params))[0])
    trained = sorted(p for p, d in resolved.items() if not isinstance(d, pj.Frozen))
    assert trained == sorted(
        ["block_15_expand/kernel", "block_16_expand/kernel", "predictions/kernel",
         "predictions/bias"] + [f"block_{i}_{part}_BN/{n}" for i in (15, 16)
                                for part in ("expand", "depthwise", "project")
                                for n in ("gamma", "beta")])
    halves = pj.schemes.mobilenetv2(params, last=1, ratio=0.5, classifier=False).resolve(params)
    assert halves["block_16_expand"]["kernel"] == pj.Channels(count=168, axis=3)  # HWIO "out"


def test_files_saved_under_tensorflow_load_and_train(tmp_path):
    """A `.keras` file and a legacy `.h5` written by Keras on TensorFlow come in through
    `pockjax.keras` with TensorFlow's outputs, and train."""
    try:  # not imported here: tests/conftest.py keeps TensorFlow out of test processes
        importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("TensorFlow is not installed")
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "import keras, numpy as np\n"
            "from tests.keras.tf_model import cnn\n"
            "m = cnn(); x = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype('float32')\n"
            "m.save(sys.argv[1] + '/m.keras'); m.save(sys.argv[1] + '/m.h5')\n"
            "np.save(sys.argv[1] + '/x.npy', x)\n"
            "np.save(sys.argv[1] + '/y.npy', np.asarray(m(x, training=False)))\n"
            "print(keras.config.backend())\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "KERAS_BACKEND": "tensorflow",
                               "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert done.returncode == 0 and done.stdout.strip().endswith("tensorflow"), done.stderr[-2000:]
    x, want = np.load(tmp_path / "x.npy"), np.load(tmp_path / "y.npy")
    for name in ("m.keras", "m.h5"):
        model = keras.saving.load_model(tmp_path / name, compile=False)
        params, apply = pk.functional(model)
        np.testing.assert_allclose(np.asarray(apply(params, x)), want, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        trainer = pk.Trainer(model, XENT, optimizer=optax.sgd(0.1),
                             scheme=pj.Scheme({"head/**": pj.Full()}))
        labels = np.array([0, 1, 2, 3])
        first = float(trainer((x, labels))["loss"])
        for _ in range(5):
            last = float(trainer((x, labels))["loss"])
        assert last < first, name
