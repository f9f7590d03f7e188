"""`pockjax.runtime` on a device that has no JAX: a fresh virtual environment with
pockjax installed without its dependencies plus the `runtime` extra's packages (and
nothing of JAX, Flax or optax) runs an artifact exported here and continues the JAX
trainer."""
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

# Run inside the runtime-only environment: three steps, then the losses and parameters.
SCRIPT = r"""
import importlib.util, json, sys
import numpy as np
for name in ("jax", "jaxlib", "flax", "optax"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed"
import pockjax
from pockjax import runtime
assert "jax" not in sys.modules
art, batch_file, out = sys.argv[1:]
batch = dict(np.load(batch_file))
sess = runtime.load(art, device="local-task")
losses = [float(sess.step(batch)["loss"]) for _ in range(%d)]
params = sess.params()
np.savez(out, losses=np.array(losses), **{f"params/{k}/{n}": v for k, d in params.items() for n, v in d.items()})
assert "jax" not in sys.modules and "flax" not in sys.modules and "optax" not in sys.modules
""" % STEPS


def _runtime_requirements() -> list[str]:
    """The `device` extra: the runtime's packages and what `pockjax run --data FILE.jsonl`
    adds (the tokenizer, chat templates, the progress bar)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert set(extras["runtime"]) <= set(extras["device"])
    return extras["device"]


@pytest.fixture(scope="module")
def runtime_env(tmp_path_factory):
    """A virtual environment with the runtime extra and pockjax's wheel (no
    dependencies), installed as docs/export.md says."""
    tmp = tmp_path_factory.mktemp("runtime-env")
    env = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(env)], check=True)
    py = str(env / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    # Built from a copy: pip builds a directory in place, and a build/ left in the checkout
    # would carry deleted modules into later wheels.
    src = tmp / "src"
    shutil.copytree(ROOT / "pockjax", src / "pockjax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(tmp / "dist"), str(src)],
                   check=True)
    wheel, = (tmp / "dist").glob("pockjax-*.whl")
    subprocess.run([*pip, "install", "--quiet", *_runtime_requirements()], check=True)
    done = subprocess.run([*pip, "install", "--no-deps", str(wheel)], capture_output=True,
                          text=True, check=True)
    # Installed last, pockjax's own (full) dependencies draw no complaint from pip.
    assert "requires" not in done.stdout + done.stderr, done.stdout + done.stderr
    return py


def test_runtime_without_jax_continues_the_jax_trainer(runtime_env, tmp_path):
    k = jax.random.PRNGKey(0)
    params = {"l0": {"w": jax.random.normal(k, (6, 8)) * 0.5, "b": jnp.zeros(8)},
              "l1": {"w": jax.random.normal(jax.random.fold_in(k, 1), (8, 3)) * 0.5, "b": jnp.zeros(3)}}
    x = np.array(jax.random.normal(jax.random.fold_in(k, 2), (8, 6)))
    x[0] = 0  # a zero row: the first element of the first layer's reader is 0
    batch = {"x": x, "y": np.array(jax.random.normal(jax.random.fold_in(k, 3), (8, 3)))}

    def loss(p, batch):
        h = jax.nn.relu(batch["x"] @ p["l0"]["w"] + p["l0"]["b"])
        return jnp.mean((h @ p["l1"]["w"] + p["l1"]["b"] - batch["y"]) ** 2)

    scheme = pj.Scheme({"l0/w": pj.Channels(count=3, axis="out"), "l1/**": pj.Full()})
    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2), scheme=scheme)
    art = trainer.export(trainer.init(params), batch, target="host-cpu", out_dir=tmp_path / "artifact")
    np.savez(tmp_path / "batch.npz", **batch)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([runtime_env, "-c", SCRIPT, str(art.path), str(tmp_path / "batch.npz"),
                    str(tmp_path / "out.npz")], check=True, cwd=tmp_path, env=env)
    got = np.load(tmp_path / "out.npz")

    state, losses = trainer.init(params), []
    for _ in range(STEPS):
        state, m = trainer(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
    for layer in ("l0", "l1"):
        for name in ("w", "b"):
            np.testing.assert_allclose(got[f"params/{layer}/{name}"], state.params[layer][name],
                                       rtol=1e-5, atol=1e-6)


def test_inspect_works_and_export_says_it_needs_the_full_install(runtime_env, tmp_path):
    from tests.export.models import make

    trainer, params, batch = make("mlp")
    art = trainer.export(trainer.init(params), batch, out_dir=tmp_path / "artifact")
    tool = str(Path(runtime_env).parent / "pockjax")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = lambda *args: subprocess.run([tool, *args], capture_output=True, text=True,
                                       cwd=tmp_path, env=env)
    inspect = run("inspect", str(art.path))
    assert inspect.returncode == 0, inspect.stderr
    assert "train_step(state[" in inspect.stdout and "x: float32[8, 16]" in inspect.stdout
    install = ("needs the full install, and {} are not installed here (a runtime-only install "
               "runs artifacts with `pockjax run` and `pockjax inspect`). Install it with: pip "
               "install 'pockjax{}' (from a checkout: pip install '.{}')")
    export = run("export", str(ROOT / "examples" / "export_mlp.py:make"), "--out", "out")
    assert export.returncode == 1 and "Traceback" not in export.stderr
    assert export.stderr.strip() == "pockjax export: exporting " + install.format(
        "jax, jaxlib, optax, flax, iree-base-compiler", "[export]", "[export]")
    search = run("search", str(ROOT / "examples" / "search_schemes.py:make"), "--out", "s.json")
    assert search.returncode == 1 and search.stderr.strip() == (
        "pockjax search: the scheme search " + install.format("jax, jaxlib, optax, flax", "", ""))
    assert not (tmp_path / "out").exists() and not (tmp_path / "s.json").exists()
    library = subprocess.run([runtime_env, "-c", "import pockjax; pockjax.export.export"],
                             capture_output=True, text=True, cwd=tmp_path, env=env)
    assert library.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: pockjax.export.export needs jax, which this install lacks: a "
        "runtime-only install runs artifacts (pockjax.runtime) but cannot export them. Install "
        "the full pockjax: pip install 'pockjax[export]' (from a checkout: pip install "
        "'.[export]')")


def test_a_device_without_jax_fine_tunes_a_model_folder(runtime_env, tmp_path):
    """`pockjax run DIR --data train.jsonl --out RUN` in the runtime-only environment (no
    JAX, Flax or optax installed; the process checks none is imported) ends at the
    parameters and validation loss of the same job run here, and writes the model
    folder."""
    from safetensors.numpy import load_file

    from pockjax.cli import main
    from tests.finetuning.test_finetune import WORDS, _completions, _folder, _jsonl

    model = _folder(tmp_path, "llama")
    rng = np.random.default_rng(1)
    valid = _jsonl(tmp_path / "valid.jsonl", [{"text": " ".join(rng.choice(WORDS[:12], 10))}
                                              for _ in range(6)])
    data = _jsonl(tmp_path / "train.jsonl", _completions(24))
    options = ["--scheme", "paper", "--steps", "5", "--batch", "4", "--seq", "24", "--lr", "3e-3"]
    assert main(["export", "--model", str(model), "--out", str(tmp_path / "art"), *options]) == 0
    assert main(["run", str(tmp_path / "art"), "--data", str(data), "--valid", str(valid),
                 "--out", str(tmp_path / "here")]) == 0
    script = ("import sys, runpy\n"
              "from pockjax.cli import main\n"
              "code = main(sys.argv[1:])\n"
              "leaked = [m for m in ('jax', 'flax', 'optax') if m in sys.modules]\n"
              "assert not leaked, leaked\n"
              "sys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([runtime_env, "-c", script, "run", str(tmp_path / "art"), "--data",
                           str(data), "--valid", str(valid), "--out", str(tmp_path / "there")],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    here = load_file(tmp_path / "here" / "final" / "model.safetensors")
    there = load_file(tmp_path / "there" / "final" / "model.safetensors")
    for k in here:
        np.testing.assert_allclose(there[k], here[k], rtol=1e-5, atol=1e-7, err_msg=k)
    metrics = [[json.loads(line) for line in (tmp_path / r / "metrics.jsonl").read_text()
                .splitlines()] for r in ("here", "there")]
    valid_losses = [[r["valid_loss"] for r in m if "valid_loss" in r] for m in metrics]
    np.testing.assert_allclose(valid_losses[1], valid_losses[0], rtol=1e-6)
