"""Generated text for the language examples: a byte-level tokenizer, a pretraining corpus
and an instruction-tuning task set, all made from a seed (nothing is downloaded).

The corpus is plain sentences, facts and sums. The instructions ask, as in PockEngine's
demo, to reverse the words of a sentence, to state a fact or to add two numbers:

    reverse: the red fox jumps
    jumps fox red the
"""
from __future__ import annotations

import os

import numpy as np

PAD, EOS = 0, ord("\n")
VOCAB = 128  # ASCII

ADJECTIVES = ["red", "big", "old", "small", "happy", "blue", "cold", "fast", "green", "quiet"]
NOUNS = ["cat", "dog", "fox", "bird", "tree", "boat", "girl", "king", "fish", "moon", "car",
         "house"]
VERBS = ["sees", "likes", "jumps", "runs", "finds", "eats", "sings", "reads", "sleeps", "wants"]
FACTS = [("the capital of france", "paris"), ("the capital of italy", "rome"),
         ("the capital of japan", "tokyo"), ("the capital of spain", "madrid"),
         ("the color of the sky", "blue"), ("the color of grass", "green"),
         ("the opposite of hot", "cold"), ("the opposite of big", "small"),
         ("the first letter", "a"), ("the number after nine", "ten")]


def encode(text: str) -> list[int]:
    return list(text.encode("ascii"))


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if 0 < int(t) < VOCAB).decode("ascii")


def _sentence(rng: np.random.Generator) -> str:
    words = ["the", str(rng.choice(ADJECTIVES)), str(rng.choice(NOUNS)), str(rng.choice(VERBS))]
    if rng.random() < 0.5:
        words += ["the", str(rng.choice(NOUNS))]
    return " ".join(words)


def corpus(n: int, seed: int = 0) -> list[str]:
    """Pretraining lines: sentences, facts and sums."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        kind = rng.integers(3)
        if kind == 0:
            lines.append(_sentence(rng))
        elif kind == 1:
            subject, answer = FACTS[rng.integers(len(FACTS))]
            lines.append(f"{subject} is {answer}")
        else:
            a, b = rng.integers(0, 50, size=2)
            lines.append(f"{a} plus {b} is {a + b}")
    return lines


def instructions(n: int, seed: int = 1) -> list[tuple[str, str]]:
    """(prompt, answer) pairs: reverse a sentence's words (half of them), a fact, a sum."""
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            s = _sentence(rng)
            pairs.append((f"reverse: {s}", " ".join(reversed(s.split()))))
        elif kind < 0.75:
            subject, answer = FACTS[rng.integers(len(FACTS))]
            pairs.append((f"what is {subject}?", answer))
        else:
            a, b = rng.integers(0, 50, size=2)
            pairs.append((f"what is {a} plus {b}?", str(a + b)))
    return pairs


def split_heldout(pairs, fraction: float = 0.1):
    """Train and held-out pairs with no prompt in both."""
    prompts = sorted({p for p, _ in pairs})
    rng = np.random.default_rng(123)
    held = set(rng.choice(prompts, size=max(1, int(len(prompts) * fraction)), replace=False))
    return [x for x in pairs if x[0] not in held], [x for x in pairs if x[0] in held]


def pack_lines(lines, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens `[N, length]` (each line then EOS, right-padded) and a loss mask over the
    predicted positions (every real token after the first)."""
    tokens = np.full((len(lines), length), PAD, np.int32)
    for i, line in enumerate(lines):
        ids = encode(line)[:length - 1] + [EOS]
        tokens[i, :len(ids)] = ids
    mask = (tokens != PAD).astype(np.float32)
    mask[:, 0] = 0.0
    return tokens, mask


def pack_pairs(pairs, length: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of `prompt \\n answer \\n` and a mask over the answer's tokens only."""
    tokens = np.full((len(pairs), length), PAD, np.int32)
    mask = np.zeros((len(pairs), length), np.float32)
    for i, (prompt, answer) in enumerate(pairs):
        head = encode(prompt) + [EOS]
        ids = (head + encode(answer) + [EOS])[:length]
        tokens[i, :len(ids)] = ids
        mask[i, len(head):len(ids)] = 1.0
    return tokens, mask


def batches(tokens: np.ndarray, mask: np.ndarray, batch: int, seed: int = 0):
    """Endless shuffled `(tokens, mask)` batches of a fixed size."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(tokens))
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            yield tokens[idx], mask[idx]


# --------------------------------------------------------------------------- model side


def config():
    """The tiny LLaMA the examples train: 4 blocks, 128 wide, grouped-query attention."""
    from pockjax.models.llama import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=320, num_layers=4,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=LENGTH)


LENGTH = 80


def lm_loss(model, batch):
    """Next-token cross-entropy over the masked positions (written with a one-hot, not a
    gather, so the exported step has no scatter)."""
    import jax
    import jax.numpy as jnp

    tokens, mask = batch
    logits = model(tokens)[:, :-1]
    targets = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1])
    nll = -jnp.sum(targets * jax.nn.log_softmax(logits), axis=-1)
    weight = mask[:, 1:]
    return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def exact_match(model, pairs, max_new_tokens: int = 36) -> tuple[float, list[str]]:
    """Greedy answers to `pairs`' prompts: the fraction exactly right, and the answers."""
    from pockjax.models.llama import generate

    answers = [""] * len(pairs)
    by_length: dict[int, list[int]] = {}
    for i, (prompt, _) in enumerate(pairs):
        by_length.setdefault(len(encode(prompt)) + 1, []).append(i)
    for length, idx in by_length.items():
        prompts = np.array([encode(pairs[i][0]) + [EOS] for i in idx], np.int32)
        new = min(max_new_tokens, LENGTH - length)
        out = np.asarray(generate(model, prompts, new, stop_token=EOS))
        for i, row in zip(idx, out[:, length:]):
            row = list(row)
            answers[i] = decode(row[:row.index(EOS)] if EOS in row else row)
    right = sum(a == want for a, (_, want) in zip(answers, pairs))
    return right / max(len(pairs), 1), answers


# The checkpoint shipped with the examples: `SHIPPED_STEPS` steps of `pretrain`, made by
# `python examples/tiny_lm.py --steps 600 --out examples/checkpoints/tiny-llama`.
SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints", "tiny-llama")
SHIPPED_STEPS = 600


def pretrained(out: str, steps: int, batch: int = 32) -> str:
    """A Hugging Face-layout checkpoint of the tiny LLaMA pretrained `steps` steps on the
    generated corpus: the shipped one (`SHIPPED`) for `SHIPPED_STEPS` steps, otherwise
    `out/pretrained-{steps}`, trained and saved on first use."""
    if steps == SHIPPED_STEPS and os.path.exists(os.path.join(SHIPPED, "config.json")):
        print(f"pretrained model: {os.path.relpath(SHIPPED)} (shipped with the examples)")
        return SHIPPED
    path = os.path.join(out, f"pretrained-{steps}")
    if os.path.exists(os.path.join(path, "config.json")):
        print(f"pretrained model: {path} (cached)")
        return path
    print(f"no checkpoint at {path}: pretraining a tiny LLaMA on generated text")
    return pretrain(path, steps, batch)


def pretrain(path: str, steps: int, batch: int = 32) -> str:
    """Pretrain the tiny LLaMA `steps` steps on the generated corpus (seed 0, AdamW with
    warm-up and cosine decay) and save it in Hugging Face's layout at `path`."""
    import optax
    from flax import nnx

    import pockjax as pj
    from pockjax.models.hf import save_llama
    from pockjax.models.llama import Llama

    tokens, mask = pack_lines(corpus(20_000), LENGTH)
    model = Llama(config(), rngs=nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 10, 1), steps, 3e-4)
    trainer = pj.nnx.Trainer(model, lm_loss, optimizer=optax.adamw(schedule, weight_decay=0.01))
    history = trainer.fit(batches(tokens, mask, batch), steps, desc="pretrain")
    trainer.update(model)
    save_llama(model, path)
    print(f"pretrained {steps} steps, final loss {history.loss[-20:].mean():.3f}; saved {path}")
    return path


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="pretrain the examples' tiny LLaMA on generated text")
    ap.add_argument("--steps", type=int, default=SHIPPED_STEPS)
    ap.add_argument("--out", default=SHIPPED, help="the checkpoint folder to write")
    args = ap.parse_args()
    pretrain(args.out, args.steps)
