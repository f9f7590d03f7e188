"""Scheme schedules (`pockjax.schedule`) against a plain `jax.grad` + optax reference:
each turn a fresh AdamW on that turn's leaves, its learning rate read at the global step."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax.schedule import Schedule
from pockjax.scheme import leaves_with_paths

SHAPES = {"layers": [{"w": (6, 6), "b": (6,)} for _ in range(3)], "head": {"w": (6, 2)}}


def _params(seed=0):
    keys = iter(jax.random.split(jax.random.key(seed), 16))
    return jax.tree_util.tree_map(lambda s: jax.random.normal(next(keys), s) * 0.5, SHAPES,
                                  is_leaf=lambda x: isinstance(x, tuple))


def loss(p, batch):
    h = batch["x"]
    for layer in p["layers"]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    err = (h @ p["head"]["w"] - batch["y"]) * batch["mask"][:, None]
    return jnp.sum(err ** 2) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)


def _batches(n):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = rng.normal(size=(5, 6)).astype(np.float32)
        x[i % 5] = 0.0                                   # a row of exact zeros
        mask = np.ones(5, np.float32)
        mask[-1 - i % 2:] = 0.0                          # padding at the end
        out.append({"x": jnp.asarray(x), "y": jnp.asarray(rng.normal(size=(5, 2)), jnp.float32),
                    "mask": jnp.asarray(mask)})
    return out


def _sched():
    return optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, 9)


def _reference(params, schedule: Schedule, batches):
    """Plain jax.grad + optax: at each turn's start a new AdamW over the turn's leaves,
    whose learning rate is the run's schedule shifted to the turn's first step."""
    paths = [p for p, _ in leaves_with_paths(params)[0]]
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaves = list(leaves)
    opt = opt_state = current = None
    grad = jax.jit(jax.grad(loss))
    for step, batch in enumerate(batches):
        k = schedule.index(step)
        if k != current:
            current = k
            trained = [i for i, p in enumerate(paths)
                       if isinstance(schedule.schemes[k].match(p), pj.Full)]
            opt = optax.adamw(lambda c, s=step: _sched()(c + s), weight_decay=0.01)
            opt_state = opt.init([leaves[i] for i in trained])
        g = jax.tree_util.tree_leaves(grad(jax.tree_util.tree_unflatten(treedef, leaves), batch))
        sub = [leaves[i] for i in trained]
        updates, opt_state = opt.update([g[i] for i in trained], opt_state, sub)
        for i, new in zip(trained, optax.apply_updates(sub, updates)):
            leaves[i] = new
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _trainer(schedule):
    return pj.sparse_train(loss, optimizer=optax.adamw(_sched(), weight_decay=0.01),
                           scheme=schedule)


@pytest.mark.parametrize("order", ["cycle", "random"])
def test_schedule_matches_a_fresh_optimizer_per_turn(order):
    params = _params()
    schedule = pj.schemes.blockwise(params, every=2, extra=("head/**",),
                                    order="random" if order == "random" else "descending")
    batches = _batches(9)
    trainer = _trainer(schedule)
    state = trainer.init(params)
    for b in batches:
        state, metrics = trainer(state, b)
    expected = _reference(params, schedule, batches)
    got = jax.tree_util.tree_leaves(state.params)
    for path_got, want in zip(got, jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(path_got, want, rtol=2e-5, atol=2e-6)
    assert int(state.step) == 9
    assert state.scheme == schedule.at(8)
    # Every block trained in some turn, and moved.
    for i in range(3):
        assert not np.allclose(state.params["layers"][i]["w"], params["layers"][i]["w"])


def test_one_scheme_schedule_equals_the_plain_trainer():
    params, batches = _params(), _batches(5)
    scheme = pj.schemes.last_blocks(params, 2, extra=("head/**",))
    plain = _trainer(scheme)
    a = plain.init(params)
    scheduled = _trainer(pj.schemes.schedule([scheme], every=2))
    b = scheduled.init(params)
    for batch in batches:
        a, _ = plain(a, batch)
        b, _ = scheduled(b, batch)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_each_scheme_is_compiled_once():
    params = _params()
    traces = []

    def counted(p, b):
        traces.append(1)
        return loss(p, b)

    schedule = pj.schemes.blockwise(params, every=1, group=2)   # 2 groups: [2], [0, 1]
    assert len(schedule.schemes) == 2
    trainer = pj.sparse_train(counted, optimizer=optax.adam(1e-2), scheme=schedule)
    state = trainer.init(params)
    batches = _batches(6)
    for b in batches[:2]:                                       # one turn of each
        state, _ = trainer(state, b)
    first = len(traces)
    for b in batches[2:]:                                       # two more rounds
        state, _ = trainer(state, b)
    assert len(traces) == first
    assert len(trainer.trainers) == 2


def test_resumed_state_continues_bit_for_bit():
    params, batches = _params(), _batches(7)
    schedule = pj.schemes.blockwise(params, every=2)
    trainer = _trainer(schedule)
    state = trainer.init(params)
    for b in batches:
        state, _ = trainer(state, b)
    # Stop after step 3 (mid-turn) and after 4 (a turn's end): a new trainer goes on.
    for stop in (3, 4):
        t = _trainer(schedule)
        s = t.init(params)
        for b in batches[:stop]:
            s, _ = t(s, b)
        saved = jax.tree_util.tree_map(np.asarray, s)
        t2 = _trainer(schedule)
        like = t2.init(params, step=stop)
        assert like.scheme == s.scheme
        resumed = jax.tree_util.tree_map(jnp.asarray, saved)
        resumed = like.replace(step=resumed.step, params=resumed.params,
                               opt_state=resumed.opt_state)
        for b in batches[stop:]:
            resumed, _ = t2(resumed, b)
        for x, y in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(resumed)):
            np.testing.assert_array_equal(x, y)


def test_switch_frees_the_old_optimizer_state():
    params = _params()
    trainer = _trainer(pj.schemes.blockwise(params, every=1))
    state = trainer.init(params)
    state, _ = trainer(state, _batches(1)[0])
    old = jax.tree_util.tree_leaves(state.opt_state)
    state, _ = trainer(state, _batches(2)[1])
    assert all(x.is_deleted() for x in old if isinstance(x, jax.Array))


def test_random_order_visits_every_scheme_each_round():
    s = Schedule(tuple(pj.Scheme({f"layers/{i}/**": pj.Full()}) for i in range(3)), every=2,
                 order="random", seed=3)
    for r in range(4):
        assert sorted({s.index(step) for step in range(6 * r, 6 * r + 6)}) == [0, 1, 2]
    assert [s.index(k) for k in range(24)] == [s.index(k) for k in range(24)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(schemes=(), every=2), "non-empty list of Schemes"),
    (dict(schemes=(pj.Scheme(),), every=0), "positive whole number"),
    (dict(schemes=(pj.Scheme(),), every=2, order="zigzag"), "order is one of"),
])
def test_bad_schedules_say_what_is_expected(kwargs, message):
    with pytest.raises(pj.SchemeError, match=message):
        Schedule(**kwargs)


def test_blockwise_bad_arguments():
    params = _params()
    with pytest.raises(pj.SchemeError, match="group"):
        pj.schemes.blockwise(params, every=2, group=0)
    with pytest.raises(pj.SchemeError, match="order"):
        pj.schemes.blockwise(params, every=2, order="sideways")
    with pytest.raises(pj.SchemeError, match="extra patterns"):
        pj.schemes.blockwise(params, every=2, extra=("nothing/**",))
