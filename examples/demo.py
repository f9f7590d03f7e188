"""pockjax's headline flow: sparse fine-tuning of a tiny LLaMA, exported to IREE and run there.

1. Load a tiny LLaMA from a Hugging Face-layout checkpoint: the one shipped in
   `examples/checkpoints/tiny-llama` (pretrained 600 steps on generated text by
   `python examples/tiny_lm.py`), another folder (`--pretrained DIR`), or one pretrained
   here for `--pretrain-steps N` other than 600 (cached in OUT).
2. Instruction-tune it with PockEngine's transformer scheme (attention and the MLP's
   gate/up projections of the last 3 blocks, plus the output head), with a progress bar,
   and print the step's report (FLOPs and compiled memory against full training).
3. Export the training step for `android-vulkan` and `host-cpu`.
4. Run the host-cpu artifact (and the android-vulkan one, where this machine has a
   Vulkan driver: Mesa's lavapipe, from `make system-deps`, counts) for a few more steps
   from the tuned state, side by side with the JAX trainer on the same batches: the
   losses continue the same curve and the parameters agree. What could not run here is
   named at the end, with how to get it.
5. Write the loss curve to `OUT/demo_loss.png`.

    python examples/demo.py [--steps 150] [--artifact-steps 5] [--out out/demo] [--fast]
"""
import argparse
import os
import time

import jax
import numpy as np
import optax

import pockjax as pj
import tiny_lm as data
from pockjax.models.hf import load_llama
from pockjax.models.llama import num_params
from reporting import figure, save_figure

BATCH = 32


# What the android-vulkan artifact needs here, and where `make system-deps` gets it.
NO_VULKAN = ("the android-vulkan artifact was compiled but not run: this machine has no "
             "Vulkan driver ({reason}). `make system-deps` (as root, Debian/Ubuntu) installs "
             "mesa-vulkan-drivers, whose lavapipe is a Vulkan driver that runs on the CPU, "
             "with QEMU and the aarch64 libraries for android-arm64 artifacts; then run "
             "`make demo` again")


def vulkan_device() -> tuple[str | None, str]:
    """The name of this machine's Vulkan device (None where there is none) and why not."""
    try:
        from pockjax.export import vulkan
        return vulkan.device_caps().name, ""
    except Exception as e:  # no driver, no device, or no IREE Vulkan support
        return None, str(e).split(";")[0]


def open_sessions(paths: dict[str, str]):
    """Runtime sessions of the artifacts that can run here, the Vulkan device's name (or
    None) and a note for each artifact that cannot run, saying how to get what it needs."""
    sessions = {"host-cpu": pj.runtime.load(paths["host-cpu"], device="local-task")}
    device, reason = vulkan_device()
    skipped = []
    if device:
        sessions["android-vulkan"] = pj.runtime.load(paths["android-vulkan"], device="vulkan")
    else:
        skipped.append(NO_VULKAN.format(reason=reason))
        print(f"skipping: {skipped[-1]}", flush=True)
    return sessions, device, skipped


def stage(text: str) -> None:
    """A heading for each step of the demo, so a long one is never silent."""
    print(f"\n== {text}", flush=True)


def max_relative_difference(a, b) -> float:
    return max(float(np.max(np.abs(x - np.asarray(y))) / (np.max(np.abs(np.asarray(y))) + 1e-12))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrained", help="a Hugging Face-layout LLaMA checkpoint directory")
    ap.add_argument("--pretrain-steps", type=int, default=data.SHIPPED_STEPS,
                    help="pretraining steps; 600 loads the shipped checkpoint, other counts "
                         "pretrain here (cached in --out)")
    ap.add_argument("--steps", type=int, default=150, help="sparse fine-tuning steps")
    ap.add_argument("--artifact-steps", type=int, default=5)
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--fast", action="store_true",
                    help="a quick run for tests: 20 fine-tuning steps, 3 in the artifacts")
    args = ap.parse_args(argv)
    if args.fast:
        args.steps, args.artifact_steps = 20, 3
    os.makedirs(args.out, exist_ok=True)

    # 1. The model, from a checkpoint in Hugging Face's layout.
    if args.pretrained or args.pretrain_steps == data.SHIPPED_STEPS:
        stage("1/5 loading a tiny LLaMA pretrained on generated text")
    else:
        stage(f"1/5 a tiny LLaMA pretrained {args.pretrain_steps} steps on generated text "
              "(cached after the first run; the bar starts once JAX has compiled the step, "
              "under a minute)")
    path = args.pretrained or data.pretrained(args.out, args.pretrain_steps)
    model = load_llama(path)
    print(f"loaded {path}: {model.config.num_layers} blocks, hidden {model.config.hidden_size}, "
          f"{num_params(model.config):,} parameters")

    # 2. Sparse instruction tuning.
    train, _ = data.split_heldout(data.instructions(20_000))
    tokens, mask = data.pack_pairs(train, data.LENGTH)
    batches = data.batches(tokens, mask, BATCH, seed=2)
    scheme = pj.schemes.transformer(model, last=3, extra=["lm_head/**"])
    trainer = pj.nnx.Trainer(model, data.lm_loss, optimizer=optax.adam(1e-3), scheme=scheme)
    first = next(batches)
    stage("2/5 sparse instruction tuning with PockEngine's transformer scheme (last 3 blocks' "
          "attention and gate/up projections, and the head)")
    print("compiling the sparse and the full step for their report...", flush=True)
    print(trainer.report(first), "\n", flush=True)
    history = trainer.fit(batches, args.steps, desc="sparse fine-tune")
    print(f"loss {history.loss[:5].mean():.3f} -> {history.loss[-5:].mean():.3f} in "
          f"{history.steps} steps ({history.steps_per_second:.1f} steps/s)")

    # 3. Export the step from the tuned state.
    stage("3/5 exporting the training step through StableHLO to IREE (IREE compiles each "
          "target: seconds here, longer for larger models)")
    artifacts = {}
    for target in ("android-vulkan", "host-cpu"):
        print(f"compiling for {target}...", flush=True)
        start = time.perf_counter()
        art = trainer.export(first, target=target, out_dir=os.path.join(args.out, target),
                             progress=True)
        files = ", ".join(f"{k} {v['bytes'] / 1024:.0f} KiB" for k, v in art.manifest["files"].items())
        print(f"exported {target} in {time.perf_counter() - start:.1f} s: {art.path} ({files})")
        artifacts[target] = art

    # 4. Keep training in the artifacts and in JAX on the same batches.
    sessions, device, skipped = open_sessions({t: a.path for t, a in artifacts.items()})
    stage(f"4/5 {args.artifact_steps} more steps in the {' and '.join(sessions)} "
          f"artifact{'s' if len(sessions) > 1 else ''} and in JAX, on the same batches")
    more = [next(batches) for _ in range(args.artifact_steps)]
    jax_loss, art_loss = [], {name: [] for name in sessions}
    for batch in more:
        for name, sess in sessions.items():
            art_loss[name].append(float(sess.step(batch)["loss"]))
        jax_loss.append(float(trainer(batch)["loss"]))
    print(f"\n{'step':>5}  {'JAX':>9}  " + "  ".join(f"{n:>14}" for n in sessions))
    for i in range(len(more)):
        print(f"{history.steps + i + 1:>5}  {jax_loss[i]:9.5f}  "
              + "  ".join(f"{art_loss[n][i]:14.5f}" for n in sessions))
    for name, sess in sessions.items():
        err = max_relative_difference(sess.params(), trainer.params())
        where = f" on {device}" if name == "android-vulkan" else ""
        print(f"{name}{where}: max relative parameter difference to JAX after "
              f"{len(more)} steps: {err:.1e}")
        assert err < 1e-3, f"the {name} artifact does not match the JAX trainer"
        np.testing.assert_allclose(art_loss[name], jax_loss, rtol=1e-3)

    stage("5/5 the loss curve")
    png = os.path.join(args.out, "demo_loss.png")
    plot(history.loss, jax_loss, art_loss, png)
    print(f"loss curve: {png}")
    for note in skipped:
        print(f"\nNOT RUN: {note}", flush=True)
    return {"history": history, "jax": jax_loss, "artifacts": art_loss, "skipped": skipped}


def plot(history, jax_loss, art_loss, path: str) -> None:
    fig, ax = figure()
    n = len(history)
    ax.plot(np.arange(1, n + 1), history, color="0.6", label="JAX (pockjax), fine-tuning")
    steps = np.arange(n + 1, n + len(jax_loss) + 1)
    ax.plot(steps, jax_loss, "o-", color="k", label="JAX, continued")
    for (name, loss), marker in zip(art_loss.items(), "x+"):
        ax.plot(steps, loss, marker, markersize=9, label=f"IREE {name} artifact")
    ax.set(xlabel="step", ylabel="training loss", yscale="log",
           title="sparse fine-tuning, then the exported step")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
