"""Reading token caches made by data/prepare.py: checked, memory-mapped, shuffled per epoch.

A training sequence i is tokens[i*T : i*T + T + 1] (inputs are the first T, targets the last T), so the
sequences of an epoch step by T and every token after the first is a target exactly once, up to the last
whole sequence: the (N - 1) % T tokens after it are never targets (639 of the reference recipe's 10M-token
subset), since a partial sequence would give one update another shape or padding. The order of an
epoch's sequences depends only on (seed, epoch), and update u takes the u-th slice of that order: two runs
with the same seed see the same tokens in the same updates whatever their micro-batch, accumulation or
number of GPUs. Only how an update's sequences are split into micro-batches depends on those.

A sequence-length schedule keeps each update's tokens, targets and order: a micro-batch's rows of T + 1 tokens are
cut into windows of C + 1 tokens that overlap by one (a reshape of the inputs and of the targets to rows of C), so
every target is still scored once, from a context of at most C tokens. A micro-batch is then (rows x T / C, C):
one shape per context, whatever the update's size. With context_windows the rows stay whole, (rows, T), and the
micro-batch carries its windows as two tensors of one shape for every context (window_tensors): the model then
restarts positions and keeps attention within each window, the same math in one shape.
"""
import hashlib
import json
import math
import queue
import threading
from pathlib import Path

import numpy as np
import torch

from data.shards import SPLITS, shard_list, split_tokens
from env import REPO, hash_json  # REPO: named when a relative data_dir is found there but not from here

IGNORE = -100  # target of a padded position: the loss skips it


class CacheError(ValueError):
    """A token cache that is missing, truncated, foreign or does not fit the model."""


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def recorded_identity(meta):
    """The cache_identity that a sharded cache's meta.json fields give: the tokenizer's files, the source, the split
    rule and each split's stream sha256 (data/prepare.py computes it so); None for a format-1 cache, whose fields
    may be of a cache written by hand."""
    if int(meta.get("format", 1)) < 2:
        return None
    return hash_json([meta["tokenizer_files_sha256"], meta["source_sha256"], meta["split_rule"],
                      meta["train_sha256"], meta["val_sha256"]])


class TokenCache:
    """The train and val tokens of a prepared folder (shards, or a format-1 cache's train.bin and val.bin), checked
    against its meta.json at the cost of a stat per shard: each file is there and of the size recorded, the shards
    add up to the split, and the recorded hashes give the recorded identity. Nothing is hashed or read at start: a
    file whose bytes changed at the same size is found by `python data/verify.py DIR`, which reads them all."""

    def __init__(self, path, verify=True, vocab_size=0):
        """verify: also check meta.json against the saved tokenizer's size and its identity against its hashes (off,
        the sizes only, for a caller that reads only the meta); vocab_size: the vocabulary the caller's model expects
        (0: the cache's); it completes the prepare command that the error for a missing cache suggests."""
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise CacheError(missing_cache(self.path, vocab_size))
        try:
            self.meta = json.loads(meta_path.read_text())
            self.dtype = np.dtype(self.meta["dtype"])
            self.identity = self.meta["cache_identity"]
            self.vocab_size = int(self.meta["vocab_size"])
            self.shards = {split: shard_list(self.meta, split) for split in SPLITS}
            counts = {split: int(self.meta[f"{split}_tokens"]) for split in SPLITS}
            expected = recorded_identity(self.meta) if verify else None
        except (ValueError, KeyError, TypeError) as exc:
            raise CacheError(f"{meta_path} is unreadable or incomplete ({type(exc).__name__}: {exc}); "
                             f"prepare the cache again") from None
        if expected not in (None, self.identity):
            raise CacheError(f"{meta_path}'s cache_identity is not the one its recorded hashes give: meta.json was "
                             f"edited or mixed with another cache's; prepare the cache again")
        tokens_in_tokenizer = tokenizer_size(self.path) if verify else None
        if tokens_in_tokenizer not in (None, self.vocab_size):  # else a model would be sized by a wrong number
            raise CacheError(f"{meta_path} says vocab_size {self.vocab_size} but the cache's tokenizer has "
                             f"{tokens_in_tokenizer} tokens: meta.json disagrees with its tokenizer (edited, or "
                             f"mixed with another cache's files); prepare the cache again")
        for split in SPLITS:
            setattr(self, split, self.open_split(split, counts[split]))

    def open_split(self, split, expected):
        """The split's tokens, memory-mapped, after the cheap checks of its shards' names and sizes."""
        maps = []
        for name, tokens, _ in self.shards[split]:
            path = self.path / name
            if Path(name).name != name or not path.is_file():
                raise CacheError(f"token cache {self.path} has no {name} (meta.json lists it in the {split} split); "
                                 f"prepare it again")
            size = path.stat().st_size
            if size % self.dtype.itemsize:
                raise CacheError(f"{path} holds {size} bytes, not a whole number of {self.dtype} tokens: it is "
                                 f"truncated or foreign; prepare the cache again")
            if size // self.dtype.itemsize != tokens:
                raise CacheError(f"{path} holds {size // self.dtype.itemsize} tokens but meta.json says {tokens}: "
                                 f"it is truncated or foreign; prepare the cache again")
            maps.append(np.memmap(path, dtype=self.dtype, mode="r") if tokens else np.zeros(0, self.dtype))
        if sum(len(m) for m in maps) != expected:
            raise CacheError(f"the {split} shards of {self.path} hold {sum(len(m) for m in maps)} tokens but "
                             f"meta.json says {expected}: it was edited or mixed; prepare the cache again")
        if expected < 2:  # else a validation over no tokens has loss 0.0, below any target
            raise CacheError(f"{self.path / self.shards[split][0][0] if self.shards[split] else self.path} holds "
                             f"{expected} tokens, as meta.json says: the cache's {split} split is empty, with no "
                             f"token to {'train' if split == 'train' else 'validate'} on; prepare the cache again "
                             f"from a source with {split} documents")
        return split_tokens(maps)


def missing_cache(path, vocab_size=0):
    """Why a token cache folder without meta.json is refused, and the command that prepares it; a relative path
    that the repository holds a cache at is said to be taken from the current folder (a script run from
    elsewhere)."""
    if not path.is_absolute() and (REPO / path / "meta.json").is_file() and (REPO / path).resolve() != path.resolve():
        return (f"token cache {path} has no meta.json here: relative paths are taken from the current folder "
                f"{Path.cwd()}, and the repository's {path} holds one; run from {REPO}, or give "
                f"data_dir={REPO / path}")
    return f"token cache {path} has no meta.json; prepare it first, e.g. {prepare_command(path, vocab_size)}"


def tokenizer_size(folder):
    """The size of the tokenizer saved in a cache folder (len() of the loaded tokenizer), or None without a
    tokenizer.json (a cache written by hand, as the tests do)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    try:
        return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    except Exception:  # unreadable: loading the tokenizer (sample.py) says so, with the reason
        return None


def prepare_command(out, vocab_size=0):
    """The command that makes the cache `out` from the shared corpus (prepare.py trains 32,000 tokens unless told)."""
    return (f"python data/prepare.py --source ../shared/data/gutenberg --out {out}"
            + (f" --vocab_size {vocab_size}" if vocab_size else ""))


def sequence_count(n_tokens, seq_len):
    """Whole training sequences in n_tokens tokens (the loader's docstring says what is left over)."""
    return max(0, (n_tokens - 1) // seq_len)


def read_rows(tokens, starts, seq_len, rows):
    """Inputs and targets (int64, `rows` x seq_len) of the sequences starting at `starts`.

    Rows past len(starts), and positions past the end of the tokens, are padding: input 0, target -100.
    """
    x = np.zeros((rows, seq_len), dtype=np.int64)
    y = np.full((rows, seq_len), IGNORE, dtype=np.int64)
    for r, start in enumerate(starts):
        chunk = np.asarray(tokens[start:start + seq_len + 1], dtype=np.int64)
        n = len(chunk) - 1
        if n > 0:
            x[r, :n] = chunk[:-1]
            y[r, :n] = chunk[1:]
    return torch.from_numpy(x), torch.from_numpy(y)


def epoch_order(n_sequences, seed, epoch):
    """The shuffled sequence order of an epoch: a function of (seed, epoch) alone."""
    return np.random.default_rng([seed, epoch]).permutation(n_sequences)


def step_value(steps, at, last):
    """The value of a schedule's steps ((value, until), ...) at `at`, the share of the run done: the first step
    whose until lies above it, else `last`."""
    return next((value for value, until in steps if at < until), last)


def split_context(x, y, context):
    """Rows of T inputs and targets as rows of `context`: row r's window j is tokens [jC, (j+1)C] of its T + 1,
    the next window starting at its last token, so the targets and their order stay the same."""
    return x.view(-1, context), y.view(-1, context)


def window_tensors(rows, seq_len, context, smallest):
    """A micro-batch's windows of `context` inside its rows of seq_len, as the model takes them: each position's
    place in its window (seq_len,), and the windows' starts over the rows' rows x seq_len tokens, int32, padded with
    windows of no tokens to as many as the smallest context makes (rows x seq_len / smallest + 1), so that neither
    tensor's shape depends on the context."""
    positions = torch.arange(seq_len) % context
    starts = torch.arange(0, rows * seq_len + 1, context, dtype=torch.int32)
    return positions, torch.cat((starts, starts.new_full((rows * seq_len // smallest + 1 - len(starts),),
                                                          rows * seq_len)))


def windowed(context_windows, contexts):
    """Whether a run's micro-batches keep their windows in whole rows: context_windows (the setting) where the run
    has more than one context (a seq_len_schedule); with one context the rows are its windows."""
    return bool(context_windows) and len(contexts) > 1


def sequence_lengths(seq_len, context_steps):
    """The contexts a run's micro-batches may take (one shape each), in order: seq_len and its schedule's."""
    return sorted({value for value, _ in context_steps} | {seq_len})


class TrainData:
    """The fixed training subset, cut into sequences and grouped into updates, over `epochs` epochs.

    context_steps ((context, until), ...) is the sequence-length schedule: an update's micro-batches are in windows
    of `context` (else seq_len) while the run's sequences before it are below `until` of its epochs x n_sequences."""

    def __init__(self, tokens, seq_len, sequences_per_update, seed, subset_tokens=0, epochs=1, context_steps=(),
                 context_windows=False):
        if subset_tokens:
            if subset_tokens > len(tokens):
                raise CacheError(f"train_subset_tokens {subset_tokens:,} exceeds the {len(tokens):,} training "
                                 f"tokens of the cache; use at most that, or 0 for all of them")
            tokens = tokens[:subset_tokens]
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.sequences_per_update = sequences_per_update
        self.n_sequences = sequence_count(len(tokens), seq_len)
        if self.n_sequences == 0:
            raise CacheError(f"the training subset ({len(tokens)} tokens) is shorter than one sequence of "
                             f"{seq_len + 1} tokens")
        self.epochs, self.context_steps = epochs, tuple(context_steps)
        self.context_windows = windowed(context_windows, self.contexts())
        self.updates_per_epoch = math.ceil(self.n_sequences / sequences_per_update)
        self.tokens_per_epoch = self.n_sequences * seq_len
        self._order_cache = (None, None)

    def context(self, epoch, update):
        """The context of an update's micro-batches: the schedule's step at the run's sequences before it."""
        done = epoch * self.n_sequences + update * self.sequences_per_update
        return step_value(self.context_steps, done / (max(self.epochs, 1) * self.n_sequences), self.seq_len)

    def contexts(self):
        """The contexts the run's micro-batches may take (one shape each), in order."""
        return sequence_lengths(self.seq_len, self.context_steps)

    def update_sequences(self, epoch, update):
        cached, order = self._order_cache
        if cached != epoch:  # the training loop and the prefetching thread both ask: each gets one whole pair
            order = epoch_order(self.n_sequences, self.seed, epoch)
            self._order_cache = (epoch, order)
        per = self.sequences_per_update
        return order[update * per:(update + 1) * per]

    def micro_batches(self, epoch, update, micro_batch_size, rank=0, world_size=1):
        """This rank's micro-batches of one update, each padded to micro_batch_size rows (in windows of the
        update's context), and the update's target-token count over all ranks.

        Ranks take disjoint contiguous shares of the update's sequences. Every rank makes the same number
        of micro-steps (so gradient syncs line up); a short share is padded with ignored rows, which keeps
        one batch shape per context for the whole run and so never triggers a recompile.
        """
        context = self.context(epoch, update)
        batches, n_tokens = self.batches_of(self.update_sequences(epoch, update), micro_batch_size, rank, world_size)
        if self.context_windows:  # whole rows, and their windows as tensors (window_tensors)
            smallest = min(self.contexts())
            return [(x, y, *window_tensors(len(x), self.seq_len, context, smallest)) for x, y in batches], n_tokens
        return [split_context(x, y, context) for x, y in batches], n_tokens

    def batches_of(self, sequences, micro_batch_size, rank=0, world_size=1):
        """micro_batches for any array of sequence indices (bench.py's partial-update probe picks its own)."""
        share = np.array_split(sequences, world_size)[rank]
        steps = math.ceil(math.ceil(len(sequences) / world_size) / micro_batch_size)
        batches = [read_rows(self.tokens, share[i * micro_batch_size:(i + 1) * micro_batch_size] * self.seq_len,
                             self.seq_len, micro_batch_size) for i in range(steps)]
        return batches, len(sequences) * self.seq_len


def eval_batch_count(n_tokens, seq_len, batch_size, max_tokens=0):
    """How many batches eval_batches yields for n_tokens tokens (a progress bar's total)."""
    scored = min(max_tokens or n_tokens, n_tokens) - 1
    return math.ceil(math.ceil(max(scored, 0) / seq_len) / batch_size)


def eval_batches(tokens, seq_len, batch_size, max_tokens=0):
    """(inputs, targets) over the first max_tokens tokens (0: all), every token after the first scored once.

    The last sequence may be short and the last batch may hold fewer rows: both are padded with ignored
    targets, so every batch has one shape.
    """
    if max_tokens:
        tokens = tokens[:max_tokens]
    starts = np.arange(0, max(len(tokens) - 1, 0), seq_len)
    for i in range(0, len(starts), batch_size):
        yield read_rows(tokens, starts[i:i + batch_size], seq_len, batch_size)


class Prefetcher:
    """Builds batches on a background thread and copies them to the device without blocking.

    On CUDA the batches are pinned, so the host-to-device copy overlaps the GPU's work on the last update.
    """

    def __init__(self, make_batches, keys, device, depth=2):
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.queue = queue.Queue(maxsize=depth)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(make_batches, keys), daemon=True)
        self.thread.start()

    def _put(self, item):
        """Queue an item unless the consumer has gone (then the thread ends instead of waiting forever)."""
        while not self.closed.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _work(self, make_batches, keys):
        try:
            for key in keys:
                batches, n_tokens = make_batches(key)
                if self.pin:
                    batches = [tuple(t.pin_memory() for t in batch) for batch in batches]
                if not self._put((key, batches, n_tokens)):
                    return
        except BaseException as exc:  # surface loader errors in the training thread
            self._put(exc)
        self._put(None)

    def close(self):
        """Stop the thread and wait for it (one batch at most): a daemon thread still in torch's C++ code when the
        interpreter exits is ended there by Python (pthread_exit), which aborts the process ("terminate called
        without an active exception") after a run that stopped cleanly."""
        self.closed.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=60)

    def __iter__(self):
        try:
            while True:
                item = self.queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                key, batches, n_tokens = item
                yield key, [tuple(t.to(self.device, non_blocking=True) for t in batch) for batch in batches], n_tokens
        finally:  # also when the consumer stops early (a signal, an error): let the thread end
            self.close()


def synthetic_batches(cfg, vocab, sequences_per_update, rank=0, world_size=1):
    """(data, make_batches(u)): a few updates of random tokens, cycled: the shapes of real data, no dataset needed
    (bench.py's data_mode=synthetic)."""
    rng = np.random.default_rng(cfg.seed)
    n_seq = 4 * sequences_per_update
    tokens = rng.integers(0, vocab, size=n_seq * cfg.seq_len + 1, dtype=np.int64)
    data = TrainData(tokens, cfg.seq_len, sequences_per_update, cfg.seed)
    return data, lambda u: data.micro_batches(0, u % data.updates_per_epoch, cfg.micro_batch_size, rank, world_size)


def batch_stream(make_batches, device, total):
    """(micro-batches, target tokens) of updates 0 .. total-1, prefetched onto the device."""
    for _, micro_batches, n_tokens in Prefetcher(make_batches, range(total), device):
        yield micro_batches, n_tokens
