"""LLaMA with low-precision frozen weights (bfloat16 storage, float32 compute and float32
trained masters) and per-block rematerialisation: both must give the float32 model's
gradients and updates, and the compiled step must not hold float32 copies of the
frozen weights."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax as pj
from pockjax.models.llama import Llama, LlamaConfig, cast_frozen, narrow_matmul, upcast_matmul
from tests.helpers import assert_trees_close, dense_view, dequantized, no_nodes

TOKENS = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 12)), jnp.int32)


def model_and_loss(**overrides):
    config = LlamaConfig.tiny(dtype=jnp.float32, num_layers=3, **overrides)
    graphdef, params, _ = pj.nnx.split(Llama(config, rngs=nnx.Rngs(0)))

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss, params


def upcast(params):
    return dequantized(params, jnp.float32)


SCHEMES = {
    # Frozen weights inside the differentiated part too: the last block's down_proj and
    # the output head are bfloat16 and their input gradients flow through them.
    "transformer": lambda p: pj.schemes.transformer(p, last=1),
    "last_blocks": lambda p: pj.schemes.last_blocks(p, 2, extra=["norm/**"]),
}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", list(SCHEMES))
def test_low_precision_frozen_gradient_equals_float32_reference(kind, tie):
    loss, params = model_and_loss(tie_embeddings=tie)
    scheme = SCHEMES[kind](params)
    mixed = cast_frozen(params, scheme)
    frozen = [x for x, d in zip(jax.tree.leaves(mixed), jax.tree.leaves(scheme.resolve(mixed)))
              if isinstance(d, pj.Frozen)]
    assert frozen and all(x.dtype == jnp.bfloat16 for x in frozen)
    # The reference: the float32 model holding exactly the stored (rounded) weights.
    want = dense_view(loss, scheme, upcast(mixed), TOKENS)
    got = no_nodes(pj.sparse_grad(loss, scheme)(mixed, TOKENS))
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(got))
    assert_trees_close(got, want, rtol=1e-5, atol=1e-7)


def test_low_precision_step_update_equals_float32_reference():
    loss, params = model_and_loss()
    scheme = SCHEMES["transformer"](params)
    mixed = cast_frozen(params, scheme)
    opt = optax.adamw(1e-2)
    trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
    state = trainer.init(mixed)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.opt_state)
               if hasattr(x, "dtype") and x.ndim)
    for _ in range(2):
        state, metrics = trainer(state, TOKENS)

    ref = upcast(mixed)
    view = pj.trainable_view(ref, scheme)
    opt_state = opt.init(view)
    for _ in range(2):
        value, grads = jax.value_and_grad(loss)(ref, TOKENS)
        updates, opt_state = opt.update(pj.trainable_view(grads, scheme), opt_state, view)
        ref = pj.apply_sparse_updates(ref, updates, scheme)
        view = pj.trainable_view(ref, scheme)
    np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=1e-5)
    # Adam divides by sqrt(v): where a gradient is near zero, float32 rounding of the
    # reference's different summation order shows up at 1e-5 of the step size.
    assert_trees_close(no_nodes(pj.trainable_view(state.params, scheme)), view, rtol=1e-4,
                       atol=5e-5)
    for got, old, d in zip(jax.tree.leaves(state.params), jax.tree.leaves(mixed),
                           jax.tree.leaves(scheme.resolve(mixed))):
        assert got.dtype == old.dtype
        if isinstance(d, pj.Frozen):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(old))


@pytest.mark.parametrize("transposed", [False, True])
def test_upcast_matmul_matches_float32_product(transposed):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 8) if transposed else (8, 6)), jnp.bfloat16)
    ref = lambda x, w: jnp.sum(jnp.sin(x @ (w.astype(jnp.float32).T if transposed
                                            else w.astype(jnp.float32))))
    mine = lambda x, w: jnp.sum(jnp.sin(upcast_matmul(x, w, transposed)))
    np.testing.assert_allclose(mine(x, w), ref(x, w), rtol=1e-6)
    gx, gw = jax.grad(mine, argnums=(0, 1))(x, w)
    rx, rw = jax.grad(ref, argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.float32 and gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw.astype(jnp.float32), rw.astype(jnp.float32), rtol=1e-2,
                               atol=1e-3)


def _step_memory(config, scheme_fn, frozen_dtype):
    """Compiled memory of one sparse step, from shapes only."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, params, _ = pj.nnx.split(abstract)
    scheme = scheme_fn(params)
    params = cast_frozen(params, scheme, frozen_dtype, native=config.narrow_matmul == "native")
    opt = optax.adamw(1e-4)

    def loss(params, tokens):
        logits = nnx.merge(graphdef, params)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
    state = pj.TrainState(jax.ShapeDtypeStruct((), jnp.int32), params,
                          jax.eval_shape(opt.init, pj.trainable_view(params, scheme)), scheme)
    compiled = trainer.lower(state, jax.ShapeDtypeStruct((1, 8), jnp.int32)).compile()
    frozen = [x for x, d in zip(jax.tree.leaves(params), jax.tree.leaves(scheme.resolve(params)))
              if isinstance(d, pj.Frozen)]
    return pj.compiled_memory(compiled), frozen


@pytest.mark.parametrize("narrow", ["upcast", "native"])
def test_compiled_step_holds_no_float32_copies_of_frozen_weights(narrow):
    # Weights dominate (short sequence): float32 copies of them would show in temp memory.
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=6,
                         num_heads=4, dtype=jnp.float32, narrow_matmul=narrow)
    scheme_fn = lambda p: pj.schemes.transformer(p, last=1)
    memory, frozen = _step_memory(config, scheme_fn, jnp.bfloat16)
    frozen_f32 = sum(4 * int(np.prod(x.shape)) for x in frozen)
    # A few weights' copies at a time (the output head is the largest; 3.0 MB in all),
    # not the model's: upcast without the data dependency, XLA converts every frozen
    # weight at the top of the step and temp is 19.9 MB, their whole float32 size.
    assert memory["temp"] < frozen_f32 / 4, (memory, frozen_f32)
    f32_memory, _ = _step_memory(config, scheme_fn, jnp.float32)
    assert f32_memory["argument"] - memory["argument"] == frozen_f32 // 2


def test_remat_block_gradients_equal_plain_ones():
    loss, params = model_and_loss()
    loss_remat, _ = model_and_loss(remat="block")
    want = jax.grad(loss)(params, TOKENS)
    assert_trees_close(jax.grad(loss_remat)(params, TOKENS), want, rtol=1e-5, atol=1e-7)
    assert "checkpoint" in str(jax.make_jaxpr(jax.grad(loss_remat))(params, TOKENS)) or \
        "remat" in str(jax.make_jaxpr(jax.grad(loss_remat))(params, TOKENS))
    # Sparse through the rematerialised blocks, with bfloat16 frozen weights.
    scheme = SCHEMES["transformer"](params)
    mixed = cast_frozen(params, scheme)
    sg = pj.sparse_grad(loss_remat, scheme)
    want = dense_view(loss, scheme, upcast(mixed), TOKENS)
    for got in (sg(mixed, TOKENS), jax.jit(sg)(mixed, TOKENS)):
        assert_trees_close(no_nodes(got), want, rtol=1e-5, atol=1e-7)
    info = sg.explain(mixed, TOKENS)
    # The one fallback: the loss slices the bfloat16 head's logits (`[:, :-1]`), and a
    # custom_vjp call is computed whole rather than narrowed (one row of 12 extra).
    assert dict(info.fallbacks) == {"custom_vjp_call": 1}, str(info)


def test_plain_float32_model_is_unchanged_by_compute_dtype():
    loss, params = model_and_loss()
    config = LlamaConfig.tiny(num_layers=3)
    graphdef, _, _ = pj.nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    logits = nnx.merge(graphdef, params)(TOKENS)
    want = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], TOKENS[:, 1:]).mean()
    np.testing.assert_allclose(loss(params, TOKENS), want, rtol=1e-6)


def test_native_bfloat16_matmuls_are_close_to_the_float32_reference():
    loss, params = model_and_loss(narrow_matmul="native")
    scheme = SCHEMES["transformer"](params)
    mixed = cast_frozen(params, scheme, native=True)
    want = dense_view(loss, scheme, upcast(mixed), TOKENS)
    got = pj.sparse_grad(loss, scheme)(mixed, TOKENS)
    # Activations are rounded to bfloat16 (8 bits of mantissa) on their way into frozen
    # layers: close, not equal.
    assert_trees_close(got, want, rtol=5e-2, atol=1e-4)
    np.testing.assert_allclose(loss(mixed, TOKENS), loss(upcast(mixed), TOKENS), rtol=1e-3)


@pytest.mark.parametrize("transposed", [False, True])
def test_narrow_matmul_gradients(transposed):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 8) if transposed else (8, 6)), jnp.bfloat16)
    low = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
    ref = lambda x, w: jnp.sum(jnp.sin(low(x) @ (w.astype(jnp.float32).T if transposed
                                                  else w.astype(jnp.float32))))
    mine = lambda x, w: jnp.sum(jnp.sin(narrow_matmul(x, w, transposed)))
    np.testing.assert_allclose(mine(x, w), ref(x, w), rtol=1e-5)
    gx, gw = jax.grad(mine, argnums=(0, 1))(x, w)
    rx, rw = jax.grad(ref, argnums=(0, 1))(x, w)
    assert gx.dtype == jnp.float32 and gw.dtype == jnp.bfloat16
    np.testing.assert_allclose(gx, rx, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(gw.astype(jnp.float32), rw, rtol=2e-2, atol=2e-2)


def test_checkpoint_loads_for_mixed_precision(tmp_path):
    from pockjax.models.hf import load_llama, save_llama

    save_llama(Llama(LlamaConfig.tiny(num_layers=3), rngs=nnx.Rngs(0)), tmp_path)
    model = load_llama(tmp_path, dtype=jnp.bfloat16, compute_dtype=jnp.float32,
                       narrow_matmul="native", remat="block")  # the old spelling, read as "blocks"
    assert (model.config.param_dtype, model.config.dtype) == (jnp.bfloat16, jnp.float32)
    assert (model.config.narrow_matmul, model.config.remat) == ("native", "blocks")
    graphdef, params, _ = pj.nnx.split(model)
    scheme = pj.schemes.last_blocks(params, 1)
    mixed = cast_frozen(params, scheme, native=True)
    assert mixed["layers"][2]["attn"]["q_proj"]["kernel"].dtype == jnp.float32
    assert nnx.merge(graphdef, mixed)(TOKENS).dtype == jnp.float32


@pytest.mark.parametrize("overrides, match", [
    (dict(dtype=jnp.int32), "compute dtype"),
    (dict(dtype="nonsense"), "is not a dtype"),
    (dict(remat="layer"), "remat='layer'"),
    (dict(narrow_matmul="fp8"), "narrow_matmul='fp8'"),
])
def test_config_refuses_bad_precision_settings(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.tiny(**overrides)


def test_an_inf_in_the_first_element_stays_where_it_is():
    from pockjax.models.llama import upcast_matmul

    x = jnp.ones((2, 3, 4)).at[0, 0, 0].set(jnp.inf)
    w = jnp.ones((4, 5), jnp.bfloat16)
    y = upcast_matmul(x, w)
    np.testing.assert_array_equal(y[1], 4.0 * np.ones((3, 5)))
    assert np.isinf(y[0, 0]).all() and np.isfinite(y[0, 1:]).all()
    g = jax.grad(lambda x: upcast_matmul(x, w)[1].sum())(x)
    assert np.isfinite(g).all()
