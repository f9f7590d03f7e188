"""host-cpu artifacts run with IREE's runtime and match the JAX trainer step by step."""
import json

import numpy as np
import pytest

import pockjax as pj
from pockjax import runtime
from tests.export.models import MODELS, eval_loss, make, run_against_jax
from tests.helpers import assert_trees_close

STEPS = 3


@pytest.fixture(scope="module", params=list(MODELS))
def exported(request, tmp_path_factory):
    trainer, params, batch = make(request.param)
    out = tmp_path_factory.mktemp(request.param) / "artifact"
    art = trainer.export(trainer.init(params), batch, target="host-cpu", out_dir=out)
    return request.param, trainer, params, batch, art


def test_artifact_matches_the_jax_trainer(exported, tmp_path):
    name, trainer, params, batch, art = exported
    sess = runtime.load(art.path, device="local-task")
    state = run_against_jax(sess, trainer, params, batch, STEPS)
    np.testing.assert_allclose(sess.evaluate(batch), eval_loss(trainer, state.params, batch), rtol=1e-4)
    # The session's checkpoint is pockjax.save's format: it loads into the JAX state.
    sess.save(tmp_path / "ckpt.safetensors")
    loaded = pj.load(tmp_path / "ckpt.safetensors", like=state)
    assert_trees_close(loaded, state, rtol=1e-4, atol=1e-6)


def test_manifest_describes_the_artifact(exported):
    name, trainer, params, batch, art = exported
    m = pj.export.read_manifest(art.path)
    assert m["target"]["name"] == "host-cpu" and "--iree-llvmcpu-target-cpu=host" in m["target"]["flags"]
    assert [s["name"] for s in m["functions"]["train_step"]["inputs"]] == sorted(batch)
    roles = {p["name"]: p["role"] for p in m["parameters"]}
    decisions = pj.scheme.leaves_with_paths(trainer.scheme.resolve(params))[0]
    for path, d in decisions:
        assert roles[f"params/{path}"] == ("frozen" if isinstance(d, pj.Frozen) else "trainable")
    assert pj.Scheme.from_json(json.dumps(m["scheme"])) == trainer.scheme
    assert m["update_mode"] == ("global" if name == "clipped" else "fused")
    assert set(m["files"]) == {"train_step.vmfb", "params.irpa"}
