"""Verify token caches whole: every byte of every shard against the sha256 that meta.json records for it and for
its split's stream, every token id inside the vocabulary, and one end-of-text token per document.

    python data/verify.py data/cache/gutenberg [DIR ...]

A run starts with TokenCache's cheap checks only (each shard there, of its recorded size; the recorded hashes give
the recorded identity), which cost a stat per shard however large the cache; this reads the whole cache once, so
it finds what those cannot: bytes changed at the same size. Exit status 0 when every cache is whole, else 2, with
one line naming the first file at fault.
"""
import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from data.loader import CacheError, TokenCache, tokenizer_size  # noqa: E402

CHUNK = 1 << 24  # bytes hashed at a time: bounded memory for shards of any size


def verify(path):
    """Check the cache at `path` whole; returns {"shards", "tokens", "seconds"}, or raises CacheError."""
    t0 = time.time()
    cache = TokenCache(path)
    if tokenizer_size(cache.path) is None:  # TokenCache allows none (a cache written by hand); a copy must hold it
        raise CacheError(f"{cache.path / 'tokenizer.json'} is missing or does not load: the cache cannot be decoded "
                         f"without it; copy it from the cache's source, or prepare the cache again")
    eot = cache.meta.get("eot_token_id")
    shards = tokens = 0
    for split in ("train", "val"):
        stream, documents = hashlib.sha256(), 0
        for name, count, sha256 in cache.shards[split]:
            digest, ends, largest = read_shard(cache.path / name, cache.dtype, stream, eot)
            if digest != sha256:
                raise CacheError(f"{cache.path / name} does not match its sha256 in meta.json (its bytes changed "
                                 f"after preparation); prepare the cache again")
            if largest >= cache.vocab_size:
                raise CacheError(f"{cache.path / name} holds token id {largest}, outside its vocabulary of "
                                 f"{cache.vocab_size}; prepare the cache again")
            documents, shards, tokens = documents + ends, shards + 1, tokens + count
        if stream.hexdigest() != cache.meta[f"{split}_sha256"]:
            raise CacheError(f"the {split} shards of {cache.path} do not give the {split}_sha256 of meta.json (shards "
                             f"swapped, or meta.json edited); prepare the cache again")
        recorded = cache.meta.get(f"{split}_documents")
        if eot is not None and recorded is not None and documents != recorded:
            raise CacheError(f"the {split} split of {cache.path} holds {documents} end-of-text tokens but meta.json "
                             f"says {recorded} documents; prepare the cache again")
    return {"shards": shards, "tokens": tokens, "seconds": time.time() - t0}


def read_shard(path, dtype, stream, eot):
    """(sha256 of the file, its end-of-text tokens, its largest token id), `stream` updated with its bytes."""
    h, ends, largest = hashlib.sha256(), 0, -1
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK - CHUNK % dtype.itemsize):
            h.update(chunk)
            stream.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            largest = max(largest, int(ids.max()))
            ends += int(np.count_nonzero(ids == eot)) if eot is not None else 0
    return h.hexdigest(), ends, largest


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("caches", nargs="+", help="token cache folders (data/prepare.py's --out)")
    args = ap.parse_args(argv)
    for path in args.caches:
        try:
            r = verify(path)
        except CacheError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{path}: whole ({r['shards']} shards, {r['tokens']:,} tokens, {r['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
