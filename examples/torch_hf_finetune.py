"""Sparse-tune a Hugging Face causal LM (PyTorch) with pockjax, export it, run it on Vulkan.

1. A `transformers.LlamaForCausalLM` is built from a config (random weights; nothing is
   downloaded) and brought in with `pockjax.torch.functional`: its parameters as a
   pytree with the module's own names (`model/layers/1/mlp/up_proj/weight`), its
   forward as a JAX function.
2. It is sparse-tuned on the generated instruction data (reverse the words of a
   sentence, a fact, a sum; see tiny_lm.py): `pockjax.schemes.transformer` on the last
   block with half of each projection's input features (`axis="in"` means torch's
   `in_features`, axis 1 of the `[out, in]` weight) plus the output head.
3. The training step is exported for `android-vulkan` and run on this machine's Vulkan
   device (lavapipe, Mesa's Vulkan on the CPU, where there is no GPU); the artifact
   continues training and is compared with the JAX trainer.
4. The trained values go back into the PyTorch module (`pockjax.torch.load_state`),
   which is saved with `save_pretrained`.

    python examples/torch_hf_finetune.py [--steps 60] [--out out/torch_hf] [--fast]

`pockjax export examples/torch_hf_finetune.py:make --target android-arm64 --out DIR`
exports the same step from the command line (`make` gives the model and its loss).
"""
import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers

import pockjax as pj
import tiny_lm as data

BATCH, LENGTH = 8, 48


def build_model(hidden: int = 64, layers: int = 2) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=data.VOCAB, hidden_size=hidden,
                                   intermediate_size=2 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=LENGTH)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()   # eval: no dropout, as exported


def lm_loss(apply, params, batch):
    """Next-token cross-entropy over the answer's tokens (one-hot: no scatter in the export)."""
    tokens, mask = batch
    logits = apply(params, tokens, use_cache=False)[:, :-1]
    nll = -jnp.sum(jax.nn.one_hot(tokens[:, 1:], logits.shape[-1]) * jax.nn.log_softmax(logits), -1)
    weight = mask[:, 1:]
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def scheme_for(params):
    return pj.schemes.transformer(params, last=1, ratio=0.5, axis="in", extra=["lm_head/**"])


def data_batches(n: int = 512):
    tokens, mask = data.pack_pairs(data.instructions(n), LENGTH)
    return data.batches(tokens, mask, BATCH)


def make():
    """For `pockjax export examples/torch_hf_finetune.py:make`: the model and its loss."""
    model = build_model()
    params, _ = pj.torch.functional(model, output=lambda out: out.logits)
    return {"model": model, "loss_fn": lm_loss, "optimizer": optax.adamw(3e-3),
            "scheme": scheme_for(params), "output": lambda out: out.logits,
            "batch": next(data_batches())}


def vulkan_device() -> str | None:
    try:
        from pockjax.export import vulkan
        return vulkan.device_caps().name
    except Exception:  # no driver, no device, or no IREE Vulkan support
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--artifact-steps", type=int, default=3)
    ap.add_argument("--out", default="out/torch_hf")
    ap.add_argument("--fast", action="store_true", help="a few steps (for tests)")
    args = ap.parse_args(argv)
    if args.fast:
        args.steps = 6

    model = build_model()
    params, apply = pj.torch.functional(model, output=lambda out: out.logits)
    scheme = scheme_for(params)
    print(f"{type(model).__name__}: {sum(x.size for x in jax.tree_util.tree_leaves(params)):,} "
          f"parameters; scheme {scheme}\n")

    trainer = pj.sparse_train(lambda p, b: lm_loss(apply, p, b), optimizer=optax.adamw(3e-3),
                              scheme=scheme)
    batches = data_batches()
    state = trainer.init(params)
    first = next(batches)
    print(trainer.report(state, first), "\n")
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = trainer(state, next(batches))
        losses.append(float(metrics["loss"]))
    print(f"loss {np.mean(losses[:3]):.3f} -> {np.mean(losses[-3:]):.3f} in {args.steps} steps "
          f"({args.steps / (time.perf_counter() - start):.1f} steps/s)\n")

    target = "android-vulkan"
    start = time.perf_counter()
    art = trainer.export(state, first, target=target, out_dir=os.path.join(args.out, target))
    print(f"exported {target} in {time.perf_counter() - start:.1f} s: {art.path}")
    device = vulkan_device()
    if device is None:
        print("no Vulkan device here: the android-vulkan artifact is compiled but not run")
    else:
        sess = pj.runtime.load(art.path, device="vulkan")
        for i in range(args.artifact_steps):
            batch = next(batches)
            got = float(sess.step(batch)["loss"])
            state, metrics = trainer(state, batch)
            print(f"step {args.steps + i + 1}: JAX {float(metrics['loss']):.5f}  "
                  f"{target} on {device} {got:.5f}")
            np.testing.assert_allclose(got, float(metrics["loss"]), rtol=1e-3)
        err = max(float(np.max(np.abs(a - np.asarray(b))) / (np.max(np.abs(np.asarray(b))) + 1e-12))
                  for a, b in zip(jax.tree_util.tree_leaves(sess.params()),
                                  jax.tree_util.tree_leaves(state.params)))
        print(f"{target} on {device}: max relative parameter difference to JAX after "
              f"{args.artifact_steps} steps: {err:.1e}")
        assert err < 1e-3, "the artifact does not match the JAX trainer"

    # Back into PyTorch: the module now holds the trained values.
    pj.torch.load_state(model, state.params)
    with torch.no_grad():
        tokens = torch.tensor(np.asarray(first[0]))
        torch_logits = model(tokens, use_cache=False).logits.numpy()
    jax_logits = np.asarray(apply(state.params, jnp.asarray(first[0]), use_cache=False))
    print(f"PyTorch logits with the trained values vs JAX: max difference "
          f"{np.max(np.abs(torch_logits - jax_logits)):.1e}")
    model.save_pretrained(os.path.join(args.out, "tuned"))
    print(f"saved the tuned model: {os.path.join(args.out, 'tuned')}")


if __name__ == "__main__":
    main()
