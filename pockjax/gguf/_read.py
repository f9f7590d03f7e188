"""Reading a GGUF file (llama.cpp's format) as a model `finetune` can load.

`model_folder(path)` gives the folder the rest of pockjax reads a model from: the file's
config (architecture, shapes, rope and norm settings, as transformers' GGUF loader maps
its metadata) as `config.json`, its tokenizer, special tokens and chat template as the
tokenizer files transformers writes for it, and `gguf.json` naming the file, whose
tensors `read_tensors` hands to the loader as the file stores them. The folder is made
once per file (in `$XDG_CACHE_HOME/pockjax/gguf`) and found again by the file's path,
size and time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import numpy as np

SOURCE = "gguf.json"   # in a model folder made from a GGUF file: which file
_MAGIC = b"GGUF"


class GgufError(ValueError):
    """A file that is not a GGUF model pockjax can read (the message says why)."""


def is_gguf(path) -> bool:
    """Whether `path` is a GGUF file (by its first four bytes)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


def source_of(folder) -> Path | None:
    """The GGUF file a model folder was made from (`model_folder`), or None."""
    record = Path(folder) / SOURCE
    if not record.is_file():
        return None
    return Path(json.loads(record.read_text())["file"])


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pockjax" / "gguf"


def _needs(*names: str) -> None:
    """Found without importing them (transformers alone holds hundreds of MiB once
    imported, which a cached folder does not need)."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise GgufError(f"reading a GGUF file needs {' and '.join(missing)}: pip install "
                        f"'pockjax[gguf]'")


def model_folder(path) -> Path:
    """The model folder of GGUF file `path` (made on first use, then reused): its
    `config.json`, tokenizer files and `gguf.json`.

    Raises:
      GgufError: `path` is not a GGUF file, gguf or transformers is missing, or
        transformers cannot map its architecture or tokenizer.
    """
    path = Path(path).resolve()
    if not is_gguf(path):
        raise GgufError(f"'{path}' is not a GGUF file (it does not start with 'GGUF')")
    _needs("gguf")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = _cache_root() / f"{path.stem}-{key}"
    if (folder / SOURCE).is_file():
        return folder
    _needs("transformers")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        config, tokenizer = _config_and_tokenizer(path)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE).write_text(json.dumps({"file": str(path), "size": stat.st_size,
                                              "mtime_ns": stat.st_mtime_ns}) + "\n")
        try:
            os.replace(tmp, folder)
        except OSError:  # made by another process meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _config_and_tokenizer(path: Path):
    """transformers' reading of the file's metadata: the config dict and the tokenizer."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers prints progress bars and warnings while it converts; keep the log clean.
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            parsed = load_gguf_checkpoint(str(path), return_tensors=False)
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent),
                                                                   gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise GgufError(f"'{path}': transformers cannot read this GGUF model "
                        f"({str(e).splitlines()[0][:200]})") from None
    finally:
        transformers.logging.set_verbosity(level)
    config = {k: v for k, v in parsed["config"].items() if not k.startswith("_")}
    config.setdefault("tie_word_embeddings", False)
    return config, tokenizer


@dataclasses.dataclass
class GgufTensor:
    """One tensor of a GGUF file as stored: `type` its GGUF type name ("Q4_1", "F32"...),
    `shape` in numpy's order (`[out, in]` for a weight), `raw` its bytes `[..., row
    bytes]` (memory-mapped), `offset` its bytes' position in the file."""

    name: str
    type: str
    shape: tuple[int, ...]
    raw: np.ndarray
    offset: int


FLOAT_TYPES = ("F32", "F16", "BF16")


def float_values(t: GgufTensor, rows=None) -> np.ndarray:
    """A GGUF tensor's values in float32 (`[out, in]` for a weight), rows reordered by
    `rows` where given: `gguf.quants.dequantize`'s (which the step's decoding of the
    stored blocks equals bit for bit). numpy only."""
    raw = t.raw if rows is None else t.raw[rows]
    if t.type not in FLOAT_TYPES:
        import gguf

        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[t.type]).reshape(
            raw.shape[:-1] + (t.shape[-1],))
    values = plain_values(t)
    return values if rows is None else values[rows]


def plain_values(t: GgufTensor) -> np.ndarray:
    """An F32, F16 or BF16 tensor's values in float32."""
    if t.type == "F32":
        return np.array(t.raw.view(np.float32).reshape(t.shape))
    if t.type == "F16":
        return t.raw.view(np.float16).reshape(t.shape).astype(np.float32)
    if t.type == "BF16":   # a bfloat16 is a float32's upper half
        return (t.raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(t.shape)
    raise GgufError(f"tensor '{t.name}' is {t.type}: pockjax reads F32, F16, BF16 and the "
                    f"block types")


def read_tensors(path, reader=None) -> dict[str, GgufTensor]:
    """The tensors of GGUF file `path` (or of its open `gguf.GGUFReader`) by their GGUF
    names, memory-mapped."""
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        raw = np.asarray(t.data)
        raw = raw.view(np.uint8).reshape(raw.shape[:-1] + (-1,)) if raw.ndim else raw
        out[t.name] = GgufTensor(t.name, t.tensor_type.name, shape, raw, int(t.data_offset))
    return out


def hf_to_gguf_names(path, config: dict, hf_names, reader=None) -> dict[str, str]:
    """Hugging Face tensor name -> the GGUF file's name for it, by gguf's own tensor-name
    map for the file's architecture (`reader`: the file's open `gguf.GGUFReader`)."""
    import gguf

    reader = reader or gguf.GGUFReader(str(path))
    arch_name = str(reader.fields["general.architecture"].contents())
    archs = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    if arch_name not in archs:
        raise GgufError(f"'{path}': architecture {arch_name!r} is not one gguf names")
    table = gguf.get_tensor_name_map(archs[arch_name], int(config["num_hidden_layers"]))
    out = {}
    for name in hf_names:
        mapped = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise GgufError(f"'{path}': gguf has no name for tensor '{name}' of a "
                            f"{arch_name} model")
        out[name] = mapped
    return out


def unpermute_rows(n_rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's permutation of a q or k projection's rows
    (its converter interleaves each head's two rotary halves): `w_hf = w_gguf[order]`."""
    dim = n_rows // heads // 2
    return np.arange(n_rows).reshape(heads, dim, 2).swapaxes(1, 2).reshape(-1)
