"""Transfer learning on scikit-learn's bundled handwritten digits with MobileNetV2.

A small MobileNetV2 (width 0.35, 16x16 inputs) is pretrained on the digits 0-4, then
fine-tuned on the digits 5-9 with a fresh classifier, four ways:

- full: every parameter;
- sparse: PockEngine's MobileNetV2 scheme (`pockjax.schemes.mobilenetv2`): the first
  point-wise convolution of every inverted-residual block, those blocks' batch norms and
  the classifier; depth-wise and projection convolutions stay frozen;
- bias-only: every bias (the batch norms' and the classifier's) and the classifier;
- last layer: the classifier only.

Batch norm runs in training mode while tuning (running statistics updated) and in eval
mode for the accuracy. The script prints test accuracy, step time and the compiled
step's memory for each method and writes the curves to `OUT/digits_curves.png`.

    python examples/digits_transfer.py [--pretrain-steps 200] [--steps 200] [--out out/digits] [--fast]
"""
import argparse
import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pockjax as pj
from pockjax.models.mobilenetv2 import INVERTED_RESIDUAL_SETTINGS, MobileNetV2
from reporting import plot_loss_curves, print_table

SIZE, BATCH, WIDTH = 16, 32, 0.35


def load(classes, seed: int = 0):
    """Train and test splits (80/20) of the digits in `classes`, images [N, 16, 16, 1] in [0, 1],
    labels 0..len(classes)-1."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    keep = np.isin(digits.target, classes)
    images = digits.images[keep].astype(np.float32) / 16.0
    images = np.kron(images, np.ones((SIZE // 8, SIZE // 8), np.float32))[..., None]
    labels = np.searchsorted(classes, digits.target[keep]).astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(labels))
    cut = int(0.8 * len(order))
    return (images[order[:cut]], labels[order[:cut]]), (images[order[cut:]], labels[order[cut:]])


def batches(images, labels, seed: int):
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(labels))
        for i in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[i:i + BATCH]
            # Random shifts by up to one pixel: the training sets are small.
            dx, dy = rng.integers(-1, 2, size=2)
            yield np.roll(images[idx], (dy, dx), axis=(1, 2)), labels[idx]


def xent(model, batch):
    images, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()


@nnx.jit
def predict(model, images):
    return jnp.argmax(model(images), -1)


def accuracy(model, images, labels) -> float:
    model.eval()
    right = sum(int(jnp.sum(predict(model, images[i:i + 256]) == labels[i:i + 256]))
                for i in range(0, len(labels), 256))
    model.train()
    return right / len(labels)


def pretrained(steps: int, settings=INVERTED_RESIDUAL_SETTINGS) -> MobileNetV2:
    """The MobileNetV2 (stages `settings`) trained on digits 0-4 for `steps` steps (a 5-way
    classifier)."""
    (pre_x, pre_y), _ = load(np.arange(0, 5))
    model = MobileNetV2(5, width_mult=WIDTH, input_size=SIZE, in_channels=1, settings=settings,
                        rngs=nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 10, 1), steps)
    trainer = pj.nnx.Trainer(model, xent, optimizer=optax.adamw(schedule, weight_decay=1e-4))
    trainer.fit(batches(pre_x, pre_y, seed=0), steps, desc="pretrain 0-4")
    trainer.update(model)
    return model


def methods(model) -> dict:
    """Each method's scheme and peak learning rate (the partial ones take a larger one)."""
    head = [("classifier/**", pj.Full())]
    return {
        "full": (pj.Scheme(default=pj.Full()), 2e-3),
        "sparse": (pj.schemes.mobilenetv2(model, norms=True), 5e-3),
        "bias-only": (pj.Scheme([*pj.schemes.bias_only(model).rules, *head]), 5e-3),
        "last layer": (pj.Scheme(head), 5e-3),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrain-steps", type=int, default=200)
    ap.add_argument("--steps", type=int, default=200, help="fine-tuning steps per method")
    ap.add_argument("--out", default="out/digits")
    ap.add_argument("--fast", action="store_true",
                    help="a quick run for tests: 20 + 10 steps, and the first two stages of "
                         "the network (3 of its 17 blocks), which compile in a fraction of the time")
    args = ap.parse_args(argv)
    settings = INVERTED_RESIDUAL_SETTINGS
    if args.fast:
        args.pretrain_steps, args.steps = 20, 10
        settings = INVERTED_RESIDUAL_SETTINGS[:2]
    os.makedirs(args.out, exist_ok=True)

    (pre_x, pre_y), (pre_tx, pre_ty) = load(np.arange(0, 5))
    (new_x, new_y), (test_x, test_y) = load(np.arange(5, 10))
    print(f"pretraining on digits 0-4: {len(pre_y)} images; fine-tuning on 5-9: "
          f"{len(new_y)} images, {len(test_y)} held out")

    model = pretrained(args.pretrain_steps, settings)
    print(f"pretrained: {100 * accuracy(model, pre_tx, pre_ty):.1f}% on held-out digits 0-4")

    rows, curves = [], {}
    for name, (scheme, lr) in methods(model).items():
        tuned = nnx.clone(model)
        tuned.classifier = nnx.Linear(model.last_channels, 5, rngs=nnx.Rngs(1))
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, args.steps // 10, args.steps)
        trainer = pj.nnx.Trainer(tuned, xent, optimizer=optax.adam(schedule), scheme=scheme)
        data = batches(new_x, new_y, seed=1)
        first = next(data)
        report = trainer.report(first)
        trainer(first)  # compiles; the timed steps below exclude it
        history = trainer.fit(data, args.steps - 1, desc=name)
        trainer.update(tuned)
        curves[name] = history.loss
        rows.append({"method": name, "trained": f"{report.trainable_params:,}", "lr": f"{lr:g}",
                     "accuracy": f"{100 * accuracy(tuned, test_x, test_y):.1f}%",
                     "final loss": f"{history.loss[-20:].mean():.3f}",
                     "step ms": f"{1e3 * history.seconds / max(history.steps, 1):.1f}",
                     "step memory": pj.format_bytes(report.memory["peak"]),
                     "FLOPs": f"{report.flops / 1e9:.2f} G"})

    print()
    print_table(rows)
    print(f"\n(accuracy on {len(test_y)} held-out images of 5-9; step memory is the compiled "
          "step's peak estimate from XLA)")
    png = os.path.join(args.out, "digits_curves.png")
    plot_loss_curves(curves, png, "MobileNetV2 transfer, digits 0-4 -> 5-9")
    print(f"loss curves: {png}")
    return rows


if __name__ == "__main__":
    main()
