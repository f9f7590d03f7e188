"""The package's seams: every module imports on its own, `import pockjax` is cheap and
JAX-free, and no module reaches into another's private names."""
import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pockjax

PACKAGE = Path(pockjax.__file__).parent
# Modules whose imports need an optional extra that the test environment may lack.
OPTIONAL = {"pockjax.torch"}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], "pockjax.")
                  if m.name not in OPTIONAL)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """One interpreter per module would be exact but slow; instead each module is imported
    after every pockjax module is dropped from sys.modules (JAX stays loaded): a module
    that needs another to be imported first, or a cycle that breaks at import time,
    fails here."""
    script = (
        "import importlib, sys, traceback\n"
        "failed = []\n"
        f"for name in {_modules()!r}:\n"
        "    for m in [m for m in sys.modules if m == 'pockjax' or m.startswith('pockjax.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception:\n"
        "        failed.append(name + ': ' + traceback.format_exc(limit=3))\n"
        "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_import_pockjax_and_its_runtime_load_no_jax():
    code = ("import sys, pockjax, pockjax.runtime, pockjax.export.manifest\n"
            "heavy = [m for m in ('jax', 'flax', 'optax', 'iree.compiler') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "assert pockjax.Scheme.__name__ == 'Scheme' and 'jax' in sys.modules\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def test_public_names_resolve():
    for name in pockjax.__all__:
        assert getattr(pockjax, name) is not None, name


def test_no_module_imports_another_modules_private_names():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pockjax"):
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module} "
                          f"import {a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, "\n".join(found)
