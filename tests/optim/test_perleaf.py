"""Per-leaf vs global optax chains, decided from the update jaxpr."""
import jax
import jax.numpy as jnp
import optax
import pytest

from pockjax.optim.perleaf import plan_updates

VIEW = {"a": jnp.ones((3, 4)), "frozen": None, "c": jnp.ones(5)}
NAMES = ["a", "c"]

PER_LEAF = {
    "sgd": optax.sgd(0.1),
    "momentum": optax.sgd(0.1, momentum=0.9),
    "nesterov": optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": optax.adam(1e-3),
    "adamw": optax.adamw(1e-3, weight_decay=0.1),
    "lion": optax.lion(1e-4),
    "schedule": optax.adam(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 50)),
    "elementwise clip": optax.chain(optax.clip(1.0), optax.adam(1e-3)),
    "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    "lamb": optax.lamb(1e-3),  # per-leaf trust ratio: a norm over one leaf only
}
GLOBAL = {
    "clip_by_global_norm": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
    "apply_if_finite": optax.apply_if_finite(optax.adam(1e-3), 3),
    "MultiSteps": optax.MultiSteps(optax.adam(1e-3), 4),
}


@pytest.mark.parametrize("name", list(PER_LEAF))
def test_per_leaf_chains_are_fused(name):
    opt = PER_LEAF[name]
    plan = plan_updates(opt, VIEW, opt.init(VIEW), VIEW, NAMES)
    assert plan.mode == "fused", plan.reason
    n, m = 2, len(jax.tree_util.tree_leaves(opt.init(VIEW)))
    for j, leaf in enumerate(plan.leaves):
        grads = [i for i in leaf.inputs if i < n]
        params = [i - n - m for i in leaf.inputs if i >= n + m]
        assert grads == [j] and set(params) <= {j}
        assert not set(leaf.state_out) & set(plan.shared_out)


@pytest.mark.parametrize("name", list(GLOBAL))
def test_global_chains_are_detected(name):
    opt = GLOBAL[name]
    plan = plan_updates(opt, VIEW, opt.init(VIEW), VIEW, NAMES)
    assert plan.mode == "global"
    assert "'a'" in plan.reason and "'c'" in plan.reason


def test_shared_state_is_the_step_count():
    opt = optax.adam(1e-3)
    state = opt.init(VIEW)
    plan = plan_updates(opt, VIEW, state, VIEW, NAMES)
    assert plan.shared_out == (0,)  # ScaleByAdamState.count comes first
    assert plan.leaves[0].state_out == (1, 3)  # mu['a'], nu['a']


def test_a_hand_written_cross_leaf_transform_is_global():
    def init(params):
        return optax.EmptyState()

    def update(updates, state, params=None):
        total = sum(jnp.sum(u) for u in jax.tree_util.tree_leaves(updates))
        return {k: (None if u is None else u * total) for k, u in updates.items()}, state

    plan = plan_updates(optax.GradientTransformation(init, update), VIEW, init(VIEW), VIEW, NAMES)
    assert plan.mode == "global"


@pytest.mark.parametrize("name", list(PER_LEAF) + ["pockjax adamw int8"])
def test_the_one_pass_split_equals_a_dce_per_leaf(name):
    """Each leaf's update jaxpr, split from the whole in one backward pass, reads the
    same inputs and computes the same values as the whole jaxpr's DCE to that leaf."""
    import numpy as np

    from pockjax.optim import adamw
    from pockjax.optim.perleaf import _sub_jaxpr, _sub_jaxprs

    opt = adamw(1e-3, moments="int8", block=4) if name.startswith("pockjax") else PER_LEAF[name]
    view = {"a": jnp.ones((3, 4)), "b": jnp.ones((4, 4)), "frozen": None, "c": jnp.ones(5)}
    state = opt.init(view)
    g, p = jax.tree_util.tree_leaves(view), jax.tree_util.tree_leaves(view)
    s = jax.tree_util.tree_leaves(state)
    n = len(g)

    def flat(*xs):
        gt = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(view), xs[:n])
        st = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state), xs[n:n + len(s)])
        pt = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(view), xs[n + len(s):])
        u, s2 = opt.update(gt, st, pt)
        return [*jax.tree_util.tree_leaves(u), *jax.tree_util.tree_leaves(s2)]

    closed = jax.make_jaxpr(flat)(*g, *s, *p)
    n_out = len(closed.jaxpr.outvars)
    groups = [[i] for i in range(n_out)] + [[0, n_out - 1], list(range(n_out))]
    rng = np.random.default_rng(0)
    inputs = [jnp.asarray(rng.standard_normal(np.shape(x)), x.dtype)
              if jnp.issubdtype(x.dtype, jnp.floating) else x for x in [*g, *s, *p]]
    for outs, (sub, used) in zip(groups, _sub_jaxprs(closed, groups)):
        ref, ref_used = _sub_jaxpr(closed, outs)
        assert used == ref_used
        assert len(sub.jaxpr.eqns) == len(ref.jaxpr.eqns)
        got = jax.core.eval_jaxpr(sub.jaxpr, sub.consts, *[inputs[i] for i in used])
        want = jax.core.eval_jaxpr(ref.jaxpr, ref.consts, *[inputs[i] for i in ref_used])
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
