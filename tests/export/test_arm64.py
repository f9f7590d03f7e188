"""android-arm64 artifacts run under qemu-aarch64 with the aarch64 `iree-run-module`.

`make test` fetches the aarch64 wheel of iree-base-runtime (`make arm64-runtime`) and
CI installs qemu-user and the aarch64 C/C++ libraries; without them these tests fail.
"""
import os
import sys

import numpy as np
import pytest

from pockjax import runtime
from pockjax.export import ExportError
from tests.export.models import MODELS, eval_loss, make, run_against_jax

STEPS = 3
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
RUNTIME = os.environ.get("POCKJAX_ARM64_RUNTIME", os.path.join(ROOT, ".cache", "iree-aarch64"))


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    trainer, params, batch = make(request.param)
    out = tmp_path_factory.mktemp(request.param) / "arm64"
    art = trainer.export(trainer.init(params), batch, target="android-arm64", out_dir=out)
    return trainer, params, batch, art


def test_arm64_artifact_under_qemu_matches_the_jax_trainer(exported, tmp_path):
    trainer, params, batch, art = exported
    assert "--iree-llvmcpu-target-triple=aarch64-linux-android34" in art.manifest["target"]["flags"]
    sess = runtime.ToolSession(art.path, runtime.qemu_arm64(RUNTIME), workdir=tmp_path / "run")
    state = run_against_jax(sess, trainer, params, batch, STEPS)
    np.testing.assert_allclose(sess.evaluate(batch), eval_loss(trainer, state.params, batch), rtol=1e-4)


def test_tool_errors_name_the_problem(tmp_path):
    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, target="android-arm64",
                         out_dir=tmp_path / "arm64")
    with pytest.raises(ExportError, match="no aarch64 iree-run-module under"):
        runtime.qemu_arm64(str(tmp_path))
    with pytest.raises(ExportError, match="sysroot '/nowhere' is missing"):
        runtime.qemu_arm64(RUNTIME, sysroot="/nowhere")
    with pytest.raises(ExportError, match="cannot start '/no/such/tool'"):
        runtime.ToolSession(art.path, ["/no/such/tool"])
    # The host build of the tool cannot open an arm64 artifact: the tool's error is shown.
    host_tool = os.path.join(os.path.dirname(sys.executable), "iree-run-module")
    with pytest.raises(ExportError, match=r"(?s)init failed \(exit \d+\):.*--function=init"):
        runtime.ToolSession(art.path, [host_tool])
    # The Python runtime of this x86 host refuses it and says how to run it.
    with pytest.raises(ExportError, match=r"is for android-arm64 \(aarch64 code\).*--qemu-arm64"):
        runtime.load(art.path)
    # A manifest that hides the target: IREE's own refusal becomes an ExportError.
    import json
    import shutil
    relabeled = tmp_path / "relabeled"
    shutil.copytree(art.path, relabeled)
    manifest = json.loads((relabeled / "manifest.json").read_text())
    manifest["target"]["name"] = "host-cpu"
    (relabeled / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match=r"IREE could not load artifact .*target 'host-cpu'.*"
                                          r"device 'local-task'"):
        runtime.load(relabeled)


def test_cli_runs_an_arm64_artifact_under_qemu(tmp_path, capsys):
    from pockjax.cli import main as cli

    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, target="android-arm64",
                         out_dir=tmp_path / "arm64")
    data = tmp_path / "batch.npz"
    np.savez(data, **{k: np.asarray(v) for k, v in batch.items()})
    assert cli(["run", art.path, "--qemu-arm64", RUNTIME, "--steps", "2", "--data", str(data)]) == 0
    lines = capsys.readouterr().out.splitlines()
    state, want = trainer(trainer.init(params), batch)
    assert lines[0].startswith(f"step 1: loss {float(want['loss']):.6g} (")
    assert lines[1].startswith("step 2: loss ")
