"""`pockjax targets | export | inspect | run | merge | search | finetune | generate`.

`pockjax export MODULE:ATTR --target NAME --out DIR` imports MODULE (a dotted module
name, or a path to a .py file) and reads ATTR from it. ATTR is either a function
taking no arguments that returns `(trainer, state, batch)`, or such a tuple itself:
the trainer made with `@pockjax.sparse_train`, its initial `TrainState`, and an
example batch with the shapes to compile for (see examples/export_mlp.py); or
`(nnx_trainer, batch)` with a `pockjax.nnx.Trainer`; or a dict with a PyTorch `model`
(a `torch.nn.Module`), `loss_fn(apply, params, batch)`, `optimizer`, `scheme`, `batch`
and optionally `output` (see `pockjax.torch.trainer`). `--scheme FILE.json` (from
`pockjax search`) replaces the trainer's scheme.

`pockjax search MODULE:ATTR --budget 40% --out scheme.json` reads ATTR the same
way. It must give `(trainer_factory, params, data)`, as `pockjax.search_scheme` takes them,
or a dict with `model` (an `nnx.Module`), `loss_fn`, `optimizer` and `data`, as
`pockjax.nnx.search_scheme` takes them. `data` is `(train_batches, heldout_batches)`.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import time

import numpy as np

from pockjax.export.targets import TARGETS, ExportError


class _Interrupted(Exception):
    """Ctrl-C during a command; the message says what it left behind."""


# Module -> the distribution to install, for what `export` and `search` need beyond
# the runtime-only install.
_FULL_INSTALL = {"jax": "jax", "jaxlib": "jaxlib", "optax": "optax", "flax": "flax"}
_COMPILER = {"iree.compiler": "iree-base-compiler"}


def _require_full_install(cmd: str, what: str, modules: dict[str, str], extra: str = "") -> None:
    """Stop with the fix when the packages `cmd` needs are missing (a runtime-only
    install), before the user's module is imported and fails on them."""
    missing = []
    for module, dist in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package (iree) is missing
            found = False
        if not found:
            missing.append(dist)
    if missing:
        raise SystemExit(
            f"pockjax {cmd}: {what} needs the full install, and {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not installed here (a runtime-only install "
            "runs artifacts with `pockjax run` and `pockjax inspect`). Install it with: pip "
            f"install 'pockjax{extra}' (from a checkout: pip install '.{extra}')")


def _load_attr(spec: str, cmd: str):
    """The object MODULE:ATTR names, called if it is a function."""
    if ":" not in spec:
        raise SystemExit(f"pockjax {cmd}: expected MODULE:ATTR (e.g. examples/export_mlp.py:make), "
                         f"got {spec!r}")
    module_name, attr = spec.rsplit(":", 1)
    if module_name.endswith(".py") or os.sep in module_name:
        if not os.path.isfile(module_name):
            raise SystemExit(f"pockjax {cmd}: file '{module_name}' does not exist")
        spec_obj = importlib.util.spec_from_file_location(f"_pockjax_{cmd}_target", module_name)
        module = importlib.util.module_from_spec(spec_obj)
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        spec_obj.loader.exec_module(module)
    else:
        sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"pockjax {cmd}: '{module_name}' has no attribute {attr!r}")
    obj = getattr(module, attr)
    return obj() if callable(obj) else obj


def _load_spec(spec: str):
    obj = _load_attr(spec, "export")
    from pockjax.nnx import Trainer

    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], Trainer):
        nnx_trainer, batch = obj
        return nnx_trainer.sparse, nnx_trainer.state, nnx_trainer.step_batch(batch)
    if isinstance(obj, dict) and _is_torch_module(obj.get("model")):
        missing = sorted({"loss_fn", "optimizer", "batch"} - set(obj))
        if missing:
            raise SystemExit(f"pockjax export: {spec} gives a torch model; the dict also needs "
                             f"{missing} (loss_fn(apply, params, batch), see pockjax.torch.trainer)")
        from pockjax.torch import trainer

        t, state = trainer(obj["model"], obj["loss_fn"], optimizer=obj["optimizer"],
                           scheme=obj.get("scheme"), output=obj.get("output"))
        return t, state, obj["batch"]
    if not (isinstance(obj, tuple) and len(obj) == 3):
        raise SystemExit(f"pockjax export: {spec} must give (trainer, state, batch), "
                         f"(pockjax.nnx.Trainer, batch) or a dict with a torch 'model', "
                         f"'loss_fn', 'optimizer', 'scheme' and 'batch'; got {type(obj).__name__}")
    return obj


def _is_torch_module(obj) -> bool:
    torch = sys.modules.get("torch")  # a torch model means torch is imported already
    return torch is not None and isinstance(obj, torch.nn.Module)


def _read_scheme(path: str):
    from pockjax.scheme import Scheme, SchemeError

    try:
        with open(path) as f:
            return Scheme.from_json(f.read())
    except OSError as e:
        raise SystemExit(f"cannot read scheme file '{path}': {e.strerror}") from None
    except SchemeError as e:
        raise SystemExit(f"scheme file '{path}': {e}") from None


def cmd_targets(args) -> int:
    """`pockjax targets`: print every export target with its compiler flags and GPU
    families; returns exit status 0."""
    width = max(len(n) for n in TARGETS)
    for name, t in TARGETS.items():
        print(f"{name.ljust(width)}  {t.description}")
        flags = list(t.flags) + ([f"{t.gpu_flag}={t.default_gpu}"] if t.gpu_flag else [])
        print(f"{' ' * width}  flags: {' '.join(flags)}")
        if t.local_device:
            print(f"{' ' * width}  plus a #hal.device.target built from the local Vulkan "
                  "device's capabilities")
        if t.gpus:
            print(f"{' ' * width}  --gpu: {', '.join(t.gpus)} (default {t.default_gpu})")
    return 0


def cmd_export(args) -> int:
    """`pockjax export`: compile the step `args.spec` names into the artifact directory
    `args.out`; returns exit status 0 (errors propagate to `main`)."""
    _require_full_install("export", "exporting", {**_FULL_INSTALL, **_COMPILER}, "[export]")
    if (args.spec is None) == (args.model is None):
        raise SystemExit("pockjax export: give MODULE:ATTR or --model FOLDER (one of them)")
    if args.model is not None:
        return _export_job(args)
    try:
        from pockjax.export import export

        print(f"loading {args.spec}", file=sys.stderr, flush=True)
        trainer, state, batch = _load_spec(args.spec)
        if args.scheme:
            scheme = _read_scheme(args.scheme)
            trainer = trainer.replace(scheme=scheme)
            state = trainer.init(state.params)
            print(f"scheme from {args.scheme}: {scheme!r}")
        t0 = time.perf_counter()
        art = export(trainer, state, batch, target=args.target, out_dir=args.out, gpu=args.gpu,
                     extra_flags=tuple(args.flag or ()), progress=True)
    except KeyboardInterrupt:
        kept = (f"'{args.out}' is as it was" if os.path.exists(args.out)
                else f"no '{args.out}' was made")
        raise _Interrupted(f"nothing was written ({kept})") from None
    files = art.manifest["files"]
    print(f"exported {args.spec} for {args.target} to {art.path} in {time.perf_counter() - t0:.1f} s "
          "(" + ", ".join(f"{k} {v['bytes']:,} B" for k, v in files.items()) + ")")
    return 0


def _export_job(args) -> int:
    """`pockjax export --model FOLDER`: finetune's step and the device job's files."""
    from pockjax.finetuning import FinetuneError, FinetuneOptions
    from pockjax.finetuning._job_export import export_job

    try:
        options = FinetuneOptions.from_args(args, job=True, scheme=args.scheme or "paper")
        art = export_job(args.model, args.target, args.out, options=options, gpu=args.gpu,
                         extra_flags=tuple(args.flag or ()), base=args.base)
    except KeyboardInterrupt:
        raise _Interrupted(f"nothing was written ('{args.out}' is as it was)") from None
    except FinetuneError as e:
        print(f"pockjax export: {e}", file=sys.stderr)
        return 1
    print(f"exported {args.model} for {args.target} to {art.path}; on the device: pockjax "
          f"run {art.path} --data train.jsonl --out RUN")
    return 0


def cmd_inspect(args) -> int:
    """`pockjax inspect`: print the manifest of artifact `args.dir` (target, signature,
    memory, parameters, files); returns exit status 0."""
    # Not pockjax.export.artifact, which imports JAX: inspect runs in the runtime-only install.
    from pockjax.measure import format_bytes
    from pockjax.export.manifest import read_manifest

    m = read_manifest(args.dir)
    t = m["target"]
    print(f"artifact: {os.path.abspath(args.dir)}")
    print(f"target:   {t['name']} ({t['backend']}, runs on {t['driver']})"
          + (f", gpu {t['gpu']}" if t.get("gpu") else ""))
    print(f"flags:    {' '.join(t['flags'])}")
    if t.get("gpu_target"):
        from pockjax.export.vulkan import parse_target

        g = parse_target(t["gpu_target"])
        print(f"gpu:      {g.arch}, subgroup ops {'|'.join(sorted(g.subgroup_ops)) or 'none'}, "
              f"sizes {list(g.subgroup_size_choices)}, compute {'|'.join(sorted(g.compute))}"
              + (f" (built for device '{t['device']['name']}')" if t.get("device") else ""))
    print("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    print(f"update:   {m['update_mode']}")
    fn = m["functions"]["train_step"]
    n = len(fn["state"])
    print(f"train_step(state[{n}], " + ", ".join(f"{s['name']}: {s['dtype']}{s['shape']}"
                                                for s in fn["inputs"])
          + f") -> (state[{n}], " + ", ".join(fn["outputs"]) + ")")
    print("          the state (step, trainable parameters, optimizer state) is donated and "
          "updated in place")
    mem = m["memory"]
    print(f"memory:   state and batch {format_bytes(mem['input_bytes'])}, the step allocates at most "
          f"{format_bytes(mem['peak_alloc_bytes'])} more, {mem['submissions']} submission(s) per step"
          + ("; trained weights' reads tied to their matmuls" if mem.get("tied_weight_reads")
             else ""))
    roles: dict[str, list] = {}
    for p in m["parameters"]:
        roles.setdefault(p["role"], []).append(p)
    for role, ps in roles.items():
        n = sum(int(np.prod(p["shape"])) for p in ps)
        print(f"{role}: {len(ps)} tensors, {n:,} values")
        for p in ps:
            print(f"  {p['name']}: {p['dtype']}{p['shape']}")
    for name, f in m["files"].items():
        print(f"file {name}: {f['bytes']:,} B sha256 {f['sha256'][:16]}...")
    return 0


def _signature(inputs) -> str:
    return ", ".join(f"{s['name']}: {s['dtype']}{list(s['shape'])}" for s in inputs)


def _read_data(path: str, inputs, artifact: str) -> dict[str, np.ndarray]:
    """The arrays of `--data`, one per step input and named after it."""
    names = [s["name"] for s in inputs]
    npz = path if path.endswith(".npz") else "batch.npz"
    example = (", ".join(f"{n}=..." for n in names) if all(n.isidentifier() for n in names)
               else "**{" + ", ".join(f"'{n}': ..." for n in names) + "}")
    how = (f"the step's inputs are {_signature(inputs)} (`pockjax inspect {artifact}` lists "
           f"them); save one array per input under its name, e.g. np.savez('{npz}', {example}), "
           "each optionally with a leading axis of one batch per step")
    try:
        data = np.load(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"pockjax run: cannot read --data '{path}' ({e}); {how}") from None
    if not isinstance(data, np.lib.npyio.NpzFile):
        raise SystemExit(f"pockjax run: --data '{path}' holds a single array, not an .npz of "
                         f"named arrays; {how}")
    missing = [n for n in names if n not in data.files]
    unknown = [n for n in data.files if n not in names]
    if missing or unknown:
        found = ", ".join(f"{n}: {data[n].dtype}{list(data[n].shape)}" for n in data.files)
        problems = []
        if missing:
            problems.append(f"no array named {', '.join(map(repr, missing))}")
        if unknown:
            problems.append(", ".join(map(repr, unknown))
                            + (" is not an input" if len(unknown) == 1 else " are not inputs"))
        raise SystemExit(f"pockjax run: --data '{path}' does not match the step: "
                         f"{'; '.join(problems)} "
                         f"(it has {found or 'no arrays'}); {how}")
    return {n: data[n] for n in names}


def _batches(manifest, data_path, steps, artifact):
    inputs = manifest["functions"]["train_step"]["inputs"]
    if data_path:
        arrays = _read_data(data_path, inputs, artifact)
        stacked = all(a.ndim == len(s["shape"]) + 1 for s, a in zip(inputs, arrays.values()))
        for i in range(steps):
            if stacked:
                yield {k: a[i % a.shape[0]] for k, a in arrays.items()}
            else:
                yield arrays
    else:
        rng = np.random.default_rng(0)
        batch = {}
        for s in inputs:
            dtype = np.dtype(s["dtype"]) if s["dtype"] != "bfloat16" else None
            if dtype is not None and np.issubdtype(dtype, np.floating):
                batch[s["name"]] = rng.standard_normal(s["shape"]).astype(dtype)
            else:
                raise SystemExit(f"pockjax run: input '{s['name']}' is {s['dtype']}, and only float "
                                 "inputs can be made up; pass --data FILE.npz with one array per "
                                 f"input, named after it ({_signature(inputs)})")
        for _ in range(steps):
            yield batch


def cmd_run(args) -> int:
    """`pockjax run`: with an artifact of `export --model` and JSONL data, the device's
    fine-tuning job (`pockjax.finetuning._job_run`); otherwise run `args.steps` training steps of
    artifact `args.dir`, printing each loss, and save a checkpoint with `--save`; returns
    the exit status."""
    from pockjax import runtime

    data = args.data or ""
    if os.path.isfile(os.path.join(args.dir, "job.json")):
        arrays = data.endswith(".npz")
    else:  # arrays, unless the options are the job's (then read_job says what this is)
        arrays = not (data.endswith(".jsonl") or args.out or args.valid or args.epochs
                      or args.resume or args.write_batches)
    if not arrays:
        return _run_job(args)
    if args.steps is None:
        args.steps = 3

    if args.qemu_arm64 or args.tool:
        import shlex

        command = runtime.qemu_arm64(args.qemu_arm64) if args.qemu_arm64 else shlex.split(args.tool)
        sess = runtime.ToolSession(args.dir, command, device=args.device)
    else:
        sess = runtime.load(args.dir, device=args.device)
    done = 0
    try:
        for i, batch in enumerate(_batches(sess.manifest, args.data, args.steps, args.dir)):
            t0 = time.perf_counter()
            metrics = sess.step(batch)
            ms = (time.perf_counter() - t0) * 1e3
            print(f"step {i + 1}: loss {float(metrics['loss']):.6g} ({ms:.1f} ms)")
            done = i + 1
    except KeyboardInterrupt:
        saved = (f"; the trained state was not saved to '{args.save}' (--save writes it "
                 "after the last step)" if args.save else "")
        raise _Interrupted(f"{done} of {args.steps} steps ran; the artifact's files are "
                           f"unchanged{saved}") from None
    if args.save:
        sess.save(args.save)
        print(f"saved {args.save}")
    return 0


def _run_job(args) -> int:
    """`pockjax run DIR --data train.jsonl --out RUN`: the device's fine-tuning job."""
    from pockjax import runtime
    from pockjax.finetuning._base import FinetuneError, Interrupted
    from pockjax.finetuning._job_run import run_job

    if args.write_batches:
        from pockjax.finetuning._job_run import write_batches

        if not args.data:
            raise SystemExit("pockjax run --write-batches: give --data train.jsonl")
        try:
            script = write_batches(args.dir, args.data, args.write_batches, steps=args.steps,
                                   device=args.device)
        except FinetuneError as e:
            print(f"pockjax run: {e}", file=sys.stderr)
            return 1
        print(f"wrote the batches and {script}: on the device, IREE_RUN_MODULE=... sh {script}; "
              f"then pockjax merge {args.dir} --state {os.path.join(args.write_batches, 'state')}"
              f" --out final")
        return 0
    if not args.data or not args.out:
        raise SystemExit(f"pockjax run: '{args.dir}' is a fine-tuning job; give --data "
                         f"train.jsonl and --out RUN (and --valid valid.jsonl)")
    session = None
    try:
        if args.qemu_arm64 or args.tool:
            import shlex

            command = runtime.qemu_arm64(args.qemu_arm64) if args.qemu_arm64 else \
                shlex.split(args.tool)
            session = runtime.ToolSession(args.dir, command, device=args.device)
        result = run_job(args.dir, args.data, args.out, valid=args.valid, steps=args.steps,
                         epochs=args.epochs, eval_every=args.eval_every,
                         save_every=args.save_every, keep=args.keep, resume=args.resume,
                         overwrite=args.overwrite, device=args.device, session=session)
    except Interrupted as e:
        print(f"pockjax run: {e}", file=sys.stderr)
        return e.exit_status
    except FinetuneError as e:
        print(f"pockjax run: {e}", file=sys.stderr)
        return 1
    except runtime.DeviceLost as e:
        print(f"pockjax run: the {args.device!r} device was lost ({e.driver_message}); the "
              f"checkpoints in '{args.out}' are intact: run the same command with --resume "
              f"to continue from the last one", file=sys.stderr)
        return 2
    valid = (f", validation loss {result['valid_loss']:.4f}" if result["valid_loss"] is not None
             else "")
    where = result["final"] or os.path.join(result["out"], "checkpoints")
    print(f"fine-tuned on the device: {where} ({result['steps']} steps{valid})")
    return 0


def cmd_merge(args) -> int:
    """`pockjax merge`: the fine-tuned model folder from a device job's checkpoint or
    state files."""
    from pockjax.finetuning._base import FinetuneError
    from pockjax.finetuning._job_run import merge_checkpoint, merge_state
    from pockjax.checkpoint import CheckpointError

    try:
        if args.checkpoint:
            merge_checkpoint(args.dir, args.checkpoint, args.out)
        else:
            merge_state(args.dir, args.state, args.out)
    except (FinetuneError, CheckpointError) as e:
        print(f"pockjax merge: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


def cmd_search(args) -> int:
    """`pockjax search`: choose a scheme under the budget for the model `args.spec` names
    and write it to `args.out`; returns exit status 0, or 2 for a budget out of range or
    data too short."""
    _require_full_install("search", "the scheme search", _FULL_INSTALL)
    written: list[str] = []
    try:
        return _search(args, written)
    except KeyboardInterrupt:
        if written:
            note = f"wrote {', '.join(written)} before that"
        elif args.cache:
            note = (f"nothing was written to '{args.out}'; the candidates measured so far are "
                    f"kept in '{args.cache}', and the same command resumes from them")
        else:
            note = ("nothing was written (with --cache DIR the candidates measured so far are "
                    "kept, and the same command resumes from them)")
        raise _Interrupted(note) from None


def _search(args, written: list[str]) -> int:
    import pockjax as pj
    from pockjax.checkpoint import write_atomic

    obj = _load_attr(args.spec, "search")
    common = dict(budget=args.budget, steps=args.steps, cache=args.cache,
                  flop_budget=args.flop_budget * 1e9 if args.flop_budget else None)
    try:
        if isinstance(obj, dict):
            missing = {"model", "loss_fn", "optimizer", "data"} - set(obj)
            if missing:
                raise SystemExit(f"pockjax search: {args.spec} gave a dict without {sorted(missing)}; "
                                 "it needs model, loss_fn, optimizer and data")
            extra = {k: v for k, v in obj.items() if k not in ("model", "loss_fn", "optimizer", "data")}
            scheme, report = pj.nnx.search_scheme(obj["model"], obj["loss_fn"],
                                                  optimizer=obj["optimizer"], data=obj["data"],
                                                  **extra, **common)
        elif isinstance(obj, tuple) and len(obj) == 3:
            factory, params, data = obj
            scheme, report = pj.search_scheme(factory, params, data, **common)
        else:
            raise SystemExit(f"pockjax search: {args.spec} must give (trainer_factory, params, data) "
                             f"or a dict with model, loss_fn, optimizer and data; got "
                             f"{type(obj).__name__}")
    except ValueError as err:  # budgets out of range, data too short
        print(f"pockjax search: {err}", file=sys.stderr)
        return 2
    print(report)
    write_atomic(args.out, (scheme.to_json(indent=1) + "\n").encode())
    written.append(args.out)
    print(f"\nscheme: {args.out}")
    if args.report:
        report.save(args.report)
        written.append(args.report)
        print(f"report: {args.report}")
    if args.plot:
        report.plot(args.plot)
        written.append(args.plot)
        print(f"plot:   {args.plot}")
    return 0


def main(argv=None) -> int:
    """Parse the command line (`argv`, default `sys.argv[1:]`) and run the command.

    Returns the command's exit status; for `targets`, `export`, `inspect`, `run` and
    `search`, 2 when the command raised `ExportError`, 130 after Ctrl-C, 143 after SIGTERM
    (`finetune` and `generate` return `pockjax.finetuning`'s status).
    """
    from pockjax import finetuning
    from pockjax._src.malloc import choice

    try:
        choice()  # a mistyped POCKJAX_MALLOC stops the command before any work
    except ValueError as e:
        raise SystemExit(f"pockjax: {e}") from None

    ap = argparse.ArgumentParser(prog="pockjax", description="Sparse on-device training with JAX and IREE")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("targets", help="list export targets and their IREE flags")
    e = sub.add_parser("export", help="compile a training step into an artifact directory",
                       description=__doc__.split("\n\n")[1])
    e.add_argument("spec", metavar="MODULE:ATTR", nargs="?",
                   help="a module giving (trainer, state, batch); or --model FOLDER")
    e.add_argument("--model", help="a Hugging Face model folder: export `pockjax finetune`'s "
                                   "step for it, with what a device needs to fine-tune "
                                   "(`pockjax run DIR --data train.jsonl --out RUN`)")
    e.add_argument("--target", default="host-cpu", choices=list(TARGETS))
    e.add_argument("--out", required=True, help="artifact directory (replaced atomically)")
    e.add_argument("--gpu", help="GPU family for GPU targets (e.g. valhall, adreno, sm_87)")
    e.add_argument("--flag", action="append", help="extra IREE compiler flag (repeatable)")
    e.add_argument("--scheme", help="with MODULE:ATTR: train this scheme (JSON from `pockjax "
                                    "search` or Scheme.to_json) instead of the trainer's; with "
                                    "--model: as finetune's --scheme (default paper)")
    job = e.add_argument_group("with --model: finetune's options (see `pockjax finetune -h`); "
                               "--steps is required")
    finetuning.FinetuneOptions.add_arguments(job, job=True, without=("scheme",))
    job.add_argument("--no-base", dest="base", action="store_false",
                     help="leave the base model's weights out of the artifact (the device "
                          "then writes checkpoints only, no fine-tuned folder)")
    i = sub.add_parser("inspect", help="print an artifact's manifest")
    i.add_argument("dir")
    r = sub.add_parser("run", help="fine-tune with an artifact of `export --model` on JSONL "
                                   "data, or run any artifact's step on arrays")
    r.add_argument("dir")
    r.add_argument("--device", default="local-task", help="IREE's device to run on: "
                   "local-task (the CPU, the default), vulkan or cuda; the artifact's target "
                   "must be built for it")
    r.add_argument("--steps", type=int, help="steps to run (default: the job's, or 3 for "
                                             "arrays)")
    r.add_argument("--data", metavar="FILE",
                   help="with an artifact of `export --model`: JSONL records ({\"text\"}, "
                        "{\"prompt\", \"completion\"} or {\"messages\"}, as finetune reads "
                        "them). Otherwise FILE.npz, the batches: one array per input of the "
                        "step, named after it (the names `pockjax inspect DIR` shows on its "
                        "train_step line, e.g. np.savez('b.npz', x=..., y=...)), each of the "
                        "input's shape or with a leading axis of one batch per step; without "
                        "it, random float inputs")
    r.add_argument("--out", help="with JSONL data: the run's folder (checkpoints, "
                                 "metrics.jsonl, final/)")
    r.add_argument("--valid", help="with JSONL data: held-out JSONL, evaluated every "
                                   "--eval-every steps")
    r.add_argument("--epochs", type=float, help="with JSONL data: passes over the data "
                                                "instead of --steps")
    r.add_argument("--eval-every", type=int, help="with --valid: steps between evaluations "
                                                  "(default: at the start and the end)")
    r.add_argument("--save-every", type=int, help="steps between checkpoints (default: the "
                                                  "end, and Ctrl-C or SIGTERM)")
    r.add_argument("--keep", type=int, default=3, help="checkpoints kept (default 3)")
    r.add_argument("--resume", action="store_true", help="continue the run in --out")
    r.add_argument("--overwrite", action="store_true", help="start again in --out")
    r.add_argument("--write-batches", metavar="FOLDER",
                   help="with JSONL data: do not train; write the job's batches as .npy "
                        "files and train.sh, which runs the loop with iree-run-module alone "
                        "(a device without Python); `pockjax merge DIR --state "
                        "FOLDER/state` makes the model folder afterwards")
    m = sub.add_parser("merge", help="a fine-tuned model folder from a device job's checkpoint "
                                     "or train.sh's state files")
    m.add_argument("dir", help="the artifact of `pockjax export --model`")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint `pockjax run` wrote (RUN/checkpoints/...)")
    src.add_argument("--state", help="the state folder train.sh wrote")
    m.add_argument("--out", required=True, help="the model folder to write")
    r.add_argument("--save", help="write a checkpoint after the last step")
    r.add_argument("--tool", help="run each call with this iree-run-module command instead of "
                                  "the Python runtime (e.g. a path, or 'qemu-aarch64 ... "
                                  "iree-run-module')")
    r.add_argument("--qemu-arm64", metavar="RUNTIME_DIR",
                   help="run an android-arm64 artifact under qemu-aarch64 with the aarch64 "
                        "iree-run-module unpacked in RUNTIME_DIR (make arm64-runtime)")
    s = sub.add_parser("search", help="choose what to train under a memory budget "
                                      "(contribution analysis + knapsack)",
                       description=__doc__.split("\n\n")[2])
    s.add_argument("spec", metavar="MODULE:ATTR")
    s.add_argument("--budget", default="40%",
                   help="a percentage of full fine-tuning's step memory ('40%%') or a size "
                        "('2GiB', '512MiB')")
    s.add_argument("--out", required=True, help="the chosen scheme, as JSON")
    s.add_argument("--steps", type=int, default=20, help="training steps per candidate")
    s.add_argument("--cache", help="directory for per-candidate results (resumes an interrupted "
                                   "analysis)")
    s.add_argument("--flop-budget", type=float, help="GFLOP per step")
    s.add_argument("--report", help="write the full report as JSON")
    s.add_argument("--plot", help="write contribution vs memory as a PNG")
    f = sub.add_parser("finetune", help="fine-tune a Hugging Face model folder on a JSONL "
                                        "file (checkpoints, resume, a Hugging Face folder out)",
                       description=finetuning.__doc__.split("\n\n")[0])
    finetuning.add_arguments(f)
    g = sub.add_parser("generate", help="continue a prompt with a Hugging Face model folder")
    finetuning.add_generate_arguments(g)
    args = ap.parse_args(argv)
    if args.cmd in ("finetune", "generate"):
        return (finetuning.main if args.cmd == "finetune" else finetuning.generate_main)(args)
    try:
        return {"targets": cmd_targets, "export": cmd_export, "inspect": cmd_inspect,
                "run": cmd_run, "search": cmd_search, "merge": cmd_merge}[args.cmd](args)
    except ExportError as err:
        print(f"pockjax {args.cmd}: {err}", file=sys.stderr)
        return 2
    except _Interrupted as note:
        print(f"pockjax {args.cmd}: interrupted (Ctrl-C); {note}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a command stopped by Ctrl-C


if __name__ == "__main__":
    sys.exit(main())
