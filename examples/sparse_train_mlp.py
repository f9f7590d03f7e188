"""A sparse fine-tune with `@pockjax.sparse_train`, exported to IREE and run there.

A small MLP is fit to a random teacher. Only the last layer's bias and a quarter of the
input channels of the last two kernels train, with Adam fused into the backward pass.
The script prints the step's report (FLOPs and compiled memory against full training),
trains with a progress bar, checks the result against a plain JAX + optax reference,
saves and reloads a checkpoint, then exports the training step for the host CPU
through StableHLO and IREE, runs a few more steps in the artifact and checks them
against the JAX trainer.

    python examples/sparse_train_mlp.py [--steps 200] [--out /tmp/pockjax-demo] [--target host-cpu]
"""
import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pockjax as pj

WIDTH, LAYERS, BATCH = 256, 4, 64


def init(key):
    keys = jax.random.split(key, LAYERS)
    return {f"dense_{i}": {"kernel": jax.random.normal(k, (WIDTH, WIDTH)) / np.sqrt(WIDTH),
                           "bias": jnp.zeros(WIDTH)} for i, k in enumerate(keys)}


def forward(params, x):
    for i in range(LAYERS):
        x = x @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"]
        x = jax.nn.gelu(x) if i < LAYERS - 1 else x
    return x


SCHEME = pj.Scheme({
    f"dense_{LAYERS - 1}/bias": pj.Full(),
    f"dense_{LAYERS - 2}/kernel": pj.Channels(ratio=0.25, axis="in"),
    f"dense_{LAYERS - 1}/kernel": pj.Channels(ratio=0.25, axis="in"),
}, default=pj.Frozen())


@pj.sparse_train(optimizer=optax.adam(3e-3), scheme=SCHEME)
def trainer(params, batch):
    x, y = batch
    return jnp.mean((forward(params, x) - y) ** 2)


def make_batches(teacher, steps, seed=2):
    key = jax.random.PRNGKey(seed)
    out = []
    for _ in range(steps):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (BATCH, WIDTH))
        out.append((x, forward(teacher, x)))
    return out


def reference(params, batches):
    """The same training with dense jax.grad, sliced, and optax on the trainable view."""
    loss = trainer.loss_fn
    opt = optax.adam(3e-3)
    opt_state = opt.init(pj.trainable_view(params, SCHEME))

    @jax.jit
    def step(params, opt_state, batch):
        g = pj.trainable_view(jax.grad(loss)(params, batch), SCHEME)
        updates, opt_state = opt.update(g, opt_state, pj.trainable_view(params, SCHEME))
        return pj.apply_sparse_updates(params, updates, SCHEME), opt_state

    for b in batches:
        params, opt_state = step(params, opt_state, b)
    return params


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pockjax-demo"))
    ap.add_argument("--target", default="host-cpu", help="export target (host-cpu runs here)")
    args = ap.parse_args(argv)

    params = init(jax.random.PRNGKey(0))
    batches = make_batches(init(jax.random.PRNGKey(1)), args.steps)
    state = trainer.init(params)
    print(trainer.report(state, batches[0]), "\n")

    state, history = pj.fit(trainer, state, batches)
    print(f"loss {history.loss[0]:.4f} -> {history.loss[-1]:.4f} in {history.steps} steps "
          f"({history.steps_per_second:.0f} steps/s)")

    want = reference(params, batches)
    err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
              for a, b in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(want)))
    print(f"max relative difference to the JAX + optax reference: {err:.2e}")
    assert err < 1e-4, "sparse_train does not match the reference"

    path = os.path.join(args.out, "mlp.safetensors")
    pj.save(path, state)
    restored = pj.load(path, like=state)
    assert int(restored.step) == args.steps
    print(f"checkpoint written and reloaded: {path} (step {int(restored.step)})")

    # Export the step from the trained state and keep training on IREE.
    art_dir = os.path.join(args.out, "artifact")
    art = trainer.export(restored, batches[0], target=args.target, out_dir=art_dir)
    files = ", ".join(f"{k} {v['bytes']:,} B" for k, v in art.manifest["files"].items())
    print(f"exported for {args.target}: {art_dir} ({files})")
    sess = pj.runtime.load(art_dir, device=art.manifest["target"]["driver"])
    jax_state = restored
    for i, batch in enumerate(batches[:5]):
        got = sess.step(batch)
        jax_state, want = trainer(jax_state, batch)
        print(f"artifact step {i + 1}: loss {float(got['loss']):.6f} (JAX {float(want['loss']):.6f})")
    err = max(float(np.max(np.abs(a - np.asarray(b))) / (np.max(np.abs(np.asarray(b))) + 1e-12))
              for a, b in zip(jax.tree_util.tree_leaves(sess.params()),
                              jax.tree_util.tree_leaves(jax_state.params)))
    print(f"max relative parameter difference, IREE artifact vs JAX after 5 steps: {err:.2e}")
    assert err < 1e-4, "the exported artifact does not match the JAX trainer"


if __name__ == "__main__":
    main()
