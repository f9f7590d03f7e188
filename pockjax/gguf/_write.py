"""Writing a fine-tuned model back as a GGUF file that runs where the original ran.

`write_gguf(source, out, trained)` copies GGUF file `source` into `out`: every metadata
key (tokenizer, chat template, rope settings, ...) as it is, the fine-tuning recorded in
`general.*` keys, every tensor not in `trained` as the source's own bytes, and each
trained tensor in a float type (F16 by default, BF16 or F32) or quantized to a named
block type with `gguf`'s quantizer. The file is written beside `out` and renamed into
place.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from pockjax.gguf._read import GgufError

SAVE_TYPES = ("F16", "BF16", "F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def tensor_digest(raw) -> str:
    """A short SHA-256 of a tensor's bytes (the log's check that a frozen tensor is the
    source's)."""
    return hashlib.sha256(np.ascontiguousarray(raw).view(np.uint8).tobytes()).hexdigest()[:16]


def add_metadata(writer, metadata: dict) -> None:
    """`metadata`'s keys on `writer` (a `gguf.GGUFWriter`): booleans, integers (uint64),
    floats (float64), anything else as a string."""
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint64(key, value)
        elif isinstance(value, float):
            writer.add_float64(key, value)
        else:
            writer.add_string(key, str(value))


def write_gguf(source, out, trained: dict, *, save_type: str = "F16",
               metadata: dict | None = None) -> dict:
    """Write GGUF file `out`: `source` with the tensors in `trained` replaced.

    Args:
      source: the GGUF file the model was read from.
      out: the file to write (replaced atomically).
      trained: GGUF tensor name -> float32 values in the file's numpy layout (`[out,
        in]` for a weight, rows in the file's order).
      save_type: the trained tensors' type: "F16" (default), "BF16", "F32", or a block
        type `gguf` quantizes ("Q8_0", "Q4_0", ...). Vectors (norms) stay F32; a
        tensor whose rows no block of the type divides is written in F16.
      metadata: more keys (strings or numbers), e.g. the training in `general.*` keys.

    Returns:
      `{name: (how, detail)}` for every tensor: ("kept", digest of its bytes) or
      ("trained", the type written and the largest error of its rounding).

    Raises:
      GgufError: an unknown `save_type`, or a trained tensor whose shape is not the
        source's.
    """
    import gguf

    if save_type not in SAVE_TYPES:
        raise GgufError(f"--gguf-type {save_type!r}: choose one of {', '.join(SAVE_TYPES)}")
    source, out = Path(source), Path(out)
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields["general.architecture"].contents())
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
        if key == "general.alignment":
            writer.data_alignment = int(field.contents())
    add_metadata(writer, metadata or {})
    report = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        if t.name not in trained:
            raw = np.asarray(t.data)
            writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=t.tensor_type)
            report[t.name] = ("kept", tensor_digest(raw))
            continue
        values = np.asarray(trained[t.name], np.float32)
        if values.shape != shape:
            raise GgufError(f"trained tensor '{t.name}' has shape {list(values.shape)}; "
                            f"'{source}' holds {list(shape)}")
        data, qtype, error = encoded(values, save_type)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
        report[t.name] = ("trained", f"{qtype.name}, largest rounding {error:.3g}")
    finish(writer, tmp, out)
    return report


def encoded(values: np.ndarray, kind: str):
    """`values` in GGUF type `kind` (a vector in F32; a row length no block of `kind`
    divides in F16): the data, its type and the largest error of the rounding."""
    import gguf

    if values.ndim < 2:
        kind = "F32"
    qtype = gguf.GGMLQuantizationType[kind]
    if values.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        qtype = gguf.GGMLQuantizationType.F16
    data = gguf.quants.quantize(values, qtype)
    back = gguf.quants.dequantize(data, qtype).reshape(values.shape)
    error = float(np.max(np.abs(back - values))) if values.size else 0.0
    return data, qtype, error


def write_report(gguf_path: Path, report: dict) -> None:
    """`report` (a writer's `{name: (how, detail)}`) as `<gguf_path>.json` beside the file,
    written atomically: each tensor's digest or rounding."""
    from pockjax.checkpoint import write_atomic

    write_atomic(gguf_path.with_name(gguf_path.name + ".json"), (json.dumps(
        {name: {how: detail} for name, (how, detail) in report.items()}, indent=1)
        + "\n").encode())


def finish(writer, tmp: Path, out: Path) -> None:
    """Write `writer`'s header, keys and tensors into `tmp` and rename it to `out`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, out)
