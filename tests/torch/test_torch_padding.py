"""Padded batches through pockjax.torch under Hugging Face's default `sdpa` attention,
against torch's own forward and autograd.

Left padding gives the pad positions query rows whose every key is masked; torch's
`scaled_dot_product_attention` returns 0 there (gradient 0), and pockjax's torchax
environment must too, or the NaN of a 0/0 softmax reaches the loss through `0 * NaN`.
"""
from __future__ import annotations

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
from tests.helpers import assert_trees_close  # noqa: E402

V, T, B, PAD = 64, 8, 2, 3


def _model(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=32)
    if kind == "llama":
        cfg = transformers.LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common)
    else:
        cfg = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def _batch(side):
    ids = np.random.RandomState(0).randint(0, V, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    if side == "left":
        mask[0, :PAD] = 0
    else:
        mask[1, T - PAD:] = 0
    return ids, mask


def _masked_xent(logits, ids, mask, xp):
    """Next-token cross-entropy over the positions whose target is a real token."""
    lse = xp["logsumexp"](logits[:, :-1], -1)
    picked = xp["take"](logits[:, :-1], ids[:, 1:])
    w = mask[:, 1:] * mask[:, :-1]
    return ((lse - picked) * w).sum() / w.sum()


_JNP = {"logsumexp": lambda x, a: jax.nn.logsumexp(x, axis=a),
        "take": lambda x, i: jnp.take_along_axis(x, i[..., None], -1)[..., 0]}
_TORCH = {"logsumexp": lambda x, a: torch.logsumexp(x, a),
          "take": lambda x, i: torch.gather(x, -1, i[..., None]).squeeze(-1)}


def _everything(logits, ids, mask, xp):
    """A loss that also reads the pad positions, so gradients flow through the rows whose
    keys are all masked."""
    return _masked_xent(logits, ids, mask, xp) + 1e-2 * (logits ** 2).mean()


def _torch_side(model, ids, mask, loss):
    model.zero_grad()
    ids_t, mask_t = torch.tensor(ids).long(), torch.tensor(mask).long()
    logits = model(input_ids=ids_t, attention_mask=mask_t, use_cache=False).logits
    value = loss(logits, ids_t, mask_t.float(), _TORCH)
    value.backward()
    grads = pt._nest({k: p.grad.numpy() for k, p in model.named_parameters()})
    return logits.detach().numpy(), float(value.detach()), grads


def _jax_loss(apply, loss):
    def f(params, ids, mask):
        logits = apply(params, input_ids=ids, attention_mask=mask, use_cache=False)
        return loss(logits, ids, mask.astype(jnp.float32), _JNP), logits
    return f


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_padded_batch_matches_torch_sdpa(kind, side):
    model = _model(kind)
    ids, mask = _batch(side)
    params, apply = pt.functional(model, output=lambda out: out.logits)
    grad = jax.jit(jax.value_and_grad(_jax_loss(apply, _masked_xent), has_aux=True))
    (value, logits), g = grad(params, jnp.asarray(ids), jnp.asarray(mask))
    want_logits, want_value, want_g = _torch_side(model, ids, mask, _masked_xent)

    real = mask.astype(bool)
    assert np.isfinite(np.asarray(logits)).all()
    np.testing.assert_allclose(np.asarray(logits)[real], want_logits[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value), want_value, rtol=1e-5)
    tied = {k: v for k, v in want_g.items() if k in g}   # GPT-2's tied lm_head comes once
    assert_trees_close(g, tied, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_gradient_through_fully_masked_rows_is_finite_and_matches_torch(kind):
    model = _model(kind)
    ids, mask = _batch("left")
    params, apply = pt.functional(model, output=lambda out: out.logits)
    (value, logits), g = jax.value_and_grad(_jax_loss(apply, _everything), has_aux=True)(
        params, jnp.asarray(ids), jnp.asarray(mask))
    want_logits, want_value, want_g = _torch_side(model, ids, mask, _everything)

    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(g))
    np.testing.assert_allclose(np.asarray(logits), want_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(value), want_value, rtol=1e-5)
    assert_trees_close(g, {k: v for k, v in want_g.items() if k in g}, rtol=1e-4, atol=1e-6)


def test_training_step_on_left_padded_batch_keeps_every_parameter_finite():
    model = _model("llama")
    ids, mask = _batch("left")

    def loss(apply, p, b):
        logits = apply(p, input_ids=b["ids"], attention_mask=b["mask"], use_cache=False)
        return _masked_xent(logits, b["ids"], b["mask"].astype(jnp.float32), _JNP)

    trainer, state = pt.trainer(model, loss, optimizer=optax.adamw(1e-2),
                                output=lambda out: out.logits)
    state, metrics = trainer(state, {"ids": jnp.asarray(ids), "mask": jnp.asarray(mask)})
    assert np.isfinite(float(metrics["loss"]))
    flat = pt._flatten(state.params, "/")
    bad = [k for k, x in flat.items() if not np.isfinite(np.asarray(x)).all()]
    assert not bad, f"NaN or inf after one step in {bad}"


def _sdpa_under(env, q, k, v, **kw):
    """torch's sdpa run inside a torchax environment on JAX arrays."""
    with env:
        tq, tk, tv, tm = env.j2t_iso((q, k, v, kw.pop("attn_mask", None)))
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, **kw)
        return env.t2j_iso(out)


_MASKS = {
    "bool": np.array([[False] * 4, [True, False, False, False], [True, True, False, True],
                      [True] * 4]),
    "float": np.where(np.array([[False] * 4, [True, True, False, False], [True] * 4,
                                [False, True, True, True]]), 0.0, -np.inf).astype(np.float32),
}


@pytest.mark.parametrize("variant", ["bool", "float", "causal", "gqa_scale"])
def test_sdpa_override_matches_torch_values_and_gradients(variant):
    rs = np.random.RandomState(1)
    hq, hk = (4, 2) if variant == "gqa_scale" else (2, 2)
    q = rs.randn(2, hq, 4, 8).astype(np.float32)
    k, v = (rs.randn(2, hk, 4, 8).astype(np.float32) for _ in range(2))
    kw = {"bool": {"attn_mask": _MASKS["bool"]}, "float": {"attn_mask": _MASKS["float"]},
          "causal": {"is_causal": True},
          "gqa_scale": {"enable_gqa": True, "scale": 0.3, "attn_mask": _MASKS["bool"]}}[variant]
    weights = rs.randn(2, hq, 4, 8).astype(np.float32)

    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tkw = {n: torch.tensor(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **tkw)
    (want * torch.tensor(weights)).sum().backward()

    env = pt.environment()
    jkw = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}

    def f(q, k, v):
        out = _sdpa_under(env, q, k, v, **dict(jkw))
        return (out * weights).sum(), out

    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), rtol=1e-5, atol=1e-6)
    for got, t in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(np.asarray(got), t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_upstream_torchax_sdpa_still_nan_on_fully_masked_rows():
    """Fails once torchax returns 0 for a query row whose keys are all masked: then the
    `_sdpa` override in pockjax/torch/__init__.py (`environment()`) can be removed."""
    import torchax.tensor

    raw = torchax.tensor.Environment()
    rs = np.random.RandomState(2)
    q, k, v = (jnp.asarray(rs.randn(1, 1, 3, 4).astype(np.float32)) for _ in range(3))
    mask = jnp.asarray([[False, False, False], [True, False, False], [True, True, True]])
    out = np.asarray(_sdpa_under(raw, q, k, v, attn_mask=mask))
    assert np.isnan(out[0, 0, 0]).all(), (
        "torchax now handles fully masked rows: retire pockjax.torch's _sdpa override")
    assert np.isfinite(out[0, 0, 1:]).all()
