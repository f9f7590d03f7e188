"""Flax NNX and Linen models through `sparse_grad` and `sparse_train`."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx

import pockjax as pj
from pockjax.models.lora import LoRALinear, apply_lora, merge_lora
from tests.helpers import assert_matches_dense, assert_trees_close


class Net(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(6, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(3)])
        self.head = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.gelu(self.bn(self.inp(x)))
        for block in self.blocks:
            h = h + jnp.tanh(block(h))
        return self.head(h)


def xent(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.fixture(scope="module")
def batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (8, 6)), jax.random.randint(ky, (8,), 0, 3)


def test_split_paths_and_merge_round_trip(batch):
    model = Net(nnx.Rngs(0))
    graphdef, params, rest = pj.nnx.split(model)
    paths = [p for p, _ in pj.scheme.leaves_with_paths(params)[0]]
    assert "blocks/1/kernel" in paths and "bn/scale" in paths
    assert paths == pj.nnx.param_paths(model)
    assert sorted(p for p, _ in pj.scheme.leaves_with_paths(rest)[0]) == ["bn/mean", "bn/var"]
    np.testing.assert_array_equal(pj.nnx.merge(graphdef, params, rest)(batch[0]), model(batch[0]))


def test_filters_become_schemes():
    model = Net(nnx.Rngs(0))
    s = pj.nnx.scheme(model, nnx.Any(nnx.PathContains("head"), nnx.PathContains("bn")))
    assert [p for p, _ in s.rules] == ["bn/bias", "bn/scale", "head/bias", "head/kernel"]
    s = pj.nnx.scheme(model, [(lambda path, v: path[-1] == "bias", pj.Full()),
                              (nnx.PathContains(2), pj.Channels(ratio=0.5, axis="in"))])
    resolved = dict(pj.scheme.leaves_with_paths(s.resolve(nnx.to_pure_dict(nnx.state(model,
                                                                                     nnx.Param))))[0])
    assert resolved["blocks/2/bias"] == pj.Full()
    assert resolved["blocks/2/kernel"] == pj.Channels(count=8, axis=0)
    assert resolved["inp/kernel"] == pj.Frozen()
    assert pj.nnx.scheme(model, nnx.All(nnx.Param, nnx.PathContains("inp"))).rules == (
        ("inp/bias", pj.Full()), ("inp/kernel", pj.Full()))
    with pytest.raises(pj.SchemeError, match="matches no .*Param.* variable of Net"):
        pj.nnx.scheme(model, nnx.PathContains("attn"))


@pytest.mark.parametrize("scheme", [
    pj.Scheme({"blocks/2/**": pj.Full(), "head/**": pj.Full()}),
    pj.Scheme({"blocks/*/kernel": pj.Channels(ratio=0.25, axis="out"), "bn/*": pj.Full(),
               "inp/kernel": pj.Channels(count=2, axis="in")}),
], ids=["last-block", "channels"])
def test_nnx_sparse_grad_matches_dense(scheme, batch):
    graphdef, params, rest = pj.nnx.split(Net(nnx.Rngs(0)))
    loss = lambda p, b: xent(pj.nnx.merge(graphdef, p, rest), b)
    assert_matches_dense(loss, scheme, params, batch, rtol=1e-5, atol=1e-6)


def test_nnx_trainer_matches_flax_optimizer_loop(batch):
    """The Flax docs' loop (nnx.Optimizer(wrt=...) + nnx.value_and_grad) against the trainer."""
    trained = nnx.Any(nnx.PathContains("head"), nnx.PathContains("bn"), nnx.PathContains(2))
    ref_model = Net(nnx.Rngs(0))
    model = Net(nnx.Rngs(0))
    wrt = nnx.All(nnx.Param, trained)
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=wrt)

    @nnx.jit
    def ref_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(xent, argnums=nnx.DiffState(0, wrt))(model, batch)
        optimizer.update(model, grads)
        return loss

    trainer = pj.nnx.Trainer(model, xent, optimizer=optax.adam(1e-2), scheme=trained)
    for _ in range(4):
        want = ref_step(ref_model, ref_opt, batch)
        got = trainer(batch)["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5)
    trainer.update(model)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)),
                       rtol=1e-5, atol=1e-6)
    # Running statistics moved, and the frozen input layer did not.
    assert not np.allclose(model.bn.mean[...], 0.0)
    np.testing.assert_array_equal(model.inp.kernel[...], Net(nnx.Rngs(0)).inp.kernel[...])


def test_nnx_trainer_fit_aux_and_export_inputs(batch, tmp_path):
    model = Net(nnx.Rngs(0))

    def loss_fn(model, batch):
        logits = model(batch[0])
        return xent(model, batch), jnp.mean(jnp.argmax(logits, -1) == batch[1])

    trainer = pj.nnx.Trainer(model, loss_fn, optimizer=optax.sgd(0.1), has_aux=True,
                             scheme=nnx.PathContains("head"))
    metrics = trainer(batch)
    assert set(metrics) == {"loss", "aux"} and metrics["aux"].shape == ()
    history = trainer.fit([batch] * 5, progress=False)
    assert history.steps == 5 and history.loss[-1] < history.loss[0]
    assert int(trainer.state.step) == 6
    report = trainer.report(batch)
    assert report.trainable_params == 16 * 3 + 3
    lowered = trainer.lower(batch).as_text()
    assert "stablehlo" in lowered
    # The new model has the trained head and the carried statistics.
    new = trainer.model()
    np.testing.assert_array_equal(new.head.kernel[...], trainer.params()["head"]["kernel"])
    np.testing.assert_array_equal(new.bn.mean[...], trainer.rest["bn"]["mean"])


def test_nnx_trainer_errors():
    with pytest.raises(TypeError, match="needs an nnx.Module"):
        pj.nnx.Trainer({"w": jnp.ones(2)}, xent, optimizer=optax.sgd(0.1))
    with pytest.raises(pj.SchemeError, match="matches no"):
        pj.nnx.Trainer(Net(nnx.Rngs(0)), xent, optimizer=optax.sgd(0.1),
                       scheme=nnx.PathContains("nope"))
    with pytest.raises(TypeError, match="nnx.search_scheme needs an nnx.Module"):
        pj.nnx.search_scheme({"w": jnp.ones(2)}, xent, optimizer=optax.sgd(0.1), data=([], []))



def test_nnx_trainer_copy_false_takes_the_modules_arrays_and_trains_the_same(batch):
    """copy=False: the state holds the module's own buffers (no second model in memory);
    training matches copy=True, and update() gives the module its parameters back."""
    model, ref_model = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    theirs = jax.tree_util.tree_leaves(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    trainer = pj.nnx.Trainer(model, xent, optimizer=optax.adam(1e-2), copy=False,
                             scheme=nnx.PathContains("blocks"))
    ref = pj.nnx.Trainer(ref_model, xent, optimizer=optax.adam(1e-2),
                         scheme=nnx.PathContains("blocks"))
    ours = jax.tree_util.tree_leaves(trainer.state.params)
    assert all(a is b for a, b in zip(ours, theirs)) and len(ours) == len(theirs)
    copied = jax.tree_util.tree_leaves(ref.state.params)
    assert not any(a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()
                   for a, b in zip(copied, jax.tree_util.tree_leaves(
                       nnx.to_pure_dict(nnx.state(ref_model, nnx.Param)))))
    for _ in range(3):
        np.testing.assert_allclose(trainer(batch)["loss"], ref(batch)["loss"], rtol=1e-6)
    assert model.blocks[0].kernel[...].is_deleted()  # donated: the module waits for update()
    trainer.update(model)
    ref.update(ref_model)
    assert_trees_close(nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(ref_model)),
                       rtol=0, atol=0)
    np.testing.assert_array_equal(model(batch[0]), ref_model(batch[0]))


# --------------------------------------------------------------------------- Linen


class LinenNet(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = jax.nn.relu(linen.Dense(32)(x))
        x = jax.nn.relu(linen.Dense(32)(x))
        return linen.Dense(3)(x)


def test_linen_apply_losses_work_directly(batch):
    model = LinenNet()
    params = model.init(jax.random.key(0), batch[0])["params"]

    def loss(p, b):
        logits = model.apply({"params": p}, b[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()

    scheme = pj.Scheme({"Dense_1/kernel": pj.Channels(ratio=0.25, axis="in"),
                        "Dense_2/**": pj.Full()})
    assert_matches_dense(loss, scheme, params, batch)
    assert pj.schemes.blocks(params) == ["Dense_0", "Dense_1", "Dense_2"]

    # Whole-tensor scheme against optax's own masking of a dense step.
    scheme = pj.schemes.last_blocks(params, 2)
    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2), scheme=scheme)
    state = trainer.init(params)
    mask = jax.tree_util.tree_map_with_path(
        lambda p, _: not pj.scheme.path_str(p).startswith("Dense_0"), params)
    tx = optax.masked(optax.adam(1e-2), mask)
    ref, ref_state = params, tx.init(params)
    for _ in range(3):
        state, _ = trainer(state, batch)
        g = jax.grad(loss)(ref, batch)
        g = jax.tree_util.tree_map(lambda x, m: x if m else jnp.zeros_like(x), g, mask)
        updates, ref_state = tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    assert_trees_close(state.params, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- LoRA


def test_lora_adapters_train_alone_and_merge_back(batch):
    model = Net(nnx.Rngs(0))
    before = model(batch[0])
    apply_lora(model, rank=4, alpha=8.0, targets=["blocks/*"], rngs=nnx.Rngs(5))
    assert isinstance(model.blocks[0], LoRALinear) and not isinstance(model.head, LoRALinear)
    np.testing.assert_allclose(model(batch[0]), before, rtol=1e-6)  # b starts at zero
    assert set(pj.nnx.param_paths(model, nnx.LoRAParam)) == {
        f"blocks/{i}/lora_{ab}" for i in range(3) for ab in "ab"}

    graphdef, params, rest = pj.nnx.split(model)
    loss = lambda p, b: xent(pj.nnx.merge(graphdef, p, rest), b)
    info = assert_matches_dense(loss, pj.schemes.lora(), params, batch)
    assert info.trainable_params == 3 * (16 * 4 + 4 * 16)

    trainer = pj.nnx.Trainer(model, xent, optimizer=optax.adam(1e-2), scheme=nnx.LoRAParam)
    assert trainer.scheme.resolve(params) == pj.schemes.lora().resolve(params)
    first = trainer(batch)["loss"]
    for _ in range(3):
        last = trainer(batch)["loss"]
    assert last < first
    trainer.update(model)
    np.testing.assert_array_equal(model.blocks[1].kernel[...], Net(nnx.Rngs(0)).blocks[1].kernel[...])
    adapted = model(batch[0])
    merge_lora(model)
    assert isinstance(model.blocks[0], nnx.Linear) and not pj.nnx.param_paths(model, nnx.LoRAParam)
    np.testing.assert_allclose(model(batch[0]), adapted, rtol=1e-5, atol=1e-6)


def test_lora_errors():
    with pytest.raises(ValueError, match="no nnx.Linear layer matches LoRA targets \\['q_proj'\\]"):
        apply_lora(Net(nnx.Rngs(0)), targets=["q_proj"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rank 8 is larger than layer 'head'"):
        apply_lora(Net(nnx.Rngs(0)), rank=8, targets=["head"], rngs=nnx.Rngs(0))


def test_nnx_trainer_skip_nonfinite_keeps_batch_statistics(batch):
    x, y = batch
    bad = (x.at[3, 1].set(jnp.nan), y)
    model = Net(nnx.Rngs(0))
    trainer = pj.nnx.Trainer(model, xent, optimizer=optax.adam(1e-2), skip_nonfinite=True,
                             scheme=nnx.Any(nnx.PathContains("head"), nnx.PathContains("bn")))
    trainer(batch)
    before = jax.tree.map(np.array, (trainer.state.params, trainer.rest))
    metrics = trainer(bad)
    assert bool(metrics["skipped"])
    after = (trainer.state.params, trainer.rest)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), after, before)
    assert not bool(trainer(batch)["skipped"])
    assert np.isfinite(np.asarray(trainer.rest["bn"]["mean"])).all()
