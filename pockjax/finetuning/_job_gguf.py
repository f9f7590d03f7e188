"""`pockjax run`'s end for a job exported from a GGUF file (`pockjax export --model
FILE.gguf`), without JAX: `RUN/final/` (the model folder: every tensor the file's values
in float32, as `finetune` writes it from a GGUF file) and `RUN/final.gguf` (every tensor
the job never trained the file's own bytes, the trained ones in the job's GGUF type);
`pockjax merge --out MID` writes `MID/` and `MID.gguf` alike.
The job's `gguf` entry (`_job_export._gguf_layout`) says where each checkpoint tensor is
in the file and the q and k projections' row order."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

SHARD_BYTES = 2 << 30  # final/'s shards, as `pockjax.models.hf.save_llama_params` writes


def merge_final_gguf(artifact: Path, job: dict, values: dict, final: Path,
                     trained_value, merged_value) -> dict:
    """Write `final` and `final.gguf` beside it from the job's GGUF file and the trained
    `values`; `trained_value(name, base)` and `merged_value(name, base)` give a trained
    tensor or a LoRA kernel from its base values (`[out, in]`, float32). Returns
    `pockjax.gguf.write_gguf`'s report (also written as `final.gguf.json`)."""
    from pockjax.checkpoint import write_safetensors
    from pockjax.gguf._read import float_values, read_tensors
    from pockjax.gguf._write import write_gguf, write_report

    layout = job["gguf"]
    source = Path(artifact) / "model" / layout["file"]
    tensors = read_tensors(source)

    def base(name):
        rows = layout["rows"].get(name)
        return float_values(tensors[layout["names"][name]],
                            None if rows is None else np.asarray(rows))

    def value(name):
        if name in job["trained"]:
            return np.asarray(trained_value(name, base), np.float32)
        if name in job["lora"]:
            return np.asarray(merged_value(name, base), np.float32)
        return base(name)

    # final/: the folder's files, then every tensor in float32.
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in (Path(artifact) / "model").iterdir():
        if f.name != layout["file"]:
            shutil.copyfile(f, tmp / f.name)
    names = list(layout["names"])
    shapes = {n: tensors[layout["names"][n]].shape for n in names}
    shards, size = [[]], 0
    for n in names:
        nbytes = int(np.prod(shapes[n])) * 4
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards):
        write_safetensors(tmp / file, [(n, tuple(shapes[n]), np.dtype(np.float32),
                                        lambda n=n: np.ascontiguousarray(value(n)))
                                       for n in shard], {"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": {n: f for f, s in zip(files, shards) for n in s}}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)

    # final.gguf: the trained tensors back in the file's row order and layout.
    changed = {}
    for name in list(job["trained"]) + list(job["lora"]):
        v = value(name)
        rows = layout["rows"].get(name)
        changed[layout["names"][name]] = v if rows is None else v[np.argsort(rows)]
    written = final.with_name(final.name + ".gguf")   # RUN/final.gguf beside RUN/final
    report = write_gguf(source, written, changed, save_type=layout["type"], metadata={
        "general.pockjax.tool": "pockjax run", "general.pockjax.scheme": job["scheme"],
        "general.pockjax.steps": int(job["steps"]), "general.pockjax.base_file": layout["file"]})
    write_report(written, report)
    return report
