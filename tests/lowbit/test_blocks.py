"""GGUF's block formats (`pockjax.lowbit.Blocks`): decoding inside the step against
`gguf.quants.dequantize` bit for bit (tensors gguf quantizes, and random bytes of the
K-quants, which it does not quantize), in both layouts and in 32-bit words; the loss and
gradients on stored blocks against `jax.grad` on the decoded weights; lookups, products
in pieces, and a weight trained in part over its blocks."""
from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pockjax as pj
from pockjax import lowbit
from pockjax.lowbit._blocks import BLOCK_TYPES, Blocks, join_blocks, split_blocks

TYPES = list(BLOCK_TYPES)
# Where each K-quant keeps its float16 scales (d, and dmin where it has one).
_HALVES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_bytes(values: np.ndarray, name: str, seed: int = 0) -> np.ndarray:
    """`values [rows, n]` as GGUF type `name`'s bytes `[rows, row bytes]`: quantized by
    gguf where it can; for the K-quants, random codes and sub-scales under float16 scales
    that include exact zeros, subnormals and negative values."""
    qtype = gguf.GGMLQuantizationType[name]
    if not name.endswith("_K"):
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, n = values.shape
    raw = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    scales = rng.uniform(-0.02, 0.02, (rows, n // block)).astype(np.float16)
    scales[0, 0] = 0.0
    scales[-1, -1] = np.float16(3e-7)          # a subnormal float16
    for at in _HALVES[name]:
        raw[..., at:at + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def node(values_out_in: np.ndarray, name: str, *, transposed: bool = True, seed: int = 0):
    """A `Quantized` `Blocks` node of `values [out, in]` (GGUF's layout): an `[in, out]`
    kernel (blocks along axis 0) when `transposed`, else `[out, in]` (along axis 1)."""
    raw = gguf_bytes(values_out_in, name, seed)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(values_out_in.shape)
    data, d = split_blocks(raw, Blocks(name))
    if transposed:
        q = lowbit.Quantized(jnp.asarray(data.T), jnp.asarray(d.T), fmt=Blocks(name),
                             shape=want.T.shape, dtype=jnp.float32, axis=0)
        return q, want.T
    q = lowbit.Quantized(jnp.asarray(data), jnp.asarray(d), fmt=Blocks(name), shape=want.shape,
                         dtype=jnp.float32, axis=1)
    return q, want


def _values(rows=6, n=512, seed=1):
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((rows, n)) * rng.uniform(0.01, 3, (rows, 1))).astype(np.float32)
    v[0, :64] = 0.0                           # whole blocks of zeros
    v[1, 5] = -1e-9
    v[2] = np.abs(v[2])                       # a row with no negative value (Q4_1's min)
    return v


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("transposed", [True, False], ids=["kernel", "rows"])
def test_decoding_in_the_step_equals_gguf_dequantize_bit_for_bit(name, transposed):
    q, want = node(_values(), name, transposed=transposed)
    got = jax.jit(lambda q: lowbit.dequantize(q))(q)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))
    words = lowbit.in_words(q)                       # Vulkan targets: bytes in 32-bit words
    got = jax.jit(lambda q: lowbit.dequantize(q))(words)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", TYPES)
def test_split_and_join_give_back_the_files_bytes(name):
    raw = gguf_bytes(_values(), name)
    data, d = split_blocks(raw, Blocks(name))
    assert data.dtype == np.int8 and d.dtype == np.float16
    np.testing.assert_array_equal(join_blocks(data, d, Blocks(name)), raw)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K", "Q4_K"])
def test_loss_and_gradients_on_blocks_equal_jax_grad_on_the_decoded_weights(name):
    """A frozen embedding table (a lookup and the tied head's transposed product), a
    frozen kernel and a trained one: the value and the trained kernel's gradient as
    `jax.grad` gives them on the decoded floats. Exact zeros in the batch."""
    rng = np.random.default_rng(2)
    table, table_f = node(_values(32, 256, seed=3), name, transposed=False)
    kernel, kernel_f = node(_values(256, 256, seed=4) / 16, name, transposed=True)
    trained = jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.float32)
    ids = jnp.asarray([[0, 5, 31, 5], [2, 2, 0, 7]])
    x = jnp.asarray(rng.standard_normal((2, 4, 256)), jnp.float32).at[1, 2].set(0.0)

    def loss(p, ids, x):
        h = jnp.take(p["embed"], ids, axis=0) + x
        h = jnp.tanh(h @ p["frozen"]) @ p["trained"]
        return jnp.mean(jax.nn.log_softmax(h @ p["embed"].T))

    frozen = {"embed": table, "frozen": kernel}
    got_v, got_g = jax.jit(jax.value_and_grad(
        lambda t: lowbit.at_use(loss)({**frozen, "trained": t}, ids, x)))(trained)
    floats = {"embed": jnp.asarray(table_f), "frozen": jnp.asarray(kernel_f)}
    want_v, want_g = jax.jit(jax.value_and_grad(
        lambda t: loss({**floats, "trained": t}, ids, x)))(trained)
    # To float32 rounding: the products' accumulation order may differ once XLA fuses
    # the decoding into them.
    assert float(got_v) == pytest.approx(float(want_v), rel=1e-6)
    np.testing.assert_allclose(got_g, want_g, rtol=1e-5,
                               atol=1e-5 * float(jnp.max(jnp.abs(want_g))))
    rows = lowbit.at_use(lambda p, i: jnp.take(p["embed"], i, axis=0))(frozen, ids)
    np.testing.assert_array_equal(np.asarray(rows), table_f[np.asarray(ids)])


def test_sparse_train_trains_channels_over_a_weights_blocks():
    """`Channels` on a weight stored in blocks: its trained channels are a float32 master
    (from the decoded values), the gradient is `jax.grad`'s restricted to them, and the
    blocks are untouched by training."""
    import optax

    q, w = node(_values(64, 256, seed=5) / 8, "Q4_1", transposed=True)     # [256, 64]
    channels = pj.Channels(count=16, axis="out", last=True)
    scheme = pj.Scheme({"w": channels}, default=pj.Frozen())
    decision = scheme.resolve({"w": jax.ShapeDtypeStruct(q.shape, jnp.float32)})["w"]
    start = 64 - 16
    stored = lowbit.Quantized(q.data, q.scale, fmt=q.fmt, shape=q.shape,
                              dtype=q.dtype, axis=q.axis, master=jnp.asarray(w[:, start:]),
                              channels=(1, start, 16))
    assert decision.count == 16
    x = jax.random.normal(jax.random.key(0), (8, 256)).at[3].set(0.0)
    y = jax.random.normal(jax.random.key(1), (8, 64))

    def loss(p, b):
        return jnp.mean((jnp.tanh(b["x"] @ p["w"]) - b["y"]) ** 2)

    opt = optax.adam(1e-2)
    trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
    state = trainer.init({"w": stored})
    master = jnp.asarray(w[:, start:])
    ref = opt.init(master)
    for _ in range(3):
        state, metrics = trainer(state, {"x": x, "y": y})
        full = lambda m: loss({"w": jnp.asarray(w).at[:, start:].set(m)}, {"x": x, "y": y})  # noqa: E731
        value, g = jax.value_and_grad(full)(master)
        updates, ref = opt.update(g, ref, master)
        master = master + updates
        assert float(metrics["loss"]) == pytest.approx(float(value), rel=1e-6)
    # Adam turns rounding in a near-zero gradient into a step of the learning rate's
    # size: within 0.1% of how far the channels moved.
    moved = float(jnp.max(jnp.abs(master - w[:, start:])))
    np.testing.assert_allclose(state.params["w"].master, master, rtol=1e-5, atol=1e-3 * moved)
    np.testing.assert_array_equal(state.params["w"].data, q.data)
    np.testing.assert_array_equal(state.params["w"].scale, q.scale)


def test_blocks_are_read_not_made():
    with pytest.raises(lowbit.QuantizeError, match="GGUF file's own block format"):
        lowbit.quantize_leaf(jnp.ones((64, 64)), Blocks("Q4_0"))
    with pytest.raises(ValueError, match="pockjax decodes Q4_0"):
        Blocks("IQ2_XXS")
