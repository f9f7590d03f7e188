"""The quality benchmark's presets and methods (the rows of its table), and the names
its runs are filed under."""
from __future__ import annotations

import dataclasses
import sys

TASKS = ("domain", "instruct")
# Every linear layer of a LLaMA block: LoRA's targets and the Channels rows' weights.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUALITY_MARGIN = 0.02  # time to quality: validation loss within 2% of the reference's final

# Learning-rate grids: rows that train every weight, and rows that train few parameters
# (which want larger steps). The quick preset takes the last rate of a grid.
FULL_RATES = (1e-4, 3e-4, 1e-3)
FEW_RATES = (3e-4, 1e-3, 3e-3)

PRESETS = {
    # Minutes on a 2-core CPU: a test of the pipeline, not a measurement.
    "quick": dict(pretrain="quick", steps=16, sweep_steps=16, seeds=1, rates_in_sweep=1,
                  blockwise_every=4,
                  eval_points=4, batch=8, warmup_frac=0.1, sample_pct=30,
                  caps={"train": 2000, "valid": 32, "test": 64}, eval_batch=16,
                  search=dict(steps=10, lr=1e-3, last_blocks=1, parts=("mlp/**",),
                              ratios=()),
                  time_steps=4, row_timeout=900),
    # A row (sweep, 3 seeds, scoring) takes 14-20 minutes on a 2-core Xeon (the last 2
    # blocks with int4 frozen weights 14, PockEngine's scheme with int4 20), so the 19
    # rows take 5-6 hours there, pretraining's 40 minutes apart; on an H200 a row takes
    # 1.5-4.5 minutes with ten at a time (`python -m benchmarks gpu quality`). The
    # search's candidates are the weights of the last half of the blocks, each in full
    # and at 1/4 of its input channels: the library's default (every weight, at 1/8,
    # 1/4 and 1/2 too) would take about an hour a task.
    "small": dict(pretrain="small", steps=80, sweep_steps=30, seeds=3, rates_in_sweep=3,
                  blockwise_every=4,
                  eval_points=8, batch=8, warmup_frac=0.1, sample_pct=100,
                  caps={"train": 4000, "valid": 32, "test": 128}, eval_batch=16,
                  search=dict(steps=10, lr=1e-3, last_blocks=3, parts=("**",), ratios=(0.25,)),
                  time_steps=16, row_timeout=4 * 3600),
    # The 31.6M-parameter model (`benchmarks/pretrain.py`'s medium preset), the same tasks,
    # the rows of `MEDIUM_METHODS`. Sweep runs are as long as the seeds' runs, so seed 0 at
    # the chosen rate is its sweep run; 2 seeds. The search's candidates cover the whole
    # model at the granularity of a block's attention or MLP (`whole_model_candidates`),
    # 48 candidates instead of the library default's 200-odd single weights.
    "medium": dict(pretrain="medium", steps=80, sweep_steps=80, seeds=2, rates_in_sweep=3,
                   blockwise_every=2,
                   eval_points=8, batch=8, warmup_frac=0.1, sample_pct=100,
                   caps={"train": 4000, "valid": 32, "test": 128}, eval_batch=16,
                   search=dict(steps=10, lr=1e-3, whole_model=True, ratios=(0.25,)),
                   time_steps=16, row_timeout=8 * 3600),
    # The medium preset's code path (its corpus source, packed pretraining, whole-model
    # search, method list) at the quick preset's size: a test of the pipeline.
    "medium-quick": dict(pretrain="medium-quick", steps=8, sweep_steps=8, seeds=2,
                         rates_in_sweep=1, blockwise_every=2,
                         eval_points=4, batch=8, warmup_frac=0.1, sample_pct=30,
                         caps={"train": 2000, "valid": 16, "test": 32}, eval_batch=16,
                         search=dict(steps=4, lr=1e-3, whole_model=True, ratios=(0.25,)),
                         time_steps=4, row_timeout=900),
    # A published checkpoint (`benchmarks/quality_real.py`): SmolLM2-135M-Instruct from
    # its GGUF file, task "instruct" only, the rows of `REAL_METHODS`, every grid's rates
    # a tenth of the small models' (a pretrained model of this size wants smaller steps:
    # the small models' rates diverge here). Sweep runs are the seeds' length, so seed 0
    # at the chosen rate is its sweep run. A row takes 10-25 minutes on a 2-core Xeon.
    "real": dict(pretrain="real", tasks=("instruct",), seq=256, steps=32, sweep_steps=32,
                 seeds=2, rates_in_sweep=2, rate_scale=0.1, blockwise_every=4,
                 eval_points=4, batch=4, warmup_frac=0.1, sample_pct=100,
                 caps={"train": 2000, "valid": 32, "test": 64}, eval_batch=8,
                 search=dict(steps=4, lr=1e-4, last_blocks=4, parts=("**",), ratios=()),
                 time_steps=6, row_timeout=3 * 3600),
    # The real preset's code path at a size that runs in minutes: a test of the pipeline.
    "real-quick": dict(pretrain="real", tasks=("instruct",), seq=128, steps=4, sweep_steps=4,
                       seeds=1, rates_in_sweep=1, rate_scale=0.1, blockwise_every=2,
                       eval_points=2, batch=2, warmup_frac=0.1, sample_pct=10,
                       caps={"train": 200, "valid": 8, "test": 8}, eval_batch=8,
                       search=dict(steps=2, lr=1e-4, last_blocks=1, parts=("mlp/**",),
                                   ratios=()),
                       time_steps=3, row_timeout=1800),
}
PRESETS["full"] = PRESETS["small"]  # the small preset's former name


@dataclasses.dataclass(frozen=True)
class Method:
    """One row of the table: `kind` picks the runner (`quality_runs.RUNNERS`); `scheme`
    is what `pockjax.finetune` trains (its own strings, or "@name" for a scheme built by
    `quality_schemes.build_scheme`); `rank` is LoRA's; `rates` the sweep's grid; `quick`
    puts the row in the quick preset; `frontend` is finetune's (the model code that
    runs); `frozen` its `frozen_dtype` (the frozen weights' storage)."""

    name: str
    kind: str
    scheme: str = ""
    rank: int = 0
    rates: tuple[float, ...] = ()
    quick: bool = True
    frontend: str = "auto"
    frozen: str = "float32"
    auto: bool = False   # finetune's `lr="auto"` chooses the rate in each run: no sweep


METHODS = [
    Method("pretrained (no fine-tuning)", "pretrained"),
    Method("torch full (AdamW)", "torch", rates=FULL_RATES),
    Method("peft LoRA r8", "peft", rank=8, rates=FEW_RATES),
    Method("peft LoRA r16", "peft", rank=16, rates=FEW_RATES, quick=False),
    Method("pockjax full", "pockjax", "full", rates=FULL_RATES),
    Method("pockjax last:1", "pockjax", "last:1", rates=FEW_RATES, quick=False),
    Method("pockjax last:2", "pockjax", "last:2", rates=FEW_RATES, quick=False),
    Method("pockjax last:4", "pockjax", "last:4", rates=FULL_RATES, quick=False),
    Method("pockjax paper", "pockjax", "paper", rates=FEW_RATES),
    # The same schemes with the output head trained too (finetune's "+head").
    Method("pockjax paper+head", "pockjax", "paper+head", rates=FEW_RATES, quick=False),
    Method("pockjax last:2+head", "pockjax", "last:2+head", rates=FEW_RATES, quick=False),
    Method("pockjax bias+norms", "pockjax", "@bias-norms", rates=FEW_RATES, quick=False),
    Method("pockjax channels in 1/4", "pockjax", "@channels-in", rates=FEW_RATES, quick=False),
    Method("pockjax channels out 1/4", "pockjax", "@channels-out", rates=FEW_RATES, quick=False),
    Method("pockjax search:LoRA-r8", "pockjax", "@search:lora-r8", rates=FEW_RATES, quick=False),
    Method("pockjax search:50%", "pockjax", "@search:50%", rates=FEW_RATES, quick=False),
    Method("pockjax LoRA r8", "pockjax", "lora:8", rank=8, rates=FEW_RATES, quick=False),
    # One block at a time, each for `every` steps, from the last block back (the preset's
    # `blockwise_every`: about 3 turns per block over a run).
    Method("pockjax blockwise", "pockjax", "@blockwise", rates=FULL_RATES, quick=False),
    # PockEngine's scheme on transformers' own LlamaForCausalLM through pockjax.torch.
    Method("pockjax.torch paper", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frontend="torch"),
    # Frozen weights in 4 and 8 bits (pockjax.lowbit) against the same schemes in float32.
    Method("pockjax paper int4", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frozen="int4"),
    Method("pockjax paper int8", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frozen="int8"),
    Method("pockjax last:2 int4", "pockjax", "last:2", rates=FEW_RATES, quick=False,
           frozen="int4"),
    # The real preset: PockEngine's scheme from the GGUF file itself, its frozen weights
    # kept in the file's blocks (`frozen="gguf"`: the model is the file, not the folder).
    Method("pockjax paper (GGUF file)", "pockjax", "paper", rates=FEW_RATES, quick=False,
           frozen="gguf"),
    # `--lr auto` against the benchmark's own sweep: finetune's short run at each rate of
    # its grid on the validation split, in every seed's run.
    Method("pockjax paper (--lr auto)", "pockjax", "paper", rates=(0.0,), quick=False,
           auto=True),
]
REFERENCE = "torch full (AdamW)"
# The medium preset's rows: the references, LoRA, and pockjax's whole-block, channel,
# searched and scheduled schemes.
MEDIUM_METHODS = ("pretrained (no fine-tuning)", "torch full (AdamW)", "peft LoRA r8",
                  "peft LoRA r16", "pockjax full", "pockjax last:1", "pockjax last:2",
                  "pockjax paper", "pockjax paper+head", "pockjax search:LoRA-r8",
                  "pockjax channels in 1/4", "pockjax blockwise")
# The real preset's rows: the references, LoRA, and pockjax's whole-model, block and
# PockEngine schemes, the last also from the GGUF file as it is stored.
REAL_METHODS = ("pretrained (no fine-tuning)", "torch full (AdamW)", "peft LoRA r8",
                "pockjax full", "pockjax last:2", "pockjax paper", "pockjax paper (GGUF file)",
                "pockjax paper (--lr auto)")


PRESET_TITLES = {"quick": "quick preset", "small": "small preset, 8.9M parameters",
                 "full": "small preset, 8.9M parameters",
                 "medium": "medium preset, 31.6M parameters",
                 "medium-quick": "medium-quick preset",
                 "real": "real preset, SmolLM2-135M-Instruct from its GGUF file",
                 "real-quick": "real-quick preset"}
# Each preset's results page (the .json and .png beside it).
RESULTS = {"quick": "quality_quick.md", "small": "quality.md", "medium": "quality_medium.md",
           "medium-quick": "quality_medium-quick.md", "real": "quality_real.md",
           "real-quick": "quality_real-quick.md"}


def preset_methods(preset: str) -> list[Method]:
    """The rows a preset runs: the quick preset's marked ones, the small preset's all,
    the medium presets' `MEDIUM_METHODS`, the real presets' `REAL_METHODS`."""
    if preset.startswith("real"):
        return [m for m in METHODS if m.name in REAL_METHODS]
    if preset.startswith("medium"):
        return [m for m in METHODS if m.name in MEDIUM_METHODS]
    return [m for m in METHODS if m.quick or preset in ("small", "full")]


def tasks_of(cfg: dict) -> tuple[str, ...]:
    """The tasks a run's configuration trains on, in `TASKS`'s order."""
    return tuple(t for t in TASKS if t in cfg.get("tasks", TASKS))


def timing_task(cfg: dict) -> str:
    """The task the timing runs train on: "domain" where the preset has it."""
    return "domain" if "domain" in tasks_of(cfg) else tasks_of(cfg)[0]


def rates_of(cfg: dict, method: Method) -> list[float]:
    """The method's sweep grid in this preset: the last `rates_in_sweep` of its rates,
    scaled by the preset's `rate_scale`; [0.0] for a method whose runs choose their own
    (`auto`)."""
    if method.auto:
        return [0.0]   # a placeholder: each run's finetune chooses
    scale = cfg.get("rate_scale", 1.0)
    return [float(f"{r * scale:.3g}") for r in method.rates[-cfg["rates_in_sweep"]:]]


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-").replace("--", "-")


def method_named(name: str) -> Method:
    for m in METHODS:
        if m.name == name or slug(m.name) == name:
            return m
    sys.exit(f"quality benchmark: no method {name!r}; the methods are: "
             + ", ".join(slug(m.name) for m in METHODS))
