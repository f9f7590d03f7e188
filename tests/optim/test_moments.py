"""`pockjax.optim.adamw(moments=...)` against `optax.adamw`: float32 is optax itself; the
bfloat16 and int8 moments follow the float32 trajectory on adversarial gradients (exact
zeros, scales from 1e-4 to 1e3 inside one block, a leaf one past a block, a scalar), and
train through the fused trainer to the reference's loss."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax import optim
from pockjax.optim.moments import Blockwise, _load_int8, _round_stochastic, _store_int8

SHAPES = {"a": (257,), "b": (64, 48), "s": ()}


def _params():
    return {k: jnp.zeros(s) for k, s in SHAPES.items()}


def _grads(t):
    keys = jax.random.split(jax.random.fold_in(jax.random.key(0), t), 3)
    g = {k: jax.random.normal(key, s) for (k, s), key in zip(SHAPES.items(), keys)}
    g["a"] = g["a"] + 0.5                                   # a drift: a consistent sign
    g["b"] = (g["b"] * jnp.logspace(-4, 3, 48)[None, :]).at[:8].set(0.0)  # zeros, scales
    return g


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def _trajectories(moments, steps=150):
    ref, low = optax.adamw(1e-3, weight_decay=0.0), optim.adamw(1e-3, weight_decay=0.0,
                                                                 moments=moments)
    params = _params()
    s_ref, s_low = ref.init(params), low.init(params)
    update_ref, update_low = jax.jit(ref.update), jax.jit(low.update)
    out = []
    for t in range(steps):
        g = _grads(t)
        u_ref, s_ref = update_ref(g, s_ref, params)
        u_low, s_low = update_low(g, s_low, params)
        out.append((_flat(u_ref), _flat(u_low)))
    return out


def test_float32_is_optax_adamw():
    params, ref = _params(), optax.adamw(1e-3, weight_decay=1e-2)
    low = optim.adamw(1e-3, weight_decay=1e-2, moments="float32")
    s_ref, s_low = ref.init(params), low.init(params)
    for t in range(5):
        u_ref, s_ref = ref.update(_grads(t), s_ref, params)
        u_low, s_low = low.update(_grads(t), s_low, params)
        np.testing.assert_array_equal(_flat(u_low), _flat(u_ref))
    np.testing.assert_array_equal(_flat(s_low), _flat(s_ref))


@pytest.mark.parametrize("moments,cos,rel", [("bfloat16", 0.9999, 0.02), ("int8", 0.98, 0.2)])
def test_updates_follow_float32_adam(moments, cos, rel):
    """Every step's update against optax's on the same gradients: cosine similarity of the
    whole update and the median relative error of its nonzero entries. Exact zeros
    (rows of `b` with zero gradient) stay exactly zero."""
    for t, (want, got) in enumerate(_trajectories(moments)):
        assert np.all(got[want == 0] == 0), t
        nz = want != 0
        similarity = want @ got / np.linalg.norm(want) / np.linalg.norm(got)
        assert similarity > cos, (t, similarity)
        assert np.median(np.abs(got - want)[nz] / np.abs(want)[nz]) < rel, t
        assert np.max(np.abs(got)) <= 1e-3 * 1.5, t     # no update far beyond the rate


def test_state_bytes():
    params = {"w": jnp.zeros((1000, 300))}
    full = optim.state_bytes(optax.adamw(1e-3).init(params))
    bf16 = optim.state_bytes(optim.adamw(1e-3, moments="bfloat16").init(params))
    int8 = optim.state_bytes(optim.adamw(1e-3, moments="int8").init(params))
    assert full == 8 * 300_000 + 4
    assert bf16 == 4 * 300_000 + 4
    blocks = -(-300_000 // 256)
    assert int8 == 2 * (blocks * 256 + 4 * blocks) + 4


def test_int8_round_trip_and_block_edges():
    """Codes within half a step (7% for the square root, 14% signed) of the value; a
    block's largest magnitude exact; zeros exact; the last, partial block padded."""
    x = jnp.concatenate([jnp.zeros(3), jnp.logspace(-4, 2, 254) * jnp.where(
        jnp.arange(254) % 2 == 0, 1.0, -1.0), jnp.array([7.0])])        # 258: 2 blocks
    for signed, step in ((True, 2 ** (24 / 126)), (False, 2 ** (24 / 254))):
        v = x if signed else jnp.abs(x)
        q = _store_int8(v, 256, signed)
        assert isinstance(q, Blockwise) and q.codes.shape == (2, 256)
        back = np.asarray(_load_int8(q, v, signed))
        v = np.asarray(v)
        assert np.all(back[:3] == 0)
        for block in (slice(0, 256), slice(256, 258)):        # each block's largest: exact
            i = np.argmax(np.abs(v[block]))
            assert back[block][i] == pytest.approx(v[block][i], rel=1e-6)
        ratio = back[3:-1] / v[3:-1]
        assert np.all(ratio > 0) and np.all(np.abs(np.log(ratio)) <= np.log(step) / 2 + 1e-5)


def test_stochastic_rounding_is_unbiased():
    x = jnp.full((20_000,), 1.0 + 2.0 ** -10)          # a quarter of bfloat16's step above 1
    y = _round_stochastic(x, 3).astype(jnp.float32)
    assert set(np.unique(np.asarray(y))) == {1.0, 1.0 + 2.0 ** -7}
    assert float(jnp.mean(y)) == pytest.approx(float(x[0]), abs=3e-5)


def test_bfloat16_second_moment_decays():
    """Rounded to nearest, bfloat16 could not hold b2 = 0.999's 0.1% decay (below its
    resolution) and the second moment would stay put once gradients stop."""
    opt = optim.scale_by_adam(moments="bfloat16")
    params = {"w": jnp.zeros(4096)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    _, state = update({"w": jnp.ones(4096)}, state, params)
    for _ in range(500):
        _, state = update({"w": jnp.zeros(4096)}, state, params)
    want = 0.001 * 0.999 ** 500
    assert float(jnp.mean(state.nu["w"].astype(jnp.float32))) == pytest.approx(want, rel=0.01)


def test_fused_trainer_trains_as_the_reference():
    """The low-precision chain stays per-leaf (fused updates) in `sparse_train`; the
    trained parameters follow plain `jax.grad` + `optax.adamw`, and the loss gets as low."""
    keys = jax.random.split(jax.random.key(1), 5)
    params = {f"l{i}": {"w": jax.random.normal(keys[i], (32, 32)) / 6, "b": jnp.zeros(32)}
              for i in range(3)}
    x = jax.random.normal(keys[3], (64, 32))
    y = jnp.sin(x @ jax.random.normal(keys[4], (32, 32)) / 6)

    def loss(p, batch):
        h = batch[0]
        for i in range(3):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - batch[1]) ** 2)

    scheme = pj.Scheme({"l2/**": pj.Full(), "l1/b": pj.Full()})

    def merged(t):                                          # the trained leaves, by hand
        return {"l0": params["l0"], "l1": {"w": params["l1"]["w"], "b": t["b1"]}, "l2": t["l2"]}

    ref_opt = optax.adamw(3e-3, weight_decay=1e-3)
    trained = {"b1": params["l1"]["b"], "l2": params["l2"]}
    ref_state = ref_opt.init(trained)

    @jax.jit
    def ref_step(trained, s):
        g = jax.grad(lambda t: loss(merged(t), (x, y)))(trained)
        u, s = ref_opt.update(g, s, trained)
        return optax.apply_updates(trained, u), s

    for _ in range(200):
        trained, ref_state = ref_step(trained, ref_state)
    ref_loss = float(loss(merged(trained), (x, y)))
    start = float(loss(params, (x, y)))
    start_trained = {"b1": params["l1"]["b"], "l2": params["l2"]}
    for moments, loss_close, close in (("float32", 1e-5, 1e-4), ("bfloat16", 0.0025, 0.01),
                                       ("int8", 0.05, 0.3)):
        trainer = pj.sparse_train(loss, scheme=scheme,
                                  optimizer=optim.adamw(3e-3, weight_decay=1e-3, moments=moments))
        state = trainer.init(params)
        assert trainer.update_mode(state, (x, y))[0] == "fused"
        for _ in range(200):
            state, metrics = trainer(state, (x, y))
        got = {"b1": state.params["l1"]["b"], "l2": state.params["l2"]}
        final = float(loss(state.params, (x, y)))
        assert final < start / 2
        assert final == pytest.approx(ref_loss, rel=loss_close), (moments, final, ref_loss)
        for a, b, a0 in zip(*map(jax.tree.leaves, (got, trained, start_trained))):
            # how far each leaf moved, against how far the reference moved it
            assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b - a0)) < close, moments
        # The frozen leaves are untouched.
        np.testing.assert_array_equal(state.params["l0"]["w"], params["l0"]["w"])


def test_bad_options_name_the_parameter():
    with pytest.raises(ValueError, match="moments='int4'.*'int8'"):
        optim.adamw(1e-3, moments="int4")
    with pytest.raises(ValueError, match="block=0"):
        optim.scale_by_adam(moments="int8", block=0)


@pytest.mark.parametrize("moments", ["bfloat16", "int8"])
def test_the_step_exports_and_runs_as_the_trainer(moments, tmp_path):
    """A host-cpu artifact of a step with low-precision moments (int8: a leaf large
    enough to be updated in pieces): three steps through `pockjax.runtime` equal the JAX
    trainer's, parameters and moments."""
    import pockjax.optim.moments as M

    keys = jax.random.split(jax.random.key(4), 3)
    params = {"w1": jax.random.normal(keys[0], (64, 64)) / 8,
              "w2": jax.random.normal(keys[1], (64, 512)) / 8, "b": jnp.zeros(512)}
    batch = jax.random.normal(keys[2], (8, 64))
    loss = lambda p, x: jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"]) ** 2)
    old, M._PIECE = M._PIECE, 8192              # w2: 32768 values, 4 pieces
    try:
        trainer = pj.sparse_train(loss, scheme=pj.Scheme({"w2": pj.Full(), "b": pj.Full()}),
                                  optimizer=optim.adamw(1e-2, moments=moments))
        state = trainer.init(params)
        pj.export(trainer, state, batch, target="host-cpu", out_dir=tmp_path / "art")
        session = pj.runtime.load(tmp_path / "art", device="local-task")
        for _ in range(3):
            metrics = session.step(batch)
            state, ref = trainer(state, batch)
            assert float(np.asarray(metrics["loss"])) == pytest.approx(float(ref["loss"]),
                                                                       rel=1e-5)
    finally:
        M._PIECE = old
    # A last-bit difference in the float32 moments (IREE's kernels are not XLA's) can move
    # a stored moment to the next code (int8) or the other side of a stochastic rounding
    # (bfloat16): then that value's update differs by a fraction of the learning rate.
    got = session.params()
    for name in ("w2", "b"):
        diff = np.abs(got[name] - np.asarray(state.params[name]))
        assert np.mean(diff <= 1e-6 + 1e-5 * np.abs(got[name])) > 0.99, name
        assert diff.max() <= 3 * 1e-2 * 0.15, name        # 3 steps, a code's 14%
