"""`pockjax.tf`'s cases, run by `test_tf.py` in a process of their own: tf.Modules,
tf.functions and SavedModels through tf2jax as params + a pure function, against
TensorFlow's own outputs, gradients (GradientTape) and training; the module's docstring
examples."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax.tf  # noqa: E402,F401  (before TensorFlow: Keras's backend stays JAX)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf2jax")

import pockjax as pj  # noqa: E402
from tests.helpers import assert_artifact_follows, assert_matches_dense  # noqa: E402

MOMENTUM = 0.9


class Net(tf.Module):
    """A conv net written in TensorFlow's own API: a convolution, a depthwise
    convolution, batch norm with moving statistics it assigns in training, a dense head
    stored `[out, in]` (read with transpose_b) and an embedding table added to the
    features."""

    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)

        def var(shape, name, scale=0.3, trainable=True):
            return tf.Variable(rng.normal(size=shape).astype(np.float32) * scale, name=name,
                               trainable=trainable)
        self.conv = var((3, 3, 3, 8), "conv/kernel")
        self.depthwise = var((3, 3, 8, 1), "dw/depthwise_kernel")
        self.gamma = tf.Variable(np.ones(8, np.float32), name="bn/gamma")
        self.beta = tf.Variable(np.zeros(8, np.float32), name="bn/beta")
        self.mean = tf.Variable(np.zeros(8, np.float32), name="bn/moving_mean", trainable=False)
        self.var = tf.Variable(np.ones(8, np.float32), name="bn/moving_variance",
                               trainable=False)
        self.embed = var((5, 8), "embed/table")
        self.head = var((4, 8), "head/kernel")
        self.bias = tf.Variable(np.zeros(4, np.float32), name="head/bias")

    @tf.function
    def __call__(self, x, ids):
        h = tf.nn.conv2d(x, self.conv, 1, "SAME")
        h = tf.nn.depthwise_conv2d(h, self.depthwise, [1, 1, 1, 1], "SAME")
        mean, var = tf.nn.moments(h, [0, 1, 2])
        self.mean.assign(MOMENTUM * self.mean + (1 - MOMENTUM) * mean)
        self.var.assign(MOMENTUM * self.var + (1 - MOMENTUM) * var)
        h = tf.nn.relu(tf.nn.batch_normalization(h, mean, var, self.beta, self.gamma, 1e-3))
        h = tf.reduce_mean(h, [1, 2]) + tf.nn.embedding_lookup(self.embed, ids)
        return tf.matmul(h, self.head, transpose_b=True) + self.bias


class Mlp(tf.Module):
    def __init__(self):
        rng = np.random.default_rng(1)
        self.w1 = tf.Variable(rng.normal(size=(6, 16)).astype(np.float32) * 0.4, name="fc1/kernel")
        self.b1 = tf.Variable(np.zeros(16, np.float32), name="fc1/bias")
        self.w2 = tf.Variable(rng.normal(size=(16, 3)).astype(np.float32) * 0.4, name="fc2/kernel")

    @tf.function(input_signature=[tf.TensorSpec([5, 6], tf.float32)])
    def __call__(self, x):
        return tf.matmul(tf.nn.gelu(tf.matmul(x, self.w1) + self.b1), self.w2)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 6, 6, 3)).astype(np.float32)
    x[0, 0] = 0.0  # an exact-zero row of pixels
    return x, np.array([0, 4], np.int32), np.array([1, 3], np.int32)


def _xent(logits, labels):
    return -jnp.mean(jax.nn.log_softmax(logits)[np.arange(len(labels)), labels])


def test_outputs_state_and_layouts_equal_tensorflows():
    net = Net()
    x, ids, _ = _batch()
    params, apply = pj.tf.load(net, x, ids)
    assert set(params) == {"conv", "dw", "bn", "embed", "head"}
    assert set(apply.state["bn"]) == {"moving_mean", "moving_variance"}
    out, state = apply.stateful(params, apply.state, x, ids)
    want = net(x, ids)          # TensorFlow's own call assigns the moving statistics
    np.testing.assert_allclose(np.asarray(out), want.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(state["bn"]["moving_mean"]), net.mean.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state["bn"]["moving_variance"]), net.var.numpy(),
                               rtol=1e-5, atol=1e-6)
    resolved = pj.Scheme({"conv/kernel": pj.Channels(count=2, axis="in"),
                          "dw/depthwise_kernel": pj.Channels(count=2, axis="out"),
                          "embed/table": pj.Channels(count=2, axis="out"),
                          "head/kernel": pj.Channels(count=2, axis="in")}).resolve(params)
    assert resolved["conv"]["kernel"].axis == 2          # HWIO
    assert resolved["dw"]["depthwise_kernel"].axis == 2  # the channels
    assert resolved["embed"]["table"].axis == 1          # [vocabulary, width]
    assert resolved["head"]["kernel"].axis == 1          # [out, in] read with transpose_b


def test_gradients_equal_gradient_tape_and_sparse_grad_equals_jax_grad():
    net = Net(seed=2)
    x, ids, labels = _batch(1)
    params, apply = pj.tf.load(net, x, ids)
    names = {"conv/kernel": net.conv, "dw/depthwise_kernel": net.depthwise, "bn/gamma": net.gamma,
             "bn/beta": net.beta, "embed/table": net.embed, "head/kernel": net.head,
             "head/bias": net.bias}
    with tf.GradientTape() as tape:
        logits = net(x, ids)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))
    tape_grads = dict(zip(names, tape.gradient(loss, list(names.values()))))

    def loss_fn(p, b):
        return _xent(apply.stateful(p, apply.state, b[0], b[1])[0], b[2])

    grads = dict(pj.scheme.leaves_with_paths(jax.grad(loss_fn)(params, (x, ids, labels)))[0])
    for name, want in tape_grads.items():
        want = tf.convert_to_tensor(want).numpy()  # the embedding's IndexedSlices too
        np.testing.assert_allclose(np.asarray(grads[name]), want, rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    scheme = pj.Scheme({"conv/kernel": pj.Channels(count=3, axis="out"),
                        "head/kernel": pj.Channels(count=1, axis="in"), "bn/**": pj.Full()})
    assert_matches_dense(loss_fn, scheme, params, (x, ids, labels), rtol=1e-5, atol=1e-6)


def test_training_equals_tensorflows_own_sgd():
    net = Mlp()
    x = np.random.default_rng(3).normal(size=(5, 6)).astype(np.float32)
    y = np.array([0, 2, 1, 1, 0])
    params, apply = pj.tf.load(net, x)
    trainer = pj.sparse_train(lambda p, b: _xent(apply(p, b[0]), b[1]), optimizer=optax.sgd(0.1),
                              scheme=pj.Scheme({"fc2/**": pj.Full(), "fc1/bias": pj.Full()}))
    state = trainer.init(params)
    for _ in range(3):
        state, metrics = trainer(state, (x, y))
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, net(x)))
        for v, g in zip([net.w2, net.b1], tape.gradient(loss, [net.w2, net.b1])):
            v.assign_sub(0.1 * g)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(state.params["fc2"]["kernel"]), net.w2.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.params["fc1"]["bias"]), net.b1.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.params["fc1"]["kernel"]), net.w1.numpy())


def test_a_saved_model_by_call_and_by_signature_and_an_artifact(tmp_path):
    net = Mlp()
    tf.saved_model.save(net, str(tmp_path / "sm"), signatures=net.__call__)
    x = np.random.default_rng(4).normal(size=(5, 6)).astype(np.float32)
    want = net(x).numpy()
    for signature in (None, "serving_default"):
        params, apply = pj.tf.load(tmp_path / "sm", x, signature=signature)
        np.testing.assert_allclose(np.asarray(apply(params, x)), want, rtol=1e-5, atol=1e-6)
    pytest.importorskip("iree.compiler")
    assert_artifact_follows(apply, params, x, tmp_path / "art", pj.Scheme({"fc2/**": pj.Full()}))


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a SavedModel directory"):
        pj.tf.load(tmp_path, np.zeros((5, 6), np.float32))
    with pytest.raises(ValueError, match="needs example inputs"):
        pj.tf.load(Mlp())
    tf.saved_model.save(Mlp(), str(tmp_path / "sm"))
    with pytest.raises(KeyError, match="no signature 'train'"):
        pj.tf.load(tmp_path / "sm", np.zeros((5, 6), np.float32), signature="train")

    class Frozen(tf.Module):
        def __init__(self):
            self.w = tf.Variable(np.ones((6, 2), np.float32), trainable=False)

        @tf.function
        def __call__(self, x):
            return tf.matmul(x, self.w)
    with pytest.raises(ValueError, match="no trainable variable"):
        pj.tf.load(Frozen(), np.zeros((5, 6), np.float32))
    with pytest.raises(TypeError, match="takes a SavedModel directory"):
        pj.tf.load(3, np.zeros((5, 6), np.float32))


def test_docstring_examples():
    import doctest

    result = doctest.testmod(pockjax.tf, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
