"""`pockjax.onnx`: ONNX files (torch's two exporters, external data) as params + a pure
function. Outputs against onnxruntime, gradients against dense `jax.grad`, training
against torch on the module the file came from, named axes from the reading nodes, the
merged-initializer tie reported, an IREE artifact, and the refusals."""
from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest

import pockjax as pj
from tests.helpers import assert_artifact_follows, assert_matches_dense

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.dw = torch.nn.Conv2d(8, 8, 3, groups=8)
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.nn.functional.relu6(self.bn(self.conv(x)))
        return self.fc(torch.flatten(self.pool(self.dw(h)), 1))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.ln, self.fc2 = (torch.nn.Linear(6, 16), torch.nn.LayerNorm(16),
                                       torch.nn.Linear(16, 3))
        with torch.no_grad():  # not the fresh ones and zeros an exporter could merge
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.1, 0.1)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.ln(self.fc1(x))))


def _export(module, args, path, dynamo):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), args, str(path), dynamo=dynamo,
                          opset_version=18 if dynamo else 17)
    return path


def _images(n=2, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, 3, 8, 8)).astype(np.float32)
    x[0, :, :2] = 0.0
    return x


@pytest.mark.parametrize("dynamo", [False, True])
def test_outputs_equal_onnxruntime(tmp_path, dynamo):
    torch.manual_seed(0)
    path = _export(CNN(), (torch.tensor(_images()),), tmp_path / "cnn.onnx", dynamo)
    params, apply = pj.onnx.load(path)
    x = _images(seed=1)
    want = ort.InferenceSession(str(path)).run(None, {apply.inputs[0]: x})[0]
    np.testing.assert_allclose(np.asarray(jax.jit(apply)(params, x)), want, rtol=1e-5,
                               atol=1e-6)


def test_a_gpt2_export_runs_and_its_merged_layer_norms_are_reported(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = transformers.GPT2LMHeadModel(config).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ids = np.random.default_rng(0).integers(0, 64, (2, 8))
    path = _export(Logits(), (torch.tensor(ids),), tmp_path / "gpt2.onnx", dynamo=True)
    with pytest.warns(UserWarning, match=r"read by nodes of different layers.*ln_1/weight"):
        params, apply = pj.onnx.load(path)
    # fresh LayerNorm scales (all ones) of every layer came out as one tensor: a tie
    tied = [p for p in apply.shared if p.endswith("ln_1/weight")]
    assert tied and len(apply.shared[tied[0]]) >= 4
    want = ort.InferenceSession(str(path)).run(None, {apply.inputs[0]: ids})[0]
    np.testing.assert_allclose(np.asarray(jax.jit(apply)(params, ids)), want, rtol=1e-5,
                               atol=1e-5)


def test_sparse_grad_equals_jax_grad_with_named_axes(tmp_path):
    torch.manual_seed(0)
    path = _export(CNN(), (torch.tensor(_images()),), tmp_path / "cnn.onnx", dynamo=False)
    params, apply = pj.onnx.load(path)
    conv = [p for p, x in pj.scheme.leaves_with_paths(params)[0] if x.shape == (8, 3, 3, 3)][0]
    scheme = pj.Scheme({conv: pj.Channels(count=4, axis="out"),
                        "fc/weight": pj.Channels(count=2, axis="in"), "fc/bias": pj.Full()})
    resolved = dict(pj.scheme.leaves_with_paths(scheme.resolve(params))[0])
    assert resolved[conv] == pj.Channels(count=4, axis=0)     # Conv [out, in, kh, kw]
    assert resolved["fc/weight"] == pj.Channels(count=2, axis=1)  # Gemm transB=1 [out, in]
    labels = np.array([1, 3])

    def loss(p, b):
        logits = apply(p, b[0])
        return -jax.numpy.mean(jax.nn.log_softmax(logits)[np.arange(2), b[1]])

    assert_matches_dense(loss, scheme, params, (_images(seed=2), labels), rtol=1e-5,
                         atol=1e-6)


def test_training_equals_torch_on_the_module_the_file_came_from(tmp_path):
    torch.manual_seed(0)
    module = MLP()
    x = np.random.default_rng(3).normal(size=(5, 6)).astype(np.float32)
    y = np.array([0, 2, 1, 1, 0])
    path = _export(module, (torch.tensor(x),), tmp_path / "mlp.onnx", dynamo=False)
    params, apply = pj.onnx.load(path)
    assert not apply.shared
    scheme = pj.Scheme({"fc2/**": pj.Full(), "ln/**": pj.Full()})

    def loss(p, b):
        return -jax.numpy.mean(jax.nn.log_softmax(apply(p, b[0]))[np.arange(5), b[1]])

    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=scheme)
    state = trainer.init(params)
    trained = [module.fc2.weight, module.fc2.bias, module.ln.weight, module.ln.bias]
    opt = torch.optim.SGD(trained, lr=0.1)
    for _ in range(3):
        state, metrics = trainer(state, (x, y))
        opt.zero_grad()
        want = torch.nn.functional.cross_entropy(module(torch.tensor(x)), torch.tensor(y))
        want.backward()
        opt.step()
        np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
    for name, t in module.named_parameters():
        node = state.params
        for k in name.split("."):
            node = node[k]
        np.testing.assert_allclose(np.asarray(node), t.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_external_data_and_an_artifact(tmp_path):
    pytest.importorskip("iree.compiler")
    torch.manual_seed(0)
    path = _export(MLP(), (torch.zeros(5, 6),), tmp_path / "mlp.onnx", dynamo=False)
    model = onnx.load(str(path))
    onnx.save_model(model, str(tmp_path / "ext.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="ext.onnx.data", size_threshold=0)
    assert (tmp_path / "ext.onnx.data").stat().st_size > 0
    params, apply = pj.onnx.load(tmp_path / "ext.onnx")
    ref, _ = pj.onnx.load(path)
    jax.tree_util.tree_map(np.testing.assert_array_equal, params, ref)
    x = np.random.default_rng(4).normal(size=(5, 6)).astype(np.float32)
    assert_artifact_follows(apply, params, x, tmp_path / "art", pj.Scheme({"fc2/**": pj.Full()}))


def _graph(nodes, opset=17):
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                          [4, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(NotImplementedError, match=r"does not run: Hardmax \(h1\).*OPS"):
        pj.onnx.load(_graph([helper.make_node("Gemm", ["x", "w"], ["z"], transB=1),
                             helper.make_node("Hardmax", ["z"], ["y"], name="h1")]))
    with pytest.raises(ValueError, match="opset is 12; pockjax.onnx runs opset 13 and later"):
        pj.onnx.load(_graph([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], 12))
    with pytest.raises(FileNotFoundError, match="no ONNX file"):
        pj.onnx.load(tmp_path / "missing.onnx")
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not an ONNX model"):
        pj.onnx.load(tmp_path / "bad.onnx")
    params, apply = pj.onnx.load(_graph([helper.make_node("Gemm", ["x", "w"], ["y"],
                                                          transB=1)]))
    with pytest.raises(TypeError, match=r"takes 1 inputs \(x\), got 2"):
        apply(params, np.ones((4, 2), np.float32), np.ones(1))
