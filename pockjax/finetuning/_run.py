"""The fine-tuning job's output folder: `run.json` (the options a resumed run must
share), `checkpoints/`, `metrics.jsonl` and `loss.png`.

`pockjax.finetuning.finetune` opens it as a `RunFolder` (which refuses a folder holding
something else, and a resume with other options), saves and restores checkpoints and
logs metrics through it, and draws the loss curve with `plot_losses` at the end.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from pockjax.finetuning._base import FinetuneError
from pockjax.finetuning._options import RESULT_OPTIONS, FinetuneOptions

RUN = "run.json"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
FINAL = "final"
_DEFAULTS = {"frontend": "auto", "moments": "float32"}  # what a run.json without them used


def run_options(options: FinetuneOptions | None = None, **values) -> dict:
    """What `run.json` records (`RESULT_OPTIONS`): each from `values` where given, else
    from `options`."""
    missing = [k for k in RESULT_OPTIONS if k not in values and options is None]
    if missing:
        raise TypeError(f"run_options: no value for {', '.join(missing)}")
    return {k: values[k] if k in values else getattr(options, k) for k in RESULT_OPTIONS}


def fingerprint(path) -> str:
    """A short SHA-256 of a file's bytes (the data a run trained on)."""
    from pockjax.export.manifest import sha256

    return sha256(path)[:16]


class RunFolder:
    """The output folder: run.json, checkpoints, metrics."""

    @staticmethod
    def check(out: Path, *, resume: bool, overwrite: bool) -> None:
        """The checks on `out` that need no options, made before any work: a file, a
        folder holding something else, or another run without `resume`/`overwrite`."""
        if out.exists() and not out.is_dir():
            raise FinetuneError(f"--out '{out}' is a file; give a folder")
        if out.is_dir() and any(out.iterdir()):
            if not (out / RUN).is_file():
                raise FinetuneError(f"--out '{out}' is not empty and holds no pockjax run; "
                                    f"give a new or empty folder")
            if not (overwrite or resume or RunFolder.never_saved(out)):
                raise FinetuneError(f"--out '{out}' holds another run ({RUN}); pass --resume "
                                    f"to continue it or --overwrite to start again")

    @staticmethod
    def never_saved(out: Path) -> bool:
        """Whether `out` holds a run that stopped before saving anything (no checkpoint,
        no final/): the same command starts it again without --overwrite."""
        saved = any((out / CHECKPOINTS).glob("step-*.safetensors")) if (
            out / CHECKPOINTS).is_dir() else False
        return (out / RUN).is_file() and not saved and not (out / FINAL).exists()

    writer = True  # False: another process of the run writes the folder

    @classmethod
    def reader(cls, out: Path) -> "RunFolder":
        """The folder as a process other than the writer sees it: its checkpoints read,
        nothing written."""
        run = cls.__new__(cls)
        run.out, run.writer = out, False
        return run

    def __init__(self, out: Path, options: dict, *, resume: bool, overwrite: bool):
        self.out = out
        run_file = out / RUN
        self.check(out, resume=resume, overwrite=overwrite)
        if out.is_dir() and any(out.iterdir()):
            if overwrite or not resume and self.never_saved(out):
                for name in (RUN, CHECKPOINTS, METRICS, FINAL, "loss.png", "final.gguf",
                             "final.gguf.json"):
                    p = out / name
                    shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            else:
                self._check_same(json.loads(run_file.read_text()), options)
        elif resume:
            print(f"pockjax finetune: nothing to resume in '{out}'; starting a new run",
                  file=sys.stderr)
        out.mkdir(parents=True, exist_ok=True)
        (out / CHECKPOINTS).mkdir(exist_ok=True)
        for tmp in (out / CHECKPOINTS).glob(".tmp-*"):  # a write that a kill cut short
            tmp.unlink(missing_ok=True)
        from pockjax.checkpoint import write_atomic
        write_atomic(run_file, (json.dumps(options, indent=2) + "\n").encode())

    @staticmethod
    def _check_same(before: dict, now: dict) -> None:
        for k in RESULT_OPTIONS:
            if before.get(k, _DEFAULTS.get(k)) != now.get(k):
                raise FinetuneError(f"cannot resume: this run used {k}={before.get(k)!r}, now "
                                    f"{k}={now.get(k)!r}; resume with the same options, or "
                                    f"pass --overwrite to start again")

    def checkpoints(self) -> list[tuple[int, Path]]:
        found = []
        for p in (self.out / CHECKPOINTS).glob("step-*.safetensors"):
            try:
                found.append((int(p.stem.split("-")[1]), p))
            except ValueError:
                continue
        return sorted(found)

    def path_of(self, step: int) -> Path:
        """The checkpoint file of `step`."""
        return self.out / CHECKPOINTS / f"step-{step:08d}.safetensors"

    def save(self, state, keep: int) -> Path:
        from pockjax.checkpoint import save

        step = int(state.step)
        path = self.path_of(step)
        save(path, state)
        for _, old in self.checkpoints()[:-keep]:
            old.unlink(missing_ok=True)
        return path

    def restore(self, like):
        """The newest checkpoint that loads, or None; a damaged newer one is named.
        `like` is a state, or a function of the checkpoint's step giving one."""
        from pockjax.checkpoint import CheckpointError, load

        for step, path in reversed(self.checkpoints()):
            try:
                return load(path, like=like(step) if callable(like) else like), path
            except CheckpointError as e:
                print(f"pockjax finetune: skipping checkpoint {path.name}: {e}", file=sys.stderr)
        return None, None

    def log(self, record: dict) -> None:
        if not self.writer:
            return
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")

    def trim_log(self, step: int) -> None:
        """Drop records after `step` (a resumed run logs those steps again)."""
        path = self.out / METRICS
        if not self.writer or not path.is_file():
            return
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except ValueError:  # a line a kill cut short
                continue
        from pockjax.checkpoint import write_atomic
        write_atomic(path, ("\n".join(kept) + "\n" if kept else "").encode())


def close_prefix_cache(cached, out) -> None:
    """Drop the prefix cache and its spill folder."""
    if cached is not None:
        cached.close()
        shutil.rmtree(Path(out) / "prefix-cache", ignore_errors=True)


def plot_losses(out: Path) -> None:
    """`loss.png`: the training and validation losses of `metrics.jsonl`."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return  # the plot is optional (matplotlib is in the examples extra)
    train, valid = [], []
    for line in (out / METRICS).read_text().splitlines():
        r = json.loads(line)
        if r.get("loss") is not None:
            train.append((r["step"], r["loss"]))
        if "valid_loss" in r:
            valid.append((r["step"], r["valid_loss"]))
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
