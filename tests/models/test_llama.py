"""The LLaMA decoder against Hugging Face's `LlamaForCausalLM`, its checkpoint loader,
greedy decoding, and sparse gradients through it."""
from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import pockjax as pj
from pockjax.models.hf import load_llama, save_llama
from pockjax.models.llama import Llama, LlamaConfig, generate, num_params
from tests.models.common import VOCAB, forward, random_tokens
from tests.helpers import assert_matches_dense



def hf_model(tie: bool, dtype=torch.float32) -> transformers.LlamaForCausalLM:
    """A tiny random LlamaForCausalLM. Weights are larger than HF's initialisation
    (std 0.02 makes attention nearly uniform, hiding rotary or masking mistakes) and
    norm scales are not all ones."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(1 + tie)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
    return model.to(dtype)


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF models, tied and untied, saved as one file and as shards."""
    out = {}
    for tie in (False, True):
        model = hf_model(tie)
        single = tmp_path_factory.mktemp(f"hf_tie{tie}")
        sharded = tmp_path_factory.mktemp(f"hf_tie{tie}_sharded")
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="40KB")
        out[tie] = (model, single, sharded)
    return out


# -- Hugging Face checkpoints -----------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_logits_match_transformers(checkpoints, tie, layout):
    hf, single, sharded = checkpoints[tie]
    directory = single if layout == "single" else sharded
    assert (directory / ("model.safetensors" if layout == "single"
                         else "model.safetensors.index.json")).is_file()
    model = load_llama(directory)
    assert model.config.tie_embeddings == tie and model.config.rope_theta == 1000.0
    assert hasattr(model, "lm_head") != tie
    tokens = random_tokens((2, 16))
    np.testing.assert_allclose(forward(model, tokens), hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_saved_model_loads_in_transformers_and_back(checkpoints, tmp_path):
    hf, single, _ = checkpoints[False]
    model = load_llama(single)
    save_llama(model, tmp_path / "ours")
    assert sorted(os.listdir(tmp_path / "ours")) == ["config.json", "model.safetensors"]
    tokens = random_tokens((2, 10), seed=3)
    again = load_llama(tmp_path / "ours")
    assert again.config == model.config
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(model))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf, tokens), atol=1e-6)


def _small_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20 + ["hello world"] * 20,
                            trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>"]))
    return tok


def test_saved_model_keeps_its_tokenizer(checkpoints, tmp_path):
    _, single, _ = checkpoints[False]
    source = tmp_path / "source"
    shutil.copytree(single, source)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=_small_tokenizer(),
                                                bos_token="<s>", unk_token="<unk>")
    fast.save_pretrained(source)
    model = load_llama(source)
    save_llama(model, tmp_path / "ours", tokenizer=source)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(tmp_path / "ours"))
    again = transformers.AutoTokenizer.from_pretrained(tmp_path / "ours")
    text = "def g(y):\n    return y"
    assert again(text)["input_ids"] == fast(text)["input_ids"]

    save_llama(model, tmp_path / "object", tokenizer=_small_tokenizer())
    assert "tokenizer.json" in os.listdir(tmp_path / "object")
    with pytest.raises(pj.CheckpointError, match="holds no tokenizer files"):
        save_llama(model, tmp_path / "bad", tokenizer=single)
    assert not (tmp_path / "bad").exists()  # refused before anything was written


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_save_load_round_trip(tmp_path, tie):
    model = Llama(LlamaConfig.tiny(tie_embeddings=tie), rngs=nnx.Rngs(3))
    save_llama(model, tmp_path)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    loaded = load_llama(tmp_path)
    assert loaded.config == model.config
    assert pj.nnx.param_paths(loaded) == pj.nnx.param_paths(model)
    jax.tree.map(np.testing.assert_array_equal, nnx.state(loaded), nnx.state(model))
    # Saving again replaces the files in place, leaving no temporaries behind.
    save_llama(loaded, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_save_over_a_sharded_checkpoint(checkpoints, tmp_path):
    _, _, sharded = checkpoints[True]
    shutil.copytree(sharded, tmp_path, dirs_exist_ok=True)
    model = Llama(LlamaConfig.tiny(tie_embeddings=True), rngs=nnx.Rngs(4))
    save_llama(model, tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    jax.tree.map(np.testing.assert_array_equal, nnx.state(load_llama(tmp_path)), nnx.state(model))


def test_a_large_model_is_saved_in_shards_that_transformers_loads(checkpoints, tmp_path):
    hf, single, _ = checkpoints[False]
    model = load_llama(single)
    save_llama(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json",
                                                   "model.safetensors.index.json", *shards])
    jax.tree.map(np.testing.assert_array_equal, nnx.state(load_llama(tmp_path)),
                 nnx.state(model))
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    tokens = random_tokens((2, 10), seed=4)
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf, tokens), atol=1e-6)
    save_llama(model, tmp_path)  # one file again: the index and its shards go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    jax.tree.map(np.testing.assert_array_equal, nnx.state(load_llama(tmp_path)),
                 nnx.state(model))


def test_save_refuses_parameters_without_a_place(tmp_path):
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    model.layers[0].attn.q_proj.lora_a = nnx.Param(jnp.zeros((64, 2)))
    with pytest.raises(pj.CheckpointError, match="no place for: layers/0/attn/q_proj/lora_a; "
                       "fold adapters"):
        save_llama(model, tmp_path)
    assert not os.listdir(tmp_path)
    with pytest.raises(TypeError, match="save_llama saves a pockjax Llama, got Linear"):
        save_llama(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tmp_path)


def test_half_precision_checkpoints_load(tmp_path):
    hf = hf_model(tie=False, dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path)
    want = hf.model.layers[1].mlp.up_proj.weight.detach().float().numpy().T

    as_f32 = load_llama(tmp_path)
    kernel = as_f32.layers[1].mlp.up_proj.kernel[...]
    assert as_f32.config.param_dtype == jnp.float32 and kernel.dtype == jnp.float32
    np.testing.assert_array_equal(kernel, want)

    as_bf16 = load_llama(tmp_path, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(as_bf16))} == {jnp.dtype(jnp.bfloat16)}
    np.testing.assert_array_equal(as_bf16.layers[1].mlp.up_proj.kernel[...].astype(np.float32),
                                  want)
    assert forward(as_bf16, random_tokens((1, 8))).dtype == np.float32

    save_llama(as_bf16, tmp_path / "again")
    with safe_open(tmp_path / "again" / "model.safetensors", framework="numpy") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"


def test_mismatched_checkpoint_lists_every_problem(tmp_path):
    save_llama(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.upproj.weight"] = tensors.pop("model.layers.0.mlp.up_proj.weight")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:32]
    tensors["model.layers.1.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # ignored
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})

    with pytest.raises(pj.CheckpointError) as e:
        load_llama(tmp_path)
    message = str(e.value)
    assert str(tmp_path) in message and "3 problems" in message
    assert ("missing tensor 'model.layers.0.mlp.up_proj.weight' (expected shape [172, 64])"
            in message)
    assert "unexpected tensor 'model.layers.0.mlp.upproj.weight' [172, 64]" in message
    assert "'model.norm.weight': expected shape [64], found [32]" in message
    assert "inv_freq" not in message


def test_checkpoint_of_another_shape_fails(tmp_path):
    save_llama(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pj.CheckpointError, match=r"\(6 problems\)") as e:
        load_llama(tmp_path)
    assert "'model.layers.1.mlp.down_proj.weight': expected shape [64, 128], found [64, 172]" \
        in str(e.value)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(pj.CheckpointError, match="is not a directory"):
        load_llama(tmp_path / "nowhere")
    with pytest.raises(pj.CheckpointError, match=r"config\.json' does not exist"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig.tiny().to_hf()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(pj.CheckpointError, match=r"neither model\.safetensors nor "
                       r"model\.safetensors\.index\.json.*pytorch_model\.bin.*safe_serialization"):
        load_llama(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(pj.CheckpointError, match="model-00001-of-00002.safetensors"):
        load_llama(tmp_path)


def test_corrupt_weights_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LlamaConfig.tiny().to_hf()))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00not a header")
    with pytest.raises(pj.CheckpointError, match="model.safetensors' is not a readable"):
        load_llama(tmp_path)


def test_unreadable_checkpoint_parts_are_named(tmp_path):
    save_llama(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = np.ones(64, np.int8)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(pj.CheckpointError, match="'model.norm.weight': dtype I8 in "
                       "model.safetensors is not a float type"):
        load_llama(tmp_path)

    # Two shards holding the same tensor.
    norm = {"model.norm.weight": np.ones(64, np.float32)}
    save_file(norm, tmp_path / "a.safetensors")
    save_file(norm, tmp_path / "b.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "a.safetensors",
                                                "lm_head.weight": "b.safetensors"}}))
    with pytest.raises(pj.CheckpointError, match="'model.norm.weight' is in both"):
        load_llama(tmp_path)
    index.write_text("{")
    with pytest.raises(pj.CheckpointError, match="is not a safetensors index"):
        load_llama(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(pj.CheckpointError, match=r"config\.json' is not valid JSON"):
        load_llama(tmp_path)


def test_unsupported_config_in_checkpoint_names_file(tmp_path):
    config = LlamaConfig.tiny().to_hf()
    config["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(pj.CheckpointError, match=r"config\.json': .*hidden_act='gelu'"):
        load_llama(tmp_path)


# -- configuration ------------------------------------------------------------------------


def test_config_defaults_resolve():
    config = LlamaConfig(vocab_size=10, hidden_size=48, intermediate_size=96, num_layers=1,
                         num_heads=6)
    assert (config.head_dim, config.num_kv_heads) == (8, 6)
    assert config.param_dtype == jnp.float32
    assert LlamaConfig.tiny(num_layers=3).num_layers == 3
    hash(config)  # a static attribute of the module


@pytest.mark.parametrize("overrides, match", [
    (dict(hidden_size=65), "hidden_size=65 is not divisible by num_heads=4"),
    (dict(num_kv_heads=3), "num_heads=4 is not divisible by num_kv_heads=3"),
    (dict(num_layers=0), "num_layers must be a positive integer, got 0"),
    (dict(vocab_size=-1), "vocab_size must be a positive integer"),
    (dict(num_heads=2.0), "num_heads must be a positive integer"),
    (dict(head_dim=15), "head_dim=15 must be even"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be positive"),
    (dict(param_dtype=jnp.int32), "param_dtype must be a float type"),
    (dict(param_dtype="nonsense"), "param_dtype='nonsense' is not a dtype"),
])
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.tiny(**overrides)


def test_explicit_head_dim_need_not_divide_hidden():
    config = LlamaConfig.tiny(hidden_size=60, head_dim=16)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))))
    assert state["layers"][0]["attn"]["q_proj"]["kernel"].shape == (60, 64)
    logits = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state,
                            jax.ShapeDtypeStruct((1, 4), jnp.int32))
    assert logits.shape == (1, 4, 256)


def test_hf_config_round_trip():
    config = LlamaConfig.tiny(rope_theta=5e5, rms_norm_eps=1e-6, tie_embeddings=True)
    assert LlamaConfig.from_hf(config.to_hf()) == config
    hf = transformers.LlamaConfig(**config.to_hf())
    assert LlamaConfig.from_hf(hf.to_dict()) == config
    # Older config.json files give rope_theta at the top level.
    old = {k: v for k, v in config.to_hf().items() if k != "rope_parameters"}
    assert LlamaConfig.from_hf(old).rope_theta == 5e5
    assert LlamaConfig.from_hf({**old, "rope_scaling": {"rope_type": "default"}}) == config
    assert LlamaConfig.from_hf(config.to_hf(), param_dtype="bfloat16").param_dtype == jnp.bfloat16


@pytest.mark.parametrize("field, value", [
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),          # lacks its bands
    ("rope_scaling", {"type": "longrope", "factor": 2.0}),
    ("rope_parameters", {"rope_type": "su", "rope_theta": 1e4, "factor": 4.0}),
    ("hidden_act", "gelu"),
    ("model_type", "gpt2"),
])
def test_unsupported_hf_settings(field, value):
    config = {**LlamaConfig.tiny().to_hf(), field: value}
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is not supported")):
        LlamaConfig.from_hf(config)


def test_hf_config_without_sizes_is_refused():
    with pytest.raises(ValueError, match="lacks num_hidden_layers, num_attention_heads"):
        LlamaConfig.from_hf({"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8})


def test_too_long_input_is_refused():
    model = Llama(LlamaConfig.tiny(max_position_embeddings=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="9 tokens exceed max_position_embeddings=8"):
        model(jnp.zeros((1, 9), jnp.int32))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        generate(model, jnp.zeros((1, 4), jnp.int32), max_new_tokens=5)


def test_token_ids_outside_the_vocabulary_are_named():
    model = Llama(LlamaConfig.tiny(vocab_size=256), rngs=nnx.Rngs(0))
    tokens = np.zeros((2, 5), np.int32)
    tokens[1, 3] = 300
    with pytest.raises(ValueError, match=r"token id 300 at position \[1, 3\] is outside the "
                                         r"vocabulary \[0, 256\)"):
        model(jnp.asarray(tokens))
    tokens[1, 3] = -1  # would wrap around to the table's last row
    with pytest.raises(ValueError, match=r"token id -1 at position \[1, 3\]"):
        model(jnp.asarray(tokens))
    with pytest.raises(ValueError, match=r"token id -1 at position \[1, 3\] in the prompt"):
        generate(model, jnp.asarray(tokens), max_new_tokens=1)
    with pytest.raises(TypeError, match=r"integer token ids, got float32\[2, 5\]; convert"):
        model(jnp.zeros((2, 5)))


def test_token_ids_outside_the_vocabulary_make_a_traced_loss_nan():
    # Inside a compiled step nothing can raise: a bad id (300, or -1, which indexing
    # would wrap to the last row) must show in the loss, not train on a wrong row.
    model = Llama(LlamaConfig.tiny(vocab_size=256), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    @jax.jit
    def loss(params, tokens):
        return jnp.mean(nnx.merge(graphdef, params)(tokens))

    good = jnp.zeros((2, 5), jnp.int32).at[1, 3].set(255)
    assert np.isfinite(loss(params, good))
    for bad in (256, 300, -1):
        assert np.isnan(loss(params, good.at[1, 3].set(bad))), bad


def test_check_token_ids():
    from pockjax.data import check_token_ids
    assert check_token_ids([[0, 9]], 10).dtype.kind == "i"
    assert check_token_ids([3, -100], 10, ignore=-100).tolist() == [3, -100]
    with pytest.raises(ValueError, match=r"label id 10 at position \[1\] in a.jsonl line 2 is "
                                         r"outside the vocabulary \[0, 10\) \(2 of 3 ids are\)"):
        check_token_ids([1, 10, 11], 10, what="label id", where=" in a.jsonl line 2")
    with pytest.raises(TypeError, match="token ids must be integers, got float64"):
        check_token_ids([1.0, 2.0], 10)


# -- the module -------------------------------------------------------------------------


def test_parameter_paths_and_shapes():
    config = LlamaConfig.tiny()
    model = Llama(config, rngs=nnx.Rngs(0))
    _, params, rest = pj.nnx.split(model)
    assert rest == {}
    shapes = {"/".join(str(k.key) for k in path): leaf.shape
              for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    layer = {"attn_norm/scale": (64,), "attn/q_proj/kernel": (64, 64),
             "attn/k_proj/kernel": (64, 32), "attn/v_proj/kernel": (64, 32),
             "attn/o_proj/kernel": (64, 64), "mlp_norm/scale": (64,),
             "mlp/gate_proj/kernel": (64, 172), "mlp/up_proj/kernel": (64, 172),
             "mlp/down_proj/kernel": (172, 64)}
    want = {"embed/embedding": (256, 64), "norm/scale": (64,), "lm_head/kernel": (64, 256),
            **{f"layers/{i}/{k}": v for i in range(2) for k, v in layer.items()}}
    assert shapes == want
    tied = Llama(LlamaConfig.tiny(tie_embeddings=True), rngs=nnx.Rngs(0))
    assert "lm_head/kernel" not in pj.nnx.param_paths(tied)


def test_llama2_7b_shape_without_allocation():
    config = LlamaConfig.llama2_7b()
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(int(np.prod(x.shape)) for x in leaves) == 6_738_415_616
    assert num_params(config) == 6_738_415_616
    assert abstract.layers[31].mlp.down_proj.kernel.shape == (11008, 4096)
    assert config.to_hf()["max_position_embeddings"] == 4096


def test_causal():
    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    tokens = random_tokens((1, 10))
    changed = tokens.copy()
    changed[0, 6:] = (changed[0, 6:] + 1) % VOCAB
    a, b = forward(model, tokens), forward(model, changed)
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3


def test_loss_reductions_stay_out_of_the_head_product():
    """XLA's CPU compiler fused log-softmax's max over the vocabulary into the head's
    dot, which then ran 2.5x slower at TinyLlama's size; the logits are kept apart by an
    identity (`reduce_precision` to float32's own widths) that changes no bit."""
    from pockjax.models.llama import _unfused

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    loss = lambda state, tokens: jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens)).mean()
    text = jax.jit(loss).lower(state, jnp.zeros((2, 8), jnp.int32)).compile().as_text()
    head = [c for c in re.split(r"\n(?=\S)", text)
            if re.search(r" dot\(", c) and f",{model.config.vocab_size}]" in c.split("\n")[0]]
    assert head and not any(" reduce(" in c for c in head), head

    tiny = np.finfo(np.float32).smallest_subnormal
    x = np.array([0.0, -0.0, 1.0, -3.4e38, np.inf, -np.inf, np.nan, tiny, -tiny * 7,
                  np.finfo(np.float32).tiny, 1 + np.finfo(np.float32).eps], np.float32)
    for f in (_unfused, jax.jit(_unfused)):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x))).view(np.uint32),
                                      x.view(np.uint32))


# -- greedy decoding ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder() -> Llama:
    """A small model with weights large enough for varied greedy output."""
    model = Llama(LlamaConfig.tiny(vocab_size=VOCAB), rngs=nnx.Rngs(7))
    graphdef, state = nnx.split(model)
    state = jax.tree.map(lambda x: x * 10 if x.ndim == 2 else x, state)
    return nnx.merge(graphdef, state)


def test_generate_is_greedy_decoding(decoder):
    prompt = random_tokens((2, 5), seed=4)
    out = np.asarray(generate(decoder, jnp.asarray(prompt, jnp.int32), max_new_tokens=4))
    assert out.shape == (2, 9)
    np.testing.assert_array_equal(out[:, :5], prompt)
    tokens = prompt
    for _ in range(4):
        nxt = forward(decoder, tokens)[:, -1].argmax(-1)
        tokens = np.concatenate([tokens, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(out, tokens)
    assert len(np.unique(out[:, 5:])) > 1


def test_generate_stops(decoder):
    prompt = jnp.asarray(random_tokens((2, 5), seed=4), jnp.int32)
    free = np.asarray(generate(decoder, prompt, max_new_tokens=4))
    stop = int(free[0, 6])  # the first sequence's second new token
    out = np.asarray(generate(decoder, prompt, max_new_tokens=4, stop_token=stop))
    assert (out[0, 7:] == stop).all()
    for row_free, row in zip(free, out):  # the same up to the first stop, then only stops
        new = list(row_free[5:])
        end = 5 + (new.index(stop) + 1 if stop in new else 4)
        np.testing.assert_array_equal(row[:end], row_free[:end])
        assert (row[end:] == stop).all()
    assert generate(decoder, prompt, max_new_tokens=0).shape == (2, 5)


def test_generate_refuses_bad_prompts(decoder):
    with pytest.raises(ValueError, match="integer tokens"):
        generate(decoder, jnp.zeros((5,), jnp.int32), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        generate(decoder, jnp.zeros((1, 2), jnp.int32), max_new_tokens=-1)


# -- sparse gradients -------------------------------------------------------------------

TRAIN_LAYER_1 = {
    "layers/1/attn/*_proj/kernel": pj.Full(),
    "layers/1/mlp/gate_proj/kernel": pj.Channels(ratio=0.25, axis="out"),
    "layers/1/mlp/up_proj/kernel": pj.Channels(ratio=0.5, axis="in"),
    "norm/scale": pj.Full(),
}


def lm_loss(tie: bool):
    model = Llama(LlamaConfig.tiny(vocab_size=VOCAB, tie_embeddings=tie), rngs=nnx.Rngs(0))
    graphdef, params, rest = pj.nnx.split(model)

    @jax.jit  # one compiled program for the dense reference, inlined by sparse_grad
    def loss(params, tokens):
        logits = pj.nnx.merge(graphdef, params, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

    return loss, params


@pytest.mark.parametrize("tie, head, fallbacks", [
    (False, {"lm_head/kernel": pj.Channels(ratio=0.25, axis="out")}, {}),
    # The embedding's gradient from the token lookup is a scatter-add, which has no
    # push-down rule: computed whole, then sliced.
    (True, {"embed/embedding": pj.Channels(ratio=0.25, axis="in")}, {"scatter-add": 1}),
], ids=["untied", "tied"])
def test_sparse_grad_matches_dense(tie, head, fallbacks):
    loss, params = lm_loss(tie)
    scheme = pj.Scheme({**TRAIN_LAYER_1, **head}, default=pj.Frozen())
    tokens = jnp.asarray(random_tokens((2, 12), seed=5), jnp.int32)
    info = assert_matches_dense(loss, scheme, params, tokens, rtol=1e-4, atol=1e-6)
    assert dict(info.fallbacks) == fallbacks, str(info)
    assert len(info.channels) == 3 and info.rules["dot_general"] >= 4
    assert "layers/0/attn/q_proj/kernel" in info.frozen


def test_remat_speaks_the_trainers_word():
    """`LlamaConfig(remat="blocks")` is what `pj.nnx.Trainer(remat="blocks")` calls the
    same thing; the older "block" reads as it, anything else names the choices."""
    assert LlamaConfig.tiny(remat="blocks").remat == LlamaConfig.tiny(remat="block").remat == "blocks"
    with pytest.raises(ValueError, match="'blocks'"):
        LlamaConfig.tiny(remat="layers")
