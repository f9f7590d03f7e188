"""`--scheme`: the text read once into a `SchemeSpec`, which builds the scheme (or
schedule) for a model's parameters; `choose_scheme` picks it for a loaded model.

Reading needs no JAX (`FinetuneOptions` reads `--scheme` where it is made, and the
options import no JAX); building does.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from pockjax.finetuning._base import FinetuneError
from pockjax.finetuning._model import shapes_of

SCHEMES = ("paper", "paper:K", "full", "last:N", "blockwise:K", "blockwise:K:N", "lora:R",
           "search:BUDGET", "FILE.json", "paper[:K]+head", "last:N+head")
"""The forms of `finetune(scheme=...)` (`--scheme`), as `SchemeSpec.parse` reads them."""

# A tied output head's weight: the embedding table (Flax LLaMA, LLaMA-style, GPT-2,
# GPT-NeoX, Bloom and Falcon names).
_EMBEDDINGS = ("embed/embedding", "embed_tokens/weight", "wte/weight", "embed_in/weight",
               "word_embeddings/weight")


def spec_number(spec: str, form: str) -> int:
    """The positive whole number after the colon of a scheme `spec` ("last:2" -> 2);
    `form` names the expected form in the error."""
    try:
        k = int(spec.split(":", 1)[1])
    except ValueError:
        k = 0
    if k <= 0:
        raise FinetuneError(f"--scheme {spec!r}: {form} takes a positive whole number")
    return k


@dataclasses.dataclass(frozen=True)
class SchemeSpec:
    """`--scheme` read: which form (`kind`) and its numbers. `str(spec)` is the text.

    Attributes:
      text: the text as given.
      kind: "paper", "full", "last", "lora", "blockwise", "search" or "file".
      count: paper's K (None: the last half of the blocks), last's N, lora's rank R,
        blockwise's K (steps a turn).
      group: blockwise's N (blocks a turn); 1 otherwise.
      head: "+head": the output head trains too.
      budget: search's budget ("40%", "4GiB").
      path: the scheme file of "FILE.json".
    """

    text: str
    kind: str
    count: int | None = None
    group: int = 1
    head: bool = False
    budget: str | None = None
    path: Path | None = None

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, spec) -> "SchemeSpec":
        """Read `--scheme` text (a `SchemeSpec` is returned as it is).

        Raises:
          FinetuneError: the text is none of `SCHEMES`' forms, or a count in it is not a
            positive whole number (the message names the text).
        """
        if isinstance(spec, SchemeSpec):
            return spec
        text = str(spec)
        base, head = (text[:-len("+head")], True) if text.endswith("+head") else (text, False)
        if head and not (base == "paper" or base.startswith(("paper:", "last:"))):
            raise FinetuneError(f"--scheme {text!r}: +head follows paper, paper:K or last:N "
                                f"(e.g. last:2+head)")
        if base == "full":
            return cls(text, "full")
        if base == "paper":
            return cls(text, "paper", head=head)
        if base.startswith("paper:"):
            return cls(text, "paper", spec_number(base, "paper:K"), head=head)
        if base.startswith("last:"):
            return cls(text, "last", spec_number(base, "last:N"), head=head)
        if base.startswith("lora:"):
            return cls(text, "lora", spec_number(base, "lora:R"))
        if base.startswith("blockwise:"):
            parts = base.split(":")
            if len(parts) not in (2, 3):
                raise FinetuneError(f"--scheme {text!r}: blockwise:K or blockwise:K:N (K steps "
                                    f"a turn, N blocks a turn)")
            every = spec_number(":".join(parts[:2]), "blockwise:K")
            group = spec_number("blockwise:" + parts[2], "blockwise:K:N") if len(parts) == 3 else 1
            return cls(text, "blockwise", every, group=group)
        if base.startswith("search:"):
            return cls(text, "search", budget=base.split(":", 1)[1])
        if base.endswith(".json"):
            return cls(text, "file", path=Path(base))
        raise FinetuneError(f"--scheme {text!r}: choose one of {', '.join(SCHEMES)} (paper: "
                            f"PockEngine's transformer scheme on the last half of the blocks)")

    @property
    def lora_rank(self) -> int | None:
        """The LoRA rank of "lora:R", else None."""
        return self.count if self.kind == "lora" else None

    @property
    def known_before_loading(self) -> bool:
        """Whether the scheme follows from the parameters' names and shapes alone, so the
        frozen weights can be stored compactly as they are read (not "search:", which
        needs the data, nor "blockwise:", whose schemes take turns)."""
        return self.kind not in ("search", "blockwise")

    def build(self, params, num_layers: int, *, search: Callable | None = None):
        """The scheme for a model's `params` (its names and shapes are enough, except for
        "search:") with `num_layers` blocks.

        Args:
          params: the model's parameter pytree (arrays or `jax.ShapeDtypeStruct`s).
          num_layers: the model's number of blocks.
          search: `search(budget) -> Scheme`, for "search:BUDGET"; None refuses that form.

        Returns:
          A `Scheme`, or a `pockjax.schedule.Schedule` for "blockwise:...".

        Raises:
          FinetuneError: "search:" without `search`, a missing JSON file, a model with no
            output head for "+head", or a scheme that does not fit `params`.
        """
        from pockjax import schemes
        from pockjax.scheme import Full, Scheme, SchemeError

        try:
            if self.kind == "full":
                scheme = Scheme(default=Full())
            elif self.kind == "paper":
                scheme = schemes.transformer(params, last=self.count or max(1, num_layers // 2))
            elif self.kind == "last":
                scheme = schemes.last_blocks(params, self.count)
            elif self.kind == "lora":
                # The adapters are the model's (load_model(lora=R)); the scheme trains them:
                # pockjax's (`lora_a`, `lora_b`) or peft's on a pockjax.torch model.
                from pockjax.scheme import leaves_with_paths
                peft = any("/lora_A/" in p for p, _ in leaves_with_paths(params)[0])
                scheme = schemes.lora(("lora_A/**", "lora_B/**") if peft else
                                      ("lora_a", "lora_b"))
            elif self.kind == "blockwise":
                return schemes.blockwise(params, every=self.count, group=self.group)
            elif self.kind == "search":
                if search is None:
                    raise FinetuneError("search schemes need the data: use finetune()")
                return search(self.budget)
            else:
                if not self.path.is_file():
                    raise FinetuneError(f"--scheme {self.text}: no such file")
                scheme = Scheme.from_json(self.path.read_text())
                scheme.resolve(params)
        except SchemeError as e:
            raise FinetuneError(f"--scheme {self.text}: {e}") from None
        if not self.head:
            return scheme
        head = output_head(params)
        if head is None:
            raise FinetuneError(f"--scheme {self.text}: the model has no output head (lm_head) "
                                f"and no embedding it could be tied to: use "
                                f"{self.text[:-len('+head')]}, or a scheme file that names the "
                                f"weights to train")
        return Scheme([(head[0], Full())] + list(scheme.rules), default=scheme.default)


def scheme_from_spec(spec, params, num_layers: int, *, search: Callable | None = None):
    """The scheme `finetune(scheme=spec)` trains, for a model's `params` with `num_layers`
    blocks: `SchemeSpec.parse(spec).build(params, num_layers, search=search)`.

    Args:
      spec: "full"; "paper" (`pockjax.schemes.transformer` on the last
        `max(1, num_layers // 2)` blocks) or "paper:K" (on the last K); "last:N" (the
        last N blocks in full); "lora:R" (the LoRA adapters, which the model must
        already have: `load_model(lora=R)`); "blockwise:K" / "blockwise:K:N" (the
        schedule `pockjax.schemes.blockwise`: the blocks, N at a time, each trained for
        K steps in turn from the last); "search:BUDGET" (calls `search(budget)`); or a
        path ending in ".json" to a scheme written by `Scheme.to_json`. "paper",
        "paper:K" and "last:N" take a "+head" suffix: the output head (`lm_head`) trains
        too, in full. A `SchemeSpec` is taken as it is.
      params: the model's parameter pytree.
      num_layers: the model's number of blocks.
      search: `search(budget) -> Scheme`, for "search:BUDGET"; None (the default)
        refuses that form.

    Returns:
      A `Scheme`, or a `pockjax.schedule.Schedule` for "blockwise:...".

    Raises:
      FinetuneError: the spec is none of the forms, a count in it is not a positive
        whole number, a JSON file is missing, "search:" comes without `search`, or the
        scheme does not fit `params` (the message names the spec).
    """
    return SchemeSpec.parse(spec).build(params, num_layers, search=search)


def output_head(params) -> tuple[str, bool] | None:
    """`(glob, tied)` of the model's output head: its own module (`lm_head/**`,
    GPT-NeoX's `embed_out/**`), or, for a model whose head is tied to its embedding, the
    embedding table (`tied` True: training it changes the input embeddings too, which
    is what the tied model computes with). None if neither is found."""
    from pockjax import schemes

    paths = schemes.param_paths(params)
    for name in schemes.HEADS:
        if any(p.startswith(name + "/") for p in paths):
            return f"{name}/**", False
    for p in paths:
        if any(p == e or p.endswith("/" + e) for e in _EMBEDDINGS):
            return p, True
    return None


def choose_scheme(loaded, spec, frozen_dtype: str, *, search: Callable | None = None,
                  say: Callable[[str], None] = lambda text: None):
    """The scheme (or schedule) `finetune` trains for `--scheme spec` on a loaded model:
    the one its weights were stored for, else the spec's; `say` gets the notes (a tied
    head that `+head` trains, block weights no role names)."""
    from pockjax import schemes
    from pockjax.schedule import Schedule

    spec = SchemeSpec.parse(spec)
    chosen = (loaded.scheme if loaded.scheme is not None else  # stored for it as read
              spec.build(loaded.params, loaded.num_layers, search=search))
    if spec.head:
        head = output_head(shapes_of(loaded.params))
        if head is not None and head[1]:
            say(f"+head: the output head is tied to the embedding ({head[0]}): the shared "
                f"table trains, so the input embeddings change too, as the tied model uses "
                f"them")
    if spec.kind == "paper":
        unnamed = schemes.unnamed_weights(shapes_of(loaded.params))
        if unnamed:
            say(f"--scheme {spec}: {len(unnamed)} weights of the blocks have names no role of "
                f"pockjax.schemes.FAMILY_NAMES has and stay frozen: "
                f"{', '.join(unnamed[:6])}{' ...' if len(unnamed) > 6 else ''}")
    if isinstance(chosen, Schedule) and frozen_dtype != "float32":
        raise FinetuneError(f"--scheme {spec} changes which weights train, so every weight "
                            f"needs its float32 value: use --frozen-dtype float32")
    return chosen

