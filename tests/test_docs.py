"""The documentation: the docstring examples of the public modules run and show what
they print, every public name has an API entry, and the site builds with warnings as
errors."""
import doctest
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

MODULES = ["pockjax.scheme", "pockjax.schemes", "pockjax.nnx", "pockjax.train",
           "pockjax.models.lora", "pockjax.models.llama", "pockjax.models.mobilenetv2",
           "pockjax.models.hf", "pockjax.sharding", "pockjax.schedule",
           "pockjax.transforms.sparse_grad", "pockjax.keras", "pockjax.onnx"]  # pockjax.flops, .torch, .tokenizer, .tf: in their own tests


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


# --------------------------------------------------------------------------- the site

ROOT = Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_has_an_api_entry():
    """Each `pj.` name links to its entry on an API page, and every public module of the
    package is rendered on one (`::: pockjax.module` in docs/api/)."""
    hooks = _hooks()
    missing = [n for n in hooks.top_level_names() if hooks.api_entry(n) is None]
    assert not missing, f"pj names without an API entry in docs/api/: {missing}"
    documented = set(hooks._api_pages())
    modules = []
    for path in sorted((ROOT / "pockjax").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            if not re.search(r"^(def|class) [^_]", path.read_text(), re.M):
                continue  # a package that only re-exports its modules' names
            parts = parts[:-1]
            if len(parts) == 1:
                continue  # pockjax itself: the API index lists its names
        if any(p.startswith("_") for p in parts[1:]):
            continue
        modules.append(".".join(parts))
    undocumented = [m for m in modules if m not in documented]
    assert not undocumented, f"modules no page of docs/api/ renders: {undocumented}"


def test_docs_site_builds_with_warnings_as_errors(tmp_path):
    """`make docs`: the site builds with mkdocs --strict (broken links and anchors,
    docstrings naming parameters a signature lacks, unresolved references all fail)."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.is_file(), "mkdocs is not installed: pip install -e '.[docs]'"
    run = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    warnings = [line for line in run.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert run.returncode == 0, "mkdocs build --strict failed:\n" + "\n".join(warnings[:40])
    assert (tmp_path / "api" / "index.html").is_file()


def _run_program(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` run by this interpreter in a fresh process in `cwd`, this checkout first on
    the path, plots written without a display."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


def test_readme_quickstart_runs_as_written(tmp_path):
    """The README's Python quickstart is a whole program: it runs, its loss falls, and
    it prints the report and writes its checkpoint."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, f"the README has {len(blocks)} Python blocks; the test runs one"
    run = _run_program(blocks[0], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, re.search(r"loss (\S+) -> (\S+)", run.stdout).groups())
    assert last < 0.5 * first, run.stdout
    assert "parameters trained" in run.stdout and (tmp_path / "ckpt.safetensors").is_file()


GUIDES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "```python" in p.read_text())


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_guide_code_blocks_run(page, tmp_path):
    """Each guide's Python blocks run, in order, as one program in a fresh process (four
    host devices, so the mesh examples have a mesh): the guides show working code."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    program = ('import jax\njax.config.update("jax_num_cpu_devices", 4)\n'
               + "\n".join(blocks))
    run = _run_program(program, tmp_path)
    assert run.returncode == 0, f"{page.name}:\n{run.stderr[-4000:]}"
