"""Data for language-model training: JSONL files in the formats users have, tokenized
with the prompt masked out of the loss, cut to the sequence length and batched in an
order fixed by the seed (so a resumed run sees the same batches); and checks on token
ids where they enter.

An id outside the vocabulary does not fail inside a compiled step: the embedding
lookup reads NaN (or, for a negative id, wraps to the end of the table), and the loss
and every trained parameter turn NaN. So ids are checked on the host, where the
position of the bad one can still be named.
"""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

__all__ = ["check_token_ids", "DataError", "Example", "Dataset", "read_jsonl", "batch_at",
           "batch_examples", "pad_batch", "eval_batches", "epoch_order", "steps_per_epoch", "FORMATS"]


def check_token_ids(ids, vocab_size: int, *, what: str = "token id", where: str = "",
                    ignore: int | None = None) -> np.ndarray:
    """`ids` as a numpy integer array, after checking every id is in [0, vocab_size).

    Args:
      ids: token (or label) ids, any shape; a numpy or JAX array or nested lists.
      vocab_size: the model's vocabulary size.
      what: what the ids are, for the message; default "token id" (or "label id").
      where: where they came from, appended to the message (", batch 3" or
        " in data.jsonl line 7"); default empty.
      ignore: a value allowed besides the vocabulary (e.g. -100 for ignored labels);
        None (the default) allows none.

    Returns:
      The ids as a numpy array (`np.asarray(ids)`, not copied where it need not be).

    Raises:
      TypeError: the ids are not integers (float ids index nothing).
      ValueError: an id is outside the vocabulary; the message names the first one and
        its position, and how many there are.
    """
    a = np.asarray(ids)
    if a.dtype == object or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{what}s must be integers, got {a.dtype}{list(a.shape)}{where}; "
                        f"convert them with .astype(np.int32) (ids read from text or JSON "
                        f"as floats need rounding first)")
    bad = (a < 0) | (a >= vocab_size)
    if ignore is not None:
        bad &= a != ignore
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        position = f" at position {list(first)}" if first else ""
        raise ValueError(f"{what} {int(a[first])}{position}{where} is outside the vocabulary "
                         f"[0, {vocab_size}) ({int(bad.sum())} of {a.size} ids are); the "
                         f"tokenizer and the model disagree, or the data holds ids of another "
                         f"tokenizer: re-tokenize with the model's tokenizer")
    return a


# --------------------------------------------------------------------------- JSONL data


class DataError(ValueError):
    """Raised when a data file cannot be used; the message names the file, the line and
    the fix."""


FORMATS = {
    "text": ("text",),
    "completion": ("prompt", "completion"),
    "chat": ("messages",),
}
"""The JSONL record formats: format name -> the keys a record of that format has."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One tokenized example.

    Attributes:
      ids: int32 token ids, shape [n].
      mask: bool, shape [n]: True where the token is one the loss predicts (the
        completion, the assistant's turns, or all of a text).
    """

    ids: np.ndarray
    mask: np.ndarray


@dataclasses.dataclass
class Dataset:
    """The examples of a JSONL file, tokenized and cut to the sequence length
    (`read_jsonl` makes one); `len(dataset)` is the number of examples.

    Attributes:
      examples: the `Example`s, in file order.
      path: the file read.
      format: the records' format, a key of `FORMATS`.
      truncated: how many examples were longer than the sequence length and cut to it.
      dropped: how many examples had nothing left to predict after the cut.
      tokens: the tokens kept, all examples together.
      targets: of those, the tokens the loss counts (masked positions after each
        example's first token).
    """

    examples: list[Example]
    path: str
    format: str
    truncated: int  # examples longer than the sequence length, cut to it
    dropped: int    # examples with nothing left to predict after the cut
    tokens: int     # tokens kept, all examples
    targets: int    # of those, tokens the loss counts

    def __len__(self) -> int:
        return len(self.examples)

    def describe(self) -> str:
        """A one-line summary: path, example and token counts, cut and dropped examples.

        Returns:
          The summary text.
        """
        cut = f", {self.truncated} cut to the sequence length" if self.truncated else ""
        gone = (f", {self.dropped} dropped (nothing to predict within the sequence length)"
                if self.dropped else "")
        return (f"{self.path}: {len(self)} {self.format} examples, {self.tokens} tokens "
                f"({self.targets} in the loss){cut}{gone}")


def _format_of(record: dict, where: str) -> str:
    keys = set(record)
    for name, needed in FORMATS.items():
        if set(needed) <= keys:
            return name
    known = "; ".join("{" + ", ".join(f'"{k}"' for k in v) + "}" for v in FORMATS.values())
    raise DataError(f"{where}: a record with keys {sorted(keys)}; each line must be one of "
                    f"{known}")


def _text(record: dict, key: str, where: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: \"{key}\" must be a string, got {type(value).__name__}")
    return value


def _tokenize(record: dict, fmt: str, tokenizer, where: str) -> tuple[list[int], list[bool]]:
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    if fmt == "text":
        text = _text(record, "text", where)
        if not text:
            raise DataError(f"{where}: \"text\" is empty")
        ids = tokenizer.encode(text, add_special_tokens=True) + eos
        return ids, [True] * len(ids)
    if fmt == "completion":
        prompt = tokenizer.encode(_text(record, "prompt", where), add_special_tokens=True)
        completion = _text(record, "completion", where)
        if not completion:
            raise DataError(f"{where}: \"completion\" is empty: nothing to learn from")
        answer = tokenizer.encode(completion, add_special_tokens=False) + eos
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list of "
                        f"{{\"role\", \"content\"}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} must be an object with string \"role\" and "
                            f"\"content\", got {json.dumps(m)[:80]}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no \"assistant\" message: nothing to learn from")
    try:
        ids, mask = tokenizer.encode_chat(messages)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None
    return list(ids), list(mask)


def read_jsonl(path, tokenizer, seq_len: int, *, vocab_size: int | None = None) -> Dataset:
    """Read and tokenize a JSONL file of `{"text"}`, `{"prompt", "completion"}` or
    `{"messages": [{"role", "content"}, ...]}` records (one format per file).

    The loss counts the completion (with the end-of-sequence token), the assistant's
    messages (as the tokenizer's chat template renders them), or the whole text.
    Examples longer than `seq_len` are cut to it (counted in `Dataset.truncated`); one
    with nothing left to predict is dropped (`Dataset.dropped`). Every line is read and
    checked before this returns, so a bad line fails before training starts.

    Args:
      path: the JSONL file (a string or path-like). Blank lines are skipped.
      tokenizer: a `pockjax.tokenizer.Tokenizer` (or an object with its `encode`,
        `encode_chat` and `eos_id`).
      seq_len: the training sequence length, an integer >= 2.
      vocab_size: the model's vocabulary; token ids at or above it are refused. None
        (the default) checks nothing.

    Returns:
      A `Dataset`.

    Raises:
      DataError: `seq_len` is not an integer >= 2; the file is missing, a folder or
        holds no records; a line is not UTF-8 text, not a JSON object, not one of the
        formats, or of another format than the first; a field has the wrong type or is empty (a `"text"`, a
        `"completion"`, `"messages"`), a conversation has no assistant message or the
        chat template refuses it; or every example was dropped. The message names the
        file and line.
      ValueError: with `vocab_size`, a token id is outside the vocabulary
        (`check_token_ids`).
    """
    if not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise DataError(f"the sequence length must be an integer >= 2 (a token and the one it "
                        f"predicts), got {seq_len!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        raise DataError(f"data '{path}' is a folder; give a JSONL file (one JSON record a "
                        f"line)")
    if not os.path.isfile(path):
        raise DataError(f"data file '{path}' does not exist")
    examples, fmt, truncated, dropped = [], None, 0, 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path} line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                                f"{e.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each "
                                f"line must be one JSON object") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: a JSON {type(record).__name__}, not an object")
            this = _format_of(record, where)
            if fmt is None:
                fmt, first = this, number
            elif this != fmt:
                raise DataError(f"{where}: a {this!r} record, but line {first} was {fmt!r}; "
                                f"use one format per file")
            ids, mask = _tokenize(record, fmt, tokenizer, where)
            if vocab_size is not None:
                check_token_ids(ids, vocab_size, where=f" in {where}")
            if len(ids) > seq_len:
                truncated += 1
                ids, mask = ids[:seq_len], mask[:seq_len]
            if not any(mask[1:]):
                dropped += 1
                continue
            examples.append(Example(np.asarray(ids, np.int32), np.asarray(mask, bool)))
    if fmt is None:
        raise DataError(f"data file '{path}' holds no records (one JSON object per line)")
    if not examples:
        raise DataError(f"{path}: every example was dropped: none has a token to predict "
                        f"within the sequence length {seq_len}; raise --seq")
    return Dataset(examples, path, fmt, truncated, dropped,
                   tokens=sum(len(e.ids) for e in examples),
                   targets=sum(int(e.mask[1:].sum()) for e in examples))


# --------------------------------------------------------------------------- batches


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Steps in one pass over `n` examples, the last batch possibly partial.

    Args:
      n: the number of examples.
      batch_size: examples per step.

    Returns:
      `ceil(n / batch_size)`.
    """
    return -(-n // batch_size)


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The examples' order in `epoch`: a permutation fixed by `(seed, epoch)` alone, so a
    resumed run sees the same batches.

    Args:
      n: the number of examples.
      seed: the run's data seed.
      epoch: the 0-based epoch.

    Returns:
      A permutation of `range(n)` as a numpy integer array.
    """
    return np.random.default_rng([seed, epoch]).permutation(n)


def batch_at(dataset: Dataset, step: int, batch_size: int, seq_len: int, *, seed: int,
             pad_id: int = 0, shuffle: bool = True) -> dict[str, np.ndarray]:
    """The batch of training step `step` (0-based), right-padded with `pad_id` (mask 0).

    Step `step` falls in epoch `step // steps_per_epoch(len(dataset), batch_size)` and
    takes the next `batch_size` examples of that epoch's order; the last batch of an
    epoch is filled with empty rows (mask 0), so every example is seen once per epoch
    and the shapes never change.

    Args:
      dataset: the `Dataset`.
      step: the 0-based training step.
      batch_size: rows per batch (B).
      seq_len: tokens per row (L); at least the longest example (the `seq_len` the
        dataset was read with).
      seed: the data seed (`epoch_order`).
      pad_id: the token id written in padding; default 0.
      shuffle: use `epoch_order` (the default); False keeps file order in every epoch.

    Returns:
      `{"tokens": int32 [B, L], "mask": float32 [B, L]}`.
    """
    return pad_batch(batch_examples(dataset, step, batch_size, seed=seed, shuffle=shuffle),
                     batch_size, seq_len, pad_id)


def batch_examples(dataset: Dataset, step: int, batch_size: int, *, seed: int,
                   shuffle: bool = True) -> list[Example]:
    """The examples of training step `step` (see `batch_at`), unpadded.

    Args:
      dataset: the `Dataset`.
      step: the 0-based training step.
      batch_size: examples per step.
      seed: the data seed (`epoch_order`).
      shuffle: use `epoch_order` (the default); False keeps file order.

    Returns:
      Up to `batch_size` `Example`s (fewer in an epoch's last step).
    """
    n = len(dataset)
    epoch, i = divmod(step, steps_per_epoch(n, batch_size))
    order = epoch_order(n, seed, epoch) if shuffle else np.arange(n)
    return [dataset.examples[j] for j in order[i * batch_size:(i + 1) * batch_size]]


def pad_batch(examples, batch_size: int, seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """`examples` as one right-padded batch of a fixed shape.

    Args:
      examples: at most `batch_size` `Example`s, each at most `seq_len` tokens long.
      batch_size: rows in the batch (B); rows past the examples are padding.
      seq_len: tokens per row (L).
      pad_id: the token id written in padding; default 0.

    Returns:
      `{"tokens": int32 [B, L], "mask": float32 [B, L]}`; the mask is each example's
      own mask, 0 on padding.
    """
    tokens = np.full((batch_size, seq_len), pad_id, np.int32)
    mask = np.zeros((batch_size, seq_len), np.float32)
    for r, e in enumerate(examples):
        tokens[r, :len(e.ids)] = e.ids
        mask[r, :len(e.ids)] = e.mask
    return {"tokens": tokens, "mask": mask}


def eval_batches(dataset: Dataset, batch_size: int, seq_len: int, pad_id: int = 0):
    """Every example once, in file order, in batches of the training shape.

    Args:
      dataset: the `Dataset`.
      batch_size: rows per batch.
      seq_len: tokens per row.
      pad_id: the token id written in padding; default 0.

    Yields:
      `pad_batch` batches; the last one is filled with empty rows (mask 0).
    """
    for i in range(0, len(dataset), batch_size):
        yield pad_batch(dataset.examples[i:i + batch_size], batch_size, seq_len, pad_id)
