"""`pockjax export --model`: `finetune`'s training step for a Hugging Face folder, as an
artifact a device fine-tunes with (`pockjax run DIR --data ...`, `pockjax.finetuning._job_run`).

The step is `finetune`'s: the same loading (`load_model`, frozen weights stored as they
are read), scheme (`choose_scheme`), parameters (`trainer_params`) and optimizer
(`make_trainer`, the learning-rate schedule over `--steps`). Beside the compiled step
the artifact directory holds what the device needs to run the job and nothing else:

    DIR/job.json     the job: sizes, schedule, seed, scheme, where each trained tensor
                     goes in the model folder, and the sha256 of every file below
    DIR/model/       the base folder's config, tokenizer files and chat template, and
                     (unless --no-base) its weights, from which `pockjax run` writes the
                     fine-tuned folder: the frozen tensors as they are, byte for byte

`job.json`'s format is read by `pockjax.finetuning._job_run`, which imports no JAX.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from pockjax.finetuning._base import FinetuneError
from pockjax.finetuning._options import FinetuneOptions
from pockjax.export.manifest import sha256

JOB = "job.json"
MODEL = "model"
FORMAT = "pockjax.device-job"
VERSION = 1
# The base folder's files a device job keeps (besides the weights).
_FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "tokenizer.model", "vocab.json", "merges.txt")


def _trained_tensors(loaded, chosen, params) -> tuple[dict, dict]:
    """`(trained, lora)`: checkpoint name -> where its new value is in the parameters
    (`{"path", "transposed", "channels"}`: a whole leaf, or a low-bit weight's float32
    `@master` channels `[axis, start, count]` in the parameter's layout), and for LoRA
    each adapted weight's kernel and adapters (`{"kernel", "a", "b", "scale",
    "transposed"}`)."""
    import jax

    from pockjax import lowbit
    from pockjax.finetuning._model import shapes_of
    from pockjax.scheme import Frozen, leaves_with_paths

    if loaded.checkpoint_name is None:
        raise FinetuneError("this model's parameters have no names in its folder; export it "
                            "with a module of your own (pockjax export MODULE:ATTR)")
    shapes = shapes_of(params)
    paths = [p for p, _ in leaves_with_paths(shapes)[0]]
    trained = set()
    for one in getattr(chosen, "schemes", None) or (chosen,):
        decisions = jax.tree_util.tree_leaves(one.resolve(shapes, allow_empty=True),
                                              is_leaf=lambda d: d is not None
                                              and not isinstance(d, dict))
        trained |= {p for p, d in zip(paths, decisions) if not isinstance(d, Frozen)}
    out, lora = {}, {}
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lowbit.is_quantized)[0]
    from pockjax.scheme import path_str

    transposed = loaded.checkpoint_transposed or set()
    for key, leaf in leaves:
        path = path_str(key)
        if loaded.lora is not None and path.endswith("/lora_a"):
            owner = path[:-len("/lora_a")]
            name = loaded.checkpoint_name(owner + "/kernel")
            lora[name] = {"kernel": owner + "/kernel", "a": path, "b": owner + "/lora_b",
                          "scale": loaded.lora["scale"],
                          "transposed": owner + "/kernel" in transposed}
            continue
        name = loaded.checkpoint_name(path)
        if name is None or name in lora:
            continue
        if lowbit.is_quantized(leaf):
            if leaf.channels is not None:  # trains in part: its channels in @master
                out[name] = {"path": path + "/@master", "transposed": path in transposed,
                             "channels": list(leaf.channels)}
        elif path in trained:
            out[name] = {"path": path, "transposed": path in transposed, "channels": None}
    return out, lora


def _gguf_layout(loaded, folder: Path, source: Path, gguf_type: str) -> dict:
    """What `pockjax run` needs to write `final/` and `final.gguf` from a GGUF base
    without JAX: the file's name, each checkpoint name's tensor in the file, the q and k
    projections' row order (llama.cpp interleaves each head's rotary halves), the type
    the trained tensors are written in, and the architecture's settings."""
    from pockjax.gguf._read import hf_to_gguf_names, unpermute_rows
    from pockjax.models.hf import read_config

    import jax

    from pockjax import lowbit
    from pockjax.scheme import path_str

    config = read_config(folder)
    shapes = {}   # checkpoint name -> its shape in the file's layout ([out, in])
    for key, leaf in jax.tree_util.tree_flatten_with_path(loaded.params,
                                                          is_leaf=lowbit.is_quantized)[0]:
        path = path_str(key)
        name = loaded.checkpoint_name(path)
        if name is not None:
            shape = tuple(leaf.shape)
            shapes[name] = shape[::-1] if path in loaded.checkpoint_transposed else shape
    mapped = hf_to_gguf_names(source, config, list(shapes))
    rows = {}
    for name, shape in shapes.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else \
                config.get("num_key_value_heads", config["num_attention_heads"])
            rows[name] = unpermute_rows(shape[0], heads).tolist()
    return {"file": source.name, "names": mapped, "rows": rows, "type": gguf_type}


def export_job(model, target: str, out, *, options: FinetuneOptions | None = None,
               gpu: str | None = None, extra_flags=(), base: bool = True,
               progress: bool = True, **keywords):
    """Export `finetune`'s step for the model folder `model` to the artifact directory
    `out` (replaced atomically), with `job.json` and `model/` beside it (see the module
    docstring). The options are `finetune`'s that shape the step (`FinetuneOptions.names(
    job=True)`: `steps`, the run's length that the learning-rate schedule is built for and
    which is required, `scheme`, `batch`, `seq`, `lr`, ...), as keywords or `options`.
    Returns the `Artifact`.

    Raises:
      FinetuneError: a bad option, a model folder that does not load, a scheme that
        needs data (`search:`), a model whose parameters have no names in its folder.
      ExportError: the target, GPU family or a flag is wrong, or the step does not
        compile for the target.
    """
    from pockjax.export import export
    from pockjax.finetuning._job import check_positions, options_from
    from pockjax.finetuning._step import make_trainer, trainer_params
    from pockjax.finetuning._model import load_model, model_folder
    from pockjax.finetuning._spec import choose_scheme
    from pockjax.tokenizer import Tokenizer, TokenizerError

    o = options_from(options, keywords, name="export_job", job=True)
    scheme, steps, batch, frozen_dtype = o.scheme, o.steps, o.batch, o.frozen_dtype
    say = (lambda text: print(f"pockjax export: {text}", file=sys.stderr, flush=True)) \
        if progress else (lambda text: None)
    if steps is None:
        raise FinetuneError("give --steps N, the run's length (the learning-rate schedule is "
                            "built for it)")
    if o.lr == "auto":
        raise FinetuneError("--lr auto chooses the rate on held-out data, which export does not "
                            "read; give the rate (pockjax finetune --lr auto records the one it "
                            "chose in run.json)")
    if scheme.kind == "search":
        raise FinetuneError("--scheme search:BUDGET needs the data; choose the scheme first "
                            "(pockjax search, or pockjax finetune --scheme search:... writes it "
                            "in run.json) and export with --scheme FILE.json")
    if scheme.kind == "blockwise":
        raise FinetuneError(f"--scheme {scheme}: a schedule changes which weights train as it "
                            f"goes, and an artifact compiles one step; export one scheme")
    source = Path(model) if Path(model).is_file() else None   # a GGUF file
    model = model_folder(model)
    try:
        tokenizer = Tokenizer.from_folder(model)
    except TokenizerError as e:
        raise FinetuneError(str(e)) from None
    loaded = load_model(model, frozen_dtype=frozen_dtype, frontend=o.frontend,
                        lora=scheme.lora_rank, seed=o.seed, scheme_of=scheme.build)
    if loaded.lora and loaded.lora.get("peft"):
        raise FinetuneError(f"--scheme {scheme}: the device job of a model that runs through "
                            f"pockjax.torch ({loaded.description}) trains whole tensors or "
                            f"channels; LoRA's device job is implemented for pockjax's Flax "
                            f"models (choose paper, last:N, full or a scheme file)")
    seq = check_positions(model, o.seq)
    say(f"model {model}: {loaded.description}" + (f" ({loaded.note})" if loaded.note else ""))
    chosen = choose_scheme(loaded, scheme, frozen_dtype, say=say)
    params = trainer_params(loaded, chosen, frozen_dtype)
    trained, adapters = _trained_tensors(loaded, chosen, params)
    trainer = make_trainer(loaded, chosen, lr=o.lr, warmup=o.warmup, total=steps,
                           schedule=o.schedule, weight_decay=o.weight_decay, moments=o.moments)
    state = trainer.init(params, copy=False)
    example = {"tokens": np.zeros((batch, seq), np.int32),
               "mask": np.zeros((batch, seq), np.float32)}
    info = trainer.explain(state, example)
    say(f"scheme {scheme}: {info.trainable_params:,} of {info.total_params:,} parameters "
        f"train; {steps} steps of {batch} x {seq} tokens")

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp-job")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    art = export(trainer, state, example, target=target, out_dir=str(tmp), gpu=gpu,
                 extra_flags=tuple(extra_flags), progress=progress)
    folder = tmp / MODEL
    folder.mkdir()
    copied = [name for name in _FOLDER_FILES if (model / name).is_file()]
    origin = {name: model / name for name in copied}
    if base and source is not None:
        origin[source.name] = source
        copied.append(source.name)
    elif base:
        from pockjax.models.hf import INDEX, weight_files

        copied += [f.name for f in weight_files(model)]
        if (model / INDEX).is_file():
            copied.append(INDEX)
        origin.update({name: model / name for name in copied})
    for name in copied:
        try:  # a hard link where the file system allows: no second copy of the weights
            os.link(origin[name], folder / name)
        except OSError:
            shutil.copyfile(origin[name], folder / name)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else (tokenizer.eos_id or 0)
    job = {"format": FORMAT, "version": VERSION, "base": str(model.resolve()),
           "model_type": json.loads((model / "config.json").read_text()).get("model_type"),
           "vocab_size": loaded.vocab_size, "batch": batch, "seq": seq, "steps": steps,
           "lr": o.lr, "schedule": o.schedule, "warmup": o.warmup,
           "weight_decay": o.weight_decay, "seed": o.seed, "scheme": str(scheme),
           "scheme_json": chosen.to_json(), "frozen_dtype": frozen_dtype,
           "moments": o.moments, "frontend": loaded.kind,
           "pad_id": pad, "trainable_params": info.trainable_params,
           "total_params": info.total_params, "with_base": base, "trained": trained,
           "lora": adapters,
           "files": {f"{MODEL}/{name}": sha256(folder / name) for name in sorted(copied)}}
    if source is not None:
        job["gguf"] = _gguf_layout(loaded, model, source, o.gguf_type)
        job["base"] = str(source.resolve())
    from pockjax.checkpoint import write_atomic

    write_atomic(tmp / JOB, (json.dumps(job, indent=1) + "\n").encode())
    if out.exists():
        old = out.with_name(out.name + ".old-job")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    import dataclasses

    art = dataclasses.replace(art, path=str(out))
    say(f"exported in {time.perf_counter() - t0:.0f} s to {out}: the step, {JOB} and "
        f"{MODEL}/ ({len(copied)} files of the base folder)")
    return art
