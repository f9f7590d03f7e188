"""The fine-tuning job's options, in one place: `FinetuneOptions` holds their defaults,
checks and help. `pockjax finetune`'s flags (`add_arguments`), `pockjax.finetune`'s
keywords, `pockjax export --model`'s job flags, the options `run.json` records and the
resume check (`RESULT_OPTIONS`) are all read from its fields.

Imports no JAX: the device job (`pockjax run`) records its runs with `run_options`.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import typing

from pockjax.finetuning._base import FRONTENDS, SCHEDULES, FinetuneError

LR_GRID = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)
"""The rates `--lr auto` tries."""

MOMENTS = ("float32", "bfloat16", "int8")
"""The storage of AdamW's moments `--moments` takes (`pockjax.optim.moments.MOMENTS`,
which needs JAX to import; a test checks the two agree)."""
from pockjax.finetuning._model import SAVE_DTYPES

GGUF_TYPES = ("F16", "BF16", "F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
"""The types of final.gguf's trained tensors (`pockjax.gguf.SAVE_TYPES`, which needs JAX
to import; a test checks the two agree)."""
from pockjax.finetuning._spec import SchemeSpec
from pockjax.gguf._convert import FROZEN_TYPES


def _option(default, help: str, *, result: bool = False, job: bool = False, flag: str | None = None,
            choices=None, metavar: str | None = None):
    """A field of `FinetuneOptions`. `result`: it changes what the run computes (recorded
    in `run.json`; a resumed run must have the same value). `job`: `pockjax export
    --model` takes it too (the device job's step is built from it). `flag`: the command
    line's flag where it is not `--name-with-dashes` (`--no-plot`)."""
    return dataclasses.field(default=default, metadata=dict(
        help=help, result=result, job=job, flag=flag, choices=choices, metavar=metavar))


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
    """What `pockjax finetune` / `pockjax.finetune(model, data, out, **options)` does
    besides its three folders; checked when made (a bad value raises `FinetuneError`
    naming the flag). `scheme` is read into a `SchemeSpec`.

    Each field's help is `pockjax finetune -h`'s; `finetune`'s docstring says more.
    """

    valid: str | None = _option(None, "held-out JSONL, evaluated every --eval-every steps",
                                metavar="FILE")
    scheme: SchemeSpec | str = _option(
        "paper", "paper (PockEngine's transformer scheme, last half of the blocks) | paper:K "
        "| full | last:N | paper[:K]+head, last:N+head (the output head trains too) | "
        "blockwise:K[:N] (the blocks, N at a time, each trained K steps in turn) | lora:R "
        "(LoRA of rank R on every linear layer, merged at the end) | search:BUDGET (e.g. "
        "search:40%% or search:4GiB) | FILE.json (default: paper)", result=True, job=True)
    steps: int | None = _option(None, "training steps (with export --model: the run's length, "
                                "which the learning-rate schedule is built for)", job=True)
    epochs: float | None = _option(None, "passes over the data (default 1)")
    batch: int = _option(4, "examples per step (default 4)", result=True, job=True)
    seq: int | None = _option(None, "tokens per example; longer ones are cut (default 512, or "
                              "the model's max_position_embeddings where fewer)", result=True,
                              job=True)
    lr: float | str = _option(1e-4, "AdamW learning rate (default 1e-4), or auto: the best of "
                              "a short run at each rate of LR_GRID on --valid's loss, recorded "
                              "in run.json", result=True, job=True, metavar="LR")
    warmup: int = _option(0, "linear warm-up steps (default 0)", result=True, job=True)
    schedule: str = _option("cosine", "decay after the warm-up (default cosine)", result=True,
                            job=True, choices=SCHEDULES)
    weight_decay: float = _option(0.0, "AdamW weight decay (default 0)", result=True, job=True)
    eval_every: int | None = _option(None, "steps between evaluations (default: at the start "
                                     "and the end)")
    save_every: int | None = _option(None, "steps between checkpoints (default: at the end, "
                                     "and on Ctrl-C or SIGTERM)")
    keep: int = _option(3, "checkpoints kept (default 3)")
    resume: bool = _option(False, "continue the run in --out")
    overwrite: bool = _option(False, "start again in --out")
    seed: int = _option(0, "seed of the data order (and of LoRA's adapters)", result=True,
                        job=True)
    frozen_dtype: str = _option(
        "float32", "storage of the frozen weights: float32, bfloat16 (LLaMA families), int8 "
        "(a scale per output channel) or int4 (a scale per group of 64 inputs; int4:GROUP "
        "sets the group; the embeddings and output head stay int8), dequantized where each "
        "is used (pockjax.lowbit); the fine-tuned model holds the base's own frozen tensors "
        "either way", result=True, job=True,
        metavar="FORMAT")
    moments: str = _option(
        "float32", "storage of AdamW's two moments: float32 (8 bytes a trained value), "
        "bfloat16 (4) or int8 (2, block-wise; pockjax.optim.adamw); the trained weights stay "
        "float32", result=True, job=True, choices=MOMENTS)
    skip_nonfinite: bool = _option(False, "skip a step whose loss or gradient is not finite "
                                   "instead of stopping", result=True)
    frontend: str = _option(
        "auto", "the model code: auto (pockjax's Flax LLaMA for LLaMA families, pockjax.torch "
        "for other causal LMs), flax, or torch (transformers' own module for any family)",
        result=True, job=True, choices=FRONTENDS)
    devices: int | str = _option(
        "auto", "devices the step runs on: N, all, or auto (default: every GPU or TPU of "
        "JAX's default backend; one on CPU, whose devices share its cores); --batch stays "
        "the global batch, split over them", metavar="N")
    mesh: str | None = _option(
        None, "the devices' axes: data=N (data-parallel), fsdp=N (parameters and optimizer "
        "state sharded too), or both, e.g. data=2,fsdp=4 (default: data over --devices)",
        metavar="AXES")
    coordinator: str | None = _option(
        None, "HOST:PORT of process 0, for a run over several processes (hosts), each "
        "started with the same --coordinator and --num-processes and its own --process-id "
        "(default: one process, or the processes SLURM's srun or mpirun started)",
        metavar="HOST:PORT")
    num_processes: int | None = _option(None, "the run's processes, with --coordinator",
                                        metavar="N")
    process_id: int | None = _option(None, "this process, 0 to N-1, with --coordinator",
                                     metavar="I")
    plot: bool = _option(True, "do not draw loss.png (matplotlib) at the end; metrics.jsonl is "
                         "written either way", flag="--no-plot")
    prefix_cache: str = _option("auto", "compute the frozen prefix once per example when the "
                                "data repeats (auto: when it saves enough; same results either "
                                "way)", choices=("auto", "on", "off"))
    save_dtype: str = _option("auto", "the float type of final/'s trained tensors (default "
                              "auto: the base model's); the tensors the scheme freezes are the "
                              "base's own bytes", choices=SAVE_DTYPES)
    gguf_type: str = _option("F16", "with a .gguf --model, final.gguf is written beside "
                             "final/: the file's own bytes for every frozen tensor, the trained "
                             "ones (with --save-gguf too) in this type (default F16; BF16, "
                             "F32, or a block type gguf quantizes: Q8_0, Q4_0, Q4_1, Q5_0, "
                             "Q5_1)", choices=GGUF_TYPES, metavar="TYPE", job=True)
    save_gguf: str | None = _option(None, "with a model folder (llama, mistral, qwen2, "
                                    "qwen3), also write final.gguf beside final/: the frozen "
                                    "tensors quantized once to TYPE (Q8_0, Q4_0, Q4_1, Q5_0, "
                                    "Q5_1, F16, BF16, F32), the trained ones in --gguf-type",
                                    choices=FROZEN_TYPES, metavar="TYPE")
    logits: str = _option("targets", "where the output head runs: targets (default: only at "
                          "the positions the loss counts, when prompts and padding leave at "
                          "most half of a batch's; with the prefix cache on, everywhere) or all",
                          result=True, choices=("targets", "all"))
    compile_cache: bool = _option(True, "do not use JAX's persistent compilation cache "
                                  "(default: on, in ~/.cache/pockjax/jax, so a second run of "
                                  "the same shapes starts without compiling)", flag="--no-cache")
    progress: bool = _option(True, "a progress bar and log lines on stderr")

    def __post_init__(self):
        object.__setattr__(self, "scheme", SchemeSpec.parse(self.scheme))
        # numpy numbers as the plain Python numbers run.json records (and a whole float
        # for --warmup, a step count the schedule reads as a number); any other value
        # stays, for the checks below to refuse.
        for name, kind in _NUMBERS.items():
            value = getattr(self, name)
            if kind is int and (_whole(value) or name == "warmup" and _real(value)
                                and float(value).is_integer()):
                object.__setattr__(self, name, int(value))
            elif kind is float and _real(value):
                object.__setattr__(self, name, float(value))
        if self.steps is not None and self.epochs is not None:
            raise FinetuneError("give --steps or --epochs, not both")
        for name in ("batch", "keep", "steps", "seq", "eval_every", "save_every"):
            value = getattr(self, name)
            if value is None and name not in ("batch", "keep"):
                continue
            if not _whole(value) or value < 1:
                raise FinetuneError(f"{_flag(name)} must be a positive whole number, got "
                                    f"{value!r}")
        if self.seq is not None and self.seq < 2:
            raise FinetuneError(f"--seq must be at least 2 (a token and the one it predicts), "
                                f"got {self.seq}")
        if self.epochs is not None and not (_real(self.epochs) and self.epochs > 0):
            raise FinetuneError(f"--epochs must be positive, got {self.epochs!r}")
        if _real(self.lr):
            object.__setattr__(self, "lr", float(self.lr))
        elif isinstance(self.lr, str) and self.lr != "auto":
            try:  # the command line's text
                object.__setattr__(self, "lr", float(self.lr))
            except ValueError:
                pass
        if self.lr != "auto" and not (_real(self.lr) and self.lr > 0 and math.isfinite(self.lr)):
            raise FinetuneError(f"--lr must be a positive finite number or auto, got "
                                f"{self.lr!r}")
        if self.lr == "auto" and self.valid is None:
            raise FinetuneError("--lr auto chooses the rate by the loss on held-out data: give "
                                "--valid FILE, or a number for --lr")
        if self.lr == "auto" and self.scheme.kind in ("search", "blockwise"):
            raise FinetuneError(f"--lr auto with --scheme {self.scheme}: that scheme is not "
                                f"swept; give a number for --lr")
        if not (_whole(self.warmup) and self.warmup >= 0):
            raise FinetuneError(f"--warmup must be a whole number >= 0, got {self.warmup!r}")
        if not (_real(self.weight_decay) and self.weight_decay >= 0
                and math.isfinite(self.weight_decay)):
            raise FinetuneError(f"--weight-decay must be a finite number >= 0, got "
                                f"{self.weight_decay!r}")
        if not _whole(self.seed):
            raise FinetuneError(f"--seed must be a whole number, got {self.seed!r}")
        if self.resume and self.overwrite:
            raise FinetuneError("give --resume or --overwrite, not both")
        for field in dataclasses.fields(self):
            choices = field.metadata["choices"]
            value = getattr(self, field.name)
            if choices is not None and value not in choices and not (
                    value is None and field.default is None):  # an option left out
                raise FinetuneError(f"{_flag(field.name)} must be one of {', '.join(choices)}, "
                                    f"got {value!r}")
        devices = self.devices
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if not (devices in ("auto", "all") or _whole(devices) and devices >= 1):
            raise FinetuneError(f"--devices must be a positive whole number, all or auto, got "
                                f"{self.devices!r}")
        object.__setattr__(self, "devices", devices)
        if self.mesh is not None:
            axes = mesh_axes(self.mesh)
            size = math.prod(axes.values())
            if _whole(devices) and devices != size:
                raise FinetuneError(f"--mesh {self.mesh} has {size} devices, --devices "
                                    f"{devices}; give one of them, or the same count")
            object.__setattr__(self, "mesh", ",".join(f"{a}={n}" for a, n in axes.items()))
        given = [n for n in ("coordinator", "num_processes", "process_id")
                 if getattr(self, n) is not None]
        if given and len(given) != 3:
            raise FinetuneError("a run over several processes needs --coordinator HOST:PORT, "
                                "--num-processes N and --process-id I together; got only "
                                + ", ".join(_flag(n) for n in given))
        if given:
            host, _, port = str(self.coordinator).rpartition(":")
            if not host or not port.isdigit():
                raise FinetuneError(f"--coordinator must be HOST:PORT (process 0's address "
                                    f"and a free port), got {self.coordinator!r}")
            if not (_whole(self.num_processes) and self.num_processes >= 1 and
                    _whole(self.process_id) and 0 <= self.process_id < self.num_processes):
                raise FinetuneError(f"--process-id must be 0 to --num-processes - 1, got "
                                    f"{self.process_id!r} of {self.num_processes!r}")
            if self.lr == "auto" or self.scheme.kind == "search":
                raise FinetuneError("--lr auto and --scheme search: run on one process; "
                                    "choose them in a one-process run, then pass them here")
        if self.scheme.lora_rank is not None and self.frozen_dtype != "float32":
            raise FinetuneError(f"--scheme {self.scheme} with --frozen-dtype "
                                f"{self.frozen_dtype} is not implemented; use --frozen-dtype "
                                f"float32")

    @classmethod
    def names(cls, *, job: bool = False) -> tuple[str, ...]:
        """The options' names; `job`: only those `pockjax export --model` takes."""
        return tuple(f.name for f in dataclasses.fields(cls) if not job or f.metadata["job"])

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, job: bool = False,
                  **given) -> "FinetuneOptions":
        """The options from parsed `add_arguments` flags (`job`, as there), and `given`
        (the options a parser holds under other terms)."""
        return cls(**{name: getattr(args, name) for name in cls.names(job=job)
                      if hasattr(args, name) and name not in given}, **given)

    @classmethod
    def add_arguments(cls, parser, *, job: bool = False, without: tuple[str, ...] = ()) -> None:
        """Add the options' flags to an argparse parser (or group); `job`: only those
        `pockjax export --model` takes; `without`: options the parser has already.
        `--steps` and `--epochs` exclude each other."""
        both = parser.add_mutually_exclusive_group() if not job else parser
        for field in dataclasses.fields(cls):
            meta = field.metadata
            if field.name in ("progress", *without) or (job and not meta["job"]):
                continue
            flag = meta["flag"] or _flag(field.name)
            target = both if field.name in ("steps", "epochs") else parser
            if isinstance(field.default, bool):
                action = "store_false" if field.default else "store_true"
                target.add_argument(flag, dest=field.name, action=action, help=meta["help"])
                continue
            target.add_argument(flag, dest=field.name, default=field.default,
                                type=_NUMBERS.get(field.name),
                                choices=meta["choices"], metavar=meta["metavar"],
                                help=meta["help"])


MESH_AXES = ("data", "fsdp")
"""The axes `--mesh` names: `data` splits each step's batch, `fsdp` splits the batch and
shards the parameters and optimizer state too."""


def mesh_axes(text: str) -> dict[str, int]:
    """`--mesh`'s text (`data=2,fsdp=4`) as `{axis: size}`, in `MESH_AXES`' order.

    Raises:
      FinetuneError: an unknown or repeated axis, or a size that is not a positive whole
        number.
    """
    axes: dict[str, int] = {}
    for part in str(text).replace(" ", "").split(","):
        name, eq, size = part.partition("=")
        if name not in MESH_AXES or not eq or not size.isdigit() or int(size) < 1:
            raise FinetuneError(f"--mesh {text!r}: expected AXIS=SIZE[,AXIS=SIZE] with AXIS "
                                f"one of {', '.join(MESH_AXES)} and SIZE a positive whole "
                                f"number, e.g. data=4 or data=2,fsdp=2; got {part!r}")
        if name in axes:
            raise FinetuneError(f"--mesh {text!r}: the axis {name!r} is given twice")
        axes[name] = int(size)
    return {a: axes[a] for a in MESH_AXES if a in axes}


def _number_kind(hint) -> type | None:
    """int or float for a field typed `int`, `float` or either `| None`; else None."""
    kinds = {a for a in typing.get_args(hint) or (hint,) if a is not type(None)}
    return next(iter(kinds)) if len(kinds) == 1 and kinds <= {int, float} else None


# The numeric options and their type, read from the fields' annotations.
_NUMBERS = {name: kind for name, hint in typing.get_type_hints(FinetuneOptions).items()
            if (kind := _number_kind(hint)) is not None}

RESULT_OPTIONS = ("model", "data", "scheme", "total_steps") + tuple(
    f.name for f in dataclasses.fields(FinetuneOptions)
    if f.metadata["result"] and f.name not in ("scheme", "steps"))
"""What `run.json` records: the options that change what a run computes (its model, the
data's fingerprint, the scheme resolved, the run's length, and the fields marked so); a
resumed run must have the same."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _whole(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
