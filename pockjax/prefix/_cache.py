"""Where the cut values live between epochs: `PrefixCache` keeps one row per example
key in RAM up to a byte budget and in memory-mapped files past it, and `example_keys`
names examples by a hash of their contents. `pockjax.prefix.PrefixCachedTrainer` fills
and reads them; the public names are re-exported from `pockjax.prefix`.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from typing import Sequence

import jax
import numpy as np

from pockjax.prefix._cut import CutValue
from pockjax.transforms.sparse_grad import is_dynamic


class PrefixCache:
    """Cut values per example key: in RAM up to `budget_bytes`, then in memory-mapped
    files under `spill_dir`. `len(cache)` is the number of keys held, `key in cache`
    whether one is.

    Args:
      values: the `CutValue`s each key holds one row of (`PrefixSplit.values`).
      budget_bytes: RAM for rows; default 1 GiB.
      spill_dir: the folder for rows past the budget; None (the default) makes a
        temporary folder when first needed, removed by `close()`.
      dtype: "float32" (the default: values kept as they are) or "bfloat16" (floating
        values wider than 2 bytes stored in bfloat16: half the bytes; the suffix then
        sees rounded inputs, so results differ from the uncached run).
      chunk: rows per memory-mapped file; default 256.

    Attributes:
      values: the `CutValue`s, as a list.
      row_bytes: stored bytes per key.
      budget_bytes: the RAM budget.
      hits: lookups found in the cache (counted by `PrefixCachedTrainer`).
      misses: lookups computed and added (counted by `PrefixCachedTrainer`).

    Raises:
      ValueError: `dtype` is not "float32" or "bfloat16".
    """

    def __init__(self, values: Sequence[CutValue], budget_bytes: int = 2**30,
                 spill_dir: str | None = None, dtype: str = "float32", chunk: int = 256):
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
        import ml_dtypes

        self.values = list(values)
        narrow = lambda d: np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" and \
            np.issubdtype(d, np.floating) and np.dtype(d).itemsize > 2 else np.dtype(d)
        self._stored = [narrow(v.dtype) for v in self.values]
        self.row_bytes = sum(int(np.prod(v.shape, dtype=np.int64)) * d.itemsize
                             for v, d in zip(self.values, self._stored))
        self.budget_bytes = int(budget_bytes)
        self._ram: dict = {}
        self._disk: dict = {}
        self._chunks: list[list[np.memmap]] = []
        self._chunk = chunk
        self._spill_dir, self._own_dir = spill_dir, spill_dir is None
        self.hits = self.misses = 0

    def __len__(self) -> int:
        """The number of keys held, in RAM and on disk."""
        return len(self._ram) + len(self._disk)

    @property
    def ram_bytes(self) -> int:
        """Bytes of rows held in RAM."""
        return len(self._ram) * self.row_bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of rows written to the spill files."""
        return len(self._disk) * self.row_bytes

    def __contains__(self, key) -> bool:
        """Whether `key` has a row."""
        return key in self._ram or key in self._disk

    def put(self, key, rows: Sequence[np.ndarray]) -> None:
        """Store one example's rows under `key`, in RAM while the budget allows, else in
        the spill files. A key already held is left as it is.

        Args:
          key: a hashable example key.
          rows: one array per cut value, without the example axis (cast to the stored
            dtype).
        """
        rows = [np.asarray(r).astype(d, copy=False) for r, d in zip(rows, self._stored)]
        if key in self:
            return
        if (len(self._ram) + 1) * self.row_bytes <= self.budget_bytes:
            self._ram[key] = [r.copy() for r in rows]
            return
        n = len(self._disk)
        c, r = divmod(n, self._chunk)
        if c == len(self._chunks):
            self._chunks.append(self._new_chunk(c))
        for m, row in zip(self._chunks[c], rows):
            m[r] = row
        self._disk[key] = (c, r)

    def _new_chunk(self, c: int) -> list[np.memmap]:
        if self._spill_dir is None:
            self._spill_dir = tempfile.mkdtemp(prefix="pockjax-prefix-")
        os.makedirs(self._spill_dir, exist_ok=True)
        return [np.memmap(os.path.join(self._spill_dir, f"chunk{c}-value{i}.bin"), dtype=d,
                          mode="w+", shape=(self._chunk, *v.shape))
                for i, (v, d) in enumerate(zip(self.values, self._stored))]

    def get(self, keys: Sequence) -> list[np.ndarray]:
        """The stacked rows of `keys`, in the values' own dtypes.

        Args:
          keys: example keys, all present in the cache.

        Returns:
          One array per cut value, `[len(keys), *shape]`.
        """
        rows = []
        for k in keys:
            if k in self._ram:
                rows.append(self._ram[k])
            else:
                c, r = self._disk[k]
                rows.append([m[r] for m in self._chunks[c]])
        return [np.stack([row[i] for row in rows]).astype(v.dtype, copy=False)
                for i, v in enumerate(self.values)]

    def close(self) -> None:
        """Drop every row and remove the spill files this cache made."""
        self._ram.clear()
        self._disk.clear()
        self._chunks.clear()
        if self._own_dir and self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir = None


def _per_example(x, examples: int) -> bool:
    return is_dynamic(x) and np.ndim(x) >= 1 and np.shape(x)[0] == examples


def whole_digest(batch, examples: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for x in jax.tree_util.tree_leaves(batch):
        if is_dynamic(x) and not _per_example(x, examples):
            x = np.asarray(x)
            h.update(str((x.shape, x.dtype)).encode() + x.tobytes())
    return h.digest()


def example_keys(batch, examples: int) -> list[bytes]:
    """A content hash per example: the example's rows of every batch array with the
    example axis first, and every other batch leaf whole.

    Args:
      batch: the batch pytree.
      examples: the example count (the leading axis length that marks a per-example
        array).

    Returns:
      `examples` 16-byte BLAKE2b digests, in example order.
    """
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(batch) if is_dynamic(x)]
    whole = hashlib.blake2b(digest_size=16)
    for x in leaves:
        if not (x.ndim >= 1 and x.shape[0] == examples):
            whole.update(str((x.shape, x.dtype)).encode() + x.tobytes())
    keys = []
    for i in range(examples):
        h = whole.copy()
        for x in leaves:
            if x.ndim >= 1 and x.shape[0] == examples:
                h.update(str((x.shape[1:], x.dtype)).encode() + np.ascontiguousarray(x[i]).tobytes())
        keys.append(h.digest())
    return keys
