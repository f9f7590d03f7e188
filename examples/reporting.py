"""Printing and plotting shared by the examples: a text table and loss-curve PNGs."""
from __future__ import annotations

import os

import numpy as np


def print_table(rows: list[dict]) -> None:
    """Rows of equal keys as right-aligned columns under their keys."""
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in keys}
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(r[k].rjust(widths[k]) for k in keys))


def save_figure(fig, path: str) -> None:
    """Write a matplotlib figure as PNG atomically (temporary file, then rename), and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    plt.close(fig)


def figure():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(6, 4))


def plot_loss_curves(curves: dict[str, np.ndarray], path: str, title: str) -> None:
    """Each method's training loss, as a 10-step running mean on a log scale."""
    fig, ax = figure()
    for name, loss in curves.items():
        smooth = np.convolve(loss, np.ones(10) / 10, mode="valid")
        ax.plot(np.arange(len(smooth)) + 10, smooth, label=name)
    ax.set(xlabel="step", ylabel="training loss (10-step mean)", yscale="log", title=title)
    ax.legend()
    save_figure(fig, path)
