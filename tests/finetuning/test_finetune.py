"""`pockjax finetune` / `pj.finetune`: a Hugging Face folder and a JSONL file to a better
model; data formats and prompt masking, resume after SIGKILL bit for bit, the
non-finite guard, the output folder in transformers, and every bad input's message."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import pockjax as pj
from pockjax.data import DataError, batch_at, read_jsonl
from pockjax.finetuning import NonFiniteLoss, load_model

ROOT = Path(__file__).resolve().parents[2]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega one two three four five six seven eight nine "
         "ten def return import class self print").split()


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = np.random.default_rng(0)
    text = [" ".join(rng.choice(WORDS, 12)) for _ in range(300)]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>",
                                        "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", chat_template=CHATML)


def _folder(tmp: Path, kind: str) -> Path:
    fast = _tokenizer()
    vocab = len(fast)
    torch.manual_seed(0)
    if kind in ("llama", "qwen2"):  # qwen2: q/k/v biases, tied embeddings
        config_class, model_class = ((transformers.LlamaConfig, transformers.LlamaForCausalLM)
                                     if kind == "llama" else
                                     (transformers.Qwen2Config, transformers.Qwen2ForCausalLM))
        model = model_class(config_class(
            vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            tie_word_embeddings=kind == "qwen2", bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id))
    else:  # an architecture outside pockjax's own families: through pockjax.torch
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=48, n_layer=2, n_head=4,
                                         n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=fast.bos_token_id,
                                         eos_token_id=fast.eos_token_id)
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # HF's std 0.02 leaves a frozen head almost no reach
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.15)
    folder = tmp / kind
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    return {kind: _folder(tmp, kind) for kind in ("llama", "qwen2", "gpt2")}


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _completions(n, seed=0):
    rng = np.random.default_rng(seed)
    return [{"prompt": " ".join(rng.choice(WORDS[:24], 6)) + " :",
             "completion": " one two three four"} for _ in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(1)
    texts = [{"text": " ".join(rng.choice(WORDS[:12], 10))} for _ in range(24)]
    return {"train": _jsonl(tmp / "train.jsonl", texts[:16]),
            "valid": _jsonl(tmp / "valid.jsonl", texts[16:]),
            "completion": _jsonl(tmp / "completion.jsonl", _completions(320)),
            "completion_as_text": _jsonl(tmp / "as_text.jsonl", [
                {"text": r["prompt"] + r["completion"]} for r in _completions(320)]),
            "chat": _jsonl(tmp / "chat.jsonl", [
                {"messages": [{"role": "user", "content": r["prompt"]},
                              {"role": "assistant", "content": r["completion"]}]}
                for r in _completions(16)])}


def _cli(*args, timeout=600, **kw):
    return subprocess.run([sys.executable, "-m", "pockjax.cli", "finetune", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


# -- data ---------------------------------------------------------------------------------


def test_each_format_masks_what_the_loss_does_not_count(folders, data):
    from pockjax.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folders["llama"])
    text = read_jsonl(data["train"], tok, 64)
    assert text.format == "text" and all(e.mask.all() for e in text.examples)
    assert text.examples[0].ids[0] == tok.bos_id and text.examples[0].ids[-1] == tok.eos_id

    comp = read_jsonl(data["completion"], tok, 64)
    e = comp.examples[0]
    assert tok.decode(e.ids[e.mask].tolist(), skip_special_tokens=False) == " one two three four</s>"
    assert not e.mask[:3].any()

    chat = read_jsonl(data["chat"], tok, 64)
    e = chat.examples[0]
    masked = tok.decode(e.ids[e.mask].tolist(), skip_special_tokens=False)
    assert "one two three four" in masked and "<|im_start|>user" not in masked

    cut = read_jsonl(data["train"], tok, 6)
    assert cut.truncated == 16 and all(len(e.ids) == 6 for e in cut.examples)
    with pytest.raises(DataError, match="every example was dropped.*raise --seq"):
        read_jsonl(data["completion"], tok, 6)  # each completion starts past token 6

    batch = batch_at(comp, 45, 7, 64, seed=3, pad_id=tok.pad_id)  # 320 = 45 * 7 + 5
    assert batch["tokens"].shape == (7, 64) and batch["tokens"].dtype == np.int32
    assert (batch["mask"][5:] == 0).all() and (batch["tokens"][5:] == tok.pad_id).all()
    assert (batch["mask"][:5].sum(axis=1) == 5).all()  # " one two three four" + </s>


def test_batches_follow_the_seed_and_cover_each_epoch(folders, data):
    from pockjax.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folders["llama"])
    ds = read_jsonl(data["completion"], tok, 64)
    seen = [tuple(r) for s in range(10) for r in batch_at(ds, s, 32, 64, seed=0)["tokens"]]
    assert sorted(seen) == sorted(tuple(np.pad(e.ids, (0, 64 - len(e.ids)))) for e in ds.examples)
    np.testing.assert_array_equal(batch_at(ds, 13, 32, 64, seed=0)["tokens"],
                                  batch_at(ds, 13, 32, 64, seed=0)["tokens"])
    assert not np.array_equal(batch_at(ds, 0, 32, 64, seed=0)["tokens"],
                              batch_at(ds, 10, 32, 64, seed=0)["tokens"])  # a new epoch's order
    assert not np.array_equal(batch_at(ds, 0, 32, 64, seed=0)["tokens"],
                              batch_at(ds, 0, 32, 64, seed=1)["tokens"])


@pytest.mark.parametrize("line, message", [
    ('{"text": "a b"\n', "line 2: not valid JSON"),
    ('[1, 2]\n', "line 2: a JSON list, not an object"),
    ('{"question": "x"}\n', "line 2: a record with keys ['question']"),
    ('{"prompt": "x", "completion": "y"}\n', "line 2: a 'completion' record, but line 1 was 'text'"),
    ('{"text": 3}\n', "line 2: \"text\" must be a string"),
])
def test_a_bad_line_is_named_before_training(folders, tmp_path, line, message):
    from pockjax.tokenizer import Tokenizer
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "alpha beta"}\n' + line)
    with pytest.raises(DataError, match=str(path).replace(".", r"\.") + " " + message.replace(
            "[", r"\[").replace("]", r"\]")):
        read_jsonl(path, Tokenizer.from_folder(folders["llama"]), 32)


# -- the run ------------------------------------------------------------------------------


def test_prompt_masking_learns_the_completion_and_not_the_prompt(folders, data, tmp_path):
    # Random prompts, a constant completion: with the prompt masked out the loss (on the
    # completion only) goes to ~0; trained as plain text, the random prompt keeps it high.
    common = dict(scheme="full", steps=40, batch=8, seq=24, lr=1e-2, schedule="constant",
                  progress=False)
    masked = pj.finetune(folders["llama"], data["completion"], tmp_path / "masked", **common)
    unmasked = pj.finetune(folders["llama"], data["completion_as_text"], tmp_path / "text",
                           **common)
    assert masked.train_loss < 0.15, masked
    assert unmasked.train_loss > 1.0, unmasked


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_finetune_lowers_the_validation_loss_and_saves_a_transformers_folder(folders, data,
                                                                           tmp_path, kind,
                                                                           capsys):
    out = tmp_path / "run"
    result = pj.finetune(folders[kind], data["train"], out, valid=data["valid"],
                         scheme="last:1", epochs=6, batch=4, seq=32, lr=1e-2, eval_every=8,
                         progress=False)
    assert result.valid_loss < result.valid_loss_before - 0.5, result
    assert 0 < result.trainable_params < result.total_params
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "valid_loss" in r] == [0, 8, 16, 24]
    assert (out / "loss.png").is_file()
    # The output loads in transformers with the logits pockjax computes.
    final = Path(result.final)
    hf = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    tokens = np.random.default_rng(0).integers(0, hf.config.vocab_size, (2, 16))
    with torch.no_grad():
        want = hf(torch.tensor(tokens)).logits.numpy()
    ours = load_model(final)
    np.testing.assert_allclose(np.asarray(ours.apply(ours.params, tokens)), want, atol=2e-5)
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[kind]
    tok = transformers.AutoTokenizer.from_pretrained(final)
    assert tok("alpha beta")["input_ids"] == transformers.AutoTokenizer.from_pretrained(
        folders[kind])("alpha beta")["input_ids"]
    # pockjax generate looks at the model: greedy text equal to transformers' generate.
    from pockjax.cli import main
    capsys.readouterr()
    assert main(["generate", "--model", str(final), "--prompt", "alpha beta",
                 "--max-tokens", "8"]) == 0
    printed = capsys.readouterr()
    assert "tokens/s" in printed.err
    ids = tok("alpha beta", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=8, do_sample=False,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    assert printed.out.strip() == tok.decode(want[0, ids.shape[1]:],
                                             skip_special_tokens=True).strip()


def _params(folder: Path) -> dict[str, np.ndarray]:
    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("kind, stop", [("llama", "SIGKILL"), ("gpt2", "SIGKILL"),
                                        ("llama", "SIGTERM")])
def test_resume_after_sigkill_or_sigterm_equals_an_uninterrupted_run_bit_for_bit(
        folders, data, tmp_path, kind, stop, capsys):
    args = ["--model", folders[kind], "--data", data["completion"], "--scheme", "last:1",
            "--steps", 30, "--batch", 4, "--seq", 24, "--lr", 1e-3, "--save-every", 1,
            "--keep", 2, "--seed", 5]
    whole = _cli(*args, "--out", tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    # The same run, killed (or stopped as a scheduler stops a job) at a random step once
    # it has checkpoints, then resumed.
    out, log = tmp_path / "killed", tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pockjax.cli", "finetune",
                                 *map(str, args), "--out", str(out)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    kill_at = int(np.random.default_rng().integers(2, 20))
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        ckpts = list((out / "checkpoints").glob("step-*.safetensors")) if out.exists() else []
        if any(int(p.stem.split("-")[1]) >= kill_at for p in ckpts):
            break
        time.sleep(0.005)
    proc.send_signal(getattr(signal, stop))
    proc.wait(timeout=120)
    err = log.read_text()
    assert not (out / "final").exists(), "the run ended before it was stopped"
    if stop == "SIGKILL":
        assert proc.returncode == -signal.SIGKILL
    else:  # the step in flight completes, is saved, and the command says so
        assert proc.returncode == 143, err
        said = re.search(r"pockjax finetune: stopped by SIGTERM at step (\d+) of 30; saved "
                         r"(\S+) in [\d.]+ s; continue with --resume", err)
        assert said, err[-2000:]
        saved = sorted((out / "checkpoints").glob("step-*.safetensors"))[-1]
        assert said.group(2) == str(saved) and saved.stem == f"step-{int(said.group(1)):08d}"
    from pockjax.cli import main  # refused before any work: in this process
    assert main(["finetune", *map(str, args), "--out", str(out)]) != 0
    assert "--resume" in capsys.readouterr().err  # the folder is in use
    resumed = _cli(*args, "--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step-" in resumed.stderr
    a, b = _params(tmp_path / "whole" / "final"), _params(out / "final")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))  # each step logged once


def test_a_diverging_run_stops_and_keeps_a_loadable_finite_checkpoint(folders, data, tmp_path,
                                                                       capsys):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match=r"step \d+: the loss is (nan|inf).*--skip-nonfinite") as e:
        pj.finetune(folders["llama"], data["completion"], out, scheme="full", steps=40,
                    batch=4, seq=24, lr=1e20, save_every=1, progress=False)
    # One error for a step's non-finite loss: finetune's is fit's too, with the step.
    assert isinstance(e.value, pj.train.NonFiniteLoss) and not np.isfinite(e.value.loss)
    ckpts = sorted((out / "checkpoints").glob("step-*.safetensors"))
    assert ckpts and not (out / "final").exists() and ckpts[-1].stem == f"step-{e.value.step - 1:08d}"
    for path in ckpts:
        tensors = load_file(str(path))
        assert all(np.isfinite(v).all() for v in tensors.values() if v.dtype.kind == "f"), path
    from pockjax.cli import main
    code = main(["finetune", "--model", str(folders["llama"]), "--data", str(data["completion"]),
                 "--out", str(tmp_path / "cli"), "--scheme", "full", "--steps", "40", "--batch",
                 "4", "--seq", "24", "--lr", "1e20"])
    assert code == 1 and "the loss is" in capsys.readouterr().err
    skipping = pj.finetune(folders["llama"], data["completion"], tmp_path / "skip",
                           scheme="full", steps=20, batch=4, seq=24, lr=1e20,
                           skip_nonfinite=True, progress=False)
    assert skipping.skipped > 0


def test_bad_inputs_get_messages(folders, data, tmp_path, capsys):
    from pockjax.cli import main

    def fails(message, *args):  # in this process: no exception escapes, a message is printed
        try:
            code = main(["finetune", *map(str, args)])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err
        assert code not in (0, None) and message in err, err

    base = ["--model", folders["llama"], "--data", data["train"], "--steps", 1, "--seq", 16]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "alpha"}\n{"text": \n')
    fails(f"{bad} line 2: not valid JSON", *base[:2], "--data", bad, "--out", tmp_path / "a")
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        (no_tok / f).write_bytes((folders["llama"] / f).read_bytes())
    fails("tokenizer.json", "--model", no_tok, *base[2:], "--out", tmp_path / "b")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    fails("llama", "--model", odd, *base[2:], "--out", tmp_path / "c")
    fails("nowhere' is not a directory", "--model", tmp_path / "nowhere", *base[2:],
          "--out", tmp_path / "d")
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    fails("is not empty and holds no pockjax run", *base, "--out", used)
    fails("--seq must be a positive whole number, got 0", *base[:-1], "0", "--out", tmp_path / "e")
    fails("--seq must be at least 2", *base[:-1], "1", "--out", tmp_path / "e2")
    fails("takes at most 128 positions (max_position_embeddings in its config.json); pass "
          "--seq 128 or less", *base[:-1], "512", "--out", tmp_path / "e3")
    fails("--scheme 'nothing'", *base, "--scheme", "nothing", "--out", tmp_path / "f")
    fails("last:N takes a positive", *base, "--scheme", "last:0", "--out", tmp_path / "g")
    scheme = tmp_path / "scheme.json"
    scheme.write_text(pj.Scheme({"blocks/9/**": pj.Full()}).to_json())
    fails("matched no parameter", *base, "--scheme", scheme, "--out", tmp_path / "h")
    fails("argument --epochs: not allowed with argument --steps", *base, "--epochs", 1,
          "--out", tmp_path / "i")
    fails("lora:R takes a positive whole number", *base, "--scheme", "lora:0",
          "--out", tmp_path / "j")
    fails("blockwise:K takes a positive whole number", *base, "--scheme", "blockwise:x",
          "--out", tmp_path / "k")
    fails("use --frozen-dtype float32", *base, "--scheme", "blockwise:2", "--frozen-dtype",
          "bfloat16", "--out", tmp_path / "l")
    fails("--frozen-dtype 'int3': choose float32, bfloat16, int8 or int4", *base,
          "--frozen-dtype", "int3", "--out", tmp_path / "l2")
    fails("the group is an even number of values", *base, "--frozen-dtype", "int4:7",
          "--out", tmp_path / "l3")
    fails("is inside the model folder", *base, "--out", Path(folders["llama"]) / "run")
    assert not (Path(folders["llama"]) / "run").exists()
    gpt2 = ["--model", folders["gpt2"], *base[2:]]
    fails("use --frontend torch", *gpt2, "--frontend", "flax", "--out", tmp_path / "m")
    fails("takes at most 128 positions", *gpt2[:-1], "129", "--out", tmp_path / "m2")


def test_chat_data_with_bfloat16_frozen_weights_and_the_paper_scheme(folders, data, tmp_path):
    # The assistant's turns only are learned; frozen weights are bfloat16 in the run, the
    # saved folder holds the base's own (float32) tensors for them and float32 trained ones.
    result = pj.finetune(folders["llama"], data["chat"], tmp_path / "run", scheme="paper",
                         steps=6, batch=4, seq=40, lr=3e-3, frozen_dtype="bfloat16",
                         progress=False)
    assert np.isfinite(result.train_loss) and result.trainable_params < result.total_params
    saved = _params(Path(result.final))
    original = _params(folders["llama"])
    assert saved["model.layers.1.self_attn.q_proj.weight"].dtype == np.float32  # trained
    for name, x in original.items():  # as the base stores them
        assert saved[name].dtype == x.dtype == np.float32, name
    np.testing.assert_array_equal(  # frozen: the base's bytes, not the bfloat16 rounding
        saved["model.layers.0.mlp.down_proj.weight"],
        original["model.layers.0.mlp.down_proj.weight"])
    assert not np.array_equal(saved["model.layers.1.self_attn.q_proj.weight"],
                              original["model.layers.1.self_attn.q_proj.weight"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.final)
    assert hf.config.vocab_size == original["model.embed_tokens.weight"].shape[0]


def test_a_torch_frontend_model_takes_bfloat16_frozen_weights(folders, data, tmp_path):
    """GPT-2 through `pockjax.torch` with `frozen_dtype="bfloat16"`: the frozen weights
    are stored in bfloat16 (`pockjax.lowbit`, upcast where each is used), the run's
    losses are float32's to bfloat16's rounding, and the saved frozen weights are the
    base file's own."""
    runs = {dtype: pj.finetune(folders["gpt2"], data["train"], tmp_path / dtype, scheme="last:1",
                               steps=6, batch=4, seq=32, lr=3e-3, frozen_dtype=dtype,
                               progress=False, plot=False)
            for dtype in ("float32", "bfloat16")}
    assert runs["bfloat16"].trainable_params == runs["float32"].trainable_params
    assert runs["bfloat16"].train_loss == pytest.approx(runs["float32"].train_loss, rel=0.02)
    saved, original = _params(Path(runs["bfloat16"].final)), _params(folders["gpt2"])
    frozen, trained = "transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_fc.weight"
    np.testing.assert_array_equal(saved[frozen], original[frozen])
    assert saved[trained].dtype == original[trained].dtype
    assert not np.array_equal(saved[trained], original[trained])


def test_search_scheme_is_pockjax_search_under_the_budget(folders, data, tmp_path, monkeypatch):
    # The wiring only (the search itself is tested in tests/scheme_search/test_search.py): the budget,
    # training and held-out batches of the run's shape reach pj.search_scheme, and the scheme it
    # returns is the one trained.
    import pockjax.scheme_search as scheme_search

    seen = {}

    def search(factory, params, data_pair, budget, **kw):
        seen.update(budget=budget, train=data_pair[0], heldout=data_pair[1], cache=kw["cache"])
        scheme = pj.Scheme({"layers/1/mlp/up_proj/kernel": pj.Full()})
        factory(scheme)  # the factory builds a trainer for a candidate scheme
        return scheme, type("Report", (), {"chosen": ["layers/1/mlp/up_proj/kernel"]})()

    # pockjax's own name first: reading it loads the real function, which monkeypatch
    # puts back afterwards (read after the module's, it would be the stub, kept for good)
    monkeypatch.setattr(pj, "search_scheme", search)
    monkeypatch.setattr(scheme_search, "search_scheme", search)
    result = pj.finetune(folders["llama"], data["train"], tmp_path / "run", valid=data["valid"],
                         scheme="search:40%", steps=2, batch=4, seq=32, progress=False)
    assert seen["budget"] == "40%" and seen["train"][0]["tokens"].shape == (4, 32)
    assert seen["heldout"] and seen["cache"].endswith("search-cache")
    assert result.trainable_params == 48 * 96
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "layers/1/mlp/up_proj/kernel" in run["scheme"]


def _valid_loss(folder, valid, seq=32, batch=4):
    """The held-out loss of a saved folder, computed here (pockjax's forward pass)."""
    import optax

    from pockjax.data import eval_batches, read_jsonl

    loaded = load_model(folder)
    tok = pj.Tokenizer.from_folder(folder)
    pad = tok.pad_id if tok.pad_id is not None else tok.eos_id
    total = count = 0.0
    for b in eval_batches(read_jsonl(valid, tok, seq, vocab_size=loaded.vocab_size), batch, seq,
                          pad):
        logits = loaded.apply(loaded.params, b["tokens"])
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], b["tokens"][:, 1:])
        total += float((nll * b["mask"][:, 1:]).sum())
        count += float(b["mask"][:, 1:].sum())
    return total / count


def test_lora_scheme_trains_adapters_and_saves_them_merged(folders, data, tmp_path):
    result = pj.finetune(folders["llama"], data["train"], tmp_path / "run", valid=data["valid"],
                         scheme="lora:4", steps=12, batch=4, seq=32, lr=1e-2, progress=False)
    assert result.valid_loss < result.valid_loss_before
    # Adapters on the 7 linear layers of 2 blocks, (in + out) x rank each: q and o are
    # 48 -> 48, k and v 48 -> 24 (2 key/value heads of 12), gate, up and down 48 <-> 96.
    lora_params = 2 * 4 * (2 * (48 + 48) + 2 * (48 + 24) + 3 * (48 + 96))
    assert result.trainable_params == lora_params
    saved, original = _params(Path(result.final)), _params(folders["llama"])
    assert saved.keys() == original.keys()  # merged: a plain LLaMA folder
    np.testing.assert_array_equal(saved["model.embed_tokens.weight"],
                                  original["model.embed_tokens.weight"])
    assert not np.array_equal(saved["model.layers.0.mlp.up_proj.weight"],
                              original["model.layers.0.mlp.up_proj.weight"])
    # The merged folder scores what the adapted model scored at the end of the run.
    np.testing.assert_allclose(_valid_loss(result.final, data["valid"]), result.valid_loss,
                               rtol=1e-5)


def test_lora_through_pockjax_torch_equals_peft_with_torch_adamw(folders, data, tmp_path):
    """`--scheme lora:R` on a family outside pockjax's own (GPT-2's Conv1D layers) puts
    peft's adapters on every linear layer and trains them through pockjax.torch: the
    losses and the merged folder of peft + torch.optim.AdamW on the same batches."""
    import peft

    from pockjax.data import batch_examples, pad_batch, read_jsonl
    from pockjax.tokenizer import Tokenizer

    kw = dict(steps=4, batch=4, seq=24, lr=1e-2, warmup=0, schedule="constant",
              weight_decay=0.0, seed=2)
    result = pj.finetune(folders["gpt2"], data["completion"], tmp_path / "run", scheme="lora:4",
                         progress=False, plot=False, **kw)
    losses = [json.loads(line)["loss"] for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    torch.manual_seed(kw["seed"])
    model = peft.get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(folders["gpt2"]).eval(),
        peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    params = [p for p in model.parameters() if p.requires_grad]
    assert result.trainable_params == sum(p.numel() for p in params) > 0
    opt = torch.optim.AdamW(params, lr=kw["lr"], weight_decay=0.0, eps=1e-8)
    tok = Tokenizer.from_folder(folders["gpt2"])
    train = read_jsonl(data["completion"], tok, kw["seq"], vocab_size=model.config.vocab_size)
    want = []
    for i in range(kw["steps"]):
        b = pad_batch(batch_examples(train, i, kw["batch"], seed=kw["seed"]), kw["batch"],
                      kw["seq"], tok.pad_id)
        tokens, mask = torch.from_numpy(b["tokens"]).long(), torch.from_numpy(b["mask"])[:, 1:]
        nll = torch.nn.functional.cross_entropy(
            model(input_ids=tokens).logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(),
            reduction="none").view(mask.shape)
        loss = (nll * mask).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    saved, base = _params(Path(result.final)), _params(folders["gpt2"])
    merged = {k: v.detach().numpy() for k, v in model.merge_and_unload().state_dict().items()}
    assert saved.keys() == base.keys()
    for k in saved:
        if "attn.c_" in k or "mlp.c_" in k:  # adapted: merged as peft merges
            if k.endswith(".weight"):
                assert not np.array_equal(saved[k], base[k]), k
            np.testing.assert_allclose(saved[k], merged[k], rtol=1e-4, atol=1e-5, err_msg=k)
        else:
            np.testing.assert_array_equal(saved[k], base[k], err_msg=k)
    from pockjax.finetuning._job_export import export_job
    with pytest.raises(pj.finetuning.FinetuneError, match="LoRA's device job is implemented "
                                                          "for pockjax's Flax models"):
        export_job(folders["gpt2"], "host-cpu", tmp_path / "job", steps=2, scheme="lora:4",
                   progress=False)
    assert not (tmp_path / "job").exists()


def test_lora_on_a_mixture_of_experts_leaves_router_and_experts_frozen(data, tmp_path):
    """Mixtral through pockjax.torch with `lora:4`: adapters on the attention's linear
    layers only (the router and the stacked experts are parameters, which peft would
    wrap in ops torchax lacks), the loss falls, and every tensor but the adapted ones is
    the base's."""
    from tests.torch.test_torch import MOE

    fast = _tokenizer()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MOE["mixtral"](
        vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id))
    model.save_pretrained(tmp_path / "mixtral")
    fast.save_pretrained(tmp_path / "mixtral")
    result = pj.finetune(tmp_path / "mixtral", data["completion"], tmp_path / "run",
                         scheme="lora:4", steps=8, batch=4, seq=24, lr=3e-2, progress=False,
                         plot=False, valid=data["valid"])
    # q, o: 32 -> 32; k, v: 32 -> 16 (2 key/value heads of 8); rank 4; 2 blocks.
    assert result.trainable_params == 2 * 4 * (2 * (32 + 32) + 2 * (32 + 16))
    assert result.valid_loss < result.valid_loss_before
    saved, base = _params(Path(result.final)), _params(tmp_path / "mixtral")
    assert saved.keys() == base.keys()
    for k in saved:
        if "self_attn" in k and k.endswith("proj.weight"):
            assert not np.array_equal(saved[k], base[k]), k
        else:
            np.testing.assert_array_equal(saved[k], base[k], err_msg=k)


def test_torch_frontend_trains_the_same_llama_as_the_flax_one(folders, data, tmp_path):
    common = dict(scheme="last:1", steps=4, batch=4, seq=32, lr=1e-2, progress=False)
    flax_run = pj.finetune(folders["llama"], data["train"], tmp_path / "flax", **common)
    torch_run = pj.finetune(folders["llama"], data["train"], tmp_path / "torch",
                            frontend="torch", **common)
    assert torch_run.trainable_params == flax_run.trainable_params
    a, b = _params(Path(flax_run.final)), _params(Path(torch_run.final))
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
    changed = [k for k in a if not np.array_equal(a[k], _params(folders["llama"])[k])]
    assert changed and all(k.startswith("model.layers.1.") for k in changed), changed


def _stopped_after(run, out, step: int):
    """A copy of the finished run folder `run` at `out` as if stopped after `step`: no
    final model, no checkpoints past it."""
    shutil.copytree(run, out)
    shutil.rmtree(out / "final")
    for path in (out / "checkpoints").glob("step-*.safetensors"):
        if int(path.stem.split("-")[1]) > step:
            path.unlink()
    return out


def test_blockwise_schedule_trains_every_block_and_resumes_mid_turn(folders, data, tmp_path):
    common = dict(scheme="blockwise:2", steps=6, batch=4, seq=32, lr=1e-2, save_every=1,
                  keep=10, progress=False)
    whole = pj.finetune(folders["llama"], data["train"], tmp_path / "whole", **common)
    a, original = _params(Path(whole.final)), _params(folders["llama"])
    for layer in (0, 1):  # the last block trains first, then block 0, then block 1 again
        assert not np.array_equal(a[f"model.layers.{layer}.mlp.up_proj.weight"],
                                  original[f"model.layers.{layer}.mlp.up_proj.weight"])
    np.testing.assert_array_equal(a["model.embed_tokens.weight"],
                                  original["model.embed_tokens.weight"])
    # The same run stopped after step 3 (in block 0's turn) and resumed.
    cut = _stopped_after(tmp_path / "whole", tmp_path / "cut", 3)
    resumed = pj.finetune(folders["llama"], data["train"], cut, resume=True, **common)
    assert resumed.start_step == 3
    b = _params(Path(resumed.final))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_prefix_cache_gives_the_same_run_and_says_so(folders, data, tmp_path, capsys):
    """Six epochs of the last block: with the prefix cache (on, and auto) the final
    weights equal the uncached run's bit for bit; the log says what the cache saves;
    its spill folder is gone at the end."""
    # --logits all: a run the cache serves computes every logit (the default computes
    # only the counted positions' where the cache is off, equal within rounding).
    common = dict(valid=data["valid"], scheme="last:1", epochs=6, batch=4, seq=32, lr=1e-2,
                  eval_every=8, plot=False, logits="all")
    off = pj.finetune(folders["llama"], data["train"], tmp_path / "off", prefix_cache="off",
                      progress=False, **common)
    capsys.readouterr()
    on = pj.finetune(folders["llama"], data["train"], tmp_path / "on", prefix_cache="on",
                     progress=True, **common)
    err = capsys.readouterr().err
    assert "prefix cache on (asked for): the cut is float32[32, " in err, err
    assert on.valid_loss == off.valid_loss and on.train_loss == off.train_loss
    a, b = _params(Path(off.final)), _params(Path(on.final))
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert not (tmp_path / "on" / "prefix-cache").exists()
    once = pj.finetune(folders["llama"], data["train"], tmp_path / "once", steps=2,
                       progress=True, **{k: v for k, v in common.items() if k != "epochs"})
    assert "prefix cache off (auto): each example is seen once" in capsys.readouterr().err
    assert once.steps == 2
    with pytest.raises(pj.FinetuneError, match="--prefix-cache must be one of auto, on, off"):
        pj.finetune(folders["llama"], data["train"], tmp_path / "bad", prefix_cache="yes",
                    progress=False)
    # A schedule: the cut is below the lowest block any of its schemes trains.
    sched = dict(scheme="blockwise:2", epochs=3, batch=4, seq=32, lr=1e-2, plot=False,
                 progress=False, logits="all")
    a = pj.finetune(folders["llama"], data["train"], tmp_path / "s-off", prefix_cache="off",
                    **sched)
    b = pj.finetune(folders["llama"], data["train"], tmp_path / "s-on", prefix_cache="on",
                    **sched)
    a, b = _params(Path(a.final)), _params(Path(b.final))
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)


def test_seq_defaults_to_the_models_positions_where_fewer(folders, data, tmp_path, capsys):
    """Without --seq a model built for 128 positions trains on 128 tokens, not 512 (its
    forward pass would refuse them)."""
    pj.finetune(folders["gpt2"], data["train"], tmp_path / "run", steps=1, batch=2,
                scheme="last:1", progress=True, plot=False)
    assert "1 steps of 2 x 128 tokens" in capsys.readouterr().err


def test_a_tokenizer_larger_than_its_model_is_a_finetune_error(folders, data, tmp_path):
    """Token ids past the model's vocabulary (a tokenizer from another model) stop the run
    with FinetuneError naming the file and line, not a bare ValueError."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"])
    small = model.config.vocab_size - 200
    model.resize_token_embeddings(small)
    folder = tmp_path / "small-vocab"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (folders["llama"] / name).is_file():
            shutil.copyfile(folders["llama"] / name, folder / name)
    with pytest.raises(pj.FinetuneError, match=rf"train.jsonl line \d+ is outside the "
                                               rf"vocabulary \[0, {small}\)"):
        pj.finetune(folder, data["train"], tmp_path / "run", steps=1, batch=2, seq=32,
                    progress=False, plot=False)


def test_int8_moments_train_save_and_resume(folders, data, tmp_path):
    """`--moments int8`: the run records it, the loss falls, the block-wise moments go
    through the checkpoints (a run stopped after step 3 and resumed equals the whole run
    bit for bit), and resuming with other moments is refused naming the option."""
    common = dict(scheme="last:1", steps=6, batch=4, seq=32, lr=1e-2, save_every=1, keep=10,
                  progress=False, plot=False, moments="int8")
    whole = pj.finetune(folders["llama"], data["train"], tmp_path / "whole", **common)
    assert json.loads((tmp_path / "whole" / "run.json").read_text())["moments"] == "int8"
    assert whole.train_loss < json.loads(
        (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()[1])["loss"]
    cut = _stopped_after(tmp_path / "whole", tmp_path / "cut", 3)
    resumed = pj.finetune(folders["llama"], data["train"], cut, resume=True, **common)
    assert resumed.start_step == 3
    a, b = _params(Path(whole.final)), _params(Path(resumed.final))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    with pytest.raises(pj.FinetuneError, match="moments='int8', now moments='float32'"):
        pj.finetune(folders["llama"], data["train"], cut, resume=True,
                    **{**common, "moments": "float32"})
    with pytest.raises(pj.FinetuneError, match="--moments must be one of"):
        pj.finetune(folders["llama"], data["train"], tmp_path / "bad", **{**common, "moments": "int4"})


def test_resume_with_int4_weights_reads_the_checkpoint_or_loads_the_model_again(folders, data,
                                                                              tmp_path, capsys):
    """`--resume` with int4 frozen weights: the model's weights are dropped before the
    checkpoint (which holds them all) is read, and a run stopped after step 2 and resumed
    equals the whole run bit for bit. When no checkpoint loads (each damaged), the model
    is loaded again and the run starts over: equal to the whole run too."""
    common = dict(scheme="paper:1", steps=4, batch=4, seq=32, lr=1e-2, save_every=1, keep=10,
                  progress=False, plot=False, frozen_dtype="int4", moments="int8")
    whole = pj.finetune(folders["llama"], data["train"], tmp_path / "whole", **common)
    want = _params(Path(whole.final))
    cut = _stopped_after(tmp_path / "whole", tmp_path / "cut", 2)
    resumed = pj.finetune(folders["llama"], data["train"], cut, resume=True, **common)
    assert resumed.start_step == 2
    damaged = _stopped_after(tmp_path / "whole", tmp_path / "damaged", 2)
    for path in (damaged / "checkpoints").glob("step-*.safetensors"):
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF  # the last tensor's last byte: the checksum fails
        path.write_bytes(bytes(raw))
    again = pj.finetune(folders["llama"], data["train"], damaged, resume=True, **common)
    assert again.start_step == 0 and "skipping checkpoint" in capsys.readouterr().err
    for run in (resumed, again):
        got = _params(Path(run.final))
        assert sorted(got) == sorted(want)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_head_suffix_trains_the_output_head_too():
    """`paper+head`, `paper:K+head`, `last:N+head`: the base scheme's decisions plus the
    output head in full; other forms and models without a separate head are refused."""
    import jax
    from flax import nnx

    from pockjax.finetuning import FinetuneError, scheme_from_spec
    from pockjax.models.llama import Llama, LlamaConfig

    params = pj.nnx.split(Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)))[1]
    paths = pj.schemes.param_paths(params)
    for spec in ("paper", "paper:1", "last:1"):
        base = dict(zip(paths, jax.tree.leaves(scheme_from_spec(spec, params, 2).resolve(params))))
        head = dict(zip(paths, jax.tree.leaves(
            scheme_from_spec(spec + "+head", params, 2).resolve(params))))
        assert isinstance(base["lm_head/kernel"], pj.Frozen) and head["lm_head/kernel"] == pj.Full()
        assert {p: d for p, d in head.items() if p != "lm_head/kernel"} == \
            {p: d for p, d in base.items() if p != "lm_head/kernel"}, spec
    with pytest.raises(FinetuneError, match=r"\+head follows paper, paper:K or last:N"):
        scheme_from_spec("full+head", params, 2)
    # A tied head is the embedding table: +head trains it.
    tied = pj.nnx.split(Llama(LlamaConfig.tiny(tie_embeddings=True), rngs=nnx.Rngs(0)))[1]
    decided = dict(zip(pj.schemes.param_paths(tied), jax.tree.leaves(
        scheme_from_spec("last:1+head", tied, 2).resolve(tied))))
    assert decided["embed/embedding"] == pj.Full()
    assert isinstance(decided["layers/0/attn/q_proj/kernel"], pj.Frozen)
    with pytest.raises(FinetuneError, match="no output head"):
        scheme_from_spec("last:1+head", {"layers": [{"w": jnp.zeros((2, 2))}] * 2}, 2)


# -- today's checkpoints: what finetune and generate say and write --------------------------


def test_refused_runs_say_so_before_any_work_and_leave_nothing(folders, data, tmp_path, capsys):
    """A file with bytes that are not UTF-8, a folder given as data, a learning rate that
    is not finite, and an --out holding another run: one line each naming the file and
    line where there is one; the refused runs leave no folder behind."""
    from pockjax.cli import main

    def fails(message, *args):
        code = main(["finetune", *map(str, args)])
        err = capsys.readouterr().err
        assert code == 1 and message in err, err
        assert "Traceback" not in err

    base = ["--model", folders["llama"], "--steps", 1, "--seq", 16]
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "alpha beta"}\n{"text": "caf\xe9"}\n')
    out = tmp_path / "x"
    fails(f"{latin} line 2: not UTF-8 text (byte 0xe9 at column 14); save the file as UTF-8",
          *base, "--data", latin, "--out", out)
    fails(f"data '{tmp_path}' is a folder; give a JSONL file", *base, "--data", tmp_path,
          "--out", out)
    fails("--lr must be a positive finite number", *base, "--data", data["train"],
          "--lr", "inf", "--out", out)
    fails("--weight-decay must be a finite number >= 0", *base, "--data", data["train"],
          "--weight-decay", "nan", "--out", out)
    assert not out.exists()
    # Another run in --out is refused before the data is read (the data here is bad too:
    # the message is about the folder).
    used = tmp_path / "used"
    (used / "checkpoints").mkdir(parents=True)
    (used / "run.json").write_text("{}")
    (used / "checkpoints" / "step-00000002.safetensors").write_bytes(b"")
    fails("holds another run (run.json); pass --resume", *base, "--data", latin, "--out", used)


def test_a_run_that_saved_nothing_starts_again_without_overwrite(folders, data, tmp_path):
    """A run that stopped before its first checkpoint leaves run.json and an empty
    checkpoints/: the same command runs again in that folder."""
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss):
        pj.finetune(folders["llama"], data["train"], out, scheme="full", steps=3, batch=4,
                    seq=24, lr=1e20, progress=False)
    assert (out / "run.json").is_file() and not any((out / "checkpoints").iterdir())
    again = pj.finetune(folders["llama"], data["train"], out, scheme="full", steps=3,
                        batch=4, seq=24, progress=False)
    assert again.steps == 3 and (out / "final").is_dir()


def test_final_keeps_the_base_config_dtype_and_frozen_bytes(folders, data, tmp_path):
    """`final/config.json` keeps every field of the base's (token ids, initializer range,
    use_cache); a bfloat16 base comes back in bfloat16 (`--save-dtype` chooses), and the
    tensors the scheme froze are the base's bytes, also under int4 frozen weights."""
    from safetensors import safe_open

    base = tmp_path / "bf16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"]).to(torch.bfloat16)
    hf.save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (base / name).write_bytes((folders["llama"] / name).read_bytes())
    config = json.loads((base / "config.json").read_text())

    def tensors(folder):
        out = {}
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
        return out

    original = tensors(base)
    trained = "model.layers.1.mlp.up_proj.weight"
    for frozen_dtype, save_dtype, want in (("float32", "auto", torch.bfloat16),
                                           ("int4", "auto", torch.bfloat16),
                                           ("float32", "float32", torch.float32)):
        run = pj.finetune(base, data["train"], tmp_path / f"{frozen_dtype}-{save_dtype}",
                          scheme="last:1", steps=3, batch=4, seq=16, lr=3e-3,
                          frozen_dtype=frozen_dtype, save_dtype=save_dtype, progress=False,
                          plot=False)
        written = json.loads((Path(run.final) / "config.json").read_text())
        for key in ("bos_token_id", "eos_token_id", "initializer_range", "use_cache"):
            assert written[key] == config[key], key
        assert written["dtype"] == str(want).removeprefix("torch.")
        saved = tensors(Path(run.final))
        assert sorted(saved) == sorted(original)
        for k, x in saved.items():  # last:1 trains block 1 only
            if k.startswith("model.layers.1."):
                assert x.dtype == want, k
            else:  # the base's own bytes
                assert x.dtype == torch.bfloat16 and torch.equal(x, original[k]), k
        assert not torch.equal(saved[trained].to(torch.float32),
                               original[trained].to(torch.float32))
        transformers.AutoModelForCausalLM.from_pretrained(run.final)
    with pytest.raises(pj.FinetuneError, match="--save-dtype must be one of auto"):
        pj.finetune(base, data["train"], tmp_path / "bad", save_dtype="int8", progress=False)


def test_generate_loads_models_as_finetune_does(folders, tmp_path, capsys):
    """`generate --frontend`, the position limit on both paths, and --chat without a
    template: one line each."""
    from pockjax.cli import main

    def run(*args):
        code = main(["generate", *map(str, args)])
        return code, capsys.readouterr()

    for frontend in ("flax", "torch"):
        code, out = run("--model", folders["llama"], "--prompt", "alpha beta", "--max-tokens",
                        4, "--frontend", frontend)
        assert code == 0, out.err
    texts = {f: run("--model", folders["llama"], "--prompt", "alpha beta", "--max-tokens", 6,
                    "--frontend", f)[1].out for f in ("flax", "torch")}
    assert texts["flax"] == texts["torch"]
    for frontend in ("flax", "torch"):
        code, out = run("--model", folders["llama"], "--prompt", "alpha beta", "--max-tokens",
                        400, "--frontend", frontend)
        assert code == 1 and "exceed the 128 positions" in out.err and "--max-tokens 1" in \
            out.err, out.err
    code, out = run("--model", folders["gpt2"], "--prompt", "alpha", "--max-tokens", 200)
    assert code == 1 and "exceed the 128 positions" in out.err
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in folders["llama"].iterdir():
        if f.name != "chat_template.jinja":
            (plain / f.name).write_bytes(f.read_bytes())
    tok_config = json.loads((plain / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(tok_config))
    code, out = run("--model", plain, "--prompt", "alpha", "--chat")
    assert code == 1 and "has no chat template" in out.err and "drop --chat" in out.err
    assert "Traceback" not in out.err


def test_a_family_model_the_flax_llama_cannot_run_goes_to_torch_with_a_note(folders, data,
                                                                              tmp_path, capsys):
    """Under `auto`, a LLaMA-family setting pockjax's LLaMA does not compute (here Phi-3's
    longrope scaling on a LLaMA config) runs through pockjax.torch with a one-line note;
    `--frontend flax` is refused with the reason."""
    from pockjax.finetuning._model import frontend_of

    folder = tmp_path / "longrope"
    folder.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((folders["llama"] / name).read_bytes())
    config = json.loads((folders["llama"] / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                                 "original_max_position_embeddings": 64}
    (folder / "config.json").write_text(json.dumps(config))
    kind, _, note = frontend_of(folder)
    assert kind == "torch" and "runs through pockjax.torch" in note and "longrope" in note
    with pytest.raises(pj.FinetuneError, match="--frontend flax: .*longrope.*use --frontend "
                                               "torch"):
        frontend_of(folder, "flax")
    assert frontend_of(folders["llama"]) == ("flax", json.loads(
        (folders["llama"] / "config.json").read_text()), "")
    result = pj.finetune(folder, data["train"], tmp_path / "run", scheme="last:1", steps=2,
                         batch=4, seq=16, progress=True, plot=False)
    assert np.isfinite(result.train_loss)
    assert "runs through pockjax.torch: pockjax's LLaMA cannot run it" in capsys.readouterr().err


# Tiny checkpoints of families people fine-tune, each with what PockEngine's scheme trains
# in a block: the attention projections and the MLP's first linear(s), named here by hand
# (not from pockjax.schemes.FAMILY_NAMES), and the output head for +head.
FAMILY_CASES = {
    "phi3": (lambda v: transformers.Phi3Config(
        vocab_size=v, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2),
        ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj"), "lm_head"),
    "gpt2": (lambda v: transformers.GPT2Config(vocab_size=v, n_embd=32, n_layer=2, n_head=4,
                                               n_positions=64, bos_token_id=1, eos_token_id=2),
             ("attn.c_attn", "attn.c_proj", "mlp.c_fc"), "transformer.wte"),
    "gpt_neox": (lambda v: transformers.GPTNeoXConfig(
        vocab_size=v, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, bos_token_id=1, eos_token_id=2),
        ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h"), "lm_head"),
    "falcon": (lambda v: transformers.FalconConfig(vocab_size=v, hidden_size=32,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   bos_token_id=1, eos_token_id=2),
               ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h"),
               "transformer.word_embeddings"),
    "gemma": (lambda v: transformers.GemmaConfig(
        vocab_size=v, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0),
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj"), "model.embed_tokens"),
    "llama3": (lambda v: transformers.LlamaConfig(
        vocab_size=v, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}),
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj"), "model.embed_tokens"),
}


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_families_train_what_the_scheme_means_and_generate(family, data, tmp_path, capsys):
    """`finetune` with the default scheme (paper: the last half of the blocks) trains each
    family's attention and first MLP linears, as many parameters as those weights (and
    their biases) hold; `+head` adds the output head (the embedding where they are
    tied); `generate` continues a prompt; Llama-3.x (llama3 rotary scaling, a tied head)
    runs on the Flax path."""
    from pockjax.cli import main

    make, trained_modules, head = FAMILY_CASES[family]
    fast = _tokenizer()
    model = transformers.AutoModelForCausalLM.from_config(make(len(fast)))
    folder = tmp_path / family
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    params = dict(model.named_parameters())
    blocks = sorted({n.split(".layers.")[-1].split(".h.")[-1].split(".")[0] for n in params
                     if ".layers." in n or ".h." in n}, key=int)
    last = blocks[len(blocks) // 2:]
    want = sum(p.numel() for n, p in params.items()
               if any(f".{b}.{m}." in n for b in last for m in trained_modules))
    # The head's weight as transformers holds it (the embedding's, where tied).
    [head_name] = [n for n, p in params.items() if p is model.get_output_embeddings().weight]
    assert head_name.startswith(head + "."), head_name
    heads = sum(p.numel() for n, p in params.items() if n.startswith(head_name.rsplit(".", 1)[0]
                                                                      + "."))
    for spec, count in (("paper", want), ("paper+head", want + heads)):
        run = pj.finetune(folder, data["train"], tmp_path / f"run-{spec}", scheme=spec, steps=2,
                          batch=4, seq=16, lr=1e-3, progress=True, plot=False)
        assert run.trainable_params == count, (spec, run.trainable_params, count)
        assert np.isfinite(run.train_loss)
    err = capsys.readouterr().err
    assert f"{want:,} of" in err
    if family == "llama3":
        assert "(pockjax.models.llama)" in err
    code = main(["generate", "--model", str(tmp_path / "run-paper" / "final"), "--prompt",
                 "alpha beta", "--max-tokens", "4"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_checkpoints_finetune(family, data, tmp_path):
    """A mixture-of-experts folder through `finetune` (pockjax.torch): `paper` trains the
    attention and every expert's stacked gate/up weights (Qwen2-MoE's shared expert too)
    and leaves the router and the down projections as the base's bytes; transformers
    loads final/."""
    from tests.torch.test_torch import MOE

    fast = _tokenizer()
    config = MOE[family](vocab_size=len(fast), hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=64,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    folder = tmp_path / family
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    run = pj.finetune(folder, data["train"], tmp_path / "run", steps=3, batch=4, seq=16,
                      lr=1e-3, progress=False, plot=False)
    assert np.isfinite(run.train_loss)
    base, final = _params(folder), _params(Path(run.final))
    assert base.keys() == final.keys()  # the file's own names (one tensor per expert)
    moved = {k for k in base if not np.array_equal(base[k], final[k])}
    want = {f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"}
    if family == "mixtral":
        want |= {f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in range(4)
                 for w in ("w1", "w3")}
        router = "model.layers.1.block_sparse_moe.gate.weight"
    else:  # q/k/v biases, and the shared expert's first linears
        want |= {f"model.layers.1.mlp.experts.{e}.{w}_proj.weight" for e in range(4)
                 for w in ("gate", "up")}
        want |= {f"model.layers.1.self_attn.{p}_proj.bias" for p in "qkv"}
        want |= {f"model.layers.1.mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up")}
        router = "model.layers.1.mlp.gate.weight"
    assert moved == want
    assert router in base
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run.final)
    np.testing.assert_array_equal(loaded.model.layers[1].mlp.gate.weight.detach().numpy(),
                                  base[router])


def test_a_second_run_reads_its_compiled_steps_from_the_cache(folders, data, tmp_path):
    """`finetune` turns on JAX's persistent compilation cache in the user's cache folder
    (here POCKJAX_CACHE_DIR): the first run fills it, the second finds its programs there
    (JAX's cache-hit events), and both log the first step's compile seconds; --no-cache
    leaves the cache alone."""
    script = (
        "import json, sys, jax, jax.monitoring as m\n"
        "hits = []\n"
        "m.register_event_listener(lambda e, **k: hits.append(e) if 'cache_hits' in e else 0)\n"
        "from pockjax.cli import main\n"
        "code = main(['finetune', *sys.argv[1:]])\n"
        "print(json.dumps({'code': code, 'hits': len(hits),"
        " 'dir': jax.config.jax_compilation_cache_dir}))\n")
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["POCKJAX_CACHE_DIR"] = str(tmp_path / "cache")
    args = ["--model", str(folders["llama"]), "--data", str(data["train"]), "--scheme",
            "last:1", "--steps", "2", "--batch", "4", "--seq", "16", "--no-plot"]
    runs = []
    for name, extra in (("a", []), ("b", []), ("c", ["--no-cache"])):
        proc = subprocess.run([sys.executable, "-c", script, *args, "--out",
                               str(tmp_path / name), *extra], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        first = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 1 and first["compile_seconds"] > 0, first
        assert "of which compiling" in proc.stderr
    assert runs[0]["dir"] == str(tmp_path / "cache" / "jax")
    assert any((tmp_path / "cache" / "jax").iterdir())
    assert runs[0]["hits"] == 0 and runs[1]["hits"] > 0
    assert runs[2]["dir"] is None and runs[2]["hits"] == 0
    # A step read from the cache computes what the compiled one did, bit for bit.
    weights = [(tmp_path / n / "final" / "model.safetensors").read_bytes() for n in "abc"]
    assert weights[0] == weights[1] == weights[2]


def test_the_head_runs_at_the_counted_positions_with_the_same_run(folders, data, tmp_path,
                                                                  capsys):
    """Prompt/completion data: with --logits targets (the default) the head runs at the
    completion's positions only, and the run ends where --logits all ends (float32
    rounding apart); run.json records which."""
    common = dict(scheme="last:1+head", steps=4, batch=4, seq=48, lr=1e-3, plot=False)
    at = pj.finetune(folders["llama"], data["completion"], tmp_path / "at", progress=True,
                     **common)
    assert "the output head runs at the positions the loss counts" in capsys.readouterr().err
    every = pj.finetune(folders["llama"], data["completion"], tmp_path / "all", logits="all",
                        progress=False, **common)
    assert json.loads((tmp_path / "all" / "run.json").read_text())["logits"] == "all"
    np.testing.assert_allclose(at.train_loss, every.train_loss, rtol=1e-5)
    a, b = _params(Path(at.final)), _params(Path(every.final))
    for k in a:  # Adam turns a rounding-level gradient difference into up to lr a step
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
    with pytest.raises(pj.FinetuneError, match="--logits must be one of targets, all"):
        pj.finetune(folders["llama"], data["completion"], tmp_path / "bad", logits="some",
                    progress=False)


def test_a_rising_validation_loss_is_said_once(folders, data, tmp_path, capsys):
    """A learning rate far too high: the validation loss rises above its best, and the
    run says so once (the log with progress, a Python warning without), and records it."""
    kw = dict(scheme="full", steps=6, batch=4, seq=24, lr=0.3, eval_every=2)
    pj.finetune(folders["llama"], data["train"], tmp_path / "a", valid=data["valid"], **kw)
    said = [line for line in capsys.readouterr().err.splitlines()
            if "the validation loss rose" in line]
    assert len(said) == 1 and "a lower --lr (now 0.3)" in said[0], said
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text()
               .splitlines()]
    assert sum("warning" in r for r in records) == 1
    with pytest.warns(UserWarning, match="the validation loss rose from"):
        pj.finetune(folders["llama"], data["train"], tmp_path / "b", valid=data["valid"],
                    progress=False, **kw)
    quiet = pj.finetune(folders["llama"], data["train"], tmp_path / "c", valid=data["valid"],
                        progress=False, **{**kw, "lr": 1e-4})
    assert quiet.valid_loss < quiet.valid_loss_before


def test_lr_auto_picks_the_rate_with_the_lowest_held_out_loss(folders, data, tmp_path, capsys):
    """Each rate of the grid trains from the same weights for the sweep's steps; the one
    whose held-out loss is lowest is recorded and trains the run, and the run equals a
    run given that rate; a resume reuses the choice without sweeping again."""
    from pockjax.finetuning._options import LR_GRID

    kw = dict(scheme="full", steps=8, batch=4, seq=24, valid=data["valid"], progress=False)
    auto = pj.finetune(folders["llama"], data["train"], tmp_path / "auto", lr="auto", **kw)
    record = json.loads((tmp_path / "auto" / "run.json").read_text())
    sweep = record["lr_auto"]
    assert record["lr"] == "auto" and sweep["steps"] == 8
    assert set(sweep["losses"]) == {f"{r:g}" for r in LR_GRID}
    assert sweep["chosen"] == float(min(sweep["losses"], key=sweep["losses"].get))
    # The sweep's run at the chosen rate is the same 8 steps as the run: the same loss.
    assert auto.valid_loss == pytest.approx(sweep["losses"][f"{sweep['chosen']:g}"], rel=1e-5)
    given = pj.finetune(folders["llama"], data["train"], tmp_path / "given",
                        lr=sweep["chosen"], **kw)
    assert given.valid_loss == pytest.approx(auto.valid_loss, rel=1e-5)
    capsys.readouterr()
    pj.finetune(folders["llama"], data["train"], tmp_path / "auto", lr="auto", resume=True,
                **{**kw, "progress": True})
    assert "--lr auto:" not in capsys.readouterr().err        # not swept again
    with pytest.raises(pj.FinetuneError, match="--lr auto chooses the rate by the loss on "
                                            "held-out data: give --valid FILE"):
        pj.finetune(folders["llama"], data["train"], tmp_path / "x", lr="auto",
                    **{k: v for k, v in kw.items() if k != "valid"})
    with pytest.raises(pj.FinetuneError, match="--lr auto with --scheme blockwise:2"):
        pj.finetune(folders["llama"], data["train"], tmp_path / "x", lr="auto",
                    **{**kw, "scheme": "blockwise:2"})
    with pytest.raises(pj.FinetuneError, match="--lr must be a positive finite number or auto"):
        pj.finetune(folders["llama"], data["train"], tmp_path / "x", lr="fast", **kw)


def test_valid_equal_to_the_training_data_is_said(folders, data, tmp_path, capsys):
    pj.finetune(folders["llama"], data["train"], tmp_path / "a", valid=data["train"],
                steps=1, batch=4, seq=24)
    assert "is the training file: its loss measures what the model memorised" in \
        capsys.readouterr().err
