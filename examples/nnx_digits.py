"""A Flax NNX training loop in the style of the Flax docs, with `pj.nnx.Trainer` as the step.

A small CNN learns scikit-learn's bundled 8x8 digits. Where the Flax docs write a
`train_step` with `nnx.value_and_grad` and `nnx.Optimizer`, the trainer runs pockjax's
compiled step: sparse backward, fused in-place Adam. NNX filters choose what trains:
here half of the first dense layer's input channels are frozen at their random
initial values (a channel-sparse layer), everything else trains.

    python examples/nnx_digits.py [--epochs 10]
"""
import argparse

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import pockjax as pj


class CNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 32, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(4 * 4 * 32, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


def loss_fn(model, batch):
    logits = model(batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return loss, logits


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1400], order[1400:]

    model = CNN(rngs=nnx.Rngs(0))
    trainer = pj.nnx.Trainer(
        model, loss_fn, optimizer=optax.adamw(3e-3), has_aux=True,
        scheme=[(nnx.All(nnx.PathContains("linear1"), nnx.PathContains("kernel")),
                 pj.Channels(ratio=0.5, axis="in")),
                (nnx.Param, pj.Full())])
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    rng = np.random.default_rng(1)

    for epoch in range(args.epochs):
        for idx in np.array_split(rng.permutation(train), len(train) // args.batch):
            batch = {"image": images[idx], "label": labels[idx]}
            out = trainer(batch)                       # the training step
            metrics.update(loss=out["loss"], logits=out["aux"], labels=batch["label"])
        train_metrics = metrics.compute()
        metrics.reset()
        trainer.update(model)                          # trained weights into the module
        test_logits = model(images[test])
        accuracy = float(jnp.mean(jnp.argmax(test_logits, -1) == labels[test]))
        print(f"epoch {epoch + 1:2d}: train loss {float(train_metrics['loss']):.4f}, "
              f"train accuracy {100 * float(train_metrics['accuracy']):.1f}%, "
              f"test accuracy {100 * accuracy:.1f}%")
    print()
    print(trainer.report({"image": images[:args.batch], "label": labels[:args.batch]}))
    return accuracy


if __name__ == "__main__":
    main()
