"""GGUF files in and out (`pockjax.gguf`): a real pretrained model's file
(SmolLM2-135M-Instruct, Q4_1) and a two-block model made from it with every tensor type
pockjax decodes. References: transformers' GGUF loader (tokenizer, template, logits),
the same run from the float32 folder transformers makes of the file, `gguf`'s reader,
and llama.cpp (llama-cpp-python) on the written file."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest

from pockjax import lowbit
from pockjax.finetuning import FinetuneError, finetune
from pockjax.finetuning._model import load_model, model_folder

PROMPTS = ["What is the capital of France?", "def dumps(obj):\n    return json.dumps(obj)",
           "  spaces,\ttabs and ünïcode — ok", ""]


def _hf(path, **kw):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **kw).eval()


def _logits(module, tokens):
    import torch

    with torch.no_grad():
        return module(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def _data(tmp_path, n=24):
    """Chat examples from the standard library's docstrings."""
    import ast
    import sys
    from pathlib import Path

    rows = []
    for name in ("textwrap.py", "shlex.py", "fractions.py", "json/__init__.py"):
        tree = ast.parse((Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}."
                          f"{sys.version_info[1]}" / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                doc = ast.get_docstring(node).split("\n\n")[0][:200]
                rows.append({"messages": [
                    {"role": "user", "content": f"What does `{node.name}` in {name} do?"},
                    {"role": "assistant", "content": doc}]})
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:n]))
    valid.write_text("".join(json.dumps(r) + "\n" for r in rows[n:n + 6]))
    return train, valid


def test_tokenizer_and_chat_template_are_transformers(smollm2):
    from transformers import AutoTokenizer

    from pockjax.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(model_folder(smollm2))
    theirs = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    for text in PROMPTS:
        assert ours.encode(text) == theirs.encode(text), text
    chat = [{"role": "user", "content": PROMPTS[0]}]
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
        theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_id, ours.bos_id) == (theirs.eos_token_id, theirs.bos_token_id) == (2, 1)
    assert model_folder(smollm2) == model_folder(smollm2)   # made once, then found


def test_logits_of_the_real_file_equal_transformers(smollm2):
    """Within 1e-4 of transformers' float32 model of the file, with every weight decoded
    (all trained) and with the default scheme's frozen weights kept in Q4_1 / Q8_0."""
    from pockjax.finetuning._spec import SchemeSpec

    tokens = np.array([[1, 504, 3458, 282, 4649, 314, 2, 0, 17, 49151]], np.int32)
    want = _logits(_hf(smollm2), tokens)
    loaded = load_model(smollm2)
    got = np.asarray(jax.jit(loaded.apply)(loaded.params, tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    stored = load_model(smollm2, scheme_of=SchemeSpec.parse("paper").build)
    kinds = [x.fmt.name for x in jax.tree.leaves(stored.params, is_leaf=lowbit.is_quantized)
             if lowbit.is_quantized(x)]
    assert kinds.count("Q8_0") == 1 and kinds.count("Q4_1") == 15 * 7 + 15, kinds
    got = np.asarray(jax.jit(lowbit.at_use(stored.apply))(stored.params, tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def test_every_tensor_type_loads_as_transformers_reads_it(tiny_gguf):
    """The two-block file (Q4_0 ... Q8_0, Q4_K, Q6_K, F16, BF16, F32 weights): logits
    equal transformers' with its frozen weights in the file's types."""
    from pockjax.finetuning._spec import SchemeSpec

    tokens = np.array([[1, 504, 3458, 0, 49151, 2, 17]], np.int32)
    want = _logits(_hf(tiny_gguf), tokens)
    stored = load_model(tiny_gguf, scheme_of=SchemeSpec.parse("last:1").build)
    kinds = {x.fmt.name for x in jax.tree.leaves(stored.params, is_leaf=lowbit.is_quantized)
             if lowbit.is_quantized(x)}
    assert kinds == {"Q4_0", "Q5_0", "Q5_1", "Q8_0", "float16", "bfloat16", "Q6_K"}, kinds
    got = np.asarray(jax.jit(lowbit.at_use(stored.apply))(stored.params, tokens))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


@pytest.fixture(scope="module")
def tiny_runs(tiny_gguf, tmp_path_factory):
    """The same run from the GGUF file and from the float32 folder transformers makes of
    it: the last block trains, AdamW at 1e-3, three steps; the folder's run writes
    final.gguf too (`save_gguf`, frozen tensors in Q8_0)."""
    tmp = tmp_path_factory.mktemp("tiny-runs")
    train, valid = _data(tmp)
    folder = tmp / "float32"
    import transformers
    read = _hf(tiny_gguf)   # transformers keeps a GGUF-loaded model from being saved
    copy = transformers.AutoModelForCausalLM.from_config(read.config)
    copy.load_state_dict(read.state_dict())
    copy.save_pretrained(folder)
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name) \
        .save_pretrained(folder)
    kw = dict(scheme="last:1", steps=3, batch=2, seq=64, lr=1e-3, progress=False, plot=False,
              compile_cache=False, gguf_type="F32", valid=str(valid))
    from_file = finetune(str(tiny_gguf), str(train), str(tmp / "from-gguf"), **kw)
    from_folder = finetune(str(folder), str(train), str(tmp / "from-folder"), save_gguf="Q8_0",
                           **{k: v for k, v in kw.items() if k != "gguf_type"})
    return tmp, from_file, from_folder


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_run_from_the_file_equals_the_run_from_its_float32_folder(tiny_runs, tiny_gguf):
    tmp, a, b = tiny_runs
    la = [r["loss"] for r in _metrics(tmp / "from-gguf") if "loss" in r]
    lb = [r["loss"] for r in _metrics(tmp / "from-folder") if "loss" in r]
    assert len(la) == 3 and la == pytest.approx(lb, rel=1e-5, abs=1e-5)
    assert a.valid_loss == pytest.approx(b.valid_loss, rel=1e-5)
    assert json.loads((tmp / "from-gguf" / "run.json").read_text())["model"] == str(tiny_gguf)
    from safetensors.numpy import load_file
    fa = load_file(tmp / "from-gguf" / "final" / "model.safetensors")
    fb = load_file(tmp / "from-folder" / "final" / "model.safetensors")
    assert fa.keys() == fb.keys()
    for name in fa:
        moved = np.abs(fb[name].astype(np.float32) - load_file(
            tmp / "float32" / "model.safetensors").get(name, fb[name]).astype(np.float32)).max()
        np.testing.assert_allclose(fa[name], fb[name], rtol=0,
                                   atol=max(1e-6, 1e-3 * float(moved)), err_msg=name)


def test_lora_on_the_file_equals_lora_on_its_float32_folder(tiny_runs, tiny_gguf):
    """QLoRA on the file as stored: LoRA adapters over the file's blocks train as they do
    over the float32 folder (same draws, same losses); final/ and final.gguf hold the
    merged kernels, and every tensor without an adapter keeps the file's bytes."""
    tmp = tiny_runs[0]
    train, valid = tmp / "train.jsonl", tmp / "valid.jsonl"
    kw = dict(scheme="lora:4", steps=3, batch=2, seq=64, lr=1e-2, progress=False, plot=False,
              compile_cache=False, valid=str(valid), seed=3)
    a = finetune(str(tiny_gguf), str(train), str(tmp / "lora-gguf"), gguf_type="F32", **kw)
    b = finetune(str(tmp / "float32"), str(train), str(tmp / "lora-folder"), **kw)
    la = [r["loss"] for r in _metrics(tmp / "lora-gguf") if "loss" in r]
    lb = [r["loss"] for r in _metrics(tmp / "lora-folder") if "loss" in r]
    assert len(la) == 3 and la == pytest.approx(lb, rel=1e-5, abs=1e-5)
    assert la[-1] < la[0] and a.valid_loss == pytest.approx(b.valid_loss, rel=1e-5)
    assert a.trainable_params == b.trainable_params
    from safetensors.numpy import load_file
    fa = load_file(tmp / "lora-gguf" / "final" / "model.safetensors")
    fb = load_file(tmp / "lora-folder" / "final" / "model.safetensors")
    base = load_file(tmp / "float32" / "model.safetensors")
    assert fa.keys() == fb.keys() == base.keys()
    for name in fa:
        moved = float(np.abs(fb[name] - base[name]).max())
        if name.endswith("proj.weight"):
            assert moved > 0, name   # merged: the adapters moved it
        np.testing.assert_allclose(fa[name], fb[name], rtol=0,
                                   atol=max(1e-6, 1e-3 * moved), err_msg=name)
    report = json.loads((tmp / "lora-gguf" / "final.gguf.json").read_text())
    trained = {n for n, r in report.items() if "trained" in r}
    assert trained and all(n.startswith("blk.") and n.endswith(".weight") and "norm" not in n
                           for n in trained)
    src = {t.name: t for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    for t in gguf.GGUFReader(str(tmp / "lora-gguf" / "final.gguf")).tensors:
        if t.name not in trained:
            np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8),
                                          np.asarray(src[t.name].data).view(np.uint8))
    tokens = np.array([[1, 504, 3458, 0, 49151, 2, 17]], np.int32)
    import transformers
    want = _logits(transformers.AutoModelForCausalLM.from_pretrained(
        tmp / "lora-gguf" / "final").eval(), tokens)
    np.testing.assert_allclose(_logits(_hf(tmp / "lora-gguf" / "final.gguf"), tokens), want,
                               rtol=0, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_the_device_job_of_a_gguf_file_ends_where_finetune_ends(tiny_runs, tiny_gguf,
                                                                 monkeypatch, capsys):
    """`pockjax export --model FILE.gguf` and `pockjax run` (no JAX in the run's end):
    the same losses as finetune's from the file, final/ with finetune's values (AdamW
    turns summation-order rounding in near-zero gradients into a few learning-rate-sized
    steps: under 1% of the elements off by more than 1e-5 of the tensor's largest value,
    and under 1% of how far each tensor moved), and
    final.gguf with every tensor the job never trained the file's own bytes."""
    from safetensors.numpy import load_file

    from pockjax.cli import main
    from pockjax.gguf._read import float_values, read_tensors

    tmp = tiny_runs[0]
    train = tmp / "train.jsonl"
    options = ["--scheme", "last:1", "--steps", "3", "--batch", "2", "--seq", "64", "--lr",
               "1e-3", "--gguf-type", "Q8_0"]
    assert main(["finetune", "--model", str(tiny_gguf), "--data", str(train), "--out",
                 str(tmp / "job-ft"), "--no-plot", *options]) == 0
    assert main(["export", "--model", str(tiny_gguf), "--target", "host-cpu", "--out",
                 str(tmp / "job-art"), *options]) == 0
    job = json.loads((tmp / "job-art" / "job.json").read_text())
    assert job["gguf"]["file"] == tiny_gguf.name and job["base"] == str(tiny_gguf.resolve())
    assert (tmp / "job-art" / "model" / tiny_gguf.name).is_file()
    assert main(["run", str(tmp / "job-art"), "--data", str(train), "--out",
                 str(tmp / "job-run")]) == 0
    got, want = (_metrics(tmp / p) for p in ("job-run", "job-ft"))
    assert [r["loss"] for r in got if "loss" in r] == pytest.approx(
        [r["loss"] for r in want if "loss" in r], rel=1e-5)
    ft, run = (load_file(tmp / p / "final" / "model.safetensors") for p in ("job-ft", "job-run"))
    assert sorted(ft) == sorted(run)
    tensors, layout = read_tensors(tiny_gguf), job["gguf"]
    for name in ft:
        rows = layout["rows"].get(name)
        base = float_values(tensors[layout["names"][name]],
                            None if rows is None else np.asarray(rows))
        if name not in job["trained"]:
            np.testing.assert_array_equal(run[name], base, err_msg=name)
            np.testing.assert_array_equal(ft[name], base, err_msg=name)
            continue
        moved = np.linalg.norm(ft[name] - base)
        assert moved > 0, name
        assert np.linalg.norm(run[name] - ft[name]) < 0.01 * moved, name
        off = np.abs(run[name] - ft[name]) > 1e-5 * np.abs(ft[name]).max()
        assert np.mean(off) < 0.01, name
    src = {t.name: t for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    report = json.loads((tmp / "job-run" / "final.gguf.json").read_text())
    written = gguf.GGUFReader(str(tmp / "job-run" / "final.gguf"))
    assert [t.name for t in written.tensors] == list(src)
    for t in written.tensors:
        if "kept" in report[t.name]:
            np.testing.assert_array_equal(np.asarray(t.data).view(np.uint8),
                                          np.asarray(src[t.name].data).view(np.uint8))
        else:
            assert t.name.startswith("blk.1.") and report[t.name]["trained"].startswith(
                "Q8_0" if len(t.shape) > 1 else "F32")
    assert {n for n, r in report.items() if "trained" in r} == \
        {layout["names"][n] for n in job["trained"]}
    assert written.fields["general.pockjax.tool"].contents() == "pockjax run"
    # A device without the gguf package hears so before the first step.
    import importlib.util
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else find(name, *a))
    capsys.readouterr()
    assert main(["run", str(tmp / "job-art"), "--data", str(train), "--out",
                 str(tmp / "job-bare")]) != 0
    assert "its final.gguf is written with the gguf package: pip install gguf" in \
        capsys.readouterr().err
    assert not (tmp / "job-bare" / "checkpoints").exists()


def test_final_gguf_keeps_the_frozen_bytes_and_metadata(tiny_runs, tiny_gguf):
    tmp, _, _ = tiny_runs
    written = tmp / "from-gguf" / "final.gguf"
    report = json.loads((tmp / "from-gguf" / "final.gguf.json").read_text())
    src, out = gguf.GGUFReader(str(tiny_gguf)), gguf.GGUFReader(str(written))
    assert [t.name for t in src.tensors] == [t.name for t in out.tensors]
    trained = {t.name for t in out.tensors if "trained" in report[t.name]}
    assert trained == {t.name for t in src.tensors if t.name.startswith("blk.1.")}
    for a, b in zip(src.tensors, out.tensors):
        if a.name in trained:
            assert b.tensor_type.name == "F32" or len(b.shape) < 2
            continue
        assert a.tensor_type == b.tensor_type
        np.testing.assert_array_equal(np.asarray(a.data).view(np.uint8),
                                      np.asarray(b.data).view(np.uint8), err_msg=a.name)
        from pockjax.gguf import tensor_digest
        assert report[a.name]["kept"] == tensor_digest(np.asarray(b.data))
    for key, field in src.fields.items():
        if not key.startswith("GGUF."):
            assert out.fields[key].contents() == field.contents(), key
    assert out.fields["general.pockjax.steps"].contents() == 3
    # transformers reads it back: the logits of final/ (F32: to its rounding).
    tokens = np.array([[1, 504, 3458, 0, 49151, 2, 17]], np.int32)
    import transformers
    final = transformers.AutoModelForCausalLM.from_pretrained(tmp / "from-gguf" / "final").eval()
    want = _logits(final, tokens)
    np.testing.assert_allclose(_logits(_hf(written), tokens), want, rtol=0,
                               atol=1e-4 * max(1.0, np.abs(want).max()))


def test_a_model_folder_written_as_gguf_is_the_file_it_came_from(tiny_runs, tiny_gguf,
                                                                  tmp_path):
    """`folder_gguf` on the float32 folder transformers made of the two-block file, every
    tensor in F32: each tensor the file's own decoded values bit for bit (the q and k
    rows back in llama.cpp's order), every key of the file's (hyperparameters, tokens and
    their types, merges, special ids, chat template) but the pre-tokenizer's name: the
    folder's tokenizer.json splits as GPT-2's does."""
    from pockjax.gguf import folder_gguf

    tmp, _, _ = tiny_runs
    written = tmp_path / "f32.gguf"
    report = folder_gguf(tmp / "float32", written, frozen_type="F32")
    src, got = gguf.GGUFReader(str(tiny_gguf)), gguf.GGUFReader(str(written))
    mine = {t.name: t for t in got.tensors}
    assert sorted(mine) == sorted(report) == sorted(t.name for t in src.tensors)
    for t in src.tensors:
        assert mine[t.name].tensor_type.name == "F32", t.name
        want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        np.testing.assert_array_equal(np.asarray(mine[t.name].data).reshape(want.shape), want,
                                      err_msg=t.name)
    for key, field in src.fields.items():
        if not key.startswith(("GGUF.", "general.")) and key != "tokenizer.ggml.pre":
            assert got.fields[key].contents() == field.contents(), key
    assert got.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert src.fields["tokenizer.ggml.pre"].contents() == "smollm"


def test_save_gguf_writes_a_folders_run_as_gguf(tiny_runs):
    """`finetune(..., save_gguf="Q8_0")` from a model folder: final.gguf beside final/,
    the trained block in F16 and every frozen weight in Q8_0 (norms F32), which
    transformers reads back as final/'s values within each type's rounding."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    tmp, _, _ = tiny_runs
    run = tmp / "from-folder"
    written = run / "final.gguf"
    report = json.loads((run / "final.gguf.json").read_text())
    out = gguf.GGUFReader(str(written))
    trained = {n for n, r in report.items() if "trained" in r}
    assert trained == {t.name for t in out.tensors if t.name.startswith("blk.1.")}
    for t in out.tensors:
        want = "F32" if len(t.shape) < 2 else "F16" if t.name in trained else "Q8_0"
        assert t.tensor_type.name == want, (t.name, t.tensor_type.name)
    assert out.fields["general.pockjax.steps"].contents() == 3
    assert out.fields["general.pockjax.base_folder"].contents() == "float32"
    read = transformers.AutoModelForCausalLM.from_pretrained(
        str(run), gguf_file="final.gguf", dtype=torch.float32).state_dict()
    final = load_file(run / "final" / "model.safetensors")
    for name, value in final.items():
        got = read[name].numpy()
        scale = np.abs(value).max()
        # F16: 2^-11 of each value. Q8_0: half a step (a block's largest / 127), plus the
        # F16 step's own rounding times the 127 steps of the largest code.
        bound = scale / 127 * (0.5 + 127 * 2.0 ** -11) if value.ndim == 2 and \
            ".layers.1." not in name else 2.0 ** -11 * scale
        np.testing.assert_allclose(got, value, rtol=0, atol=bound, err_msg=name)


def test_save_gguf_refuses_what_it_cannot_write_before_training(tiny_runs, smollm2, tmp_path):
    import shutil

    tmp, _, _ = tiny_runs
    train, _ = _data(tmp_path, 4)
    run = dict(steps=1, batch=2, seq=32, progress=False, plot=False)
    with pytest.raises(FinetuneError, match="final.gguf is written anyway, its frozen tensors "
                                            "the file's own bytes; leave --save-gguf out"):
        finetune(str(smollm2), str(train), str(tmp_path / "a"), save_gguf="Q8_0", **run)
    for change, said in (
            (lambda c, t: c.update(model_type="gemma"), "model_type 'gemma'; pockjax writes "
                                                         "GGUF files of llama, mistral, qwen2, "
                                                         "qwen3 models"),
            (lambda c, t: c.update(rope_scaling={"rope_type": "linear", "factor": 2.0}),
             "rope_scaling"),
            (lambda c, t: t["model"].update(byte_fallback=True), "byte-level BPE tokenizers"),
            (lambda c, t: t.update(pre_tokenizer={"type": "Metaspace"}), "pre-tokenizer")):
        folder = tmp_path / "folder"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tmp / "float32", folder)
        config = json.loads((folder / "config.json").read_text())
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        change(config, tokenizer)
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
        with pytest.raises(FinetuneError, match="--save-gguf Q4_0: .*" + said):
            finetune(str(folder), str(train), str(tmp_path / "b"), save_gguf="Q4_0", **run)
        assert not (tmp_path / "b" / "run.json").exists()


@pytest.fixture(scope="module")
def real_run(smollm2, tmp_path_factory):
    """Two steps of the default scheme on the real file, trained tensors in F16."""
    tmp = tmp_path_factory.mktemp("real-run")
    train, _ = _data(tmp)
    finetune(str(smollm2), str(train), str(tmp / "run"), steps=2, batch=2, seq=64,
             progress=False, plot=False, compile_cache=False)
    return tmp / "run"


def _in_llama_cpp(code: str, *args):
    """`code` run with llama_cpp's `Llama`, `json`, `sys` and numpy as `np` imported and
    `args` as its arguments; the JSON its last line prints. In its own process:
    llama.cpp's native code beside what a test worker has loaded (TensorFlow's
    libraries, after tests/tf) crashed the worker once."""
    done = subprocess.run([sys.executable, "-c", "import json, sys, numpy as np\n"
                           "from llama_cpp import Llama\n" + code, *map(str, args)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _llama_cpp_reads(path, texts, ids, tmp_path):
    """llama.cpp's tokens of each of `texts` (no BOS; special tokens read as such) and its
    logits of `ids`, its cache of keys and values in F32 (type 0; its default F16 rounds
    them)."""
    code = ("texts, ids = json.loads(sys.argv[1]), json.loads(sys.argv[2]); "
            "llm = Llama(model_path=sys.argv[3], logits_all=True, verbose=False, n_ctx=256, "
            "type_k=0, type_v=0, seed=0); "
            "got = [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]; "
            "llm.eval(ids); np.save(sys.argv[4], np.asarray(llm.scores[:len(ids)])); "
            "print(json.dumps(got))")
    tokens = _in_llama_cpp(code, json.dumps(texts), json.dumps(ids), path,
                           tmp_path / "scores.npy")
    return tokens, np.load(tmp_path / "scores.npy")


def test_llama_cpp_runs_the_written_file_and_predicts_as_final(real_run, tmp_path):
    """final.gguf, and final/ written as GGUF by `folder_gguf` (frozen tensors in Q8_0),
    in llama.cpp: its tokens of a chat text (special tokens included) are the tokenizer's,
    and its next-token predictions final/'s (transformers). llama.cpp multiplies with
    quantized activations, so predictions are compared, not logits."""
    import transformers
    from transformers import AutoTokenizer

    from pockjax.gguf import folder_gguf

    text = ("<|im_start|>user\nWhat does the function dumps in the json module do?<|im_end|>\n"
            "<|im_start|>assistant\nIt serializes a Python object to a JSON formatted string "
            "(1234567 bytes, 3.14 s).")
    final = transformers.AutoModelForCausalLM.from_pretrained(real_run / "final").eval()
    ids = AutoTokenizer.from_pretrained(real_run / "final").encode(text)
    want = _logits(final, np.array([ids])).argmax(-1)[0]
    folder_gguf(real_run / "final", tmp_path / "folder.gguf", frozen_type="Q8_0")
    code = ("text, ids = sys.argv[1], json.loads(sys.argv[2]); out = []\n"
            "for path in sys.argv[3:]:\n"
            "    llm = Llama(model_path=path, logits_all=True, verbose=False, n_ctx=128, seed=0)\n"
            "    tokens = llm.tokenize(text.encode(), add_bos=False, special=True)\n"
            "    llm.eval(ids)\n"
            "    out.append([tokens, np.asarray(llm.scores[:len(ids)]).argmax(-1).tolist()])\n"
            "print(json.dumps(out))")
    for name, (tokens, got) in zip(("final.gguf", "folder.gguf"), _in_llama_cpp(
            code, text, json.dumps(ids), real_run / "final.gguf", tmp_path / "folder.gguf")):
        assert tokens == ids, name
        assert (np.asarray(got) == want).mean() >= 0.9, (name, got, want)


def test_the_log_says_what_the_frozen_weights_are_stored_as(smollm2):
    from pockjax.finetuning._formats import stored_formats
    from pockjax.finetuning._spec import SchemeSpec

    stored = load_model(smollm2, scheme_of=SchemeSpec.parse("paper").build)
    assert stored_formats(stored.params) == "120 Q4_1, 1 Q8_0"
    assert stored_formats({"w": np.ones((2, 2))}) == ""


def test_generate_answers_in_the_models_template_and_stops_at_its_end_of_turn(smollm2, real_run):
    import torch
    from transformers import AutoTokenizer

    from pockjax.finetuning._cli import generate_text

    text, n, _ = generate_text(smollm2, "What is the capital of France?", chat=True,
                               max_tokens=24)
    tok = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of "
                                       "France?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = _hf(smollm2).generate(prompt, max_new_tokens=24, do_sample=False,
                                    eos_token_id=2)[0, prompt.shape[1]:].tolist()
    assert out[-1] == 2 and n == len(out) - 1 < 24       # stopped at <|im_end|>
    assert text == tok.decode(out[:-1]) == "The capital of France is Paris."
    text, n, _ = generate_text(real_run / "final.gguf", "What is 2 + 2?", chat=True,
                               max_tokens=48)
    assert n < 48 and "<|im" not in text


def test_bad_input_names_the_file_and_the_fix(tmp_path, smollm2):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(FinetuneError, match="is not a GGUF file"):
        model_folder(not_gguf)
    train, _ = _data(tmp_path, 4)
    with pytest.raises(FinetuneError, match="keeps its frozen weights in the file's own "
                                            "blocks; leave --frozen-dtype at float32"):
        finetune(str(smollm2), str(train), str(tmp_path / "a"), steps=1, frozen_dtype="int4",
                 progress=False)
    assert not os.path.exists(tmp_path / "a" / "run.json")
    with pytest.raises(FinetuneError, match="reads GGUF files of the families its Flax LLaMA"):
        load_model(smollm2, frontend="torch")


def test_the_options_gguf_types_are_the_writers():
    from pockjax.finetuning._options import GGUF_TYPES
    from pockjax.gguf import SAVE_TYPES

    assert GGUF_TYPES == SAVE_TYPES


def _random_folder(folder, family: str, tokenizer_of) -> "torch.nn.Module":
    """A two-block model of `family` with random weights (large enough that the logits
    are far from uniform; biases and norms random too) saved in `folder` with SmolLM2's
    vocabulary under the family's pre-tokenizer; returns the model."""
    import torch
    import transformers

    from pockjax.gguf._convert import LLAMA3_SPLIT, QWEN2_SPLIT

    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    if family == "llama3":  # Llama 3.1's RoPE scaling, a short original context
        config = transformers.LlamaConfig(**shape, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    elif family == "qwen2":  # q, k and v biases
        config = transformers.Qwen2Config(**shape)
    else:  # qwen3: q and k norms, heads wider than the width split
        config = transformers.Qwen3Config(**shape, head_dim=32)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(20.0)
            elif name.endswith("bias"):
                p.normal_(0.0, 1.0)
            else:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    tokenizer = tokenizer_of()
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT if family == "llama3"
                                      else QWEN2_SPLIT}, "behavior": "Isolated",
         "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
         "use_regex": False}]}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return model


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_a_folder_of_each_family_runs_in_llama_cpp_as_in_transformers(family, tiny_gguf,
                                                                      tmp_path):
    """A two-block folder of each family `folder_gguf` writes besides SmolLM's (Llama 3
    with its Split pre-tokenizer and RoPE scaling; Qwen2 with its biases; Qwen3 with its
    q/k norms and wide heads; SmolLM2's vocabulary, random weights) in F32: llama.cpp's
    tokens of an adversarial text are the tokenizer's, and its logits transformers' (for
    Llama 3, which they are not without the scaling's factors)."""
    import torch
    from tokenizers import Tokenizer

    from pockjax.gguf import folder_gguf

    folder = tmp_path / family
    smol = model_folder(tiny_gguf)
    model = _random_folder(folder, family,
                           lambda: json.loads((smol / "tokenizer.json").read_text()))
    (folder / "tokenizer_config.json").write_text((smol / "tokenizer_config.json").read_text())
    report = folder_gguf(folder, tmp_path / "m.gguf", frozen_type="F32")
    assert ("rope_freqs.weight" in report) == (family == "llama3")
    text = ("DON'T stop: it's 12345 ünïcode\n\n\n  spaces\tand\r\n tabs!!! "
            "<|im_start|>user\nhi<|im_end|>" + " the quick brown fox" * 8)
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert len(ids) > 64  # well past Llama 3's original context of 32
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    tokens, got = _llama_cpp_reads(tmp_path / "m.gguf", [text], ids, tmp_path)
    assert tokens == [ids]
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-3 * scale, np.abs(got - want).max() / scale
    if family == "llama3":  # the factors matter here
        import transformers

        config = model.config
        config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
        plain = transformers.LlamaForCausalLM(config).eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            unscaled = plain(torch.tensor([ids])).logits[0].numpy()
        assert np.abs(unscaled - want).max() > 1e-2 * scale


def _sentencepiece_tokenizer(texts) -> dict:
    """A tokenizer.json of Llama 2's form (BPE with byte fallback, "▁" for spaces and
    before the text, <unk> <s> </s> then the 256 byte tokens first) trained on
    `texts`."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=700, special_tokens=specials,
                                                       show_progress=False))
    spec = json.loads(tok.to_str())
    learned = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    order = specials + [f"<0x{b:02X}>" for b in range(256)] + [
        t for t in learned if t not in specials]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for added in spec["added_tokens"]:
        added["id"] = spec["model"]["vocab"][added["content"]]
    return spec


def test_a_sentencepiece_style_folder_tokenizes_in_llama_cpp_as_its_tokenizer(tmp_path):
    """Llama 2's tokenizer form (SentencePiece's BPE as tokenizer.json, byte fallback):
    `folder_gguf` writes it as llama.cpp's `llama` tokenizer with each token scored by
    its merge's rank. A tokenizer trained on two modules' sources tokenizes 400 lines of
    two others (indentation, unicode outside its vocabulary, a leading space) in
    llama.cpp as in `tokenizers`, and llama.cpp's logits of a two-block model are
    transformers'. A Metaspace pre-tokenizer is refused."""
    import collections
    import difflib
    import inspect
    import textwrap

    import torch
    import transformers
    from tokenizers import Tokenizer

    from pockjax.gguf import GgufError, folder_gguf

    spec = _sentencepiece_tokenizer(inspect.getsource(json).splitlines()
                                    + inspect.getsource(textwrap).splitlines())
    config = transformers.LlamaConfig(
        vocab_size=len(spec["model"]["vocab"]), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(20.0)
    folder = tmp_path / "llama2"
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "add_bos_token": True, "tokenizer_class": "LlamaTokenizerFast"}))
    folder_gguf(folder, tmp_path / "m.gguf", frozen_type="F32")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lines = [line for m in (collections, difflib) for line in
             inspect.getsource(m).splitlines() if line.strip()][:400]
    lines += [" a leading space", "ünïcödé ĳ ﬁ ✓ 日本", "two  spaces\tand a tab", ""]
    want = [tokenizer.encode(line, add_special_tokens=False).ids for line in lines]
    ids = tokenizer.encode("def f(x):\n    return x + 12345  # ✓").ids  # with <s>
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    got, scores = _llama_cpp_reads(tmp_path / "m.gguf", lines, ids, tmp_path)
    wrong = [(line, w, g) for line, w, g in zip(lines, want, got) if w != g]
    assert not wrong, (len(wrong), wrong[:3])
    assert np.abs(scores - logits).max() <= 1e-3 * np.abs(logits).max()
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁",
                             "prepend_scheme": "first", "split": False}
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    with pytest.raises(GgufError, match="Metaspace.*convert_hf_to_gguf"):
        folder_gguf(folder, tmp_path / "n.gguf", frozen_type="F32")


def test_rows_no_block_divides_are_written_in_f16_and_bad_input_is_named(tmp_path):
    """`encoded`: a vector stays F32, rows of 40 values (no Q8_0 block of 32 divides them)
    fall back to F16 with their rounding reported, rows of 64 are Q8_0. `folder_gguf`
    names a missing tokenizer.json and an unknown type."""
    from pockjax.gguf import GgufError, folder_gguf
    from pockjax.gguf._write import encoded

    rng = np.random.default_rng(0)
    for shape, want in (((40,), "F32"), ((3, 40), "F16"), ((3, 64), "Q8_0")):
        values = rng.normal(size=shape).astype(np.float32)
        if values.ndim == 2:  # exact zeros in a block
            values[0, :5] = 0.0
        data, qtype, error = encoded(values, "Q8_0")
        assert qtype.name == want, shape
        back = gguf.quants.dequantize(data, qtype).reshape(shape)
        assert error == pytest.approx(float(np.abs(back - values).max()))
        if want == "Q8_0":
            assert 0 < error < np.abs(values).max() / 127
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4}))
    with pytest.raises(GgufError, match="has no tokenizer.json: a GGUF file carries its "
                                        "tokenizer"):
        folder_gguf(tmp_path, tmp_path / "m.gguf")
    with pytest.raises(GgufError, match="GGUF type 'Q3_K': choose one of Q8_0, Q4_0"):
        folder_gguf(tmp_path, tmp_path / "m.gguf", frozen_type="Q3_K")
    assert not list(tmp_path.glob("m.gguf*"))
