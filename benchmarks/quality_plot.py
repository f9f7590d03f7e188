"""The quality benchmark's figure: learning against forgetting, and validation loss
against time, one colour per group of methods."""
from __future__ import annotations

import math
from pathlib import Path

from benchmarks.quality_methods import QUALITY_MARGIN, REFERENCE, TASKS, method_named


# The figure's method groups, one colour each (a marker per method within a group).
GROUPS = {"PyTorch": "#222222", "LoRA": "#d62728", "pockjax whole blocks": "#1f77b4",
          "pockjax channels": "#2ca02c", "pockjax searched": "#9467bd",
          "pockjax schedule": "#ff7f0e", "pockjax low-bit frozen": "#8c564b"}
MARKERS = "osD^vPX*<>"


def group_of(method: str) -> str:
    """The figure's group of a method (by its row in `METHODS`)."""
    m = method_named(method)
    if m.kind == "torch":
        return "PyTorch"
    if m.kind == "peft" or m.scheme.startswith("lora:"):
        return "LoRA"
    if m.frozen != "float32":
        return "pockjax low-bit frozen"
    if m.scheme.startswith("@search"):
        return "pockjax searched"
    if m.scheme == "@blockwise":
        return "pockjax schedule"
    if m.scheme.startswith("@channels"):
        return "pockjax channels"
    return "pockjax whole blocks"


def styles(rows) -> dict[str, tuple[str, str]]:
    """`{method: (colour, marker)}` for the methods of `rows`, in their order."""
    out, used = {}, {}
    for r in rows:
        if r["kind"] == "pretrained" or r["method"] in out:
            continue
        g = group_of(r["method"])
        out[r["method"]] = (GROUPS[g], MARKERS[used.get(g, 0) % len(MARKERS)])
        used[g] = used.get(g, 0) + 1
    return out


def frontier(points) -> list[tuple[float, float]]:
    """The learning-forgetting frontier of `(forgetting, learning)` points: those no
    other point beats on both (forgets no more and learns at least as much), by
    forgetting."""
    best, out = -math.inf, []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if y > best:
            out.append((x, y))
            best = y
    return out


def plot(rows, path: Path, title: str = "") -> None:
    """The results figure, one column a task. Top: the learning-forgetting plane (the
    rise of the pretraining corpus's held-out loss against the share of full fine-tuning's
    test-loss gain; each method's mean over seeds with their standard deviation as
    error bars; the dashed line is the frontier). Bottom: validation loss against
    training seconds (as time to quality counts them; seed 0), with the time-to-quality
    target. One colour per group of methods (`GROUPS`), one marker per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    style = styles(rows)
    tasks = [t for t in TASKS if any(r["task"] == t for r in rows)]
    fig, axes = plt.subplots(2, len(tasks), figsize=(6.2 * len(tasks) + 3.2, 10),
                             squeeze=False)
    for col, task in enumerate(tasks):
        plane, curves = axes[0][col], axes[1][col]
        points, target = [], None
        for r in rows:
            if r["task"] != task or "runs" not in r or r["kind"] == "pretrained":
                continue
            colour, marker = style[r["method"]]
            s = r["summary"]
            if "gain_share" in s and "forgetting" in s:
                plane.errorbar(s["forgetting"], s["gain_share"], xerr=s["corpus_loss_sd"],
                               yerr=s["gain_share_sd"], fmt=marker, color=colour, ms=7,
                               mfc=colour if r["kind"] in ("torch", "peft") else "white",
                               mew=1.5, elinewidth=0.8, capsize=2)
                points.append((s["forgetting"], s["gain_share"]))
            curve, timing = r["runs"][0]["valid_curve"], r.get("timing")
            at = ([0.0 if c[1] == 0 else timing["first_step_s"] + (c[1] - 1) * timing["s_per_step"]
                   for c in curve] if timing else [c[0] for c in curve])
            curves.plot(at, [c[2] for c in curve], marker=marker, ms=4, lw=1, color=colour,
                        ls="--" if r["kind"] in ("torch", "peft") else "-",
                        mfc=colour if r["kind"] in ("torch", "peft") else "white")
            target = s.get("quality_target")
        if points:
            line = frontier(points + [(0.0, 0.0)])
            plane.plot(*zip(*line), "k--", lw=0.8, zorder=0)
            plane.plot([0], [0], "k+", ms=10)
            plane.annotate("pretrained", (0, 0), textcoords="offset points", xytext=(4, 4),
                           fontsize=8)
        plane.set_title(f"task: {task}: learning against forgetting")
        plane.set_xlabel("forgetting: rise of the pretraining corpus's held-out loss (nats)")
        plane.set_ylabel("learning: share of full fine-tuning's test-loss gain")
        plane.grid(alpha=0.3)
        if target:
            curves.axhline(target, color="#555", lw=0.8, ls=":")
        curves.set_title(f"task: {task}: validation loss against time (this CPU)")
        curves.set_xlabel("training seconds (first step's compilation included)")
        curves.set_ylabel("validation loss (nats/token)")
        curves.grid(alpha=0.3)
    handles = [Line2D([], [], color=c, marker=m, ls="none", ms=7,
                      mfc=c if method_named(name).kind in ("torch", "peft") else "white",
                      mew=1.5, label=name) for name, (c, m) in style.items()]
    handles.append(Line2D([], [], color="k", ls="--", lw=0.8, label="frontier"))
    handles.append(Line2D([], [], color="#555", ls=":", lw=0.8,
                          label=f"within {QUALITY_MARGIN:.0%} of {REFERENCE}'s final loss"))
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1 - 3.0 / (6.2 * len(tasks) + 3.2), 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)

