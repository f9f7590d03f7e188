"""Shared checks: a sparse gradient must equal dense `jax.grad` sliced the same way."""
from __future__ import annotations

import functools
import os

import jax
import numpy as np

import pockjax as pj


@functools.lru_cache(maxsize=32)
def _jitted_grad(fun, argnums, has_aux):
    return jax.jit(jax.grad(fun, argnums=argnums, has_aux=has_aux))


def dense_grad(fun, params, *args, argnums=0, has_aux=False):
    """`jax.grad` of `fun`, compiled once per function and argument shapes, so that
    the schemes tested against one model share the reference's compile (an uncompiled
    gradient of a large model runs op by op, minutes for MobileNetV2 in float64).
    With a Python value among the arguments (a setting the function may branch on)
    the gradient is taken uncompiled."""
    leaves = jax.tree_util.tree_leaves((params, args))
    if all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
        try:
            return _jitted_grad(fun, argnums, has_aux)(params, *args)
        except TypeError as e:  # an unhashable callable or argnums
            if "unhashable" not in str(e):
                raise
    return jax.grad(fun, argnums=argnums, has_aux=has_aux)(params, *args)


def dense_view(fun, scheme, params, *args, argnums=0, has_aux=False):
    """`jax.grad` of `fun`, sliced to the trainable view of `scheme`."""
    g = dense_grad(fun, params, *args, argnums=argnums, has_aux=has_aux)
    if has_aux:
        g = g[0]
    return pj.trainable_view(g, scheme)


def no_nodes(grad):
    """A sparse gradient of stored weights with each `pockjax.lowbit.Quantized` node (all
    of whose arrays are frozen: None) as one None, as the float model's gradient has it."""
    from pockjax import lowbit

    return jax.tree.map(lambda x: None if lowbit.is_quantized(x) else x, grad,
                        is_leaf=lambda x: x is None or lowbit.is_quantized(x))


def dequantized(params, dtype=np.float32):
    """`params` with every stored weight (`pockjax.lowbit.Quantized`) and every other
    leaf in `dtype`: the float model holding the stored values."""
    from pockjax import lowbit

    return jax.tree.map(lambda x: lowbit.dequantize(x, dtype), params,
                        is_leaf=lowbit.is_quantized)


def assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    got_leaves, got_def = jax.tree_util.tree_flatten(got, is_leaf=lambda x: x is None)
    want_leaves, want_def = jax.tree_util.tree_flatten(want, is_leaf=lambda x: x is None)
    assert got_def == want_def, f"tree structures differ:\n{got_def}\n{want_def}"
    for path_g, (a, b) in zip(jax.tree_util.tree_flatten_with_path(
            got, is_leaf=lambda x: x is None)[0], zip(got_leaves, want_leaves)):
        if b is None:
            assert a is None, f"{path_g[0]}: expected None, got {type(a)}"
            continue
        assert np.shape(a) == np.shape(b), f"{path_g[0]}: shape {np.shape(a)} vs {np.shape(b)}"
        scale = float(np.max(np.abs(np.asarray(b)))) if np.size(b) else 0.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol,
                                   atol=atol + rtol * scale, err_msg=str(path_g[0]))


def assert_matches_dense(fun, scheme, params, *args, rtol=1e-5, atol=1e-6, eager=True):
    """sparse_grad equals sliced jax.grad, called directly and under jax.jit.

    `eager=False` leaves out the direct call, which runs the same transformed program op
    by op (compiling each operation's shapes): property tests that draw many models use
    it, and the direct call is covered by the fixed-model tests beside them.
    Returns the transform's `TransformInfo` for further checks.
    """
    want = dense_view(fun, scheme, params, *args)
    sg = pj.sparse_grad(fun, scheme)
    if eager:
        assert_trees_close(sg(params, *args), want, rtol, atol)
    assert_trees_close(jax.jit(sg)(params, *args), want, rtol, atol)
    return sg.explain(params, *args)


def flops(fn, *args) -> float:
    analysis = jax.jit(fn).lower(*args).compile().cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis["flops"])


def temp_bytes(fn, *args) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


# MobileNetV2's stages for tests that compile training steps: 6 blocks instead of 17, with
# every block kind of the full network (no expansion; expansion at stride 2; stride 1
# with a residual; a stride-1 stage start that changes the channels). Compiling the
# full network's step is most of such a test's time; architecture tests keep 17 blocks.
MOBILENETV2_STAGES = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 2, 2), (6, 64, 1, 1))


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def run_example(script: str, *args: str, timeout: int = 900) -> str:
    """Run `examples/<script>` as a user does and return its standard output.

    The examples that step an artifact on lavapipe can lose the Vulkan device at random
    (docs/export.md, "Vulkan on lavapipe: device loss"); a run that failed with
    `pockjax.runtime.DeviceLost` is repeated once, with a warning. Any other failure is
    not repeated."""
    import subprocess
    import sys
    import warnings

    for attempt in (1, 2):
        proc = subprocess.run([sys.executable, script, *args], cwd=EXAMPLES,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 0 or attempt == 2 or "DeviceLost" not in proc.stderr:
            break
        warnings.warn(f"{script} lost the Vulkan device ({proc.stderr.strip().splitlines()[-1]}); "
                      "running it again")
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def assert_artifact_follows(apply, params, x, out_dir, scheme, steps: int = 2):
    """A host-cpu artifact of `sparse_train` on `mean(apply(params, x) ** 2)` (Adam
    1e-2, `scheme`) gives the JAX trainer's loss at each of `steps` steps (1e-5)."""
    import optax

    trainer = pj.sparse_train(lambda p, b: jax.numpy.mean(apply(p, b) ** 2),
                              optimizer=optax.adam(1e-2), scheme=scheme)
    state = trainer.init(params)
    trainer.export(state, x, target="host-cpu", out_dir=str(out_dir))
    session = pj.runtime.load(str(out_dir))
    for _ in range(steps):
        state, metrics = trainer(state, x)
        np.testing.assert_allclose(np.asarray(session.step(x)["loss"]),
                                   np.asarray(metrics["loss"]), rtol=1e-5)
