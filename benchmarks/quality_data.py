"""The quality benchmark's data: a pretraining corpus and two fine-tuning tasks held out
from it, all made from Python sources installed on this machine.

- **Pretraining corpus**: the running interpreter's standard library
  (`sysconfig.get_paths()["stdlib"]`), without its test folders and installed packages
  (source "stdlib", the small preset's); or the standard library and the Python sources
  of every installed package except the tasks' (numpy, sympy and a `--task-dir`
  package; source "packages", the medium preset's). A few percent of its files (chosen
  by hashing their paths) are held out: the fine-tuned models' loss on them measures
  forgetting.
- **Task "domain"** (domain adaptation): the sources of an installed package the
  pretraining never saw, numpy by default (or any folder of Python files), split into
  train / valid / test *by file*, so no file is on both sides.
- **Task "instruct"** (instruction following from real code): the functions with
  docstrings of sympy, extracted with `ast`; the prompt is the signature and the
  docstring, the completion the body. sympy because it is the largest pure-Python code
  base installed that is in neither the corpus nor task "domain": it does not build on
  numpy (its own arithmetic), so its bodies are not numpy idiom the domain task teaches;
  its many short methods fit a short sequence. Split by file as well.

Every split is a deterministic function of the file's relative path
(`split_of`), so the data are the same on every run and every machine with the same
installed versions; the manifest records the interpreter and package versions, the
sha256 of each file list and of its contents, and the token counts.

Records are JSONL in the formats `pockjax finetune` reads (`pockjax.data.read_jsonl`):
`{"text"}` cut to at most the sequence length in tokens, and `{"prompt", "completion"}`.
This module imports neither JAX nor PyTorch.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
import textwrap
from pathlib import Path

SPLITS = ("train", "valid", "test")
# Folders left out of every source tree: tests (the "without test/"), what pip
# installed beside the standard library, and byte code.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                       "__pycache__"})
BOS, EOS = "<s>", "</s>"
INSTRUCT_PACKAGE = "sympy"
# Part of every cache key: bump it when a change here changes the data.
FORMAT = 1


def split_of(relpath: str, shares: tuple[int, int] = (80, 90)) -> str:
    """"train", "valid" or "test" for a file: its path's sha256 as a number in [0, 100)
    below `shares[0]` is train, below `shares[1]` valid, the rest test."""
    bucket = int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100
    return "train" if bucket < shares[0] else "valid" if bucket < shares[1] else "test"


def python_files(root: Path) -> list[str]:
    """The `.py` files under `root` as sorted POSIX paths relative to it, without the
    `SKIP_DIRS` folders."""
    root = Path(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        rel = Path(dirpath).relative_to(root)
        out += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(out)


def read_source(root: Path, rel: str) -> str:
    return (Path(root) / rel).read_text(encoding="utf-8", errors="replace")


def fingerprint(root: Path, rels: list[str]) -> dict:
    """The sha256 of the file list (one path a line) and of the files' contents (in that
    order), and the count: enough to tell whether two runs read the same sources."""
    contents = hashlib.sha256()
    for rel in rels:
        contents.update(rel.encode() + b"\0" + (Path(root) / rel).read_bytes() + b"\0")
    return {"root": str(root), "files": len(rels),
            "list_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest(),
            "content_sha256": contents.hexdigest()}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def package_root(name: str) -> Path:
    """The folder of an installed package, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"quality benchmark: the package {name!r} is not installed; pip install "
                 f"{name}, or give another folder of Python files with --task-dir")
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts, vocab_size: int):
    """A byte-level BPE (Hugging Face `tokenizers`) trained on `texts`, with `<s>` and
    `</s>` as its special tokens; the same construction as
    `benchmarks/finetune_speed.py`'s `make_folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def write_tokenizer(tok, folder: Path, max_length: int) -> None:
    """`tokenizer.json` and the `tokenizer_config.json` that `transformers.AutoTokenizer`
    and `pockjax.Tokenizer.from_folder` read (what `PreTrainedTokenizerFast(...,
    bos_token, eos_token).save_pretrained` writes, without importing transformers)."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS,
              "eos_token": EOS, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# --------------------------------------------------------------------------- records


def text_records(texts, tok, seq: int, min_tokens: int = 16, encodings=None) -> list[str]:
    """Each text cut into pieces of `seq - 1` tokens (`read_jsonl` appends the end token),
    cut where a token starts; pieces under `min_tokens` tokens are dropped. `encodings`
    are the texts' `tok.encode_batch`, where the caller has them."""
    out = []
    for enc, text in zip(encodings or tok.encode_batch(list(texts)), texts):
        offsets = enc.offsets
        for i in range(0, len(offsets), seq - 1):
            piece = offsets[i:i + seq - 1]
            if len(piece) < min_tokens:
                continue
            end = offsets[i + seq - 1][0] if i + seq - 1 < len(offsets) else len(text)
            out.append(text[piece[0][0]:end])
    return out


def functions(source: str) -> list[tuple[str, str]]:
    """`(prompt, completion)` for every function in `source` with a docstring and a body
    after it: the prompt is the `def` line(s) and the docstring, dedented to the `def`,
    ending at the docstring's closing quotes; the completion is the rest of the function
    starting with the newline after them. Decorators are left out.

    The cut leaves the newline and the next line's indentation to the completion, so the
    two halves tokenize as the whole would (byte-level BPE groups a whitespace run)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    # Lines as `ast` numbers them: str.splitlines also breaks at form feeds and other
    # separators that Python source may hold inside a line.
    lines = source.replace("\r\n", "\n").split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if (len(body) < 2 or not isinstance(body[0], ast.Expr)
                or not isinstance(body[0].value, ast.Constant)
                or not isinstance(body[0].value.value, str)):
            continue
        doc_end = body[0].end_lineno  # the docstring's last line (1-based)
        text = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
        text_lines = text.split("\n")
        head = doc_end - node.lineno + 1
        prompt = "\n".join(text_lines[:head]).rstrip("\n")
        completion = "\n" + "\n".join(text_lines[head:]).rstrip() + "\n"
        if not prompt.rstrip().endswith(('"""', "'''", '"', "'")) or not completion.strip():
            continue  # a docstring followed by code on its line: not a clean cut
        out.append((prompt, completion))
    return out


def first_line_span(completion: str) -> tuple[int, int]:
    """`(start, end)` characters of the completion's first non-blank line (`end` at its
    newline, or the completion's end)."""
    start = len(completion) - len(completion.lstrip("\n"))
    end = completion.find("\n", start)
    return start, (len(completion) if end < 0 else end)


def write_jsonl(path: Path, records) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
            n += 1
    return n


def _stable_order(items, key):
    """`items` in an order fixed by hashing `key(item)`: caps then take an unbiased but
    reproducible sample instead of the first files alphabetically."""
    return sorted(items, key=lambda x: hashlib.sha256(key(x).encode()).hexdigest())


# --------------------------------------------------------------------------- builders


def _sampled(rels: list[str], pct: int) -> list[str]:
    """A fixed `pct` percent of `rels` (by hashing each path), all of them at 100."""
    if pct >= 100:
        return rels
    return [r for r in rels
            if int(hashlib.sha256(b"sample" + r.encode()).hexdigest()[:8], 16) % 100 < pct]


# Corpus sources: the standard library alone, or with every installed package's sources.
SOURCES = ("stdlib", "packages")
# The task packages, never in a "packages" corpus (a --task-dir package is left out too).
HELD_OUT_PACKAGES = ("numpy", "sympy")
# Larger files are generated tables (lexer maps, Unicode data), not code to learn from.
MAX_FILE_BYTES = 1 << 20


class Sources:
    """The files of several roots under one name space: a file is `"<label>/<path>"`
    (`"stdlib/json/decoder.py"`), or its bare path where there is one root (the standard
    library alone, named as the small preset always named it)."""

    def __init__(self, roots: dict[str, Path]):
        self.roots = {k: Path(v) for k, v in roots.items()}

    def _split(self, rel: str) -> tuple[Path, str]:
        if len(self.roots) == 1:
            return next(iter(self.roots.values())), rel
        label, _, path = rel.partition("/")
        return self.roots[label], path

    def read(self, rel: str) -> str:
        root, path = self._split(rel)
        return read_source(root, path)

    def read_bytes(self, rel: str) -> bytes:
        root, path = self._split(rel)
        return (root / path).read_bytes()

    def fingerprint(self, rels: list[str]) -> dict:
        """As `fingerprint`, over these roots."""
        contents = hashlib.sha256()
        for rel in rels:
            contents.update(rel.encode() + b"\0" + self.read_bytes(rel) + b"\0")
        root = " + ".join(f"{k}: {v}" for k, v in self.roots.items()) \
            if len(self.roots) > 1 else str(next(iter(self.roots.values())))
        return {"root": root, "files": len(rels),
                "list_sha256": hashlib.sha256("\n".join(rels).encode()).hexdigest(),
                "content_sha256": contents.hexdigest()}


def site_packages() -> list[Path]:
    """The running interpreter's package folders (a virtual environment's own)."""
    paths = sysconfig.get_paths()
    return sorted({Path(paths["purelib"]), Path(paths["platlib"])})


def package_files(root: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """The `.py` files of every package in a site-packages folder, without `SKIP_DIRS`,
    the top-level packages and modules named in `exclude` (and their `.libs` folders),
    metadata folders, files over `MAX_FILE_BYTES` and files whose bytes repeat an
    earlier file's (vendored copies)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out, seen = [], set()
    for rel in python_files(root):
        top = rel.split("/", 1)[0]
        name = top[:-3] if top.endswith(".py") else top
        if (name in exclude or name.removesuffix(".libs") in exclude
                or top.endswith((".dist-info", ".egg-info", ".data")) or top.startswith("__editable__")):
            continue
        path = root / rel
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        digest = hashlib.sha256(path.read_bytes()).digest()
        if digest not in seen:
            seen.add(digest)
            out.append(rel)
    return out


def corpus_files(sample_pct: int = 100, source: str = "stdlib",
                 exclude: tuple[str, ...] = ()) -> tuple[Sources, list[str], list[str]]:
    """`(sources, pretraining files, held-out files)`: of the standard library (source
    "stdlib"), or of the standard library and every installed package but
    `HELD_OUT_PACKAGES` and `exclude` (source "packages"). The held-out files are the
    "test" share of `split_of(..., (95, 95))` (5%); `sample_pct` < 100 keeps that share
    of the pretraining files (the quick presets)."""
    if source not in SOURCES:
        raise ValueError(f"corpus source {source!r}: choose one of {', '.join(SOURCES)}")
    if source == "stdlib":
        sources = Sources({"stdlib": stdlib_root()})
        rels = python_files(stdlib_root())
    else:
        packages = site_packages()
        roots = {"stdlib": stdlib_root(),
                 **{("site-packages" if i == 0 else f"site-packages-{i}"): p
                    for i, p in enumerate(packages)}}
        sources = Sources(roots)
        skip = tuple(HELD_OUT_PACKAGES) + tuple(exclude)
        rels = [f"stdlib/{r}" for r in python_files(stdlib_root())]
        for label, root in list(roots.items())[1:]:
            rels += [f"{label}/{r}" for r in package_files(root, skip)]
    held = [r for r in rels if split_of(r, (95, 95)) == "test"]
    train = [r for r in rels if split_of(r, (95, 95)) == "train"]
    return sources, _sampled(train, sample_pct), held


def build_corpus(folder: Path, *, vocab: int, seq: int, sample_pct: int = 100,
                 heldout_cap: int = 128, source: str = "stdlib",
                 exclude: tuple[str, ...] = ()) -> dict:
    """The pretraining corpus in `folder`: `tokenizer/` (a BPE trained on the pretraining
    files only), `train.jsonl` and `heldout.jsonl` (`{"text"}` records of at most `seq`
    tokens; the held-out set capped at `heldout_cap` records, a fixed sample), from
    `corpus_files(sample_pct, source, exclude)`. Returns the manifest (also written as
    `manifest.json`); a folder whose manifest has the same settings is reused as it is."""
    settings = {"vocab": vocab, "seq": seq, "sample_pct": sample_pct, "heldout_cap": heldout_cap,
                "python": sys.version.split()[0], "format": FORMAT}
    if source != "stdlib":  # the small preset's settings as they always were
        settings.update(source=source, exclude=sorted(HELD_OUT_PACKAGES + tuple(exclude)))
    manifest_file = folder / "manifest.json"
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("settings") == settings:
            return manifest
    sources, train_rels, held_rels = corpus_files(sample_pct, source, tuple(exclude))
    train_texts = [sources.read(r) for r in train_rels]
    held_texts = [sources.read(r) for r in held_rels]
    tok = train_tokenizer(train_texts, vocab)
    write_tokenizer(tok, folder / "tokenizer", seq)
    encodings = tok.encode_batch(train_texts)
    train = text_records(train_texts, tok, seq, encodings=encodings)
    train_tokens = sum(len(e.ids) for e in encodings)
    del encodings
    held = _stable_order(text_records(held_texts, tok, seq), lambda t: t)[:heldout_cap]
    write_jsonl(folder / "train.jsonl", ({"text": t} for t in train))
    write_jsonl(folder / "heldout.jsonl", ({"text": t} for t in held))
    count = lambda texts: sum(len(e.ids) for e in tok.encode_batch(texts))
    manifest = {
        "settings": settings,
        "interpreter": f"{sys.implementation.name} {sys.version.split()[0]} ({sys.executable})",
        "pretraining_files": sources.fingerprint(train_rels),
        "heldout_files": sources.fingerprint(held_rels),
        "skipped_folders": sorted(SKIP_DIRS),
        "vocab_size": tok.get_vocab_size(),
        "tokens": {"train_files": train_tokens, "heldout_files": count(held_texts),
                   "train_records": len(train), "heldout_records": len(held)},
    }
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _package_version(name: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "unknown"


def check_task_dir(task_dir) -> Path:
    """`--task-dir` resolved, after checking it is a folder with Python files."""
    root = Path(task_dir).resolve()
    if not root.is_dir():
        sys.exit(f"quality benchmark: --task-dir {task_dir}: no such folder; give a folder of "
                 f"Python files to use as the domain task")
    if not python_files(root):
        sys.exit(f"quality benchmark: --task-dir {task_dir}: no .py files in it (test folders "
                 f"are skipped); give a folder of Python sources")
    return root


def build_tasks(folder: Path, tokenizer_folder: Path, *, seq: int, caps: dict,
                task_dir: str | None = None, sample_pct: int = 100) -> dict:
    """Both fine-tuning tasks in `folder`: `domain/{train,valid,test}.jsonl` (`{"text"}`,
    from `task_dir` or numpy) and `instruct/{train,valid,test}.jsonl` (`{"prompt",
    "completion"}` from sympy's functions that fit `seq` tokens with the end token).
    `caps` is `{split: most records}` (a fixed sample); `sample_pct` < 100 reads only
    that share of numpy's and sympy's files (the quick preset). Returns the manifest (written
    as `manifest.json`); a folder with the same settings is reused."""
    from tokenizers import Tokenizer

    domain_root = check_task_dir(task_dir) if task_dir else package_root("numpy")
    tok_hash = hashlib.sha256((tokenizer_folder / "tokenizer.json").read_bytes()).hexdigest()
    settings = {"seq": seq, "caps": caps, "domain": str(domain_root), "tokenizer": tok_hash,
                "sample_pct": sample_pct, "format": FORMAT}
    manifest_file = folder / "manifest.json"
    if manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("settings") == settings:
            return manifest
    tok = Tokenizer.from_file(str(tokenizer_folder / "tokenizer.json"))
    manifest = {"settings": settings}

    # Task "domain": source files as text records.
    # A user's folder is taken whole; the packages are sampled in the quick preset.
    rels = python_files(domain_root)
    rels = rels if task_dir else _sampled(rels, sample_pct)
    name = domain_root.name if task_dir else "numpy"
    entry = {"source": name, "version": "" if task_dir else _package_version("numpy"),
             "files": {}, "records": {}, "tokens": {}}
    for split in SPLITS:
        split_rels = [r for r in rels if split_of(r) == split]
        texts = [read_source(domain_root, r) for r in split_rels]
        records = _stable_order(text_records(texts, tok, seq), lambda t: t)[:caps[split]]
        entry["files"][split] = fingerprint(domain_root, split_rels)
        entry["records"][split] = write_jsonl(folder / "domain" / f"{split}.jsonl",
                                              ({"text": t} for t in records))
        entry["tokens"][split] = sum(len(e.ids) + 1 for e in tok.encode_batch(records)) \
            if records else 0
        if not records:
            sys.exit(f"quality benchmark: task 'domain' ({domain_root}) has no {split} "
                     f"records; give a folder with more Python files")
    manifest["domain"] = entry

    # Task "instruct": sympy's documented functions.
    root = package_root(INSTRUCT_PACKAGE)
    rels = _sampled(python_files(root), sample_pct)
    entry = {"source": INSTRUCT_PACKAGE, "version": _package_version(INSTRUCT_PACKAGE),
             "files": {}, "records": {}, "tokens": {}, "functions_found": {}}
    for split in SPLITS:
        split_rels = [r for r in rels if split_of(r) == split]
        pairs, seen = [], set()
        for rel in split_rels:
            for prompt, completion in functions(read_source(root, rel)):
                if (prompt, completion) not in seen:
                    seen.add((prompt, completion))
                    pairs.append((prompt, completion))
        # Whole examples only: prompt + completion + the end token within `seq`.
        encoded = zip(tok.encode_batch([p for p, _ in pairs]),
                      tok.encode_batch([c for _, c in pairs]))
        fits = [(p, c) for (p, c), (ep, ec) in zip(pairs, encoded)
                if len(ep.ids) + len(ec.ids) + 1 <= seq]
        fits = _stable_order(fits, lambda pc: pc[0] + pc[1])[:caps[split]]
        entry["files"][split] = fingerprint(root, split_rels)
        entry["functions_found"][split] = len(pairs)
        entry["records"][split] = write_jsonl(folder / "instruct" / f"{split}.jsonl",
                                              ({"prompt": p, "completion": c} for p, c in fits))
        entry["tokens"][split] = sum(len(tok.encode(p).ids) + len(tok.encode(c).ids) + 1
                                     for p, c in fits)
        if not fits:
            sys.exit(f"quality benchmark: task 'instruct' has no {split} examples of at most "
                     f"{seq} tokens; raise the sequence length")
    manifest["instruct"] = entry
    manifest_file.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
