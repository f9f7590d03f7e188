"""Where a training step's time goes: XLA CPU operations, from a JAX profiler trace.

Profiles the compiled steps of `paper_table.py`'s rows that run on XLA (pockjax sparse,
pockjax full, JAX + optax full) on one of its workloads, in one process: a few
warm-up steps, then `--steps` steps under `jax.profiler.trace`. Each operation the
XLA CPU runtime executes is an event named after its HLO instruction. Events are
summed per instruction and grouped by what the instruction computes, read from the
compiled HLO:

- "depthwise conv": a convolution with feature groups;
- "conv": any other convolution;
- "matmul": a dot;
- "elementwise/reduce", "copy/transpose", "other".

For each row, the table gives milliseconds per step per group, its share of the summed
operation time, and the median wall time of a step. It also lists the slowest
instructions. The output is written to
`benchmarks/results/profile_WORKLOAD.md`.

    python -m benchmarks profile [--workload mobilenetv2] [--quick] [--steps 5]
        [--rows "pockjax sparse,jax+optax full"]

`--preset` (LLaMA only) profiles `real_size.py`'s JAX rows instead, built by its
`jax_row` (same weights, scheme, precision, AdamW) at one of its shapes, and splits the
step further, from the HLO's source metadata: "optimizer update" (instructions traced
from optax or `pockjax.optim`), the non-matmul time by the model code it came from
(RMSNorm, rotary embedding, softmax, SwiGLU, cross-entropy, ...), and every dot by shape
and role (forward; backward: input gradient, or weight gradient when it contracts over
the tokens; attention). An instruction that finishes asynchronously (an Eigen dot) lasts
until its "end:" event. Each distinct dot is then timed alone (jitted, same dtypes and
dimension numbers, operands cycled through copies of about 768 MiB so they come from
memory as in the step; and repeated on one pair, warm in cache), and the AdamW update
alone, its bytes against an in-place triad's bandwidth. Writes
`benchmarks/results/profile_llama_<size>.md`.

    python -m benchmarks profile --workload llama --preset tinyllama-1.1b
        --rows "pockjax sparse last-k f32,pockjax sparse last-k bf16-frozen bf16-matmul"

`--torch` adds PyTorch's full fine-tuning step of the same shape (real_size.py's `torch
full fused-adamw` row) under `torch.profiler`, its operators' own times grouped by name
(`TORCH_GROUPS`) as a column beside the XLA rows:

    python -m benchmarks profile --workload llama --preset quality-small --torch
        --rows "pockjax full f32,jax+optax full f32"
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import ROOT, commit, versions  # noqa: E402
from benchmarks.paper_table import (describe, jax_step, make_batch, make_model,  # noqa: E402
                                    sizes)

ROWS = ["pockjax sparse", "pockjax full", "jax+optax full"]
# also accepted: the sparse step with the frozen batch norms folded (paper_table's row)
EXTRA_ROWS = ["pockjax sparse (frozen BN folded)"]
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z0-9\-]*)\(")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_groups(text: str) -> dict[str, str]:
    """Instruction name -> group, for the instructions of a compiled HLO module."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            computations[current] = []
        elif current is not None:
            computations[current].append(line)

    def classify(lines: list[str], depth: int = 0) -> str | None:
        found = None
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(2)
            if op == "convolution":
                groups = re.search(r"feature_group_count=(\d+)", line)
                return "depthwise conv" if groups and int(groups.group(1)) > 1 else "conv"
            if op == "dot":
                found = "matmul"
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if called and depth < 3 and called.group(1) in computations:
                inner = classify(computations[called.group(1)], depth + 1)
                if inner in ("depthwise conv", "conv"):
                    return inner
                found = found or inner
        return found

    out = {}
    for lines in computations.values():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            name, op = m.groups()
            out[name] = classify([line]) or _plain_group(name, op)
    return out


def _plain_group(name: str, op: str) -> str:
    """The group of an instruction that computes no convolution or dot."""
    if op in ("copy", "transpose") or "copy" in name or "transpose" in name:
        return "copy/transpose"
    if op in ("fusion", "reduce", "add", "multiply", "select", "broadcast", "maximum",
              "exponential", "divide", "subtract"):
        return "elementwise/reduce"
    return "other"


def trace_events(step, steps: int, directory: str) -> tuple[list[dict], list[float]]:
    """The profiler's complete events ("X") over `steps` steps and each step's time (s)."""
    import jax

    times = []
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    path = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"], times


def trace_ops(step, steps: int, directory: str) -> tuple[dict[str, float], float]:
    """Microseconds per instruction (summed over `steps`) and the median step time (s)."""
    events, times = trace_events(step, steps, directory)
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        totals[e["name"]] += float(e.get("dur", 0.0))
    return totals, statistics.median(times)


# --------------------------------------------------------------------------- real_size.py's rows

_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(([^)]*)\)(.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4,
          "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# The model code an instruction was traced from, by the innermost function of its call
# chain that one of these names starts; the first match wins.
_MODEL_CODE = (("RMSNorm.", "RMSNorm"), ("apply_rope", "rotary embedding"),
               ("_upcast_after", "bf16 -> f32 weight upcasts"),
               ("narrow_matmul", "roundings to bf16 for bf16 matmuls"),
               ("_narrow_matmul", "roundings to bf16 for bf16 matmuls"),
               ("MLP.", "SwiGLU (SiLU, product)"),
               ("Attention.", "attention: mask, softmax, head layout"),
               ("LlamaBlock.", "residual adds"),
               ("jax_loss.<locals>.lm_loss", "cross-entropy (log-softmax, one-hot, mean)"),
               ("Llama.", "embedding lookup, final norm input, logits cast"))
SOURCES = list(dict.fromkeys(label for _, label in _MODEL_CODE)) + ["copies of step arguments",
                                                                      "other"]
ROLES = ["forward", "input gradient", "weight gradient", "attention (batched)"]


class Instr(collections.namedtuple("Instr", "op shape operands calls attrs")):
    """One HLO instruction: its opcode, result shape text, operand names, the
    computation it calls and the rest of its line (dimension numbers, metadata)."""

    def attr(self, key: str) -> str:
        m = re.search(key + r'=("[^"]*"|\{[^}]*\}|[^,\s]+)', self.attrs)
        return m.group(1).strip('"{}') if m else ""


def parse_hlo(text: str) -> tuple[dict[str, Instr], dict[str, list[str]], dict[int, list]]:
    """A compiled module's instructions by name, each computation's instruction names,
    and each stack frame's call chain (innermost first) as (file, function) pairs."""
    instrs, computations, current = {}, {}, None
    for line in text.splitlines():
        if line[:1] not in (" ", "") and line.rstrip().endswith("{"):
            current = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)", line).group(1)
            computations[current] = []
            continue
        m = _LINE.match(line)
        if m and current is not None:
            name, shape, op, args, rest = m.groups()
            calls = re.search(r"calls=%?([\w.\-]+)", rest)
            instrs[name] = Instr(op, shape, re.findall(r"%([\w.\-]+)", args),
                                 calls.group(1) if calls else None, rest)
            computations[current].append(name)

    def section(title: str) -> dict[int, str]:
        m = re.search(rf"^{title}\n((?:\d+ .*\n)+)", text, re.M)
        return dict((int(k), v) for k, v in (l.split(" ", 1) for l in m.group(1).splitlines())) \
            if m else {}

    files, funcs = section("FileNames"), section("FunctionNames")
    locations = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in
                 section("FileLocations").items()}
    frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in section("StackFrames").items()}
    chains = {}
    for i in frames:
        chain, j = [], i
        while j in frames and len(chain) < 100:
            loc = locations[int(frames[j]["file_location_id"])]
            chain.append((files[int(loc["file_name_id"])].strip('"'),
                          funcs[int(loc["function_name_id"])].strip('"')))
            j = int(frames[j]["parent_frame_id"]) - 1  # printed one above the id; 0: none
        chains[i] = chain
    return instrs, computations, chains


def _inside(name: str, instrs: dict, computations: dict, depth: int = 0) -> list[str]:
    """`name` and the instructions of the computations it calls."""
    out, called = [name], instrs[name].calls
    if called in computations and depth < 3:
        for inner in computations[called]:
            out += _inside(inner, instrs, computations, depth + 1)
    return out


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def _nbytes(shape: str) -> int:
    return sum(_BYTES.get(t, 4) * math.prod(dims) for t, dims in _arrays(shape))


def describe_instructions(text: str, tokens: int) -> dict[str, dict]:
    """Instruction name -> {"group", "source", "dots", "bytes"} for a compiled LLaMA step.

    "group" is hlo_groups' with "optimizer update" split off (instructions traced from
    optax or pockjax.optim); "source" is the model code a non-dot came from (`SOURCES`);
    "dots" are its dots as (signature, role, FLOPs); "bytes" what it reads and writes."""
    instrs, computations, chains = parse_hlo(text)
    params = {n for n, i in instrs.items() if i.op == "parameter"}
    out = {}
    for name, instr in instrs.items():
        inside = _inside(name, instrs, computations)
        frames = [int(instrs[n].attr("stack_frame_id")) for n in inside
                  if instrs[n].attr("stack_frame_id")]
        chain = chains.get(frames[0], []) if frames else []
        dots = []
        for n in inside:
            d = instrs[n]
            if d.op != "dot":
                continue
            (lt, ld), (rt, rd) = _arrays(instrs[d.operands[0]].shape)[0], \
                _arrays(instrs[d.operands[1]].shape)[0]
            (ot, od), = _arrays(d.shape)[:1]
            dims = tuple(tuple(int(x) for x in d.attr(k).split(",") if x) for k in
                         ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims",
                          "rhs_batch_dims"))
            contract = math.prod(ld[i] for i in dims[0])
            dot_chain = chains.get(int(d.attr("stack_frame_id") or 0), chain)
            backward = "transpose(" in (d.attr("op_name") or instr.attr("op_name")) or \
                any(fn.endswith("_bwd") for _, fn in dot_chain)
            role = ("attention (batched)" if dims[2] else "weight gradient" if backward and
                    contract == tokens else "input gradient" if backward else "forward")
            dots.append(((lt, ld, rt, rd, dims, ot), role, 2 * math.prod(od) * contract))
        files = [f for f, _ in chain]
        if any("/optax/" in f or "/pockjax/optim/" in f for f in files) and not dots:
            source = "optimizer update"
        elif instr.op == "copy" and set(instr.operands) <= params and instr.operands:
            source = "copies of step arguments"
        else:
            source = next((label for _, fn in chain for prefix, label in _MODEL_CODE
                           if fn.startswith(prefix)), "other")
        group = ("matmul" if dots else "optimizer update" if source == "optimizer update"
                 else _plain_group(name, instr.op))
        nbytes = _nbytes(instr.shape) + sum(_nbytes(instrs[o].shape) for o in instr.operands
                                            if o in instrs)
        out[name] = {"group": group, "source": source, "dots": dots, "bytes": nbytes}
    return out


def _dtype(hlo_type: str):
    import jax.numpy as jnp

    return {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}[hlo_type]


def time_dot(signature, budget: int = 768 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """Seconds per call of one dot alone, jitted: with its operands cycled through copies
    of about `budget` bytes (read from memory, as in the step), and on one pair (warm)."""
    import jax
    import jax.numpy as jnp

    from benchmarks.real_size_models import uniform_noise

    lt, ld, rt, rd, (lc, rc, lb, rb), ot = signature
    f = jax.jit(lambda a, b: jax.lax.dot_general(a, b, ((lc, rc), (lb, rb)),
                                                 preferred_element_type=_dtype(ot)))
    make = jax.jit(uniform_noise, static_argnums=(1, 2, 3))
    size = math.prod(ld) * _BYTES[lt] + math.prod(rd) * _BYTES[rt]
    pairs = [(make(jnp.uint32(2 * i + 1), ld, _dtype(lt), 1.0),
              make(jnp.uint32(2 * i + 2), rd, _dtype(rt), 1.0))
             for i in range(max(2, min(256, budget // size)))]

    def per_call(operands, calls):
        jax.block_until_ready(f(*operands[0]))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i in range(calls):
                y = f(*operands[i % len(operands)])
            jax.block_until_ready(y)
            times.append((time.perf_counter() - t0) / calls)
        return statistics.median(times)

    return per_call(pairs, max(len(pairs), 8)), per_call(pairs[:1], 8)


def triad_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes per second of a jitted `a + 0.5 * b` over `mib` MiB float32 arrays (two
    read, one written), `a` donated: in place, as the step's optimizer writes (a fresh
    output buffer would measure the page faults of its first touch instead)."""
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    a, b = jnp.ones((n,), jnp.float32), jnp.full((n,), 2.0, jnp.float32)
    f = jax.jit(lambda a, b: a + 0.5 * b, donate_argnums=0)
    a = jax.block_until_ready(f(a, b))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - t0)
    return 3 * n * 4 / statistics.median(times)


def time_optimizer(shapes, repeats: int = 5) -> float:
    """Seconds per AdamW update (real_size.py's) of parameters of these
    `jax.ShapeDtypeStruct`s, jitted alone, parameters and state donated (in place)."""
    import jax
    import jax.numpy as jnp
    import optax

    from benchmarks.real_size import LR, WEIGHT_DECAY

    opt = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
    params = [jnp.full(x.shape, 0.01, x.dtype) for x in shapes]
    grads = [jnp.full(x.shape, 1e-3, x.dtype) for x in shapes]

    def update(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    f = jax.jit(update, donate_argnums=(0, 1))
    state = [params, opt.init(params)]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        state = list(jax.block_until_ready(f(*state, grads)))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def op_spans(events: list[dict], names) -> list[tuple[str, float, float]]:
    """(name, start, stop) in microseconds of each executed operation among `names`. An
    operation that finishes asynchronously (XLA's Eigen dots) ends at its "end: <name>"
    event, not with its own event (which then only covers the launch)."""
    starts, stops = collections.defaultdict(list), collections.defaultdict(list)
    for e in events:
        if e["name"] in names:
            starts[e["name"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))))
        elif e["name"].startswith("end: ") and e["name"][5:] in names:
            stops[e["name"][5:]].append(float(e["ts"]))
    spans = []
    for name, runs in starts.items():
        ends = sorted(stops[name])
        for k, (t0, t1) in enumerate(sorted(runs)):
            spans.append((name, t0, max(t1, ends[k]) if k < len(ends) else t1))
    return spans


def _union(spans) -> float:
    """Microseconds during which at least one of the spans runs."""
    busy, end = 0.0, -math.inf
    for _, start, stop in sorted(spans, key=lambda s: s[1]):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profile_real_size(args, rows: list[str]) -> str:
    """Profiles real_size.py's rows at `args.preset`; the results file's text."""
    import gc

    import jax

    import pockjax as pj
    from benchmarks.common import peak_rss_mib
    from benchmarks.real_size import (PRESETS, build_params, describe as describe_size, jax_row,
                                      label, scheme_for)

    s = PRESETS[args.preset]
    tokens = s["seq"] * s["batch"]
    results, alone = {}, {}
    for row in rows:
        print(f"[{label(row, s)}] compiling, making weights ...", file=sys.stderr, flush=True)
        step, compiled, info = jax_row(row, s, args.limit_gib)
        for _ in range(args.warmup):
            step()
        described = describe_instructions(compiled.as_text(), tokens)
        print(f"[{label(row, s)}] profiling {args.steps} steps ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="pockjax-profile-") as d:
            events, times = trace_events(step, args.steps, d)
        del step, compiled
        gc.collect()
        spans = op_spans(events, described)
        ops, counts = collections.defaultdict(float), collections.Counter()
        for name, t0, t1 in spans:  # ms per step
            ops[name] += (t1 - t0) / args.steps / 1e3
            counts[name] += 1
        busy = _union(spans) / args.steps / 1e3
        # ms per step are means over the profiled steps, so they compare with the mean step
        results[row] = dict(ops=ops, busy=busy, counts=counts, described=described,
                            wall=statistics.mean(times), median=statistics.median(times),
                            info=info)
        for name in ops:
            for sig, _, _ in described[name]["dots"]:
                if sig not in alone:
                    lt, ld, rt, rd, _, _ = sig
                    print(f"  alone: {lt}{list(ld)} x {rt}{list(rd)}", file=sys.stderr, flush=True)
                    alone[sig] = time_dot(sig)
    optimizer = {}
    for row in rows:  # the trained leaves, from shapes (as jax_row builds them)
        _, abstract, scheme, _ = build_params(s, scheme_for(row, s))
        shapes = tuple(jax.tree.leaves(pj.trainable_view(abstract, scheme)))
        key = tuple((x.shape, str(x.dtype)) for x in shapes)
        if key not in optimizer:
            print(f"  alone: AdamW over {len(shapes)} tensors", file=sys.stderr, flush=True)
            optimizer[key] = time_optimizer(shapes)
        results[row]["optimizer_alone"] = optimizer[key]
    bandwidth = triad_bandwidth()
    torch_result = None
    if args.torch:
        print(f"[PyTorch full] profiling {args.steps} steps ...", file=sys.stderr, flush=True)
        torch_result = profile_torch(s, args.steps, args.warmup)
    return _real_size_report(args, s, rows, results, alone, bandwidth, peak_rss_mib(),
                             describe_size(args.preset, s), label, torch_result)


# PyTorch's operators by the groups of the XLA tables, from their names (first match):
# an "aten::" key is a name prefix, any other a substring. Times are each operator's own
# (self) time, so a composite (aten::linear, aten::matmul) counts nothing itself.
TORCH_GROUPS = (
    ("attention kernel (SDPA)", ("scaled_dot_product", "flash_attention")),
    ("optimizer update", ("adam", "_foreach_")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")),
    ("copy/transpose", ("aten::copy_", "aten::clone", "aten::cat", "aten::_to_copy",
                        "aten::stack", "aten::contiguous")),
    ("elementwise/reduce", ("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::neg",
                            "aten::pow", "aten::rsqrt", "aten::sqrt", "aten::mean",
                            "aten::sum", "aten::silu", "aten::exp", "aten::log", "softmax",
                            "nll_loss", "aten::sigmoid", "aten::cos", "aten::sin",
                            "aten::where", "aten::masked_fill", "aten::lerp")),
)


def torch_group(name: str) -> str:
    """The group of a PyTorch operator (`TORCH_GROUPS`), "other" where none matches."""
    for group, keys in TORCH_GROUPS:
        if any(name.startswith(k) if k.startswith("aten::") else k in name for k in keys):
            return group
    return "other"


def profile_torch(s: dict, steps: int, warmup: int) -> dict:
    """transformers' `LlamaForCausalLM` of shape `s` (float32, every weight, fused AdamW:
    real_size.py's `torch full fused-adamw` row) under `torch.profiler`: ms per step of
    each operator's own time, summed per operator, and the step's wall times."""
    import torch
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.real_size import LR, WEIGHT_DECAY, torch_config, torch_step

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    net = transformers.LlamaForCausalLM._from_config(torch_config(s), torch_dtype=torch.float32)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    step = torch_step(net, opt, torch.from_numpy(make_batch("llama", s)).long())
    for _ in range(warmup):
        step()
    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    ops = {e.key: e.self_cpu_time_total / steps / 1e3 for e in prof.key_averages()
           if e.self_cpu_time_total > 0}
    return dict(ops=ops, wall=statistics.mean(times), median=statistics.median(times),
                attention=net.config._attn_implementation)


def _dot_text(sig) -> str:
    lt, ld, rt, rd, (lc, rc, lb, rb), ot = sig
    batch = f", batch {list(lb)}x{list(rb)}" if lb else ""
    return f"{lt}{list(ld)} . {rt}{list(rd)} over {list(lc)}x{list(rc)}{batch} -> {ot}"


def _real_size_report(args, s, rows, results, alone, bandwidth, peak_mib, title, label,
                      torch_result=None) -> str:
    names = [label(r, s) for r in rows]
    groups = ["matmul", "optimizer update", "elementwise/reduce", "copy/transpose", "other"]
    if torch_result is not None:
        groups.insert(1, "attention kernel (SDPA)")
    pct = lambda ms, r: f"{ms:.0f} ms ({100 * ms / (r['wall'] * 1e3):.0f}%)"
    lines = [f"# Where the step's time goes at real size: {title}", "",
             f"XLA CPU, {os.cpu_count()} cores. {versions(('jax', 'jaxlib', 'flax', 'optax'))}. "
             f"Commit {commit()}. Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
             f"`python -m benchmarks profile --workload llama --preset {args.preset} --rows "
             f"\"{','.join(rows)}\"`, the rows built by `real_size.py`'s `jax_row`, in one "
             f"process (peak RSS {peak_mib / 1024:.1f} GiB). {args.steps} profiled steps after "
             f"{args.warmup} warm-up steps, from `jax.profiler` events, one per executed HLO "
             f"instruction; an instruction that finishes asynchronously (XLA's Eigen dots) "
             f"lasts until its `end:` event.", "",
             "Times are ms per step (means over the profiled steps) of each operation's own "
             "duration, percentages of the mean step's wall time. XLA runs independent "
             "operations side by side on the 2 cores and an Eigen dot runs on its own thread "
             "pool beside the others, so operations share the cores: a duration is an upper "
             "bound of the operation's cost, and the groups add up to more than the wall time "
             "(the last rows say by how much). The matmul tables below therefore also add up "
             "each dot's time alone.", "",
             "| group | " + " | ".join(names) + (" | PyTorch full (torch.profiler) |"
                                                   if torch_result else " |"),
             "|---|" + "---:|" * (len(rows) + bool(torch_result))]
    t = torch_result
    for g in groups + ["all operations", "some operation running", "wall time (mean)",
                       "wall time (median)"]:
        cells = []
        if t is not None:
            if g.startswith("wall time"):
                torch_cell = f"{t['wall' if 'mean' in g else 'median'] * 1e3:.0f} ms"
            elif g == "some operation running":
                torch_cell = "-"
            else:
                torch_cell = pct(sum(v for k, v in t["ops"].items()
                                     if g == "all operations" or torch_group(k) == g), t)
        for row in rows:
            r = results[row]
            if g.startswith("wall time"):
                cells.append(f"{r['wall' if 'mean' in g else 'median'] * 1e3:.0f} ms")
            elif g == "some operation running":
                cells.append(pct(r["busy"], r))
            elif g == "all operations":
                total = sum(r["ops"].values())
                cells.append(f"{pct(total, r)}, {total / r['busy']:.1f} at once on average")
            else:
                cells.append(pct(sum(v for k, v in r["ops"].items()
                                     if r["described"][k]["group"] == g), r))
        if t is not None:
            cells.append(torch_cell)
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    if t is not None:
        lines += ["", f"PyTorch full: transformers' `LlamaForCausalLM` of the same shape "
                  f"(float32, attention `{t['attention']}`, fused AdamW, every weight), "
                  f"the same steps under `torch.profiler`; each operator's own time (self "
                  f"CPU time), grouped by name (`profile_step.TORCH_GROUPS`). Its attention "
                  f"is one kernel (matmuls and softmax), which XLA's rows count under matmul "
                  f"and elementwise. Slowest operators:", ""]
        for k, ms in sorted(t["ops"].items(), key=lambda kv: -kv[1])[:args.top]:
            lines.append(f"- `{k}` ({torch_group(k)}): {ms:.1f} ms")
    lines += ["", "## Matmuls by role", "",
              "Role from the HLO: a dot with batch dimensions is attention's; a dot traced in "
              "the backward pass (`transpose(...)` in its name, or a custom VJP's `_bwd`) is a "
              f"weight gradient when it contracts over the {s['seq'] * s['batch']} tokens, else "
              "an input gradient. The last column adds up each dot's time alone (cold, below).",
              "", "| row | role | dots per step | GFLOP per step | ms per step | GFLOP/s in step "
              "| ms if each ran as fast as alone |", "|---|---|---:|---:|---:|---:|---:|"]
    for row, name in zip(rows, names):
        r = results[row]
        for role in ROLES + ["all"]:
            n = flop = ms = ideal = 0
            for k, v in r["ops"].items():
                dots = r["described"][k]["dots"]
                for sig, rl, f in dots:
                    if role in (rl, "all"):
                        calls = r["counts"][k] / args.steps
                        n, flop, ms = n + calls, flop + f * calls, ms + v / len(dots)
                        ideal += alone[sig][0] * 1e3 * calls
            if n:
                lines.append(f"| {name} | {'**all**' if role == 'all' else role} | {n:.0f} | "
                             f"{flop / 1e9:.1f} | {ms:.0f} | {flop / 1e6 / ms:.0f} | "
                             f"{ideal:.0f} |")
    lines += ["", "## Every distinct dot: in the step against alone", "",
              "Alone: the dot jitted by itself with the same operand shapes, dtypes and "
              "dimension numbers (default layouts), median of 3, both cores; cold: operands "
              "cycled through copies of about 768 MiB, so they come from memory as the step's "
              "weights do; warm: one pair repeated (in cache). In the step: its own duration "
              "per call (possibly sharing the cores).", "",
              "| row | role | dot | per step | ms/call in step | GFLOP/s in step "
              "| alone cold GFLOP/s | alone warm GFLOP/s | in step / alone cold |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for row, name in zip(rows, names):
        r = results[row]
        per_sig = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
        for k, v in r["ops"].items():
            dots = r["described"][k]["dots"]
            for sig, role, f in dots:
                entry = per_sig[(role, sig)]
                entry[0] += r["counts"][k] / args.steps
                entry[1] += v / len(dots)
                entry[2] = f
        for (role, sig), (calls, ms, f) in sorted(per_sig.items(), key=lambda kv: -kv[1][1]):
            cold, warm = alone[sig]
            lines.append(f"| {name} | {role} | `{_dot_text(sig)}` | {calls:.0f} | "
                         f"{ms / calls:.2f} | {f / 1e6 / (ms / calls):.0f} | "
                         f"{f / 1e9 / cold:.0f} | {f / 1e9 / warm:.0f} | "
                         f"{(ms / calls) / (cold * 1e3):.2f} |")
    lines += ["", "## Time outside matmuls by model code", "",
              "Each non-dot instruction by the innermost model function in its source "
              "metadata (fused instructions: the first fused operation that has one); ms per "
              "step and % of the wall time.", "",
              "| source | " + " | ".join(names) + " |", "|---|" + "---:|" * len(rows)]
    for source in ["optimizer update"] + SOURCES:
        ms = [sum(v for k, v in results[row]["ops"].items() if not
                  results[row]["described"][k]["dots"] and
                  results[row]["described"][k]["source"] == source) for row in rows]
        if any(m >= 0.05 for m in ms):
            lines.append(f"| {source} | " + " | ".join(
                f"{m:.1f} ms ({100 * m / (results[row]['wall'] * 1e3):.1f}%)"
                for m, row in zip(ms, rows)) + " |")
    lines += ["", "## The optimizer's memory traffic", "",
              f"Bytes the optimizer's instructions read and write (their operands and results "
              f"in the HLO), against their durations in the step and the same AdamW update "
              f"jitted alone (parameters and state donated, median of 5); beside a jitted "
              f"in-place `a + 0.5 * b` over 256 MiB float32 arrays: {bandwidth / 1e9:.1f} GB/s "
              f"on this machine.", "",
              "| row | trained parameters | instructions per step | GB per step | bytes per "
              "trained parameter | ms per step in step | GB/s in step | ms alone | GB/s alone "
              "| of the triad's |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row, name in zip(rows, names):
        r = results[row]
        opt = [k for k in r["ops"] if r["described"][k]["group"] == "optimizer update"]
        gb = sum(r["described"][k]["bytes"] * r["counts"][k] for k in opt) / args.steps / 1e9
        ms = sum(r["ops"][k] for k in opt)
        lines.append(f"| {name} | {r['info']['trained_params']:,} | "
                     f"{sum(r['counts'][k] for k in opt) / args.steps:.0f} | {gb:.2f} | "
                     f"{gb * 1e9 / r['info']['trained_params']:.0f} | {ms:.0f} | "
                     f"{gb / ms * 1e3:.1f} | {r['optimizer_alone'] * 1e3:.0f} | "
                     f"{gb / r['optimizer_alone']:.1f} | "
                     f"{100 * gb * 1e9 / r['optimizer_alone'] / bandwidth:.0f}% |")
    for row, name in zip(rows, names):
        r = results[row]
        lines += ["", f"Slowest instructions, {name}:", ""]
        for k, ms in sorted(r["ops"].items(), key=lambda kv: -kv[1])[:args.top]:
            d = r["described"][k]
            what = ", ".join(sorted({f"{role} {_dot_text(sig)}" for sig, role, _ in d["dots"]})) \
                or d["source"]
            lines.append(f"- `{k}` ({d['group']}; {what}): {ms:.1f} ms")
    return "\n".join(lines) + "\n"


GROUPS = ["depthwise conv", "conv", "matmul", "elementwise/reduce", "copy/transpose", "other"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mobilenetv2", choices=["llama", "mobilenetv2"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", help="size overrides, as paper_table's --llama / --mobilenetv2")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--top", type=int, default=8, help="slowest instructions listed per row")
    ap.add_argument("--out")
    ap.add_argument("--preset", help="profile real_size.py's rows at this shape of its "
                                     "(tinyllama-1.1b, llama2-7b, smoke); LLaMA only")
    ap.add_argument("--torch", action="store_true",
                    help="with --preset: profile PyTorch's full fine-tuning step of the same "
                         "shape too (torch.profiler), a column beside the XLA rows")
    ap.add_argument("--limit-gib", type=float, default=20.0,
                    help="with --preset: refuse a step whose compiled memory exceeds this")
    args = ap.parse_args(argv)
    if args.preset:
        return main_real_size(ap, args)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS + EXTRA_ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; choose from {ROWS + EXTRA_ROWS}")
    s = sizes(args.workload, args.quick, args.size)
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"profile_{args.workload}.md")

    results = {}
    for row in rows:
        print(f"[{row}] compiling and profiling ...", file=sys.stderr, flush=True)
        import jax
        import jax.numpy as jnp

        batch = jax.tree.map(jnp.asarray, make_batch(args.workload, s))
        step, compiled, _, _ = jax_step(args.workload, row, make_model(args.workload, s), batch)
        compiled = compiled()
        for _ in range(args.warmup):
            step()
        groups = hlo_groups(compiled.as_text())
        with tempfile.TemporaryDirectory(prefix="pockjax-profile-") as d:
            totals, wall = trace_ops(step, args.steps, d)
        ops = {k: v for k, v in totals.items() if k in groups}
        results[row] = (ops, groups, wall)

    lines = [f"# Where the step's time goes: {describe(args.workload, s)}", "",
             f"XLA CPU, {os.cpu_count()} cores. {versions(('jax', 'jaxlib', 'flax', 'optax'))}. "
             f"Commit {commit()}. {args.steps} profiled steps after {args.warmup} warm-up steps; "
             f"ms per step from `jax.profiler` events, one per executed HLO instruction.", "",
             "| group | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for g in GROUPS + ["all operations", "wall time (median)"]:
        cells = []
        for row in rows:
            ops, groups, wall = results[row]
            per_step = lambda us: us / args.steps / 1e3
            total = per_step(sum(ops.values()))
            if g == "wall time (median)":
                cells.append(f"{wall * 1e3:.1f} ms")
            elif g == "all operations":
                cells.append(f"{total:.1f} ms")
            else:
                ms = per_step(sum(v for k, v in ops.items() if groups[k] == g))
                cells.append(f"{ms:.1f} ms ({100 * ms / max(total, 1e-9):.0f}%)")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += ["", "Shares are of the summed operation time. XLA runs independent operations "
              "at the same time on the cores, so the sum can exceed the wall time; where it is "
              "below, the rest is dispatch and waiting."]
    for row in rows:
        ops, groups, _ = results[row]
        lines += ["", f"Slowest instructions, {row}:", ""]
        for name, us in sorted(ops.items(), key=lambda kv: -kv[1])[:args.top]:
            lines.append(f"- `{name}` ({groups[name]}): {us / args.steps / 1e3:.2f} ms")
    text = "\n".join(lines) + "\n"
    print(text)
    from pockjax.checkpoint import write_atomic

    write_atomic(out, text.encode())
    print(f"written to {out}", file=sys.stderr)


def main_real_size(ap, args):
    from benchmarks.real_size import IREE_ROWS, PRESETS, ROWS as SIZE_ROWS, label

    if args.workload != "llama" or args.preset not in PRESETS:
        ap.error(f"--preset takes --workload llama and one of {list(PRESETS)}")
    s = PRESETS[args.preset]
    known = {label(r, s): r for r in SIZE_ROWS
             if r.startswith(("pockjax", "jax+optax")) and r not in IREE_ROWS}
    known.update({r: r for r in known.values()})
    given = args.rows if args.rows != ",".join(ROWS) else \
        "pockjax sparse last-k f32,pockjax sparse last-k bf16-frozen bf16-matmul"
    rows = [r.strip() for r in given.split(",") if r.strip()]
    unknown = [r for r in rows if r not in known]
    if unknown:
        ap.error(f"unknown rows {unknown} for --preset; choose from {sorted(set(known))}")
    text = profile_real_size(args, [known[r] for r in rows])
    print(text)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"profile_llama_{args.preset.split('-')[-1]}.md")
    from pockjax.checkpoint import write_atomic

    write_atomic(out, text.encode())
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
