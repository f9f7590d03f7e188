"""Quality of sparse fine-tuning: every method from the same pretrained model, on the
same batches and token budget, on two tasks the pretraining never saw.

    python -m benchmarks quality [--preset small|medium|real|quick|medium-quick|real-quick]
        [--out FILE]
        [--work DIR] [--task-dir PATH] [--methods NAME,NAME]

The model is `benchmarks/pretrain.py`'s LLaMA pretrained on the Python standard library;
the tasks (`benchmarks/quality_data.py`) are domain adaptation to numpy's sources
(held-out loss) and writing a function's body from its signature and docstring, taken
from sympy (held-out loss on the body, and exact match of the body's first line under
greedy decoding). The methods (`METHODS`, one entry a row) are PyTorch full fine-tuning
as the quality reference, peft LoRA, and pockjax's schemes through `pockjax.finetune`.
The `real` preset starts from a published checkpoint instead, SmolLM2-135M-Instruct from
its GGUF file, on task "instruct" (`benchmarks/quality_real.py`).

Protocol, per method and task: the learning rate is chosen on the validation split
from a sweep (`Method.rates`, one seed, `sweep_steps`), then `seeds` runs at that rate
train `steps` steps each; the table gives their mean and spread. All runs see the same
batches: pockjax's runs are `pockjax.finetune`'s (`pockjax.data.batch_at`, the seed
fixing the order), and the PyTorch runs build the same ones with `pockjax.data` (which
loads no JAX, so PyTorch's memory is measured alone), with the same masked token-mean
loss, AdamW settings and learning-rate schedule. Every final model is saved as a Hugging
Face folder and scored by one evaluator (pockjax's forward pass), so the metrics are
computed the same way for all.

Each row (a method, both tasks) runs in its own process (`benchmarks.common.run_row`):
training first, peak memory read for each run (the process's high-water mark, reset
before it starts), evaluation last. Each finished run leaves `train.json` and, for
the chosen rate, `eval.json` in its folder under `--work`; a second call skips what is
finished, so an interrupted benchmark resumes where it stopped.

Results: `--out` (default `benchmarks/results/quality.md`) and the `.json` and `.png`
beside it: per method and task the test loss (nats per token), the pretraining
corpus's held-out loss after fine-tuning (forgetting), exact match, s/step, tokens/s,
peak RSS, trained parameters, and time to quality (wall-clock until the validation
loss is within 2% of PyTorch full fine-tuning's final one); the chart plots validation
loss against wall-clock time for every method.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import pretrain as pretraining  # noqa: E402
from benchmarks import quality_data, quality_real  # noqa: E402
from benchmarks.common import (ROOT, add_malloc_option, commit, malloc_env,  # noqa: E402
                               report_result, run_row, versions)
from benchmarks.quality_eval import Evaluator  # noqa: E402
from benchmarks.quality_methods import (METHODS, PRESET_TITLES, PRESETS, RESULTS,  # noqa: E402
                                        TASKS, method_named, preset_methods, rates_of, slug, tasks_of,
                                        timing_task)
from benchmarks.quality_plot import plot  # noqa: E402
from benchmarks.quality_report import (collect, markdown, notes, summarize,  # noqa: E402
                                       trained_on)
from benchmarks.quality_runs import log_to, one_run, run_dir  # noqa: E402
from benchmarks.quality_schemes import build_scheme  # noqa: E402
# Imported from here by the tests and the other benchmarks.
from benchmarks.quality_eval import exact_match_check, exact_matches  # noqa: E402,F401
from benchmarks.quality_methods import QUALITY_MARGIN  # noqa: E402,F401
from benchmarks.quality_plot import GROUPS, frontier, group_of  # noqa: E402,F401
from benchmarks.quality_report import chosen_lr, time_to_quality  # noqa: E402,F401
from benchmarks.quality_runs import (lr_at, read_metrics, reset_peak_rss,  # noqa: E402,F401
                                     warmup_steps)
from benchmarks.quality_schemes import whole_model_candidates  # noqa: E402,F401


# --------------------------------------------------------------------------- a row


def row_main(name: str, config: str) -> None:
    """One row's process: every run of the method on both tasks (the sweep, then the
    seeds at the chosen rate), then the evaluation of the chosen rate's runs."""
    cfg = json.loads(Path(config).read_text())
    method = method_named(name)
    log = Path(cfg["runs"]) / slug(method.name) / "log.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    log_to(log)
    finals = []
    for task in tasks_of(cfg):
        if method.kind == "pretrained":
            finals.append(one_run(cfg, method, task, 0.0, 0, 0, None))
            continue
        scheme = build_scheme(cfg, method.scheme, task) if method.kind == "pockjax" else None
        rates = rates_of(cfg, method)
        sweep = {lr: one_run(cfg, method, task, lr, 0, cfg["sweep_steps"],
                             scheme)["final_valid_loss"] for lr in rates}
        finite = {lr: v for lr, v in sweep.items() if math.isfinite(v)}
        if not finite:
            raise RuntimeError(f"{method.name} / {task}: every learning rate of {rates} "
                               f"diverged; add smaller ones to the method's rates")
        chosen = min(finite, key=finite.get)
        folder = Path(cfg["runs"]) / slug(method.name) / task
        (folder / "chosen.json").write_text(json.dumps(
            {"lr": chosen, "sweep": {f"{k:g}": v for k, v in sweep.items()},
             "scheme": scheme}, indent=1) + "\n")
        for seed in range(cfg["seeds"]):
            finals.append(one_run(cfg, method, task, chosen, seed, cfg["steps"], scheme))
    evaluator = None
    for i, run in enumerate(finals):
        out = run_dir(cfg, method, run["task"], run["lr"], run["seed"], run["steps"])
        if (out / "eval.json").is_file() or "diverged" in run:
            continue
        if not (Path(run["final"]) / "config.json").is_file():
            # Trained but not scored, and its model gone (a run trained elsewhere, whose
            # models stay there): trained again.
            (out / "train.json").unlink()
            scheme = json.loads((out.parent / "chosen.json").read_text())["scheme"] \
                if method.kind == "pockjax" else None
            run = finals[i] = one_run(cfg, method, run["task"], run["lr"], run["seed"],
                                      run["steps"], scheme)
        evaluator = evaluator or Evaluator(cfg)
        scores = evaluator(run["final"], run["task"])
        (out / "eval.json").write_text(json.dumps(scores, indent=1) + "\n")
    # The models are scored: only the runs' records are kept.
    for path in (Path(cfg["runs"]) / slug(method.name)).glob("*/*/final"):
        shutil.rmtree(path, ignore_errors=True)
    report_result({"row": method.name, "runs": len(finals)})


def timing_main(name: str, config: str, lr: float | None = None) -> None:
    """One row's timing process: `time_steps` steps on `timing_task`'s task at the rate the
    sweep chose, seed 0, with validation only before the first step and after the last.
    The table's speed columns come from these runs, made one after another on an
    otherwise idle machine once every training run is done, so the quality runs may
    share the machine with other work without changing a speed figure. With `lr` (a
    `--retime` of a finished run, whose sweep ran elsewhere), that rate, and the
    method's scheme built here."""
    cfg = json.loads(Path(config).read_text())
    method = method_named(name)
    log = Path(cfg["runs"]) / slug(method.name) / "log.txt"
    log.parent.mkdir(parents=True, exist_ok=True)
    log_to(log)
    task = timing_task(cfg)
    if lr is None:
        chosen = json.loads((Path(cfg["runs"]) / slug(method.name) / task / "chosen.json")
                            .read_text())
    else:
        chosen = {"lr": lr, "scheme": build_scheme(cfg, method.scheme, task)
                  if method.kind == "pockjax" else None}
        shutil.rmtree(run_dir(cfg, method, task, lr, 0, cfg["time_steps"]),
                      ignore_errors=True)  # measured again, not read back
    run = one_run(cfg, method, task, chosen["lr"], 0, cfg["time_steps"], chosen["scheme"])
    shutil.rmtree(run_dir(cfg, method, task, chosen["lr"], 0, cfg["time_steps"]) / "final",
                  ignore_errors=True)
    report_result({"row": method.name, "s_per_step": run["s_per_step"]})


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- main


def corpus_exclude(task_dir: str | None) -> tuple[str, ...]:
    """The installed package a `--task-dir` is (or lies in), which a "packages" corpus
    must leave out too; () otherwise."""
    if not task_dir:
        return ()
    path = Path(task_dir).resolve()
    for root in quality_data.site_packages():
        root = root.resolve()
        if path != root and root in path.parents:
            return (path.relative_to(root).parts[0].removesuffix(".py"),)
    return ()


def prepare_runs(work: Path, preset: str, task_dir: str | None = None):
    """The tasks and the runs' configuration of `preset` under `work`: `(cfg, tasks
    manifest, config.json path)`. It needs the pretraining corpus and its tokenizer
    (`benchmarks/pretrain.py` builds them first), not the pretrained weights, so the
    runs can be trained where the model is pretrained (`python -m benchmarks gpu
    quality`): the runs' folder is named by a hash of `cfg`, whose paths are under
    `work`, so the same `work` on both machines names the same folder."""
    settings = PRESETS[preset]
    if settings["pretrain"] == "real":
        seq = settings["seq"]
        pre = quality_real.real_model(work, seq)
        model, heldout = Path(pre["heldout"]).parent, Path(pre["heldout"])
        tokenizer, source_key = model, pre["sha256"]
    else:
        seq = pretraining.PRESETS[settings["pretrain"]]["seq"]
        exclude = corpus_exclude(task_dir)
        where = pretraining.folders(work, settings["pretrain"], exclude)
        corpus = pretraining.build_corpus(work, settings["pretrain"], exclude)
        model, heldout = where["model"], where["corpus"] / "heldout.jsonl"
        tokenizer = where["corpus"] / "tokenizer"
        source_key = corpus["pretraining_files"]["content_sha256"]
    task_key = [settings["caps"], settings["sample_pct"], seq, str(task_dir), source_key]
    task_folder = work / f"tasks-{pretraining.settings_hash(task_key)}"
    tasks = quality_data.build_tasks(task_folder, tokenizer, seq=seq,
                                     caps=settings["caps"], task_dir=task_dir,
                                     sample_pct=settings["sample_pct"])
    cfg = {k: v for k, v in settings.items()
           if k not in ("caps", "row_timeout", "sample_pct", "time_steps", "tasks")}
    cfg.update(seq=seq, pretrained=str(model), corpus_heldout=str(heldout),
               tasks={t: {s: str(task_folder / t / f"{s}.jsonl") for s in quality_data.SPLITS}
                      for t in settings.get("tasks", TASKS)})
    if settings["pretrain"] == "real":
        cfg["gguf"] = str(quality_real.gguf_file())
    runs = work / f"runs-{pretraining.settings_hash([cfg, tasks['settings']])}"
    cfg["runs"] = str(runs)
    cfg["time_steps"] = settings["time_steps"]  # not in the hash: timing runs are separate
    runs.mkdir(parents=True, exist_ok=True)
    config = runs / "config.json"
    config.write_text(json.dumps(cfg, indent=1) + "\n")
    return cfg, tasks, config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Rows run in their own processes; finished runs are cached under --work and "
               "skipped when the command is run again.")
    ap.add_argument("--preset", choices=[p for p in PRESETS if p != "full"], default="small",
                    help="small (the default: 8.9M parameters on the standard library), "
                         "medium (31.6M on every installed package's sources; its "
                         "pretraining needs a GPU, see benchmarks/gpu.py), real "
                         "(SmolLM2-135M-Instruct from its GGUF file), quick, medium-quick and "
                         "real-quick (tests of the pipeline, minutes)")
    ap.add_argument("--quick", action="store_true",
                    help="the same as --preset quick: a tiny model, 1 seed, 1 learning rate, "
                         f"{PRESETS['quick']['steps']} steps, the rows marked quick (minutes)")
    ap.add_argument("--out", help="the Markdown table; the .json and .png go beside it "
                                  "(default benchmarks/results/quality.md, quality_medium.md "
                                  "or quality_<preset>.md)")
    ap.add_argument("--work", default=pretraining.DEFAULT_WORK,
                    help="cache folder: data, the pretrained model, every run "
                         f"(default {pretraining.DEFAULT_WORK})")
    ap.add_argument("--task-dir", help="a folder of Python files to use as the domain task "
                                       "instead of numpy's sources")
    ap.add_argument("--methods", help="comma-separated method names (as in the table, or "
                                      "their slugs such as pockjax-last-1) to run; default all "
                                      "of the preset's")
    ap.add_argument("--no-timing", action="store_true",
                    help="train and score the rows only; a later call without it times "
                         "them (the training may then share the machine with other work)")
    ap.add_argument("--replot", action="store_true",
                    help="only write the table and the figure again from the .json beside "
                         "--out (a finished run's), with this version's columns and figure")
    add_malloc_option(ap)
    ap.add_argument("--retime", action="store_true",
                    help="measure the speed and memory columns of the finished run beside "
                         "--out again on this machine (each row's timing run, compilation "
                         "included, at the rate its sweep chose) and rewrite its table, "
                         "data and figure; the quality columns stay the run's")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        if args.timing:
            timing_main(args.row, args.config, args.lr)
        else:
            row_main(args.row, args.config)
        return 0

    if args.task_dir:
        quality_data.check_task_dir(args.task_dir)
    preset = "quick" if args.quick else args.preset
    settings = PRESETS[preset]
    out = Path(args.out or os.path.join(ROOT, "benchmarks", "results", RESULTS[preset]))
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return replot(out)
    work = Path(args.work).resolve()
    if args.retime:
        return retime(out, work, preset, args.task_dir, args.methods, args.malloc)
    methods = preset_methods(preset)
    if args.methods:
        methods = [method_named(n.strip()) for n in args.methods.split(",")]
        if not any(m.kind == "pretrained" for m in methods):
            methods.insert(0, METHODS[0])
    t_start = time.perf_counter()

    # 1. The pretrained model (its own process: JAX stays out of this one).
    pre = pretrained(work, settings, args.task_dir)

    # 2. The tasks and the runs' folder.
    cfg, tasks, config = prepare_runs(work, preset, args.task_dir)
    runs = Path(cfg["runs"])
    print(f"quality: runs in {runs}", file=sys.stderr, flush=True)

    # 3. Every row in its own process.
    errors = {}
    for method in methods:
        t0 = time.perf_counter()
        log = runs / slug(method.name) / "log.txt"
        print(f"quality: {method.name} (progress in {log})", file=sys.stderr, flush=True)
        result = run_row(["-m", "benchmarks.quality", "--row", method.name, "--config",
                          str(config)], timeout=settings["row_timeout"])
        if "error" in result:
            errors[method.name] = result["error"]
        print(f"quality: {method.name}: {result.get('error') or 'done'} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)

    # 4. Speed: each row again for `time_steps` steps, one process each, after all the
    # training (run the benchmark on an idle machine for this part).
    env, malloc = malloc_env(args.malloc)
    for method in methods if settings["time_steps"] and not args.no_timing else []:
        if method.kind == "pretrained" or method.name in errors:
            continue
        t0 = time.perf_counter()
        result = run_row(["-m", "benchmarks.quality", "--row", method.name, "--timing",
                          "--config", str(config)], timeout=settings["row_timeout"], env=env)
        if "error" in result:
            errors[method.name] = f"timing: {result['error']}"
            said = result["error"]
        else:
            said = f"{result['s_per_step']:.3f} s/step"
        print(f"quality: timing {method.name}: {said} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)

    # 5. The table, the data and the chart.
    rows = collect(cfg, methods)
    summarize(rows)
    for r in rows:
        if r["method"] in errors:
            r["error"] = errors[r["method"]]
            r.pop("runs", None)
    meta = {"preset": preset, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit(), "cpu": cpu_model(), "cores": os.cpu_count(),
            "versions": f"Python {platform.python_version()}, " + versions(
                ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft", "tokenizers",
                 "numpy", "sympy")),
            "config": cfg, "pretrain": pre, "tasks": {t: tasks[t] for t in tasks_of(cfg)},
            "seconds": time.perf_counter() - t_start, "notes": notes(cfg, rows),
            "malloc": None if args.no_timing else malloc,
            "trained_on": trained_on(rows)}
    write_results(out, rows, meta)
    print(out.read_text())
    print(f"quality: {time.perf_counter() - t_start:.0f} s; wrote {out} and its .json, .png",
          file=sys.stderr)
    return 1 if errors else 0


def pretrained(work: Path, settings: dict, task_dir: str | None) -> dict:
    """The preset's pretrained model under `work`, made in its own process unless it is
    there (JAX stays out of this one): its `pretrain.json`."""
    if settings["pretrain"] == "real":
        return quality_real.real_model(work, settings["seq"])
    exclude = corpus_exclude(task_dir)
    made = subprocess.run([sys.executable, "-m", "benchmarks.pretrain", "--preset",
                           settings["pretrain"], "--work", str(work), "--exclude",
                           ",".join(exclude)], cwd=ROOT)
    if made.returncode:
        sys.exit(f"quality benchmark: pretraining the {settings['pretrain']} model failed "
                 f"(above)")
    where = pretraining.folders(work, settings["pretrain"], exclude)
    return json.loads((where["model"] / "pretrain.json").read_text())


def retime(out: Path, work: Path, preset: str, task_dir: str | None,
           names: str | None, malloc_mode: str = "pockjax") -> int:
    """`--retime`: each row of the finished run beside `out` timed again here, as the run
    times them (`timing_main`: its own process, `time_steps` steps on the domain task,
    seed 0, at the rate the run's sweep chose), with an empty compilation cache so the
    first step compiles as a first run's does; the table, data and figure rewritten
    with these speed, memory and time-to-quality columns and the run's quality columns.
    The timing runs start from the preset's pretrained model as `work` holds it (made
    here if it is not there): the same shapes as the run's, and a step's time does not
    depend on the weights' values. A searched scheme is searched again on that model;
    the notes say where it trains a different number of parameters."""
    import tempfile

    data = out.with_suffix(".json")
    if not data.is_file():
        sys.exit(f"quality benchmark: --retime needs {data}, a finished run's data")
    saved = json.loads(data.read_text())
    ran = {"full": "small"}.get(saved["meta"]["preset"], saved["meta"]["preset"])  # old name
    if ran != preset:
        sys.exit(f"quality benchmark: {data} is a run of preset {ran!r}; pass --preset {ran}")
    settings = PRESETS[preset]
    if not settings["time_steps"]:
        sys.exit(f"quality benchmark: preset {preset!r} has no timing runs")
    t_start = time.perf_counter()
    pretrained(work, settings, task_dir)
    cfg, _, config = prepare_runs(work, preset, task_dir)
    rows = saved["rows"]
    wanted = {method_named(n.strip()).name for n in names.split(",")} if names else None
    timed = [r for r in rows if r["task"] == timing_task(cfg) and r["kind"] != "pretrained"
             and "runs" in r and (wanted is None or r["method"] in wanted)]
    changed = []
    env, malloc = malloc_env(malloc_mode)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    for row in timed:
        method = method_named(row["method"])
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="pockjax-retime-") as cache:
            result = run_row(["-m", "benchmarks.quality", "--row", method.name, "--timing",
                              "--config", str(config), "--lr", repr(row["lr"])],
                             timeout=settings["row_timeout"],
                             env={**env, "POCKJAX_CACHE_DIR": cache})
        if "error" in result:
            print(f"quality: timing {method.name}: {result['error']}; its columns stay the "
                  f"run's", file=sys.stderr, flush=True)
            continue
        timing = json.loads((run_dir(cfg, method, timing_task(cfg), row["lr"], 0,
                                     cfg["time_steps"])
                             / "train.json").read_text())
        for r in rows:
            if r["method"] == method.name and "runs" in r:
                r["timing"] = timing
        if timing.get("trained_params") != row["runs"][0].get("trained_params"):
            changed.append(f"{method.name} ({timing.get('trained_params'):,} trained "
                           f"parameters timed, {row['runs'][0].get('trained_params'):,} "
                           f"trained)")
        print(f"quality: timing {method.name}: {result['s_per_step']:.3f} s/step "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    summarize([r for r in rows if "runs" in r])
    meta = saved["meta"]
    meta["retimed"] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit(),
        "cpu": cpu_model(), "cores": os.cpu_count(),
        "versions": f"Python {platform.python_version()}, " + versions(
            ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "peft")),
        "rows": len(timed), "schemes_differ": changed, "malloc": malloc,
        "seconds": time.perf_counter() - t_start}
    write_results(out, rows, meta)
    print(out.read_text())
    print(f"quality: retimed {len(timed)} rows in {time.perf_counter() - t_start:.0f} s; "
          f"wrote {out} and its .json, .png", file=sys.stderr)
    return 0


def write_results(out: Path, rows, meta) -> None:
    """The table, its data and its figure: `out` and the .json and .png beside it."""
    from pockjax.checkpoint import write_atomic

    write_atomic(out, markdown(rows, meta).encode())
    write_atomic(out.with_suffix(".json"),
                 (json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n").encode())
    title = PRESET_TITLES.get(meta["preset"], meta["preset"])
    plot(rows, out.with_suffix(".png"), f"Fine-tuning quality, {title}")


def replot(out: Path) -> int:
    """`--replot`: the table and figure of a finished run, from its .json."""
    data = out.with_suffix(".json")
    if not data.is_file():
        sys.exit(f"quality benchmark: --replot needs {data}, a finished run's data")
    saved = json.loads(data.read_text())
    rows = [r for r in saved["rows"]]
    summarize([r for r in rows if "runs" in r])
    write_results(out, rows, saved["meta"])
    print(f"quality: wrote {out} and its .png from {data}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    sys.exit(main())
