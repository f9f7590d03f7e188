"""`pockjax finetune` over several devices (`--devices`, `--mesh`): the same run as on one
device, data-parallel, FSDP and both, low-bit frozen weights sharded too; resume on the
same mesh bit for bit and on another within rounding; SIGTERM on a mesh; the refusals.
The suite's 4 CPU devices (conftest) stand for a machine's GPUs."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import pockjax as pj
from pockjax.finetuning import FinetuneError
from tests.finetuning.test_finetune import ROOT, _completions, _folder, _jsonl

MESHES = ["data=4", "fsdp=4", "data=2,fsdp=2"]
RUN = dict(scheme="paper", steps=6, batch=4, seq=24, lr=1e-3, seed=3, progress=False,
           plot=False)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mesh")
    return {"tmp": tmp, "model": _folder(tmp, "llama"),
            "data": _jsonl(tmp / "train.jsonl", _completions(48, seed=5)),
            "valid": _jsonl(tmp / "valid.jsonl", _completions(8, seed=6))}


def _run(setup, name, **kw):
    out = setup["tmp"] / name
    if not (out / "final").exists():
        pj.finetune(setup["model"], setup["data"], out, valid=setup["valid"], **{**RUN, **kw})
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"out": out, "params": load_file(str(out / "final" / "model.safetensors")),
            "loss": [r["loss"] for r in records if "loss" in r],
            "valid": [r["valid_loss"] for r in records if "valid_loss" in r]}


def assert_same_run(got, want, base):
    """Losses within 1e-5; every trained tensor within 0.1% of how far it moved (the
    norms of the difference and of the move: AdamW turns rounding in near-zero gradients
    into learning-rate-sized steps of single elements); every frozen tensor the base's
    bytes."""
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(got["valid"], want["valid"], rtol=0, atol=1e-5)
    assert got["params"].keys() == want["params"].keys()
    trained = 0
    for k, w in want["params"].items():
        moved = np.linalg.norm(w - base[k])
        if moved == 0:
            np.testing.assert_array_equal(got["params"][k], base[k], err_msg=k)
            continue
        trained += 1
        assert np.linalg.norm(got["params"][k] - w) <= 1e-3 * moved, k
    assert trained > 0


@pytest.mark.parametrize("frozen", ["float32", "int4"])
@pytest.mark.parametrize("mesh", MESHES)
def test_a_mesh_trains_as_one_device_does(setup, mesh, frozen):
    one = _run(setup, f"one-{frozen}", devices=1, frozen_dtype=frozen)
    got = _run(setup, f"{mesh}-{frozen}", mesh=mesh, frozen_dtype=frozen)
    base = load_file(str(setup["model"] / "model.safetensors"))
    assert_same_run(got, one, base)
    assert json.loads((got["out"] / "run.json").read_text())["mesh"] == mesh


def test_the_state_is_sharded_as_the_mesh_says_and_the_log_says_so(setup, capsys):
    from pockjax.finetuning import choose_devices, make_trainer, trainer_params

    placement = choose_devices(1, "data=2,fsdp=2", 4, print)
    assert dict(placement.mesh.shape) == {"data": 2, "fsdp": 2}
    loaded = pj.finetuning.load_model(setup["model"])
    scheme = pj.schemes.transformer(loaded.params, last=1)
    trainer = make_trainer(loaded, scheme, lr=1e-3, warmup=0, total=4, schedule="cosine",
                           weight_decay=0.0, moments="float32", placement=placement)
    state = trainer.init(trainer_params(loaded, scheme, "float32"))
    big = max(jax.tree_util.tree_leaves(state.params), key=lambda x: x.size)
    assert {s.data.size for s in big.addressable_shards} == {big.size // 2}  # fsdp halves it
    assert len(big.sharding.device_set) == 4
    line = placement.describe(state)
    assert re.fullmatch(r"mesh data=2,fsdp=2 on 4 cpu devices: each takes 1 of a step's 4 "
                        r"examples; parameters and optimizer state sharded over fsdp: "
                        r"[\d.]+ MiB on each device of the state's [\d.]+ MiB", line), line
    held, whole = map(float, re.findall(r"([\d.]+) MiB", line))
    assert 0.4 * whole <= held <= 0.6 * whole
    # a checkpoint loads onto the mesh of the state it is loaded like (resume), from a
    # state saved on one device or on the mesh
    pj.checkpoint.save(setup["tmp"] / "sharded.safetensors", state)
    like = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    loaded_back = pj.checkpoint.load(setup["tmp"] / "sharded.safetensors", like)
    for a, b in zip(jax.tree_util.tree_leaves(loaded_back), jax.tree_util.tree_leaves(state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the run says it in its log; --devices auto on CPU is one device, with no mesh line
    pj.finetune(setup["model"], setup["data"], setup["tmp"] / "said", mesh="fsdp=4", steps=2,
                batch=4, seq=24, plot=False)
    err = capsys.readouterr().err
    assert "pockjax finetune: mesh fsdp=4 on 4 cpu devices: each takes 1 of" in err
    said = re.search(r"the compiled step takes ([\d.]+) MiB on each device: ([\d.]+) MiB of "
                     r"arguments \(state and batch\), ([\d.]+) MiB of temporaries", err)
    assert said and 0 < float(said.group(2)) < held, err[-3000:]
    pj.finetune(setup["model"], setup["data"], setup["tmp"] / "auto", steps=1, batch=4,
                seq=24, plot=False)
    err = capsys.readouterr().err
    assert "pockjax finetune: mesh" not in err and "scheme paper" in err
    assert json.loads((setup["tmp"] / "auto" / "run.json").read_text())["mesh"] is None


def _cut_at(out: Path, step: int) -> None:
    """The run folder as a stop after `step` leaves it: later checkpoints and final/
    gone."""
    import shutil

    shutil.rmtree(out / "final")
    for p in (out / "checkpoints").glob("step-*.safetensors"):
        if int(p.stem.split("-")[1]) > step:
            p.unlink()


@pytest.mark.parametrize("first, then", [("data=2,fsdp=2", "data=2,fsdp=2"),
                                         ("data=2,fsdp=2", None), (None, "fsdp=4")])
def test_resume_on_the_same_mesh_bit_for_bit_and_on_another_within_rounding(setup, first,
                                                                           then):
    whole = _run(setup, f"whole-{first}", mesh=first, save_every=3)
    cut = setup["tmp"] / f"cut-{first}-{then}"
    import shutil

    shutil.copytree(whole["out"], cut)
    _cut_at(cut, 3)
    pj.finetune(setup["model"], setup["data"], cut, valid=setup["valid"],
                **{**RUN, "save_every": 3}, mesh=then, resume=True)
    got = _run(setup, cut.name)
    if first == then:
        for k, w in whole["params"].items():
            np.testing.assert_array_equal(got["params"][k], w, err_msg=k)
        assert got["loss"] == whole["loss"]
    else:
        assert_same_run(got, whole, load_file(str(setup["model"] / "model.safetensors")))


def test_sigterm_on_a_mesh_saves_and_resume_ends_where_an_uninterrupted_run_ends(setup):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    args = ["--model", setup["model"], "--data", setup["data"], "--scheme", "paper",
            "--steps", 60, "--batch", 4, "--seq", 24, "--lr", 1e-3, "--mesh", "data=2,fsdp=2",
            "--save-every", 1, "--keep", 2, "--no-plot"]
    cmd = [sys.executable, "-m", "pockjax.cli", "finetune", *map(str, args)]
    whole = setup["tmp"] / "cli-whole"
    assert subprocess.run([*cmd, "--out", str(whole)], cwd=ROOT, env=env, capture_output=True,
                          timeout=600).returncode == 0
    out, log = setup["tmp"] / "cli-cut", setup["tmp"] / "cli-cut.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen([*cmd, "--out", str(out)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if len(list((out / "checkpoints").glob("step-*.safetensors")) if out.exists()
               else []) >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    err = log.read_text()
    assert proc.returncode == 143, err[-2000:]
    said = re.search(r"stopped by SIGTERM at step (\d+) of 60; saved (\S+) in [\d.]+ s", err)
    assert said and int(said.group(1)) < 60, err[-2000:]
    resumed = subprocess.run([*cmd, "--out", str(out), "--resume"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (whole, out))
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_devices_and_meshes_refused_by_name(setup):
    tmp, model, data = setup["tmp"], setup["model"], setup["data"]
    for kw, message in [
            (dict(devices=8), r"--devices 8 needs 8 devices; JAX sees 4 cpu devices \(on CPU, "
                              r"XLA_FLAGS=--xla_force_host_platform_device_count=N"),
            (dict(mesh="data=2,fsdp=4"), r"--mesh data=2,fsdp=4 needs 8 devices"),
            (dict(mesh="data=2", batch=3), r"--batch 3 is split over 2 devices.*multiple of 2"),
            (dict(mesh="data=2", prefix_cache="on"), r"--prefix-cache on with --mesh data=2"),
            (dict(mesh="model=2"), r"--mesh 'model=2': expected AXIS=SIZE"),
            (dict(mesh="data=2", devices=4), r"--mesh data=2 has 2 devices, --devices 4"),
            (dict(devices="two"), r"--devices must be a positive whole number, all or auto")]:
        with pytest.raises(FinetuneError, match=message):
            pj.finetune(model, data, tmp / "refused", **{**RUN, **kw})
        assert not (tmp / "refused" / "checkpoints").exists()
