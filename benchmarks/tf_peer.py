"""TensorFlow, PockEngine's peer: one Keras model trained by TensorFlow and by pockjax in
one run, each row in its own process.

Workload: `keras.applications.MobileNetV2` (`weights=None`, 10 classes, logits out),
built once with seed 0 and saved as a `.keras` file that every row loads; random images
and labels (seed 0); Adam at 1e-4 (epsilon 1e-7, Keras's default, in every row); sparse
categorical cross-entropy on the logits; BatchNorm in training mode where it trains.

Rows:
- `tensorflow full`: Keras 3 on TensorFlow, `model.compile(...)` then
  `model.train_on_batch` (the `tf.function` step `model.fit` runs).
- `tensorflow full XLA`: the same compiled with `jit_compile=True` (TensorFlow's XLA).
- `tensorflow sparse`: the layers `pj.schemes.mobilenetv2(norms=True)` freezes set
  `trainable=False`, TensorFlow's way to freeze: no gradients for their variables, and
  Keras runs their BatchNorm layers in inference mode.
- `pockjax full`: the same file under Keras's JAX backend, trained by
  `pockjax.keras.Trainer` with every variable.
- `pockjax sparse`: the same, with the flags of `tensorflow sparse` (`trainable=False`
  on the same layers): the like-for-like row, whose losses equal TensorFlow's.
- `pockjax sparse (scheme)`: every layer left trainable in Keras and
  `pj.schemes.mobilenetv2(norms=True)` given to the trainer: the same variables train,
  but the frozen BatchNorm layers stay in training mode (batch statistics), so its loss
  differs from the two rows above by design.
- `pockjax full, XLA's convolutions` and `pockjax sparse, XLA's convolutions`: the
  same as `pockjax full` and `pockjax sparse` with `POCKJAX_CONVOLUTIONS=xla`, the
  depth-wise and 1x1 convolutions left to XLA (`pockjax.transforms.convolutions`).

The losses of every row's steps are printed, so speed is compared at equal results:
`tensorflow full`, `tensorflow full XLA` and `pockjax full` compute the same steps,
as do `tensorflow sparse` and `pockjax sparse`.

`--quick`: width 0.5, 64x64 images, batch 8. Writes benchmarks/results/tf_peer.md
(`tf_peer_quick.md` with `--quick`) and the rows' JSON beside it.

    python -m benchmarks tf_peer [--quick] [--steps 10] [--warmup 3] [--rounds 1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (ROOT, commit, report_result, run_row,  # noqa: E402
                               timed_steps, versions)

ROWS = ["tensorflow full", "tensorflow full XLA", "tensorflow sparse", "pockjax full",
        "pockjax sparse", "pockjax sparse (scheme)", "pockjax full, XLA's convolutions",
        "pockjax sparse, XLA's convolutions"]
# Rows run with POCKJAX_CONVOLUTIONS=xla: the depth-wise and 1x1 convolutions left to XLA
# (pockjax.transforms.convolutions off).
XLA_CONVOLUTIONS = ", XLA's convolutions"
SAME = [("tensorflow full", "tensorflow full XLA", "pockjax full",
         "pockjax full, XLA's convolutions"),
        ("tensorflow sparse", "pockjax sparse", "pockjax sparse, XLA's convolutions")]
LR, EPS = 1e-4, 1e-7


def sizes(quick: bool) -> dict:
    return ({"alpha": 0.5, "size": 64, "batch": 8} if quick
            else {"alpha": 1.0, "size": 128, "batch": 16})


def build(path: str, s: dict) -> None:
    """Keras's MobileNetV2 with seed-0 weights, saved to `path`; reports the layers the
    sparse rows freeze (run under Keras's JAX backend)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(
        input_shape=(s["size"], s["size"], 3), alpha=s["alpha"], weights=None, classes=10,
        classifier_activation=None)
    model.save(path)
    report_result({"frozen": frozen_layers(model)})


def data(s: dict):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(s["batch"], s["size"], s["size"], 3)).astype("float32")
    return x, rng.integers(0, 10, size=(s["batch"],)).astype("int32")


def frozen_layers(model) -> list[str]:
    """The names of the layers `pj.schemes.mobilenetv2(norms=True)` leaves frozen whole."""
    import pockjax as pj

    params, _ = pj.keras.functional(model)
    decisions = pj.schemes.mobilenetv2(params, norms=True).resolve(params)
    trained = {path.split("/")[-2] for path, d in
               pj.scheme.leaves_with_paths(decisions)[0] if not isinstance(d, pj.Frozen)}
    return [l.name for l in model.layers if l.weights and l.name not in trained]


def row(name: str, path: str, frozen: list[str], s: dict, steps: int, warmup: int) -> None:
    name = name.removesuffix(XLA_CONVOLUTIONS)
    if name.startswith("pockjax"):
        import pockjax  # noqa: F401  (before Keras starts JAX, as docs/keras.md says)
    import keras

    model = keras.saving.load_model(path)
    x, y = data(s)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if name != "pockjax sparse (scheme)" and "sparse" in name:
        for layer_name in frozen:
            model.get_layer(layer_name).trainable = False
    trainable = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    if name.startswith("tensorflow"):
        model.compile(optimizer=keras.optimizers.Adam(LR, epsilon=EPS), loss=loss,
                      jit_compile=name.endswith("XLA"))

        def step():
            return float(np.asarray(model.train_on_batch(x, y)).ravel()[0])
    else:
        import optax

        import pockjax as pj

        scheme = None
        if name == "pockjax sparse (scheme)":
            scheme = pj.schemes.mobilenetv2(pj.keras.functional(model)[0], norms=True)
        trainer = pj.keras.Trainer(model, loss, optimizer=optax.adam(LR, eps=EPS),
                                   scheme=scheme)
        if scheme is not None:
            decisions = pj.scheme.leaves_with_paths(scheme.resolve(trainer.params()))[0]
            trainable = int(sum(np.prod(np.shape(v)) for (p, v), (_, d) in zip(
                pj.scheme.leaves_with_paths(trainer.params())[0], decisions)
                if not isinstance(d, pj.Frozen)))

        def step():
            return float(trainer((x, y))["loss"])
    losses, times = timed_steps(step, steps, warmup)
    report_result({"losses": losses, "times": times, "trainable": trainable})


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=None, help="the results page (default benchmarks/"
                                                "results/tf_peer[_quick].md)")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--frozen", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = sizes(args.quick)
    if args.row:
        row(args.row, args.model, args.frozen.split(","), s, args.steps, args.warmup)
        return
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   "tf_peer_quick.md" if args.quick else "tf_peer.md")
    results: dict[str, list[dict]] = {r: [] for r in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mobilenetv2.keras")
        env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = run_row(["-c", f"import sys; sys.path.insert(0, {ROOT!r}); from benchmarks."
                        f"tf_peer import build; build({path!r}, {s!r})"], args.timeout, env)
        if "error" in done:
            sys.exit(f"building the model failed: {done['error']}")
        frozen = ",".join(done["frozen"])
        for r in range(args.rounds):
            for name in ROWS:
                env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "KERAS_BACKEND":
                       "tensorflow" if name.startswith("tensorflow") else "jax"}
                if name.endswith(XLA_CONVOLUTIONS):
                    env["POCKJAX_CONVOLUTIONS"] = "xla"
                cmd = [os.path.abspath(__file__), "--row", name, "--model", path, "--frozen", frozen,
                       "--steps", str(args.steps), "--warmup", str(args.warmup)]
                got = run_row(cmd + (["--quick"] if args.quick else []), args.timeout, env)
                results[name].append(got)
                print(f"round {r + 1} {name}: " + (got.get("error") or
                      f"{statistics.median(got['times']):.4f} s/step, "
                      f"peak RSS {got['rss_peak_mib']:.0f} MiB"), flush=True)
    page = report(results, s, args)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(page)
    with open(out[:-3] + ".json", "w") as f:
        json.dump({"sizes": s, "rows": results}, f, indent=1)
    print(page)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [l.split(":", 1)[1].strip() for l in f if l.startswith("model name")]
        return f"{names[0]}, {len(names)} cores" if names else platform.processor()
    except OSError:
        return platform.processor() or "unknown CPU"


def report(results: dict, s: dict, args) -> str:
    lines = [f"# TensorFlow against pockjax on one Keras model\n",
             f"`python -m benchmarks tf_peer{' --quick' if args.quick else ''} --steps "
             f"{args.steps} --warmup {args.warmup} --rounds {args.rounds}`: "
             f"`keras.applications.MobileNetV2` (width {s['alpha']}, {s['size']}x"
             f"{s['size']} images, 10 classes, batch {s['batch']}), one `.keras` file for "
             f"every row, Adam 1e-4; each row in its own process; s/step is the median of "
             f"the timed steps (with several rounds, the median of the rounds' medians and "
             f"their range).\n",
             f"CPU: {_cpu()}; {versions(['tensorflow', 'keras', 'jax', 'tf2jax'])}; Python "
             f"{platform.python_version()}; commit {commit()}.\n",
             "| row | trained parameters | s/step | vs tensorflow full | peak RSS MiB | "
             "loss, first step | loss, last step |", "|---|---:|---:|---:|---:|---:|---:|"]

    def med(name):
        ok = [statistics.median(g["times"]) for g in results[name] if "error" not in g]
        return (statistics.median(ok), min(ok), max(ok)) if ok else None

    base = med("tensorflow full")
    for name in ROWS:
        got = [g for g in results[name] if "error" not in g]
        if not got:
            lines.append(f"| {name} | | {results[name][0]['error']} | | | | |")
            continue
        m, lo, hi = med(name)
        spread = f" ({lo:.3f}-{hi:.3f})" if len(got) > 1 else ""
        ratio = f"{base[0] / m:.2f}x" if base else ""
        lines.append(f"| {name} | {got[0]['trainable']:,} | {m:.3f}{spread} | {ratio} | "
                     f"{max(g['rss_peak_mib'] for g in got):.0f} | {got[0]['losses'][0]:.5f} | "
                     f"{got[0]['losses'][-1]:.5f} |")
    lines.append("\n\"vs tensorflow full\" is how many times faster than TensorFlow's full "
                 "step the row is. The rows computing the same steps, and the largest "
                 "difference of their losses over every step:\n")
    for group in SAME:
        got = [results[n][0] for n in group if "error" not in results[n][0]]
        if len(got) > 1:
            diff = max(abs(a - b) for g in got[1:] for a, b in
                       zip(got[0]["losses"], g["losses"]))
            lines.append(f"- {', '.join(group)}: {diff:.2e}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
