"""From documents to a cache's shards, on every core and in independent jobs: data/prepare.py's build.

Every document has an ordinal (its place in the source: the corpus, or train then val) and an order key: a hash of
(shuffle_seed, ordinal), or with shuffle_seed -1 the ordinal itself (the source's order). The cache is the split's
documents sorted by key, so any prefix of it samples the whole corpus. Tokenizing writes each document's tokens,
as they come, to the bucket file of its key's range (256 of them; the source's order: 4,096 documents a bucket),
with one index row per document. Then each bucket in turn is sorted and appended to the train and val shards, and
deleted: peak disk is the cache plus a bucket.

A job `--shard i/n` reads every document and tokenizes those whose ordinal is i modulo n into a part (its buckets,
its index and its tokenizer). Joining the n parts sorts all their index rows by (key, ordinal) as one run sorts
its own, so the joined cache is the one run's, bit for bit. Which documents are held out for validation is decided
there too, from every document's draw (a tiny corpus's fallback needs the smallest one).
"""
import collections
import glob
import hashlib
import itertools
import json
import multiprocessing
import shutil
import signal
from pathlib import Path

import numpy as np

from data import diagnose, sources
from data.diagnose import PrepareError
from data.shards import ShardWriter

SOURCE_ORDER = -1  # shuffle_seed for the source's own order (the caches made before shuffling)
STREAMS = ("corpus", "train", "val")  # index "stream": held out by hash, or the source's own split
INDEX = np.dtype([("key", "<u8"), ("ordinal", "<u8"), ("draw", "<f8"), ("stream", "u1"), ("bucket", "<u4"),
                  ("offset", "<u8"), ("length", "<u8")])
TASK_TEXT = 1 << 20  # characters of text per tokenizing task: a few hundred web pages, or one or two books
MAX_OPEN = 256       # bucket files open at once


def order_keys(ordinals, shuffle_seed):
    """The documents' order keys (uint64): the ordinal itself in the source's order, else a hash of it."""
    if shuffle_seed == SOURCE_ORDER:
        return np.asarray(ordinals, dtype=np.uint64)
    return np.array([int.from_bytes(hashlib.sha256(f"{shuffle_seed}:{o}".encode()).digest()[:8], "big")
                     for o in ordinals], dtype=np.uint64)


def bucket_of(keys, shuffle_seed):
    return (keys >> np.uint64(12 if shuffle_seed == SOURCE_ORDER else 56)).astype(np.uint32)


# ----------------------------------------------------------------------------- reading the documents

def tasks(streams, part, read):
    """(stream code, texts, ordinals) of this part's documents with text, in batches of about TASK_TEXT characters;
    the dict `read` gets each stream's count of documents read (blank ones too)."""
    i, n = part
    ordinal = 0
    for name, docs in streams.items():
        code, texts, ordinals, size, count = STREAMS.index(name), [], [], 0, 0
        for batch in docs.batches():
            for text in batch:
                if ordinal % n == i and text and text.strip():
                    texts.append(text)
                    ordinals.append(ordinal)
                    size += len(text)
                    if size >= TASK_TEXT:
                        yield code, texts, ordinals
                        texts, ordinals, size = [], [], 0
                ordinal, count = ordinal + 1, count + 1
        if texts:
            yield code, texts, ordinals
        read[name] = count


WORK = {}  # the tokenizer and its settings, set before the workers fork (each inherits them)


def encode_text(tok, text):
    """The token ids of a text (a list of ids), or of each of a list of texts, as a cache tokenizes a document."""
    # split_special_tokens: a literal "<|endoftext|>" inside a document is text, not a document boundary
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def encode_batch(batch, tok, eot):
    """{"ids": each document's tokens followed by end-of-text} for {"text": documents}: how a cache tokenizes one."""
    return {"ids": [x + [eot] for x in encode_text(tok, batch["text"])]}


def encode(code, texts, ordinals):
    """A task's documents tokenized and drawn: (code, ordinals, draws, lengths, ids)."""
    ids = encode_batch({"text": texts}, WORK["tok"], WORK["eot"])["ids"]
    lengths = np.array([len(x) for x in ids], dtype=np.uint64)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=WORK["dtype"], count=int(lengths.sum()))
    draws = np.array([sources.draw(t, WORK["seed"]) for t in texts], dtype=np.float64)
    return code, np.asarray(ordinals, dtype=np.uint64), draws, lengths, flat


def ordered_map(fn, work, num_proc):
    """fn(*task) of each task in order, on num_proc forked processes (this one alone when 1), with at most two
    tasks a process in flight, so that reading runs ahead of the tokenizing by a bounded amount of text."""
    if num_proc == 1:
        yield from (fn(*task) for task in work)
        return
    with multiprocessing.get_context("fork").Pool(num_proc, initializer=default_signals) as pool:
        pending = collections.deque()
        for task in work:
            pending.append(pool.apply_async(fn, task))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()  # the workers end as their queue does; the with's terminate() then has no one left to stop
        pool.join()


def default_signals():
    """A worker dies of SIGTERM and SIGINT at once. The Python handler it inherits from data/stopping.py runs only
    between bytecodes, so a SIGTERM from Pool.terminate() that arrives just before the worker blocks on its task
    queue was never handled, and the pool waited for that worker for ever."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_DFL)


# ----------------------------------------------------------------------------- a part

class Buckets:
    """A part's bucket files, appended to as documents come (a bounded number open at once)."""

    def __init__(self, folder, dtype):
        self.folder, self.dtype, self.files, self.sizes = Path(folder), np.dtype(dtype), {}, {}

    def append(self, buckets, lengths, flat):
        offsets, pos = np.zeros(len(lengths), dtype=np.uint64), 0
        for j, (b, n) in enumerate(zip(buckets.tolist(), lengths.tolist())):
            if b not in self.files:
                if len(self.files) >= MAX_OPEN:
                    self.close()
                self.files[b] = open(bucket_path(self.folder, b), "ab")
            offsets[j] = self.sizes.get(b, 0)
            self.files[b].write(flat[pos:pos + n].tobytes())
            self.sizes[b], pos = int(offsets[j]) + n, pos + n
        return offsets

    def close(self):
        for f in self.files.values():
            f.close()
        self.files = {}


def bucket_path(folder, bucket):
    return Path(folder) / f"bucket-{bucket:05d}.bin"


def tokenize(streams, tok, dtype, seed, shuffle_seed, part, num_proc, folder):
    """Tokenize this part's documents into bucket files in `folder`; returns (its index, documents read per
    stream)."""
    from tqdm import tqdm
    WORK.update(tok=tok, eot=tok.eos_token_id, dtype=np.dtype(dtype), seed=seed)
    buckets, rows, read = Buckets(folder, dtype), [], {}
    with tqdm(desc="tokenize", unit="doc") as bar:
        for code, ordinals, draws, lengths, flat in ordered_map(encode, tasks(streams, part, read), num_proc):
            keys = order_keys(ordinals, shuffle_seed)
            b = bucket_of(keys, shuffle_seed)
            offsets = buckets.append(b, lengths, flat)
            rows.append(index_rows(keys, ordinals, draws, code, b, offsets, lengths))
            bar.update(len(ordinals))
    buckets.close()
    return (np.concatenate(rows) if rows else np.zeros(0, INDEX)), read


def index_rows(keys, ordinals, draws, code, buckets, offsets, lengths):
    rows = np.zeros(len(keys), dtype=INDEX)
    rows["key"], rows["ordinal"], rows["draw"], rows["stream"] = keys, ordinals, draws, code
    rows["bucket"], rows["offset"], rows["length"] = buckets, offsets, lengths
    return rows


def scan(streams, seed):
    """Every document's index row without its tokens (draw and stream): where a BPE is trained, which documents are
    train documents is known before any tokenizing. Returns (index, documents read per stream)."""
    read = {}
    rows = [index_rows(np.zeros(len(o), np.uint64), np.asarray(o, np.uint64),
                       np.array([sources.draw(t, seed) for t in texts]), code, 0, 0, 0)
            for code, texts, o in tasks(streams, (0, 1), read)]
    return (np.concatenate(rows) if rows else np.zeros(0, INDEX)), read


def train_texts(streams, is_val, index, size=16):
    """Batches of `size` train documents' texts in the source's order (what the BPE trains on)."""
    train, batch = set(index["ordinal"][~is_val].tolist()), []
    for _, texts, ordinals in tasks(streams, (0, 1), {}):
        for text, o in zip(texts, ordinals):
            if o in train:
                batch.append(text)
            if len(batch) == size:
                yield batch
                batch = []
    if batch:
        yield batch


# ----------------------------------------------------------------------------- a job's part on disk

PART_KEYS = ("part", "read", "val_fraction", "documents", "bucket_bytes")  # a part's meta.json, not its cache's


def parse_part(text):
    """--shard I/N -> (I, N): job I of N, 0 <= I < N."""
    i, slash, n = str(text).partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        i = n = -1
    if not slash or not 0 <= i < n:
        raise PrepareError(f"--shard {text} is not I/N with 0 <= I < N (job I of N jobs, e.g. 0/8)")
    return i, n


def check_layout(shuffle_seed, shard_tokens, part, tokenizer):
    """The options of the cache's layout that cannot work, refused before any work."""
    if shuffle_seed < SOURCE_ORDER:
        raise PrepareError(f"--shuffle_seed {shuffle_seed} must be a seed of at least 0, or -1 for the source's order")
    if shard_tokens < 1:
        raise PrepareError(f"--shard_tokens {shard_tokens} must be at least 1")
    if part[1] > 1 and tokenizer is None:
        raise PrepareError(f"--shard {part[0]}/{part[1]} needs a --tokenizer, so that every job tokenizes alike; "
                           f"to train one, prepare a cache of a sample (--max_documents) and give its folder")


def part_folder(out, part):
    """Where job I of N writes its part: beside the cache, as DIR.part-I-of-N (one job writes the cache itself)."""
    return out if part[1] == 1 else out.parent / f"{out.name}.part-{part[0]}-of-{part[1]}"


def save_part(folder, index, meta):
    """A job's part: its index saved beside its buckets and tokenizer; returns its meta.json's fields."""
    np.save(Path(folder) / "index.npy", index)
    sizes = {bucket_path(folder, b).name: int(bucket_path(folder, b).stat().st_size)
             for b in np.unique(index["bucket"]).tolist()}
    return dict(meta, documents=len(index), bucket_bytes=sizes)


def part_is_whole(folder, meta):
    """Every bucket file there at its size, and an index of the part's documents that reads."""
    try:
        return all((folder / name).stat().st_size == size for name, size in meta["bucket_bytes"].items()) \
            and len(load_index(folder)) == meta["documents"]
    except (OSError, ValueError):  # a file missing, or an index cut short
        return False


def check_whole(out, folders, metas):
    """Refuse to join parts of which one is cut short (an interrupted copy from another node): its buckets would be
    read short, the cache made short and the parts deleted."""
    for folder, meta in zip(folders, metas):
        if not part_is_whole(folder, meta):
            raise PrepareError(f"--join {out}: the part {str(folder)!r} is not whole (a bucket file shorter than its "
                               f"meta.json records, or its index of another length); make it again with its --shard "
                               f"job, then join")


def load_index(folder):
    return np.load(Path(folder) / "index.npy")


def copy_tokenizer(part, folder):
    """The tokenizer's files that a job saved into its part (all but its index, buckets and meta.json)."""
    for f in sorted(Path(part).iterdir()):
        if f.is_file() and f.name != "meta.json" and f.name != "index.npy" and not f.name.startswith("bucket-"):
            shutil.copyfile(f, Path(folder) / f.name)


# ----------------------------------------------------------------------------- the cache from its parts

def held_out(index, read, val_fraction, rule, source):
    """Which index rows are validation documents; an empty split is refused (diagnose says what the inputs lack)."""
    if not len(index):
        raise PrepareError(f"--source {source!r} holds no documents with text ({sum(read.values())} documents, all "
                           f"empty or blank)")
    corpus = index["stream"] == STREAMS.index("corpus")
    draws = index["draw"][corpus] if corpus.any() else None
    if draws is None:
        is_val = index["stream"] == STREAMS.index("val")
    else:
        is_val = corpus & (index["draw"] < val_fraction)
        if not is_val.any() and corpus.sum() >= 2:  # a tiny corpus still gets one val document, with its copies:
            is_val = corpus & (index["draw"] == draws.min())  # identical texts draw alike
    for split, mask in (("train", ~is_val), ("val", is_val)):
        if not mask.any():
            raise diagnose.empty_split_error(source, split, rule, draws, val_fraction)
    return is_val


def write_splits(parts, folder, dtype, shard_tokens, is_val, consume):
    """Append every part's documents, sorted by (key, ordinal), to the train and val shards in `folder`; with
    `consume`, each bucket's files are deleted once written. parts: [(part folder, its index)]. Returns meta.json's
    fields of the two splits."""
    index = np.concatenate([p[1] for p in parts])
    part_of = np.repeat(np.arange(len(parts)), [len(p[1]) for p in parts])
    order = np.lexsort((index["ordinal"], index["key"]))  # keys sort by bucket too: buckets are key ranges
    writers = {val: ShardWriter(folder, "val" if val else "train", dtype, shard_tokens) for val in (False, True)}
    maps, current = {}, None
    for row, p, val in zip(index[order], part_of[order].tolist(), is_val[order].tolist()):
        if row["bucket"] != current:
            done, maps, current = maps, {}, row["bucket"]
            finish_bucket(done, consume)
        if p not in maps:
            path = bucket_path(parts[p][0], int(current))
            maps[p] = (path, np.memmap(path, dtype=dtype, mode="r"))
        start = int(row["offset"])
        writers[val].write(maps[p][1][start:start + int(row["length"])])
        writers[val].documents += 1
    finish_bucket(maps, consume)
    return {**writers[False].close(), **writers[True].close()}


def finish_bucket(maps, consume):
    """A bucket's files are done: unmapped, and deleted with `consume`."""
    paths = [path for path, _ in maps.values()]
    maps.clear()
    for path in paths if consume else ():
        path.unlink()


def part_folders(out):
    """The parts of `out` that jobs wrote (DIR.part-I-of-N), by number; all of them, of one N, or refused. Only a
    folder named as part_folder names the part its meta.json says it is counts (not a user's DIR.part-0-of-2.bak,
    which --join would use and then remove)."""
    found = {}
    for p in out.parent.glob(f"{glob.escape(out.name)}.part-*-of-*"):
        try:
            part = json.loads((p / "meta.json").read_text()).get("part")
            i, n = part
        except (OSError, ValueError, AttributeError, TypeError):
            continue  # no part's meta.json
        if isinstance(i, int) and isinstance(n, int) and p == part_folder(out, (i, n)):
            found.setdefault(n, {})[i] = p
    if len(found) != 1:
        what = "no parts" if not found else f"parts of {' and of '.join(map(str, sorted(found)))} jobs"
        raise PrepareError(f"--join {out}: found {what} beside it; run the n jobs --shard 0/n .. n-1/n with the same "
                           f"--out first, and remove the parts of another n")
    (n, parts), = found.items()
    missing = sorted(set(range(n)) - set(parts))
    if missing:
        named = ", ".join(f"{i}/{n}" for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise PrepareError(f"--join {out}: {len(missing)} of the {n} parts are missing ({named}); run those --shard "
                           f"jobs first")
    return [parts[i] for i in range(n)]


def remove(folders):
    """The joined parts, and their lock files."""
    for f in folders:
        shutil.rmtree(f, ignore_errors=True)
        Path(f"{f}.lock").unlink(missing_ok=True)
