"""The targets table, compile-only targets, and the errors of export and runtime."""
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pockjax as pj
from pockjax import runtime
from pockjax.cli import main as cli
from pockjax.export import TARGETS, ExportError, resolve_target
from tests.export.models import COMPILE_ONLY, MODELS, make

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "export_mlp.py")


def test_flags_come_from_the_table():
    t, flags = resolve_target("android-vulkan", gpu="valhall", extra_flags=["--iree-opt-level=O2"])
    assert flags[-2:] == ("--iree-vulkan-target=valhall", "--iree-opt-level=O2")
    assert resolve_target("android-vulkan")[1][-1] == "--iree-vulkan-target=vp_android_baseline_2022"
    assert resolve_target("jetson-cuda")[1][-1] == "--iree-cuda-target=sm_87"
    assert "--iree-llvmcpu-target-triple=aarch64-linux-android34" in resolve_target("android-arm64")[1]
    with pytest.raises(ExportError, match="unknown target 'ios'.*host-cpu"):
        resolve_target("ios")
    with pytest.raises(ExportError, match="takes no GPU family"):
        resolve_target("host-cpu", gpu="valhall")
    with pytest.raises(ExportError, match="must look like '--iree-"):
        resolve_target("host-cpu", extra_flags=["O3"])


# Every model compiles for every target's backend. MODELS run on the targets that run
# here (test_host_cpu, test_vulkan, test_arm64), which compiles them there; jetson-cuda
# only compiles, so it gets every model here. The larger COMPILE_ONLY models (an NNX
# MobileNetV2 with batch statistics, a tiny LLaMA) compile once more for each of IREE's
# other two backends: LLVM CPU (host-cpu: the LLaMA here, MobileNetV2 in test_host_cpu,
# which runs it) and SPIR-V (both Vulkan targets for MobileNetV2, android-vulkan for the
# LLaMA); android-arm64 differs from host-cpu only in the CPU it generates code for, which
# the six MODELS cover under QEMU. The transformer also compiles for the Android GPU
# families offered by name.
COMPILED = ([("jetson-cuda", None, m) for m in [*MODELS, *COMPILE_ONLY]]
            + [("host-vulkan", None, "mobilenetv2"), ("android-vulkan", None, "mobilenetv2"),
               ("host-cpu", None, "llama"), ("android-vulkan", None, "llama")]
            + [("android-vulkan", gpu, "transformer") for gpu in ("valhall", "adreno")])


@functools.cache
def _made(name):
    return make(name)


@pytest.mark.parametrize("target,gpu,name", COMPILED,
                         ids=[f"{t}{'-' + g if g else ''}-{m}" for t, g, m in COMPILED])
def test_every_model_compiles_for_every_target(target, gpu, name, tmp_path):
    """Before the batched-gather rewrite the integer-label classifier failed for
    jetson-cuda ("failed to distribute"); before the boolean slice-of-broadcast rewrite
    the LLaMA (Channels on attention) was refused for android-vulkan (an i8 mask in
    memory); before the Vulkan reduction barrier MobileNetV2 failed for host-vulkan."""
    trainer, params, batch = _made(name)
    art = trainer.export(trainer.init(params), batch, target=target, gpu=gpu,
                         out_dir=tmp_path / "art")
    assert art.manifest["target"]["name"] == target
    assert art.manifest["files"]["train_step.vmfb"]["bytes"] > 10_000


# --------------------------------------------------------------------------- errors


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    trainer, params, batch = make("mlp")
    out = tmp_path_factory.mktemp("mlp") / "art"
    trainer.export(trainer.init(params), batch, out_dir=out)
    return trainer, params, batch, str(out)


def test_compiler_failure_names_target_and_flags_and_leaves_no_directory(tmp_path):
    trainer, params, batch = make("mlp")
    out = tmp_path / "art"
    with pytest.raises(ExportError) as e:
        trainer.export(trainer.init(params), batch, out_dir=out,
                       extra_flags=["--iree-no-such-flag=1"])
    assert "target 'host-cpu'" in str(e.value) and "--iree-no-such-flag=1" in str(e.value)
    assert "compiler said" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_export_keeps_the_previous_artifact(mlp_artifact, tmp_path):
    trainer, params, batch, path = mlp_artifact
    before = sorted(os.listdir(path))
    with pytest.raises(ExportError):
        trainer.export(trainer.init(params), batch, out_dir=path, extra_flags=["--iree-bogus=1"])
    assert sorted(os.listdir(path)) == before
    pj.export.read_manifest(path)  # hashes still match
    assert not [p for p in os.listdir(os.path.dirname(path)) if p.startswith(".tmp")]


def test_dynamic_batch_shapes_are_refused(tmp_path):
    trainer, params, batch = make("mlp")
    b, = jax.export.symbolic_shape("b")
    dynamic = {"x": jax.ShapeDtypeStruct((b, 16), jnp.float32), "y": batch["y"]}
    with pytest.raises(ExportError, match="batch input 'x' has a dynamic.*fixed shapes"):
        trainer.export(trainer.init(params), dynamic, out_dir=tmp_path / "a")


def test_batches_that_do_not_fit_the_signature_are_refused(mlp_artifact):
    _, _, batch, path = mlp_artifact
    sess = runtime.load(path)
    with pytest.raises(ExportError, match=r"expects \['x', 'y'\] \(x: float32\[8, 16\]"):
        sess.step({"x": batch["x"]})
    with pytest.raises(ExportError, match=r"'x' is float32\[4, 16\], the artifact expects float32\[8, 16\]"):
        sess.step({"x": batch["x"][:4], "y": batch["y"]})
    with pytest.raises(ExportError, match=r"'y' is int32\[8, 16\]"):
        sess.step({"x": batch["x"], "y": np.zeros((8, 16), np.int32)})
    # A dtype that differs but not the shape: cast, not export again.
    with pytest.raises(ExportError, match=r"'y' is float64\[8, 16\].*cast it with .*astype\(np.float32\)"):
        sess.step({"x": batch["x"], "y": np.zeros((8, 16), np.float64)})


def test_device_and_file_checks(mlp_artifact, tmp_path):
    _, _, _, path = mlp_artifact
    with pytest.raises(ExportError, match="runs on device local-task or local-sync, not 'vulkan'"):
        runtime.load(path, device="vulkan")
    with pytest.raises(ExportError, match="unknown device 'tpu'"):
        runtime.load(path, device="tpu")
    with pytest.raises(ExportError, match="manifest.json is missing"):
        runtime.load(tmp_path)
    import shutil
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    with open(copy / "params.irpa", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    with pytest.raises(ExportError, match="params.irpa' does not match the manifest's hash"):
        runtime.load(copy)
    sess = runtime.load(path, device="local-sync")
    assert np.isfinite(sess.step(make("mlp")[2])["loss"])


# --------------------------------------------------------------------------- CLI


def test_cli_targets_export_inspect_run(tmp_path, capsys):
    assert cli(["targets"]) == 0
    out = capsys.readouterr().out
    for name in TARGETS:
        assert name in out
    assert "--iree-vulkan-target=vp_android_baseline_2022" in out

    art = tmp_path / "mlp"
    assert cli(["export", f"{EXAMPLE}:make", "--target", "host-cpu", "--out", str(art)]) == 0
    assert "exported" in capsys.readouterr().out
    assert cli(["inspect", str(art)]) == 0
    out = capsys.readouterr().out
    assert "train_step(state[11], x: float32[16, 64], y: float32[16, 64]) -> (state[11], loss)" in out
    assert "1 submission(s) per step" in out
    assert "params/dense_0/kernel: float32[64, 64]" in out

    data = tmp_path / "data.npz"
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.standard_normal((2, 16, 64)).astype(np.float32),
             y=rng.standard_normal((2, 16, 64)).astype(np.float32))
    ckpt = tmp_path / "ckpt.safetensors"
    assert cli(["run", str(art), "--steps", "3", "--data", str(data), "--save", str(ckpt)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [l.split(":")[0] for l in lines[:3]] == ["step 1", "step 2", "step 3"]
    assert pj.checkpoint.read_metadata(ckpt)["step"] == "3"
    # The same steps through iree-run-module processes (the state in .npy files).
    import sys
    tool = os.path.join(os.path.dirname(sys.executable), "iree-run-module")
    assert cli(["run", str(art), "--steps", "3", "--data", str(data), "--tool", tool]) == 0
    tool_lines = capsys.readouterr().out.splitlines()
    assert [l.split(" (")[0] for l in tool_lines[:3]] == [l.split(" (")[0] for l in lines[:3]]


def test_cli_errors(tmp_path, capsys):
    assert cli(["inspect", str(tmp_path)]) == 2
    assert "manifest.json is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="expected MODULE:ATTR"):
        cli(["export", "nocolon", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="has no attribute 'nope'"):
        cli(["export", f"{EXAMPLE}:nope", "--out", str(tmp_path / "a")])


def test_bad_manifests_and_output_paths(mlp_artifact, tmp_path):
    trainer, params, batch, path = mlp_artifact
    import json
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(ExportError, match="is not valid JSON"):
        pj.export.read_manifest(broken)
    m = json.loads(open(os.path.join(path, "manifest.json")).read())
    m["schema_version"] = 99
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ExportError, match="schema version 99"):
        runtime.load(broken)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ExportError, match="exists and is not a directory"):
        trainer.export(trainer.init(params), batch, out_dir=a_file)
    assert a_file.read_text() == "x"


@pytest.mark.parametrize("hazards,not_in_place,message", [
    (["'params/l1/w' is read by @d::@backward after @d::@update wrote it in place"], [],
     r"(?s)refusing to export for 'host-cpu'.*would train wrong.*'params/l1/w' is read by"),
    ([], ["params/l1/w"], r"refusing to export for 'host-cpu': IREE did not update this state "
                          r"in place.*params/l1/w")])
def test_an_unsafe_schedule_refuses_the_export(tmp_path, monkeypatch, hazards, not_in_place,
                                               message):
    import pockjax.export.artifact as artifact
    from pockjax.export.stream import StreamReport
    monkeypatch.setattr(artifact, "analyze", lambda text, donated: StreamReport(
        hazards, not_in_place, 0, 0, 1))
    trainer, params, batch = make("mlp")
    with pytest.raises(ExportError, match=message):
        trainer.export(trainer.init(params), batch, out_dir=tmp_path / "art")
    assert list(tmp_path.iterdir()) == []


def test_cli_run_needs_every_input_in_the_data(mlp_artifact, tmp_path):
    _, _, _, path = mlp_artifact
    signature = r"the step's inputs are x: float32\[8, 16\], y: float32\[8, 16\]"
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((8, 16), np.float32))
    with pytest.raises(SystemExit, match=r"does not match the step: no array named 'y' \(it has "
                                         r"x: float32\[8, 16\]\); " + signature):
        cli(["run", path, "--data", str(data)])
    np.savez(data, x=np.zeros((8, 16), np.float32), labels=np.zeros((8, 16), np.float32))
    with pytest.raises(SystemExit, match=r"no array named 'y'; 'labels' is not an input .*"
                                         + signature + r" \(`pockjax inspect .*` lists them\); "
                                         r"save one array per input under its name, e\.g\. "
                                         r"np\.savez\('.*d\.npz', x=\.\.\., y=\.\.\.\)"):
        cli(["run", path, "--data", str(data)])
    np.save(tmp_path / "x.npy", np.zeros((8, 16), np.float32))
    with pytest.raises(SystemExit, match="holds a single array, not an .npz of named arrays; "
                                         + signature):
        cli(["run", path, "--data", str(tmp_path / "x.npy")])
    with pytest.raises(SystemExit, match=r"cannot read --data '.*nope\.npz' \(.*No such file.*\); "
                                         + signature):
        cli(["run", path, "--data", str(tmp_path / "nope.npz")])


def test_cli_run_help_says_how_to_name_the_data(capsys):
    with pytest.raises(SystemExit):
        cli(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "one array per input of the step, named after it" in help_text
    assert "`pockjax inspect DIR`" in help_text


def test_cli_exports_an_nnx_trainer(tmp_path, capsys):
    spec = tmp_path / "nnx_model.py"
    spec.write_text(
        "import numpy as np, optax, pockjax as pj\n"
        "from flax import nnx\n"
        "def make():\n"
        "    model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.relu,\n"
        "                           nnx.Linear(8, 2, rngs=nnx.Rngs(1)))\n"
        "    loss = lambda m, b: ((m(b) - 1.0) ** 2).mean()\n"
        "    trainer = pj.nnx.Trainer(model, loss, optimizer=optax.sgd(0.1),\n"
        "                             scheme=nnx.PathContains(2))\n"
        "    return trainer, np.ones((3, 4), np.float32)\n")
    out = tmp_path / "art"
    assert cli(["export", f"{spec}:make", "--target", "host-cpu", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["functions"]["train_step"]["state"] == ["step", "params/layers/2/bias",
                                                            "params/layers/2/kernel"]
    assert [s["name"] for s in manifest["functions"]["train_step"]["inputs"]] == ["batch"]


def test_export_with_progress_names_each_stage(tmp_path, capsys):
    trainer, params, batch = make("mlp")
    trainer.export(trainer.init(params), batch, out_dir=tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    pj.export(trainer, trainer.init(params), batch, target="host-cpu", out_dir=tmp_path / "art",
              progress=True)
    lines = capsys.readouterr().err.splitlines()
    stages = [line.split("] ", 1)[1] for line in lines]
    assert stages[0] == "lowering the training step to StableHLO"
    assert stages[1] == "compiling for host-cpu to IREE's stream IR, to check the in-place updates"
    assert stages[-3].startswith("compiling the module for host-cpu: the longest stage")
    assert stages[-2:] == [f"writing the artifact to {tmp_path / 'art'}", "done"]
    seconds = [float(line.split()[1]) for line in lines]
    assert all(line.startswith("[export ") for line in lines) and seconds == sorted(seconds)
