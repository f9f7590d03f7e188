"""Sparse training on several devices: data-parallel and FSDP-style, against one device.

The tiny LLaMA of the other examples (4 blocks, 128 wide) is instruction-tuned with
PockEngine's transformer scheme on the last 2 blocks, where the kernels' output
channels train at ratio 1/2, plus the output head. It runs three times on the same
batches:

- on one device;
- data-parallel over a mesh of N devices: the batch is split, the parameters are
  replicated and the trainable slices' gradients are all-reduced;
- FSDP-style: the parameters and optimizer state are split too. Each weight is
  gathered when the step reads it.

On a CPU-only machine the N devices are host CPU devices (`jax_num_cpu_devices`);
where JAX sees accelerators it uses those. The script prints the losses, the largest
difference from the one-device parameters (and stops if it is over 1e-5), and each
step's compiled memory per device and collective traffic (`trainer.report`).

    python examples/data_parallel.py [--devices 4] [--steps 20] [--batch 16]
"""
import argparse

import jax

import tiny_lm as data
from reporting import print_table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    # Before JAX starts its CPU backend; only takes effect on the host platform.
    jax.config.update("jax_num_cpu_devices", args.devices)

    import numpy as np
    import optax
    from flax import nnx

    import pockjax as pj
    from pockjax.models import Llama
    from pockjax import format_bytes

    devices = jax.devices()[:args.devices]
    if len(devices) < args.devices:
        raise SystemExit(f"asked for {args.devices} devices, JAX sees {len(jax.devices())}: "
                         f"{jax.devices()}")
    if args.batch % args.devices:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --devices {args.devices}")
    mesh = jax.make_mesh((args.devices,), ("data",), devices=devices)

    tokens, mask = data.pack_pairs(data.instructions(512), data.LENGTH)
    stream = data.batches(tokens, mask, args.batch)
    batches = [next(stream) for _ in range(args.steps)]

    def trainer(**mesh_kwargs):
        model = Llama(data.config(), rngs=nnx.Rngs(0))
        scheme = pj.schemes.transformer(model, last=2, ratio=0.5, extra=["lm_head/**"])
        return pj.nnx.Trainer(model, data.lm_loss, optimizer=optax.adamw(2e-3), scheme=scheme,
                              **mesh_kwargs)

    runs = {"one device": trainer(),
            f"data-parallel x{args.devices}": trainer(mesh=mesh),
            f"FSDP x{args.devices}": trainer(mesh=mesh, param_axis="data")}
    losses, reports = {}, {}
    for name, t in runs.items():
        reports[name] = t.report(batches[0])
        losses[name] = np.asarray([float(t(b)["loss"]) for b in batches])
        print(f"{name}: loss {losses[name][0]:.4f} -> {losses[name][-1]:.4f}")

    ref = jax.tree_util.tree_leaves(jax.device_get(runs["one device"].params()))
    rows = []
    for name, t in runs.items():
        got = jax.tree_util.tree_leaves(jax.device_get(t.params()))
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(got, ref))
        if diff > 1e-5:  # parameters are O(0.1-1); float32 reduction order differs
            raise SystemExit(f"{name}: parameters differ from the one-device run by {diff:.2e}")
        r = reports[name]
        ops = r.collective_bytes()
        rows.append({
            "run": name,
            "final loss": f"{losses[name][-1]:.5f}",
            "max |param - one device|": f"{diff:.1e}",
            "peak memory / device": format_bytes(r.memory["peak"]),
            "arguments / device": format_bytes(r.memory["argument"]),
            "all-reduce": format_bytes(ops.get("all-reduce", 0)),
            "all-gather": format_bytes(ops.get("all-gather", 0)),
        })
    print()
    print_table(rows)
    print(f"\nFSDP step, per device:\n{reports[f'FSDP x{args.devices}']}")


if __name__ == "__main__":
    main()
