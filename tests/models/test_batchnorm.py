"""`frozen_norms_in_inference_mode`: which batch norms switch, and the folded step equals
the unfolded one with running statistics (values, and sparse gradients against dense
`jax.grad`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax as pj
from pockjax.nnx import frozen_norms_in_inference_mode
from pockjax.models import MobileNetV2
from tests.helpers import MOBILENETV2_STAGES, assert_trees_close, dense_view

CLASSES = 10


def model_with_statistics():
    """A small MobileNetV2 whose running statistics and norms are not the identity, with
    a dead ReLU channel (first) and a saturated one (last) in every batch norm."""
    m = MobileNetV2(CLASSES, width_mult=0.35, input_size=32, settings=MOBILENETV2_STAGES,
                    rngs=nnx.Rngs(0))
    for _, node in nnx.graph.iter_graph(m):
        if isinstance(node, nnx.BatchNorm):
            c = node.mean.shape[0]
            node.mean[...] = jnp.linspace(-0.5, 0.5, c)
            node.var[...] = jnp.linspace(0.5, 2.0, c)
            node.scale[...] = jnp.linspace(0.5, 1.5, c)
            node.bias[...] = jnp.linspace(-0.2, 0.2, c).at[0].set(-50.0).at[-1].set(50.0)
    return m


def adversarial_batch():
    x = np.array(jax.random.normal(jax.random.key(0), (4, 32, 32, 3)))
    x[0] = 0.0                  # an all-zero image
    x[:, :, :, 0] = 0.0         # a zero first channel
    x[:, ::4] = 0.0             # zero rows
    return jnp.asarray(x), jnp.asarray([0, 3, 9, 9])


def loss_of(graphdef, rest):
    def loss(params, batch):
        x, y = batch
        logits = pj.nnx.merge(graphdef, params, rest)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss


def test_paper_scheme_switches_the_fully_frozen_norms_only():
    m = model_with_statistics()
    scheme = pj.schemes.mobilenetv2(m, norms=True)
    switched = frozen_norms_in_inference_mode(m, scheme)
    assert switched == ["blocks/0/depthwise/bn", "blocks/0/project/bn", "head/bn", "stem/bn"]
    assert m.stem.bn.use_running_average and m.stem.fold_norm
    assert not m.blocks[1].expand.bn.use_running_average and not m.blocks[1].expand.fold_norm
    # the mode is static: split keeps it in the graph definition
    graphdef, _, _ = pj.nnx.split(m)
    again = pj.nnx.merge(graphdef, *pj.nnx.split(m)[1:])
    assert again.head.bn.use_running_average and again.head.fold_norm


def test_a_partly_trained_norm_keeps_training_mode():
    m = model_with_statistics()
    scheme = pj.Scheme([("stem/bn/scale", pj.Channels(ratio=0.5)), ("classifier/**", pj.Full())])
    switched = frozen_norms_in_inference_mode(m, scheme, fold=False)
    assert "stem/bn" not in switched and "head/bn" in switched
    assert not m.stem.bn.use_running_average and not m.head.fold_norm


def test_an_nnx_filter_is_accepted_as_the_scheme():
    m = model_with_statistics()
    switched = frozen_norms_in_inference_mode(m, nnx.PathContains("classifier"))
    assert len(switched) == 19 and "blocks/5/project/bn" in switched  # every batch norm


@pytest.mark.parametrize("norms", [False, True])
def test_folded_step_equals_unfolded_running_statistics(norms):
    """Folded vs flax's eval-mode batch norm: loss, and pockjax's sparse gradient of the
    folded model against dense jax.grad of the unfolded one (float64)."""
    scheme = pj.schemes.mobilenetv2(model_with_statistics(), norms=norms)
    unfolded, folded = model_with_statistics(), model_with_statistics()
    assert (frozen_norms_in_inference_mode(unfolded, scheme, fold=False)
            == frozen_norms_in_inference_mode(folded, scheme, fold=True))
    batch = adversarial_batch()
    with jax.enable_x64(True):
        batch = (batch[0].astype(jnp.float64), batch[1])
        losses, grads = [], []
        for m in (unfolded, folded):
            graphdef, params, rest = pj.nnx.split(m)
            params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
            rest = jax.tree.map(lambda a: a.astype(jnp.float64), rest)
            loss = loss_of(graphdef, rest)
            losses.append(jax.jit(loss)(params, batch))
            grads.append((loss, params))
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-12)
        (loss_unfolded, params), (loss_folded, _) = grads
        want = dense_view(loss_unfolded, scheme, params, batch)
        assert_trees_close(jax.jit(pj.sparse_grad(loss_folded, scheme))(params, batch), want,
                           rtol=1e-9, atol=1e-12)


def test_trainer_keeps_frozen_statistics_and_matches_plain_jax():
    m = model_with_statistics()
    scheme = pj.schemes.mobilenetv2(m, norms=True)
    frozen_norms_in_inference_mode(m, scheme)
    reference = model_with_statistics()
    frozen_norms_in_inference_mode(reference, scheme, fold=False)
    batch = adversarial_batch()
    want = optax.softmax_cross_entropy_with_integer_labels(
        nnx.jit(lambda m, x: m(x))(reference, batch[0]), batch[1]).mean()

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

    graphdef, params, rest = pj.nnx.split(m)
    with jax.enable_x64(True):
        as64 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float64), tree)
        folded = jax.jit(loss_of(graphdef, as64(rest)))(as64(params),
                                                        (batch[0].astype(jnp.float64), batch[1]))
    trainer = pj.nnx.Trainer(m, loss_fn, optimizer=optax.adam(1e-3), scheme=scheme)
    before = jax.tree.map(np.asarray, trainer.rest)
    got = trainer(batch)["loss"]
    # float32 evaluations of this model (batch of 4, saturated and dead channels) differ
    # from float64 by up to 1e-4 relative, eager or jitted alike
    np.testing.assert_allclose(got, folded, rtol=2e-4)
    # In float32 the fold rounds differently, and the training-mode batch norms after it
    # (batch of 4, saturated and dead channels) amplify that; float64 agrees to 1e-12
    # (test_folded_step_equals_unfolded_running_statistics).
    np.testing.assert_allclose(got, want, rtol=1e-3)
    after = trainer.rest
    np.testing.assert_array_equal(after["stem"]["bn"]["mean"], before["stem"]["bn"]["mean"])
    np.testing.assert_array_equal(after["head"]["bn"]["var"], before["head"]["bn"]["var"])
    assert not np.allclose(after["blocks"][3]["expand"]["bn"]["mean"],
                           before["blocks"][3]["expand"]["bn"]["mean"])


def test_trainer_option_switches_the_frozen_norms():
    scheme = pj.schemes.mobilenetv2(model_with_statistics(), norms=True)
    by_hand = model_with_statistics()
    frozen_norms_in_inference_mode(by_hand, scheme)

    def loss_fn(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

    batch = adversarial_batch()
    m = model_with_statistics()
    trainer = pj.nnx.Trainer(m, loss_fn, optimizer=optax.adam(1e-3), scheme=scheme,
                             frozen_norms="running")
    assert m.stem.bn.use_running_average and not m.blocks[3].expand.bn.use_running_average
    want = pj.nnx.Trainer(by_hand, loss_fn, optimizer=optax.adam(1e-3), scheme=scheme)(batch)
    np.testing.assert_array_equal(trainer(batch)["loss"], want["loss"])
    default = pj.nnx.Trainer(model_with_statistics(), loss_fn, optimizer=optax.adam(1e-3),
                             scheme=scheme)
    assert not np.allclose(default(batch)["loss"], want["loss"], rtol=1e-3)
    with pytest.raises(ValueError, match="frozen_norms must be 'batch'.*or 'running'"):
        pj.nnx.Trainer(model_with_statistics(), loss_fn, optimizer=optax.adam(1e-3),
                       frozen_norms="eval")
