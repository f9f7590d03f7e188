"""Scaled rotary embeddings (`linear`, `dynamic`, `yarn`, `llama3`) in the Flax `Llama`
against transformers: logits of a loaded checkpoint at positions past the original
context, from both config forms (transformers 5's `rope_parameters`, the older top-level
`rope_scaling` beside `rope_theta`), greedy decoding through the key/value cache, the
config written back, and what still does not load."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from pockjax.models.hf import load_llama, save_llama
from pockjax.models.llama import LlamaConfig
from tests.models.common import VOCAB, forward, random_tokens

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5)
# rope_type -> (its parameters, max_position_embeddings). The original context is 16
# positions; the test sequences run to 40.
SCALINGS = {
    "llama3": (dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=16), 128),
    "linear": (dict(factor=4.0), 64),
    "dynamic": (dict(factor=2.0), 16),
    "yarn": (dict(factor=4.0, original_max_position_embeddings=16), 64),
    "yarn_mscale": (dict(factor=4.0, original_max_position_embeddings=16, mscale=0.8,
                         mscale_all_dim=0.5, beta_fast=16, beta_slow=2), 64),
}
THETA = 500000.0


def hf_model(name: str, old_form: bool):
    params, positions = SCALINGS[name]
    kind = name.split("_")[0]
    if old_form:  # transformers 4's form: rope_scaling with "type", rope_theta beside it
        settings = dict(rope_scaling={"type": kind, **params}, rope_theta=THETA)
    else:
        settings = dict(rope_parameters={"rope_type": kind, "rope_theta": THETA, **params})
    config = transformers.LlamaConfig(**SIZES, max_position_embeddings=positions, **settings)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p)) if p.ndim == 1 else p.normal_(0, 0.2)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def assert_logits_equal(got, want):
    """Within 1e-5 of the logits' scale (float32 sums in another order: the unscaled
    model differs from transformers' by as much, 1.6e-6 of the scale here)."""
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), \
        np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("old_form", [False, True], ids=["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_logits_equal_transformers_past_the_original_context(name, old_form, tmp_path):
    hf = hf_model(name, old_form)
    hf.save_pretrained(tmp_path)
    if old_form:  # the file as an older transformers wrote it
        config = json.loads((tmp_path / "config.json").read_text())
        config.pop("rope_parameters", None)
        config["rope_scaling"] = {"type": name.split("_")[0], **SCALINGS[name][0]}
        config["rope_theta"] = THETA
        (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_llama(tmp_path)
    assert dict(model.config.rope_scaling)["rope_type"] == name.split("_")[0]
    assert model.config.rope_theta == THETA
    tokens = random_tokens((2, 40), seed=1)
    got = forward(model, tokens)
    assert_logits_equal(got, hf_logits(hf_model(name, old_form), tokens))
    # The scaling matters: unscaled embeddings give other logits past the context.
    if name != "dynamic":
        plain = load_llama(tmp_path, rope_scaling=None)
        assert np.abs(forward(plain, tokens)[:, 20:] - got[:, 20:]).max() > 1e-3


def test_dynamic_grows_with_the_sequence(tmp_path):
    """`dynamic` stretches its frequencies only once a sequence is longer than the
    context: within it the logits are the unscaled model's, past it they follow the
    length (as transformers recomputes them)."""
    hf = hf_model("dynamic", False)
    hf.save_pretrained(tmp_path)
    model = load_llama(tmp_path)
    plain = load_llama(tmp_path, rope_scaling=None)
    short = random_tokens((1, 16), seed=2)
    np.testing.assert_allclose(forward(model, short), forward(plain, short), atol=1e-6)
    for length in (17, 33):
        tokens = random_tokens((1, length), seed=length)
        assert_logits_equal(forward(model, tokens), hf_logits(hf_model("dynamic", False), tokens))


@pytest.mark.parametrize("name", ["llama3", "yarn", "dynamic"])
def test_greedy_decoding_equals_transformers(name, tmp_path):
    from pockjax.models.llama import generate

    hf = hf_model(name, False)
    hf.save_pretrained(tmp_path)
    model = load_llama(tmp_path)
    prompt = random_tokens((1, 12), seed=4)
    with torch.no_grad():
        want = hf.generate(torch.tensor(prompt), max_new_tokens=20, do_sample=False,
                           pad_token_id=0).numpy()
    got = np.asarray(generate(model, prompt, max_new_tokens=20))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_scaling_is_written_back(name, tmp_path):
    hf = hf_model(name, False)
    hf.save_pretrained(tmp_path / "in")
    model = load_llama(tmp_path / "in")
    save_llama(model, tmp_path / "out")
    assert load_llama(tmp_path / "out").config == model.config
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = random_tokens((1, 40), seed=5)
    np.testing.assert_allclose(hf_logits(again, tokens), hf_logits(hf, tokens), atol=1e-6)


def test_what_does_not_load_says_why():
    base = dict(SIZES, max_position_embeddings=64, model_type="llama")
    for rope, match in [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
         "rope_parameters=.* is not supported: pockjax's LLaMA computes rotary embeddings "
         "of the types default, linear, dynamic, yarn, llama3, not 'longrope'"),
        ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5},
         "partial_rotary_factor=0.5 is not supported"),
    ]:
        with pytest.raises(ValueError, match=match):
            LlamaConfig.from_hf({**base, "rope_parameters": rope})
    with pytest.raises(ValueError, match="rope_scaling: factor must be positive"):
        LlamaConfig.tiny(rope_scaling={"rope_type": "linear", "factor": 0.0})
    with pytest.raises(ValueError, match="exceed max_position_embeddings"):
        from tests.models.common import forward as fw
        from flax import nnx
        from pockjax.models.llama import Llama
        fw(Llama(LlamaConfig.tiny(vocab_size=VOCAB, max_position_embeddings=8),
                 rngs=nnx.Rngs(0)), random_tokens((1, 9)))
