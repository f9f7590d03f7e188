"""Models that come in through the Keras and ONNX frontends, exported to the device
targets: the android-vulkan artifact on this machine's Vulkan device (lavapipe in CI)
and the android-arm64 one under qemu-aarch64 follow the JAX trainer step by step, losses
and parameters, as the JAX models' artifacts do (`test_vulkan.py`, `test_arm64.py`).
The Keras model carries BatchNorm statistics through the step; the ONNX one is a file
torch wrote, with a depth-wise convolution and BatchNorm folded into its weights."""
from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax import runtime
from tests.export.models import run_against_jax, run_vulkan_against_jax
from tests.helpers import assert_trees_close

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RUNTIME = os.environ.get("POCKJAX_ARM64_RUNTIME", os.path.join(ROOT, ".cache", "iree-aarch64"))
TARGETS = ["android-vulkan", "android-arm64"]
STEPS = 2


def _session(path, target, workdir):
    if target == "android-arm64":
        return runtime.ToolSession(path, runtime.qemu_arm64(RUNTIME), workdir=workdir)
    return runtime.load(path, device="vulkan")


@pytest.mark.parametrize("target", TARGETS)
def test_a_keras_model_with_batchnorm_follows_the_jax_trainer(target, tmp_path):
    import pockjax.keras as pk  # before keras: chooses Keras's JAX backend
    from tests.keras.test_keras import XENT, _cnn, _images

    scheme = pj.Scheme({"head/**": pj.Full(), "dw/kernel": pj.Channels(ratio=0.5, axis="out"),
                        "bn1/**": pj.Full()})

    def trainer():
        return pk.Trainer(_cnn(), XENT, optimizer=optax.adamw(1e-2), scheme=scheme)

    art = trainer().export(_images(seed=3), target=target, out_dir=str(tmp_path / "art"))
    for attempt in range(3):  # lavapipe loses the device at random (run_vulkan_against_jax)
        jax_trainer = trainer()
        sess = _session(art.path, target, tmp_path / f"run{attempt}")
        try:
            state = jax_trainer.model_state
            for s in range(STEPS):
                x, y = _images(seed=s)
                out = sess.step(jax.tree_util.tree_map(
                    np.asarray, {"batch": (x, y), "model_state": state}))
                want = jax_trainer((x, y))
                np.testing.assert_allclose(np.asarray(out["loss"]), np.asarray(want["loss"]),
                                           rtol=1e-4, err_msg=f"step {s + 1}")
                state = jax_trainer.model_state
            break
        except runtime.DeviceLost as e:
            if attempt == 2:
                raise
            warnings.warn(f"attempt {attempt + 1}: {e}; repeating the run on a new device")
    assert_trees_close(sess.params(), jax.device_get(jax_trainer.params()), rtol=1e-4,
                       atol=1e-5)


@pytest.mark.parametrize("target", TARGETS)
def test_an_onnx_file_follows_the_jax_trainer(target, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from tests.onnx.test_onnx import CNN, _export, _images

    path = _export(CNN(), (torch.tensor(_images()),), tmp_path / "cnn.onnx", dynamo=False)
    params, apply = pj.onnx.load(path)
    labels = np.array([1, 3], np.int32)

    def loss(p, batch):
        logits = apply(p, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2),
                              scheme=pj.Scheme({"fc/**": pj.Full(), "dw/bias": pj.Full(),
                                                "dw/weight": pj.Channels(ratio=0.5,
                                                                         axis="out")}))
    batch = {"x": _images(seed=1), "y": labels}
    art = trainer.export(trainer.init(params), batch, target=target,
                         out_dir=str(tmp_path / "art"))
    if target == "android-arm64":
        run_against_jax(_session(art.path, target, tmp_path / "run"), trainer, params, batch,
                        STEPS)
    else:
        run_vulkan_against_jax(art.path, trainer, params, batch, STEPS)
