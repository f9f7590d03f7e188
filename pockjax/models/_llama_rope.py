"""Rotary position embeddings for the LLaMA-family decoder, with the scalings Hugging Face
checkpoints use: `linear` (positions divided by a factor), `dynamic` (NTK: the base grows
with the sequence past the context), `yarn` (per-frequency interpolation and a
temperature on cos/sin) and `llama3` (Llama-3.1/3.2's wavelength bands).

The frequencies are computed as transformers computes them (`modeling_rope_utils`), in
float32, so logits agree with transformers' models. `LlamaConfig.rope_scaling` holds a
scaling as a sorted tuple of `(key, value)` pairs (hashable, like the config); the
layers call `rope_tables` (a whole sequence) and `rope_tables_at` (decoding from a
traced position, where `dynamic` depends on how far the sequence has grown).
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# Scaled rotary embeddings this model computes ("default" is none).
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_NEEDS = {"linear": ("factor",), "dynamic": ("factor",),
          "yarn": ("original_max_position_embeddings",),
          "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")}
# Keys of a Hugging Face rope dict that are not the scaling's own.
_NOT_SCALING = {"rope_type", "type", "rope_theta"}


def scaling_of(params: dict | None, config: dict, unsupported,
               field: str = "rope_parameters") -> tuple | None:
    """The `LlamaConfig.rope_scaling` tuple of a Hugging Face rope dict (`rope_parameters`
    or the older `rope_scaling`), or None for unscaled embeddings. `config` is the whole
    `config.json` (a top-level `original_max_position_embeddings` wins over the dict's,
    as in transformers); `unsupported(field, value, why)` raises; `field` is the dict's
    name in the file."""
    if not params:
        return None
    if not isinstance(params, dict):
        unsupported(field, params, "expected a dict with a rope_type")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_TYPES:
        unsupported(field, params, f"pockjax's LLaMA computes rotary embeddings of the "
                                   f"types {', '.join(ROPE_TYPES)}, not {kind!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        unsupported("partial_rotary_factor", params["partial_rotary_factor"],
                    "pockjax's LLaMA rotates every channel of a head")
    out = {k: v for k, v in params.items() if k not in _NOT_SCALING
           and k != "partial_rotary_factor" and v is not None}
    if kind in ("llama3", "yarn"):
        if "original_max_position_embeddings" in config:
            out["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        out.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    missing = [k for k in _NEEDS[kind] if out.get(k) is None]
    if missing:
        unsupported(field, params, f"rope_type {kind!r} needs {', '.join(missing)}")
    return freeze({"rope_type": kind, **out})


def freeze(scaling: dict | tuple | None) -> tuple | None:
    """A scaling as `LlamaConfig` holds it: its items sorted, lists as tuples."""
    if scaling is None:
        return None
    items = scaling.items() if isinstance(scaling, dict) else scaling
    return tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in items))


def check(scaling: tuple | None) -> None:
    """Raise ValueError for a `LlamaConfig.rope_scaling` this module cannot compute."""
    if scaling is None:
        return
    s = dict(scaling)
    kind = s.get("rope_type")
    if kind not in ROPE_TYPES or kind == "default":
        raise ValueError(f"LlamaConfig.rope_scaling: rope_type {kind!r} is not one of "
                         f"{', '.join(ROPE_TYPES[1:])} (None is unscaled)")
    missing = [k for k in _NEEDS[kind] if s.get(k) is None]
    if missing:
        raise ValueError(f"LlamaConfig.rope_scaling of type {kind!r} needs "
                         f"{', '.join(missing)}")
    factor = s.get("factor")
    if factor is not None and not factor > 0:
        raise ValueError(f"LlamaConfig.rope_scaling: factor must be positive, got {factor!r}")


def to_hf(scaling: tuple | None, theta: float) -> dict:
    """The Hugging Face `rope_parameters` dict of a scaling."""
    return {"rope_type": "default", "rope_theta": theta} if scaling is None else \
        {**{k: list(v) if isinstance(v, tuple) else v for k, v in scaling}, "rope_theta": theta}


def _base_frequencies(dim: int, theta) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim))
            ).astype(np.float32)


def inv_frequencies(dim: int, theta: float, scaling: tuple | None, max_positions: int,
                    seq_len: int | None = None) -> tuple[np.ndarray, float]:
    """`(inverse frequencies [dim / 2] float32, attention factor)` for sequences of
    `seq_len` positions (which only `dynamic` reads)."""
    if scaling is None:
        return _base_frequencies(dim, theta), 1.0
    s = dict(scaling)
    kind = s["rope_type"]
    if kind == "linear":
        return (_base_frequencies(dim, theta) / np.float32(s["factor"])).astype(np.float32), 1.0
    if kind == "dynamic":
        seq = max(seq_len or max_positions, max_positions)
        if seq <= max_positions:  # within the context: the base as it is
            return _base_frequencies(dim, theta), 1.0
        f = np.float32(s["factor"])
        base = np.float32(theta) * ((f * np.float32(seq) / np.float32(max_positions))
                                    - (f - np.float32(1))) ** np.float32(dim / (dim - 2))
        return _base_frequencies(dim, np.float32(base)), 1.0
    if kind == "llama3":
        inv = _base_frequencies(dim, theta)
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = (np.float32(2 * math.pi) / inv).astype(np.float32)
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
                  ).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    # yarn
    old = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old
    attention = s.get("attention_factor")

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all \
            else mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # the share extrapolated (left unscaled)
    pos = (theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)).astype(np.float32)
    extrapolated = (1.0 / pos).astype(np.float32)
    interpolated = (1.0 / (np.float32(factor) * pos)).astype(np.float32)
    inv = (interpolated * (1 - keep) + extrapolated * keep).astype(np.float32)
    return inv, attention


def rope_tables(length: int, head_dim: int, theta: float, scaling: tuple | None = None,
                max_positions: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`cos`, `sin` [length, head_dim] for positions 0..length-1 in HF's layout (both
    halves of a head hold the same frequencies), scaled by `scaling` for a model of
    `max_positions` positions."""
    inv, attention = inv_frequencies(head_dim, theta, scaling, max_positions or length, length)
    angles = np.arange(length, dtype=np.float32)[:, None] * inv[None]
    angles = np.concatenate([angles, angles], axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    if attention != 1.0:
        cos, sin = cos * np.float32(attention), sin * np.float32(attention)
    return cos.astype(np.float32), sin.astype(np.float32)


def is_dynamic(scaling: tuple | None) -> bool:
    """Whether the frequencies depend on the sequence's length (`dynamic`)."""
    return scaling is not None and dict(scaling)["rope_type"] == "dynamic"


def rope_tables_at(position, t: int, length: int, head_dim: int, theta: float,
                   scaling: tuple | None, max_positions: int):
    """`cos`, `sin` [t, head_dim] for positions `position`..`position + t - 1` of a cache
    of `length` (`position` may be traced). For `dynamic`, the frequencies of a sequence
    of `position + t` positions, as transformers recomputes them while it decodes."""
    import jax

    if not is_dynamic(scaling):
        cos, sin = rope_tables(length, head_dim, theta, scaling, max_positions)
        return (jax.lax.dynamic_slice_in_dim(jnp.asarray(cos), position, t),
                jax.lax.dynamic_slice_in_dim(jnp.asarray(sin), position, t))
    s = dict(scaling)
    seq = (position + t).astype(jnp.float32)
    f = jnp.float32(s["factor"])
    grown = jnp.float32(theta) * ((f * seq / jnp.float32(max_positions)) - (f - 1)) \
        ** jnp.float32(head_dim / (head_dim - 2))
    base = jnp.where(position + t > max_positions, grown, jnp.float32(theta))
    inv = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = (position + jnp.arange(t, dtype=jnp.int32)).astype(jnp.float32)[:, None] * inv[None]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)
