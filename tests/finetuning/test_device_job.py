"""Fine-tuning on the device: `pockjax export --model FOLDER` (finetune's step, the job and
the base folder) and `pockjax run DIR --data train.jsonl --out RUN` (the job without JAX),
against `pockjax finetune` on the same folder, scheme, data and seed."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

import pockjax as pj
from pockjax.cli import main
from tests.finetuning.test_finetune import WORDS, _completions, _folder, _jsonl

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ["--scheme", "paper", "--steps", "8", "--batch", "4", "--seq", "24", "--lr", "3e-3"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny LLaMA folder and data; finetune's run of them; the host-cpu job's artifact."""
    tmp = tmp_path_factory.mktemp("job")
    model = _folder(tmp, "llama")
    rng = np.random.default_rng(1)
    valid = _jsonl(tmp / "valid.jsonl", [{"text": " ".join(rng.choice(WORDS[:12], 10))}
                                         for _ in range(6)])
    data = _jsonl(tmp / "train.jsonl", _completions(40))
    assert main(["finetune", "--model", str(model), "--data", str(data), "--valid", str(valid),
                 "--eval-every", "4", "--out", str(tmp / "ft"), "--no-plot", *OPTIONS]) == 0
    assert main(["export", "--model", str(model), "--target", "host-cpu", "--out",
                 str(tmp / "art"), *OPTIONS]) == 0
    return {"tmp": tmp, "model": model, "data": data, "valid": valid, "art": tmp / "art"}


def _valid_losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["valid_loss"]) for r in map(json.loads,
                                                       (run / "metrics.jsonl").read_text()
                                                       .splitlines()) if "valid_loss" in r]


def _run(setup, out, *extra) -> int:
    return main(["run", str(setup["art"]), "--data", str(setup["data"]), "--valid",
                 str(setup["valid"]), "--eval-every", "4", "--out", str(out), *extra])


def test_the_job_ends_where_finetune_ends(setup):
    """Parameters within 1e-5 relative of finetune's, validation losses within 1e-5, the
    frozen tensors the base's bytes, and transformers scores both folders alike."""
    out = setup["tmp"] / "run"
    assert _run(setup, out) == 0
    ft, run, base = (load_file(p / "model.safetensors") for p in
                     (setup["tmp"] / "ft" / "final", out / "final", setup["model"]))
    assert sorted(ft) == sorted(run) == sorted(base)
    trained = json.loads((setup["art"] / "job.json").read_text())["trained"]
    assert len(trained) == 6  # paper on the last of 2 blocks: q, k, v, o, gate, up
    for name in run:
        if name in trained:
            scale = np.abs(ft[name]).max()
            assert np.abs(run[name] - ft[name]).max() <= 1e-5 * scale, name
            assert not np.array_equal(run[name], base[name]), name
        else:
            np.testing.assert_array_equal(run[name], base[name])
    got, want = _valid_losses(out), _valid_losses(setup["tmp"] / "ft")
    assert [s for s, _ in got] == [s for s, _ in want] == [0, 4, 8]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-5)
    tokens = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        logits = [transformers.AutoModelForCausalLM.from_pretrained(p).eval()(tokens).logits
                  for p in (setup["tmp"] / "ft" / "final", out / "final")]
    np.testing.assert_allclose(logits[0].numpy(), logits[1].numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
def test_kill_9_or_sigterm_then_resume_equals_the_uninterrupted_run(setup, stop):
    """`pockjax run` killed mid-run (SIGKILL) or stopped as a scheduler stops a job
    (SIGTERM: the step in flight saved), then `--resume`: the same final folder as a run
    that was never stopped, bit for bit."""
    whole = setup["tmp"] / "whole"
    if not (whole / "final").exists():
        assert _run(setup, whole, "--save-every", "1") == 0
    cut = setup["tmp"] / f"cut-{stop}"
    cmd = [sys.executable, "-m", "pockjax.cli", "run", str(setup["art"]), "--data",
           str(setup["data"]), "--valid", str(setup["valid"]), "--eval-every", "4", "--out",
           str(cut), "--save-every", "1" if stop == "SIGKILL" else "100"]
    log = setup["tmp"] / f"stderr-{stop}.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (cut / "metrics.jsonl").exists() and \
                any(json.loads(line).get("step", 0) >= 3 for line in
                    (cut / "metrics.jsonl").read_text().splitlines() if line.strip()):
            proc.send_signal(getattr(signal, stop))
            break
        time.sleep(0.02)
    proc.wait()
    killed = proc.returncode in (-signal.SIGKILL, 143)
    if stop == "SIGTERM" and killed:  # saved on the way out, though --save-every is 100
        said = re.search(r"pockjax run: stopped by SIGTERM at step (\d+) of \d+; saved it in "
                         r"[\d.]+ s; continue with --resume", log.read_text())
        assert said, log.read_text()[-2000:]
        saved = sorted((cut / "checkpoints").glob("step-*.safetensors"))
        assert [p.stem for p in saved] == [f"step-{int(said.group(1)):08d}"]
    resumed = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    if killed:
        assert "resumed from step-" in resumed.stderr
    assert (cut / "final" / "model.safetensors").read_bytes() == \
        (whole / "final" / "model.safetensors").read_bytes()
    assert _valid_losses(cut)[-1] == _valid_losses(whole)[-1]
    steps = [r["step"] for r in map(json.loads, (cut / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= 3  # each step logged once


def test_low_bit_channels_and_lora_folders(setup):
    """int4 frozen weights with Channels schemes: the frozen tensors and the untrained
    channels come back as the base's values (never the int4 rounding), the trained
    channels as finetune trains them; LoRA's kernels come back merged as finetune merges
    them."""
    tmp = setup["tmp"]
    scheme = tmp / "channels.json"
    params = pj.nnx.split(pj.models.hf.load_llama(setup["model"]))[1]
    scheme.write_text(pj.schemes.transformer(params, last=1, ratio=0.25, axis="out").to_json())
    for name, extra in (("int4", ["--scheme", str(scheme), "--frozen-dtype", "int4"]),
                        ("lora", ["--scheme", "lora:4"])):
        options = OPTIONS[2:] + extra
        assert main(["finetune", "--model", str(setup["model"]), "--data", str(setup["data"]),
                     "--out", str(tmp / f"ft-{name}"), "--no-plot", *options]) == 0
        assert main(["export", "--model", str(setup["model"]), "--out", str(tmp / f"art-{name}"),
                     *options]) == 0
        assert main(["run", str(tmp / f"art-{name}"), "--data", str(setup["data"]), "--out",
                     str(tmp / f"run-{name}")]) == 0
        ft, run, base = (load_file(p / "model.safetensors") for p in
                         (tmp / f"ft-{name}" / "final", tmp / f"run-{name}" / "final",
                          setup["model"]))
        job = json.loads((tmp / f"art-{name}" / "job.json").read_text())
        changed = set(job["trained"]) | set(job["lora"])
        assert changed
        for k in run:
            if k not in changed:
                np.testing.assert_array_equal(run[k], base[k], err_msg=k)
                continue
            if name == "lora":
                assert np.abs(run[k] - ft[k]).max() <= 1e-5 * np.abs(ft[k]).max(), k
                continue
            axis, start, count = job["trained"][k]["channels"]
            hf_axis = 1 - axis  # the file holds kernels transposed
            keep = [slice(None)] * 2
            keep[hf_axis] = slice(start, start + count)
            rest = [slice(None)] * 2
            rest[hf_axis] = slice(start + count, None)
            np.testing.assert_array_equal(run[k][tuple(rest)], base[k][tuple(rest)], err_msg=k)
            assert not np.array_equal(run[k][tuple(keep)], base[k][tuple(keep)]), k
            np.testing.assert_allclose(run[k][tuple(keep)], ft[k][tuple(keep)], rtol=1e-4,
                                       atol=1e-5, err_msg=k)


def test_bad_input_is_one_line_before_any_work(setup, capsys, tmp_path):
    def fails(message, *args):
        code = main(["run", *map(str, args)])
        err = capsys.readouterr().err
        assert code == 1 and message in err and "Traceback" not in err, err

    fails("has no job.json: it is not an artifact directory", tmp_path, "--data",
          setup["data"], "--out", tmp_path / "o")
    fails("9 steps asked for, and the artifact's learning-rate schedule was built for 8",
          setup["art"], "--data", setup["data"], "--out", tmp_path / "o", "--steps", 9)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    fails("is not empty and holds no pockjax run", setup["art"], "--data", setup["data"],
          "--out", used)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "alpha"}\n{"txt": "beta"}\n')
    fails(f"{bad} line 2", setup["art"], "--data", bad, "--out", tmp_path / "o")
    assert not (tmp_path / "o").exists()
    # A changed file of the artifact's model folder is refused.
    copy = tmp_path / "art"
    import shutil

    shutil.copytree(setup["art"], copy)
    (copy / "model" / "config.json").write_text("{}")
    fails("is not the file the artifact was exported with", copy, "--data", setup["data"],
          "--out", tmp_path / "o")
    with pytest.raises(SystemExit, match="give MODULE:ATTR or --model FOLDER"):
        main(["export", "--out", str(tmp_path / "x")])
    capsys.readouterr()
    assert main(["export", "--model", str(setup["model"]), "--out", str(tmp_path / "x")]) == 1
    assert "pockjax export: give --steps N, the run's length" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["export", "--model", str(setup["model"]), "--out", str(tmp_path / "x"),
                 "--steps", "4", "--scheme", "search:40%"]) == 1
    assert "needs the data" in capsys.readouterr().err


def test_android_vulkan_on_lavapipe_and_arm64_under_qemu(setup, tmp_path):
    """The job for android-vulkan (run by lavapipe, Vulkan on the CPU) ends where
    finetune ends within the export tests' Vulkan tolerance; for android-arm64 it runs
    under qemu-aarch64 through IREE's own `iree-run-module` (state and batches as files),
    resumes from a checkpoint there, and writes the model folder."""
    from tests.export.test_arm64 import RUNTIME

    options = ["--scheme", "paper", "--steps", "3", "--batch", "4", "--seq", "24", "--lr", "3e-3"]
    assert main(["finetune", "--model", str(setup["model"]), "--data", str(setup["data"]),
                 "--out", str(tmp_path / "ft"), "--no-plot", *options]) == 0
    ft = load_file(tmp_path / "ft" / "final" / "model.safetensors")
    assert main(["export", "--model", str(setup["model"]), "--target", "android-vulkan",
                 "--out", str(tmp_path / "vk"), *options]) == 0
    for attempt in range(3):  # lavapipe loses its device at random (docs/export.md)
        code = main(["run", str(tmp_path / "vk"), "--device", "vulkan", "--data",
                     str(setup["data"]), "--out", str(tmp_path / "vk-run"), "--overwrite"])
        if code != 2:
            break
    assert code == 0
    got = load_file(tmp_path / "vk-run" / "final" / "model.safetensors")
    for k in got:
        np.testing.assert_allclose(got[k], ft[k], rtol=1e-4, atol=1e-5, err_msg=k)

    assert main(["export", "--model", str(setup["model"]), "--target", "android-arm64",
                 "--out", str(tmp_path / "arm"), *options]) == 0
    run = ["run", str(tmp_path / "arm"), "--qemu-arm64", RUNTIME, "--data", str(setup["data"]),
           "--out", str(tmp_path / "arm-run")]
    assert main([*run, "--steps", "2", "--save-every", "1"]) == 0
    assert main([*run, "--resume"]) == 0  # steps 3 of 3 after restoring step 2
    got = load_file(tmp_path / "arm-run" / "final" / "model.safetensors")
    for k in got:
        np.testing.assert_allclose(got[k], ft[k], rtol=1e-4, atol=1e-5, err_msg=k)
    # A checkpoint taken mid-run makes a model folder too.
    [mid] = [p for p in (tmp_path / "arm-run" / "checkpoints").glob("*.safetensors")
             if p.name.endswith("00000003.safetensors")]
    assert main(["merge", str(tmp_path / "arm"), "--checkpoint", str(mid), "--out",
                 str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "model.safetensors").read_bytes() == \
        (tmp_path / "arm-run" / "final" / "model.safetensors").read_bytes()

    # No Python on the device: the batches as files and train.sh, run by the aarch64
    # iree-run-module under QEMU, then the model folder from its state files.
    import shlex

    from pockjax import runtime

    assert main(["run", str(tmp_path / "arm"), "--data", str(setup["data"]),
                 "--write-batches", str(tmp_path / "sh")]) == 0
    tool = " ".join(map(shlex.quote, runtime.qemu_arm64(RUNTIME)))
    done = subprocess.run(["sh", str(tmp_path / "sh" / "train.sh")], capture_output=True,
                          text=True, env={**os.environ, "IREE_RUN_MODULE": tool}, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["step", "1", "done", "step", "2", "done", "step", "3", "done"]
    assert main(["merge", str(tmp_path / "arm"), "--state", str(tmp_path / "sh" / "state"),
                 "--out", str(tmp_path / "sh-final")]) == 0
    shell = load_file(tmp_path / "sh-final" / "model.safetensors")
    for k in shell:
        np.testing.assert_allclose(shell[k], ft[k], rtol=1e-4, atol=1e-5, err_msg=k)
