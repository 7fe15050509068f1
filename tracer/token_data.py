"""Real token data (`data.path`): a flat binary of token ids, the format of nanoGPT's train.bin and of
Megatron's raw token files (uint16 or uint32: `data.dtype`), or a .npy array (its own integer dtype).

A step's global batch is `global_batch` windows of seq_len + 1 consecutive tokens, at offsets drawn
from a generator seeded by (seed, step): every layout, rank and run reads the same batch and cuts it
by its own data parallelism, as with the synthetic tokens (tracer.generator.token_batch).
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch

from tracer.errors import ConfigError
from tracer.generator import seed_for

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_CHUNK = 1 << 24   # tokens per block when scanning a whole file


class TokenFile:
    """A token file, memory-mapped (never read whole)."""

    def __init__(self, path: str, dtype: str = "uint16"):
        self.path = path
        if not os.path.isfile(path):
            raise ConfigError(f"data.path={path} is not a file; give a flat binary of token ids "
                              "(nanoGPT's train.bin, Megatron's raw tokens) or a .npy array")
        if path.endswith(".npy"):
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as e:
                raise ConfigError(f"data.path={path} is not a readable .npy array ({e})") from None
            if arr.dtype.kind not in "iu":
                raise ConfigError(f"data.path={path} holds {arr.dtype} values; token ids are integers")
            self.tokens = arr.reshape(-1)
        else:
            if dtype not in DTYPES:
                raise ConfigError(f"data.dtype={dtype} is not a token file's dtype; use "
                                  f"{' or '.join(DTYPES)} (a .npy file carries its own)")
            size, item = os.path.getsize(path), np.dtype(DTYPES[dtype]).itemsize
            if size % item:
                raise ConfigError(f"data.path={path}: {size} bytes is not a whole number of {dtype} token "
                                  f"ids; is data.dtype right (uint16 for vocabularies under 65536)?")
            self.tokens = (np.memmap(path, dtype=DTYPES[dtype], mode="r") if size
                           else np.zeros(0, DTYPES[dtype]))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _need(self, seq_len: int) -> int:
        need = seq_len + 1
        if len(self) < need:
            raise ConfigError(f"data.path={self.path} holds {len(self)} tokens, fewer than one window of "
                              f"model.seq_len + 1 = {need}; give a longer file or a smaller model.seq_len")
        return need

    def _out_of_vocab(self, ids: np.ndarray, vocab: int, where: np.ndarray) -> None:
        bad = (ids >= vocab) | (ids < 0)
        if bad.any():
            i = int(np.flatnonzero(bad.reshape(-1))[0])
            raise ConfigError(f"data.path={self.path}: token id {int(ids.reshape(-1)[i])} at offset "
                              f"{int(where.reshape(-1)[i])} (in tokens) is outside model.vocab={vocab}; "
                              "use a model whose vocab covers the tokenizer's (model.vocab=...), or "
                              "re-tokenize the data")

    def check(self, seq_len: int, vocab: int | None) -> None:
        """The whole file: long enough for one window, every id in [0, vocab) (orchestrator, before
        anything is scheduled)."""
        self._need(seq_len)
        if vocab is None:
            return
        for start in range(0, len(self), _CHUNK):
            block = np.asarray(self.tokens[start:start + _CHUNK])
            if block.size and (int(block.max()) >= vocab or int(block.min()) < 0):
                self._out_of_vocab(block, vocab, np.arange(start, start + block.size))

    def batch(self, seed: int, step: int, global_batch: int, seq_len: int, vocab: int) -> torch.Tensor:
        """Token ids [global_batch, seq_len + 1] of data step `step` (inputs [:, :-1], labels [:, 1:])."""
        need = self._need(seq_len)
        g = torch.Generator().manual_seed(seed_for(seed, f"data.path/step{step}"))
        offsets = torch.randint(0, len(self) - need + 1, (global_batch,), generator=g).numpy()
        where = offsets[:, None] + np.arange(need)[None, :]
        ids = np.asarray(self.tokens[where]).astype(np.int64)
        self._out_of_vocab(ids, vocab, where)
        return torch.from_numpy(ids)


@lru_cache(maxsize=4)
def open_tokens(path: str, dtype: str = "uint16") -> TokenFile:
    return TokenFile(path, dtype)
