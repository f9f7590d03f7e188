"""Sparse training on a mesh of 4 host CPU devices equals single-device training."""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import pockjax as pj
from pockjax.sharding import Layout, collectives
from tests.helpers import assert_trees_close

STEPS = 4

SCHEME = pj.Scheme({
    "l1/**": pj.Frozen(),
    "l2/kernel": pj.Channels(ratio=0.25, axis="out"),
    "l2/bias": pj.Channels(ratio=0.25, axis="out"),
    "l3/kernel": pj.Channels(ratio=0.5, axis="in"),
}, default=pj.Full())


def _params():
    k = jax.random.split(jax.random.key(0), 3)
    return {"l1": {"kernel": jax.random.normal(k[0], (24, 64)) / 5, "bias": jnp.full((64,), 0.1)},
            "l2": {"kernel": jax.random.normal(k[1], (64, 40)) / 8, "bias": jnp.zeros(40)},
            "l3": {"kernel": jax.random.normal(k[2], (40, 12)) / 6, "bias": jnp.zeros(12)}}


def loss(p, batch):
    x, y = batch["x"], batch["y"]
    h = jnp.tanh(x @ p["l1"]["kernel"] + p["l1"]["bias"])
    h = jnp.tanh(h @ p["l2"]["kernel"] + p["l2"]["bias"])
    return jnp.mean((h @ p["l3"]["kernel"] + p["l3"]["bias"] - y) ** 2)


def _batches():
    k = jax.random.split(jax.random.key(1), 2 * STEPS)
    return [{"x": np.asarray(jax.random.normal(k[2 * i], (32, 24))),
             "y": np.asarray(jax.random.normal(k[2 * i + 1], (32, 12)))} for i in range(STEPS)]


OPTIMIZERS = {"adam": optax.adam(3e-2),
              "clip+momentum": optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))}


def _train(trainer):
    state = trainer.init(_params())
    losses = []
    for b in _batches():
        state, m = trainer(state, b)
        losses.append(float(m["loss"]))
    return state, np.asarray(losses)


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= 4, "tests/conftest.py asks for 4 host CPU devices"
    return jax.make_mesh((4,), ("data",))


@pytest.fixture(scope="module")
def single():
    return {name: _train(pj.sparse_train(loss, optimizer=opt, scheme=SCHEME))
            for name, opt in OPTIMIZERS.items()}


LAYOUTS = {
    "data-parallel": dict(param_axis=None),
    "fsdp": dict(param_axis="data"),
}


@pytest.fixture(scope="module")
def sharded(mesh):
    out = {}
    for lname, kw in LAYOUTS.items():
        for oname, opt in OPTIMIZERS.items():
            trainer = pj.sparse_train(loss, optimizer=opt, scheme=SCHEME, mesh=mesh, **kw)
            out[lname, oname] = (trainer, *_train(trainer))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_equals_single_device(sharded, single, layout, opt):
    trainer, state, losses = sharded[layout, opt]
    want_state, want_losses = single[opt]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(state.params, want_state.params, rtol=1e-5, atol=1e-7)
    assert_trees_close(state.opt_state, want_state.opt_state, rtol=1e-5, atol=1e-7)
    assert int(state.step) == STEPS
    assert trainer._step_jit._cache_size() == 1, "the step's outputs changed layout and recompiled"


def _spec(x):
    return tuple(x.sharding.spec) if isinstance(x.sharding, NamedSharding) else None


def test_fsdp_layout(sharded):
    """Each weight is split along a dimension its Channels decision does not slice; the
    optimizer state of the kept slice is split the same way; all of it survives steps."""
    trainer, state, _ = sharded["fsdp", "adam"]
    p = state.params
    assert _spec(p["l1"]["kernel"]) == (None, "data")     # frozen: largest dimension
    assert _spec(p["l2"]["kernel"]) == ("data",)          # Channels(out): split the in axis
    assert _spec(p["l3"]["kernel"]) == (None, "data")     # Channels(in): split the out axis
    assert _spec(p["l2"]["bias"]) == ()                    # a sliced vector stays whole
    mu = state.opt_state[0].mu
    assert mu["l1"]["kernel"] is None
    assert mu["l2"]["kernel"].shape == (64, 10) and _spec(mu["l2"]["kernel"]) == ("data",)
    assert mu["l3"]["kernel"].shape == (20, 12) and _spec(mu["l3"]["kernel"]) == (None, "data")
    # Each device holds a quarter of the weight, not a copy.
    shard = p["l2"]["kernel"].addressable_shards[0].data
    assert shard.shape == (16, 40)


def _per_device_state_bytes(state):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(state))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_updates_in_place_on_each_device(sharded, layout):
    """Every parameter and optimizer-state output aliases its donated input: the
    update writes each device's own shard, without gathering the weight."""
    trainer, state, _ = sharded[layout, "adam"]
    mem = trainer.lower(state, _batches()[0]).compile().memory_analysis()
    assert mem.alias_size_in_bytes == _per_device_state_bytes(state)


def test_fsdp_memory_below_replicated(sharded):
    mems = {}
    for layout in LAYOUTS:
        trainer, state, _ = sharded[layout, "adam"]
        m = trainer.lower(state, _batches()[0]).compile().memory_analysis()
        mems[layout] = (m.argument_size_in_bytes, m.argument_size_in_bytes + m.output_size_in_bytes
                        - m.alias_size_in_bytes + m.temp_size_in_bytes)
    arg_dp, peak_dp = mems["data-parallel"]
    arg_fsdp, peak_fsdp = mems["fsdp"]
    assert arg_fsdp < 0.6 * arg_dp, mems
    assert peak_fsdp < peak_dp, mems


@pytest.mark.parametrize("trained", ["every layer", "the last two"])
def test_fsdp_holds_about_one_gathered_weight_at_a_time(mesh, trained):
    """FSDP's point: a device holds its share of the weights and about one gathered
    weight and one full gradient at a time. Eight 512 x 512 layers (1 MiB each) over 4
    devices, activations of a few KiB: the step's temporaries stay under 3 weights.
    Measured before `fused.regather` and `Layout.compiler_options`: 16 MiB (every
    weight gathered at the start and every gradient reduced at the end, both kept),
    9 MiB with the options and no regather (one gather kept from the forward pass to
    the backward), 2 MiB with both."""
    from pockjax.train import TrainState

    width, layers = 512, 8

    def deep(p, x):
        for i in range(layers):
            x = jnp.tanh(x @ p[f"w{i}"])
        return jnp.mean(x ** 2)

    params = {f"w{i}": jax.ShapeDtypeStruct((width, width), jnp.float32) for i in range(layers)}
    scheme = (pj.Scheme(default=pj.Full()) if trained == "every layer" else
              pj.Scheme({"w6": pj.Full(), "w7": pj.Full()}, default=pj.Frozen()))
    opt = optax.adam(1e-3)
    trainer = pj.sparse_train(deep, optimizer=opt, scheme=scheme, mesh=mesh, param_axis="data")
    shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                        jax.eval_shape(opt.init, pj.trainable_view(params, scheme)), scheme)
    x = jax.ShapeDtypeStruct((8, width), jnp.float32)
    temp = pj.compiled_memory(trainer.lower(shapes, x).compile())["temp"]
    assert temp < 3 * width * width * 4, f"{temp / 2**20:.2f} MiB of temporaries"


def _reduced_shapes(compiled):
    """Non-scalar arrays that the step all-reduces or reduce-scatters."""
    return [s for c in collectives(compiled) if c.op in ("all-reduce", "reduce-scatter")
            for s in c.shapes if int(np.prod(s)) > 1]


def _trainable_shapes(state):
    view = pj.trainable_view(state.params, SCHEME)
    return [x.shape for x in jax.tree_util.tree_leaves(view)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_frozen_parameters_have_no_gradient_collectives(sharded, layout):
    trainer, state, _ = sharded[layout, "adam"]
    reduced = _reduced_shapes(trainer.lower(state, _batches()[0]).compile())
    want = _trainable_shapes(state)
    # Reduced arrays are the trainable slices (possibly transposed), and every one of them.
    norm = lambda shapes: collections.Counter(tuple(sorted(s)) for s in shapes)
    assert norm(reduced) == norm(want), (reduced, want)
    frozen = {tuple(sorted(x.shape)) for x in jax.tree_util.tree_leaves(state.params["l1"])}
    assert not frozen & set(norm(reduced))
    # The same model trained in full reduces the frozen layer's gradients too.
    full = _reduced_shapes(trainer._full_lowered(state, _batches()[0]).compile())
    assert frozen <= set(norm(full)), full


def test_report_shows_devices_and_collectives(sharded):
    trainer, state, _ = sharded["fsdp", "adam"]
    report = trainer.report(state, _batches()[0])
    assert report.devices == 4 and "sharded over 'data'" in report.layout
    text = str(report)
    assert "peak estimate per device" in text and "all-reduce" in text and "all-gather" in text
    ops = report.collective_bytes()
    trainable_bytes = sum(int(np.prod(s)) * 4 for s in _trainable_shapes(state))
    assert trainable_bytes <= ops["all-reduce"] <= trainable_bytes + 64
    d = report.as_dict()
    assert d["devices"] == 4 and d["collectives"][0]["op"] in ("all-gather", "all-reduce")


def test_two_axis_mesh_and_param_specs(single):
    """Data over one axis, FSDP over another, and one weight split by hand along its
    output features (tensor-parallel style): still the single-device result."""
    mesh = jax.make_mesh((2, 2), ("data", "model"))
    specs = {"l3/kernel": P(None, "model")}
    trainer = pj.sparse_train(loss, optimizer=OPTIMIZERS["adam"], scheme=SCHEME, mesh=mesh,
                              data_axis="data", param_axis="model", param_specs=specs)
    state, losses = _train(trainer)
    want_state, want_losses = single["adam"]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert_trees_close(state.params, want_state.params, rtol=1e-5, atol=1e-7)
    assert _spec(state.params["l3"]["kernel"]) == (None, "model")
    assert _spec(state.params["l2"]["kernel"]) == ("model",)
    batch = trainer.shard_batch(_batches()[0])
    assert _spec(batch["x"]) == ("data",)


def test_explicit_mesh_is_used_in_auto_mode(mesh):
    layout = Layout(mesh)
    assert layout.mesh.axis_types == (AxisType.Auto,)
    assert layout.mesh.devices.tolist() == mesh.devices.tolist()


def test_bad_inputs(mesh):
    with pytest.raises(ValueError, match=r"batch leaf 'x' has leading dimension 6.*multiple of 4"):
        trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=SCHEME, mesh=mesh)
        state = trainer.init(_params())
        trainer(state, {"x": np.zeros((6, 24), np.float32), "y": np.zeros((6, 12), np.float32)})
    with pytest.raises(ValueError, match=r"param_axis='model' is not an axis of the mesh.*'data'"):
        pj.sparse_train(loss, optimizer=optax.sgd(0.1), mesh=mesh, param_axis="model")
    with pytest.raises(TypeError, match="need a mesh"):
        pj.sparse_train(loss, optimizer=optax.sgd(0.1), param_axis="data")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        pj.sparse_train(loss, optimizer=optax.sgd(0.1), mesh="data")
    with pytest.raises(TypeError, match="param_specs gave 'data' for parameter 'l2/kernel'"):
        trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=SCHEME, mesh=mesh,
                                  param_specs={"l2/kernel": "data"})
        trainer.init(_params())


def test_collectives_parser():
    text = """
  %all-reduce.7 = (f32[1]{0}, f32[12,64]{1,0}, /*index=2*/bf16[10]{0}) all-reduce(%a, %b, %c), channel_id=1
  %ag = f32[64,48]{1,0} all-gather(f32[16,48]{1,0} %p), dimensions={0}
  %rs-start = f32[4]{0} reduce-scatter-start(%x), dimensions={0}
  %add = f32[4]{0} add(%x, %y)
"""
    got = collectives(text)
    assert [c.op for c in got] == ["all-reduce", "all-gather", "reduce-scatter"]
    assert got[0].shapes == ((1,), (12, 64), (10,)) and got[0].dtypes == ("f32", "f32", "bf16")
    assert got[0].nbytes == 4 + 12 * 64 * 4 + 10 * 2
    assert str(got[1]) == "all-gather(f32[64,48])"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_processes(single, layout, tmp_path):
    """Two processes of 2 CPU devices each (`jax.distributed`, gloo collectives), each
    feeding half of every batch: the single-device result."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    # Output goes to files: a full pipe would block one process at exit while the
    # other waits for it in jax.distributed's shutdown barrier.
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(2)]
    procs = []
    for i, (out, err) in enumerate(logs):
        with open(out, "w") as fo, open(err, "w") as fe:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.multihost_worker", str(i), str(port), layout],
                cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe))
    try:
        for p in procs:
            p.wait(timeout=180)
    finally:
        for p in procs:
            p.kill()
    outs = []
    for p, (out, err) in zip(procs, logs):
        assert p.returncode == 0, err.read_text()[-3000:]
        outs.append(json.loads(out.read_text().strip().splitlines()[-1]))
    want_state, want_losses = single["adam"]
    for got in outs:
        np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)
        params = jax.tree_util.tree_map(np.asarray, got["params"],
                                        is_leaf=lambda x: isinstance(x, list))
        assert_trees_close(params, want_state.params, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("param_axis", [None, "data"])
def test_nnx_trainer_on_a_mesh(mesh, param_axis):
    """An NNX module with BatchNorm: batch statistics over the whole (split) batch and
    the running statistics carried step to step, as on one device."""
    from flax import nnx

    from tests.nnx.test_nnx import Net, xent

    kx, ky = jax.random.split(jax.random.key(1))
    batch = (jax.random.normal(kx, (16, 6)), jax.random.randint(ky, (16,), 0, 3))
    scheme = [(nnx.PathContains("head"), pj.Full()),
              (nnx.PathContains("bn"), pj.Full()),
              (nnx.All(nnx.PathContains("blocks"), nnx.PathContains("kernel")),
               pj.Channels(ratio=0.25, axis="out"))]
    one = pj.nnx.Trainer(Net(nnx.Rngs(0)), xent, optimizer=optax.adam(1e-2), scheme=scheme)
    many = pj.nnx.Trainer(Net(nnx.Rngs(0)), xent, optimizer=optax.adam(1e-2), scheme=scheme,
                          mesh=mesh, param_axis=param_axis)
    for _ in range(3):
        np.testing.assert_allclose(many(batch)["loss"], one(batch)["loss"], rtol=1e-5)
    assert_trees_close(nnx.to_pure_dict(nnx.state(many.model())),
                       nnx.to_pure_dict(nnx.state(one.model())), rtol=1e-5, atol=1e-6)
    assert not np.allclose(many.model().bn.mean[...], 0.0)
    if param_axis:
        assert _spec(many.state.params["blocks"][0]["kernel"]) == ("data",)


def test_a_mesh_trainer_exports_the_one_device_step(sharded, single, tmp_path):
    """An artifact runs on one device: exporting a mesh trainer gives the plain step,
    which continues from the sharded state as the JAX trainer does."""
    pytest.importorskip("iree.compiler")
    from pockjax import runtime

    trainer, state, _ = sharded["fsdp", "adam"]
    batches = _batches()
    from pockjax.export.lowering import lower_step

    mlir = lower_step(trainer, state, batches[0]).mlir
    assert "sdy." not in mlir and "mhlo.sharding" not in mlir  # no Shardy/GSPMD annotations
    art = trainer.export(state, batches[0], target="host-cpu", out_dir=str(tmp_path / "art"))
    sess = runtime.load(art.path, device="local-task")
    ref = jax.tree_util.tree_map(jnp.copy, single["adam"][0])  # the fixture's stays valid
    ref_trainer = pj.sparse_train(loss, optimizer=OPTIMIZERS["adam"], scheme=SCHEME)
    for b in batches[:2]:
        got = sess.step(b)
        ref, want = ref_trainer(ref, b)
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    assert_trees_close(sess.params(), jax.device_get(ref.params), rtol=1e-4, atol=1e-6)
