"""The prefix cache against the uncached trainer: 3 epochs of shuffled batches through
`PrefixCachedTrainer` give the uncached run's losses and parameters bit for bit, on a
LLaMA (last blocks, PockEngine's scheme, block remat, bfloat16 frozen weights), a CNN
with batch norm in inference mode and a model whose cut holds several values; with a RAM
budget smaller than the data set (rows spill to disk) and in bfloat16 storage (close,
not equal). Steps that mix examples are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import pockjax as pj
import pockjax.nnx  # noqa: F401  (registers the nnx converters)
from pockjax import lowbit
from pockjax.finetuning import lm_loss
from pockjax.models.llama import Llama, LlamaConfig, cast_frozen
from pockjax.prefix import PrefixCachedTrainer, PrefixCacheError, find_cut

EXAMPLES, BATCH = 12, 4


def _epochs(step_a, step_b, state_a, state_b, data, epochs=3, keys=True):
    """Both steps over the same shuffled batches; their losses per step."""
    la, lb = [], []
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(EXAMPLES)
        for k in range(EXAMPLES // BATCH):
            ids = order[BATCH * k: BATCH * (k + 1)]
            batch = jax.tree_util.tree_map(lambda x: x[ids], data)
            state_a, ma = step_a(state_a, batch)
            state_b, mb = step_b(state_b, batch, keys=[int(i) for i in ids] if keys else None)
            la.append(float(ma["loss"]))
            lb.append(float(mb["loss"]))
    return state_a, state_b, la, lb


def _assert_same(state_a, state_b):
    for (path, a), b in zip(pj.scheme.leaves_with_paths(state_a.params)[0],
                            jax.tree_util.tree_leaves(state_b.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=path)
    assert int(state_a.step) == int(state_b.step)


def _llama(remat=None, frozen_bf16=False):
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                         num_heads=4, max_position_embeddings=16, remat=remat,
                         dtype=jnp.float32 if frozen_bf16 else None)
    graphdef, params, _ = pj.nnx.split(Llama(config, rngs=nnx.Rngs(0)))

    def loss(p, b):
        return lm_loss(nnx.merge(graphdef, p)(b["tokens"]), b["tokens"], b["mask"])

    rng = np.random.default_rng(0)
    data = {"tokens": rng.integers(0, 64, (EXAMPLES, 16)).astype(np.int32),
            "mask": (rng.random((EXAMPLES, 16)) > 0.2).astype(np.int32)}
    data["mask"][3] = 0  # an example with no loss positions
    data["mask"][5, :8] = 0  # padding in front
    return loss, params, data


@pytest.mark.parametrize("case", ["last-2", "paper", "remat", "bf16-frozen", "int4-frozen"])
def test_llama_cached_epochs_equal_the_uncached_run(case):
    loss, params, data = _llama(remat="block" if case == "remat" else None,
                                frozen_bf16=case == "bf16-frozen")
    scheme = (pj.schemes.transformer(params, last=2) if case == "paper"
              else pj.schemes.last_blocks(params, 2))
    if case == "bf16-frozen":
        params = cast_frozen(params, scheme, jnp.bfloat16)
    if case == "int4-frozen":  # the prefix and the suffix read them as the step does
        params = lowbit.quantize(params, scheme, "int4")
    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-2), scheme=scheme)
    split = find_cut(loss, params, jax.tree_util.tree_map(lambda x: x[:BATCH], data), scheme)
    # The residual stream entering block 2, nothing else.
    assert [v.shape for v in split.values] == [(16, 32)], split.describe()
    assert split.bytes_per_example == 16 * 32 * 4
    # Rows for 5 examples in RAM, the other 7 on disk.
    cached = PrefixCachedTrainer(trainer, budget_bytes=5 * split.bytes_per_example)
    a, b, la, lb = _epochs(trainer, cached, trainer.init(params), trainer.init(params), data)
    assert la == lb
    _assert_same(a, b)
    _, _, cache = cached.split(b, jax.tree_util.tree_map(lambda x: x[:BATCH], data))
    assert (cache.misses, cache.hits) == (EXAMPLES, 2 * EXAMPLES)
    assert cache.ram_bytes == 5 * split.bytes_per_example
    assert cache.disk_bytes == 7 * split.bytes_per_example
    cached.close()


def test_a_channels_scheme_cuts_above_the_first_trained_reader():
    """A quarter of block 2's up projection trains (and block 3): the cut is the residual
    stream after block 2's attention and block 2's frozen gate projection, which the
    trained product reads; the normalised input both read is recomputed from the
    residual."""
    loss, params, data = _llama()
    names = pj.schemes.blocks(params)
    scheme = pj.Scheme({f"{names[2]}/mlp/up_proj/kernel": pj.Channels(ratio=0.25, axis="in"),
                        f"{names[3]}/**": pj.Full()}, default=pj.Frozen())
    split = find_cut(loss, params, jax.tree_util.tree_map(lambda x: x[:BATCH], data), scheme)
    assert sorted(v.shape for v in split.values) == [(16, 32), (16, 64)], split.describe()
    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-2), scheme=scheme)
    cached = PrefixCachedTrainer(trainer)
    a, b, la, lb = _epochs(trainer, cached, trainer.init(params), trainer.init(params), data)
    assert la == lb
    _assert_same(a, b)


def test_content_keys_and_bfloat16_storage():
    """Without keys each example is named by a hash of its contents (the same hits);
    bfloat16 storage halves the bytes and moves the losses a little."""
    loss, params, data = _llama()
    scheme = pj.schemes.last_blocks(params, 2)
    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-2), scheme=scheme)
    cached = PrefixCachedTrainer(trainer)
    a, b, la, lb = _epochs(trainer, cached, trainer.init(params), trainer.init(params), data,
                           keys=False)
    assert la == lb
    _assert_same(a, b)
    narrow = PrefixCachedTrainer(trainer, dtype="bfloat16")
    _, c, _, lc = _epochs(trainer, narrow, trainer.init(params), trainer.init(params), data)
    _, _, cache = narrow.split(c, jax.tree_util.tree_map(lambda x: x[:BATCH], data))
    assert cache.row_bytes == 16 * 32 * 2
    assert lc[:3] != la[:3] and np.allclose(lc, la, rtol=2e-2)


class _CNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.n1 = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.c2 = nnx.Conv(8, 8, (3, 3), rngs=rngs)
        self.n2 = nnx.BatchNorm(8, use_running_average=True, rngs=rngs)
        self.head = nnx.Linear(8, 5, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.n1(self.c1(x)))
        h = jax.nn.relu(self.n2(self.c2(h)))
        return self.head(h.mean(axis=(1, 2)))


def test_cnn_with_inference_mode_batch_norm():
    model = _CNN(nnx.Rngs(0))
    # Running statistics that are not the initial zeros and ones.
    model.n1.mean[...] = jnp.linspace(-0.5, 0.5, 8)
    model.n1.var[...] = jnp.linspace(0.5, 2.0, 8)

    def loss(m, b):
        logits = m(b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    nt = pj.nnx.Trainer(model, loss, optimizer=optax.adam(1e-2),
                        scheme=pj.Scheme({"c2/**": pj.Full(), "head/**": pj.Full()},
                                         default=pj.Frozen()))
    rng = np.random.default_rng(1)
    data = {"x": rng.normal(size=(EXAMPLES, 6, 6, 3)).astype(np.float32),
            "y": rng.integers(0, 5, EXAMPLES).astype(np.int32)}
    data["x"][2] = 0.0
    sparse = nt.sparse
    with_state = lambda step: (lambda s, b, **kw: step(s, nt.step_batch(b), **kw))
    cached = PrefixCachedTrainer(sparse)
    a, b, la, lb = _epochs(with_state(lambda s, b, **kw: sparse(s, b)), with_state(cached),
                           sparse.init(nt.state.params), sparse.init(nt.state.params), data)
    assert la == lb
    _assert_same(a, b)
    split, _, cache = cached.split(b, nt.step_batch(jax.tree_util.tree_map(lambda x: x[:BATCH], data)))
    assert [v.shape for v in split.values] == [(6, 6, 8)], split.describe()  # c1's block output
    assert cache.hits == 2 * EXAMPLES


def test_a_cut_of_several_values_and_whole_batch_inputs():
    """The trained part reads two frozen branches (two cut values); a frozen weight that
    happens to have one row per example, tied to the batch as LLaMA ties its upcast
    weights, is not taken for a per-example value; a batch-wide count is recomputed by
    the suffix."""
    rng = np.random.default_rng(2)
    params = {"w1": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
              "wg": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
              "tie": jnp.asarray(rng.normal(size=(BATCH, 3)), jnp.float32),
              "scale": jnp.ones(8, jnp.float32),
              "head": jnp.asarray(rng.normal(size=(8, 3)) * 0.3, jnp.float32)}
    scheme = pj.Scheme({"head": pj.Full(), "scale": pj.Full()}, default=pj.Frozen())

    def loss(p, b):
        x, m = b["x"], b["mask"]
        h = jnp.tanh(x @ p["w1"])
        g = jax.nn.sigmoid((x * m[:, None]) @ p["wg"])
        tie = p["tie"] * (1 + 0 * x[0, 0])  # (4, 3): as many rows as examples
        out = h @ p["head"] + ((h * g) * p["scale"])[:, :BATCH] @ tie
        w = m / jnp.maximum(m.sum(), 1.0)
        return jnp.sum(w * jnp.sum((out - b["y"]) ** 2, axis=-1))

    data = {"x": rng.normal(size=(EXAMPLES, 6)).astype(np.float32),
            "mask": (rng.random(EXAMPLES) > 0.3).astype(np.float32),
            "y": rng.normal(size=(EXAMPLES, 3)).astype(np.float32)}
    split = find_cut(loss, params, jax.tree_util.tree_map(lambda x: x[:BATCH], data), scheme)
    assert [v.shape for v in split.values] == [(8,), (8,)], split.describe()
    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=scheme)
    cached = PrefixCachedTrainer(trainer, budget_bytes=0)  # every row on disk
    a, b, la, lb = _epochs(trainer, cached, trainer.init(params), trainer.init(params), data)
    assert la == lb
    _assert_same(a, b)


def test_batch_statistics_below_the_trained_part_are_refused():
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.normal(size=(6, 8)), jnp.float32),
              "head": jnp.asarray(rng.normal(size=(8, 1)), jnp.float32)}
    scheme = pj.Scheme({"head": pj.Full()}, default=pj.Frozen())

    def loss(p, b):
        h = b["x"] @ p["w"]
        h = (h - h.mean(0)) / (h.std(0) + 1e-3)  # batch norm in training mode
        return jnp.mean(h @ p["head"])

    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=scheme)
    batch = {"x": rng.normal(size=(BATCH, 6)).astype(np.float32)}
    with pytest.raises(PrefixCacheError, match="test_prefix.py.*depends on other examples"):
        PrefixCachedTrainer(trainer)(trainer.init(params), batch)
    with pytest.raises(pj.scheme.SchemeError, match="trains nothing"):
        find_cut(loss, params, batch, pj.Scheme(default=pj.Frozen()))


def test_fit_with_the_prefix_cache_equals_fit_without():
    loss, params, data = _llama()
    scheme = pj.schemes.last_blocks(params, 2)
    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-2), scheme=scheme)

    def batch_of(step):
        ids = np.random.default_rng(step // 3).permutation(EXAMPLES)[BATCH * (step % 3):][:BATCH]
        return jax.tree_util.tree_map(lambda x: x[ids], data)

    a, ha = pj.fit(trainer, trainer.init(params), batch_of, 9, progress=False)
    with PrefixCachedTrainer(trainer) as cached:
        b, hb = pj.fit(cached, trainer.init(params), batch_of, 9, progress=False)
    assert cached.caches() == []  # closed on leaving the block
    with PrefixCachedTrainer(trainer, budget_bytes=0) as cached:
        c, hc = pj.fit(cached, trainer.init(params), batch_of, 9, progress=False)
    np.testing.assert_array_equal(ha.loss, hb.loss)
    np.testing.assert_array_equal(ha.loss, hc.loss)
    _assert_same(a, b)
    _assert_same(a, c)
    with pytest.raises(TypeError, match="wrap the trainer first, pj.prefix.PrefixCachedTrainer"):
        pj.fit(trainer, trainer.init(params), batch_of, 1, progress=False, prefix_cache=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'setps'"):
        pj.fit(trainer, trainer.init(params), batch_of, 1, progress=False, setps=3)
    _, off = pj.fit(trainer, trainer.init(params), batch_of, 1, progress=False, prefix_cache=False)
    assert off.steps == 1  # the cache off, as fit ran it before
    # auto: a cut this small against this little prefix work is not worth it here, or it
    # is; either way the report says which and the results are the same.
    cached = PrefixCachedTrainer(trainer, auto=True)
    report = cached.report(trainer.init(params), batch_of(0))
    assert report.examples == BATCH and 0 < report.share < 1
    assert str(report).startswith(f"prefix cache {'on' if report.on else 'off'}")


def test_a_schedule_caches_below_the_lowest_block_it_trains():
    """Blocks 3 and 2 take turns every 2 steps: the cut is the residual stream entering
    block 2, shared by both turns' steps, and the run equals the uncached schedule's."""
    loss, params, data = _llama()
    names = pj.schemes.blocks(params)
    schedule = pj.schemes.schedule(
        [pj.Scheme({f"{names[3]}/**": pj.Full()}, default=pj.Frozen()),
         pj.Scheme({f"{names[2]}/**": pj.Full()}, default=pj.Frozen())], every=2)
    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-2), scheme=schedule)
    cached = PrefixCachedTrainer(trainer, budget_bytes=3 * 16 * 32 * 4)
    a, b, la, lb = _epochs(trainer, cached, trainer.init(params), trainer.init(params), data)
    assert la == lb
    _assert_same(a, b)
    split, _, cache = cached.split(b, jax.tree_util.tree_map(lambda x: x[:BATCH], data))
    assert [v.shape for v in split.values] == [(16, 32)], split.describe()
    assert cache.hits == 2 * EXAMPLES


def test_export_runs_the_prefix_and_the_suffix_on_iree(tmp_path):
    """The cached step exported for host-cpu: the artifact's prefix gives the JAX
    prefix's cut values, and its train_step on them follows the JAX cached trainer."""
    from pockjax import runtime

    loss, params, data = _llama()
    scheme = pj.schemes.transformer(params, last=2)
    trainer = pj.sparse_train(loss, optimizer=optax.adamw(1e-2), scheme=scheme)
    cached = PrefixCachedTrainer(trainer)
    batch = jax.tree_util.tree_map(lambda x: x[:BATCH], data)
    state = trainer.init(params)
    # pj.export takes either trainer (cached.export(...) is the same call).
    art = pj.export(cached, state, batch, target="host-cpu", out_dir=tmp_path / "art")
    assert art.manifest["functions"]["prefix"]["outputs"] == ["cut/0"]
    split, _, _ = cached.split(state, batch)
    sess = runtime.load(str(tmp_path / "art"))
    for k in range(3):
        b = jax.tree_util.tree_map(lambda x: x[BATCH * k:BATCH * (k + 1)], data)
        values = sess.prefix(b)
        want = jax.device_get(jax.jit(split.prefix)(state.params, b))
        np.testing.assert_allclose(values[0], want[0], rtol=1e-5, atol=1e-5)
        got = sess.step({"batch": b, "cut": values})
        state, metrics = cached(state, b)
        np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=1e-4)
    got = dict(runtime.named_leaves(sess.params()))
    want = dict(runtime.named_leaves(jax.device_get(state.params)))
    assert sorted(got) == sorted(want)
    for path, x in want.items():
        np.testing.assert_allclose(got[path], x, rtol=1e-4, atol=1e-6 + 1e-4 * np.max(np.abs(x)),
                                   err_msg=path)
    with pytest.raises(pj.export.ExportError, match="no prefix function"):
        runtime.load(str(_plain_artifact(tmp_path))).prefix(batch)


def _plain_artifact(tmp_path):
    params = {"w": jnp.ones((3, 2))}
    trainer = pj.sparse_train(lambda p, b: jnp.sum((b["x"] @ p["w"]) ** 2),
                              optimizer=optax.sgd(0.1))
    out = tmp_path / "plain"
    trainer.export(trainer.init(params), {"x": np.ones((4, 3), np.float32)}, out_dir=out)
    return out


def test_argument_errors_name_the_fix():
    loss, params, data = _llama()
    scheme = pj.schemes.last_blocks(params, 2)
    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=scheme)
    batch = jax.tree_util.tree_map(lambda x: x[:BATCH], data)
    with pytest.raises(ValueError, match=r"keys: expected one per example \(4\), got 3"):
        PrefixCachedTrainer(trainer)(trainer.init(params), batch, keys=[0, 1, 2])
    with pytest.raises(ValueError, match="dtype must be 'float32' or 'bfloat16'"):
        PrefixCachedTrainer(trainer, dtype="int8")
    with pytest.raises(TypeError, match="needs a pockjax.SparseTrainer"):
        PrefixCachedTrainer(lambda s, b: (s, {}))
    schedule = pj.schemes.blockwise(params, every=2)
    scheduled = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=schedule)
    with pytest.raises(PrefixCacheError, match="schedule's steps are not exported"):
        PrefixCachedTrainer(scheduled).export(scheduled.init(params), batch)
    with pytest.raises(pj.export.ExportError, match="takes a SparseTrainer .* got ScheduledTrainer"):
        pj.export(scheduled, scheduled.init(params), batch)
