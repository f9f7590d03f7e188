"""Small models with sparse schemes (Full, Frozen and Channels leaves) for export tests."""
import warnings

import jax
import jax.numpy as jnp
import optax

import pockjax as pj


def _normal(key, i, shape, scale):
    return jax.random.normal(jax.random.fold_in(key, i), shape) * scale


def mlp():
    k = jax.random.PRNGKey(0)
    params = {f"l{i}": {"w": _normal(k, i, (16, 16), 0.3), "b": jnp.zeros(16)} for i in range(3)}

    def loss(p, batch):
        h = batch["x"]
        for i in range(3):
            h = jax.nn.gelu(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - batch["y"]) ** 2)

    scheme = pj.Scheme({"l0/**": pj.Frozen(), "l1/w": pj.Channels(ratio=0.25, axis="in"),
                        "l2/w": pj.Channels(ratio=0.5, axis="out")}, default=pj.Full())
    batch = {"x": _normal(k, 10, (8, 16), 1.0), "y": _normal(k, 11, (8, 16), 0.5)}
    return loss, params, scheme, batch


def cnn():
    """conv -> avg pool -> conv -> max pool -> dense."""
    k = jax.random.PRNGKey(1)
    params = {"c0": {"w": _normal(k, 0, (3, 3, 3, 8), 0.3), "b": jnp.zeros(8)},
              "c1": {"w": _normal(k, 1, (3, 3, 8, 8), 0.2), "b": jnp.zeros(8)},
              "head": {"w": _normal(k, 2, (2 * 2 * 8, 4), 0.2), "b": jnp.zeros(4)}}

    def conv(x, w, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(y + b)

    def loss(p, batch):
        h = conv(batch["x"], p["c0"]["w"], p["c0"]["b"])
        h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
        h = conv(h, p["c1"]["w"], p["c1"]["b"])
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        logits = h.reshape(h.shape[0], -1) @ p["head"]["w"] + p["head"]["b"]
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * batch["y"], axis=-1))

    scheme = pj.Scheme({"c0/**": pj.Frozen(), "c1/w": pj.Channels(ratio=0.5, axis="out"),
                        "c1/b": pj.Frozen()}, default=pj.Full())
    batch = {"x": _normal(k, 10, (4, 8, 8, 3), 1.0),
             "y": jax.nn.one_hot(jnp.arange(4) % 4, 4)}
    return loss, params, scheme, batch


def transformer():
    """One pre-LayerNorm block: multi-head attention and an MLP, token embedding via take."""
    k = jax.random.PRNGKey(2)
    d, heads, vocab, seq = 16, 2, 11, 6
    params = {"embed": _normal(k, 0, (vocab, d), 0.5),
              "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
              "attn": {n: _normal(k, i + 1, (d, d), 0.25) for i, n in enumerate("qkvo")},
              "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
              "mlp": {"up": _normal(k, 5, (d, 2 * d), 0.25), "down": _normal(k, 6, (2 * d, d), 0.25)},
              "out": _normal(k, 7, (d, vocab), 0.25)}

    def ln(x, p):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]

    def loss(p, batch):
        x = jnp.take(p["embed"], batch["tokens"], axis=0)
        h = ln(x, p["ln1"])
        b, t, _ = h.shape
        split = lambda y: y.reshape(b, t, heads, d // heads)
        q, kk, v = (split(h @ p["attn"][n]) for n in "qkv")
        att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, kk) / jnp.sqrt(d // heads), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d) @ p["attn"]["o"]
        x = x + jax.nn.gelu(ln(x, p["ln2"]) @ p["mlp"]["up"]) @ p["mlp"]["down"]
        logits = x @ p["out"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][..., None], -1))

    scheme = pj.Scheme({"embed": pj.Frozen(), "attn/[qv]": pj.Channels(ratio=0.5, axis="out"),
                        "attn/[ko]": pj.Frozen(), "mlp/up": pj.Channels(ratio=0.25, axis="in"),
                        "mlp/down": pj.Frozen()}, default=pj.Full())
    tokens = jax.random.randint(jax.random.fold_in(k, 10), (2, seq), 0, vocab)
    batch = {"tokens": tokens, "labels": jnp.roll(tokens, -1, axis=1)}
    return loss, params, scheme, batch


def scanned():
    """A stack of 4 tanh layers run by lax.scan after a dense layer, with an aux output;
    only the last 2 layers of the stack train (the scan is split)."""
    k = jax.random.PRNGKey(3)
    params = {"inp": _normal(k, 0, (12, 16), 0.3), "stack": _normal(k, 1, (4, 16, 16), 0.3),
              "head": _normal(k, 2, (16, 3), 0.3)}

    def loss(p, batch):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"] @ p["inp"], p["stack"])
        out = h @ p["head"]
        return jnp.mean((out - batch["y"]) ** 2), {"out_mean": jnp.mean(out)}

    scheme = pj.Scheme({"stack": pj.Channels(count=2, axis=0, last=True)}, default=pj.Full())
    batch = {"x": _normal(k, 10, (8, 12), 1.0), "y": _normal(k, 11, (8, 3), 0.5)}
    return loss, params, scheme, batch


def classifier():
    """An MLP classifier trained with optax's integer-label cross entropy (its
    `take_along_axis` is a gather with batching dimensions) over 32 examples: IREE's CUDA
    code generation failed on that gather fused into the batch mean (see
    `pockjax.transforms.legalize`). The labels include the first and the last class."""
    k = jax.random.PRNGKey(4)
    sizes = [(16, 32), (32, 32), (32, 10)]
    params = {f"l{i}": {"w": _normal(k, i, shape, 0.3), "b": jnp.zeros(shape[1])}
              for i, shape in enumerate(sizes)}

    def loss(p, batch):
        h = batch["x"]
        for i in range(2):
            h = jax.nn.relu(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        logits = h @ p["l2"]["w"] + p["l2"]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    scheme = pj.Scheme({"l0/**": pj.Frozen(), "l1/w": pj.Channels(ratio=0.25, axis="in")},
                       default=pj.Full())
    batch = {"x": _normal(k, 10, (32, 16), 1.0), "label": jnp.arange(32, dtype=jnp.int32) % 10}
    return loss, params, scheme, batch


def mobilenetv2():
    """`pockjax.models.MobileNetV2` through `pj.nnx.Trainer`: batch norm's running
    statistics are batch inputs (`model_state/...`) and aux outputs; integer-label cross
    entropy; the classifier and the last expansion conv's input channels train."""
    from flax import nnx

    from pockjax.models.mobilenetv2 import MobileNetV2

    from tests.helpers import MOBILENETV2_STAGES

    model = MobileNetV2(4, width_mult=0.35, input_size=16, in_channels=1,
                        settings=MOBILENETV2_STAGES, rngs=nnx.Rngs(0))

    def loss(model, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    scheme = pj.schemes.mobilenetv2(model, last=1, ratio=0.5, axis="in")
    trainer = pj.nnx.Trainer(model, loss, optimizer=optax.sgd(0.1, momentum=0.9), scheme=scheme)
    batch = (jax.random.normal(jax.random.key(0), (16, 16, 16, 1)),
             jnp.arange(16, dtype=jnp.int32) % 4)
    return trainer, batch


def llama():
    """A tiny `pockjax.models.Llama` (2 blocks, grouped-query attention) through
    `pj.nnx.Trainer`, next-token integer-label cross entropy over 2 x 16 positions, with
    PockEngine's transformer scheme on the last block (a quarter of the channels) and the
    output head."""
    from flax import nnx

    from pockjax.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))

    def loss(model, tokens):
        logits = model(tokens)[:, :-1]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    scheme = pj.schemes.transformer(model, last=1, ratio=0.25, extra=["lm_head/**"])
    trainer = pj.nnx.Trainer(model, loss, optimizer=optax.adam(1e-3), scheme=scheme)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, model.config.vocab_size)
    return trainer, tokens


# Run against the JAX trainer on every target that runs here.
MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer, "scanned": scanned, "clipped": mlp,
          "classifier": classifier}
# Larger models, compiled (not run) for every target (tests/export/test_targets.py).
COMPILE_ONLY = {"mobilenetv2": mobilenetv2, "llama": llama}

# The optimizer per model: adam, except a chain that needs every gradient before any
# update (global mode) for "clipped", and plain SGD for "classifier".
OPTIMIZERS = {"clipped": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
              "classifier": lambda: optax.sgd(0.1)}


def make(name):
    """(trainer, params, batch) of a model in MODELS or COMPILE_ONLY. An NNX model's
    trainer is its `pj.nnx.Trainer`'s `SparseTrainer`, whose batch carries the module's
    other state (`{"batch": ..., "model_state": ...}`) where it has some."""
    if name in COMPILE_ONLY:
        nnx_trainer, batch = COMPILE_ONLY[name]()
        if nnx_trainer.rest:
            batch = {"batch": batch, "model_state": nnx_trainer.rest}
        return nnx_trainer.sparse, nnx_trainer.params(), batch
    loss, params, scheme, batch = MODELS[name]()
    optimizer = OPTIMIZERS.get(name, lambda: optax.adam(1e-2))()
    trainer = pj.sparse_train(loss, optimizer=optimizer, scheme=scheme, has_aux=name == "scanned")
    return trainer, params, batch


def eval_loss(trainer, params, batch):
    """The JAX loss (without aux) that an artifact's `eval` must match."""
    out = trainer.loss_fn(params, batch)
    return out[0] if trainer.has_aux else out


def assert_metrics_match(got, want, rtol=1e-4):
    """An artifact's step metrics against the JAX trainer's: loss and every aux leaf."""
    import numpy as np

    np.testing.assert_allclose(got["loss"], want["loss"], rtol=rtol)
    aux = pj.scheme.leaves_with_paths(want.get("aux"))[0] if "aux" in want else []
    assert sorted(got) == sorted(["loss"] + [f"aux/{p}" if p else "aux" for p, _ in aux])
    for p, x in aux:
        np.testing.assert_allclose(got[f"aux/{p}" if p else "aux"], x, rtol=rtol, atol=1e-6)


def run_against_jax(sess, trainer, params, batch, steps=3):
    """`steps` steps of an artifact session and of the JAX trainer side by side: metrics
    each step, then parameters (rtol 1e-4) and the step count. Returns the JAX state."""
    from tests.helpers import assert_trees_close

    state = trainer.init(params)
    for _ in range(steps):
        got = sess.step(batch)
        state, want = jax.block_until_ready(trainer(state, batch))  # not beside the next step
        assert_metrics_match(got, want)
    assert_trees_close(sess.params(), jax.device_get(state.params), rtol=1e-4, atol=1e-6)
    assert sess.step_count == steps
    return state


def run_vulkan_against_jax(path, trainer, params, batch, steps=3, attempts=3):
    """`run_against_jax` for an artifact on the Vulkan device, from a fresh load.

    lavapipe (Debian 12's Mesa 22.3) loses the device at random under IREE 3.13: IREE's
    queue threads can signal a timeline semaphore out of order and lavapipe's emulated
    timelines treat that as device loss (docs/export.md, "Vulkan on lavapipe: device loss"). The runtime
    raises `DeviceLost` and opens a new device on the next load; here the whole run is
    repeated from the artifact's initial state, with a warning, at most `attempts` times.
    Every repeated run is checked in full; any other failure is not repeated."""
    from pockjax import runtime

    for attempt in range(1, attempts + 1):
        try:
            return run_against_jax(runtime.load(path, device="vulkan"), trainer, params,
                                   batch, steps)
        except runtime.DeviceLost as e:
            if attempt == attempts:
                raise
            warnings.warn(f"attempt {attempt}: {e}; repeating the run on a new device")
