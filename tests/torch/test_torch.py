"""pockjax.torch against PyTorch's own autograd and AdamW.

Small random models: Hugging Face LLaMA, Qwen2 (attention biases), GPT-2 (Conv1D,
tied embeddings), BERT for sequence classification, and a torchvision-style
MobileNetV2 block (conv, BatchNorm in train mode, depth-wise conv, pooling).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if __import__("importlib.util").util.find_spec("torchax") is None:
    pytest.skip("torchax is not installed (pip install --no-deps torchax)", allow_module_level=True)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import pockjax as pj  # noqa: E402
import pockjax.torch as pt  # noqa: E402
from pockjax.scheme import leaves_with_paths  # noqa: E402

LR, WD = 1e-2, 0.01
V, T, B = 64, 8, 2


def _cfg(kind):
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32)
    if kind == "llama":
        return transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common)
    if kind == "qwen2":
        return transformers.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common)
    if kind == "bert":
        return transformers.BertConfig(intermediate_size=64, num_labels=3, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0, **common)
    return transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class ConvBN(torch.nn.Sequential):
    def __init__(self, cin, cout, k, stride=1, groups=1):
        super().__init__(torch.nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
                         torch.nn.BatchNorm2d(cout), torch.nn.ReLU6())


class Inverted(torch.nn.Module):
    def __init__(self, c, t):
        super().__init__()
        h = c * t
        self.conv = torch.nn.Sequential(ConvBN(c, h, 1), ConvBN(h, h, 3, groups=h),
                                        torch.nn.Conv2d(h, c, 1, bias=False), torch.nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.conv(x)


class TinyMobileNet(torch.nn.Module):
    """torchvision's mobilenet_v2 naming: features/{i}/conv/0/0 is the expansion conv."""

    def __init__(self, classes=5):
        super().__init__()
        self.features = torch.nn.Sequential(ConvBN(3, 8, 3, stride=2), Inverted(8, 2), Inverted(8, 2))
        self.pool = torch.nn.AdaptiveAvgPool2d(1)
        self.classifier = torch.nn.Sequential(torch.nn.Dropout(0.0), torch.nn.Linear(8, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


# --------------------------------------------------------------------------- cases

def _lm_loss_torch(m, b):
    logits = m(input_ids=torch.tensor(b["ids"]), use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V),
                                             torch.tensor(b["ids"]).long()[:, 1:].reshape(-1))


def _xent(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1))


class Case:
    """A torch model, its pockjax function, the losses on both sides and a scheme that
    has Full, Frozen and Channels leaves on both named axes."""

    def __init__(self, kind):
        torch.manual_seed(0)
        rs = np.random.RandomState(0)
        self.kind, self.stateful = kind, kind == "cnn"
        if kind == "cnn":
            self.module = TinyMobileNet().train()
            self.batch = {"x": rs.randn(B, 3, 8, 8).astype(np.float32),
                          "y": rs.randint(0, 5, (B,)).astype(np.int32)}
            self.params, self.apply = pt.functional(self.module)
            self.torch_loss = lambda m, b: torch.nn.functional.cross_entropy(
                m(torch.tensor(b["x"])), torch.tensor(b["y"]).long())
            self.scheme = pj.Scheme({
                "features/1/conv/0/0/weight": pj.Channels(count=8, axis="out"),  # OIHW axis 0
                "features/2/conv/0/0/weight": pj.Channels(count=3, axis="in"),   # OIHW axis 1
                "features/2/conv/1/0/weight": pj.Full(),                         # depth-wise
                "features/*/conv/3/*": pj.Full(),                                # BN scale/bias
                "classifier/**": pj.Full()})
            return
        if kind == "bert":
            self.module = transformers.BertForSequenceClassification(_cfg(kind))
        else:
            self.module = transformers.AutoModelForCausalLM.from_config(_cfg(kind))
        self.module.eval()
        ids = rs.randint(0, V, (B, T)).astype(np.int32)
        if kind == "bert":
            self.batch = {"ids": ids, "y": rs.randint(0, 3, (B,)).astype(np.int32)}
            self.torch_loss = lambda m, b: torch.nn.functional.cross_entropy(
                m(input_ids=torch.tensor(b["ids"])).logits, torch.tensor(b["y"]).long())
            blk, proj, mlp, head = ("bert/encoder/layer/1", "attention/self/query",
                                    "intermediate/dense", "classifier/**")
        else:
            self.batch = {"ids": ids}
            self.torch_loss = _lm_loss_torch
            if kind == "gpt2":
                blk, proj, mlp, head = "transformer/h/1", "attn/c_attn", "mlp/c_fc", "transformer/ln_f/*"
            else:
                blk, proj, mlp, head = "model/layers/1", "self_attn/q_proj", "mlp/up_proj", "model/norm/*"
        self.params, self.apply = pt.functional(self.module, output=lambda o: o.logits)
        rules = {f"{blk}/{proj}/weight": pj.Channels(count=8, axis="out"),
                 f"{blk}/{mlp}/weight": pj.Channels(count=16, axis="in"),
                 head: pj.Full()}
        if kind != "llama":   # attention biases
            rules[f"{blk}/{proj}/bias"] = pj.Full()
        self.scheme = pj.Scheme(rules)

    # the JAX loss: (loss, new buffers) for the stateful CNN
    def loss(self, params, batch):
        if self.kind == "cnn":
            logits, buffers = self.apply.stateful(params, batch["buffers"], batch["x"])
            return _xent(logits, batch["y"]), {"buffers": buffers}
        if self.kind == "bert":
            return _xent(self.apply(params, input_ids=batch["ids"]), batch["y"])
        logits = self.apply(params, input_ids=batch["ids"], use_cache=False)
        return _xent(logits[:, :-1], batch["ids"][:, 1:])

    def jax_batch(self, buffers=None):
        b = jax.tree_util.tree_map(jnp.asarray, self.batch)
        if self.stateful:
            b["buffers"] = self.apply.buffers if buffers is None else buffers
        return b

    def torch_tensor(self, path):
        return self.module.get_parameter(path.replace("/", "."))

    def state_copy(self):
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}


KINDS = ["llama", "qwen2", "gpt2", "bert", "cnn"]


@pytest.fixture(scope="module", params=KINDS)
def case(request):
    return Case(request.param)


def _slice(x, d):
    if isinstance(d, pj.Channels):
        ax, lo, hi = d.bounds(x.shape)
        return np.take(x, np.arange(lo, hi), axis=ax)
    return x


# --------------------------------------------------------------------------- tests


def test_forward_equals_torch(case):
    with torch.no_grad():
        before = case.state_copy()
        if case.kind == "cnn":
            want = case.module(torch.tensor(case.batch["x"])).numpy()
            got, buffers = case.apply.stateful(case.params, case.apply.buffers,
                                               jnp.asarray(case.batch["x"]))
            for name, t in case.module.named_buffers():   # running statistics as torch updates them
                np.testing.assert_allclose(np.asarray(pt._flatten(buffers)[name]), t.numpy(),
                                           rtol=1e-5, atol=1e-6)
            case.module.load_state_dict(before)
        elif case.kind == "bert":
            want = case.module(input_ids=torch.tensor(case.batch["ids"])).logits.numpy()
            got = case.apply(case.params, input_ids=jnp.asarray(case.batch["ids"]))
        else:
            want = case.module(input_ids=torch.tensor(case.batch["ids"]), use_cache=False).logits.numpy()
            got = case.apply(case.params, input_ids=jnp.asarray(case.batch["ids"]), use_cache=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_layouts_name_features(case):
    """'in'/'out' resolve through each leaf's layout; a wrong axis would slip by silently."""
    decisions = dict(leaves_with_paths(case.scheme.resolve(case.params))[0])
    for path, d in decisions.items():
        if not isinstance(d, pj.Channels):
            continue
        rule = case.scheme.match(path)
        m = case.module.get_submodule(".".join(path.split("/")[:-1]))
        kind = type(m).__name__
        want = {"Conv1D": {"in": 0, "out": 1}}.get(kind, {"in": 1, "out": 0})[rule.axis]
        assert d.axis == want, (path, kind, d)
        feature = {"Linear": ("in_features", "out_features"), "Conv2d": ("in_channels", "out_channels"),
                   "Conv1D": (None, "nf")}[kind]
        if kind != "Conv1D":
            name = feature[0] if rule.axis == "in" else feature[1]
            assert case.torch_tensor(path).shape[d.axis] == getattr(m, name)


def test_sparse_grad_equals_torch_backward(case):
    case.module.zero_grad()
    before = case.state_copy()
    case.torch_loss(case.module, case.batch).backward()
    case.module.load_state_dict(before)  # BatchNorm's running statistics as they were
    fn = pj.sparse_grad(case.loss, case.scheme, has_aux=case.stateful)
    g = fn(case.params, case.jax_batch())
    g = g[0] if case.stateful else g
    decisions = dict(leaves_with_paths(case.scheme.resolve(case.params))[0])
    kinds = set()
    for path, d in decisions.items():
        node = g
        for k in path.split("/"):
            node = node[k]
        if isinstance(d, pj.Frozen):
            assert node is None
            kinds.add("frozen")
            continue
        kinds.add(type(d).__name__ + (str(d.axis) if isinstance(d, pj.Channels) else ""))
        want = _slice(case.torch_tensor(path).grad.numpy(), d)
        np.testing.assert_allclose(np.asarray(node), want, rtol=1e-4, atol=1e-6, err_msg=path)
    assert {"frozen", "Full", "Channels0", "Channels1"} <= kinds, kinds


def _torch_adamw_steps(case, steps):
    """torch.optim.AdamW on the Full tensors; the same update by hand on Channels slices."""
    decisions = dict(leaves_with_paths(case.scheme.resolve(case.params))[0])
    full = [case.torch_tensor(p) for p, d in decisions.items() if isinstance(d, pj.Full)]
    chans = [(case.torch_tensor(p), d) for p, d in decisions.items() if isinstance(d, pj.Channels)]
    opt = torch.optim.AdamW(full, lr=LR, weight_decay=WD, eps=1e-8)
    moments = [(torch.zeros_like(_idx(t.data, d)), torch.zeros_like(_idx(t.data, d))) for t, d in chans]
    for step in range(1, steps + 1):
        case.module.zero_grad()
        case.torch_loss(case.module, case.batch).backward()
        opt.step()
        with torch.no_grad():
            for (t, d), (m, v) in zip(chans, moments):
                g, p = _idx(t.grad, d), _idx(t.data, d)
                m.mul_(0.9).add_(0.1 * g)
                v.mul_(0.999).add_(0.001 * g * g)
                mh, vh = m / (1 - 0.9 ** step), v / (1 - 0.999 ** step)
                new = p * (1 - LR * WD) - LR * mh / (vh.sqrt() + 1e-8)
                ax, lo, hi = d.bounds(tuple(t.shape))
                t.data.narrow(ax, lo, hi - lo).copy_(new)


def _idx(t, d):
    ax, lo, hi = d.bounds(tuple(t.shape))
    return t.narrow(ax, lo, hi - lo)


@pytest.fixture(scope="module")
def trained(case):
    """3 steps of pockjax (jitted, fused AdamW) and of torch AdamW from the same start."""
    trainer = pj.sparse_train(case.loss, optimizer=optax.adamw(LR, weight_decay=WD, eps=1e-8),
                              scheme=case.scheme, has_aux=case.stateful)
    state = trainer.init(case.params)
    buffers = None
    for _ in range(3):
        state, metrics = trainer(state, case.jax_batch(buffers))
        if case.stateful:
            buffers = metrics["aux"]["buffers"]
    start = case.state_copy()
    _torch_adamw_steps(case, 3)
    after = case.state_copy()
    case.module.load_state_dict(start)
    return trainer, state, buffers, after


def test_three_adamw_steps_equal_torch(case, trained):
    _, state, buffers, after = trained
    flat = pt._flatten(state.params)
    assert set(flat) == {k for k in dict(case.module.named_parameters())}
    for name, value in flat.items():
        np.testing.assert_allclose(np.asarray(value), after[name].numpy(), rtol=2e-4, atol=1e-4,
                                   err_msg=name)
    if buffers is not None:
        for name, value in pt._flatten(buffers).items():
            np.testing.assert_allclose(np.asarray(value), after[name].numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


def test_load_state_round_trip(case, trained):
    _, state, buffers, after = trained
    start = case.state_copy()
    try:
        written = pt.load_state(case.module, state.params)
        if buffers is not None:
            written += pt.load_state(case.module, buffers)
        assert len(written) >= len(pt._flatten(state.params))
        for name, t in case.module.state_dict().items():
            if name in after:
                assert t.dtype == after[name].dtype
                np.testing.assert_allclose(t.numpy(), after[name].numpy(), rtol=2e-4, atol=1e-4)
        again, _ = pt.functional(case.module, output=case.apply.output)
        for (p, a), (_, b) in zip(leaves_with_paths(again)[0], leaves_with_paths(state.params)[0]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=p)
        if case.kind == "gpt2":  # tied: lm_head follows wte
            assert case.module.lm_head.weight is case.module.transformer.wte.weight
    finally:
        case.module.load_state_dict(start)


@pytest.mark.parametrize("kind", ["llama", "cnn"])
def test_host_cpu_artifact_continues_the_jax_trainer(kind, tmp_path):
    pytest.importorskip("iree.compiler")
    c = Case(kind)
    trainer = pj.sparse_train(c.loss, optimizer=optax.adamw(LR, weight_decay=WD, eps=1e-8),
                              scheme=c.scheme, has_aux=c.stateful)
    state = trainer.init(c.params)
    batch = c.jax_batch()
    trainer.export(state, batch, target="host-cpu", out_dir=str(tmp_path))
    sess = pj.runtime.load(str(tmp_path))
    buffers = None
    for _ in range(2):
        b = c.jax_batch(buffers)
        state, metrics = trainer(state, b)
        out = sess.step(jax.tree_util.tree_map(np.asarray, b))
        np.testing.assert_allclose(np.asarray(out["loss"]), np.asarray(metrics["loss"]), rtol=1e-4)
        if c.stateful:
            buffers = metrics["aux"]["buffers"]
    got = sess.params()
    for (p, a), (_, b) in zip(leaves_with_paths(got)[0], leaves_with_paths(state.params)[0]):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=p)
    names = pt.load_state(c.module, got)           # back into PyTorch from the artifact
    assert names and np.allclose(c.module.get_parameter(names[0].replace("/", ".")).detach().numpy(),
                                 pt._flatten(got)[names[0]], atol=1e-6)


def test_schemes_and_search_candidates_on_torch_params():
    c = Case("llama")
    s = pj.schemes.transformer(c.params, last=1, ratio=0.5, axis="in", norms=True,
                               extra=["lm_head/**"])
    d = s.resolve(c.params)["model"]["layers"]["1"]
    assert d["self_attn"]["q_proj"]["weight"] == pj.Channels(count=16, axis=1)
    assert d["mlp"]["down_proj"]["weight"] == pj.Frozen()
    assert d["input_layernorm"]["weight"] == pj.Full()
    assert isinstance(s.resolve(c.params)["model"]["layers"]["0"]["mlp"]["up_proj"]["weight"], pj.Frozen)
    assert len(pj.schemes.last_blocks(c.params, 1, extra=["model/norm/**"]).rules) == 2
    assert pj.schemes.bias_only(Case("qwen2").params).resolve(Case("qwen2").params)
    from pockjax.scheme_search import find_candidates
    cands = {x.name: x for x in find_candidates(c.params, ratios=(0.5,), axis="out")}
    (path, dec), = cands["model/layers/0/mlp/up_proj/weight 1/2 out"].rules \
        if "model/layers/0/mlp/up_proj/weight 1/2 out" in cands else next(
            x for n, x in cands.items() if n.startswith("model/layers/0/mlp/up_proj/weight") and "out" in n).rules
    assert dec == pj.Channels(count=32, axis=0)   # [out=64, in=32]: half the outputs
    cnn = Case("cnn")
    s = pj.schemes.mobilenetv2(cnn.params, last=1, ratio=0.5, axis="in", norms=True)
    d = dict(leaves_with_paths(s.resolve(cnn.params))[0])
    assert d["features/2/conv/0/0/weight"] == pj.Channels(count=4, axis=1)
    assert d["features/1/conv/0/0/weight"] == pj.Frozen()
    assert d["classifier/1/weight"] == pj.Full()


def test_report_runs_on_torch_model():
    c = Case("llama")
    trainer = pj.sparse_train(c.loss, optimizer=optax.adamw(LR), scheme=c.scheme)
    state = trainer.init(c.params)
    rep = trainer.report(state, c.jax_batch())
    assert "FLOP" in str(rep) or "flop" in str(rep).lower()


# --------------------------------------------------------------------------- errors


def test_forward_returning_a_non_array_is_a_clear_error():
    c = Case("llama")
    _, apply = pt.functional(c.module)   # no output=: a CausalLMOutputWithPast comes back
    with pytest.raises(TypeError, match=r"output=lambda out: out.logits"):
        apply(c.params, jnp.asarray(c.batch["ids"]))


def test_unsupported_op_names_torchax_message_and_module():
    class Spread(torch.nn.Module):
        def forward(self, x):
            return torch.special.airy_ai(x)

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Spread())
    params, apply = pt.functional(net)
    with pytest.raises(NotImplementedError, match=r"'1' \(Spread\).*aten::special_airy_ai.*override_op_definition"):
        apply(params, jnp.ones((2, 4)))


class _AddPositions(torch.nn.Module):
    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def forward(self, x):
        return x + self.factory(x.shape[-1])


@pytest.mark.parametrize("factory", [torch.arange, torch.zeros], ids=["arange", "zeros"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_tensor_created_in_forward_without_device_names_the_line_and_the_fix(factory, jit):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), _AddPositions(factory))
    params, apply = pt.functional(net)
    run = jax.jit(apply) if jit else apply
    with pytest.raises(RuntimeError, match=(
            r"'1' \(_AddPositions\) mixed a CPU torch tensor with the model's tensors at "
            r".*test_torch.py:\d+ \(forward: return x \+ self.factory\(x.shape\[-1\]\)\): a "
            r"tensor created in forward without device=.*on the CPU, not on the model's device"
            r".*device=x.device.*register_buffer")):
        run(params, jnp.ones((2, 4)))


def test_torch_tensor_passed_to_apply_is_a_clear_error():
    params, apply = pt.functional(torch.nn.Linear(4, 2))
    with pytest.raises(TypeError, match=r"takes JAX or numpy arrays, but kwargs\['input'\] is a "
                                        r"torch.Tensor; pass x.numpy\(\)"):
        apply(params, input=torch.ones(3, 4))


def test_functional_takes_numpy_eagerly_as_under_jit():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    params, apply = pt.functional(net)
    x = np.random.RandomState(0).randn(3, 4).astype(np.float32)
    with torch.no_grad():
        want = net(torch.tensor(x)).numpy()
    eager = apply(params, x)
    jitted = jax.jit(apply)(params, x)
    numpy_params = apply(jax.tree_util.tree_map(np.asarray, params), x)
    for got in (eager, jitted, numpy_params):
        assert isinstance(got, jax.Array)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_jax_layout_names_on_a_torch_model_are_a_clear_error():
    c = Case("llama")
    with pytest.raises(pj.SchemeError, match=r"PyTorch module.*'weight' \(not 'kernel'\)"):
        pj.Scheme({"**/q_proj/kernel": pj.Channels(ratio=0.5, axis="in")}).resolve(c.params)
    bil = torch.nn.ModuleDict({"b": torch.nn.Bilinear(3, 3, 2)})
    params, _ = pt.functional(bil)
    with pytest.raises(pj.SchemeError, match=r"Bilinear.*give the axis as an int"):
        pj.Scheme({"b/weight": pj.Channels(count=1, axis="in")}).resolve(params)
    # an int axis is taken as written
    assert pj.Scheme({"b/weight": pj.Channels(count=1, axis=2)}).resolve(params)["b"]["weight"] \
        == pj.Channels(count=1, axis=2)


# --------------------------------------------------------------------------- torchax import


def test_import_compat_is_scoped_and_leaves_no_environment_variable():
    import torch._ops

    assert "ENABLE_RUNTIME_UPTIME_TELEMETRY" not in os.environ or \
        os.environ.get("POCKJAX_TEST_TELEMETRY_SET")
    original = torch._ops.OpOverloadPacket.__getattr__
    with pt._named_overloads_tolerated():
        assert torch.ops.aten.add.Tensor is not None                  # real overloads unchanged
        assert isinstance(torch.ops.aten.prod.dim_Dimname_missing_for_test, pt._MissingOverload)
        with pytest.raises(AttributeError):
            torch.ops.aten.prod.no_such_overload                       # others still raise
    assert torch._ops.OpOverloadPacket.__getattr__ is original
    with pytest.raises(AttributeError):                                # outside: torch as it was
        torch.ops.aten.prod.dim_Dimname_missing_for_test
    assert pt.import_torchax() is pt.import_torchax()


def test_import_error_names_versions(monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "torchax" or m.startswith("torchax.")]:
        monkeypatch.delitem(sys.modules, name)

    class Boom:
        def find_spec(self, name, path=None, target=None):
            if name == "torchax":
                raise AttributeError("The underlying op of 'aten.x' has no overload name 'y'")

    monkeypatch.setattr(sys, "meta_path", [Boom(), *sys.meta_path])
    with pytest.raises(ImportError, match=r"torchax .* does not import with torch 2\.\d+"):
        pt.import_torchax()


# --------------------------------------------------------------------------- export, CLI, example

TARGETS = ["host-cpu", "host-vulkan", "android-vulkan", "android-arm64", "jetson-cuda"]


@pytest.fixture(scope="module")
def small_torch_trainer():
    """A torch CNN + MLP head (conv OIHW, Linear [out, in]) with Channels on both axes."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    scheme = pj.Scheme({"0/weight": pj.Channels(count=2, axis="in"),
                        "4/weight": pj.Channels(count=8, axis="out"), "6/**": pj.Full()})
    rs = np.random.RandomState(0)
    batch = {"x": rs.randn(4, 3, 6, 6).astype(np.float32),
             "y": rs.randint(0, 4, (4,)).astype(np.int32)}
    trainer, state = pt.trainer(net, lambda apply, p, b: _xent(apply(p, b["x"]), b["y"]),
                                optimizer=optax.adamw(1e-2), scheme=scheme)
    return trainer, state, batch


@pytest.mark.parametrize("target", TARGETS)
def test_every_target_compiles_a_torch_model(small_torch_trainer, target, tmp_path):
    pytest.importorskip("iree.compiler")
    trainer, state, batch = small_torch_trainer
    art = trainer.export(state, batch, target=target, out_dir=tmp_path / "art")
    assert art.manifest["target"]["name"] == target
    names = [p["name"] for p in art.manifest["params"]] if isinstance(
        art.manifest.get("params"), list) else str(art.manifest)
    assert "4/weight" in str(names)


@pytest.mark.parametrize("target", ["host-vulkan", "android-arm64", "jetson-cuda"])
def test_hf_llama_compiles_for_the_other_targets(target, tmp_path):
    """host-cpu runs above and android-vulkan in the example; these compile (and pass the
    write-before-read check on IREE's schedule)."""
    pytest.importorskip("iree.compiler")
    c = Case("llama")
    trainer = pj.sparse_train(c.loss, optimizer=optax.adamw(LR), scheme=c.scheme)
    art = trainer.export(trainer.init(c.params), c.jax_batch(), target=target,
                         out_dir=tmp_path / "art")
    assert art.manifest["target"]["name"] == target


def test_cli_exports_a_torch_model_with_its_loss(tmp_path):
    pytest.importorskip("iree.compiler")
    from pockjax.cli import main as cli

    spec = tmp_path / "torch_model.py"
    spec.write_text(
        "import numpy as np, optax, torch, jax.numpy as jnp, pockjax as pj\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))\n"
        "    loss = lambda apply, p, b: jnp.mean((apply(p, b) - 1.0) ** 2)\n"
        "    return {'model': net, 'loss_fn': loss, 'optimizer': optax.sgd(0.1),\n"
        "            'scheme': pj.Scheme({'0/weight': pj.Channels(count=2, axis='in'),\n"
        "                                 '2/**': pj.Full()}),\n"
        "            'batch': np.ones((3, 4), np.float32)}\n")
    out = tmp_path / "art"
    assert cli(["export", f"{spec}:make", "--target", "host-cpu", "--out", str(out)]) == 0
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    state = manifest["functions"]["train_step"]["state"]
    assert "params/0/weight" in state and "params/2/bias" in state, state
    sess = pj.runtime.load(str(out))
    sess.step(np.ones((3, 4), np.float32))
    shapes = {k: v.shape for k, v in pt._flatten(sess.params(), "/").items()}
    assert shapes["0/weight"] == (8, 4)


def test_search_on_torch_params(small_torch_trainer):
    trainer, state, batch = small_torch_trainer
    data = ([batch] * 3, [batch])
    scheme, report = pj.search_scheme(
        lambda s: pj.sparse_train(trainer.loss_fn, optimizer=optax.adamw(1e-2), scheme=s),
        state.params, data, "60%", steps=3, ratios=(0.5,), axis="out")
    decisions = dict(leaves_with_paths(scheme.resolve(state.params))[0])
    for path, d in decisions.items():
        if isinstance(d, pj.Channels) and path.endswith("weight"):
            assert d.axis == 0, (path, d)   # "out" of torch's [out, in] / OIHW


def test_example_torch_hf_finetune_fast(tmp_path):
    from tests.helpers import run_example

    out = run_example("torch_hf_finetune.py", "--fast", "--out", str(tmp_path))
    assert "exported android-vulkan" in out
    assert (tmp_path / "tuned" / "config.json").exists()


def test_docstring_examples():
    import doctest

    result = doctest.testmod(pt, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


MOE = {  # each family's config, its sizes given as keywords
    "mixtral": lambda **kw: transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, num_key_value_heads=2,
        **kw),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=24, intermediate_size=48, num_key_value_heads=2, **kw),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, intermediate_size=48,
        num_key_value_heads=2, head_dim=8, **kw),
    "olmoe": lambda **kw: transformers.OlmoeConfig(
        num_experts=4, num_experts_per_tok=2, intermediate_size=48, num_key_value_heads=2, **kw),
}


@pytest.mark.parametrize("family", list(MOE))
def test_mixture_of_experts_forward_and_gradients_equal_torch(family):
    """Mixture-of-experts families (transformers' grouped matmul over each expert's
    tokens, defined in pockjax's torchax environment as jax.lax.ragged_dot): logits and
    gradients equal torch's, with two of the four experts' stacked weights training
    (Channels over the expert axis) and the router frozen."""
    config = MOE[family](vocab_size=V, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = np.random.RandomState(1).randint(0, V, (B, T)).astype(np.int32)
    params, apply = pt.functional(model, output=lambda o: o.logits)
    with torch.no_grad():
        want = model(input_ids=torch.tensor(ids), use_cache=False).logits.numpy()
    got = apply(params, input_ids=jnp.asarray(ids), use_cache=False)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    blk = "model/layers/1"
    scheme = pj.Scheme({f"{blk}/mlp/experts/gate_up_proj": pj.Channels(count=2, axis=0),
                        f"{blk}/mlp/experts/down_proj": pj.Full(),
                        f"{blk}/self_attn/q_proj/weight": pj.Full()})

    def loss(p, b):
        logits = apply(p, input_ids=b, use_cache=False)
        return _xent(logits[:, :-1], b[:, 1:])

    g = pj.sparse_grad(loss, scheme)(params, jnp.asarray(ids))
    model.zero_grad()
    _lm_loss_torch(model, {"ids": ids}).backward()
    decisions = dict(leaves_with_paths(scheme.resolve(params))[0])
    assert isinstance(decisions[f"{blk}/mlp/gate/weight"], pj.Frozen)
    trained = 0
    for path, d in decisions.items():
        node = g
        for k in path.split("/"):
            node = node[k]
        if isinstance(d, pj.Frozen):
            assert node is None, path
            continue
        trained += 1
        torch_grad = model.get_parameter(path.replace("/", ".")).grad.numpy()
        np.testing.assert_allclose(np.asarray(node), _slice(torch_grad, d), rtol=1e-4,
                                   atol=1e-6, err_msg=path)
    assert trained == 3
