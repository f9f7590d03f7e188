"""torchax, imported and set up for `pockjax.torch`: `import_torchax` (torchax with this
torch, and no trace left in the environment variables) and `environment`, pockjax's own
torchax environment with the op definitions it corrects (batch norm's running
statistics, attention rows whose keys are all masked). `pockjax.torch` re-exports both.

Importing torchax 0.0.13 with torch >= 2.10 fails on named-dimension (`Dimname`)
overloads torch dropped; `import_torchax()` lets those names resolve to placeholders
(`MissingOverload`, within `named_overloads_tolerated`) while torchax's tables load
(no-op where torchax no longer asks for them) and undoes torchax's import-time
environment variable.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import math
import os

import jax


# --------------------------------------------------------------------------- torchax import


class MissingOverload:
    """Stands for a named-dimension overload this torch no longer has (never matches an op)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<overload {self.name} missing in this torch>"


def _is_named_dim_overload(name: str) -> bool:
    low = name.lower()
    return "dimname" in low or "names" in low


@contextlib.contextmanager
def named_overloads_tolerated():
    """While torchax's op tables load, `torch.ops.aten.X.<Dimname overload>` that torch
    dropped give a placeholder instead of raising. Any other missing overload still raises."""
    import torch._ops

    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def getattr_(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if _is_named_dim_overload(key):
                return MissingOverload(f"{self._qualified_op_name}.{key}")
            raise

    packet.__getattr__ = getattr_
    try:
        yield
    finally:
        packet.__getattr__ = original


_TELEMETRY_VAR = "ENABLE_RUNTIME_UPTIME_TELEMETRY"


def import_torchax():
    """`torchax`, imported so that it works with this torch and leaves no trace in the
    environment variables. Raises ImportError naming the versions when it cannot.

    Returns:
      The `torchax` module (already imported: the one in `sys.modules`).

    Raises:
      ImportError: PyTorch or torchax is not installed, or torchax does not import
        with the installed torch.
    """
    import sys

    if "torchax" in sys.modules and "torchax.decompositions" in sys.modules:
        return sys.modules["torchax"]
    try:
        import torch
    except ImportError as e:
        raise ImportError("pockjax.torch needs PyTorch and torchax: pip install 'pockjax[torch]' "
                          "(see docs/pytorch.md)") from e
    had = _TELEMETRY_VAR in os.environ
    try:
        with named_overloads_tolerated():
            import torchax
            import torchax.amp  # noqa: F401  (op tables that name Dimname overloads)
            import torchax.decompositions  # noqa: F401
    except ImportError as e:
        raise ImportError(f"pockjax.torch needs torchax (>=0.0.13): pip install --no-deps torchax "
                          f"(torch {torch.__version__} is installed)") from e
    except Exception as e:  # an incompatibility the placeholder step does not cover
        raise ImportError(
            f"torchax {_version('torchax')} does not import with torch {torch.__version__}: "
            f"{type(e).__name__}: {e}. pockjax.torch is tested with torchax 0.0.13 and torch "
            f"2.13.0; install a torchax release that supports this torch") from e
    finally:
        if not had:
            os.environ.pop(_TELEMETRY_VAR, None)
    return torchax


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


# --------------------------------------------------------------------------- environment

_ENV = None


def environment():
    """pockjax's own torchax environment (the user's `torchax.default_env()` is left
    as it is), with the op definitions pockjax corrects: batch norm's running statistics
    and attention rows whose keys are all masked (`_sdpa`).

    Built on the first call; later calls return the same one, so an op definition
    added with `environment().override_op_definition(op, fn)` applies to every
    `functional` module.

    Returns:
      The `torchax.tensor.Environment`.
    """
    global _ENV
    if _ENV is None:
        import torch
        import torchax.tensor

        env = torchax.tensor.Environment()
        # torchax 0.0.13's batch norm neither writes the running statistics back nor
        # uses the unbiased variance for them, as torch does in train mode.
        for name in ("native_batch_norm", "_native_batch_norm_legit"):
            packet = getattr(torch.ops.aten, name, None)
            if packet is not None:
                env.override_op_definition(packet.default, _batch_norm)
        # Hugging Face's default "sdpa" attention gives each left-padded query row a mask
        # that is all False; see `_sdpa` for why torchax's own definition cannot be kept.
        sdpa = functools.partial(_sdpa, env)
        env.override_op_definition(torch.nn.functional.scaled_dot_product_attention, sdpa)
        env.override_op_definition(torch.ops.aten.scaled_dot_product_attention.default, sdpa)
        # Mixture-of-experts layers (transformers' Mixtral, Qwen2/3-MoE, OLMoE experts)
        # multiply each expert's tokens by its weights in one grouped matmul, which
        # torchax 0.0.13 does not define: `_grouped_mm`, as jax.lax.ragged_dot.
        grouped = functools.partial(_grouped_mm, env)
        for op in (getattr(torch.ops.aten, "_grouped_mm", None),
                   getattr(torch.nn.functional, "grouped_mm", None)):
            if op is not None:
                env.override_op_definition(getattr(op, "default", op), grouped)
        _ENV = env
    return _ENV


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    import torch

    dims = [0] + list(range(2, input.ndim))
    shape = [1, -1] + [1] * (input.ndim - 2)
    if training:
        mean = input.mean(dims)
        var = ((input - mean.reshape(shape)) ** 2).mean(dims)
        n = input.numel() // input.shape[1]
        if running_mean is not None:
            running_mean.copy_((1 - momentum) * running_mean + momentum * mean)
        if running_var is not None:
            running_var.copy_((1 - momentum) * running_var + momentum * var * (n / max(n - 1, 1)))
    else:
        mean, var = running_mean, running_var
    rstd = torch.rsqrt(var + eps)
    out = (input - mean.reshape(shape)) * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, rstd


def _grouped_mm(env, mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """`torch._grouped_mm` for the forms a mixture-of-experts forward uses: `(M, K)`
    rows sorted by group times `(G, K, N)` weights, row block `offs[g-1]:offs[g]` by
    group `g` (rows past `offs[-1]` come out 0), and `(G, M, K) @ (G, K, N)`."""
    import jax.numpy as jnp

    a, b, o, c = env.t2j_iso((mat_a, mat_b, offs, bias))
    if a.ndim == 2 and b.ndim == 3 and o is not None:
        sizes = jnp.diff(o.astype(jnp.int32), prepend=jnp.zeros((1,), jnp.int32))
        out = jax.lax.ragged_dot(a, b, sizes)
    elif a.ndim == 3 and b.ndim == 3 and o is None:
        out = jnp.matmul(a, b)
    else:
        raise NotImplementedError(
            f"_grouped_mm of shapes {tuple(a.shape)} x {tuple(b.shape)} "
            f"{'with' if o is not None else 'without'} offsets is not defined in pockjax's "
            f"torchax environment (a mixture-of-experts forward uses (M, K) x (G, K, N) with "
            f"offsets)")
    if c is not None:
        out = out + c
    dtype = a.dtype if out_dtype is None else jnp.dtype(str(out_dtype).removeprefix("torch."))
    return env.j2t_iso(out.astype(dtype))


def _sdpa(env, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False):
    """`torch.nn.functional.scaled_dot_product_attention` with torch's semantics for a
    query row that may attend to nothing (every key masked): output 0 and gradient 0.

    torchax 0.0.13 (`torchax/ops/jtorch.py`, `scaled_dot_product_attention` ->
    `_sdpa_reference`) adds a -inf bias and takes a plain softmax, so such a row is
    exp(-inf - -inf) = NaN. Left padding makes those rows in every causal LM under
    `sdpa`, and although their outputs are never read, `0 * NaN` carries the NaN into
    the loss and every gradient. `test_upstream_torchax_sdpa_still_nan_on_fully_masked_rows`
    fails once torchax handles it; then this override can go.
    """
    q, k, v, mask = env.t2j_iso((query, key, value, attn_mask))
    out = _attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa,
                     env.get_and_rotate_prng_key if dropout_p > 0 else None)
    return env.j2t_iso(out)


def _attention(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, prng_key):
    import jax.numpy as jnp

    if enable_gqa:
        k = jnp.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
        v = jnp.repeat(v, q.shape[-3] // v.shape[-3], axis=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ jnp.swapaxes(k, -1, -2)) * scale
    if is_causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    if mask is None:
        # Without a mask every row keeps at least one key (a causal row keeps its first):
        # the unmasked path stays the plain softmax.
        p = jax.nn.softmax(s, axis=-1)
    else:
        s = jnp.where(mask, s, -jnp.inf) if mask.dtype == jnp.bool_ else s + mask.astype(s.dtype)
        # A row with every key masked has max -inf; shifting it by 0 instead leaves exp = 0
        # everywhere, and the guarded sum makes its weights (and their gradient) exactly 0.
        m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
        e = jnp.exp(s - jnp.where(jnp.isneginf(m), 0, m))
        total = jnp.sum(e, axis=-1, keepdims=True)
        p = e / jnp.where(total == 0, 1, total)
    if dropout_p > 0:
        keep = jax.random.bernoulli(prng_key(), 1 - dropout_p, p.shape)
        p = jnp.where(keep, p / (1 - dropout_p), 0).astype(p.dtype)
    return p @ v

