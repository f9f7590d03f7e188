"""The examples run end to end (in their fast settings), as a user runs them."""
from tests.helpers import run_example as run


def test_demo_fine_tunes_exports_and_continues_in_the_artifacts(tmp_path):
    out = run("demo.py", "--fast", "--out", str(tmp_path))
    assert "parameters trained" in out and "peak estimate" in out        # the report
    for target in ("android-vulkan", "host-cpu"):
        assert (tmp_path / target / "manifest.json").exists()
    # The demo asserts the artifacts match JAX; here: it ran both, Vulkan on lavapipe.
    assert "host-cpu: max relative parameter difference to JAX" in out
    assert "android-vulkan on " in out
    assert (tmp_path / "demo_loss.png").stat().st_size > 10_000


def test_digits_transfer_fast(tmp_path):
    out = run("digits_transfer.py", "--fast", "--out", str(tmp_path))
    for method in ("full", "sparse", "bias-only", "last layer"):
        assert f"\n{method.rjust(10)} " in out, out
    assert (tmp_path / "digits_curves.png").exists()


def test_instruct_llama_fast(tmp_path):
    out = run("instruct_llama.py", "--fast", "--out", str(tmp_path))
    for method in ("full", "sparse", "lora"):
        assert f"\n{method.rjust(6)} " in out, out
    assert "generations (before -> after" in out and (tmp_path / "loss_curves.png").exists()
    assert (tmp_path / "pretrained-20" / "config.json").exists()   # HF layout


def test_flax_loop_examples():
    out = run("nnx_digits.py", "--epochs", "2")
    assert "epoch  2:" in out and "parameters trained" in out
    out = run("linen_mlp.py", "--steps", "60")
    assert "digits 5-9 after sparse fine-tuning" in out


def test_plain_pytree_example(tmp_path):
    out = run("sparse_train_mlp.py", "--steps", "20", "--out", str(tmp_path))
    assert "max relative difference to the JAX + optax reference" in out
    assert "artifact step 5" in out


def test_data_parallel_example():
    out = run("data_parallel.py", "--devices", "4", "--steps", "3")
    for name in ("one device", "data-parallel x4", "FSDP x4"):
        assert f"\n{name.rjust(16)} " in out, out
    assert "peak estimate per device" in out and "all-gather" in out


def test_search_schemes_fast(tmp_path):
    out = run("search_schemes.py", "--task", "instruct", "--fast", "--out", str(tmp_path))
    assert "contribution analysis:" in out and "chosen (*)" in out
    for scheme in ("full", "searched", "bias-only"):
        assert f"\n{scheme.rjust(13)} " in out, out
    assert "last " in out and "within budget" in out
    import pockjax as pj
    scheme = pj.Scheme.from_json((tmp_path / "scheme.json").read_text())
    assert scheme.rules and (tmp_path / "search.png").exists()


def test_an_example_that_lost_the_device_runs_once_more(tmp_path):
    import pytest

    first = tmp_path / "first-run"
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os\n"
        "from pockjax.runtime import DeviceLost\n"
        f"if not os.path.exists({str(first)!r}):\n"
        f"    open({str(first)!r}, 'w').close()\n"
        "    raise DeviceLost('device lost', during='a training step',\n"
        "                     driver_message='VK_ERROR_DEVICE_LOST')\n"
        "print('second run')\n")
    with pytest.warns(UserWarning, match="flaky.py lost the Vulkan device"):
        assert run(str(script)) == "second run\n"
    runs = tmp_path / "runs"
    script.write_text(f"open({str(runs)!r}, 'a').write('x')\n"
                      "raise SystemExit('another failure: VK_ERROR_DEVICE_LOST in a message')\n")
    with pytest.raises(AssertionError, match="another failure"):
        run(str(script))
    assert runs.read_text() == "x"


def test_the_scheduler_job_files_pass_flags_finetune_takes(tmp_path):
    """examples/slurm_finetune.sbatch and examples/kubernetes_finetune.yaml: the script
    parses, SIGTERM comes with a grace period, and the command's own parser takes every
    flag they pass (with a model that is not there, finetune stops at the model, exit 1,
    not at a flag, exit 2)."""
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "slurm_finetune.sbatch"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text()
    assert re.search(r"^#SBATCH --signal=B:TERM@\d+$", text, re.M)
    line = text[text.index("exec pockjax finetune"):].replace("\\\n", " ").splitlines()[0]
    slurm = shlex.split(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line))[3:]
    job = yaml.safe_load((root / "examples" / "kubernetes_finetune.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 60
    [container] = pod["containers"]
    assert container["command"] == ["pockjax", "finetune"]
    for name, args in (("slurm", slurm), ("kubernetes", container["args"])):
        args = list(args)
        assert "--resume" in args and "--mesh" in args
        args[args.index("--model") + 1] = str(tmp_path / "no-model")
        args[args.index("--out") + 1] = str(tmp_path / name)
        done = subprocess.run([sys.executable, "-m", "pockjax.cli", "finetune", *args],
                              capture_output=True, text=True, cwd=root, timeout=300)
        assert done.returncode == 1, (name, done.stderr[-2000:])
        assert "pockjax finetune:" in done.stderr and "no-model" in done.stderr, done.stderr
