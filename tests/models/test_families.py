"""The LLaMA-shaped families in the Flax `Llama` (LLaMA with biases, Mistral with its
sliding window, Qwen2 with q/k/v biases) against transformers: logits of a loaded
checkpoint, the family written back, sparse gradients through the biases, and the
messages for what does not load."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx

import pockjax as pj
from pockjax.models.hf import SUPPORTED_FAMILIES, load_llama, save_llama
from pockjax.models.llama import Linear, Llama, LlamaConfig, cast_frozen
from tests.models.common import VOCAB, forward, random_tokens
from tests.helpers import (assert_matches_dense, assert_trees_close, dense_view, dequantized,
                           no_nodes)

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
# name -> (transformers config class, its family's settings, the class it builds).
FAMILIES = {
    "llama_bias": (transformers.LlamaConfig, dict(attention_bias=True, mlp_bias=True),
                   "LlamaForCausalLM"),
    # A window shorter than the test sequences, so the sliding mask matters.
    "mistral": (transformers.MistralConfig, dict(sliding_window=4), "MistralForCausalLM"),
    "qwen2": (transformers.Qwen2Config, dict(use_sliding_window=False), "Qwen2ForCausalLM"),
    "qwen2_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True),
                   "Qwen2ForCausalLM"),
}


def hf_family_model(name: str, seed: int = 0):
    """A tiny random transformers model of family `name` (see FAMILIES). Weights are larger
    than HF's initialisation (std 0.02 makes attention nearly uniform, hiding masking
    mistakes); norm scales and biases are around 1, not 1 and 0."""
    config_class, settings, _ = FAMILIES[name]
    config = config_class(**{**SIZES, **settings})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (transformers model, its save_pretrained folder)."""
    out = {}
    for name in FAMILIES:
        model = hf_family_model(name)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(checkpoints, name):
    hf, folder = checkpoints[name]
    model = load_llama(folder)
    config = model.config
    assert config.model_type == json.loads((folder / "config.json").read_text())["model_type"]
    assert config.tie_embeddings == (name == "qwen2_tied")
    biases = {p for p in pj.nnx.param_paths(model) if p.endswith("/bias")}
    want = {"llama_bias": {f"layers/{i}/{m}/{n}_proj/bias" for i in range(2)
                           for m, names in (("attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                           for n in names},
            "mistral": set(),
            "qwen2": {f"layers/{i}/attn/{n}_proj/bias" for i in range(2) for n in "qkv"}}
    assert biases == want.get(name, want["qwen2"])
    tokens = random_tokens((2, 16))
    np.testing.assert_allclose(forward(model, tokens), hf_logits(hf, tokens), atol=1e-4,
                               rtol=1e-4)


def test_the_sliding_window_matters(checkpoints):
    """Mistral's window (4) is shorter than the sequence: attending to every earlier
    position would give other logits after the first 4 positions."""
    hf, folder = checkpoints["mistral"]
    assert load_llama(folder).config.sliding_window == 4
    unwindowed = load_llama(folder, sliding_window=None)
    tokens = random_tokens((2, 16))
    got, want = forward(unwindowed, tokens), hf_logits(hf, tokens)
    np.testing.assert_allclose(got[:, :4], want[:, :4], atol=1e-4, rtol=1e-4)
    assert np.abs(got[:, 4:] - want[:, 4:]).max() > 1e-2


@pytest.mark.parametrize("name", list(FAMILIES))
def test_saved_back_as_the_same_family(checkpoints, name, tmp_path):
    hf, folder = checkpoints[name]
    model = load_llama(folder)
    save_llama(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    architecture = FAMILIES[name][2]
    assert config["model_type"] == model.config.model_type
    assert config["architectures"] == [architecture]
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(again).__name__ == architecture
    tokens = random_tokens((2, 12), seed=3)
    np.testing.assert_allclose(hf_logits(again, tokens), hf_logits(hf, tokens), atol=1e-6)
    reloaded = load_llama(tmp_path)
    assert reloaded.config == model.config
    jax.tree.map(np.testing.assert_array_equal, nnx.state(reloaded), nnx.state(model))


@pytest.mark.parametrize("model_type", SUPPORTED_FAMILIES)
def test_config_round_trips_through_transformers(model_type):
    config = LlamaConfig.tiny(model_type=model_type, rope_theta=5e5, tie_embeddings=True,
                              **({"sliding_window": 16} if model_type == "mistral" else {}))
    assert LlamaConfig.from_hf(config.to_hf()) == config
    hf_class = transformers.CONFIG_MAPPING[model_type]
    assert LlamaConfig.from_hf(hf_class(**config.to_hf()).to_dict()) == config


def test_families_fix_what_their_class_cannot_vary():
    assert LlamaConfig.tiny(model_type="qwen2").qkv_bias is True
    assert LlamaConfig.tiny().qkv_bias is False
    llama = LlamaConfig.tiny(attention_bias=True)
    assert llama.biased == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert LlamaConfig.tiny(model_type="qwen2").biased == {"q_proj", "k_proj", "v_proj"}
    assert LlamaConfig.tiny(mlp_bias=True).biased == {"gate_proj", "up_proj", "down_proj"}
    for overrides, match in [
        (dict(model_type="mistral", mlp_bias=True), r"model_type='mistral'\) has "
                                                    r"mlp_bias=False, got mlp_bias=True"),
        (dict(model_type="qwen2", qkv_bias=False), "MistralForCausalLM|Qwen2ForCausalLM "
                                                   "cannot hold another value"),
        (dict(sliding_window=8), "LlamaForCausalLM cannot hold another value; choose the "
                                 "model_type whose architecture has it"),
        (dict(qkv_bias=True), r"has qkv_bias=False"),
        (dict(model_type="mistral", sliding_window=0), "sliding_window must be a positive "
                                                       "integer or None, got 0"),
        (dict(attention_bias=1), "attention_bias must be True or False, got 1"),
        (dict(model_type="gpt2"), r"model_type='gpt2': this model implements llama, "
                                  r"mistral, qwen2; other architectures load through "
                                  r"pockjax\.torch"),
    ]:
        with pytest.raises(ValueError, match=match):
            LlamaConfig.tiny(**overrides)


def test_unsupported_model_type_names_the_families(tmp_path):
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2).to_dict()
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported: the Flax LLaMA "
                       r"\(pockjax\.models\.llama\) reads the families llama, mistral, qwen2; "
                       r"other architectures load through pockjax\.torch"):
        LlamaConfig.from_hf(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pj.CheckpointError, match=r"config\.json': .*model_type='gpt2'.*"
                       r"llama, mistral, qwen2.*pockjax\.torch"):
        load_llama(tmp_path)
    assert SUPPORTED_FAMILIES == ("llama", "mistral", "qwen2")


def test_qwen2_sliding_layers_are_refused():
    sizes = {k: v for k, v in SIZES.items()}
    sliding = transformers.Qwen2Config(**sizes, use_sliding_window=True, sliding_window=8,
                                       max_window_layers=1).to_dict()
    with pytest.raises(ValueError, match=r"use_sliding_window=True is not supported: layers "
                       r"\[1\] of this Qwen2 model use sliding-window attention.*"
                       r"pockjax\.torch"):
        LlamaConfig.from_hf(sliding)
    # Switched on, but no layer past max_window_layers: every layer attends in full.
    full = transformers.Qwen2Config(**sizes, use_sliding_window=True, sliding_window=8,
                                    max_window_layers=2).to_dict()
    assert LlamaConfig.from_hf(full).sliding_window is None


# -- sparse gradients through the biases ---------------------------------------------------


def lm_loss(model: Llama):
    """The model's next-token loss as a function of its parameters, and the parameters."""
    graphdef, params, rest = pj.nnx.split(model)

    @jax.jit  # one compiled program for the dense reference, inlined by sparse_grad
    def loss(params, tokens):
        logits = pj.nnx.merge(graphdef, params, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                               tokens[:, 1:]).mean()
    return loss, params


def test_qwen2_sparse_grad_matches_dense(checkpoints):
    loss, params = lm_loss(load_llama(checkpoints["qwen2"][1]))
    scheme = pj.Scheme({"layers/1/attn/q_proj/kernel": pj.Channels(ratio=0.25, axis="out"),
                        "layers/1/attn/k_proj/kernel": pj.Full(),
                        "layers/1/attn/*_proj/bias": pj.Full(),
                        "layers/1/mlp/up_proj/kernel": pj.Channels(ratio=0.5, axis="in"),
                        "lm_head/kernel": pj.Channels(ratio=0.25, axis="out")},
                       default=pj.Frozen())
    tokens = jnp.asarray(random_tokens((2, 12), seed=5), jnp.int32)
    info = assert_matches_dense(loss, scheme, params, tokens, rtol=1e-4,
                                atol=1e-6)
    assert "layers/1/attn/v_proj/bias" not in info.frozen
    assert "layers/0/attn/q_proj/bias" in info.frozen
    assert not info.fallbacks, str(info)


def test_biases_under_mixed_precision(checkpoints):
    """bfloat16 frozen weights and biases under float32 compute: the gradient equals the
    float32 model holding the same (rounded) values."""
    model = load_llama(checkpoints["llama_bias"][1], compute_dtype=jnp.float32)
    loss, params = lm_loss(model)
    scheme = pj.schemes.transformer(params, last=1)
    mixed = cast_frozen(params, scheme)
    assert mixed["layers"][0]["attn"]["o_proj"]["bias"].dtype == jnp.bfloat16
    assert mixed["layers"][1]["attn"]["o_proj"]["bias"].dtype == jnp.float32
    tokens = jnp.asarray(random_tokens((2, 12), seed=6), jnp.int32)
    got = no_nodes(pj.sparse_grad(loss, scheme)(mixed, tokens))
    assert_trees_close(got, dense_view(loss, scheme, dequantized(mixed), tokens), rtol=1e-5,
                       atol=1e-7)


def test_llama_linear_with_a_bias():
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    for narrow, tol in (("upcast", 1e-6), ("native", 3e-2)):
        layer = Linear(4, 5, use_bias=True, param_dtype=jnp.bfloat16, dtype=jnp.float32,
                       narrow=narrow, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
        w, b = (np.asarray(v[...], np.float32) for v in (layer.kernel, layer.bias))
        y = layer(x)
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(y, np.asarray(x) @ w + b, rtol=tol, atol=tol)
    assert pj.nnx.param_paths(Linear(4, 5, rngs=nnx.Rngs(0))) == ["kernel"]
    with pytest.raises(ValueError, match="does not take precision="):
        Linear(4, 5, precision="highest", rngs=nnx.Rngs(0))
