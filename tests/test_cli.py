"""The `pockjax` command line where a user stops it: Ctrl-C in `export` and `search`."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pockjax as pj
from pockjax.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "export_mlp.py"


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def _cli(argv) -> int:
    try:
        return cli(argv)
    except KeyboardInterrupt:  # would stop pytest itself
        pytest.fail("Ctrl-C escaped `pockjax` as a KeyboardInterrupt traceback")


def _one_line(err: str) -> str:
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    return err.strip().splitlines()[-1]


def test_ctrl_c_in_export_writes_nothing(tmp_path, monkeypatch, capsys):
    import pockjax.export.artifact as artifact

    monkeypatch.setattr(artifact, "compile_module", _interrupt)
    out = tmp_path / "art"
    assert _cli(["export", f"{EXAMPLE}:make", "--out", str(out)]) == 130
    assert _one_line(capsys.readouterr().err) == (
        f"pockjax export: interrupted (Ctrl-C); nothing was written (no '{out}' was made)")
    assert list(tmp_path.iterdir()) == []
    # An older artifact in its place stays as it was.
    out.mkdir()
    (out / "manifest.json").write_text("old")
    assert _cli(["export", f"{EXAMPLE}:make", "--out", str(out)]) == 130
    assert _one_line(capsys.readouterr().err).endswith(
        f"nothing was written ('{out}' is as it was)")
    assert [p.name for p in tmp_path.iterdir()] == ["art"]
    assert (out / "manifest.json").read_text() == "old"


def test_ctrl_c_from_the_terminal_while_iree_compiles(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group, IREE's compiler process too."""
    out = tmp_path / "art"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pockjax.cli", "export", f"{EXAMPLE}:make",
                             "--out", str(out)], cwd=tmp_path, env=env, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            # as from a terminal: a process started in the background (CI)
                            # passes SIGINT on ignored, and Python keeps it so
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if "compiling the module for host-cpu" in line:
                time.sleep(0.5)  # inside iree-compile
                os.killpg(proc.pid, signal.SIGINT)
                break
        err = "".join(seen) + proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert any("compiling the module" in line for line in seen), err
    assert proc.returncode == 130, err
    assert _one_line(err) == ("pockjax export: interrupted (Ctrl-C); nothing was written "
                              f"(no '{out}' was made)")
    assert list(tmp_path.iterdir()) == []


class _Report:
    def __str__(self):
        return "report"

    def save(self, path):
        raise KeyboardInterrupt


@pytest.mark.parametrize("written, cache, message", [
    (False, False, "nothing was written (with --cache DIR the candidates measured so far are "
                   "kept, and the same command resumes from them)"),
    (False, True, "nothing was written to '{out}'; the candidates measured so far are kept in "
                  "'{cache}', and the same command resumes from them"),
    (True, False, "wrote {out} before that")])
def test_ctrl_c_in_search_says_what_was_kept(tmp_path, monkeypatch, capsys, written, cache,
                                             message):
    spec = tmp_path / "problem.py"
    spec.write_text("problem = (None, None, None)\n")
    if written:  # interrupted while writing the report, after the scheme
        monkeypatch.setattr(pj, "search_scheme", lambda *a, **k: (pj.Scheme({}), _Report()))
    else:
        monkeypatch.setattr(pj, "search_scheme", _interrupt)
    out, cache_dir = tmp_path / "scheme.json", tmp_path / "cache"
    argv = ["search", f"{spec}:problem", "--out", str(out), "--report", str(tmp_path / "r.json")]
    assert _cli(argv + (["--cache", str(cache_dir)] if cache else [])) == 130
    assert _one_line(capsys.readouterr().err) == (
        "pockjax search: interrupted (Ctrl-C); " + message.format(out=out, cache=cache_dir))
    assert out.exists() == written


def test_ctrl_c_in_run_says_how_far_it_got(tmp_path, monkeypatch, capsys):
    from pockjax import runtime

    class Session:
        manifest = {"functions": {"train_step": {"inputs": [
            {"name": "x", "dtype": "float32", "shape": [2]}]}}}
        steps = 0

        def step(self, batch):
            self.steps += 1
            if self.steps == 3:
                raise KeyboardInterrupt
            return {"loss": 1.0}

    monkeypatch.setattr(runtime, "load", lambda path, device: Session())
    ckpt = tmp_path / "c.safetensors"
    assert _cli(["run", "art", "--steps", "5", "--save", str(ckpt)]) == 130
    assert _one_line(capsys.readouterr().err) == (
        "pockjax run: interrupted (Ctrl-C); 2 of 5 steps ran; the artifact's files are "
        f"unchanged; the trained state was not saved to '{ckpt}' (--save writes it after the "
        "last step)")
    assert not ckpt.exists()
