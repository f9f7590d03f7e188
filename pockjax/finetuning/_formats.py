"""The formats `finetune` stores frozen weights in: `frozen_formats` (what `--frozen-dtype`
means per weight), `decisions_by_path` (what a loader storing weights as it reads them
asks of each path) and `stored_formats` (what the log says of a stored model)."""
from __future__ import annotations


# With an int4 format, the embedding tables and output heads stay in int8: on
# SmolLM2-135M-Instruct (tied head, 49,152 tokens) int4 there raised the held-out loss
# by 0.44 nats (0.13 with groups along each token's row), int8 by none (results page
# benchmarks/results/gguf_real_formats.md); the blocks' weights in int4 cost 0.03.
WIDE_PARTS = ("embed/embedding", "**/embed_tokens/weight", "**/wte/weight",
              "**/embed_in/weight", "**/word_embeddings/weight", "lm_head/**", "**/lm_head/**",
              "embed_out/**", "**/embed_out/**")


def frozen_formats(frozen_dtype: str):
    """The formats `finetune` stores frozen weights in for `--frozen-dtype`: one format,
    or for int4 a dict of path patterns to formats (the embeddings and output heads,
    `WIDE_PARTS`, in int8; the rest in int4), as `pockjax.lowbit.quantize` takes it."""
    if not frozen_dtype.startswith("int4"):
        return frozen_dtype
    return {**{pattern: "int8" for pattern in WIDE_PARTS}, "**": frozen_dtype}


def stored_formats(params) -> str:
    """"120 Q4_1, 1 Q8_0": how many weights of `params` each stored format holds ("" for
    none)."""
    from collections import Counter

    import jax

    from pockjax import lowbit

    counts = Counter(x.fmt.name for x in jax.tree_util.tree_leaves(
        params, is_leaf=lowbit.is_quantized) if lowbit.is_quantized(x))
    return ", ".join(f"{n} {name}" for name, n in counts.most_common())

def decisions_by_path(scheme, shapes) -> dict:
    """`{path: decision}` of `scheme` resolved on the parameter shapes `shapes`: what a
    loader that stores each weight as it reads it asks of each path."""
    import jax

    from pockjax.scheme import leaves_with_paths

    decisions = jax.tree_util.tree_leaves(scheme.resolve(shapes),
                                          is_leaf=lambda d: d is not None
                                          and not isinstance(d, dict))
    return dict(zip((path for path, _ in leaves_with_paths(shapes)[0]), decisions))
