"""The quality benchmark's results page: every row's records collected from the runs'
folder, their summary over seeds (forgetting, share of full fine-tuning's gain, time to
quality) and the Markdown table with its notes."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.quality_methods import (LINEARS, PRESET_TITLES, QUALITY_MARGIN, REFERENCE,
                                        Method, slug, tasks_of, timing_task)
from benchmarks.quality_real import model_paragraph
from benchmarks.quality_runs import run_dir


def _mean_sd(values) -> tuple[float, float]:
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def time_to_quality(curve, target: float, timing: dict | None = None) -> float | None:
    """Seconds until the validation loss first reaches `target`, or None: with `timing`
    (the row's timing run), its first step (compilation included) plus its median step
    time for each later step; without, the run's own clock (evaluations included)."""
    for seconds, step, loss in curve:
        if loss <= target:
            if timing is None:
                return seconds
            return 0.0 if step == 0 else timing["first_step_s"] + (step - 1) * timing["s_per_step"]
    return None


def collect(cfg: dict, methods) -> list[dict]:
    """Every row's records from the runs folder: per method and task, the chosen rate,
    the sweep, the seeds' train and eval records and their summary."""
    rows = []
    for method in methods:
        for task in tasks_of(cfg):
            folder = Path(cfg["runs"]) / slug(method.name) / task
            row = {"method": method.name, "task": task, "kind": method.kind,
                   "scheme": method.scheme}
            if method.kind == "pretrained":
                lr, sweep, seeds, steps = 0.0, {}, 1, 0
            else:
                chosen = folder / "chosen.json"
                if not chosen.is_file():
                    rows.append({**row, "error": "not run"})
                    continue
                info = json.loads(chosen.read_text())
                lr, sweep, seeds, steps = info["lr"], info["sweep"], cfg["seeds"], cfg["steps"]
            runs, error = [], None
            for seed in range(seeds):
                out = run_dir(cfg, method, task, lr, seed, steps)
                train = out / "train.json"
                if train.is_file() and "diverged" in json.loads(train.read_text()):
                    error = f"seed {seed} diverged at lr {lr:g}"
                elif not (out / "eval.json").is_file():
                    error = "not finished"
                if error:
                    break
                runs.append({**json.loads(train.read_text()),
                             **json.loads((out / "eval.json").read_text())})
            if error:
                rows.append({**row, "error": error})
                continue
            row.update(lr=lr, sweep=sweep, runs=runs)
            if method.kind != "pretrained" and cfg.get("time_steps"):
                # Speed is measured once a method, on one task (both tasks' batches are
                # padded to the same shape).
                task_t = timing_task(cfg)
                timing = run_dir(cfg, method, task_t, chosen_lr(cfg, method, task_t), 0,
                                 cfg["time_steps"]) / "train.json"
                if timing.is_file():
                    row["timing"] = json.loads(timing.read_text())
            rows.append(row)
    return rows


def chosen_lr(cfg: dict, method: Method, task: str) -> float:
    """The learning rate the sweep chose for `method` on `task`, or NaN before it ran."""
    chosen = Path(cfg["runs"]) / slug(method.name) / task / "chosen.json"
    return json.loads(chosen.read_text())["lr"] if chosen.is_file() else float("nan")


def summarize(rows: list[dict]) -> None:
    """Means and spreads over seeds, forgetting and time to quality, in place."""
    base = {r["task"]: r for r in rows if r["kind"] == "pretrained" and "runs" in r}
    ref = {r["task"]: r for r in rows if r["method"] == REFERENCE and "runs" in r}
    for r in rows:
        if "runs" not in r:
            continue
        runs = r["runs"]
        s = {}
        s["test_loss"], s["test_loss_sd"] = _mean_sd([x["test_loss"] for x in runs])
        s["corpus_loss"], s["corpus_loss_sd"] = _mean_sd([x["corpus_loss"] for x in runs])
        if r["task"] in base:
            s["forgetting"] = s["corpus_loss"] - base[r["task"]]["runs"][0]["corpus_loss"]
            if r["task"] in ref:
                # Learning as a share of the reference's: its test-loss drop from the
                # pretrained model's, per seed, over the reference's mean drop.
                start = base[r["task"]]["runs"][0]["test_loss"]
                full = start - statistics.mean(x["test_loss"] for x in ref[r["task"]]["runs"])
                if full > 0:
                    s["gain_share"], s["gain_share_sd"] = _mean_sd(
                        [(start - x["test_loss"]) / full for x in runs])
        if r["task"] == "instruct":
            s["exact_match"], s["exact_match_sd"] = _mean_sd([x["exact_match"] for x in runs])
        if r["kind"] != "pretrained":
            s["valid_loss"], _ = _mean_sd([x["final_valid_loss"] for x in runs])
            timing = r.get("timing")
            speed = [timing] if timing else runs
            s["timed"] = "timing run" if timing else "training runs"
            s["s_per_step"] = statistics.median(x["s_per_step"] for x in speed)
            # This task's tokens per step (padding not counted) at that step time.
            s["tokens_per_s"] = (statistics.mean(x["tokens"] / max(x["steps"], 1) for x in runs)
                                 / s["s_per_step"])
            # The timing run's: the training runs may have run on a GPU, whose process
            # memory says nothing of this machine's.
            s["peak_rss_mib"] = max(x["peak_rss_mib"] for x in speed)
            s["trained_params"] = runs[0]["trained_params"]
            if r["task"] in ref:
                target = (1 + QUALITY_MARGIN) * statistics.mean(
                    x["final_valid_loss"] for x in ref[r["task"]]["runs"])
                times = [time_to_quality(x["valid_curve"], target, timing) for x in runs]
                reached = [t for t in times if t is not None]
                s["quality_target"] = target
                # The pretrained model may already be within the margin (a task it
                # nearly knows, or a short run): then the column says nothing.
                s["target_met_at_start"] = runs[0]["valid_curve"][0][2] <= target
                s["time_to_quality_s"] = statistics.median(reached) if reached else None
                s["reached"] = f"{len(reached)}/{len(times)}"
        r["summary"] = s


def _fmt(mean, sd, digits=4, seeds=1) -> str:
    if mean is None or not math.isfinite(mean):
        return "-"
    return f"{mean:.{digits}f} ± {sd:.{digits}f}" if seeds > 1 else f"{mean:.{digits}f}"


def retimed_lines(meta) -> list[str]:
    """The header's account of a `--retime`: where and when the speed columns were
    measured again."""
    t = meta.get("retimed")
    if not t:
        return []
    differ = (" The searched schemes, searched again on that model, train a different "
              "number of parameters than the training runs' for: "
              + "; ".join(t["schemes_differ"]) + "." if t["schemes_differ"] else "")
    return [f"**Speed columns re-measured** {t['date']}, commit {t['commit']}, on {t['cpu']}, "
            f"{t['cores']} cores ({t['versions']}; allocator {t.get('malloc', 'unknown')}): "
            f"s/step, tokens/s, peak RSS and time to "
            f"quality are these timing runs' ({t['rows']} rows, `python -m benchmarks "
            f"quality --retime`), from the preset's pretrained model as this machine made "
            f"it (the same shapes; a step's time does not depend on the weights' values); "
            f"every other column is the run above's.{differ}", ""]


def _model_paragraph(pre: dict) -> str:
    """The **Model** paragraph: the real preset's checkpoint, or the model pretrained here."""
    if pre.get("source") == "gguf":
        return model_paragraph(pre)
    packages = pre["corpus"]["settings"].get("source") == "packages"
    corpus = (f"the standard library and every installed package's sources except "
              f"{', '.join(pre['corpus']['settings']['exclude'])} under "
              if packages else "the standard library of ")
    head = pre["settings"]["hidden"] * pre["corpus"]["vocab_size"]
    return (f"**Model**: pockjax's LLaMA, {pre['settings']['layers']} blocks, width "
            f"{pre['settings']['hidden']}, vocabulary {pre['corpus']['vocab_size']} "
            f"({pre['parameters']:,} parameters, the output head {head / pre['parameters']:.1%} of "
            f"them), pretrained by `python -m benchmarks pretrain --preset "
            f"{ {'full': 'small'}.get(pre['preset'], pre['preset'])}` for "
            f"{pre['steps']:,} steps of "
            f"{pre['settings']['batch']} x {pre['settings']['seq']} tokens "
            + (f"({pre['tokens_per_parameter']:.1f} tokens a parameter, {pre['passes']:.2f} passes) "
               if "tokens_per_parameter" in pre else "")
            + f"on {corpus}{pre['corpus']['interpreter']} "
            f"({pre['corpus']['pretraining_files']['files']:,} files, "
            f"{pre['corpus']['tokens']['train_files']:,} tokens, file list sha256 "
            f"`{pre['corpus']['pretraining_files']['list_sha256'][:16]}`)"
            + (f", on {pre['trained_on']['device']} (JAX {pre['trained_on']['jax']}"
               + (f", {pre['settings']['matmul']} matmuls" if pre["settings"].get("matmul") else "")
               + ")" if "trained_on" in pre else "")
            + f"; its held-out loss {pre['heldout_loss']:.4f}"
            + (f" (weights rounded to bfloat16 after training; {pre['heldout_loss_unrounded']:.4f} "
               f"before)" if pre.get("heldout_loss_unrounded") else "") + ".")


def _tasks_paragraph(meta: dict, cfg: dict) -> str:
    """The **Tasks** paragraph, for the tasks the preset has."""
    t = meta["tasks"]
    said = []
    if "domain" in t:
        said.append(f"*domain*, the sources of {t['domain']['source']} "
                    f"{t['domain']['version']} (test: {t['domain']['records']['test']} records "
                    f"of up to {cfg['seq']} tokens)")
    if "instruct" in t:
        said.append(f"*instruct*, signature + docstring -> body of {t['instruct']['source']} "
                    f"{t['instruct']['version']}'s functions (loss on the body only; test: "
                    f"{t['instruct']['records']['test']} functions)")
    where = ("held out from pretraining, split by file" if meta["pretrain"].get("source") != "gguf"
             else "split by file")
    return f"**Tasks** ({where}): " + "; ".join(said) + "."


def markdown(rows, meta) -> str:
    p, cfg = meta["preset"], meta["config"]
    pre = meta["pretrain"]
    lines = [
        f"# Fine-tuning quality: pockjax's schemes against PyTorch and peft "
        f"({PRESET_TITLES.get(p, p + ' preset')})", "",
        f"Run {meta['date']}, commit {meta['commit']}. {meta['cpu']}, {meta['cores']} cores; "
        f"{meta['versions']}.", ""] + retimed_lines(meta) + [
        _model_paragraph(pre),
        _tasks_paragraph(meta, cfg),
        f"**Protocol**: each method and task: learning rate chosen on the validation split "
        f"({cfg['rates_in_sweep']} rates, seed 0, {cfg['sweep_steps']} steps), then "
        f"{cfg['seeds']} seed(s) x {cfg['steps']} steps of {cfg['batch']} x {cfg['seq']} "
        f"tokens at that rate, AdamW, cosine schedule with {int(cfg['warmup_frac'] * 100)}% "
        f"warm-up; the same batches for every method. Mean ± sample standard deviation over "
        f"seeds." + (f" The training runs ran on: {meta['trained_on']}; the speed and memory "
                     f"columns are this machine's timing runs."
                     if meta.get("trained_on") else ""), "",
        "Columns: *test loss* on the task's test split (nats/token); *share of full FT's "
        f"gain*: the test loss's drop from the pretrained model's over {REFERENCE}'s (mean "
        "over seeds; the learning axis of the figure); *corpus loss*: the "
        "pretraining corpus's held-out files after fine-tuning, and its change from the "
        "pretrained model's (forgetting); *exact match*: the body's first line under greedy "
        "decoding; *s/step*: the median of the steps after the first (pockjax's first step "
        "compiles) in the row's timing run"
        + (f" ({cfg['time_steps']} steps on the {timing_task(cfg)} task at the chosen rate, "
           "seed 0, one "
           "process per row, after all training, on an otherwise idle machine"
           + (f"; allocator {meta['malloc']}" if meta.get("malloc") else "") + ")"
           if cfg.get("time_steps") else "s (the training runs themselves)")
        + "; *tokens/s*: this task's tokens per step (padding not counted) at that step "
        "time; *peak RSS*: the process's high-water mark during the timing run (the "
        "training runs' where there is none), runtime included; *time to quality*: the "
        "median over seeds of the time "
        f"until the validation loss is within {QUALITY_MARGIN:.0%} of {REFERENCE}'s final "
        "one, counted as the timing run's first step (compilation included) plus its "
        "median step time for every further step (validation not counted), \"never\" "
        "otherwise; \"at start\" where the pretrained model is already within it.", ""]
    for task in tasks_of(cfg):
        em = task == "instruct"
        lines += [f"## Task: {task}", "",
                  "| method | lr | test loss | share of full FT's gain | "
                  "corpus loss (forgetting) | "
                  + ("exact match | " if em else "")
                  + "s/step | tokens/s | peak RSS MiB | trained params | time to quality |",
                  "|---|---:|---:|---:|---:|" + ("---:|" if em else "") + "---:|---:|---:|---:|---:|"]
        for r in (r for r in rows if r["task"] == task):
            if "runs" not in r:
                lines.append(f"| {r['method']} | {r['error']} |" + " |" * (8 + em))
                continue
            s, n = r["summary"], len(r["runs"])
            forget = (f" ({s['forgetting']:+.4f})" if "forgetting" in s else "")
            share = ("-" if r["kind"] == "pretrained" or "gain_share" not in s else
                     _fmt(100 * s["gain_share"], 100 * s["gain_share_sd"], 0, n) + "%")
            rate = f"{r['lr']:g}" if r["lr"] else "-"
            if r["runs"][0].get("lr_auto"):
                rate = "auto: " + ", ".join(f"{x['lr_auto']['chosen']:g}" for x in r["runs"])
            cells = [r["method"], rate,
                     _fmt(s["test_loss"], s["test_loss_sd"], 4, n), share,
                     _fmt(s["corpus_loss"], s["corpus_loss_sd"], 4, n) + forget]
            if em:
                cells.append(_fmt(100 * s["exact_match"], 100 * s["exact_match_sd"], 1, n) + "%")
            if r["kind"] == "pretrained":
                cells += ["-", "-", "-", "0", "-"]
            else:
                ttq = s.get("time_to_quality_s")
                when = "never" if ttq is None else f"{ttq:.1f} s"
                if "quality_target" not in s:
                    when = "- (no reference row)"
                elif s["target_met_at_start"]:
                    when = "at start"
                elif ttq is not None and s["reached"] != f"{n}/{n}":
                    when += f" ({s['reached']} seeds)"
                cells += [f"{s['s_per_step']:.3f}", f"{s['tokens_per_s']:,.0f}",
                          f"{s['peak_rss_mib']:.0f}", f"{s['trained_params']:,}", when]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    notes = meta.get("notes", [])
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)

def trained_on(rows) -> str:
    """Where the training runs ran, when any ran elsewhere than this machine's CPU
    (`python -m benchmarks gpu quality`): "" otherwise. Each device is named with the
    rows that ran on it (all others: "the other rows")."""
    where: dict[str, list] = {}
    for r in rows:
        for run in r.get("runs", []):
            if run.get("device"):
                names = where.setdefault(run["device"], [])
                if r["method"] not in names:
                    names.append(r["method"])
    if set(where) <= {"cpu"}:
        return ""
    most = max(where, key=lambda d: len(where[d]))
    said = [f"{'this machine' if d == 'cpu' else d}: {', '.join(names)}"
            for d, names in where.items() if d != most]
    name = "this machine" if most == "cpu" else most
    return "; ".join([f"{name}: {'the other rows' if said else 'every row'}"] + said)


def notes(cfg: dict, rows) -> list[str]:
    """What the table's rows need said: the optimizer PyTorch used, the searches."""
    out = []
    impl = {r["runs"][0].get("optimizer") for r in rows
            if "runs" in r and r["kind"] in ("torch", "peft")}
    if impl - {None}:
        out.append(f"PyTorch rows: torch.optim {', '.join(sorted(impl - {None}))}; peft LoRA "
                   f"with alpha = 2 x rank on {', '.join(LINEARS)} (lm_head frozen), merged "
                   f"into the weights before scoring.")
    for r in rows:
        if "runs" in r and r["runs"][0].get("lr_auto"):
            auto = r["runs"][0]["lr_auto"]
            out.append(f"{r['method']} on task {r['task']}: each seed's run chose its rate "
                       f"itself (`finetune --lr auto`: {auto['steps']} steps at each of "
                       f"{', '.join(auto['losses'])} on the validation split before the run; "
                       f"that sweep's time is not in s/step or the time to quality).")
    for info in sorted(Path(cfg["runs"]).glob("search/*/*.info.json")):
        i = json.loads(info.read_text())
        if i.get("admits_full"):
            out.append(f"search {i['budget']} on task {info.parent.name}: LoRA r8's compiled "
                       f"step ({i['budget_bytes'] / 2**20:.1f} MiB) is no smaller than full "
                       f"fine-tuning's ({i['full_bytes'] / 2**20:.1f} MiB), so the budget "
                       f"admits every weight: the row trains them all.")
            continue
        out.append(f"search {i['budget']} on task {info.parent.name}: budget "
                   f"{i['budget_bytes'] / 2**20:.1f} MiB of compiled step memory (full "
                   f"fine-tuning {i['full_bytes'] / 2**20:.1f} MiB), {i['candidates']} "
                   f"candidates, {i['seconds']:.0f} s (not in the time to quality); trains "
                   f"{', '.join(i['chosen'])}.")
    return out

