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
                  if not _optional(m.name))


def _optional(module: str) -> bool:
    return any(module == o or module.startswith(o + ".") for o in OPTIONAL)


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


def _is_module(package: str, name: str) -> bool:
    folder = PACKAGE.parent.joinpath(*package.split("."))
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def test_no_module_imports_another_modules_private_names():
    """Private modules (`pockjax/_src/ties.py`) are the package's own implementation and may
    be imported anywhere in it; a private name inside another module may not."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pockjax"):
                found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module} "
                          f"import {a.name}" for a in node.names
                          if a.name.startswith("_") and not _is_module(node.module, a.name)]
    assert not found, "\n".join(found)


def _imports(tree: ast.AST) -> list[str]:
    """Every module an `import` or `from ... import` names, anywhere in the file."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found += [f"{node.module}.{a.name}" for a in node.names]
    return found


def test_schemes_and_the_search_import_no_flax():
    """Flax stays at the edge: `pockjax.nnx` converts modules (it registers a converter
    with `schemes.register_params_of`); the scheme helpers and the search see pytrees."""
    search = sorted(p.relative_to(PACKAGE) for p in (PACKAGE / "scheme_search").glob("*.py"))
    for name in (Path("schemes.py"), *search):
        bad = [m for m in _imports(ast.parse((PACKAGE / name).read_text()))
               if m.split(".")[0] == "flax" or m.startswith("pockjax.nnx")]
        assert not bad, f"pockjax/{name} imports {bad}"


def _module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of `package` (a folder)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, counting every import
    statement in the file (inside functions and `TYPE_CHECKING` blocks too)."""
    files = _module_files(package)
    graph = {}
    for module, path in files.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files
                           else node.module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_imports_run_one_way():
    """No import circles in the package or the benchmarks: every import (also those
    inside functions) runs from a module to one that does not import it back."""
    circles = {folder: _circles(_import_graph(PACKAGE.parent / folder))
               for folder in ("pockjax", "benchmarks")}
    assert circles == {"pockjax": [], "benchmarks": []}, circles


def test_the_layout_stays_readable_from_ls():
    """At most 20 modules directly in `pockjax/` (the rest live in one folder per idea),
    and no module of the package over 600 lines."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 20, top
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def test_benchmark_scripts_stay_short():
    """No benchmark module over 800 lines: a script's rows, report and plot live in
    modules of their own."""
    long = {p.name: n for p in (PACKAGE.parent / "benchmarks").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 800}
    assert not long, long


def test_tests_mirror_the_package():
    """A test folder is named after the package folder (or `benchmarks/`) it tests, so
    the tests of `pockjax/train/` are in `tests/train/`."""
    folders = {p.name for p in Path(__file__).parent.iterdir()
               if p.is_dir() and not p.name.startswith((".", "__"))}
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} | {"benchmarks"}
    assert folders <= packages, folders - packages


def test_every_public_name_of_version_0_1_still_imports():
    """`tests/public_names.json` lists each public module of pockjax 0.1 (no underscore in
    its path) and its `__all__`: each still imports from the same path (a renamed one may
    warn)."""
    import importlib
    import json
    import warnings

    listed = json.loads((Path(__file__).parent / "public_names.json").read_text())
    missing = []
    for module_name, names in listed.items():
        if _optional(module_name):
            continue
        module = importlib.import_module(module_name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            missing += [f"{module_name}.{n}" for n in names if not hasattr(module, n)]
    assert len(listed) > 40 and not missing, missing


def _pockjax_names(tree: ast.AST) -> set[str]:
    """The local names bound to pockjax or one of its modules (`pj`, `artifact`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names
                      if a.name.split(".")[0] == "pockjax"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pockjax":
            names |= {a.asname or a.name for a in node.names}
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_examples_and_benchmarks_use_no_private_names():
    """`pj.train._memory` or `from pockjax.export.artifact import _version` in an example
    is a seam missing: the example shows users something they cannot rely on."""
    found = []
    root = PACKAGE.parent
    for path in sorted([*(root / "examples").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        tree = ast.parse(path.read_text())
        ours = _pockjax_names(tree)
        where = lambda node: f"{path.relative_to(root)}:{node.lineno}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pockjax":
                found += [f"{where(node)}: from {node.module} import {a.name}"
                          for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute):
                chain, base = [node.attr], node.value
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in ours and any(map(_private, chain)):
                    found.append(f"{where(node)}: {ast.unparse(node)}")
    assert not sorted(set(found)), "\n".join(sorted(set(found)))


def test_renamed_names_still_work_and_say_the_new_name():
    """Each renamed public name answers with a DeprecationWarning naming its new name,
    and is (or calls) the new object."""
    import jax.numpy as jnp
    import pytest

    import pockjax.nnx
    import pockjax.scheme_search
    import pockjax.transforms

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    scheme = pockjax.Scheme({"w": pockjax.Channels(count=1)})
    for module, old, new in [(pockjax, "search", "search_scheme"),
                             (pockjax, "trainable", "trainable_view"),
                             (pockjax, "apply_updates", "apply_sparse_updates"),
                             (pockjax.transforms, "trainable", "trainable_view"),
                             (pockjax.transforms, "apply_updates", "apply_sparse_updates")]:
        with pytest.warns(DeprecationWarning, match=f"renamed .*{new}"):
            assert getattr(module, old) is getattr(module, new)
    with pytest.warns(DeprecationWarning, match="renamed pockjax.count_flops"):
        pockjax.flops_of
    assert "search" not in pockjax.__all__ and "trainable" not in pockjax.__all__
    with pytest.warns(DeprecationWarning):
        view = pockjax.trainable(params, scheme)
    assert view["w"].shape == (2, 1) and view["b"] is None
    for fn in (pockjax.scheme_search.search, pockjax.nnx.search):
        with pytest.warns(DeprecationWarning, match="renamed search_scheme"), \
                pytest.raises(TypeError):
            fn()  # the new function's own error for missing arguments


def test_public_names_report_a_module_a_user_can_import():
    """Classes and functions defined in private modules name their public facade as
    their module (`_src.home.claim`), so tracebacks and reprs show an importable path."""
    import importlib
    import inspect

    import pockjax.finetuning
    import pockjax.lowbit
    import pockjax.nnx
    import pockjax.prefix
    import pockjax.runtime
    import pockjax.scheme_search
    import pockjax.tokenizer
    import pockjax.train
    import pockjax.transforms
    from pockjax.models import llama, mobilenetv2

    assert pockjax.FinetuneError.__module__ == "pockjax.finetuning"
    private = []
    for module in (pockjax.train, pockjax.prefix, pockjax.nnx, pockjax.runtime,
                   pockjax.scheme_search, pockjax.tokenizer, pockjax.transforms, llama,
                   mobilenetv2, pockjax.lowbit, pockjax.finetuning):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                home = obj.__module__
                if any(p.startswith("_") for p in home.split(".")[1:]):
                    private.append(f"{module.__name__}.{name}: {home}")
                else:
                    assert getattr(importlib.import_module(home), name) is obj, (home, name)
    assert not private, private
