"""The quality benchmark (`benchmarks/quality.py`): its data, its pretrained model and
one run of its quick preset end to end.

The quick run trains a tiny model for a few steps, so the tests check what must hold at
any size: every row has finite numbers, fine-tuning lowers the held-out loss below the
pretrained model's, PyTorch and pockjax full fine-tuning (same batches, loss, optimizer
and schedule) land on the same loss, a second run reuses every finished run, and the
teacher-forced exact match is greedy decoding's answer.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import pretrain, quality, quality_data

ROOT = Path(__file__).resolve().parents[2]


def _run_quick(work: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", "quality", "--quick", "--work",
                           str(work), "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=3600)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One run of `python -m benchmarks quality --quick` into a fresh folder."""
    tmp = tmp_path_factory.mktemp("quality")
    work, out = tmp / "work", tmp / "quality.md"
    proc = _run_quick(work, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    return {"work": work, "out": out, "json": result, "stderr": proc.stderr}


def _rows(quick, method=None):
    return [r for r in quick["json"]["rows"] if method is None or r["method"] == method]


def _row(quick, method, task):
    [row] = [r for r in _rows(quick, method) if r["task"] == task]
    return row


# --------------------------------------------------------------------------- the quick run


def test_every_row_has_finite_numbers(quick):
    expected = [m.name for m in quality.METHODS if m.quick]
    rows = _rows(quick)
    assert [(r["method"], r["task"]) for r in rows] == \
        [(m, t) for m in expected for t in quality.TASKS]
    for r in rows:
        assert "error" not in r, (r["method"], r["task"], r.get("error"))
        s = r["summary"]
        keys = ["test_loss", "corpus_loss", "forgetting"]
        keys += ["exact_match"] if r["task"] == "instruct" else []
        if r["kind"] != "pretrained":
            keys += ["valid_loss", "s_per_step", "tokens_per_s", "peak_rss_mib"]
            assert s["trained_params"] > 0
            assert r["lr"] in quality.method_named(r["method"]).rates
            assert len(r["runs"]) == quick["json"]["meta"]["config"]["seeds"]
            curve = r["runs"][0]["valid_curve"]
            assert len(curve) >= 3 and curve[0][0] == 0.0
            assert all(b[0] >= a[0] for a, b in zip(curve, curve[1:])), "time goes forward"
        for k in keys:
            assert math.isfinite(s[k]), (r["method"], r["task"], k, s[k])
        if r["task"] == "instruct":
            assert 0.0 <= s["exact_match"] <= 1.0
            assert r["runs"][0]["exact_match_n"] > 0


def test_full_finetuning_beats_the_pretrained_model(quick):
    for task in quality.TASKS:
        before = _row(quick, "pretrained (no fine-tuning)", task)["summary"]["test_loss"]
        for method in ("torch full (AdamW)", "pockjax full"):
            after = _row(quick, method, task)["summary"]["test_loss"]
            assert after < before - 0.02, (method, task, before, after)


def test_torch_and_pockjax_full_finetuning_agree(quick):
    """The same batches, masked loss, AdamW settings and schedule from the same weights:
    the two implementations choose the same rate and end at the same losses."""
    for task in quality.TASKS:
        torch_row = _row(quick, "torch full (AdamW)", task)
        jax_row = _row(quick, "pockjax full", task)
        assert torch_row["lr"] == jax_row["lr"]
        for key in ("test_loss", "corpus_loss", "valid_loss"):
            a, b = torch_row["summary"][key], jax_row["summary"][key]
            assert abs(a - b) < 2e-3 * abs(a), (task, key, a, b)
        assert torch_row["summary"]["trained_params"] == jax_row["summary"]["trained_params"]


def test_torch_schedule_is_finetunes(quick):
    """The PyTorch runs set the learning rate `pockjax.finetune` logs for each step."""
    cfg = quick["json"]["meta"]["config"]
    row = _row(quick, "pockjax full", "domain")
    method = quality.method_named("pockjax full")
    run = quality.run_dir(cfg, method, "domain", row["lr"], 0, cfg["steps"])
    logged = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [(r["step"], r["lr"]) for r in logged if "lr" in r]
    assert len(rates) == cfg["steps"]
    warmup = quality.warmup_steps(cfg["steps"], cfg)
    for step, lr in rates:
        assert lr == pytest.approx(quality.lr_at(step - 1, row["lr"], warmup, cfg["steps"]),
                                   rel=1e-5, abs=1e-12)


def test_table_json_and_chart(quick):
    text = quick["out"].read_text()
    for task in quality.TASKS:
        assert f"## Task: {task}" in text
    for m in quality.METHODS:
        if m.quick:
            assert text.count(f"| {m.name} |") == len(quality.TASKS), m.name
    meta = quick["json"]["meta"]
    assert meta["cpu"] and "jax" in meta["versions"] and "torch" in meta["versions"]
    corpus = meta["pretrain"]["corpus"]
    assert len(corpus["pretraining_files"]["list_sha256"]) == 64
    assert corpus["tokens"]["train_files"] > 0 and corpus["interpreter"].startswith(
        sys.implementation.name)
    assert meta["tasks"]["instruct"]["source"] == "sympy"
    png = quick["out"].with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_second_run_reuses_every_finished_run(quick):
    runs = sorted(quick["work"].glob("runs-*/**/train.json"))
    assert runs
    before = {p: p.stat().st_mtime_ns for p in runs}
    out = quick["out"].with_name("again.md")
    proc = _run_quick(quick["work"], out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in runs} == before
    again = json.loads(out.with_suffix(".json").read_text())
    assert [r.get("summary") for r in again["rows"]] == \
        [r.get("summary") for r in quick["json"]["rows"]]


def test_pretrained_folder_loads_in_transformers_with_equal_logits(quick):
    import torch
    import transformers

    import pockjax as pj
    from pockjax.models.hf import load_llama

    folder = pretrain.folders(quick["work"], "quick")["model"]
    record = json.loads((folder / "pretrain.json").read_text())
    assert record["heldout_loss"] < record["heldout_loss_before"] - 1.0
    tok = pj.Tokenizer.from_folder(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "def f(x):\n    return x + 1  # ü\n"
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids and hf_tok.eos_token == quality_data.EOS
    tokens = np.array([ids, ids[::-1]], np.int32)
    ours = np.asarray(load_llama(folder)(tokens))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.from_numpy(tokens).long()).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_exact_match_is_greedy_decodings_answer(quick):
    """A line the model writes greedily is a hit, the same line changed is a miss, and
    on the test examples the teacher-forced answer equals greedy decoding's."""
    import jax.numpy as jnp

    import pockjax as pj
    from pockjax.models.hf import load_llama
    from pockjax.models.llama import generate

    folder = pretrain.folders(quick["work"], "quick")["model"]
    tok, model = pj.Tokenizer.from_folder(folder), load_llama(folder)
    cfg = quick["json"]["meta"]["config"]
    test_file = Path(cfg["tasks"]["instruct"]["test"])
    records = [json.loads(line) for line in test_file.read_text().splitlines()]
    own_lines = 0
    room = model.config.max_position_embeddings
    for record in [r for r in records if len(tok.encode(r["prompt"])) <= room - 24][:6]:
        head = tok.encode(record["prompt"])
        out = np.asarray(generate(model, jnp.asarray([head]), room - len(head)))[0, len(head):]
        text = tok.decode(out.tolist(), skip_special_tokens=False)
        start, end = quality_data.first_line_span(text)
        wrote_line = end < len(text) and text[start:end].strip()

        def hit(completion):
            check = quality.exact_match_check(tok, record["prompt"], completion)
            argmax = np.asarray(model(jnp.asarray([check.ids])).argmax(-1))
            return quality.exact_matches([check], argmax, tok)[0]

        reference = record["completion"]
        r_start, r_end = quality_data.first_line_span(reference)
        greedy_hit = bool(wrote_line) and text[:end] == reference[:r_end]
        assert hit(reference) == greedy_hit
        if wrote_line:
            own_lines += 1
            assert hit(text[:end + 1] + "    pass\n")
            assert not hit(text[:end] + "X\n    pass\n")
    assert own_lines >= 1, "the model wrote no line to check against"


# --------------------------------------------------------------------------- the data


def test_splits_are_by_file_and_fixed():
    paths = [f"pkg/mod{i}.py" for i in range(2000)]
    splits = [quality_data.split_of(p) for p in paths]
    assert splits == [quality_data.split_of(p) for p in paths]
    share = {s: splits.count(s) / len(paths) for s in quality_data.SPLITS}
    assert 0.75 < share["train"] < 0.85 and 0.07 < share["valid"] < 0.13


def test_corpus_leaves_out_tests_and_held_out_files():
    root, train, held = quality_data.corpus_files()
    assert train and held and not set(train) & set(held)
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.08
    for rel in train + held:
        assert not set(Path(rel).parts[:-1]) & quality_data.SKIP_DIRS, rel
    assert root.roots == {"stdlib": quality_data.stdlib_root()}


def test_functions_cut_at_the_docstring():
    source = '''
import x

@decorator
def add(a,
        b=1):
    """Add.

    More text.
    """
    if a:
        return a + b
    return b

def no_doc(a):
    return a

class C:
    def only_doc(self):
        """Nothing after it."""

    def method(self):
        \'\'\'One line.\'\'\'
        return self.x
'''
    pairs = quality_data.functions(source)
    assert pairs == [
        ('def add(a,\n        b=1):\n    """Add.\n\n    More text.\n    """',
         "\n    if a:\n        return a + b\n    return b\n"),
        ("def method(self):\n    '''One line.'''", "\n    return self.x\n")]
    assert quality_data.first_line_span(pairs[0][1]) == (1, 10)


def test_text_records_fit_the_sequence():
    tok = quality_data.train_tokenizer(["def f(x):\n    return x * 2\n" * 50], 300)
    text = "".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200))
    records = quality_data.text_records([text], tok, 32)
    assert len(records) > 10
    assert all(len(tok.encode(r).ids) <= 31 for r in records)
    assert "".join(records) == text[:len("".join(records))]


def test_task_dir_becomes_the_domain_task(tmp_path):
    src = tmp_path / "src"
    for i in range(60):
        (src / f"m{i % 7}").mkdir(parents=True, exist_ok=True)
        (src / f"m{i % 7}" / f"f{i}.py").write_text(
            "".join(f"def g{i}_{j}(x):\n    return x * {j}\n\n" for j in range(200)))
    (src / "tests").mkdir()
    (src / "tests" / "test_skip.py").write_text("def test(): pass\n")
    tok_folder = tmp_path / "tok"
    quality_data.write_tokenizer(quality_data.train_tokenizer(["def g(x): return x\n"] * 20, 300),
                                 tok_folder, 512)
    manifest = quality_data.build_tasks(tmp_path / "tasks", tok_folder, seq=512,
                                        caps={"train": 50, "valid": 10, "test": 10},
                                        task_dir=str(src), sample_pct=10)
    domain = manifest["domain"]
    assert domain["source"] == "src"
    assert sum(domain["files"][s]["files"] for s in quality_data.SPLITS) == 60
    assert domain["records"]["train"] == 50 and domain["records"]["test"] > 0
    assert manifest["instruct"]["source"] == "sympy"
    lines = (tmp_path / "tasks" / "instruct" / "train.jsonl").read_text().splitlines()
    assert lines and set(json.loads(lines[0])) == {"prompt", "completion"}


def test_bad_arguments_name_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="no such folder; give a folder"):
        quality.main(["--quick", "--work", str(tmp_path), "--task-dir", str(tmp_path / "none")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no .py files"):
        quality.main(["--quick", "--work", str(tmp_path), "--task-dir", str(tmp_path / "empty")])
    with pytest.raises(SystemExit, match="no method 'pockjax lora'; the methods are: .*full"):
        quality.main(["--quick", "--work", str(tmp_path), "--methods", "pockjax lora"])
    assert not list(tmp_path.glob("pretrain-*")), "nothing is trained before the checks"


def test_the_prefix_cache_benchmark_trains_alike_with_and_without_it(quick, tmp_path):
    """`benchmarks/cache_quality.py` on the quick model: two epochs with and without the
    prefix cache, each its own process; the losses are equal and the table says so."""
    out = tmp_path / "cache.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "cache_quality", "--quick",
                           "--work", str(quick["work"]), "--records", "32", "--epochs", "2",
                           "--schemes", "last:1", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = json.loads(out.with_suffix(".json").read_text())
    off, on = store["rows"]
    assert (off["cache"], on["cache"]) == ("off", "on")
    assert off["steps"] == on["steps"] == 8 and len(on["losses"]) == 8
    assert on["losses"] == off["losses"] and on["final_valid_loss"] == off["final_valid_loss"]
    assert store["summary"]["last:1"]["equal"] is True
    assert store["summary"]["last:1"]["cache_line"].startswith("on")  # finetune's log line
    assert on["to_final_s"] is not None and off["to_final_s"] is not None
    assert "| last:1 | on |" in out.read_text()


def test_time_to_quality():
    curve = [[0.0, 0, 3.0], [5.0, 10, 2.5], [9.0, 20, 2.0]]
    assert quality.time_to_quality(curve, 2.5) == 5.0
    assert quality.time_to_quality(curve, 1.0) is None
    # With a timing run: its first step, then its median step time for each further step.
    timing = {"first_step_s": 4.0, "s_per_step": 0.5}
    assert quality.time_to_quality(curve, 2.5, timing) == 4.0 + 9 * 0.5
    assert quality.time_to_quality(curve, 3.0, timing) == 0.0
    assert quality.time_to_quality(curve, 1.0, timing) is None


def test_speed_comes_from_each_rows_timing_run(quick):
    """Every trained row has a timing run of its own (the preset's `time_steps` steps on
    the domain task at the chosen rate), and its s/step is the table's."""
    steps = quality.PRESETS["quick"]["time_steps"]
    for r in quick["json"]["rows"]:
        if r["kind"] == "pretrained" or "runs" not in r:
            continue
        timing = r["timing"]
        assert timing["task"] == "domain" and timing["seed"] == 0 and timing["steps"] == steps
        assert r["summary"]["s_per_step"] == timing["s_per_step"] > 0
        assert r["summary"]["timed"] == "timing run"
    assert "timing pockjax full" in quick["stderr"]


def test_retime_measures_the_speed_columns_again(quick, tmp_path):
    """`--retime` times the chosen rows of a finished run again (at the rate its sweep
    chose, in a timing run made now) and rewrites the table with those speed columns and
    the run's quality columns; the other rows keep their timing."""
    import shutil
    import time

    out = tmp_path / "quality.md"
    shutil.copy(quick["out"].with_suffix(".json"), out.with_suffix(".json"))
    before = json.loads(out.with_suffix(".json").read_text())
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "quality", "--preset", "quick",
                           "--retime", "--work", str(quick["work"]), "--out", str(out),
                           "--methods", "pockjax full,torch full (AdamW)"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads(out.with_suffix(".json").read_text())
    assert after["meta"]["retimed"]["rows"] == 2
    assert "Speed columns re-measured" in out.read_text()
    assert out.with_suffix(".png").is_file()
    for old, new in zip(before["rows"], after["rows"], strict=True):
        assert (new["method"], new["task"]) == (old["method"], old["task"])
        assert new["runs"] == old["runs"]  # the quality columns are the run's
        assert new["summary"]["test_loss"] == old["summary"]["test_loss"]
        if new["method"] in ("pockjax full", "torch full (AdamW)"):
            timing = new["timing"]
            assert timing["lr"] == new["lr"] and timing["steps"] == old["timing"]["steps"]
            record = Path(timing["final"]).parent / "train.json"
            assert record.stat().st_mtime >= started  # measured now, not read back
            assert new["summary"]["s_per_step"] == timing["s_per_step"] > 0
        elif "timing" in old:
            assert new["timing"] == old["timing"]
    bad = subprocess.run([sys.executable, "-m", "benchmarks", "quality", "--preset", "small",
                          "--retime", "--work", str(quick["work"]), "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "pass --preset quick" in bad.stderr


def test_retime_without_a_finished_run_names_the_file(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "quality", "--retime",
                           "--preset", "quick", "--out", str(tmp_path / "q.md"), "--work",
                           str(tmp_path / "w")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert f"--retime needs {tmp_path / 'q.json'}, a finished run's data" in proc.stderr
    assert not (tmp_path / "w").exists()  # refused before any work


def _gpu(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "gpu", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_runs_trained_on_another_machine_are_adopted(quick, tmp_path):
    """`gpu prepare --quality` packs what a GPU machine needs to train the runs, naming
    the same runs' folder as `quality` here; `gpu quality` there (here: on this CPU, with
    every run already done) brings back the model in parts and the runs' records, which
    `gpu adopt-quality` puts back in place bit for bit."""
    from safetensors.numpy import load_file

    work = quick["work"]
    [config] = work.glob("runs-*/config.json")
    _gpu("prepare", "--models", "", "--quality", "quick", "--work", work, "--dir", tmp_path / "d")
    packed = json.loads((tmp_path / "d" / "quality.json").read_text())
    assert packed["config"] == str(config)  # the same folder on both machines
    weights = Path(packed["pretrained"]) / "model.safetensors"
    before = load_file(weights)
    [evaluated] = config.parent.glob("pockjax-paper/instruct/*seed0*/eval.json")
    scores = evaluated.read_text()
    _gpu("quality", "--dir", tmp_path / "d", "--out", tmp_path / "o", "--methods",
         "pockjax paper", "--workers", "1")
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == \
        ["part0.safetensors", "quality-runs.tar.gz"]
    weights.unlink()
    evaluated.unlink()
    _gpu("adopt-quality", tmp_path / "o")
    after = load_file(weights)
    assert sorted(after) == sorted(before)
    for name in before:  # every tensor bit for bit
        np.testing.assert_array_equal(after[name], before[name])
        assert after[name].dtype == before[name].dtype
    assert evaluated.read_text() == scores
    # A run trained there but not scored (stopped at the deadline) has no model here: the
    # next `quality` trains it again and scores it, as the first time.
    evaluated.unlink()
    proc = _run_quick(work, tmp_path / "again.md")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(evaluated.read_text()) == pytest.approx(json.loads(scores))


def test_where_the_runs_trained_is_said():
    rows = [{"method": "torch full", "kind": "torch", "runs": [{"device": "NVIDIA H200"}]},
            {"method": "pockjax full", "kind": "pockjax",
             "runs": [{"device": "NVIDIA H200"}, {"device": "NVIDIA H200"}]},
            {"method": "pretrained", "kind": "pretrained", "runs": [{}]}]
    assert quality.trained_on(rows) == "NVIDIA H200: every row"
    rows[1]["runs"].append({"device": "cpu"})
    rows[1]["method"] = "pockjax paper"
    assert quality.trained_on(rows) == "NVIDIA H200: the other rows; this machine: pockjax paper"
    assert quality.trained_on([{"method": "m", "kind": "torch",
                                "runs": [{"device": "cpu"}]}]) == ""


# --------------------------------------------------------------------------- the medium preset


def test_packages_corpus_leaves_out_the_tasks_and_tests():
    sources, train, held = quality_data.corpus_files(2, "packages", ("peft",))
    assert train and held and not set(train) & set(held)
    labels = {r.split("/", 1)[0] for r in train + held}
    assert labels >= {"stdlib", "site-packages"}
    for rel in train + held:
        parts = rel.split("/")
        assert not set(parts[1:-1]) & quality_data.SKIP_DIRS, rel
        if parts[0].startswith("site-packages"):
            assert parts[1] not in ("numpy", "sympy", "peft", "numpy.libs"), rel
            assert not parts[1].endswith(".dist-info"), rel
    assert sources.read(train[0])
    with pytest.raises(ValueError, match="choose one of stdlib, packages"):
        quality_data.corpus_files(source="site")


def test_task_dir_inside_site_packages_is_left_out_of_the_corpus(tmp_path):
    [root] = [p for p in quality_data.site_packages() if (p / "sympy").is_dir()][:1]
    assert quality.corpus_exclude(str(root / "sympy" / "core")) == ("sympy",)
    assert quality.corpus_exclude(str(tmp_path)) == ()
    assert quality.corpus_exclude(None) == ()


def test_bfloat16_parts_come_back_bit_for_bit(tmp_path):
    """A device run brings the medium model back as compressed bfloat16 byte planes:
    joined here they are the float32 file it trained, tensor for tensor (checked by the
    weights' digest); values that are not bfloat16's are refused, not rounded."""
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from benchmarks import gpu

    rng = np.random.default_rng(0)
    tensors = {f"w{i}": (rng.standard_normal((300, 97)) * 0.02).astype(ml_dtypes.bfloat16)
               .astype(np.float32) for i in range(3)}
    tensors["zeros"] = np.zeros(17, np.float32)
    # Signs, infinities, a subnormal.
    tensors["w0"][0, :4] = np.array([-0.0, np.inf, -np.inf, 1e-40],
                                    ml_dtypes.bfloat16).astype(np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    gpu._shard(str(tmp_path / "model.safetensors"), str(tmp_path / "parts"), bfloat16=True)
    assert all(p.suffix == ".npz" for p in (tmp_path / "parts").iterdir())
    gpu._unshard(str(tmp_path / "parts"), str(tmp_path / "back.safetensors"))
    back = load_file(tmp_path / "back.safetensors")
    for k, x in tensors.items():
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k].view(np.uint32), x.view(np.uint32))
    assert gpu.weights_digest(str(tmp_path / "back.safetensors")) == \
        gpu.weights_digest(str(tmp_path / "model.safetensors"))
    tensors["w1"][3, 3] = 0.1  # not a bfloat16 value
    save_file(tensors, tmp_path / "f32.safetensors")
    with pytest.raises(ValueError, match="w1 is not bfloat16 values"):
        gpu._shard(str(tmp_path / "f32.safetensors"), str(tmp_path / "p2"), bfloat16=True)


def test_learning_forgetting_frontier_and_groups():
    assert quality.frontier([(0.3, 1.0), (0.1, 0.5), (0.2, 0.4), (0.0, 0.0), (0.1, 0.6)]) == \
        [(0.0, 0.0), (0.1, 0.6), (0.3, 1.0)]
    groups = {m.name: quality.group_of(m.name) for m in quality.METHODS if m.kind != "pretrained"}
    assert groups["torch full (AdamW)"] == "PyTorch"
    assert groups["peft LoRA r8"] == groups["pockjax LoRA r8"] == "LoRA"
    assert groups["pockjax paper+head"] == "pockjax whole blocks"
    assert groups["pockjax channels in 1/4"] == "pockjax channels"
    assert groups["pockjax search:LoRA-r8"] == "pockjax searched"
    assert groups["pockjax blockwise"] == "pockjax schedule"
    assert groups["pockjax paper int4"] == "pockjax low-bit frozen"
    assert set(groups.values()) == set(quality.GROUPS)


def test_medium_pipeline_through_a_device_run(tmp_path):
    """The medium preset's path at test size (`medium-quick`): the packages corpus packed
    for a GPU machine, the packed pretraining there (weights stored as bfloat16 values),
    the rows trained there, the model brought back in compressed bfloat16 parts and
    checked by its digest, the rows timed here, the whole-model search, and the table and
    figure with each method's share of full fine-tuning's gain."""
    from safetensors.numpy import load_file

    work, dev = tmp_path / "work", tmp_path / "d"
    methods = "torch full (AdamW),pockjax paper,pockjax search:LoRA-r8"
    _gpu("prepare", "--models", "", "--quality", "medium-quick", "--work", work, "--dir", dev)
    assert (dev / "quality.tar.xz").stat().st_size < 4 * 2**20
    _gpu("quality", "--dir", dev, "--out", tmp_path / "o", "--methods", methods,
         "--workers", "2")
    parts = sorted(p.name for p in (tmp_path / "o").iterdir())
    assert parts == ["part0.npz", "quality-runs.tar.gz"]
    [model] = work.glob("pretrain-*/model")
    record = json.loads((model / "pretrain.json").read_text())
    assert record["preset"] == "medium-quick" and record["steps"] == 40
    assert record["corpus"]["settings"]["source"] == "packages"
    assert record["tokens_per_parameter"] > 0 and 0 < record["passes"] < 1
    assert math.isfinite(record["heldout_loss_unrounded"])
    assert record["heldout_loss"] < record["heldout_loss_before"]
    weights = load_file(model / "model.safetensors")
    for x in weights.values():  # bfloat16 values in a float32 file
        assert x.dtype == np.float32 and not np.any(x.view(np.uint32) & 0xFFFF)
    (model / "model.safetensors").unlink()
    _gpu("adopt-quality", tmp_path / "o")
    back = load_file(model / "model.safetensors")
    for k in weights:
        np.testing.assert_array_equal(back[k], weights[k])
    # A part that changed on the way is refused, and the joined file removed.
    part = tmp_path / "o" / "part0.npz"
    good = part.read_bytes()
    with np.load(part) as planes:
        changed = dict(planes)
    name = next(k for k in changed if k.endswith("@lo"))
    changed[name] = changed[name] ^ np.uint8(1)
    np.savez_compressed(part, **changed)
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "gpu", "adopt-quality",
                           str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "differ from the ones the device run trained" in proc.stderr
    assert not (model / "model.safetensors").exists()
    part.write_bytes(good)
    _gpu("adopt-quality", tmp_path / "o")

    out = tmp_path / "q.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "quality", "--preset",
                           "medium-quick", "--work", str(work), "--out", str(out),
                           "--methods", methods], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["method"], r["task"]): r for r in result["rows"]}
    for task in quality.TASKS:
        assert rows[("torch full (AdamW)", task)]["summary"]["gain_share"] == \
            pytest.approx(1.0)
        paper = rows[("pockjax paper", task)]
        assert math.isfinite(paper["summary"]["gain_share"])
        assert paper["runs"][0]["device"] == "cpu" and "timing" in paper
    [info] = work.glob("runs-*/search/domain/lora-r8.info.json")
    info = json.loads(info.read_text())
    params = __import__("pockjax.finetuning", fromlist=["load_model"]).load_model(
        str(model)).params
    assert info["candidates"] == len(quality.whole_model_candidates(params, (0.25,)))
    text = out.read_text()
    assert "share of full FT's gain" in text and "medium-quick preset" in text
    assert "every installed package's sources except numpy, sympy" in text
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_real_preset_rows_rates_and_page():
    """The real preset (a published checkpoint, one task): its rows, its grids scaled
    to a pretrained model's rates, the task its timing runs use, and a results page that
    describes the checkpoint and has no table for a task it did not run."""
    from benchmarks import quality_methods, quality_report

    names = [m.name for m in quality.preset_methods("real")]
    assert names == list(quality_methods.REAL_METHODS)
    cfg = {k: v for k, v in quality.PRESETS["real"].items() if k != "tasks"}
    cfg["tasks"] = {"instruct": {}}
    assert quality_methods.tasks_of(cfg) == ("instruct",)
    assert quality_methods.timing_task(cfg) == "instruct"
    assert quality_methods.timing_task({"tasks": {"domain": {}, "instruct": {}}}) == "domain"
    full, paper = (quality.method_named(n) for n in ("torch full (AdamW)", "pockjax paper"))
    assert quality_methods.rates_of(cfg, full) == [3e-5, 1e-4]
    assert quality_methods.rates_of(cfg, paper) == [1e-4, 3e-4]
    assert quality_methods.rates_of({"rates_in_sweep": 1}, paper) == [3e-3]
    assert quality_methods.rates_of(cfg, quality.method_named("pockjax paper (--lr auto)")) \
        == [0.0]   # its runs choose
    assert quality.group_of("pockjax paper (GGUF file)") == "pockjax low-bit frozen"
    pre = {"preset": "real", "source": "gguf", "file": "m.gguf", "sha256": "ab" * 32,
           "seq": 256, "parameters": 134_515_008, "heldout_records": 64,
           "settings": {"layers": 30, "hidden": 576, "vocab": 49152, "tied": True}}
    meta = {"preset": "real", "config": {**cfg, "time_steps": 6}, "pretrain": pre,
            "date": "d", "commit": "c", "cpu": "cpu", "cores": 2, "versions": "v",
            "tasks": {"instruct": {"source": "sympy", "version": "1", "records": {"test": 64}}}}
    page = quality_report.markdown([], meta)
    assert "SmolLM2-135M-Instruct (134,515,008 parameters, 30 blocks" in page
    assert "head tied to the embedding" in page and "`m.gguf`" in page
    assert "## Task: instruct" in page and "## Task: domain" not in page
    assert "*domain*" not in page and "6 steps on the instruct task" in page
