"""A searched scheme against bias-only and last-k-blocks at the same memory budget.

`pockjax.nnx.search_scheme` measures the contribution of every candidate on the task. Each
candidate is one weight (Full, or 1/8, 1/4, 1/2 of its input channels), or the
biases (for the LLaMA, the norm scales) of the last k blocks, trained alone from the
same starting point. The search then picks the best set whose compiled step fits in
`--budget` of full fine-tuning's step memory. Each scheme then trains for the same
number of steps:

- full: every parameter;
- searched: the search's scheme;
- bias-only: the biases (the LLaMA: its norm scales) and the output layer;
- last k: the last k blocks and the output layer, for the smallest k whose step
  needs at least the searched scheme's memory (the search is compared with a
  baseline given as much memory or more).

Two tasks:

- `--task digits`: MobileNetV2 (width 0.35, 16x16) pretrained on digits 0-4 and
  tuned on 5-9 with a fresh classifier (`digits_transfer.py`).
- `--task instruct`: the tiny LLaMA pretrained on generated text and
  instruction-tuned (`instruct_llama.py`).

It prints the contribution table, then for each scheme its compiled step memory, the
final held-out loss and its gap to full fine-tuning. It writes `OUT/search.png`
(contribution vs memory), `OUT/scheme.json` and `OUT/report.json`. The analysis is
cached in `OUT/cache`, so a second run skips it.

    python examples/search_schemes.py --task digits|instruct [--budget 40%] [--steps N]
        [--search-steps 20] [--out out/search-TASK] [--fast]
"""
import argparse
import os

import jax
import numpy as np
import optax
from flax import nnx

import pockjax as pj
from reporting import print_table


def digits_task(args):
    import digits_transfer as d

    model = d.pretrained(args.pretrain_steps)
    (x, y), (test_x, test_y) = d.load(np.arange(5, 10))
    cut = int(0.8 * len(y))  # validation split from the training images, for the search
    (x, y), (val_x, val_y) = (x[:cut], y[:cut]), (x[cut:], y[cut:])

    def fresh():
        tuned = nnx.clone(model)
        tuned.classifier = nnx.Linear(model.last_channels, 5, rngs=nnx.Rngs(1))
        return tuned

    stream = d.batches(x, y, seed=1)
    train = [next(stream) for _ in range(args.steps)]
    val = [(val_x[i:i + d.BATCH], val_y[i:i + d.BATCH])
           for i in range(0, len(val_y) - d.BATCH + 1, d.BATCH)]
    test = [(test_x[i:i + d.BATCH], test_y[i:i + d.BATCH])
            for i in range(0, len(test_y) - d.BATCH + 1, d.BATCH)]
    head = [("classifier/**", pj.Full())]
    probe = fresh()
    return dict(
        name="MobileNetV2 digits 0-4 -> 5-9", fresh=fresh, loss_fn=d.xent, train=train, val=val,
        test=test, lr={"full": 2e-3, "partial": 5e-3},
        bias_only=pj.Scheme([*pj.schemes.bias_only(probe).rules, *head]),
        last_k=lambda k: pj.schemes.last_blocks(probe, k, extra=["classifier/**", "head/**"]),
        blocks=len(pj.schemes.blocks(probe)),
        include=None if not args.fast else ["classifier/**", "head/**"],
        metric=("accuracy", lambda m: d.accuracy(m, test_x, test_y)))


def instruct_task(args):
    import tiny_lm as data
    from pockjax.models.hf import load_llama

    path = data.pretrained(args.out, args.pretrain_steps)
    pairs, held = data.split_heldout(data.instructions(20_000))
    cut = int(0.9 * len(pairs))
    tokens, mask = data.pack_pairs(pairs[:cut], data.LENGTH)
    val_tokens, val_mask = data.pack_pairs(pairs[cut:cut + 4 * 32], data.LENGTH)
    test_tokens, test_mask = data.pack_pairs(held[:8 * 32], data.LENGTH)
    stream = data.batches(tokens, mask, 32, seed=2)
    train = [next(stream) for _ in range(args.steps)]
    chunks = lambda t, m: [(t[i:i + 32], m[i:i + 32]) for i in range(0, len(t) - 31, 32)]
    probe = load_llama(path)
    norms = [(p, pj.Full()) for p in pj.nnx.param_paths(probe) if p.endswith("/scale")]
    return dict(
        name="tiny LLaMA instruction tuning", fresh=lambda: load_llama(path),
        loss_fn=data.lm_loss, train=train, val=chunks(val_tokens, val_mask),
        test=chunks(test_tokens, test_mask), lr={"full": 1e-3, "partial": 2e-3},
        bias_only=pj.Scheme([*norms, ("lm_head/**", pj.Full())]),
        last_k=lambda k: pj.schemes.last_blocks(probe, k, extra=["lm_head/**", "norm/**"]),
        blocks=len(pj.schemes.blocks(probe)),
        include=None if not args.fast else ["lm_head/**", "layers/3/mlp/**"],
        metric=None)


def evaluate(model, loss_fn, batches) -> float:
    loss = nnx.jit(loss_fn)
    return float(np.mean([float(loss(model, b)) for b in batches]))


def trainer_for(task, scheme, lr, steps):
    """A fresh model and its trainer; the compiled step's peak memory."""
    model = task["fresh"]()
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(steps // 10, 1), steps, lr / 10)
    trainer = pj.nnx.Trainer(model, task["loss_fn"], optimizer=optax.adam(schedule), scheme=scheme)
    memory = pj.compiled_memory(trainer.lower(task["train"][0]).compile())["peak"]
    return model, trainer, memory


def train(task, model, trainer, steps, desc):
    history = trainer.fit(task["train"][:steps], steps, desc=desc)
    trainer.update(model)
    return history


def trained_count(trainer) -> int:
    view = pj.trainable_view(trainer.params(), trainer.scheme)
    return sum(int(np.prod(np.shape(x))) for x in jax.tree_util.tree_leaves(view))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["digits", "instruct"], required=True)
    ap.add_argument("--budget", default="40%")
    ap.add_argument("--steps", type=int, help="fine-tuning steps per scheme "
                                              "(default: digits 200, instruct 300)")
    ap.add_argument("--search-steps", type=int, default=20, help="steps per candidate")
    ap.add_argument("--pretrain-steps", type=int, help="default: digits 200, instruct 600")
    ap.add_argument("--out")
    ap.add_argument("--fast", action="store_true", help="a quick run for tests")
    args = ap.parse_args(argv)
    defaults = {"digits": (200, 200), "instruct": (300, 600)}[args.task]
    args.steps = args.steps or defaults[0]
    args.pretrain_steps = args.pretrain_steps or defaults[1]
    if args.fast:  # the instruct task starts from the shipped checkpoint (600 steps)
        args.steps, args.search_steps = 12, 3
        args.pretrain_steps = 20 if args.task == "digits" else args.pretrain_steps
    args.out = args.out or f"out/search-{args.task}"
    os.makedirs(args.out, exist_ok=True)
    task = (digits_task if args.task == "digits" else instruct_task)(args)
    lr = task["lr"]

    print(f"== {task['name']}: contribution analysis ({args.search_steps} steps per candidate)")
    # Each candidate's short run has the fine-tuning's schedule, over its own steps.
    search_opt = optax.adam(optax.warmup_cosine_decay_schedule(
        0.0, lr["partial"], max(args.search_steps // 10, 1), args.search_steps, lr["partial"] / 10))
    scheme, report = pj.nnx.search_scheme(
        task["fresh"](), task["loss_fn"], optimizer=search_opt,
        data=(task["train"], task["val"]), budget=args.budget, steps=args.search_steps,
        cache=os.path.join(args.out, "cache"), cache_key=f"adam warmup-cosine {lr['partial']}",
        **({"include": task["include"]} if task["include"] else {}))
    print(report)
    with open(os.path.join(args.out, "scheme.json"), "w") as f:
        f.write(scheme.to_json(indent=1))
    report.save(os.path.join(args.out, "report.json"))
    report.plot(os.path.join(args.out, "search.png"))

    runs = {"full": (pj.Scheme(default=pj.Full()), lr["full"]),
            "searched": (scheme, lr["partial"]),
            "bias-only": (task["bias_only"], lr["partial"])}
    results = {}
    for name, (s, rate) in runs.items():
        model, trainer, memory = trainer_for(task, s, rate, args.steps)
        results[name] = (model, memory, train(task, model, trainer, args.steps, name), trainer)
    searched_memory = results["searched"][1]
    # Last k blocks: the smallest k whose step needs at least the searched scheme's memory.
    for k in range(1, task["blocks"] + 1):
        model, trainer, memory = trainer_for(task, task["last_k"](k), lr["partial"], args.steps)
        if memory >= searched_memory or k == task["blocks"]:
            history = train(task, model, trainer, args.steps, f"last {k}")
            results[f"last {k} blocks"] = (model, memory, history, trainer)
            break

    full_memory = results["full"][1]
    full_loss = evaluate(results["full"][0], task["loss_fn"], task["test"])
    rows = []
    for name, (model, memory, history, trainer) in results.items():
        loss = evaluate(model, task["loss_fn"], task["test"])
        row = {"scheme": name,
               "trained": f"{trained_count(trainer):,}",
               "step memory": pj.format_bytes(memory),
               "of full": f"{100 * memory / full_memory:.1f}%",
               "within budget": "yes" if memory <= report.budget_bytes else "no",
               "train loss": f"{history.loss[-10:].mean():.4f}",
               "held-out loss": f"{loss:.4f}",
               "gap to full": f"{loss - full_loss:+.4f}"}
        if task["metric"]:
            label, fn = task["metric"]
            row[label] = f"{100 * fn(model):.1f}%"
        rows.append(row)
    print(f"\n== {task['name']}: {args.steps} steps per scheme, budget {args.budget} of full "
          f"fine-tuning's step memory ({pj.format_bytes(report.budget_bytes)})")
    print_table(rows)
    print(f"\n(step memory: the compiled step's peak from XLA; held-out loss on data no scheme "
          f"or search saw)\nscheme: {os.path.join(args.out, 'scheme.json')}; plot: "
          f"{os.path.join(args.out, 'search.png')}")
    return rows


if __name__ == "__main__":
    main()
