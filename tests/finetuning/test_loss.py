"""The loss at the counted positions (`lm_loss_at`) against the loss over every
position's logits (`lm_loss`, differentiated by `jax.grad`): values and gradients, on
masks with empty rows, fractional weights and the first and last positions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pockjax as pj
from pockjax.finetuning import scheme_from_spec
from pockjax.finetuning._loss import lm_loss, lm_loss_at, target_positions
from pockjax.finetuning._model import flax_loaded
from pockjax.models.llama import Llama, LlamaConfig


def _loaded(tie: bool):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=16,
                         tie_embeddings=tie)
    graphdef, params, rest = pj.nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    return flax_loaded(graphdef, params, rest, config, save=None)


def _mask():
    mask = np.zeros((4, 16), np.float32)
    mask[0, 1] = 1.0           # the first position's next token
    mask[0, 15] = 0.5          # the last position (predicted by position 14), a fraction
    mask[1, 6:10] = 1.0        # a completion in the middle; the rest padding
    # row 2: nothing counts
    mask[3, 12:] = 2.0         # weights above one
    return mask


@pytest.mark.parametrize("tie", [False, True])
def test_the_loss_at_the_counted_positions_equals_the_loss_over_every_logit(tie):
    loaded = _loaded(tie)
    tokens = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    tokens[1, 10:] = 0  # padding
    mask = _mask()
    found = target_positions(mask)
    assert found is not None and found["targets"].shape == (16,)  # 9 counted of 64 -> K = 64 / 4
    batch = {"tokens": jnp.asarray(tokens), "mask": jnp.asarray(mask),
             **{k: jnp.asarray(v) for k, v in found.items()}}

    def every(p):
        return lm_loss(loaded.apply(p, batch["tokens"]), batch["tokens"], batch["mask"])

    want, want_grad = jax.jit(jax.value_and_grad(every))(loaded.params)
    got, got_grad = jax.jit(jax.value_and_grad(lambda p: lm_loss_at(loaded, p, batch)))(
        loaded.params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_grad),
                            jax.tree_util.tree_leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7,
                                   err_msg=jax.tree_util.keystr(path))
    # pockjax's gradient program of the last block and the head against jax.grad.
    scheme = scheme_from_spec("last:1+head", loaded.params, 2)
    grads = jax.jit(pj.sparse_grad(lambda p, b: lm_loss_at(loaded, p, b), scheme))(loaded.params,
                                                                                 batch)
    checked = 0
    for a, b in zip(jax.tree_util.tree_leaves(grads, is_leaf=lambda x: x is None),
                    jax.tree_util.tree_leaves(want_grad)):
        if a is not None:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
            checked += 1
    assert checked >= 9 + (0 if tie else 1)  # the block's 9 tensors (and the head)


def test_target_positions_pick_the_smallest_shape_that_holds_them():
    mask = np.zeros((2, 8), np.float32)
    mask[0, 3:6] = 1.0
    mask[1, 7] = 0.25
    found = target_positions(mask)
    # positions 2, 3, 4 of row 0 and 6 of row 1 (8 + 6), padded to 16 / 4 = 4
    np.testing.assert_array_equal(found["targets"], [2, 3, 4, 14])
    np.testing.assert_array_equal(found["target_weights"], [1.0, 1.0, 1.0, 0.25])
    mask[0, 1:3] = 1.0  # 6 counted: 16 / 2 = 8, two of them padding with weight 0
    found = target_positions(mask)
    assert found["targets"].shape == (8,) and found["target_weights"][6:].sum() == 0
    assert target_positions(np.ones((2, 8))) is None  # more than half: every logit
    empty = target_positions(np.zeros((2, 8)))
    assert empty["targets"].shape == (2,) and not empty["target_weights"].any()
