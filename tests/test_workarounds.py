"""Canaries for the upstream behaviour pockjax works around (docs/workarounds.md).

Each test reproduces one upstream bug or limitation directly against the upstream
library (JAX/XLA, IREE's compiler and runtime, torchax), without pockjax's workaround,
and asserts that it is still there. A test that fails means upstream changed: read the
ledger entry its docstring names, check the workaround against the new behaviour, and
remove it (and the canary) or update both.

The IREE tests compile for llvm-cpu, Vulkan and CUDA (compiling needs no GPU) and run on
`local-task`; the Vulkan runs use this machine's Vulkan driver (Mesa's lavapipe in CI).
Without a Vulkan driver they fail, as tests/export/test_vulkan.py does.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export, lax

CPU = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
       "--iree-llvmcpu-target-cpu=generic")


def _vulkan(gpu: str) -> tuple[str, ...]:
    return ("--iree-hal-target-device=vulkan", f"--iree-vulkan-target={gpu}")


CUDA = ("--iree-hal-target-device=cuda", "--iree-cuda-target=sm_87")


# --------------------------------------------------------------------------- IREE helpers


def _stablehlo(fn, *args, donate=()) -> str:
    """`fn` lowered by `jax.jit` at `args` (arrays or `jax.ShapeDtypeStruct`s)."""
    return jax.jit(fn, donate_argnums=donate).lower(*args).as_text()


def _compile(mlir: str, flags) -> bytes:
    import iree.compiler as ic

    return ic.compile_str(mlir, input_type="stablehlo", extra_args=list(flags))


def _compile_error(mlir: str, flags) -> str | None:
    """The compiler's error lines, or None when `mlir` compiles."""
    import iree.compiler as ic

    try:
        _compile(mlir, flags)
    except ic.CompilerToolError as e:
        return "\n".join(line for line in str(e).splitlines() if "error" in line)
    return None


def _call(vmfb: bytes, device, *args):
    """Run `main` of a compiled module on an IREE device; returns its DeviceArray outputs."""
    import iree.runtime as ir

    instance = ir.VmInstance()
    module = ir.VmModule.copy_buffer(instance, vmfb)
    context = ir.VmContext(instance, modules=[ir.create_hal_module(instance, device), module])
    out = ir.FunctionInvoker(context, device, module.lookup_function("main"))(*args)
    return out if isinstance(out, (tuple, list)) else (out,)


def _read(device, array) -> np.ndarray:
    """A numpy copy of a DeviceArray, through a mapped staging buffer (see
    `test_upstream_iree_vulkan_to_host_still_needs_workaround` for why not `to_host`)."""
    import iree.runtime as ir

    buffer = array._buffer_view.get_buffer()
    staging = device.allocator.allocate_buffer(
        memory_type=int(ir.MemoryType.HOST_LOCAL | ir.MemoryType.DEVICE_VISIBLE),
        allowed_usage=int(ir.BufferUsage.TRANSFER_TARGET | ir.BufferUsage.MAPPING_SCOPED),
        allocation_size=buffer.byte_length())
    sem = device.create_semaphore(0)
    device.queue_copy(buffer, staging, wait_semaphores=ir.HalFence.create_at(sem, 0),
                      signal_semaphores=ir.HalFence.create_at(sem, 1))
    ir.HalFence.create_at(sem, 1).wait()
    return np.array(staging.map().asarray(array.shape, array.dtype))


def _run(vmfb: bytes, device, *args) -> list[np.ndarray]:
    """`main`'s outputs as numpy arrays; the device arrays are freed before returning,
    while `device` is still held (see `test_upstream_iree_device_array_frees_device_first_...`)."""
    return [_read(device, o) for o in _call(vmfb, device, *args)]


@pytest.fixture(scope="module")
def cpu_device():
    import iree.runtime as ir

    return ir.get_device("local-task", cache=False)


@pytest.fixture(scope="module")
def vulkan_device():
    import iree.runtime as ir

    return ir.get_device("vulkan", cache=False)


# --------------------------------------------------------------------------- IREE: compiler


def test_upstream_iree_donated_update_before_read_still_needs_workaround(cpu_device):
    """Ledger: "In-place update scheduled before a read of the old value".

    A plain `jit(grad + SGD)` step with its parameters donated: IREE writes w1 and b1
    in place before the backward reads them again, and returns wrong values without an
    error. The same step without donation is right."""
    def loss(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def step(p, x, y):
        return jax.tree_util.tree_map(lambda a, g: a - 0.5 * g, p, jax.grad(loss)(p, x, y))

    rs = np.random.RandomState(0)
    p = {"b1": (rs.randn(16) * 0.1).astype(np.float32),
         "w1": (rs.randn(8, 16) * 0.5).astype(np.float32),
         "w2": (rs.randn(16, 4) * 0.5).astype(np.float32)}
    x, y = rs.randn(4, 8).astype(np.float32), rs.randn(4, 4).astype(np.float32)
    want = jax.tree_util.tree_leaves(jax.jit(step)(p, x, y))
    leaves = jax.tree_util.tree_leaves(p)

    def errors(donate):
        vmfb = _compile(_stablehlo(step, p, x, y, donate=donate), CPU)
        got = _run(vmfb, cpu_device, *leaves, x, y)
        return [float(np.abs(g - np.asarray(w)).max()) for g, w in zip(got, want)]

    assert max(errors(())) < 1e-5
    assert max(errors((0,))) > 1e-2, (
        "IREE now orders a donated parameter's in-place update after its reads: review "
        "the data ties of pockjax/optim/fused.py, the stream check of pockjax/export/stream.py "
        "and the per-step scalar buffers of pockjax/export/lowering.py")


def test_upstream_iree_gpu_neg_sum_still_needs_workaround():
    """Ledger: "GPU reduction of a negation has no identity value".

    `sum(-x)` fails to compile for a Vulkan GPU with subgroup operations (valhall);
    `-sum(x)`, what `legalize_for_iree` writes, compiles."""
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    error = _compile_error(_stablehlo(lambda x: jnp.sum(-x, axis=1), x), _vulkan("valhall"))
    assert error is not None and "Failed to get an identity value for the reduction" in error, (
        "IREE now compiles reduce_sum(neg x) for GPUs: the neg-sum rewrite of "
        "pockjax/transforms/legalize.py can go")
    assert _compile_error(_stablehlo(lambda x: -jnp.sum(x, axis=1), x), _vulkan("valhall")) is None


def test_upstream_iree_select_and_scatter_still_needs_workaround():
    """Ledger: "select_and_scatter reads an uninitialised buffer".

    The backward of max pooling (`select_and_scatter`) compiles for llvm-cpu with IREE's
    warning that it reads values from an uninitialised `tensor.empty`."""
    from iree.compiler.tools.binaries import find_tool

    def pooled(x):
        return jnp.sum(lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                                         "VALID") ** 2)

    mlir = _stablehlo(jax.grad(pooled), jax.ShapeDtypeStruct((1, 4, 4, 2), jnp.float32))
    assert "stablehlo.select_and_scatter" in mlir
    run = subprocess.run([find_tool("iree-compile"), "-", "--iree-input-type=stablehlo", *CPU,
                          "-o", "/dev/null"], input=mlir, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "reads uninitialized values from an operand produced by a tensor.empty" in run.stderr, (
        "IREE no longer lowers select_and_scatter onto an uninitialised buffer: the "
        "select_and_scatter_add rewrite of pockjax/transforms/legalize.py can go")


def test_upstream_iree_cuda_batched_gather_still_needs_workaround():
    """Ledger: "CUDA code generation of a gather with batching dimensions".

    The mean over 32 examples of `logsumexp(logits) - take_along_axis(logits, labels)`
    fails to compile for CUDA ("failed to distribute"); the same values read by a plain
    gather with an iota index column, as `legalize_for_iree` writes it, compile."""
    logits = jax.ShapeDtypeStruct((32, 16), jnp.float32)
    labels = jax.ShapeDtypeStruct((32,), jnp.int32)

    def batched(logits, labels):
        picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, -1) - picked)

    def plain(logits, labels):
        return jnp.mean(jax.nn.logsumexp(logits, -1) - logits[jnp.arange(32), labels])

    mlir = _stablehlo(batched, logits, labels)
    assert "operand_batching_dims" in mlir
    error = _compile_error(mlir, CUDA)
    assert error is not None and "failed to distribute" in error, (
        "IREE now compiles batched gathers for CUDA: the unbatched_gather rewrite of "
        "pockjax/transforms/legalize.py can go")
    assert _compile_error(_stablehlo(plain, logits, labels), CUDA) is None


def test_upstream_iree_vulkan_leading_axis_reduction_still_needs_workaround():
    """Ledger: "SPIR-V reduction over leading axes fused with its consumer".

    `x - sum(x, 0) / n` on 256 x 16 fails to compile for valhall ("failed to legalize
    operation 'arith.constant'"); with an optimization barrier after the sum, as
    `legalize_for_iree(backend="vulkan")` places it, it compiles."""
    x = jax.ShapeDtypeStruct((256, 16), jnp.float32)
    error = _compile_error(_stablehlo(lambda x: x - jnp.sum(x, 0) / 256, x), _vulkan("valhall"))
    assert error is not None and "failed to legalize operation 'arith.constant'" in error, (
        "IREE now compiles a leading-axis reduction fused with its consumer for Vulkan: the "
        "Vulkan-only barrier of pockjax/transforms/legalize.py can go")
    barrier = _stablehlo(lambda x: x - lax.optimization_barrier(jnp.sum(x, 0)) / 256, x)
    assert _compile_error(barrier, _vulkan("valhall")) is None


def test_upstream_iree_dynamic_shapes_still_needs_workaround():
    """Ledger: "Dynamic shapes".

    The gradient of a layer-norm-like loss exported with a symbolic batch dimension
    fails to compile for llvm-cpu (`stablehlo.dynamic_broadcast_in_dim`); the same
    function at a fixed batch compiles."""
    def loss(w, x):
        h = x @ w
        m = h.mean(-1, keepdims=True)
        v = ((h - m) ** 2).mean(-1, keepdims=True)
        return jnp.mean((h - m) * lax.rsqrt(v + 1e-5))

    w = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    b, = export.symbolic_shape("b")
    dynamic = export.export(jax.jit(jax.grad(loss)))(
        w, jax.ShapeDtypeStruct((b, 4), jnp.float32)).mlir_module()
    error = _compile_error(dynamic, CPU)
    assert error is not None and "dynamic_broadcast_in_dim" in error, (
        "IREE now compiles this dynamic-batch step: review the fixed-shape requirement of "
        "pockjax/export/lowering.py (_check_static)")
    fixed = _stablehlo(jax.grad(loss), w, jax.ShapeDtypeStruct((3, 4), jnp.float32))
    assert _compile_error(fixed, CPU) is None


# --------------------------------------------------------------------------- IREE: runtime


def test_upstream_iree_vulkan_subgroup_size_still_needs_workaround(vulkan_device):
    """Ledger: "Vulkan runtime does not check the subgroup size".

    A full max reduction compiled for valhall (subgroups of 16) runs on lavapipe
    (subgroups of 8) without an error and returns a wrong maximum; compiled for
    vp_android_baseline_2022 (no subgroup operations) it is right."""
    x = np.random.RandomState(0).randn(64, 1000).astype(np.float32)
    mlir = _stablehlo(jnp.max, x)
    right, = _run(_compile(mlir, _vulkan("vp_android_baseline_2022")), vulkan_device, x)
    assert right == x.max()
    wrong, = _run(_compile(mlir, _vulkan("valhall")), vulkan_device, x)
    assert abs(float(wrong) - float(x.max())) > 1e-3, (
        "IREE's Vulkan runtime now runs (or refuses) a kernel compiled for another subgroup "
        "size correctly: review the device check of pockjax/runtime/__init__.py (_check_vulkan)")


def test_upstream_iree_vulkan_narrow_storage_still_needs_workaround(vulkan_device):
    """Ledger: "Emulated 8/16-bit storage computes wrong values".

    A float16 input and a boolean input read by kernels compiled for
    vp_android_baseline_2022 (32-bit storage only, so IREE emulates narrower accesses)
    give wrong values on lavapipe."""
    rs = np.random.RandomState(0)
    x = rs.randn(7, 5).astype(np.float32)
    cases = [(lambda x, q: x * q.astype(jnp.float32), rs.randn(7, 5).astype(np.float16)),
             (lambda x, q: jnp.where(q, x, 0.0), rs.rand(7, 5) > 0.5)]
    for f, q in cases:
        got, = _run(_compile(_stablehlo(f, x, q), _vulkan("vp_android_baseline_2022")),
                    vulkan_device, x, q)
        assert np.abs(got - np.asarray(f(x, q))).max() > 1e-2, (
            f"IREE's emulated {q.dtype} storage now computes right on vp_android_baseline_2022: "
            "review check_storage in pockjax/export/artifact.py")


def test_upstream_iree_vulkan_batch_grouped_conv_still_needs_workaround(vulkan_device):
    """Ledger: "Batch-grouped convolution on Vulkan".

    The kernel gradient of an 8-channel depth-wise convolution over a batch of 2 (a
    convolution with `batch_group_count=8`) comes back wrong on lavapipe; the same
    gradient as `legalize_for_iree` writes it (a depth-wise convolution summed over the
    batch) is right."""
    from jax.extend.core import jaxpr_as_fun

    from pockjax.transforms.legalize import legalize_for_iree

    def kernel_grad(x, dy):
        def conv(w):
            return lax.conv_general_dilated(x, w, (1, 1), "VALID", feature_group_count=8,
                                            dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jax.vjp(conv, jnp.zeros((8, 1, 3, 3), jnp.float32))[1](dy)[0]

    rs = np.random.RandomState(0)
    x, dy = rs.randn(2, 8, 8, 8).astype(np.float32), rs.randn(2, 8, 6, 6).astype(np.float32)
    want = np.asarray(kernel_grad(x, dy))
    mlir = _stablehlo(kernel_grad, x, dy)
    assert "batch_group_count = 8" in mlir
    fixed, stats = legalize_for_iree(jax.make_jaxpr(kernel_grad)(x, dy), "vulkan")
    assert stats == {"batch_grouped_conv": 1}
    right, = _run(_compile(_stablehlo(lambda *a: jaxpr_as_fun(fixed)(*a)[0], x, dy),
                           _vulkan("vp_android_baseline_2022")), vulkan_device, x, dy)
    np.testing.assert_allclose(right, want, rtol=1e-5, atol=1e-5)
    wrong, = _run(_compile(mlir, _vulkan("vp_android_baseline_2022")), vulkan_device, x, dy)
    assert np.abs(wrong - want).max() > 1e-2, (
        "IREE's Vulkan code generation now computes a batch-grouped convolution right: the "
        "batch_grouped_conv rewrite of pockjax/transforms/legalize.py can go")


def test_upstream_iree_vulkan_to_host_still_needs_workaround(vulkan_device):
    """Ledger: "`DeviceArray.to_host` on Vulkan".

    `to_host` imports a fresh numpy array into the Vulkan allocator, which reports
    host imports as supported but refuses a pointer that is not page-aligned. The output
    is over 32 MiB, so numpy's buffer comes from `mmap` with glibc's 16-byte header:
    never page-aligned."""
    n = 9 * 2 ** 20
    vmfb = _compile(_stablehlo(lambda x: jnp.zeros((n,), jnp.float32) + x[0],
                               jax.ShapeDtypeStruct((4,), jnp.float32)), _vulkan("valhall"))
    out, = _call(vmfb, vulkan_device, np.ones(4, np.float32))
    with pytest.raises(ValueError, match="minImportedHostPointerAlignment"):
        out.to_host()
    del out


def test_upstream_iree_device_array_frees_device_first_still_needs_workaround(tmp_path):
    """Ledger: "A DeviceArray releases its device before its buffer".

    A process whose last reference to the device is a step output's `DeviceArray`
    crashes when that array is freed: the device goes first, then the buffer is released
    into it."""
    vmfb = tmp_path / "step.vmfb"
    vmfb.write_bytes(_compile(_stablehlo(lambda x: x * 2 + 1,
                                         jax.ShapeDtypeStruct((1024,), jnp.float32)), CPU))
    script = textwrap.dedent(f"""
        import resource, numpy as np, iree.runtime as ir
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the crash leaves no core file
        device = ir.get_device("local-task", cache=False)
        instance = ir.VmInstance()
        module = ir.VmModule.copy_buffer(instance, open({str(vmfb)!r}, "rb").read())
        context = ir.VmContext(instance, modules=[ir.create_hal_module(instance, device), module])
        main = ir.FunctionInvoker(context, device, module.lookup_function("main"))
        out = main(main(np.ones(1024, np.float32)))
        del main, context, module, instance, device
        del out
        print("freed")
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert run.returncode == -11 and "freed" not in run.stdout, (
        f"freeing the array no longer crashes (exit {run.returncode}): review the release "
        f"order of Session.close in pockjax/runtime/__init__.py\n{run.stderr[-2000:]}")


# --------------------------------------------------------------------------- XLA's CPU backend


def _computations(hlo: str) -> dict[str, str]:
    """The computations of an HLO module's text by name (the entry one is `main...`)."""
    return {m.group(1): m.group(2) for m in
            re.finditer(r"^(?:ENTRY )?%(\S+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M)}


def _compiled(fn, *args, donate=()):
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile()


def test_upstream_xla_cpu_checkpoint_still_needs_workaround():
    """Ledger: "Recomputation of `jax.checkpoint` scheduled beside the forward".

    Six MLP blocks, each under `jax.checkpoint` saving nothing: the gradient's
    temporaries are as large as without any checkpoint, because XLA drops the
    checkpoint's barriers and recomputes each block right after its forward."""
    def block(h, w):
        return h + jnp.tanh(jnp.tanh(h @ w[0]) * 2.0) @ w[1]

    def grad(remat):
        blk = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable) \
            if remat else block

        def loss(ws, x):
            h = x
            for w in ws:
                h = blk(h, w)
            return jnp.sum(h ** 2)

        return jax.grad(loss)

    rs = np.random.RandomState(0)
    ws = [(jnp.asarray(rs.randn(32, 256), jnp.float32), jnp.asarray(rs.randn(256, 32), jnp.float32))
          for _ in range(6)]
    x = jnp.asarray(rs.randn(128, 32), jnp.float32)
    plain, remat = (_compiled(grad(r), ws, x).memory_analysis().temp_size_in_bytes
                    for r in (False, True))
    assert remat >= 0.95 * plain, (
        f"jax.checkpoint now saves memory on XLA's CPU backend ({remat} vs {plain} bytes): "
        "review checkpoint_call(recompute_after_cotangent=True) in pockjax/remat.py and "
        "_remat_block in pockjax/models/llama.py")


def test_upstream_xla_cpu_early_converts_still_needs_workaround():
    """Ledger: "Converts of parameters scheduled at the top of the step".

    Six layers with bfloat16 weights upcast to float32 where they are used: every
    float32 copy is alive at once (the temporaries hold all six), with or without an
    optimization barrier tying the convert to the layer's input."""
    layers, d = 6, 256
    rs = np.random.RandomState(0)
    ws = [jnp.asarray(rs.randn(d, d) * 0.05, jnp.bfloat16) for _ in range(layers)]
    x = jnp.asarray(rs.randn(8, d), jnp.float32)

    def forward(upcast):
        def f(ws, x):
            h = x
            for w in ws:
                h = jnp.tanh(h @ upcast(w, h))
            return jnp.sum(h)
        return f

    def plain(w, h):
        return w.astype(h.dtype)

    def barrier(w, h):
        w, _ = lax.optimization_barrier((w, h))
        return w.astype(h.dtype)

    every_copy = layers * d * d * 4
    for upcast in (plain, barrier):
        temp = _compiled(forward(upcast), ws, x).memory_analysis().temp_size_in_bytes
        assert temp >= every_copy, (
            f"XLA now converts each weight when its layer runs ({upcast.__name__}: {temp} "
            f"bytes of temporaries, all copies are {every_copy}): review one_after in "
            "pockjax/lowbit/_use.py")


def test_upstream_xla_cpu_reduction_fused_into_dot_still_needs_workaround():
    """Ledger: "Log-softmax reductions fused into the head's YNNPACK dot".

    XLA fuses the max of `log_softmax(h @ w)` into the dot's fusion, also through an
    optimization barrier; `reduce_precision` to float32's own bits (`_unfused`) keeps
    them apart."""
    h, w = jnp.ones((16, 64)), jnp.ones((64, 512))

    def fused_with_dot(fn):
        comps = _computations(_compiled(fn, h, w).as_text())
        return [n for n, body in comps.items() if " dot(" in body and " reduce(" in body]

    assert fused_with_dot(lambda h, w: jax.nn.log_softmax(h @ w, -1)), (
        "XLA no longer fuses the log-softmax reduction into the dot: review _unfused in "
        "pockjax/models/llama.py")
    assert fused_with_dot(lambda h, w: jax.nn.log_softmax(lax.optimization_barrier(h @ w), -1))
    assert not fused_with_dot(lambda h, w: jax.nn.log_softmax(
        lax.reduce_precision(h @ w, exponent_bits=8, mantissa_bits=23), -1))


def test_upstream_xla_cpu_barrier_copy_insertion_still_needs_workaround():
    """Ledger: "Optimization barriers dropped before copy insertion".

    A donated weight whose kept channels are updated after the backward read of its old
    value (`dh1 = d2 @ w2.T`): ordered by an optimization barrier, XLA still copies the
    donated buffer (twice); ordered by data (a start index computed from `dh1`, as
    pockjax's `tied_start` does), it updates in place."""
    d, k = 256, 32

    def step(w1, w2, x, order):
        h1 = jnp.tanh(x @ w1)
        h2 = jnp.tanh(h1 @ w2)
        d2 = 2 * h2 * (1 - h2 ** 2)
        g2 = h1.T @ d2
        dh1 = d2 @ w2.T
        start = 0
        if order == "barrier":
            g2, w2, dh1 = lax.optimization_barrier((g2, w2, dh1))
        else:
            start = jnp.clip(jnp.where(dh1[0, 0] == 0, -1, 0), 0, d - k)
        new2 = lax.dynamic_update_slice(w2, w2[:, :k] - 0.1 * g2[:, :k], (0, start))
        g1 = x.T @ (dh1 * (1 - h1 ** 2))
        return lax.dynamic_update_slice(w1, w1[:, :k] - 0.1 * g1[:, :k], (0, 0)), new2

    w, x = jnp.full((d, d), 0.01), jnp.ones((8, d))

    def copies(order):
        hlo = _compiled(lambda a, b, x: step(a, b, x, order), w, w, x, donate=(0, 1)).as_text()
        return [line for line in hlo.splitlines() if re.search(rf"f32\[{d},{d}\]\S* copy\(", line)]

    assert copies("barrier"), (
        "XLA now keeps the barrier's order through copy insertion: review the data ties "
        "(ties='data', _token) of pockjax/optim/fused.py")
    assert copies("data") == []


def test_upstream_xla_cpu_pointwise_conv_weight_grad_still_needs_workaround():
    """Ledger: "1x1 convolution's weight gradient as a windowed convolution".

    The weight gradient of a 1x1 convolution over 8 x 8 images compiles to a
    convolution with an 8 x 8 window, not to a matrix product."""
    def conv(k, x):
        return jnp.sum(lax.conv_general_dilated(x, k, (1, 1), "VALID",
                                                dimension_numbers=("NHWC", "HWIO", "NHWC")) ** 2)

    hlo = _compiled(jax.grad(conv), jnp.ones((1, 1, 4, 6)), jnp.ones((2, 8, 8, 4))).as_text()
    assert re.search(r"convolution\(.*window=\{size=8x8", hlo), (
        "XLA no longer computes a 1x1 convolution's weight gradient as an 8x8 convolution: "
        "review pointwise_conv in pockjax/models/_mobilenetv2_kernels.py")


def test_upstream_xla_cpu_batch_norm_centred_copy_still_needs_workaround():
    """Ledger: "Batch norm's backward writes `x - mean` to memory".

    In the gradient of a batch norm written with `x - mean`, XLA computes the centred
    input as a fusion of its own (a full-size array) and feeds it to a YNNPACK
    reduction."""
    shape = (4, 8, 8, 16)

    def bn(scale, x, t):
        mean = jnp.mean(x, (0, 1, 2))
        var = jnp.mean(x * x, (0, 1, 2)) - mean ** 2
        return jnp.sum(jnp.maximum((x - mean) * lax.rsqrt(var + 1e-5) * scale, 0) * t)

    x = jnp.ones(shape)
    comps = _computations(_compiled(jax.grad(bn, argnums=(0, 1)), jnp.ones(shape[-1:]), x, x)
                          .as_text())
    entry = next(body for name, body in comps.items() if name.startswith("main"))
    full = rf"f32\[{','.join(map(str, shape))}\]"
    centred = [m.group(1) for m in re.finditer(
        rf"%(\S+) = {full}\S* fusion\(.*?calls=%([\w.]+)", entry)
        if re.search(r"ROOT \S+ = \S+ subtract\(", comps[m.group(2)])]
    into_reduction = [line for line in entry.splitlines() if "__ynn_fusion" in line
                      and any(f"%{c}" in line.split("calls=")[0] for c in centred)]
    assert into_reduction, (
        "XLA no longer writes the centred input to memory for a YNNPACK reduction: review "
        "the batch-norm backward in pockjax/models/_mobilenetv2_kernels.py")


def test_upstream_xla_cost_analysis_loop_once_still_needs_workaround():
    """Ledger: "Cost analysis counts a loop body once".

    `cost_analysis()["flops"]` of a 4-step scan of a matmul is one step's."""
    def body(c, w):
        return jnp.tanh(c @ w), None

    c, ws = jnp.ones((8, 16)), jnp.ones((4, 16, 16))

    def flops(fn, *args):
        analysis = _compiled(fn, *args).cost_analysis()
        return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

    one = flops(lambda c, w: body(c, w)[0], c, ws[0])
    assert flops(lambda c, ws: lax.scan(body, c, ws)[0], c, ws) < 1.5 * one, (
        "XLA's cost analysis now multiplies loop bodies by their trip count: review "
        "pockjax/flops.py (count_flops) and its callers")


# --------------------------------------------------------------------------- JAX


def test_upstream_jax_source_info_user_frame_still_needs_workaround():
    """Ledger: "Equation source info".

    `jax.extend.source_info_util` exports `summarize`, `user_context` and
    `current_name_stack`, but not `user_frame`, which pockjax/_src/jaxpr.py needs too."""
    import jax.extend.source_info_util as public
    from jax._src import source_info_util as private

    assert hasattr(private, "user_frame")
    assert not hasattr(public, "user_frame"), (
        "jax.extend.source_info_util now exports user_frame: import from it in "
        "pockjax/_src/jaxpr.py instead of jax._src")


# --------------------------------------------------------------------------- torchax

torchax_installed = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchax") is None,
    reason="torch and torchax are not installed (pip install -e '.[torch]')")

_RAW_IMPORT = """
import json, os, sys, torch
found = {"fastpath_before": torch.backends.mha.get_fastpath_enabled()}
try:
    import torchax, torchax.amp, torchax.decompositions
    found["error"] = None
except Exception as e:
    found["error"] = f"{type(e).__name__}: {e}"
    for name in [n for n in sys.modules if n == "torchax" or n.startswith("torchax.")]:
        del sys.modules[name]
    from pockjax.torch import _named_overloads_tolerated
    with _named_overloads_tolerated():  # only the Dimname placeholders, no clean-up
        import torchax, torchax.amp, torchax.decompositions
found["telemetry"] = os.environ.get("ENABLE_RUNTIME_UPTIME_TELEMETRY")
found["fastpath_after"] = torch.backends.mha.get_fastpath_enabled()
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def raw_torchax_import():
    """What importing torchax does in a fresh process without
    ENABLE_RUNTIME_UPTIME_TELEMETRY set: the plain import's error (None if it
    imports), and the environment variable and MHA fast-path setting once it is imported
    (through pockjax's Dimname placeholders where the plain import fails)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_RUNTIME_UPTIME_TELEMETRY"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", _RAW_IMPORT], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def torchax_env():
    """A plain torchax `Environment` (not pockjax's); torchax imported through
    `pockjax.torch.import_torchax`, since it does not import otherwise (see
    `test_upstream_torchax_import_dimname_still_needs_workaround`)."""
    import pockjax.torch as pt

    pt.import_torchax()
    import torchax.tensor

    return torchax.tensor.Environment()


@torchax_installed
def test_upstream_torchax_import_dimname_still_needs_workaround(raw_torchax_import):
    """Ledger: "Import fails on dropped Dimname overloads".

    `import torchax` fails with this torch: its op tables (`torchax/amp.py`) name a
    `Dimname` overload (`aten.prod.dim_Dimname`) torch no longer has."""
    error = raw_torchax_import["error"]
    assert error is not None and "Dimname" in error, (
        "torchax now imports with this torch: named_overloads_tolerated in "
        "pockjax/torch/_env.py can go")


@torchax_installed
def test_upstream_torchax_import_sets_env_var_still_needs_workaround(raw_torchax_import):
    """Ledger: "Import sets an environment variable".

    Importing torchax sets ENABLE_RUNTIME_UPTIME_TELEMETRY=1 in the process environment
    (seen through the Dimname placeholders alone, without `import_torchax`'s clean-up)."""
    assert raw_torchax_import["telemetry"] == "1", (
        "torchax no longer sets ENABLE_RUNTIME_UPTIME_TELEMETRY: the environment clean-up "
        "of import_torchax in pockjax/torch/_env.py can go")


@torchax_installed
def test_upstream_torchax_batch_norm_still_needs_workaround(torchax_env):
    """Ledger: "Train-mode batch norm keeps its running statistics".

    A BatchNorm1d in train mode under torchax leaves `running_mean` and `running_var` at
    their initial values; torch updates them."""
    import torch

    x = (np.random.RandomState(0).randn(5, 3) * 2 + 1).astype(np.float32)
    bn = torch.nn.BatchNorm1d(3).train()
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in bn.state_dict().items()}
    env = torchax_env
    with env:
        p_t, x_t = env.j2t_iso((params, jnp.asarray(x)))
        torch.func.functional_call(bn, p_t, (x_t,))
        after = env.t2j_iso(p_t)
    bn(torch.tensor(x))  # torch's own: the running statistics move
    assert not np.allclose(bn.running_mean.numpy(), 0)
    assert np.array_equal(np.asarray(after["running_mean"]), np.zeros(3)) and \
        np.array_equal(np.asarray(after["running_var"]), np.ones(3)), (
            "torchax now updates batch norm's running statistics: review _batch_norm in "
            "pockjax/torch/_env.py (torch's unbiased running variance too)")


@torchax_installed
def test_upstream_torchax_mixed_math_assert_still_needs_workaround(torchax_env):
    """Ledger: "A CPU torch tensor among torchax tensors".

    Adding a plain torch tensor to a torchax tensor raises a bare AssertionError whose
    message is the only mark pockjax's `_is_mixed_math` can recognise."""
    import torch

    env = torchax_env
    with pytest.raises(AssertionError, match="mixed math between XLATensor and torch.Tensor"):
        with env:
            env.j2t_iso(jnp.ones(3)) + torch.ones(3)


@torchax_installed
def test_upstream_torchax_mha_fastpath_still_needs_workaround(torchax_env):
    """Ledger: "MultiheadAttention's fast path".

    With torch's MHA fast path on, a TransformerEncoder in eval mode with a padding mask
    builds a nested tensor (`aten::_nested_tensor_from_mask_left_aligned`), which torchax
    cannot run."""
    import torch

    layer = torch.nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=True).eval()
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in encoder.state_dict().items()}
    x = jnp.asarray(np.random.RandomState(1).randn(2, 3, 4).astype(np.float32))
    mask = jnp.asarray([[False, False, True], [False, False, False]])
    env = torchax_env
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(True)
    try:
        with pytest.raises(Exception, match="_nested_tensor_from_mask"):
            with torch.no_grad(), env:
                p_t, x_t, m_t = env.j2t_iso((params, x, mask))
                torch.func.functional_call(encoder, p_t, (x_t,), {"src_key_padding_mask": m_t})
    finally:
        torch.backends.mha.set_fastpath_enabled(before)
