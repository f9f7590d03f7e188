"""Memory of loading a Hugging Face folder for fine-tuning with low-bit frozen weights:
each frozen weight stored in its format as it is read, against the model read whole in
bfloat16 and quantized afterwards.

    python -m benchmarks lowbit_load [--llama tinyllama-1.1b] [--frozen-dtype int4]
        [--scheme paper:2] [--rounds 1] [--out FILE]

Writes a model of a `real_size.py` shape with random weights (normal, std 0.02) as a
bfloat16 safetensors folder, sharded at 2 GiB (kept under `.cache/lowbit-load/`), then
loads it for `finetune(frozen_dtype=...)` with the given scheme, each row in its own
process:

- `stored while read`: `pockjax.finetuning.load_model(folder, frozen_dtype=...,
  scheme_of=...)`, what `finetune` does for any scheme chosen without the weights;
- `read whole, then quantized`: `load_model(folder, frozen_dtype=...)` (the model in
  bfloat16), then `cast_frozen` and `pockjax.lowbit.quantize`, what `finetune` does for
  `search:` schemes (and did for all before).

Reported per row: peak RSS, the parameters' stored bytes, the seconds, and a SHA-256 of
every stored array (the two rows must store the same bytes). Results: `--out` (default
`benchmarks/results/lowbit_load_<preset>.md`) and its `.json`.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import (ROOT, commit, peak_rss_mib, report_result, rss_mib,  # noqa: E402
                               run_row, versions)
from benchmarks.real_size_models import PRESETS, llama_config  # noqa: E402

ROWS = ("stored while read", "read whole, then quantized")
SHARD_BYTES = 2 << 30


def write_folder(preset: str, folder: Path) -> Path:
    """The preset's model as a bfloat16 Hugging Face folder at `folder` (kept when its
    config is already there)."""
    import ml_dtypes
    import numpy as np

    from pockjax.checkpoint import write_atomic, write_safetensors
    from pockjax.models.hf import CONFIG, INDEX, checkpoint_tensors

    if (folder / CONFIG).is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = llama_config(PRESETS[preset])
    rng = np.random.default_rng(0)
    shard, size, weight_map, total, files = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, size, files
        files += 1
        name = f"model-{files:05d}.safetensors"
        write_safetensors(folder / name, [(n, a.shape, a.dtype, lambda a=a: a)
                                          for n, a in shard.items()], {"format": "pt"})
        weight_map.update({tensor: name for tensor in shard})
        shard, size = {}, 0

    for name, shape in checkpoint_tensors(config).items():
        if name.endswith("norm.weight"):
            value = np.ones(shape, np.float32)
        else:
            value = rng.standard_normal(shape, np.float32) * 0.02
        value = value.astype(ml_dtypes.bfloat16)
        if shard and size + value.nbytes > SHARD_BYTES:
            flush()
        shard[name] = value
        size += value.nbytes
        total += value.nbytes
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_atomic(folder / INDEX, (json.dumps(index, indent=2) + "\n").encode())
    write_atomic(folder / CONFIG, (json.dumps(config.to_hf(), indent=2) + "\n").encode())
    return folder


def _digest(params) -> str:
    import jax
    import numpy as np

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        a = np.asarray(leaf)
        h.update(str((a.shape, a.dtype)).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def row(args) -> dict:
    """One row, in this process."""
    import jax  # noqa: F401  (imports counted in the baseline)
    import jax.numpy as jnp

    import pockjax  # noqa: F401
    from pockjax import lowbit
    from pockjax.finetuning import frozen_formats, load_model, scheme_from_spec
    from pockjax.models.llama import cast_frozen

    rss_imports = rss_mib()
    t0 = time.perf_counter()
    if args.row == ROWS[0]:
        loaded = load_model(args.folder, frozen_dtype=args.frozen_dtype,
                            scheme_of=lambda shapes, n: scheme_from_spec(args.scheme, shapes, n))
        params = loaded.params
    else:
        loaded = load_model(args.folder, frozen_dtype=args.frozen_dtype)
        scheme = scheme_from_spec(args.scheme, loaded.params, loaded.num_layers)
        params = cast_frozen(loaded.params, scheme, native=True)  # plain bfloat16, then:
        params = lowbit.quantize(params, scheme, frozen_formats(args.frozen_dtype),
                                 dtype=jnp.float32)
    del loaded
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "stored_bytes": lowbit.stored_bytes(params),
            "digest": _digest(params), "rss_imports_mib": rss_imports,
            "rss_after_mib": rss_mib(), "peak_mib": peak_rss_mib()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama", default="tinyllama-1.1b", choices=list(PRESETS))
    ap.add_argument("--frozen-dtype", default="int4")
    ap.add_argument("--scheme", default="paper:2", help="a finetune --scheme (default paper:2)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out")
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.row:
        report_result(row(args))
        return
    folder = write_folder(args.llama, Path(ROOT) / ".cache" / "lowbit-load" / args.llama)
    on_disk = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    results: dict = {}
    for r in range(args.rounds):
        for name in (ROWS if r % 2 == 0 else ROWS[::-1]):
            res = run_row([os.path.abspath(__file__), "--row", name, "--folder", str(folder),
                           "--frozen-dtype", args.frozen_dtype, "--scheme", args.scheme],
                          args.timeout)
            results.setdefault(name, []).append(res)
            print(f"round {r + 1} {name}: " + (res.get("error") or
                  f"peak {res['rss_peak_mib'] / 1024:.2f} GiB, {res['seconds']:.1f} s, "
                  f"stored {res['stored_bytes'] / 2**30:.2f} GiB"), file=sys.stderr, flush=True)
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   f"lowbit_load_{args.llama}.md")
    write(out, args, on_disk, results)


def write(out: str, args, on_disk: int, results: dict) -> None:
    from pockjax.checkpoint import write_atomic

    s = PRESETS[args.llama]
    ok = {n: [r for r in rs if "error" not in r] for n, rs in results.items()}
    digests = {r["digest"] for rs in ok.values() for r in rs}
    lines = [f"# Loading {args.llama}'s shape for fine-tuning with {args.frozen_dtype} frozen "
             f"weights", "",
             f"`python -m benchmarks lowbit_load --llama {args.llama} --frozen-dtype "
             f"{args.frozen_dtype} --scheme {args.scheme} --rounds {args.rounds}` (commit "
             f"{commit()}); {platform.machine()}, {os.cpu_count()} cores; "
             f"{versions(('jax', 'flax', 'safetensors'))}.", "",
             f"{args.llama}: {s['layers']} layers, hidden {s['hidden']}, MLP "
             f"{s['intermediate']}, {s['heads']} heads ({s['kv_heads']} key/value), vocabulary "
             f"{s['vocab']}; scheme `{args.scheme}`. The folder: random weights in bfloat16, "
             f"{on_disk / 2**30:.2f} GiB of safetensors. Each row its own process; medians "
             f"over rounds.", "",
             "| row | peak RSS GiB | after loading GiB | imports GiB | stored GiB | seconds | "
             "stored arrays' SHA-256 |", "|---|---:|---:|---:|---:|---:|---|"]
    for name in ROWS:
        rs = ok.get(name) or []
        if not rs:
            err = (results.get(name) or [{"error": "not run"}])[0].get("error")
            lines.append(f"| {name} | {err} | | | | | |")
            continue
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        lines.append(f"| {name} | {med('rss_peak_mib') / 1024:.2f} | "
                     f"{med('rss_after_mib') / 1024:.2f} | {med('rss_imports_mib') / 1024:.2f} | "
                     f"{med('stored_bytes') / 2**30:.2f} | {med('seconds'):.1f} | "
                     f"`{rs[0]['digest']}` |")
    lines += ["", "Both rows store the same bytes: " +
              ("yes." if len(digests) == 1 else f"NO ({len(digests)} digests).")]
    text = "\n".join(lines) + "\n"
    write_atomic(out, text.encode())
    write_atomic(os.path.splitext(out)[0] + ".json",
                 (json.dumps({"args": {k: v for k, v in vars(args).items()},
                              "on_disk_bytes": on_disk, "results": results}, indent=1)
                  + "\n").encode())
    print(text)


if __name__ == "__main__":
    main()
