"""`pockjax run DIR --data train.jsonl --out RUN`: a device fine-tunes with an artifact
`pockjax export --model` wrote (`pockjax.finetuning._job_export`), without JAX.

What `finetune` does with JAX, this does with the artifact's compiled step
(`pockjax.runtime`): the same JSONL formats, tokenizer, prompt masking and chat templates
(`pockjax.data`, `pockjax.tokenizer`: neither imports JAX), the same batches
(`pockjax.data.batch_at` with the job's seed), validation every `--eval-every` steps
(the artifact's `eval` function), checkpoints every `--save-every` steps in
`pockjax.save`'s format (atomic, checksummed; `--resume` after a kill continues to the
same parameters as an uninterrupted run, bit for bit), `metrics.jsonl`, and at the end
`RUN/final/`: the model folder the device was given (`DIR/model/`) with the trained
tensors replaced, in the base's dtype; every frozen tensor stays the base's bytes.
`merge_final` writes such a folder from any checkpoint.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from pockjax._src.interrupt import InterruptAfter, signal_name, stop_on_sigterm
from pockjax.finetuning._base import FinetuneError, Interrupted, NonFiniteLoss
from pockjax.finetuning._run import FINAL, RunFolder, fingerprint, run_options
from pockjax.checkpoint import numpy_dtype, safetensors_header
from pockjax.export.manifest import sha256

JOB = "job.json"
MODEL = "model"
FORMAT = "pockjax.device-job"


def read_job(artifact, check_files: bool = True) -> dict:
    """The artifact's `job.json`, its files' hashes checked.

    Raises:
      FinetuneError: the folder is not an artifact of `pockjax export --model`, or a
        file of its model folder is missing or changed.
    """
    artifact = Path(artifact)
    path = artifact / JOB
    if not path.is_file():
        what = ("an artifact of `pockjax export MODULE:ATTR` (its inputs are arrays: run "
                "it with --npz FILE)" if (artifact / "manifest.json").is_file()
                else "not an artifact directory")
        raise FinetuneError(f"'{artifact}' has no {JOB}: it is {what}; export a model folder "
                            f"with `pockjax export --model FOLDER --target ... --out DIR`")
    job = json.loads(path.read_text())
    if job.get("format") != FORMAT or job.get("version") != 1:
        raise FinetuneError(f"'{path}' is not a pockjax device job of a version this pockjax "
                            f"reads (format {job.get('format')!r}, version "
                            f"{job.get('version')!r}); export again with this pockjax")
    if check_files:
        for name, digest in job["files"].items():
            file = artifact / name
            if not file.is_file():
                raise FinetuneError(f"'{file}' is missing from the artifact; copy the whole "
                                    f"artifact directory again")
            if sha256(file) != digest:
                raise FinetuneError(f"'{file}' is not the file the artifact was exported with "
                                    f"(its sha256 differs); copy the artifact directory again")
    return job


def learning_rate(job: dict, step: int) -> float:
    """The job's learning rate at optimizer step `step` (0-based), as the artifact's
    schedule computes it: linear warm-up, then cosine or linear decay to 0, or constant."""
    lr, warmup, total = job["lr"], job["warmup"], job["steps"]
    if warmup > 0 and step < warmup:
        return lr * step / warmup
    decay, t = max(total - warmup, 1), min(max(step - warmup, 0), max(total - warmup, 1))
    if job["schedule"] == "cosine":
        return lr * 0.5 * (1 + math.cos(math.pi * t / decay))
    if job["schedule"] == "linear":
        return lr * (1 - t / decay)
    return lr


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"]
                                               .values()))]
    return [folder / "model.safetensors"]


def merge_final(artifact, values: dict[str, np.ndarray], final) -> None:
    """Write `final`: the artifact's model folder with each trained tensor taken from
    `values` (the parameters by path, `Session.param_values()` or a checkpoint's
    `params/...` tensors) in the base tensor's dtype and layout; a weight trained in
    part gets its trained channels over the base's values; LoRA kernels are merged with
    their adapters; every other tensor is the base's bytes. Written beside `final` and
    renamed into place. A job of a GGUF file writes `final.gguf` beside it too
    (`pockjax.finetuning._job_gguf`).

    Raises:
      FinetuneError: the artifact was exported without the base weights (`--no-base`).
    """
    from pockjax.checkpoint import write_safetensors

    artifact, final = Path(artifact), Path(final)
    job = read_job(artifact, check_files=False)
    model = artifact / MODEL
    if not job["with_base"]:
        raise FinetuneError(f"'{artifact}' was exported without the base model's weights "
                            f"(--no-base), so no fine-tuned folder can be written from it; "
                            f"the trained tensors are in the checkpoints")

    def trained(name, base):
        """A trained tensor in the folder's layout; `base(name)`: the base's values."""
        spec = job["trained"][name]
        value = np.asarray(values[spec["path"]], np.float32)
        if spec["channels"] is not None:  # the base's values, the trained channels over them
            axis, begin, count = spec["channels"]
            full = np.asarray(base(name), np.float32)
            full = np.array(full.T if spec["transposed"] else full)
            index = [slice(None)] * full.ndim
            index[axis] = slice(begin, begin + count)
            full[tuple(index)] = value
            value = full
        return value.T if spec["transposed"] else value

    def merged(name, base):
        """A LoRA kernel merged with its adapters, in the folder's layout."""
        spec = job["lora"][name]
        if spec["kernel"] in values:
            kernel = np.asarray(values[spec["kernel"]], np.float32)
        else:  # a state without the frozen weights: the base's kernel
            kernel = np.asarray(base(name), np.float32)
            kernel = kernel.T if spec["transposed"] else kernel
        a, b = (np.asarray(values[spec[k]], np.float32) for k in ("a", "b"))
        value = kernel + spec["scale"] * (a @ b)
        return value.T if spec["transposed"] else value

    if job.get("gguf"):
        from pockjax.finetuning._job_gguf import merge_final_gguf

        merge_final_gguf(artifact, job, values, final, trained, merged)
        return
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = _weight_files(model)
    for f in model.iterdir():
        if f not in weights:
            shutil.copyfile(f, tmp / f.name)

    def base_array(file, t, start):
        a, b = t["data_offsets"]
        with open(file, "rb") as fh:
            fh.seek(start + a)
            return np.frombuffer(fh.read(b - a), numpy_dtype(t["dtype"])).reshape(t["shape"])

    for file in weights:
        header, start = safetensors_header(file)
        entries = []
        for name, t in header.items():
            dtype = numpy_dtype(t["dtype"])
            base = lambda _, t=t: base_array(file, t, start)  # noqa: E731
            if name in job["trained"]:
                get = (lambda n=name, b=base, d=dtype:
                       np.ascontiguousarray(trained(n, b).astype(d)))
            elif name in job["lora"]:
                get = (lambda n=name, b=base, d=dtype:
                       np.ascontiguousarray(merged(n, b).astype(d)))
            else:
                get = lambda t=t: base_array(file, t, start)  # noqa: E731
            entries.append((name, tuple(t["shape"]), dtype, get))
        write_safetensors(tmp / file.name, entries, {"format": "pt"})
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def run_job(artifact, data, out, *, valid=None, steps: int | None = None,
            epochs: float | None = None, eval_every: int | None = None,
            save_every: int | None = None, keep: int = 3, resume: bool = False,
            overwrite: bool = False, device: str = "local-task", session=None,
            progress: bool = True) -> dict:
    """Fine-tune on the device with the artifact `artifact` (see the module docstring).
    `session` is an open `pockjax.runtime` session of it (default: `runtime.load(artifact,
    device)`). Returns a summary: steps, start step, losses, seconds, tokens/s, final.

    Raises:
      FinetuneError: a bad option, an artifact that is not a device job, data that does
        not read (the message names the file and line), an occupied `out`.
      NonFiniteLoss: the loss became NaN or infinite (the last checkpoint stays).
      Interrupted: Ctrl-C; the last completed step was saved.
    """
    from pockjax.data import (DataError, batch_at, batch_examples, eval_batches, read_jsonl,
                              steps_per_epoch)
    from pockjax.tokenizer import Tokenizer, TokenizerError

    def say(text):
        if progress:
            print(f"pockjax run: {text}", file=sys.stderr, flush=True)

    artifact, out = Path(artifact), Path(out)
    if steps is not None and epochs is not None:
        raise FinetuneError("give --steps or --epochs, not both")
    for name, value in (("steps", steps), ("eval-every", eval_every),
                        ("save-every", save_every), ("keep", keep)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise FinetuneError(f"--{name} must be a positive whole number, got {value!r}")
    if resume and overwrite:
        raise FinetuneError("give --resume or --overwrite, not both")
    job = read_job(artifact)
    if job.get("gguf") and job["with_base"]:
        import importlib.util
        if importlib.util.find_spec("gguf") is None:
            raise FinetuneError(f"'{artifact}' was exported from the GGUF file "
                                f"{job['gguf']['file']}, and its final.gguf is written with "
                                f"the gguf package: pip install gguf")
    RunFolder.check(out, resume=resume, overwrite=overwrite)
    try:
        tokenizer = Tokenizer.from_folder(artifact / MODEL)
        train = read_jsonl(data, tokenizer, job["seq"], vocab_size=job["vocab_size"])
        held = None if valid is None else read_jsonl(valid, tokenizer, job["seq"],
                                                     vocab_size=job["vocab_size"])
    except (DataError, TokenizerError, ValueError) as e:
        raise FinetuneError(str(e)) from None
    batch, seq, seed, pad = job["batch"], job["seq"], job["seed"], job["pad_id"]
    per_epoch = steps_per_epoch(len(train), batch)
    total = steps if steps is not None else (
        max(1, math.ceil(epochs * per_epoch)) if epochs is not None else job["steps"])
    if total > job["steps"]:
        raise FinetuneError(f"{total} steps asked for, and the artifact's learning-rate "
                            f"schedule was built for {job['steps']}; export again with "
                            f"--steps {total}, or run at most {job['steps']}")
    options = run_options(model=str(artifact.resolve()), data=fingerprint(data),
                          scheme=job["scheme_json"], total_steps=job["steps"], batch=batch,
                          seq=seq, lr=job["lr"], warmup=job["warmup"], schedule=job["schedule"],
                          seed=seed, frozen_dtype=job["frozen_dtype"], skip_nonfinite=False,
                          weight_decay=job["weight_decay"], frontend=job["frontend"],
                          moments=job["moments"], logits="all")  # the artifact's step
    for line in [train.describe(), *([held.describe()] if held is not None else [])]:
        say(line)
    if session is None:
        from pockjax import runtime

        session = runtime.load(str(artifact), device=device)
    run = RunFolder(out, options, resume=resume, overwrite=overwrite)
    start = 0
    if resume:
        from pockjax.checkpoint import CheckpointError

        for step_no, path in reversed(run.checkpoints()):
            try:
                session.restore(str(path))
            except CheckpointError as e:
                say(f"skipping checkpoint {path.name}: {e}")
                continue
            start = session.step_count
            say(f"resumed from {path.name} (step {start} of {total})")
            break
        run.trim_log(start)
    say(f"{job['trainable_params']:,} of {job['total_params']:,} parameters train "
        f"(scheme {job['scheme']}); steps {start + 1}-{total} of {batch} x {seq} tokens "
        f"({per_epoch} per epoch)")

    def evaluate(at: int, began: float | None) -> float:
        total_nll = count = 0.0
        for b in eval_batches(held, batch, seq, pad):
            n = float(b["mask"][:, 1:].sum())
            total_nll += float(session.evaluate(b)) * n
            count += n
        value = total_nll / max(count, 1.0)
        seconds = 0.0 if began is None else round(time.perf_counter() - began, 3)
        run.log({"step": at, "valid_loss": value, "valid_ppl": math.exp(min(value, 700)),
                 "seconds": seconds})
        say(f"step {at}: valid loss {value:.4f}")
        return value

    def save():
        run.out.joinpath("checkpoints").mkdir(exist_ok=True)
        path = run.out / "checkpoints" / f"step-{session.step_count:08d}.safetensors"
        session.save(str(path))
        for _, old in run.checkpoints()[:-keep]:
            old.unlink(missing_ok=True)

    try:
        from tqdm.auto import tqdm
        bar = tqdm(total=total, initial=start, disable=not progress, unit="step", desc="run",
                   dynamic_ncols=True)
    except ImportError:  # tqdm is optional on a device: plain lines instead
        bar = None
    valid_before = evaluate(0, None) if held is not None and start == 0 else None
    losses, tokens, began = [], 0, time.perf_counter()
    step = saved_at = start
    with stop_on_sigterm():  # a scheduler's SIGTERM saves as Ctrl-C does
        try:
            while step < total:
                b = batch_at(train, step, batch, seq, seed=seed, pad_id=pad)
                ntok = sum(len(e.ids) for e in batch_examples(train, step, batch, seed=seed))
                with InterruptAfter():  # a signal waits for the step, its record and its save
                    loss = float(session.step(b)["loss"])
                    step += 1
                    if not math.isfinite(loss):
                        kept = run.checkpoints()
                        where = (f"the last checkpoint, {kept[-1][1]}, is from step {kept[-1][0]}"
                                 if kept else "no checkpoint was written")
                        raise NonFiniteLoss(step, loss, f"step {step}: the loss is {loss}; the run "
                                            f"stopped and {where}. Export again with a lower --lr "
                                            f"({job['lr']:g}) or more --warmup")
                    losses.append(loss)
                    tokens += ntok
                    seconds = round(time.perf_counter() - began, 3)
                    run.log({"step": step, "loss": loss, "lr": learning_rate(job, step - 1),
                             "tokens": ntok, "seconds": seconds})
                    if bar is not None:
                        bar.update(1)
                        rate = tokens / max(seconds, 1e-9)
                        bar.set_postfix_str(f"loss {loss:.4g}, {rate:,.0f} tok/s", refresh=False)
                    elif progress and (step % 10 == 0 or step == total):
                        say(f"step {step}/{total}: loss {loss:.4f}")
                    if (save_every and step % save_every == 0) or step == total:
                        save()
                        saved_at = step
                if held is not None and eval_every and step % eval_every == 0 and step < total:
                    evaluate(step, began)
        except KeyboardInterrupt as e:
            if bar is not None:
                bar.close()
            by = signal_name(e)
            if step > start:
                saving = time.perf_counter()
                if saved_at < step:
                    save()
                raise Interrupted(f"stopped by {by} at step {step} of {total}; saved it in "
                                  f"{time.perf_counter() - saving:.1f} s; continue with --resume",
                                  by) from None
            raise Interrupted(f"stopped by {by} before step {start + 1} completed; nothing was "
                              f"saved", by) from None
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - began
    valid_after = evaluate(step, began) if held is not None else None
    final = run.out / FINAL
    if job["with_base"]:
        merge_final(artifact, session.param_values(lazy=True), final)
        say(f"done: {step - start} steps in {seconds:.1f} s "
            f"({tokens / max(seconds, 1e-9):,.0f} tokens/s), model in {final}")
    else:
        say(f"done: {step - start} steps in {seconds:.1f} s; the artifact holds no base "
            f"weights (--no-base), so the trained state is in {run.out / 'checkpoints'}")
    return {"out": str(run.out), "final": str(final) if job["with_base"] else None,
            "steps": step, "start_step": start, "losses": losses, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else float("nan"),
            "valid_loss_before": valid_before, "valid_loss": valid_after}


# --------------------------------------------------------------------------- no Python


SCRIPT = "train.sh"


def write_batches(artifact, data, folder, *, steps: int | None = None,
                  device: str = "local-task") -> Path:
    """For a device with IREE's C runtime only (`iree-run-module`, no Python): the job's
    batches as `.npy` files and `train.sh`, a POSIX shell script that runs the whole
    loop with the tool: `init` writes the initial state, each `train_step` reads the
    state files and one batch and writes the next state and the loss. `merge_state`
    then turns the last state files into the fine-tuned model folder. The batches are
    `pockjax run`'s (the job's seed and order), so the parameters are the same.

        FOLDER/batches/00001_0.npy ...   the step's inputs, in the step's order
        FOLDER/train.sh                  IREE_RUN_MODULE=... sh FOLDER/train.sh
        FOLDER/state/                    written by the script: the last state, the losses

    Returns the script's path.
    """
    from pockjax.data import batch_at, read_jsonl
    from pockjax.export.manifest import PARAMS, VMFB, read_manifest
    from pockjax.tokenizer import Tokenizer

    artifact, folder = Path(artifact).resolve(), Path(folder)
    job = read_job(artifact)
    manifest = read_manifest(str(artifact), hashes=False)
    total = steps or job["steps"]
    if total > job["steps"]:
        raise FinetuneError(f"{total} steps asked for, and the artifact's learning-rate "
                            f"schedule was built for {job['steps']}")
    try:
        tokenizer = Tokenizer.from_folder(artifact / MODEL)
        train = read_jsonl(data, tokenizer, job["seq"], vocab_size=job["vocab_size"])
    except Exception as e:
        raise FinetuneError(str(e)) from None
    inputs = [s["name"] for s in manifest["functions"]["train_step"]["inputs"]]
    (folder / "batches").mkdir(parents=True, exist_ok=True)
    for step in range(total):
        b = batch_at(train, step, job["batch"], job["seq"], seed=job["seed"],
                     pad_id=job["pad_id"])
        for i, name in enumerate(inputs):
            np.save(folder / "batches" / f"{step + 1:05d}_{i}.npy", b[name])
    n_state = len(manifest["functions"]["train_step"]["state"])
    n_out = len(manifest["functions"]["train_step"]["outputs"])
    module = f"--module={artifact / VMFB}"
    params = f"--parameters={manifest['parameter_scope']}={artifact / PARAMS}"
    lines = [
        "#!/bin/sh",
        f"# Fine-tunes with {artifact} using iree-run-module alone: {total} steps of the",
        "# batches beside this script (written by `pockjax run --write-batches`). Set",
        "# IREE_RUN_MODULE to the tool's command (default: iree-run-module on the PATH) and",
        f"# IREE_DEVICE to its device (default {device}). Afterwards:",
        f"#   pockjax merge {artifact} --state \"$(dirname \"$0\")/state\" --out final",
        "set -e",
        'HERE=$(cd "$(dirname "$0")" && pwd)',
        'TOOL=${IREE_RUN_MODULE:-iree-run-module}',
        f'DEVICE=${{IREE_DEVICE:-{device}}}',
        'mkdir -p "$HERE/state"',
        f'$TOOL --device=$DEVICE {module} {params} --function=init '
        + " ".join(f'--output=@"$HERE/state/a_{i}.npy"' for i in range(n_state)) + " > /dev/null",
        "step=1",
        f"while [ $step -le {total} ]; do",
        '  s=$(printf "%05d" $step)',
        f'  $TOOL --device=$DEVICE {module} {params} --function=train_step '
        + " ".join(f'--input=@"$HERE/state/a_{i}.npy"' for i in range(n_state)) + " "
        + " ".join(f'--input=@"$HERE/batches/${{s}}_{i}.npy"' for i in range(len(inputs))) + " "
        + " ".join(f'--output=@"$HERE/state/b_{i}.npy"' for i in range(n_state)) + " "
        + " ".join(f'--output=@"$HERE/state/out_${{s}}_{i}.npy"' for i in range(n_out))
        + " > /dev/null",
        f"  for i in $(seq 0 {n_state - 1}); do mv \"$HERE/state/b_$i.npy\" \"$HERE/state/a_$i.npy\"; done",
        '  echo "step $step done"',
        "  step=$((step + 1))",
        "done",
    ]
    script = folder / SCRIPT
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def merge_checkpoint(artifact, checkpoint, out) -> None:
    """`final`-style model folder `out` from a checkpoint `pockjax run` (or
    `Session.save`) wrote mid-run: the artifact's model folder with its trained tensors
    taken from the checkpoint (see `merge_final`)."""
    from pockjax.checkpoint import read

    tensors, _ = read(checkpoint)
    values = {k[len("params/"):]: v for k, v in tensors.items() if k.startswith("params/")}
    merge_final(artifact, values, out)


def merge_state(artifact, state, out) -> None:
    """The model folder `out` from the state files `train.sh` left in `state`
    (`a_<i>.npy`, in the step's state order; see `write_batches`)."""
    from pockjax.export.manifest import read_manifest

    manifest = read_manifest(str(artifact), hashes=False)
    names = manifest["functions"]["train_step"]["state"]
    state = Path(state)
    missing = [f"a_{i}.npy" for i in range(len(names)) if not (state / f"a_{i}.npy").is_file()]
    if missing:
        raise FinetuneError(f"'{state}' lacks {', '.join(missing[:4])}: give the state folder "
                            f"train.sh wrote")
    values = {n[len("params/"):]: np.load(state / f"a_{i}.npy") for i, n in enumerate(names)
              if n.startswith("params/")}
    merge_final(artifact, values, out)
