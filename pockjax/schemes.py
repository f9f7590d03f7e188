"""Ready-made schemes: the paper's sparse schemes and the common baselines.

Each helper takes the model's parameters so it can find the blocks and keep only
rules that match; a helper that would select nothing raises `SchemeError` naming what
it looked for.

This module (and `pockjax.scheme_search`) works on pytrees only and imports no Flax.
A model object is turned into its parameter tree by a converter registered with
`register_params_of`: `pockjax.nnx` registers one for `nnx.Module` when it is imported
(`pockjax.models` imports it), so `pj.schemes.transformer(model)` takes a module too.

>>> import jax.numpy as jnp, pockjax as pj
>>> w = {"kernel": jnp.zeros((4, 4))}
>>> params = {"layers": [{"attn": {"q_proj": w}, "mlp": {"up_proj": w, "down_proj": w}}] * 3}
>>> pj.schemes.transformer(params, last=1)
Scheme({'layers/2/**/q_proj/kernel': Full(), 'layers/2/**/up_proj/kernel': Full()}, default=Frozen())
"""
from __future__ import annotations

import numbers
import re
from typing import Any, Callable, Sequence

from pockjax.schedule import Schedule
from pockjax.scheme import Channels, Decision, Frozen, Full, Scheme, SchemeError, \
    glob_to_regex, leaves_with_paths

__all__ = ["bias_only", "blocks", "last_blocks", "transformer", "mobilenetv2", "lora",
           "schedule", "blockwise", "unnamed_weights", "FAMILY_NAMES",
           "param_paths", "params_of", "register_params_of"]

# Each family's names for the weights PockEngine's transformer scheme tells apart:
# (attention projections, the MLP's first linears, the MLP's last linear). A name is the
# end of a weight's module path ("attn/c_proj" is GPT-2's attention output, not its
# MLP's "mlp/c_proj"); a fused weight (Phi-3's qkv_proj, GPT-2's c_attn) holds several
# projections as row slices and trains as one, as its parts do on LLaMA.
FAMILY_NAMES = {
    "llama, mistral, mixtral attention, qwen2, qwen3, gemma, gemma2, gemma3, olmo, granite, "
    "stablelm, smollm": (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj"),
                         ("down_proj",)),
    "phi3": (("qkv_proj", "o_proj"), ("gate_up_proj",), ("down_proj",)),
    "phi (phi-1, phi-2)": (("q_proj", "k_proj", "v_proj", "self_attn/dense"), ("fc1",),
                           ("fc2",)),
    "gpt2": (("c_attn", "attn/c_proj"), ("c_fc",), ("mlp/c_proj",)),
    "gpt_neox (pythia), falcon, bloom": (("query_key_value", "attention/dense",
                                          "self_attention/dense"), ("dense_h_to_4h",),
                                         ("dense_4h_to_h",)),
    "gptj, opt": (("q_proj", "k_proj", "v_proj", "out_proj"), ("fc_in", "fc1"),
                  ("fc_out", "fc2")),
    "mixtral experts (stacked, or one module each)": ((), ("gate_up_proj", "w1", "w3"),
                                                      ("down_proj", "w2")),
}


def _names(i: int) -> tuple[str, ...]:
    out: list[str] = []
    for roles in FAMILY_NAMES.values():
        out += [n for n in roles[i] if n not in out]
    return tuple(out)


ATTENTION = _names(0)
MLP_IN = _names(1)
MLP_OUT = _names(2)
# The output head's module in the families transformers has (GPT-NeoX: embed_out); a
# model with none ties its head to the embedding.
HEADS = ("lm_head", "embed_out")


# type -> fn(model) -> parameter pytree; filled by adapters (pockjax.nnx) on import.
_PARAMS_OF: dict[type, Callable[[Any], Any]] = {}


def register_params_of(cls: type, fn: Callable[[Any], Any]) -> None:
    """Let the helpers here (and `pockjax.search_scheme`'s candidates) take instances of `cls`
    (and its subclasses). `pockjax.nnx` registers `nnx.Module`.

    Args:
      cls: the model type.
      fn: `fn(model)` returns the model's parameters as a pytree whose "/"-joined paths
        are what schemes glob. A later registration for the same `cls` replaces it.
    """
    _PARAMS_OF[cls] = fn


def params_of(model) -> Any:
    """`model`'s parameter tree.

    Args:
      model: a model whose type (or a base class of it) has a converter registered
        with `register_params_of`, or a parameter pytree.

    Returns:
      The converter's result for the first registered type in `model`'s method
      resolution order, else `model` itself.

    Raises:
      TypeError: `model` is a Flax NNX object and no converter for it is registered
        (`import pockjax.nnx` registers one).
    """
    for cls in type(model).__mro__:
        if cls in _PARAMS_OF:
            return _PARAMS_OF[cls](model)
    if any(c.__module__.startswith("flax.nnx") for c in type(model).__mro__):
        raise TypeError(f"got a Flax {type(model).__name__} but no converter for it is registered; "
                        "`import pockjax.nnx` registers the one for nnx.Module, or pass the "
                        "parameters: pockjax.nnx.split(model)[1]")
    return model


def param_paths(params) -> list[str]:
    """The "/"-joined paths of `params`' leaves.

    Args:
      params: a parameter pytree, or a model with a registered converter (see
        `register_params_of`).

    Returns:
      The paths, in flattening order.

    Raises:
      TypeError: as `params_of`.
    """
    return [p for p, _ in leaves_with_paths(params_of(params))[0]]


def _keep_matching(rules, paths, what: str):
    kept = [(p, d) for p, d in rules if any(glob_to_regex(p).match(x) for x in paths)]
    if not kept:
        raise SchemeError(f"no parameter matches {what}; parameters are e.g. "
                          + ", ".join(repr(p) for p in paths[:4]))
    return kept


_BLOCK = re.compile(r"^(?:(?P<a>.*?)/(?P<i>\d+)|(?P<b>[^/]*?)_(?P<j>\d+))(?=/|$)")


def blocks(params, name: str | None = None) -> list[str]:
    """Glob prefixes of the model's repeated blocks in order: `layers/0`, `layers/1`, ...
    (a list or `nnx.List` of modules) or `Block_0`, `Block_1`, ... (Linen's naming).

    >>> blocks({"h": [{"w": 0.0}, {"w": 0.0}], "head": {"w": 0.0}})
    ['h/0', 'h/1']

    Args:
      params: the model's parameters (or a model `params_of` takes).
      name: the blocks' container (`"layers"`, `"blocks"`, `"Block"`); None (the
        default) picks the one with the most blocks.

    Returns:
      The block prefixes, sorted by block number.

    Raises:
      SchemeError: no container is named `name`, or the parameters have no repeated
        blocks.
    """
    paths = param_paths(params)
    found: dict[str, set[int]] = {}
    for path in paths:
        m = _BLOCK.match(path)
        if m:
            base, idx = (m["a"], m["i"]) if m["a"] is not None else (m["b"], m["j"])
            found.setdefault(base, set()).add(int(idx))
    if name is not None:
        if name not in found:
            raise SchemeError(f"no blocks named {name!r}; the repeated blocks are "
                              f"{sorted(found) or 'none'}")
        found = {name: found[name]}
    if not found:
        raise SchemeError("the parameters have no repeated blocks (paths like 'layers/0/...' or "
                          "'Block_0/...'); name the parameters in a Scheme instead")
    base = max(found, key=lambda b: len(found[b]))
    linen = not any(p.startswith(base + "/") for p in paths)
    return [f"{base}_{i}" if linen else f"{base}/{i}" for i in sorted(found[base])]


def _chosen(params, last: int | None, name: str | None) -> list[str]:
    all_blocks = blocks(params, name)
    if last is None:
        return all_blocks
    if not 1 <= last <= len(all_blocks):
        raise SchemeError(f"last={last} but the model has {len(all_blocks)} blocks; "
                          f"use 1..{len(all_blocks)} (last:{len(all_blocks)} trains them all)")
    return all_blocks[-last:]


def bias_only(params=None, names: Sequence[str] = ("bias",)) -> Scheme:
    """Train only biases (BitFit): every parameter whose last path component is in `names`.

    >>> bias_only().match("blocks_0/mlp/bias")
    Full()

    Args:
      params: the model's parameters (or a model `params_of` takes); with them, only
        the names the model has are kept. None (the default) keeps every name.
      names: the last path components that train; default `("bias",)`.

    Returns:
      A `Scheme` with `**/{name}` in full for each kept name, everything else frozen.

    Raises:
      SchemeError: `params` is given and has none of `names`.
    """
    rules = [(f"**/{n}", Full()) for n in names]
    if params is not None:
        rules = _keep_matching(rules, param_paths(params), f"bias names {list(names)}")
    return Scheme(rules, default=Frozen())


def last_blocks(params, k: int, *, decision: Decision = Full(), extra: Sequence[str] = (),
                block_name: str | None = None) -> Scheme:
    """The last `k` blocks train (with `decision`), plus the `extra` glob patterns in full.

    Args:
      params: the model's parameters (or a model `params_of` takes).
      k: how many blocks train, counted from the last; 1 to the number of blocks.
      decision: what each chosen block's parameters get; default `Full()`.
      extra: glob patterns trained in full as well (e.g. `"norm/**"`, `"lm_head/**"`,
        `"classifier/**"`); patterns that match nothing are dropped. Default none.
      block_name: the blocks' container, as `name` in `blocks`.

    Returns:
      A `Scheme`; every other parameter is frozen.

    Raises:
      SchemeError: the model has no such blocks, `k` is out of range, or `extra` is
        given and none of its patterns matches a parameter.
    """
    rules = [(f"{b}/**", decision) for b in _chosen(params, k, block_name)]
    rules += _keep_matching([(p, Full()) for p in extra], param_paths(params),
                            f"extra patterns {list(extra)}") if extra else []
    return Scheme(rules, default=Frozen())


def _decision(ratio, axis) -> Decision:
    return Full() if ratio is None else Channels(ratio=ratio, axis=axis)


def transformer(params, *, last: int | None = None, attention: Sequence[str] = ATTENTION,
                mlp: Sequence[str] = MLP_IN, ratio: float | None = None, axis: str | int = "out",
                norms: bool = False, extra: Sequence[str] = (),
                block_name: str | None = None) -> Scheme:
    """PockEngine's transformer scheme: in each chosen block the attention projections and
    the first MLP linear (gate and up) train, the second (down) does not.

    Projection names are the last-but-one path component (`.../q_proj/kernel`, or
    `.../q_proj/weight` for a PyTorch model through `pockjax.torch`). A projection's
    bias, where it has one, trains in full.

    Args:
      params: the model's parameters (or a model `params_of` takes).
      last: train the last `last` blocks only; None (the default) trains every block.
      attention: the attention projections' names (ends of module paths); default
        every family's of `FAMILY_NAMES` (LLaMA's `q_proj`..`o_proj`, Phi-3's fused
        `qkv_proj`, GPT-2's `c_attn` and `attn/c_proj`, GPT-NeoX's `query_key_value`...).
      mlp: the first MLP linears' names; default every family's (`gate_proj`,
        `up_proj`, Phi-3's fused `gate_up_proj`, GPT-2's `c_fc`, `dense_h_to_4h`...).
      ratio: train this fraction of each chosen kernel's channels along `axis`
        (`Channels(ratio=ratio, axis=axis)`); None (the default) trains the kernels in
        full.
      axis: the channel axis for `ratio`: "out" (the default), "in" or an int.
      norms: also train the chosen blocks' normalisation parameters (`*norm*/scale`,
        `weight` and `bias`) in full; default False.
      extra: glob patterns trained in full as well (`"lm_head/**"`); default none.
      block_name: the blocks' container, as `name` in `blocks`.

    Returns:
      A `Scheme` holding the rules that match a parameter; every other parameter is
      frozen.

    Raises:
      SchemeError: the model has no such blocks, `last` is out of range, a chosen block
        has no weight of `attention`'s names or none of `mlp`'s (the message lists the
        block's parameters: the scheme would train part of what it means), or `extra`
        is given and none of its patterns matches.
    """
    paths = param_paths(params)
    decision = _decision(ratio, axis)
    rules = []
    for b in _chosen(params, last, block_name):
        block_rules = []
        for role, names in (("attention projections", attention), ("MLP input linears", mlp)):
            role_rules = []
            for name in names:
                # "weight": a PyTorch model's (pockjax.torch); the bare name: a weight
                # that is a parameter itself (transformers' stacked experts). Rules that
                # match nothing are dropped.
                for kernel in ("/kernel", "/weight", ""):
                    role_rules.append((f"{b}/**/{name}{kernel}", decision))
                role_rules.append((f"{b}/**/{name}/bias", Full()))
            kept = [(p, d) for p, d in role_rules if any(glob_to_regex(p).match(x) for x in paths)]
            if not kept and names:
                _refuse_partial(b, role, names, rules + block_rules, paths, attention, mlp)
            block_rules += kept
        rules += block_rules
        if norms:
            for n in ("scale", "weight", "bias"):
                rules.append((f"{b}/**/*norm*/{n}", Full()))
    rules = _keep_matching(rules, paths, f"projections {[*attention, *mlp]}")
    if extra:
        rules += _keep_matching([(p, Full()) for p in extra], paths, f"extra patterns {list(extra)}")
    return Scheme(rules, default=Frozen())


def _refuse_partial(block, role, names, matched, paths, attention, mlp) -> None:
    """Raise: in `block`, no weight matches `role`'s `names` though the scheme asks for
    them (a model whose names the table `FAMILY_NAMES` does not know would otherwise
    train a fraction of what the scheme means)."""
    weights = [p[len(block) + 1:] for p in paths if p.startswith(block + "/")]
    found = sorted({glob_to_regex(r).pattern for r, _ in matched})
    raise SchemeError(
        f"the transformer scheme finds no {role} in block '{block}' (it looks for the names "
        f"{list(names)}); the block's parameters are {weights[:12]}"
        f"{' ...' if len(weights) > 12 else ''}"
        + (f", and the other rules matched {len(found)} of them" if found else "")
        + "; pass attention=/mlp= with this model's names (pockjax.schemes.FAMILY_NAMES has "
          "the known families'), or train it with last_blocks or a scheme file")


def unnamed_weights(params, block_names: Sequence[str] | None = None) -> list[str]:
    """The 2-D and larger weights inside the blocks that none of `FAMILY_NAMES`' roles
    names: a transformer scheme leaves them frozen without meaning to."""
    import numpy as np

    names = (*ATTENTION, *MLP_IN, *MLP_OUT)
    try:
        chosen = block_names or blocks(params)
    except SchemeError:
        return []
    out = []
    for path, x in leaves_with_paths(params_of(params))[0]:
        if np.ndim(x) < 2 or not any(path.startswith(b + "/") for b in chosen):
            continue
        module = path.rsplit("/", 1)[0]
        if not any(m == n or m.endswith("/" + n) for n in names for m in (module, path)):
            out.append(path)
    return out


def mobilenetv2(params, *, last: int | None = None, ratio: float | None = None,
                axis: str | int = "out", norms: bool = False, classifier: bool = True) -> Scheme:
    """PockEngine's MobileNetV2 scheme: the first point-wise (expansion) convolution of each
    chosen inverted-residual block trains; the depth-wise and the second point-wise
    (projection) convolutions do not.

    Paths follow `pockjax.models.MobileNetV2` (`blocks/{i}/expand/conv/kernel`),
    torchvision's `mobilenet_v2` through `pockjax.torch` (`features/{i}/conv/0/0/weight`)
    or Keras's `keras.applications.MobileNetV2` through `pockjax.keras`
    (`block_{i}_expand/kernel`, the classifier `predictions/**`; under an enclosing
    model's name where it is nested in another).

    Args:
      params: the model's parameters (or a model `params_of` takes).
      last: train the last `last` blocks that have an expansion convolution; None (the
        default) trains all of them.
      ratio: train this fraction of each expansion kernel's channels along `axis`;
        None (the default) trains the kernels in full.
      axis: the channel axis for `ratio`: "out" (the default), "in" or an int.
      norms: also train the chosen blocks' batch norm scales and biases; default False.
      classifier: train the classifier (`classifier/**`, or Keras's `predictions`; a new
        task's head) in full; default True.

    Returns:
      A `Scheme`; every other parameter is frozen.

    Raises:
      SchemeError: the parameters have neither path layout, `last` is out of range, or
        `classifier` is True and the model has no `classifier/**` parameter.
    """
    paths = param_paths(params)
    if not any(p.startswith("blocks/") for p in paths) and any(
            re.fullmatch(r"features/\d+/conv/3/weight", p) for p in paths):
        return _torchvision_mobilenetv2(paths, last, ratio, axis, norms, classifier)
    if any(re.fullmatch(r"(?:.*/)?block_\d+_expand/kernel", p) for p in paths):
        return _keras_mobilenetv2(paths, last, ratio, axis, norms, classifier)
    found = (re.fullmatch(r"blocks/(\d+)/expand/conv/kernel", p) for p in paths)
    expanding = [f"blocks/{i}" for i in sorted(int(m[1]) for m in found if m)]
    if not expanding:
        raise SchemeError("no 'blocks/{i}/expand/conv/kernel' parameters: this scheme needs "
                          "the parameter paths of pockjax.models.MobileNetV2, torchvision's "
                          "mobilenet_v2 or keras.applications.MobileNetV2")
    return _expansion_scheme(paths, expanding, last, "/expand/conv/kernel", ratio, axis,
                             [f"/*/bn/{n}" for n in ("scale", "bias")] if norms else [], classifier)


def _expansion_scheme(paths, expanding, last, expand, ratio, axis, norms, classifier,
                      head: str = "classifier/**") -> Scheme:
    """The paper's MobileNetV2 scheme over blocks `expanding` (with an expansion conv at
    `{block}{expand}`): the last `last` of them, their norms (`{block}{n}` for `n` in
    `norms`) and the classifier (`head`)."""
    if last is not None:
        if not 1 <= last <= len(expanding):
            raise SchemeError(f"last={last} but the model has {len(expanding)} blocks with an "
                              f"expansion convolution; use 1..{len(expanding)}")
        expanding = expanding[-last:]
    rules: list = [(f"{b}{expand}", _decision(ratio, axis)) for b in expanding]
    rules += [(f"{b}{n}", Full()) for b in expanding for n in norms]
    if classifier:
        rules += _keep_matching([(head, Full())], paths, repr(head))
    return Scheme(rules, default=Frozen())


def _torchvision_mobilenetv2(paths, last, ratio, axis, norms, classifier) -> Scheme:
    # torchvision's InvertedResidual with an expansion: conv = [ConvBNReLU (expand),
    # ConvBNReLU (depth-wise), Conv2d (project), BatchNorm2d]; without one it has 3 entries.
    found = (re.fullmatch(r"features/(\d+)/conv/3/weight", p) for p in paths)
    expanding = [f"features/{i}" for i in sorted(int(m[1]) for m in found if m)]
    return _expansion_scheme(paths, expanding, last, "/conv/0/0/weight", ratio, axis,
                             [f"/conv/{bn}/{n}" for bn in ("0/1", "1/1", "3") for n in ("weight", "bias")]
                             if norms else [], classifier)


def _keras_mobilenetv2(paths, last, ratio, axis, norms, classifier) -> Scheme:
    # keras.applications.MobileNetV2 names its layers flat: block_{i}_expand (a Conv2D),
    # block_{i}_expand_BN, block_{i}_depthwise(_BN), block_{i}_project(_BN), predictions.
    found = (re.fullmatch(r"(.*/)?block_(\d+)_expand/kernel", p) for p in paths)
    expanding = [f"{m[1] or ''}block_{m[2]}" for m in sorted(
        (m for m in found if m), key=lambda m: int(m[2]))]
    head = next((re.sub(r"/[^/]*$", "/**", p) for p in paths
                 if re.fullmatch(r"(?:.*/)?predictions/[^/]*", p)), "**/predictions/**")
    return _expansion_scheme(paths, expanding, last, "_expand/kernel", ratio, axis,
                             [f"_{part}_BN/{n}" for part in ("expand", "depthwise", "project")
                              for n in ("gamma", "beta")] if norms else [], classifier, head)


def lora(names: Sequence[str] = ("lora_a", "lora_b")) -> Scheme:
    """Only the LoRA adapters train (see `pockjax.models.lora`).

    Args:
      names: the adapters' last path components; default `("lora_a", "lora_b")`.

    Returns:
      A `Scheme` with `**/{name}` in full for each name, everything else frozen. It is
      not checked against a model here; `Scheme.resolve` does that.
    """
    return Scheme({f"**/{n}": Full() for n in names}, default=Frozen())


def schedule(schemes: Sequence[Scheme], *, every: int, order: str = "cycle", seed: int = 0):
    """A `pockjax.schedule.Schedule`: `schemes` take turns, each training for `every`
    steps. `sparse_train(..., scheme=schedule)` trains it.

    Args:
      schemes: the schemes, in turn order.
      every: steps each turn lasts, a positive whole number.
      order: "cycle" (the default: the list's order, again and again) or "random" (a
        random order each round, drawn from `seed` and the round number).
      seed: the random order's seed; default 0.

    Returns:
      The `Schedule`.

    Raises:
      SchemeError: `schemes` is empty or holds something other than `Scheme`s, `every`
        is not a positive whole number, or `order` is unknown.
    """
    return Schedule(tuple(schemes), every, order, seed)


def blockwise(params, *, every: int, group: int = 1, order: str = "descending",
              seed: int = 0, extra: Sequence[str] = (), name: str | None = None):
    """Every block of the model in turn, `group` blocks at a time, each group trained in
    full for `every` steps (block-coordinate descent over the blocks).

    Args:
      params: the model's parameters (or a model `params_of` takes).
      every: steps a group trains before the next one's turn.
      group: blocks per group, a positive whole number (default 1; the last group may be
        smaller).
      order: "descending" (the default: the last group first, the blocks nearest the
        output, whose gradients cost least), "ascending", or "random".
      seed: the random order's seed; default 0.
      extra: glob patterns trained in full in every turn as well (e.g. the final norm);
        default none.
      name: the blocks' container, as in `blocks`; None (the default) picks the one
        with the most blocks.

    Returns:
      A `pockjax.schedule.Schedule` with one scheme per group.

    Raises:
      SchemeError: the parameters have no repeated blocks (or none named `name`),
        `group`, `every` or `order` is invalid, or no parameter matches `extra`.
    """
    names = blocks(params, name)
    if not isinstance(group, numbers.Integral) or isinstance(group, bool) or group < 1:
        raise SchemeError(f"blockwise: group is the blocks trained together, a positive "
                          f"whole number, got {group!r}")
    if order not in ("descending", "ascending", "random"):
        raise SchemeError(f"blockwise: order is 'descending', 'ascending' or 'random', got "
                          f"{order!r}")
    groups = [names[i:i + group] for i in range(0, len(names), group)]
    if order == "descending":
        groups = groups[::-1]
    also = _keep_matching([(p, Full()) for p in extra], param_paths(params),
                          f"extra patterns {list(extra)}") if extra else []
    schemes = [Scheme([(f"{b}/**", Full()) for b in g] + also, default=Frozen())
               for g in groups]
    return Schedule(tuple(schemes), every, "random" if order == "random" else "cycle", seed)
