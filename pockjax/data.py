"""Data for language-model training: checks on token ids where they enter.

An id outside the vocabulary does not fail inside a compiled step: the embedding
lookup reads NaN (or, for a negative id, wraps to the end of the table), and the loss
and every trained parameter turn NaN. So ids are checked on the host, where the
position of the bad one can still be named.
"""
from __future__ import annotations

import numpy as np

__all__ = ["check_token_ids"]


def check_token_ids(ids, vocab_size: int, *, what: str = "token id", where: str = "",
                    ignore: int | None = None) -> np.ndarray:
    """`ids` as a numpy integer array, after checking every id is in [0, vocab_size).

    Args:
      ids: token (or label) ids, any shape; a numpy or JAX array or nested lists.
      vocab_size: the model's vocabulary size.
      what: what the ids are, for the message ("token id", "label id").
      where: where they came from, for the message (", batch 3" or " in data.jsonl line 7").
      ignore: a value allowed besides the vocabulary (e.g. -100 for ignored labels).

    Returns:
      The ids as a numpy array.

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
