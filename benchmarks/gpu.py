"""On a machine with an NVIDIA GPU: the jetson-cuda artifacts run by IREE's CUDA driver
against the JAX trainer, LLaMA-2-7B's shape trained by JAX on the GPU beside PyTorch
LoRA, and the quality benchmark's pretraining and training runs.

A GPU machine without the IREE compiler runs what this machine prepares:

    python -m benchmarks gpu prepare [--dir .gpu] [--quality full]  # here: artifacts, references
    python -m benchmarks gpu cuda --dir .gpu --json A     # there: each artifact on `cuda`
    python -m benchmarks gpu llama7b --row ROW --json B   # there: one row per process
    python -m benchmarks gpu quality --dir .gpu --out Q   # there: the quality benchmark's runs
    python -m benchmarks gpu adopt-quality Q              # here: those runs put in place
    python -m benchmarks gpu report A B... [--work W]     # here: results/gpu.md

`prepare` exports every model of the export tests (`tests/export/models.py`: an MLP, a
CNN, a transformer block, a scanned model, a clipped optimizer chain, an integer-label
classifier, an NNX MobileNetV2 with batch statistics and a tiny LLaMA) and an MLP whose
frozen kernels are stored in int4 and int8 (`lowbit-mlp`) for jetson-cuda (sm_87; the
artifact carries PTX, which the driver compiles for the GPU at hand), and records what
the JAX trainer on this CPU gives for 3 steps of each: every step's metrics and the
parameters after the last. `cuda` loads each artifact with `pockjax.runtime` (no JAX
imported) on IREE's `cuda` device, runs the same 3 steps on the same batch and records
the largest error over the export tests' tolerance (at most 1 within it) of the metrics
and the parameters (of `lowbit-mlp`, the trained ones). `--device local-task` with
`prepare --target host-cpu` runs the same comparison on this CPU.

`llama7b` runs one row of `benchmarks/real_size.py` at LLaMA-2-7B's shape on the GPU:
the JAX rows build the model on the GPU (bfloat16 frozen weights, float32 trained
masters) and record the compiled step's memory and the GPU's peak; the PyTorch rows
build `transformers.LlamaForCausalLM` on the GPU in bfloat16 with peft LoRA r8 on q and
v. Same random tokens, batch 1, sequence 128, AdamW 1e-4.

`prepare --quality PRESET` packs the quality benchmark's corpus, tokenizer, tasks and
runs' configuration, built here under `--work` (default /tmp/pockjax-quality, the same
path on both machines, so both name the same runs' folder). `quality` there pretrains
the model and trains every row (`benchmarks/quality.py`; PyTorch's rows on the GPU too)
until a deadline; `adopt-quality` here puts the model and the finished runs in place,
and `python -m benchmarks quality --work W` then trains what is left and times every
row on this CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT  # noqa: E402

STEPS = 3
RESULTS = os.path.join(ROOT, "benchmarks", "results", "gpu.md")
GPU_ROWS = ["pockjax paper last-2 bf16-frozen bf16-matmul",
            "pockjax sparse last-k bf16-frozen bf16-matmul", "torch lora r8 q+v bf16",
            "pockjax paper last-2 bf16-frozen upcast", "pockjax paper last-2 int4-frozen",
            "pockjax paper last-2 int8-frozen"]
SHARD_BYTES = 15_000_000


def _flat_metrics(metrics) -> dict:
    import pockjax as pj

    out = {"loss": np.asarray(metrics["loss"])}
    if "aux" in metrics:
        for p, x in pj.scheme.leaves_with_paths(metrics["aux"])[0]:
            out[f"aux/{p}" if p else "aux"] = np.asarray(x)
    return out


def _plain(tree):
    """A pytree (an nnx.State too) as nested dicts and lists of numpy arrays, whose
    leaves `pockjax.runtime.named_leaves` names as JAX does."""
    import pockjax as pj

    root: dict = {}
    for path, x in pj.scheme.leaves_with_paths(tree)[0]:
        node, parts = root, path.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = np.asarray(x)

    def listify(node):
        if not isinstance(node, dict):
            return node
        node = {k: listify(v) for k, v in node.items()}
        if node and sorted(node) == sorted(map(str, range(len(node)))):
            return [node[str(i)] for i in range(len(node))]
        return node

    return listify(root)


def prepare(args) -> None:
    import jax

    import pockjax as pj
    from tests.export.models import COMPILE_ONLY, MODELS, make

    os.makedirs(args.dir, exist_ok=True)
    names = args.models.split(",") if args.models else [*MODELS, *COMPILE_ONLY, LOWBIT_MODEL]
    names = [] if args.models == "" else names
    for name in names:
        trainer, params, batch = _lowbit_model() if name == LOWBIT_MODEL else make(name)
        out = os.path.join(args.dir, "artifacts", name)
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        trainer.export(trainer.init(params), batch, target=args.target, out_dir=out)
        state = trainer.init(params)
        metrics = []
        for _ in range(STEPS):
            state, m = jax.block_until_ready(trainer(state, batch))
            metrics.append(_flat_metrics(jax.device_get(m)))
        ref = {"batch": _plain(jax.device_get(batch)), "metrics": metrics,
               "params": {p: np.asarray(x) for p, x in
                          pj.scheme.leaves_with_paths(jax.device_get(state.params))[0]},
               "target": args.target}
        if name == LOWBIT_MODEL:
            # The trained leaves (float32): the frozen ones are the quantized codes,
            # which no step changes.
            ref.update(params={p: x for p, x in ref["params"].items()
                               if p == "l3/kernel" or p.endswith("/bias")}, subset=True)
        with open(os.path.join(out, "reference.pkl"), "wb") as f:
            pickle.dump(ref, f)
        print(f"{name}: exported for {args.target} and referenced in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    if args.quality:
        prepare_quality(args)


LOWBIT_MODEL = "lowbit-mlp"
QUALITY_WORK = "/tmp/pockjax-quality"
QUALITY_PACK = "quality.tar.xz"


def _lowbit_model():
    """The export tests' MLP with frozen kernels stored as int4 with zero points, int4
    and int8 (`exportable_trainer` in tests/lowbit/test_lowbit.py)."""
    from pockjax import lowbit
    from tests.lowbit.test_lowbit import exportable_trainer

    return exportable_trainer({"l0/**": lowbit.Int4(group=32, zero_point=True),
                               "l1/**": "int4", "**": "int8"})


def prepare_quality(args) -> None:
    """The quality benchmark's runs, made ready to train on the GPU: the pretraining
    corpus and its tokenizer, the tasks and the runs' `config.json`, built here under
    `--work` (the same absolute path there, so the runs' folder has the same name) and
    packed into `<dir>/quality.tar.xz` (xz: the medium preset's corpus is 250 MB of
    Python, 40 MB packed, and a device run takes 64 MiB)."""
    import tarfile

    from benchmarks import quality

    work = Path(args.work)
    cfg, _, config = quality.prepare_runs(work, args.quality)
    pretrained = Path(cfg["pretrained"])
    packed = [Path(cfg["corpus_heldout"]).parent, Path(cfg["tasks"]["domain"]["train"]).parents[1],
              config]
    dst = os.path.join(args.dir, QUALITY_PACK)
    for old in ("quality.tar.gz", QUALITY_PACK):
        Path(args.dir, old).unlink(missing_ok=True)
    t0 = time.perf_counter()
    with tarfile.open(dst + ".tmp", "w:xz", preset=6) as tar:
        for path in packed:
            tar.add(path, arcname=str(path).lstrip("/"))
    os.replace(dst + ".tmp", dst)
    with open(os.path.join(args.dir, "quality.json"), "w") as f:
        json.dump({"config": str(config), "preset": args.quality,
                   "pretrained": str(pretrained)}, f, indent=1)
    print(f"quality: {dst} ({os.path.getsize(dst) / 2**20:.1f} MiB, "
          f"{time.perf_counter() - t0:.0f} s): the corpus, the tasks and {config}")


def _rel(got, want) -> float:
    """The largest elementwise |got - want| over the export tests' tolerance for it,
    1e-6 + 1e-4 (|want| + the leaf's largest |want|) (`tests/helpers.assert_trees_close`):
    at most 1 within it."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not want.size:
        return 0.0
    tol = 1e-6 + 1e-4 * (np.abs(want) + np.max(np.abs(want)))
    return float(np.max(np.abs(got - want) / tol))


def cuda(args) -> None:
    from pockjax import runtime

    results = {}
    root = os.path.join(args.dir, "artifacts")
    for name in sorted(os.listdir(root)):
        with open(os.path.join(root, name, "reference.pkl"), "rb") as f:
            ref = pickle.load(f)
        row = {}
        try:
            t0 = time.perf_counter()
            sess = runtime.load(os.path.join(root, name), device=args.device)
            row["load_s"] = time.perf_counter() - t0
            steps = []
            for want in ref["metrics"]:
                t0 = time.perf_counter()
                got = sess.step(ref["batch"])
                steps.append(time.perf_counter() - t0)
                if sorted(got) != sorted(want):
                    raise AssertionError(f"metrics {sorted(got)} != {sorted(want)}")
                row.setdefault("metrics_tol", []).append(max(_rel(got[k], want[k]) for k in want))
            params = dict(runtime.named_leaves(sess.params()))
            if ref.get("subset"):
                params = {k: v for k, v in params.items() if k in ref["params"]}
            if sorted(params) != sorted(ref["params"]):
                raise AssertionError(f"parameters {sorted(params)[:4]}... != "
                                     f"{sorted(ref['params'])[:4]}...")
            worst = max(ref["params"], key=lambda p: _rel(params[p], ref["params"][p]))
            row.update(params_tol=_rel(params[worst], ref["params"][worst]), worst_leaf=worst,
                       step_s=steps, step_count=sess.step_count,
                       losses=[float(np.asarray(m["loss"])) for m in ref["metrics"]])
            sess.close()
        except Exception as e:  # each model's failure is recorded, the others still run
            row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        results[name] = row
        print(name, json.dumps(row)[:400], flush=True)
    out = {"kind": "cuda", "device": args.device, "target": ref["target"],
           "gpu": _gpu_name(), "models": results}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


def _gpu_name() -> str:
    import subprocess
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no nvidia-smi"


def llama7b(args) -> None:
    from benchmarks import real_size
    from benchmarks.common import timed_steps

    s = real_size.PRESETS[args.preset]
    row = args.row
    t0 = time.perf_counter()
    if row.startswith("torch"):
        out = _torch_row(row, s, args)
    else:
        import jax

        step, _, info = real_size.jax_row(row, s, limit_gib=1e9)
        setup = time.perf_counter() - t0
        losses, times = timed_steps(step, args.steps, args.warmup)
        stats = jax.devices()[0].memory_stats() or {}
        out = {"losses": losses, "times": times, "setup_s": setup,
               "gpu_peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30,
               "device": str(jax.devices()[0]), "jax": jax.__version__, **info}
    out.update(row=row, preset=args.preset, gpu=_gpu_name(), wall_s=time.perf_counter() - t0)
    print(json.dumps(out))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


def _torch_row(row: str, s: dict, args) -> dict:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from benchmarks.common import timed_steps
    from benchmarks.paper_table import make_batch
    from benchmarks.real_size import LR, WEIGHT_DECAY, torch_step

    torch.manual_seed(0)
    t0 = time.perf_counter()
    config = transformers.LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=max(128, s["seq"]),
        rms_norm_eps=1e-5, tie_word_embeddings=False)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):  # made on the GPU: 6.7B random weights in seconds
        net = transformers.LlamaForCausalLM._from_config(config).to(torch.bfloat16)
    net.train()
    net = get_peft_model(net, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                         target_modules=["q_proj", "v_proj"]))
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    tokens = torch.from_numpy(make_batch("llama", s)).long().to(dev)
    setup = time.perf_counter() - t0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()

    losses, times = timed_steps(torch_step(net, opt, tokens), args.steps, args.warmup)
    return {"losses": losses, "times": times, "setup_s": setup,
            "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0,
            "trained_params": sum(p.numel() for p in params), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}


def prefix7b(args) -> None:
    """The paper scheme's step at a LLaMA shape, uncached or through the prefix cache
    (one per process): the cached row's first step on a new batch computes the prefix
    (an epoch's first visit), the later steps on the same batches read it back."""
    import jax

    from benchmarks import prefix_cache
    from pockjax.prefix import PrefixCachedTrainer

    row = "pockjax paper last-2 bf16-frozen bf16-matmul"
    t0 = time.perf_counter()
    trainer, state, batches = prefix_cache.build(args.preset, "paper", "bfloat16",
                                                 args.steps + 2)
    state = [state]
    step_fn, out = trainer, {}
    if args.cached:
        step_fn = PrefixCachedTrainer(trainer)
        report = step_fn.report(state[0], batches[0])
        out.update(prefix_share=report.share, prefix_gflop=report.prefix_flops / 1e9,
                   step_gflop=report.step_flops / 1e9, cut_bytes=report.bytes_per_example,
                   report=str(report))

    def step(b):
        t = time.perf_counter()
        state[0], m = step_fn(state[0], b)
        loss = float(m["loss"])
        return loss, time.perf_counter() - t

    setup = time.perf_counter() - t0
    losses, first_visit, again = [], [], []
    for b in batches:  # every batch once: compile, then the first epoch's steps
        loss, t = step(b)
        losses.append(loss)
        first_visit.append(t)
    for b in batches[1:]:  # the same batches again: a later epoch
        loss, t = step(b)
        losses.append(loss)
        again.append(t)
    stats = jax.devices()[0].memory_stats() or {}
    out.update(row=row + (" prefix-cached" if args.cached else ""), preset=args.preset,
               losses=losses, first_visit_s=first_visit[1:], later_epoch_s=again,
               setup_s=setup, gpu_peak_gib=stats.get("peak_bytes_in_use", 0) / 2**30,
               device=str(jax.devices()[0]), jax=jax.__version__, gpu=_gpu_name())
    print(json.dumps(out))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


def _shard(weights: str, out: str, bfloat16: bool = False) -> None:
    """`weights` (a safetensors file) as parts of at most SHARD_BYTES each in `out` (a
    device run brings back files under 16 MB, 64 MiB in all): `part<i>.safetensors`, or
    with `bfloat16` (float32 weights whose values are bfloat16's) `part<i>.npz`, each
    tensor's bfloat16 bits as two compressed byte planes (the high bytes, sign and
    exponent, compress to about half: 30% smaller in all)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    os.makedirs(out, exist_ok=True)
    tensors = load_file(weights)
    if bfloat16:
        for k, x in tensors.items():
            bits = x.view(np.uint32)
            if x.dtype != np.float32 or np.any(bits & 0xFFFF):
                raise ValueError(f"{weights}: {k} is not bfloat16 values stored as float32")
    part, size, parts = {}, 0, 0

    def flush():
        if bfloat16:
            planes = {}
            for k, x in part.items():
                high = (x.view(np.uint32) >> 16).astype(np.uint16)
                planes[f"{k}@hi"] = (high >> 8).astype(np.uint8)
                planes[f"{k}@lo"] = (high & 0xFF).astype(np.uint8)
            np.savez_compressed(os.path.join(out, f"part{parts}.npz"), **planes)
        else:
            save_file(part, os.path.join(out, f"part{parts}.safetensors"))

    for k in sorted(tensors):
        nbytes = tensors[k].nbytes // (2 if bfloat16 else 1)
        if part and size + nbytes > SHARD_BYTES:
            flush()
            part, size, parts = {}, 0, parts + 1
        part[k] = tensors[k]
        size += nbytes
    flush()


def _unshard(src: str, weights: str) -> None:
    """The parts `_shard` wrote in `src` joined into `weights` (float32)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = {}
    for part in sorted(os.listdir(src)):
        if part.startswith("part") and part.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, part)))
        elif part.startswith("part") and part.endswith(".npz"):
            with np.load(os.path.join(src, part)) as planes:
                for name in planes.files:
                    if name.endswith("@hi"):
                        k = name[:-3]
                        high = (planes[name].astype(np.uint32) << 8) | planes[f"{k}@lo"]
                        tensors[k] = (high << 16).view(np.float32)
    save_file(tensors, weights, metadata={"format": "pt"})


def weights_digest(weights: str) -> str:
    """The sha256 of a safetensors file's tensors (names, shapes, dtypes and bytes, in
    name order): equal for the same weights whatever the file's header order."""
    import hashlib

    from safetensors.numpy import load_file

    h = hashlib.sha256()
    tensors = load_file(weights)
    for k in sorted(tensors):
        x = tensors[k]
        h.update(f"{k}{x.shape}{x.dtype}".encode())
        h.update(x.tobytes())
    return h.hexdigest()


def _trained_on() -> dict:
    import jax

    return {"device": f"{jax.devices()[0].device_kind} ({_gpu_name()})", "jax": jax.__version__,
            "python": sys.version.split()[0]}


def quality_on_gpu(args) -> None:
    """There: the quality benchmark's pretraining and training runs, from what
    `prepare --quality` packed. The model is pretrained first (a packed preset for its
    time budget, `benchmarks/pretrain.py`'s `train_packed`); then every row
    (`benchmarks/quality.py --row`, one process each, `--workers` at a time, the searches
    one after the other since they share their candidates) until `--deadline` seconds
    from the start, when unfinished rows are stopped. PyTorch's rows run on the GPU too;
    every row multiplies float32 in float32 (`JAX_DEFAULT_MATMUL_PRECISION=highest`; no
    TF32 in PyTorch either), so both frameworks compute what they do on the CPU. Into
    `--out`: the model's weights in parts and `quality-runs.tar.gz` (every finished run's
    records, the model folder's other files, each row's log); `adopt-quality` puts them
    in place here, where `python -m benchmarks quality` then finds the runs done, trains
    what is left and times each row on this machine."""
    import concurrent.futures
    import subprocess
    import tarfile

    t_start = time.perf_counter()
    deadline = t_start + args.deadline
    with open(os.path.join(args.dir, "quality.json")) as f:
        info = json.load(f)
    packed = os.path.join(args.dir, QUALITY_PACK)
    if not os.path.isfile(packed):
        packed = os.path.join(args.dir, "quality.tar.gz")  # an older prepare's
    with tarfile.open(packed) as tar:
        tar.extractall("/", filter="data")
    cfg = json.loads(Path(info["config"]).read_text())
    from benchmarks import pretrain, quality

    name = quality.PRESETS[info["preset"]]["pretrain"]
    s = dict(pretrain.PRESETS[name])
    model, corpus = Path(cfg["pretrained"]), Path(cfg["corpus_heldout"]).parent
    os.makedirs(args.out, exist_ok=True)
    print(f"quality: unpacked {packed} in {time.perf_counter() - t_start:.0f} s", flush=True)
    if not (model / "pretrain.json").is_file():
        manifest = json.loads((corpus / "manifest.json").read_text())
        init = model.parent / "init"
        pretrain.save_init(init, corpus, manifest, s)
        if s.get("packed"):
            if args.pretrain_seconds is not None:
                s["seconds"] = args.pretrain_seconds
            result = pretrain.train_packed(
                init, corpus, "/tmp/pretrain-run", s, seconds=s.get("seconds"),
                steps=None if s.get("seconds") else (args.steps or s["steps"]))
        else:
            result = pretrain.train(init, corpus, "/tmp/pretrain-run", s, steps=args.steps,
                                    save_every=None, overwrite=True, plot=False,
                                    progress=False)
        tmp = model.with_name("model.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(result.final, tmp)
        shutil.copy(os.path.join(result.out, "metrics.jsonl"), tmp / "pretrain_metrics.jsonl")
        record = pretrain.pretrain_record(name, manifest, result, trained_on=_trained_on())
        record["settings"] = s
        (tmp / "pretrain.json").write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, model)
        print(f"pretrained in {result.seconds:.0f} s: held-out {result.valid_loss_before:.3f} -> "
              f"{result.valid_loss:.3f}", flush=True)
    weights = str(model / "model.safetensors")
    (model / "weights.sha256").write_text(weights_digest(weights) + "\n")
    _shard(weights, args.out, bfloat16=s.get("store") == "bfloat16")

    import torch
    runs = Path(cfg["runs"])
    gpu_config = runs / "config-gpu.json"
    gpu_config.write_text(json.dumps(
        {**cfg, "torch_device": "cuda" if torch.cuda.is_available() else "cpu"}, indent=1))
    names = [m.name for m in quality.preset_methods(info["preset"]) if m.kind != "pretrained"]
    if args.methods:
        names = [quality.method_named(n).name for n in args.methods.split(",")]
        names = [n for n in names if quality.method_named(n).kind != "pretrained"]
    searches = [n for n in names if "search" in n]
    groups = ([searches] if searches else []) + [[n] for n in names if n not in searches]
    groups.append([quality.METHODS[0].name])  # the pretrained model, scored
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR",
                                                       "/tmp/pockjax-jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    if torch.cuda.is_available():
        # Compiling is most of a row's time on a GPU; GEMM autotuning only changes which
        # kernel computes a product, not its float32 result's precision. Kept only where
        # this XLA still knows the flag (an unknown one aborts every process).
        flag = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0"
        probe = subprocess.run([sys.executable, "-c", "import jax.numpy as j; j.zeros(1)"],
                               env={**env, "XLA_FLAGS": flag}, capture_output=True)
        if probe.returncode == 0:
            env["XLA_FLAGS"] = flag

    def run(group):
        out = {}
        for name in group:
            left = deadline - time.perf_counter()
            if left < 15:
                out[name] = "not started before the deadline"
                continue
            t0 = time.perf_counter()
            with open(runs / f"{quality.slug(name)}.log", "w") as log:
                try:
                    rc = subprocess.run([sys.executable, "-m", "benchmarks.quality", "--row",
                                         name, "--config", str(gpu_config)], cwd=ROOT,
                                        stdout=log, stderr=subprocess.STDOUT, env=env,
                                        timeout=left).returncode
                    out[name] = f"exit {rc} after {time.perf_counter() - t0:.0f} s"
                except subprocess.TimeoutExpired:
                    out[name] = f"stopped at the deadline after {time.perf_counter() - t0:.0f} s"
            print(f"quality: {name}: {out[name]}", flush=True)
        return out

    done: dict = {}
    with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
        for out in pool.map(run, groups):
            done.update(out)
    (runs / "gpu-rows.json").write_text(json.dumps(done, indent=1))

    def keep(ti):
        parts = ti.name.split("/")
        return None if "final" in parts or "checkpoints" in parts else ti

    dst = os.path.join(args.out, "quality-runs.tar.gz")
    with tarfile.open(dst, "w:gz") as tar:
        tar.add(runs, arcname=str(runs).lstrip("/"), filter=keep)
        for f in model.iterdir():
            if f.name != "model.safetensors":
                tar.add(f, arcname=str(f).lstrip("/"))
    print(f"quality: {sum(v.startswith('exit 0') for v in done.values())}/{len(done)} rows "
          f"finished; {dst} {os.path.getsize(dst) / 2**20:.1f} MiB; "
          f"{time.perf_counter() - t_start:.0f} s", flush=True)


def adopt_quality(args) -> None:
    """Here: a device run's quality results (`quality` above) put in place under the
    same paths: the runs' records, and the pretrained model folder with its weights
    joined from the parts."""
    import tarfile

    packed = os.path.join(args.src, "quality-runs.tar.gz")
    if not os.path.isfile(packed):
        sys.exit(f"{args.src}: no quality-runs.tar.gz; give the folder that `gpu quality "
                 f"--out` wrote on the device (with its part*.safetensors)")
    with tarfile.open(packed) as tar:
        names = tar.getnames()
        tar.extractall("/", filter="data")
    model = Path("/" + next(n for n in names if n.endswith("/pretrain.json"))).parent
    if any(n.startswith("part") for n in os.listdir(args.src)):
        _unshard(args.src, str(model / "model.safetensors"))
    if not (model / "model.safetensors").is_file():
        sys.exit(f"{args.src}: no part*.safetensors or part*.npz, and no weights at {model} yet")
    digest = model / "weights.sha256"
    if digest.is_file() and digest.read_text().strip() != weights_digest(
            str(model / "model.safetensors")):
        (model / "model.safetensors").unlink()
        sys.exit(f"{args.src}: the joined weights differ from the ones the device run "
                 f"trained (weights.sha256); bring back every part of that run again")
    print(f"adopted the runs and the model {model}")


def report(args) -> None:
    """results/gpu.md from a device run's results.json (and its pretrain folder)."""
    from benchmarks.common import commit

    with open(args.results) as f:
        res = json.load(f)
    lines = ["# On an NVIDIA GPU: jetson-cuda artifacts, LLaMA-2-7B's shape, pretraining", "",
             f"Written by `python -m benchmarks gpu report` (commit {commit()}) from the "
             "device runs of `benchmarks/gpu.py` (see its docstring for the method); a row "
             "from a later run than its table's others gives its date.", ""]
    cu = res.get("cuda.json")
    if cu:
        lines += [f"## jetson-cuda artifacts on IREE's `{cu['device']}` driver", "",
                  f"GPU: {cu['gpu']}. Artifacts exported here for `{cu['target']}` (sm_87 "
                  "PTX, compiled by the driver for this GPU), run by `pockjax.runtime` "
                  "without JAX for 3 steps on the batch the JAX trainer (this machine's "
                  "CPU) took. Error columns: the largest elementwise error over the export "
                  "tests' tolerance, 1e-6 + 1e-4 (|x| + the leaf's largest |x|): within "
                  "it at 1 or less.", "",
                  "| model | losses (3 steps) | metrics / tolerance | parameters / tolerance "
                  "(worst leaf) | step ms (median) | load s |", "|---|---|---|---|---|---|"]
        for name, r in cu["models"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:200]} | | | | |")
                continue
            ms = sorted(r["step_s"])[len(r["step_s"]) // 2] * 1e3
            name += f" ({r['date']})" if "date" in r else ""
            lines.append(f"| {name} | {', '.join(f'{x:.4f}' for x in r['losses'])} | "
                         f"{max(r['metrics_tol']):.3f} | {r['params_tol']:.3f} "
                         f"(`{r['worst_leaf']}`) | {ms:.2f} | {r['load_s']:.2f} |")
        lines.append("")
    rows = [v for k, v in sorted(res.items()) if k.startswith("row")]
    if rows:
        import statistics
        lines += ["## LLaMA-2-7B's shape, one training step on the GPU", "",
                  f"GPU: {rows[0]['gpu']}. Random weights and tokens, batch 1, sequence "
                  "128, AdamW 1e-4; each row in its own process; "
                  f"{len(rows[0]['times'])} timed steps after "
                  f"{len(rows[0]['losses']) - len(rows[0]['times'])} untimed. The JAX rows "
                  "keep frozen weights in bfloat16 and multiply in bfloat16 with float32 "
                  "accumulation; trained weights and AdamW state in float32. The PyTorch "
                  "row is a bfloat16 model with float32 LoRA adapters. The losses are of a "
                  "random batch trained on repeatedly, so they show that each row trains, "
                  "not a quality: no row here is at a quality the others reach.", "",
                  "| row | trained parameters | ms/step (median) | tokens/s | GPU peak GiB | "
                  "compiled step GiB | first and last loss | versions |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            med = statistics.median(r["times"])
            compiled = f"{r['compiled_peak_gib']:.2f}" if "compiled_peak_gib" in r else "-"
            ver = f"jax {r['jax']}" if "jax" in r else f"torch {r['torch']}"
            lines.append(f"| {r['row']} | {r['trained_params']:,} | {med * 1e3:.1f} | "
                         f"{128 / med:,.0f} | {r['gpu_peak_gib']:.2f} | {compiled} | "
                         f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3g} | {ver} |")
        lines.append("")
    if args.prefix:
        with open(args.prefix) as f:
            pre = json.load(f)
        rows = [pre[k] for k in sorted(pre)]
        lines += ["## LLaMA-2-7B's shape with the prefix cache", "",
                  f"GPU: {rows[0]['gpu']}. `python -m benchmarks gpu prefix7b [--cached]`, each "
                  "row its own process: PockEngine's scheme on the last 2 blocks, bfloat16 "
                  "frozen weights (bfloat16 matmuls, float32 accumulation), batch 1, sequence "
                  "128. Every batch once (the first epoch; its first step compiles and is "
                  "left out), then the same batches again (a later epoch: the cached row "
                  "reads the prefix's output back). Medians of the steps.", ""]
        cached = [r for r in rows if "prefix_share" in r]
        if cached:
            lines += [f"`PrefixReport`: {cached[0]['report']}.", ""]
        lines += ["| row | first epoch ms/step | later epochs ms/step | GPU peak GiB | "
                  "first and last loss |", "|---|---|---|---|---|"]
        import statistics
        for r in rows:
            lines.append(f"| {r['row']} | {statistics.median(r['first_visit_s']) * 1e3:.1f} | "
                         f"{statistics.median(r['later_epoch_s']) * 1e3:.1f} | "
                         f"{r['gpu_peak_gib']:.2f} | {r['losses'][0]:.5f} -> "
                         f"{r['losses'][-1]:.5f} |")
        lines.append("")
    from benchmarks import pretrain
    done = pretrain.folders(args.work or pretrain.DEFAULT_WORK, "full")["model"] / "pretrain.json"
    rec = json.loads(done.read_text()) if done.is_file() else {}
    if "trained_on" in rec:  # the pretrained model here came from a GPU run
        lines += ["## The quality benchmark's pretraining", "",
                  f"`benchmarks/pretrain.py`'s full preset ({rec['steps']} steps, "
                  f"{rec['tokens']:,} tokens, {rec['parameters']:,} parameters) on "
                  f"{rec['trained_on']['device']} (JAX {rec['trained_on']['jax']}): "
                  f"{rec['seconds_this_session']:.1f} s of training, "
                  f"{rec['tokens_per_second']:,.0f} tokens/s; held-out loss "
                  f"{rec['heldout_loss_before']:.3f} -> {rec['heldout_loss']:.3f}. "
                  "The model is the one the quality results start from.", ""]
    text = "\n".join(lines)
    from pockjax.checkpoint import write_atomic
    write_atomic(args.out, text.encode())
    print(text)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--dir", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--target", default="jetson-cuda")
    p.add_argument("--models", help="comma-separated names from tests/export/models.py "
                                    "(default: all)")
    p.add_argument("--quality", choices=["quick", "small", "full", "medium", "medium-quick"],
                   help="also pack the quality benchmark's corpus, tasks and runs' "
                        "configuration of this preset")
    p.add_argument("--work", default=QUALITY_WORK,
                   help="the quality benchmark's work folder, the same path on both machines")
    p = sub.add_parser("cuda")
    p.add_argument("--dir", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", required=True)
    p = sub.add_parser("llama7b")
    p.add_argument("--row", required=True, choices=GPU_ROWS)
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", required=True)
    p = sub.add_parser("prefix7b")
    p.add_argument("--preset", default="llama2-7b")
    p.add_argument("--cached", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", required=True)
    p = sub.add_parser("quality")
    p.add_argument("--dir", default=os.path.join(ROOT, ".gpu"))
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=480,
                   help="seconds from the start after which unfinished rows are stopped")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--methods", help="comma-separated rows (default: the preset's)")
    p.add_argument("--steps", type=int, help="pretraining steps instead of the preset's")
    p.add_argument("--pretrain-seconds", type=float,
                   help="a packed preset's pretraining time instead of the preset's")
    p = sub.add_parser("adopt-quality")
    p.add_argument("src", help="a device run's `quality` output folder")
    p = sub.add_parser("report")
    p.add_argument("results", help="the results.json a device run wrote")
    p.add_argument("--prefix", help="a device run's prefix7b results (JSON)")
    p.add_argument("--work",
                   help="the quality benchmark's work folder whose pretrained model to report")
    p.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    {"prepare": prepare, "cuda": cuda, "llama7b": llama7b,
     "report": report, "prefix7b": prefix7b, "quality": quality_on_gpu,
     "adopt-quality": adopt_quality}[
        args.cmd](args)


if __name__ == "__main__":
    main()
