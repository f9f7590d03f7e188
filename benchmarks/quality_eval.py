"""The quality benchmark's evaluator: every fine-tuned model scored by one forward pass
(pockjax's), test and held-out corpus loss and exact match of a body's first line."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from benchmarks import quality_data
from benchmarks.quality_methods import tasks_of


@dataclasses.dataclass
class ExactMatchCheck:
    """What greedy decoding must produce for one example: the argmax at each position
    of `exact` equals its token, and the token predicted at `boundary[0]` starts with
    `boundary[1]` (the rest of the line and its newline: the next line begins)."""

    ids: list[int]                       # the example as read_jsonl tokenizes it
    exact: list[tuple[int, int]]         # (position whose argmax is checked, token)
    boundary: tuple[int, str]


def exact_match_check(tok, prompt: str, completion: str) -> ExactMatchCheck:
    """The check for the first non-blank line of `completion` after `prompt`, at the
    positions `pockjax.data.read_jsonl` gives them (prompt, completion, end token; the
    logits at position t predict token t + 1)."""
    head = tok.encode(prompt, add_special_tokens=True)
    ids, offsets = tok.encode_with_offsets(completion)
    _, end = quality_data.first_line_span(completion)
    exact, boundary = [], None
    for k, (a, b) in enumerate(offsets):
        if b <= end:
            exact.append((len(head) + k - 1, ids[k]))
        else:
            boundary = (len(head) + k - 1, completion[a:end + 1])
            break
    if boundary is None:  # the line runs to the end: the end token follows it
        boundary = (len(head) + len(ids) - 1, None)
    return ExactMatchCheck(head + ids + [tok.eos_id], exact, boundary)


def exact_matches(checks: list[ExactMatchCheck], argmax, tok) -> list[bool]:
    """Per example, whether greedy decoding reproduces its first line, from the argmax
    of a teacher-forced pass (`argmax[i][t]`: the most likely token after position t)."""
    hits = []
    for check, pred in zip(checks, argmax):
        ok = all(int(pred[pos]) == token for pos, token in check.exact)
        pos, text = check.boundary
        if ok:
            ok = (int(pred[pos]) == tok.eos_id if text is None else
                  tok.decode([int(pred[pos])], skip_special_tokens=False).startswith(text))
        hits.append(bool(ok))
    return hits


class Evaluator:
    """Scores a Hugging Face folder with pockjax's forward pass, the same computation
    for every method: the test split's loss (tokens the loss counts, summed over the
    split, as `pockjax.finetune`'s validation), the pretraining corpus's held-out loss,
    and for task "instruct" exact match of the body's first line.

    Exact match is read off one teacher-forced pass: greedy decoding reproduces the
    reference's tokens exactly when each is the argmax given the reference before it,
    so "the first line's tokens are each the argmax, and the argmax after them starts
    the next line" is greedy decoding's answer (for the reference's own tokenization of
    the line; a model that spelled the line with other tokens would count as a miss).
    """

    def __init__(self, cfg: dict):
        import jax
        import numpy as np
        import optax

        import pockjax as pj
        from pockjax.data import read_jsonl
        from pockjax.models.hf import load_llama

        self.cfg, self.np = cfg, np
        self.tok = pj.Tokenizer.from_folder(cfg["pretrained"])
        self.pad = self.tok.pad_id if self.tok.pad_id is not None else (self.tok.eos_id or 0)
        model = load_llama(cfg["pretrained"])
        self.graphdef, _, self.rest = pj.nnx.split(model)
        vocab, seq = model.config.vocab_size, cfg["seq"]
        self.sets = {task: read_jsonl(cfg["tasks"][task]["test"], self.tok, seq, vocab_size=vocab)
                     for task in tasks_of(cfg)}
        self.sets["corpus"] = read_jsonl(cfg["corpus_heldout"], self.tok, seq, vocab_size=vocab)
        self.checks = (self._exact_match_checks(cfg["tasks"]["instruct"]["test"])
                       if "instruct" in self.sets else [])

        def stats(params, tokens, mask):
            logits = pj.nnx.merge(self.graphdef, params, self.rest)(tokens)
            nll = optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1].astype("float32"), tokens[:, 1:])
            w = mask[:, 1:]
            return (nll * w).sum(), w.sum(), logits.argmax(-1)

        self.stats = jax.jit(stats)

    def _exact_match_checks(self, path) -> list:
        lines = Path(path).read_text().splitlines()
        examples = self.sets["instruct"].examples
        if len(examples) != len(lines):
            raise RuntimeError(f"{path}: {len(lines)} records but {len(examples)} examples; "
                               f"every example must fit the sequence length (rebuild the data)")
        checks = []
        for line, example in zip(lines, examples):
            record = json.loads(line)
            check = exact_match_check(self.tok, record["prompt"], record["completion"])
            if list(example.ids) != check.ids:
                raise RuntimeError("the evaluator tokenizes an example differently from "
                                   "pockjax.data.read_jsonl; rebuild the data")
            checks.append(check)
        return checks

    def _pass(self, params, dataset):
        """Summed loss and count over `dataset`, and the argmax of every example."""
        from pockjax.data import eval_batches

        np, b = self.np, self.cfg["eval_batch"]
        total = count = 0.0
        argmax = []
        for batch in eval_batches(dataset, b, self.cfg["seq"], self.pad):
            s, n, a = self.stats(params, batch["tokens"], batch["mask"])
            total, count = total + float(s), count + float(n)
            argmax += list(np.asarray(a))
        return total / count, argmax[:len(dataset)]

    def __call__(self, folder, task: str) -> dict:
        import pockjax as pj
        from pockjax.models.hf import load_llama

        params = pj.nnx.split(load_llama(folder))[1]
        test_loss, argmax = self._pass(params, self.sets[task])
        corpus_loss, _ = self._pass(params, self.sets["corpus"])
        out = {"test_loss": test_loss, "corpus_loss": corpus_loss}
        if task == "instruct":
            hits = exact_matches(self.checks, argmax, self.tok)
            out["exact_match"] = sum(hits) / len(hits)
            out["exact_match_n"] = len(hits)
        return out
