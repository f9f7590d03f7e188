"""mkdocs hooks: the pages outside `docs/` that the guides link to become site pages.

The guides link to the repository's files as they sit beside `docs/` (`../README.md`,
`../benchmarks/results/*.md` and their images, `../examples/*.py`), so they read the same
on a code host as on the site. Here those files are added to the site as generated
pages: results pages and the README as they are, each example as a page with its source.
A link to a file that does not exist stays unresolved, and `mkdocs build --strict` fails.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def on_config(config):
    """Every results page and example in the navigation, under Results and Examples."""
    results = [f"results/{p.name}" for p in sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    examples = [f"examples/{p.stem}.md" for p in sorted((ROOT / "examples").glob("*.py"))]
    nav = []
    for entry in config["nav"]:
        if entry == {"Results": "results.md"}:
            entry = {"Results": ["results.md", *results]}
        elif isinstance(entry, dict) and "Guides" in entry:
            entry = {"Guides": [*entry["Guides"], {"Example scripts": examples}]}
        nav.append(entry)
    config["nav"] = nav
    return config


def _example_page(path: Path) -> str:
    doc = path.read_text()
    return f"# examples/{path.name}\n\n```python\n{doc.rstrip()}\n```\n"


def on_files(files, config):
    """Add the README, the results pages (with their images) and the examples."""
    from mkdocs.structure.files import File

    def add(src_uri: str, content: str | bytes) -> None:
        files.append(File.generated(config, src_uri, content=content))

    add("readme.md", (ROOT / "README.md").read_text())
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        if path.suffix == ".md":
            add(f"results/{path.name}", path.read_text())
        elif path.suffix == ".png":
            add(f"results/{path.name}", path.read_bytes())
    for path in sorted((ROOT / "examples").glob("*.py")):
        add(f"examples/{path.stem}.md", _example_page(path))
    return files


def _site_link(path: str) -> str:
    """The site page of a repository path (relative to the repository's root)."""
    if path == "README.md":
        return "readme.md"
    if path.startswith("docs/"):
        return path[len("docs/"):]
    if path.startswith("benchmarks/results/"):
        return "results/" + path[len("benchmarks/results/"):]
    if path.startswith("examples/") and path.endswith(".py"):
        return "examples/" + Path(path).stem + ".md"
    return path


def on_page_markdown(markdown, page, config, files):
    """Point links to `../README.md`, `../benchmarks/results/X` and `../examples/X.py`
    (from `docs/`; the README's without `../`) at the generated pages."""
    where = page.file.src_uri
    if where == "api/index.md":
        return markdown.replace("<!-- api-table -->", api_table())
    if where == "readme.md":
        pattern = r"\]\(((?:docs/|benchmarks/results/|examples/)[^)#\s]*)"
        return re.sub(pattern, lambda m: "](" + _site_link(m.group(1)), markdown)
    if "/" in where:  # results/, examples/ and api/ pages link as they are
        return markdown
    pattern = r"\]\(\.\./((?:README\.md|benchmarks/results/|examples/)[^)#\s]*)"
    return re.sub(pattern, lambda m: "](" + _site_link(m.group(1)), markdown)


def _api_pages() -> dict[str, str]:
    """Each documented module (`::: pockjax.x` on a page of docs/api/) -> that page."""
    pages = {}
    for page in sorted((ROOT / "docs" / "api").glob("*.md")):
        for module in re.findall(r"^::: (\S+)", page.read_text(), re.M):
            pages[module] = page.name
    return pages


def top_level_names() -> dict[str, tuple[str, bool]]:
    """pockjax's top-level names -> (the module that defines it, or the module itself;
    whether the name is a module), read from `pockjax/__init__.py`'s `_WHERE` without
    importing pockjax."""
    import ast

    tree = ast.parse((ROOT / "pockjax" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_WHERE":
            where = ast.literal_eval(node.value)
            return {name: (f"pockjax.{name}" if module is None else f"pockjax.{module}",
                           module is None)
                    for name, module in where.items() if not name.startswith("_")}
    raise RuntimeError("pockjax/__init__.py has no _WHERE table")


def api_entry(name: str) -> str | None:
    """The API page and anchor of top-level name `name` ("page.md#id"), or None."""
    pages = _api_pages()
    module, is_module = top_level_names()[name]
    inside = sorted(m for m in pages if m.startswith(module + "."))
    if is_module:  # a module documented whole, or a package through its modules
        if module in pages:
            return f"{pages[module]}#{module}"
        return pages[inside[0]] if inside else None
    if module in pages:
        return f"{pages[module]}#{module}.{name}"
    for home in inside:  # a package's name, re-exported from one of its modules
        source = ROOT / (home.replace(".", "/") + ".py")
        if source.is_file() and re.search(rf"^(def|class) {name}\b", source.read_text(), re.M):
            return f"{pages[home]}#{home}.{name}"
    return None


def api_table() -> str:
    """The API index's table: each top-level name, linked to its entry."""
    rows = ["| `pj.` name | defined in |", "|---|---|"]
    for name, (module, _) in sorted(top_level_names().items(), key=lambda kv: kv[0].lower()):
        rows.append(f"| [`{name}`]({api_entry(name)}) | `{module}` |")
    return "\n".join(rows)
