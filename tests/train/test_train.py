"""`sparse_train`: N steps equal a plain reference; donation, memory, reports, fit."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pockjax as pj
from pockjax._src.jaxpr import inline_calls, is_var, producers
from tests.helpers import assert_trees_close

D = 16


def _mlp_params(key=0, layers=3, d=D):
    k = jax.random.PRNGKey(key)
    return {f"l{i}": {"w": jax.random.normal(jax.random.fold_in(k, i), (d, d)) * 0.3,
                      "b": jax.random.normal(jax.random.fold_in(k, 100 + i), (d,)) * 0.1}
            for i in range(layers)}


def _mlp_loss(p, batch):
    h = batch["x"]
    for i in range(len(p)):
        h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return jnp.mean((h - batch["y"]) ** 2)


def _batches(n, key=1, b=8, d=D):
    k = jax.random.PRNGKey(key)
    return [{"x": jax.random.normal(jax.random.fold_in(k, i), (b, d)),
             "y": jax.random.normal(jax.random.fold_in(k, 1000 + i), (b, d))} for i in range(n)]


# Full, Frozen, and Channels on both axes, ends first and last.
MIXED = pj.Scheme({
    "l0/w": pj.Frozen(),
    "l0/b": pj.Full(),
    "l1/w": pj.Channels(ratio=0.25, axis="in"),
    "l1/b": pj.Frozen(),
    "l2/w": pj.Channels(count=5, axis="out", last=True),
}, default=pj.Full())

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.5),
    "schedule": lambda: optax.sgd(optax.exponential_decay(0.2, 1, 0.5), momentum=0.5),
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2)),
}


def reference_steps(loss, optimizer, scheme, params, batches):
    """Dense jax.grad, sliced by the scheme, optax on the trainable view, written back."""
    view = pj.trainable_view(params, scheme)
    opt_state = optimizer.init(view)
    for batch in batches:
        g = pj.trainable_view(jax.grad(loss)(params, batch), scheme)
        updates, opt_state = optimizer.update(g, opt_state, pj.trainable_view(params, scheme))
        params = pj.apply_sparse_updates(params, updates, scheme)
    return params, opt_state


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_equal_the_reference(name):
    params, batches = _mlp_params(), _batches(4)
    trainer = pj.sparse_train(_mlp_loss, optimizer=OPTIMIZERS[name](), scheme=MIXED)
    state = trainer.init(params)
    for batch in batches:
        state, metrics = trainer(state, batch)
    want_params, want_state = reference_steps(_mlp_loss, OPTIMIZERS[name](), MIXED, params, batches)
    assert int(state.step) == len(batches)
    assert_trees_close(state.params, want_params, rtol=1e-5)
    assert_trees_close(state.opt_state, want_state, rtol=1e-5)
    # Frozen leaves and the untrained channels are bit-identical to the start.
    np.testing.assert_array_equal(state.params["l0"]["w"], params["l0"]["w"])
    np.testing.assert_array_equal(state.params["l1"]["b"], params["l1"]["b"])
    np.testing.assert_array_equal(state.params["l1"]["w"][4:], params["l1"]["w"][4:])
    np.testing.assert_array_equal(state.params["l2"]["w"][:, :-5], params["l2"]["w"][:, :-5])
    mode = "global" if name == "clip_by_global_norm" else "fused"
    assert trainer.update_mode(state, batches[0])[0] == mode


def test_adamw_decays_the_kept_slice_only():
    params, batches = _mlp_params(), _batches(1)
    zero_grad = lambda p, b: 0.0 * _mlp_loss(p, b)
    scheme = pj.Scheme({"l1/w": pj.Channels(ratio=0.5, axis="out")})
    trainer = pj.sparse_train(zero_grad, optimizer=optax.adamw(0.1, weight_decay=0.5), scheme=scheme)
    state, _ = trainer(trainer.init(params), batches[0])
    w0, w1 = params["l1"]["w"], state.params["l1"]["w"]
    np.testing.assert_allclose(w1[:, :8], w0[:, :8] * (1 - 0.1 * 0.5), rtol=1e-6)
    np.testing.assert_array_equal(w1[:, 8:], w0[:, 8:])


def test_optimizer_state_exists_for_the_trainable_view_only():
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-3), scheme=MIXED)
    state = trainer.init(_mlp_params())
    mu = state.opt_state[0].mu
    assert mu["l0"]["w"] is None and mu["l1"]["b"] is None
    assert mu["l1"]["w"].shape == (4, D) and mu["l2"]["w"].shape == (D, 5)
    assert mu["l0"]["b"].shape == (D,)


def test_scan_model_with_stacked_weights_trains_like_the_reference():
    k = jax.random.PRNGKey(3)
    params = {"ws": jax.random.normal(k, (4, D, D)) * 0.3, "head": jnp.ones((D, 2)) * 0.1}

    def loss(p, batch):
        def body(h, w):
            return jnp.tanh(h @ w), None
        h, _ = jax.lax.scan(body, batch["x"], p["ws"])
        return jnp.mean((h @ p["head"] - batch["y"][:, :2]) ** 2)

    scheme = pj.Scheme({"ws": pj.Channels(count=2, axis=0, last=True)}, default=pj.Full())
    batches = _batches(3)
    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2), scheme=scheme)
    state = trainer.init(params)
    for b in batches:
        state, _ = trainer(state, b)
    want, _ = reference_steps(loss, optax.adam(1e-2), scheme, params, batches)
    assert_trees_close(state.params, want, rtol=1e-5)


def test_has_aux_metrics_and_argument_checks():
    def loss(p, batch):
        value = _mlp_loss(p, batch)
        return value, {"twice": 2 * value}

    trainer = pj.sparse_train(loss, optimizer=optax.sgd(0.1), scheme=MIXED, has_aux=True)
    state = trainer.init(_mlp_params())
    state, metrics = trainer(state, _batches(1)[0])
    np.testing.assert_allclose(metrics["aux"]["twice"], 2 * metrics["loss"], rtol=1e-6)

    with pytest.raises(TypeError, match="needs an optimizer"):
        pj.sparse_train(_mlp_loss)
    with pytest.raises(TypeError, match="optax GradientTransformation"):
        pj.sparse_train(_mlp_loss, optimizer="adam")
    with pytest.raises(TypeError, match="TrainState"):
        trainer({"not": "a state"}, _batches(1)[0])
    other = pj.sparse_train(_mlp_loss, optimizer=optax.sgd(0.1))
    with pytest.raises(pj.SchemeError, match="make the state with this trainer's init"):
        other(state, _batches(1)[0])
    with pytest.raises(pj.SchemeError, match="matched no parameter"):
        pj.sparse_train(_mlp_loss, optimizer=optax.sgd(0.1),
                        scheme=pj.Scheme({"l9/w": pj.Full()})).init(_mlp_params())


def test_decorator_form_and_default_scheme_trains_everything():
    @pj.sparse_train(optimizer=optax.sgd(0.1))
    def trainer(p, batch):
        return _mlp_loss(p, batch)

    params, batches = _mlp_params(), _batches(2)
    state = trainer.init(params)
    for b in batches:
        state, _ = trainer(state, b)
    want, _ = reference_steps(_mlp_loss, optax.sgd(0.1), pj.Scheme(default=pj.Full()), params,
                              batches)
    assert_trees_close(state.params, want)


def test_donation_deletes_old_buffers_and_frozen_leaves_pass_through():
    params = _mlp_params()
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-3), scheme=MIXED)
    state = trainer.init(params)
    frozen_ptr = state.params["l0"]["w"].unsafe_buffer_pointer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "Some donated buffers were not usable"
        new_state, _ = trainer(state, _batches(1)[0])
        jax.block_until_ready(new_state)
    for leaf in jax.tree_util.tree_leaves(state):
        assert leaf.is_deleted()
    # The frozen weight is the same buffer, neither copied nor moved.
    assert new_state.params["l0"]["w"].unsafe_buffer_pointer() == frozen_ptr
    # init copied, so the caller's arrays are intact.
    assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(params))


def test_reusing_a_donated_state_says_what_happened():
    params, batch = _mlp_params(), _batches(1)[0]
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-3), scheme=MIXED)
    state = trainer.init(params)
    trainer(state, batch)
    with pytest.raises(ValueError, match=r"already passed to a step.*donate=False"):
        trainer(state, batch)
    # Without donation an old state stays usable.
    keep = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-3), scheme=MIXED, donate=False)
    state = keep.init(params)
    a, _ = keep(state, batch)
    b, _ = keep(state, batch)
    assert_trees_close(a.params, b.params, rtol=0, atol=0)


@pytest.mark.parametrize("ties", ["data", "barrier"])
def test_updates_are_interleaved_with_the_backward_pass(ties):
    """Each new weight is computed from the outputs of every equation that reads the old
    one (so no compiler can write it in place before those reads), and the last layer is
    updated before the first layer's weight gradient exists (program order)."""
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.sgd(0.1), scheme=pj.Scheme(
        {"*/w": pj.Full()}, default=pj.Frozen()))
    state, batch = trainer.init(_mlp_params()), _batches(1)[0]
    step = functools.partial(pj.train.step_variant, trainer, ties=ties)
    closed = jax.make_jaxpr(step)(state, batch)
    jaxpr = inline_calls(closed.jaxpr, closed.consts).jaxpr
    in_paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path((state, batch))[0]]
    out_paths = [jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(jax.eval_shape(step, state, batch))[0]]
    producer = producers(jaxpr)
    dots = [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == "dot_general"]

    def ancestors(v):
        seen, todo = set(), [v]
        while todo:
            i = producer.get(todo.pop())
            if i is not None and i not in seen:
                seen.add(i)
                todo.extend(x for x in jaxpr.eqns[i].invars if is_var(x))
        return seen

    for layer in ("l0", "l1", "l2"):
        old = jaxpr.invars[in_paths.index(f"[0].params['{layer}']['w']")]
        views = {old} | {e.outvars[0] for e in jaxpr.eqns
                         if e.primitive.name == "transpose" and e.invars[0] is old}
        readers = {i for i, e in enumerate(jaxpr.eqns) if e.primitive.name != "transpose"
                   and any(x in views for x in e.invars if is_var(x))}
        new = jaxpr.outvars[out_paths.index(f"[0].params['{layer}']['w']")]
        before = ancestors(new)
        assert readers and readers - {producer[new]} <= before, (layer, readers - before)
    assert producer[jaxpr.outvars[out_paths.index("[0].params['l2']['w']")]] < dots[-1]
    barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == (3 if ties == "barrier" else 0)


# --------------------------------------------------------------------------- memory

L, W, B = 6, 1024, 256


@pytest.fixture(scope="module")
def big_mlp():
    k = jax.random.PRNGKey(0)
    params = [{"w": jax.random.normal(jax.random.fold_in(k, i), (W, W)) * 0.03,
               "b": jnp.zeros(W)} for i in range(L)]
    batch = (jax.ShapeDtypeStruct((B, W), jnp.float32), jax.ShapeDtypeStruct((B, W), jnp.float32))

    def loss(p, batch):
        h = batch[0]
        for layer in p:
            h = jax.nn.gelu(h @ layer["w"] + layer["b"])
        return jnp.mean((h - batch[1]) ** 2)

    return params, batch, loss


def _compiled_step(loss, scheme, params, batch):
    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-3), scheme=scheme)
    state = jax.eval_shape(trainer.init, params)
    return trainer, state, trainer.lower(state, batch).compile().memory_analysis()


def test_fused_step_memory_is_no_higher_than_jit_plus_optax(big_mlp):
    params, batch, loss = big_mlp
    opt = optax.adam(1e-3)

    def plain(params, opt_state, batch):
        value, g = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    plain_mem = jax.jit(plain, donate_argnums=(0, 1)).lower(
        params, jax.eval_shape(opt.init, params), batch).compile().memory_analysis()
    trainer, state, mem = _compiled_step(loss, pj.Scheme(default=pj.Full()), params, batch)
    assert trainer.update_mode(state, batch)[0] == "fused"
    assert mem.temp_size_in_bytes <= plain_mem.temp_size_in_bytes
    assert mem.alias_size_in_bytes >= plain_mem.alias_size_in_bytes  # all donated (+ the step)


def test_channels_step_has_an_eighth_of_the_state_and_less_temp(big_mlp):
    params, batch, loss = big_mlp
    _, full_state, full_mem = _compiled_step(loss, pj.Scheme(default=pj.Full()), params, batch)
    sparse = pj.Scheme({"*/w": pj.Channels(ratio=1 / 8, axis="in")}, default=pj.Frozen())
    _, state, mem = _compiled_step(loss, sparse, params, batch)
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t))
    kernels = lambda s: [s.opt_state[0].mu[i]["w"] for i in range(L)]
    assert nbytes(kernels(state)) * 8 == nbytes(kernels(full_state))
    assert nbytes(state.opt_state) * 8 <= nbytes(full_state.opt_state) + 8  # + the step count
    assert mem.temp_size_in_bytes < full_mem.temp_size_in_bytes


# --------------------------------------------------------------------------- report, fit


def test_report_compares_with_full_training():
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-3), scheme=MIXED)
    state = trainer.init(_mlp_params())
    report = trainer.report(state, _batches(1)[0])
    assert report.mode == "fused"
    assert report.total_params == 3 * (D * D + D)
    assert report.trainable_params == D + 4 * D + D * 5 + D  # l0/b, l1/w, l2/w, l2/b
    assert 0 < report.flops < report.flops_full
    assert report.opt_state_bytes < report.opt_state_bytes_full
    assert report.memory["alias"] > 0
    data = report.as_dict()
    assert data["transform"]["frozen"] == ["l0/w", "l1/b"]
    text = str(report)
    for needle in ("parameters trained", "FLOPs", "temporary memory", "update mode: fused",
                   "slice rules applied"):
        assert needle in text
    # report() compiles from shapes and leaves the state usable
    trainer(state, _batches(1)[0])


def test_report_breaks_memory_down_and_needs_no_arrays(tmp_path):
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-3), scheme=MIXED)
    params, batch = _mlp_params(), _batches(1)[0]
    report = trainer.report(trainer.init(params), batch)
    b, b_full = report.breakdown, report.breakdown_full
    # The arguments by kind add up to what XLA allocates for them.
    assert sum(b[k] for k in ("frozen weights", "trained weights", "optimizer state", "batch")) \
        == report.memory["argument"]
    assert b["frozen weights"] == 4 * (D * D + D)  # l0/w and l1/b
    assert b_full["frozen weights"] == 0 and b_full["trained weights"] == 4 * 3 * (D * D + D)
    assert b["activations kept for backward"] + b["other temporaries"] >= report.memory["temp"]
    assert 0 < b["activations kept for backward"] <= b_full["activations kept for backward"]
    assert "activations kept for backward (estimate)" in str(report)

    # The same report from shapes alone: nothing is allocated for the model.
    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    abstract = trainer.init(shapes[0])
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(abstract))
    from_shapes = trainer.report(abstract, shapes[1])
    assert from_shapes.memory == report.memory and from_shapes.breakdown == b
    assert from_shapes.flops == report.flops and from_shapes.trainable_params == report.trainable_params
    with pytest.raises(TypeError, match="holds shapes.*not stepped"):
        trainer(abstract, batch)
    with pytest.raises(pj.ExportError, match="holds shapes.*export needs a state made from arrays"):
        pj.export(trainer, abstract, shapes[1], out_dir=str(tmp_path / "never"))
    assert not (tmp_path / "never").exists()
    mixed = dict(params, l0=dict(params["l0"], w=shapes[0]["l0"]["w"]))
    with pytest.raises(TypeError, match=r"params\['l0'\]\['w'\] is a ShapeDtypeStruct"):
        trainer.init(mixed)


def test_fit_runs_the_loop_and_returns_history(capsys):
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-2), scheme=MIXED)
    state = trainer.init(_mlp_params())
    batches = _batches(5)
    state, history = pj.fit(trainer, state, batches, progress=False)
    assert int(state.step) == 5 and history.loss.shape == (5,) and history.steps == 5
    assert history.steps_per_second > 0
    assert capsys.readouterr().err == ""
    with pytest.warns(UserWarning, match="ran out after 5 of 7"):
        pj.fit(trainer, state, batches, steps=7, progress=False)


def test_fit_evaluates_saves_records_and_resumes_from_a_step():
    # Batches as a function of the step; evaluations, saves and records where asked;
    # a second fit from a saved state (start=) ends where one uninterrupted fit does,
    # and both equal the jax.grad + optax reference.
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-2), scheme=MIXED)
    batches = _batches(7)
    held = _batches(1, key=9)[0]
    evaluate = jax.jit(lambda s: _mlp_loss(s.params, held))
    records, saves = [], []
    state, history = pj.fit(trainer, trainer.init(_mlp_params()), lambda i: batches[i], 7,
                            progress=False, evaluate=evaluate, eval_every=3,
                            save=lambda s: saves.append(jax.tree.map(np.array, s)),
                            save_every=2, on_record=records.append,
                            tokens=lambda i: 10 + i)
    want, _ = reference_steps(_mlp_loss, optax.adam(1e-2), MIXED, _mlp_params(), batches)
    assert_trees_close(state.params, want)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 8))
    assert [r["step"] for r in records if "valid_loss" in r] == [0, 3, 6, 7]
    assert [v[0] for v in history.valid] == [0, 3, 6, 7]
    np.testing.assert_allclose(history.valid[-1][2], float(evaluate(state)), rtol=1e-6)
    assert [int(s.step) for s in saves] == [2, 4, 6, 7]
    assert history.tokens == sum(10 + i for i in range(7)) and history.steps == 7
    # Resume from the save at step 4: steps 5..7 only, the same end.
    start = jax.tree.map(jnp.asarray, saves[1])
    again, h2 = pj.fit(trainer, start, lambda i: batches[i], 7, start=4, progress=False)
    assert h2.steps == 3 and int(again.step) == 7
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(state)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="need steps="):
        pj.fit(trainer, again, lambda i: batches[i], progress=False)


@pytest.mark.parametrize("ready", [True, False])
def test_fit_records_when_each_step_ended(ready):
    # A step that ran within the call (one CPU device: its loss is ready on return) is
    # timed at its return, not when its loss is read, after the next step; a step still
    # running on return (asynchronous dispatch) is timed when its loss is read.
    import time

    class Loss(float):
        def is_ready(self):
            return ready

    def step(state, batch):
        time.sleep(0.3)
        return state + 1, {"loss": Loss(1.0)}

    records = []
    pj.fit(step, 0, [None] * 3, progress=False, on_record=records.append, compile_cache=False)
    seconds = [r["seconds"] for r in records if "loss" in r]
    if ready:  # each step's own end: 0.3, 0.6, 0.9
        assert [round(s / 0.3) for s in seconds] == [1, 2, 3], seconds
    else:  # read after the next step: 0.6, 0.9, and the last at the end
        assert [round(s / 0.3) for s in seconds] == [2, 3, 3], seconds


def test_fit_stops_at_a_nonfinite_loss_before_saving_past_it():
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.sgd(0.1), scheme=MIXED)
    batches = _batches(5)
    batches[2] = dict(batches[2], y=batches[2]["y"].at[0, 0].set(jnp.nan))
    saves = []
    with pytest.raises(pj.train.NonFiniteLoss, match="step 3: the loss is nan") as e:
        pj.fit(trainer, trainer.init(_mlp_params()), batches, progress=False,
               save=lambda s: saves.append(int(s.step)), save_every=1, stop_nonfinite=True)
    assert e.value.step == 3 and saves == [1, 2]
    # Without the guard the run goes on, and a skipping trainer counts the step.
    _, history = pj.fit(trainer, trainer.init(_mlp_params()), batches, progress=False)
    assert history.steps == 5 and np.isnan(history.loss[2])
    skipping = trainer.replace(skip_nonfinite=True)
    records = []
    _, history = pj.fit(skipping, skipping.init(_mlp_params()), batches, progress=False,
                        on_record=records.append, stop_nonfinite=True)
    assert history.skipped == 1 and len(history.loss) == 4
    assert {"step": 3, "skipped": True, "loss": None} in records


def test_fit_lowers_the_loss():
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(3e-2), scheme=MIXED)
    batch = _batches(1)[0]
    state, history = pj.fit(trainer, trainer.init(_mlp_params()), [batch] * 30, progress=False)
    assert history.loss[-1] < 0.8 * history.loss[0]


def test_one_array_in_two_leaves_can_be_donated():
    w = jnp.ones((D, D)) * 0.1
    params = {"l0": {"w": w, "b": jnp.zeros(D)}, "l1": {"w": w, "b": jnp.zeros(D)}}
    want, _ = reference_steps(_mlp_loss, optax.sgd(0.1), pj.Scheme(default=pj.Full()), params,
                              _batches(1))
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.sgd(0.1))
    state = trainer.init(params, copy=False)  # hands `w` over: it is donated below
    state, _ = trainer(state, _batches(1)[0])
    assert_trees_close(state.params, want)
    assert w.is_deleted()


def test_fit_and_decorator_argument_errors():
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.sgd(0.1), scheme=MIXED)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        pj.fit(trainer, trainer.init(_mlp_params()), _batches(1), steps=-1, progress=False)
    with pytest.raises(TypeError, match="decorates a loss function, got int"):
        pj.sparse_train(optimizer=optax.sgd(0.1))(3)


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler, as in a terminal: a process started in the background
    (as CI may start the tests) inherits SIGINT ignored."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def sigterm_default():
    """SIGTERM left to the operating system, as in a job a scheduler started."""
    import signal

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("sent", ["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("where", ["in the step", "between steps", "while a step is logged",
                                   "while it saves"])
def test_ctrl_c_or_sigterm_in_fit_returns_the_last_completed_state(where, sent, sigint_raises,
                                                                   sigterm_default):
    # Ctrl-C (a real SIGINT), or SIGTERM as a scheduler sends it, at the third step: fit
    # returns the state after the steps that completed, every one of them logged once, and
    # saves it once; the state passed in was donated to the first step.
    import os
    import signal

    sig = getattr(signal, sent)

    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-2), scheme=MIXED)
    batches = _batches(6)
    calls = []

    def step(state, batch):
        calls.append(1)
        if len(calls) == 3 and where == "in the step":
            os.kill(os.getpid(), sig)  # arrives while the step is dispatched
        return trainer(state, batch)

    def feed():
        for i, batch in enumerate(batches):
            if i == 3 and where == "between steps":
                os.kill(os.getpid(), sig)  # while the next batch is loaded
            yield batch

    logged, saved = [], []

    def log(record):
        if record["step"] == 2 and where == "while a step is logged":
            os.kill(os.getpid(), sig)  # arrives before the record is written
        logged.append(record["step"])

    def save(state):
        if int(state.step) == 3 and where == "while it saves":
            os.kill(os.getpid(), sig)  # arrives before the checkpoint is written
        saved.append(int(state.step))

    state = trainer.init(_mlp_params())
    name = "Ctrl-C" if sent == "SIGINT" else "SIGTERM"
    with pytest.warns(UserWarning, match=f"interrupted .{name}. after 3 steps"):
        state, history = pj.fit(step, state, feed(), progress=False, on_record=log, save=save,
                                save_every=1 if where == "while it saves" else None)
    assert history.interrupted and history.steps == 3 and history.loss.shape == (3,)
    assert history.stopped_by == name and logged == [1, 2, 3]
    assert saved == ([1, 2, 3] if where == "while it saves" else [3])
    assert int(state.step) == 3
    want, _ = reference_steps(_mlp_loss, optax.adam(1e-2), MIXED, _mlp_params(), batches[:3])
    assert_trees_close(state.params, want)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back as it was


def test_a_users_own_sigterm_handler_is_left_in_place(sigterm_default):
    import os
    import signal

    seen = []
    signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-2), scheme=MIXED)

    def step(state, batch):
        os.kill(os.getpid(), signal.SIGTERM)
        return trainer(state, batch)

    state, history = pj.fit(step, trainer.init(_mlp_params()), _batches(3), progress=False)
    assert not history.interrupted and history.steps == 3 and history.stopped_by is None
    assert seen == [signal.SIGTERM] * 3  # each held across its step, then handed on


def test_fit_leaves_an_ignored_sigint_ignored():
    # A process that ignores SIGINT (started in the background) keeps ignoring it: fit
    # neither turns it into an interrupt nor changes the handler.
    import os
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer = pj.sparse_train(_mlp_loss, optimizer=optax.adam(1e-2), scheme=MIXED)

        def step(state, batch):
            os.kill(os.getpid(), signal.SIGINT)
            return trainer(state, batch)

        state, history = pj.fit(step, trainer.init(_mlp_params()), _batches(3), progress=False)
        assert not history.interrupted and history.steps == 3
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_held_ctrl_c_goes_to_the_handler_installed_before(sigint_raises):
    import os
    import signal

    from pockjax._src.interrupt import InterruptAfter

    seen = []
    signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    with InterruptAfter():
        os.kill(os.getpid(), signal.SIGINT)
        assert seen == []  # held while the step is dispatched
    assert seen == [signal.SIGINT]


@pytest.mark.parametrize("where", ["input", "masked input", "none"])
def test_skip_nonfinite_leaves_all_state_untouched(where):
    # A NaN in one batch element: plain optax (and the trainer without the option) turns
    # the trained slices and their optimizer state NaN. With skip_nonfinite the step
    # changes nothing, bit for bit; good steps equal the reference.
    def loss(p, batch):
        h = batch["x"]
        for i in range(len(p)):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        err = jnp.where(batch["mask"][:, None], h - batch["y"], 0.0)  # NaN rows masked out
        return jnp.sum(err ** 2) / jnp.maximum(jnp.sum(batch["mask"]), 1)

    good = [dict(b, mask=jnp.ones(8, bool)) for b in _batches(3)]
    bad = dict(good[1], x=good[1]["x"].at[2, 5].set(jnp.nan))
    if where == "masked input":  # the forward pass is finite, the gradient is NaN
        bad["mask"] = bad["mask"].at[2].set(False)
    if where == "none":
        bad = good[1]
    params = _mlp_params()
    params["l0"]["w"] = params["l0"]["w"].at[0, 0].set(-0.0)
    trainer = pj.sparse_train(loss, optimizer=optax.adam(1e-2), scheme=MIXED, skip_nonfinite=True)
    state = trainer.init(params)
    state, m0 = trainer(state, good[0])
    before = jax.tree_util.tree_map(np.array, state)
    state, m1 = trainer(state, bad)
    assert bool(m1["skipped"]) == (where != "none") and not bool(m0["skipped"])
    if where != "none":
        jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b),
                               state, before)
        assert np.signbit(np.asarray(state.params["l0"]["w"][0, 0]))
    state, _ = trainer(state, good[2])
    steps = [good[0], good[2]] if where != "none" else good
    want, _ = reference_steps(loss, optax.adam(1e-2), MIXED, params, steps)
    assert_trees_close(state.params, want)
    assert int(state.step) == len(steps)
    assert "skip_nonfinite" in trainer.report(state, good[0]).mode_reason
