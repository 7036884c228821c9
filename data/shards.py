"""The token files of a cache: each split a run of shards (train-000000.bin, ...), written as they fill, and read
back as one sequence of tokens.

A shard is flat token ids (meta["dtype"], no header) and holds SHARD_TOKENS tokens (the last one fewer); a document
may run on into the next shard, as in build-nanogpt's and llm.c's FineWeb shards, so the layout depends on the token
stream alone. meta.json lists each split's shards with their token counts and sha256; `<split>_sha256` is the sha256
of the split's whole stream (its shards' bytes in order), the same as the one file of a format-1 cache, so a cache's
identity names its tokens and not how they are cut. A format-1 cache (one train.bin and one val.bin, written before
shards) reads as a cache of one shard per split.
"""
import bisect
import hashlib
import os
from pathlib import Path

import numpy as np

SHARD_TOKENS = 100_000_000  # ~200 MB of uint16: as build-nanogpt's and modded-nanogpt's FineWeb shards
SPLITS = ("train", "val")


def shard_name(split, index):
    return f"{split}-{index:06d}.bin"


def shard_list(meta, split):
    """[(file name, tokens, sha256)] of a split's shards, as meta.json records them (a format-1 cache: one)."""
    if f"{split}_shards" not in meta:
        return [(f"{split}.bin", int(meta[f"{split}_tokens"]), meta[f"{split}_sha256"])]
    return [(s["file"], int(s["tokens"]), s["sha256"]) for s in meta[f"{split}_shards"]]


class ShardWriter:
    """Appends a split's tokens to its shards in `folder`, cutting a new shard every shard_tokens tokens, and hashes
    each shard and the whole stream as it writes (no second pass over the bytes)."""

    def __init__(self, folder, split, dtype, shard_tokens=SHARD_TOKENS):
        self.folder, self.split, self.dtype, self.shard_tokens = Path(folder), split, np.dtype(dtype), shard_tokens
        self.stream, self.shards, self.tokens, self.documents = hashlib.sha256(), [], 0, 0
        self.file = self.hash = None
        self.filled = 0  # tokens in the open shard

    def write(self, tokens):
        tokens = np.asarray(tokens, dtype=self.dtype)
        while len(tokens):
            if self.file is None:
                name = shard_name(self.split, len(self.shards))
                self.file, self.hash, self.filled = open(self.folder / name, "wb"), hashlib.sha256(), 0
                self.shards.append({"file": name, "tokens": 0, "sha256": None})
            piece, tokens = tokens[:self.shard_tokens - self.filled], tokens[self.shard_tokens - self.filled:]
            data = piece.tobytes()
            self.file.write(data)
            self.hash.update(data)
            self.stream.update(data)
            self.filled += len(piece)
            self.tokens += len(piece)
            if self.filled == self.shard_tokens:
                self._close_shard()

    def _close_shard(self):
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        self.shards[-1].update(tokens=self.filled, sha256=self.hash.hexdigest())
        self.file = None

    def close(self):
        """meta.json's fields for the split: its tokens, documents, stream sha256 and shards."""
        if self.file is not None:
            self._close_shard()
        s = self.split
        return {f"{s}_tokens": self.tokens, f"{s}_documents": self.documents, f"{s}_sha256": self.stream.hexdigest(),
                f"{s}_shards": self.shards}


class ShardedTokens:
    """The tokens of several shards (memory-mapped) as one sequence: len(), an int index, and slices of step 1. A
    slice within one shard is that shard's memmap slice (no copy, as a one-file cache gives); a slice across shards is
    a ShardedTokens again, which np.asarray() joins into one array: what read_rows and eval_batches take of it is
    small, and a training subset over many shards stays mapped, never read whole."""

    def __init__(self, parts):
        self.parts = [p for p in parts if len(p)] or list(parts[:1])
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + len(p))
        self.dtype = self.parts[0].dtype

    def __len__(self):
        return self.starts[-1]

    def __getitem__(self, index):
        if not isinstance(index, slice):
            i = int(index) + (len(self) if int(index) < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"token {index} of {len(self)}")
            k = bisect.bisect_right(self.starts, i) - 1
            return self.parts[k][i - self.starts[k]]
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise ValueError("sharded tokens are sliced with step 1 only")
        stop = max(start, stop)
        first = min(bisect.bisect_right(self.starts, start) - 1, len(self.parts) - 1)
        last = max(first, bisect.bisect_left(self.starts, stop) - 1)
        if first == last:
            return self.parts[first][start - self.starts[first]:stop - self.starts[first]]
        pieces = [self.parts[first][start - self.starts[first]:], *self.parts[first + 1:last],
                  self.parts[last][:stop - self.starts[last]]]
        return ShardedTokens(pieces)

    def __array__(self, dtype=None, copy=None):
        return np.concatenate([np.asarray(p, dtype=dtype) for p in self.parts])

    def astype(self, dtype):
        return np.asarray(self, dtype=dtype)


def split_tokens(memmaps):
    """A split's tokens: its one shard's memmap as it is, or the shards as one ShardedTokens."""
    return memmaps[0] if len(memmaps) == 1 else ShardedTokens(memmaps)
