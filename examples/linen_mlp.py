"""A Flax Linen model with `@pockjax.sparse_train`: the loss calls `model.apply` as usual.

An MLP is pretrained on scikit-learn's digits 0-4, then its last two layers are
fine-tuned on 5-9 (a fresh output layer trains whole, the hidden layer before it trains
a quarter of its input channels). Linen's parameter names are the scheme's paths:
`Dense_0/kernel`, `Dense_1/bias`, ...

    python examples/linen_mlp.py [--steps 300]
"""
import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from sklearn.datasets import load_digits

import pockjax as pj


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(5)(x)


model = MLP()


def loss(params, batch):
    x, y = batch
    logits = model.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def data(classes):
    digits = load_digits()
    keep = np.isin(digits.target, classes)
    x = (digits.data[keep] / 16.0).astype(np.float32)
    y = np.searchsorted(classes, digits.target[keep]).astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    cut = int(0.8 * len(y))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def batches(x, y, steps, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        idx = rng.integers(0, len(y), 32)
        yield x[idx], y[idx]


def accuracy(params, x, y) -> float:
    return float(jnp.mean(jnp.argmax(model.apply({"params": params}, x), -1) == y))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    (x0, y0), (tx0, ty0) = data(np.arange(5))
    (x1, y1), (tx1, ty1) = data(np.arange(5, 10))

    params = model.init(jax.random.key(0), x0[:1])["params"]
    pretrain = pj.sparse_train(loss, optimizer=optax.adam(1e-3))   # everything trains
    state, _ = pj.fit(pretrain, pretrain.init(params), batches(x0, y0, args.steps, 0),
                      desc="pretrain 0-4")
    print(f"digits 0-4: {100 * accuracy(state.params, tx0, ty0):.1f}%")

    params = dict(state.params)
    params["Dense_2"] = model.init(jax.random.key(1), x0[:1])["params"]["Dense_2"]  # new head
    scheme = pj.Scheme({"Dense_1/kernel": pj.Channels(ratio=0.25, axis="in"),
                        "Dense_1/bias": pj.Full(), "Dense_2/**": pj.Full()})
    finetune = pj.sparse_train(loss, optimizer=optax.adam(1e-3), scheme=scheme)
    state = finetune.init(params)
    print(finetune.report(state, (x1[:32], y1[:32])))
    state, _ = pj.fit(finetune, state, batches(x1, y1, args.steps, 1), desc="fine-tune 5-9")
    acc = accuracy(state.params, tx1, ty1)
    print(f"digits 5-9 after sparse fine-tuning: {100 * acc:.1f}%")
    return acc


if __name__ == "__main__":
    main()
