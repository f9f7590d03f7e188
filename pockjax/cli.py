"""`pockjax targets | export | inspect | run | search`.

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
way. It must give `(trainer_factory, params, data)`, as `pockjax.search` takes them,
or a dict with `model` (an `nnx.Module`), `loss_fn`, `optimizer` and `data`, as
`pockjax.nnx.search` takes them. `data` is `(train_batches, heldout_batches)`.
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
    from pockjax.export import export

    trainer, state, batch = _load_spec(args.spec)
    if args.scheme:
        scheme = _read_scheme(args.scheme)
        trainer = trainer.replace(scheme=scheme)
        state = trainer.init(state.params)
        print(f"scheme from {args.scheme}: {scheme!r}")
    t0 = time.perf_counter()
    art = export(trainer, state, batch, target=args.target, out_dir=args.out, gpu=args.gpu,
                 extra_flags=tuple(args.flag or ()))
    files = art.manifest["files"]
    print(f"exported {args.spec} for {args.target} to {art.path} in {time.perf_counter() - t0:.1f} s "
          "(" + ", ".join(f"{k} {v['bytes']:,} B" for k, v in files.items()) + ")")
    return 0


def cmd_inspect(args) -> int:
    from pockjax.export.artifact import read_manifest
    from pockjax._report import format_bytes

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


def _batches(manifest, data_path, steps):
    inputs = manifest["functions"]["train_step"]["inputs"]
    if data_path:
        data = np.load(data_path)
        missing = [s["name"] for s in inputs if s["name"] not in data]
        if missing:
            raise SystemExit(f"pockjax run: '{data_path}' lacks inputs {missing}; it has {list(data)}")
        arrays = {s["name"]: data[s["name"]] for s in inputs}
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
                raise SystemExit(f"pockjax run: input '{s['name']}' is {s['dtype']}; pass --data "
                                 "FILE.npz with real values for it")
        for _ in range(steps):
            yield batch


def cmd_run(args) -> int:
    from pockjax import runtime

    if args.qemu_arm64 or args.tool:
        import shlex

        command = runtime.qemu_arm64(args.qemu_arm64) if args.qemu_arm64 else shlex.split(args.tool)
        sess = runtime.ToolSession(args.dir, command, device=args.device)
    else:
        sess = runtime.load(args.dir, device=args.device)
    for i, batch in enumerate(_batches(sess.manifest, args.data, args.steps)):
        t0 = time.perf_counter()
        metrics = sess.step(batch)
        ms = (time.perf_counter() - t0) * 1e3
        print(f"step {i + 1}: loss {float(metrics['loss']):.6g} ({ms:.1f} ms)")
    if args.save:
        sess.save(args.save)
        print(f"saved {args.save}")
    return 0


def cmd_search(args) -> int:
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
            scheme, report = pj.nnx.search(obj["model"], obj["loss_fn"], optimizer=obj["optimizer"],
                                           data=obj["data"], **extra, **common)
        elif isinstance(obj, tuple) and len(obj) == 3:
            factory, params, data = obj
            scheme, report = pj.search(factory, params, data, **common)
        else:
            raise SystemExit(f"pockjax search: {args.spec} must give (trainer_factory, params, data) "
                             f"or a dict with model, loss_fn, optimizer and data; got "
                             f"{type(obj).__name__}")
    except ValueError as err:  # budgets out of range, data too short
        print(f"pockjax search: {err}", file=sys.stderr)
        return 2
    print(report)
    write_atomic(args.out, (scheme.to_json(indent=1) + "\n").encode())
    print(f"\nscheme: {args.out}")
    if args.report:
        report.save(args.report)
        print(f"report: {args.report}")
    if args.plot:
        report.plot(args.plot)
        print(f"plot:   {args.plot}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pockjax", description="Sparse on-device training with JAX and IREE")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("targets", help="list export targets and their IREE flags")
    e = sub.add_parser("export", help="compile a training step into an artifact directory",
                       description=__doc__.split("\n\n")[1])
    e.add_argument("spec", metavar="MODULE:ATTR")
    e.add_argument("--target", default="host-cpu", choices=list(TARGETS))
    e.add_argument("--out", required=True, help="artifact directory (replaced atomically)")
    e.add_argument("--gpu", help="GPU family for GPU targets (e.g. valhall, adreno, sm_87)")
    e.add_argument("--flag", action="append", help="extra IREE compiler flag (repeatable)")
    e.add_argument("--scheme", help="train this scheme (JSON from `pockjax search` or "
                                    "Scheme.to_json) instead of the trainer's")
    i = sub.add_parser("inspect", help="print an artifact's manifest")
    i.add_argument("dir")
    r = sub.add_parser("run", help="run an artifact's training step and print the loss")
    r.add_argument("dir")
    r.add_argument("--device", default="local-task")
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--data", help=".npz with one array per batch input (optionally stacked per step)")
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
    args = ap.parse_args(argv)
    try:
        return {"targets": cmd_targets, "export": cmd_export, "inspect": cmd_inspect,
                "run": cmd_run, "search": cmd_search}[args.cmd](args)
    except ExportError as err:
        print(f"pockjax {args.cmd}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
