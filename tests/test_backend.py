"""Backend switching (pockjax.backend.Runner): XLA and IREE host-cpu steps against the
plain reference (dense jax.grad + the same optax chain on the kept slices, written back),
the auto choice, and that measuring does not advance the training."""
import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp
import pockjax as pj
from pockjax.backend import BackendChoice, Runner
from tests.export.models import mlp
from tests.helpers import assert_trees_close
from tests.train.test_train import reference_steps


def adversarial_batches(n=4):
    """The export MLP's batches with exact zeros: a zero row, a zero feature, zero targets."""
    _, _, _, batch = mlp()
    out = []
    for i in range(n):
        x = np.array(batch["x"]) * (1 + 0.1 * i)
        x[0] = 0.0
        x[:, i] = 0.0
        y = np.array(batch["y"])
        y[-1] = 0.0
        out.append({"x": jnp.asarray(x), "y": jnp.asarray(y)})
    return out


@pytest.fixture(scope="module")
def setup():
    loss, params, scheme, _ = mlp()
    opt = optax.adamw(1e-2, weight_decay=0.1)
    trainer = pj.sparse_train(loss, optimizer=opt, scheme=scheme)
    batches = adversarial_batches()
    want = reference_steps(loss, optax.adamw(1e-2, weight_decay=0.1), scheme, params, batches)
    # the loss each step reports: of the parameters before it, on its batch
    want_losses = [float(loss(reference_steps(loss, optax.adamw(1e-2, weight_decay=0.1), scheme,
                                              params, batches[:k])[0], b))
                   for k, b in enumerate(batches)]
    return trainer, params, batches, want + (want_losses,)


@pytest.mark.parametrize("backend", ["xla", "iree"])
def test_each_backend_trains_as_the_reference(setup, backend, tmp_path):
    trainer, params, batches, (want_params, want_opt, want_losses) = setup
    runner = Runner(trainer, trainer.init(params), batches[0], backend=backend,
                    workdir=str(tmp_path), progress=False)
    assert runner.backend == backend and runner.choice.ms_per_step == {}
    losses = [float(runner.step(b)["loss"]) for b in batches]
    state = runner.state
    assert int(state.step) == len(batches)
    tol = 1e-6 if backend == "xla" else 2e-5  # IREE rounds differently
    assert_trees_close(state.params, want_params, rtol=tol, atol=tol)
    assert_trees_close(state.opt_state, want_opt, rtol=tol, atol=tol)
    # untouched: frozen leaves and untrained channels, bit for bit
    np.testing.assert_array_equal(state.params["l0"]["w"], params["l0"]["w"])
    np.testing.assert_array_equal(state.params["l1"]["w"][4:], params["l1"]["w"][4:])
    np.testing.assert_allclose(losses, want_losses, rtol=tol)
    # the state read back is a TrainState the XLA trainer continues from
    state, metrics = trainer.step(state, batches[0])
    assert np.isfinite(float(metrics["loss"]))


def test_auto_measures_both_and_does_not_advance_the_state(setup, tmp_path):
    trainer, params, batches, (want_params, _, _) = setup
    runner = Runner(trainer, trainer.init(params), batches[0], backend="auto", steps=2,
                    workdir=str(tmp_path), progress=False)
    choice = runner.choice
    assert set(choice.ms_per_step) == {"xla", "iree"} and choice.requested == "auto"
    assert choice.backend == min(choice.ms_per_step, key=choice.ms_per_step.get)
    assert choice.export_s is not None and choice.export_s > 0
    assert str(choice).startswith(f"{choice.backend}: ") and "iree host-cpu" in str(choice) \
        or str(choice).startswith("iree: ")
    assert int(runner.state.step) == 0
    for b in batches:
        runner.step(b)
    state = runner.state
    assert int(state.step) == len(batches)  # the measured steps (3 per backend) left no trace
    assert_trees_close(state.params, want_params, rtol=2e-5, atol=2e-5)


def test_report_names_the_backend(setup, tmp_path):
    trainer, params, batches, _ = setup
    runner = Runner(trainer, trainer.init(params), batches[0], backend="xla", progress=False)
    report = runner.report()
    assert report.backend == "xla (as asked)"
    assert "backend: xla (as asked)" in str(report)
    assert report.trainable_params == trainer.report(trainer.init(params), batches[0]).trainable_params


def test_bad_arguments_are_refused(setup):
    trainer, params, batches, _ = setup
    state = trainer.init(params)
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'xla', 'iree', got 'tpu'"):
        Runner(trainer, state, batches[0], backend="tpu")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        Runner(trainer, state, batches[0], steps=0)
    with pytest.raises(TypeError, match="Runner takes a pockjax.SparseTrainer"):
        Runner(lambda s, b: None, state, batches[0])


def test_choice_text():
    c = BackendChoice("xla", "auto", {"xla": 12.0, "iree": 20.5}, 3, 4.0)
    assert str(c) == ("xla: 12.0 ms/step (iree host-cpu 20.5 ms/step), chosen by "
                      "backend='auto', median of 3 steps on the first batch")


# --------------------------------------------------------------------------- nnx.Trainer

class _Net:
    """A small NNX model with batch statistics (carried as the module's other state)."""

    @staticmethod
    def make():
        from flax import nnx

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.l0 = nnx.Linear(6, 12, rngs=rngs)
                self.bn = nnx.BatchNorm(12, rngs=rngs)
                self.l1 = nnx.Linear(12, 3, rngs=rngs)

            def __call__(self, x):
                return self.l1(jax.nn.relu(self.bn(self.l0(x))))

        return Net(nnx.Rngs(0))


def _net_batches(n=4):
    out = []
    for i in range(n):
        x = np.array(jax.random.normal(jax.random.key(10 + i), (8, 6)))
        x[0] = 0.0       # a zero row
        x[:, -1] = 0.0   # a zero feature
        out.append((jnp.asarray(x), jnp.asarray(np.arange(8) % 3)))
    return out


def _net_loss(model, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _net_trainer(backend):
    from flax import nnx

    scheme = pj.Scheme({"l0/**": pj.Frozen(), "l1/kernel": pj.Channels(count=2, axis="out")},
                       default=pj.Full())
    return pj.nnx.Trainer(_Net.make(), _net_loss, optimizer=optax.adam(1e-2), scheme=scheme,
                          backend=backend)


def test_nnx_trainer_on_iree_equals_xla_with_batch_statistics():
    batches = _net_batches()
    xla, iree = _net_trainer("xla"), _net_trainer("iree")
    got = [float(iree(b)["loss"]) for b in batches]
    want = [float(xla(b)["loss"]) for b in batches]
    np.testing.assert_allclose(got, want, rtol=2e-5)
    assert iree.choice.backend == "iree" and xla.choice is None
    assert int(iree.state.step) == len(batches)
    assert_trees_close(iree.state.params, xla.state.params, rtol=2e-5, atol=1e-6)
    assert_trees_close(iree.state.opt_state, xla.state.opt_state, rtol=2e-5, atol=1e-6)
    assert_trees_close(jax.tree.map(np.asarray, iree.rest), jax.tree.map(np.asarray, xla.rest),
                       rtol=2e-5, atol=1e-6)  # batch statistics carried through IREE
    np.testing.assert_array_equal(iree.state.params["l0"]["kernel"],
                                  _net_trainer("xla").state.params["l0"]["kernel"])
    assert "backend: iree (as asked)" in str(iree.report(batches[0]))
    assert "backend: xla" in str(xla.report(batches[0]))
    model = iree.model()  # the trained module, built from the state read back
    np.testing.assert_allclose(_net_loss(model, batches[0]), _net_loss(xla.model(), batches[0]),
                               rtol=2e-5)
    with pytest.raises(ValueError, match="its state cannot be replaced"):
        iree.state = xla.state


def test_nnx_trainer_auto_and_fit():
    batches = _net_batches()
    auto, xla = _net_trainer("auto"), _net_trainer("xla")
    history = auto.fit(batches, progress=False)
    want = xla.fit(batches, progress=False)
    assert set(auto.choice.ms_per_step) == {"xla", "iree"}
    assert int(auto.state.step) == len(batches)  # the measurement's steps left no trace
    tol = 0 if auto.choice.backend == "xla" else 2e-5
    np.testing.assert_allclose(history.loss, want.loss, rtol=tol)
    assert f"backend: {auto.choice.backend}: " in str(auto.report(batches[0]))


def test_nnx_trainer_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'xla', 'iree', got 'gpu'"):
        _net_trainer("gpu")


def test_iree_metrics_keep_an_aux_pytree(tmp_path):
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Aux:
        mean_out: jax.Array
        per_row: jax.Array

    loss, params, scheme, batch = mlp()

    def with_aux(p, b):
        h = b["x"] @ p["l0"]["w"]
        return loss(p, b), Aux(jnp.mean(h), jnp.sum(h, axis=1))

    trainer = pj.sparse_train(with_aux, optimizer=optax.adam(1e-2), scheme=scheme, has_aux=True)
    runner = Runner(trainer, trainer.init(params), batch, backend="iree", workdir=str(tmp_path),
                    progress=False)
    got = runner.step(batch)
    _, want = trainer(trainer.init(params), batch)
    assert isinstance(got["aux"], Aux)
    assert_trees_close(got, jax.tree.map(np.asarray, want), rtol=2e-5, atol=1e-6)
