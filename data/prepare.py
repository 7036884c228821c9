"""Tokenize a text corpus into a token cache: DIR/meta.json, the tokenizer, and the train and val shards.

    python data/prepare.py --source ../shared/data/gutenberg --out data/cache/gutenberg --vocab_size 32000
    python data/prepare.py --source hf:roneneldan/TinyStories --out data/cache/tinystories --tokenizer gpt2

SRC is a local folder, file or glob of .txt / .jsonl / .json (optionally .gz/.bz2/.xz/.zst) / .parquet, or
hf:NAME[:CONFIG][@SPLIT] for a Hugging Face dataset. A .txt file is one document; a jsonl/parquet row is one
document (column "text"). A folder with train/ and val/ (or validation/) keeps that split; otherwise whole
documents are held out by a hash of their text, so no document is in both splits. The shards are flat token ids
(uint16, or uint32 for vocabularies over 65536), each document followed by the end-of-text token, in an order
shuffled from --shuffle_seed (-1: the source's). meta.json is written last and the folder is swapped in
atomically, so a cache that has a meta.json is whole. --shard I/N makes one of N independent jobs' parts, and
--join the cache from them, the same as one run's. data/sources.py finds and reads the documents, data/parts.py
tokenizes them and writes the shards (data/shards.py), data/diagnose.py says why an input is refused. See
docs/DATA.md.
"""
import argparse
import contextlib
import datetime
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
import env  # noqa: E402
from data import diagnose, parts, sources  # noqa: E402
from data.diagnose import PrepareError, first_line  # noqa: E402  (PrepareError: prepare's one error type)
from data.parts import encode_batch  # noqa: E402,F401  (callers and tests reach these here)
from data.sources import find_local, parse_hf  # noqa: E402,F401
from data.loader import CacheError, TokenCache, recorded_identity  # noqa: E402
from data.shards import SHARD_TOKENS  # noqa: E402
from data.stopping import stopped_by_signals  # noqa: E402
from results import atomic_write_text  # noqa: E402

FORMAT = 2  # shards; 1: one train.bin and one val.bin (the loader reads both)
EOT = "<|endoftext|>"
VOCAB_SIZE = 32000  # the trained BPE's vocabulary unless --vocab_size says otherwise (the Llama tokenizer's size)
VAL_FRACTION = 0.01  # the documents held out for val, by hash, when the source has no split of its own
SEED = 0  # the salt of the held-out hash (0: plain sha256)
SHUFFLE_SEED = 0  # the documents' order in the cache (-1: the source's)
# BPE training time grows with the square of the longest piece the pre-tokenizer leaves (a run of letters, digits,
# symbols or whitespace): a run of 100,000 letters (DNA, a long base64 or JSON value) adds seconds, one of 1,000,000
# minutes, with no progress shown. So runs of LONG_RUN or more characters without whitespace (or all whitespace)
# reach the trainer in pieces of LONG_RUN, with one note; the tokenizer still encodes them whole. No word of prose
# comes near LONG_RUN, so other corpora train exactly as before.
LONG_RUN = 10_000
WHITESPACE = np.array([9, 10, 11, 12, 13, 32, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                       0x205F, 0x3000])  # Unicode's White_Space, which the pre-tokenizer's \s matches


# ----------------------------------------------------------------------------- tokenizer

def hub_reachable():
    """A fast check: offline, the hub clients retry for ~30 s before failing; a DNS lookup fails at once."""
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "") or os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy"):
        return True  # offline mode reads the local cache; behind a proxy the clients know best
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=5).close()
        return True
    except OSError:
        return False


def load_tokenizer(spec, vocab_size):
    """A loaded transformers tokenizer, or None when no tokenizer is given and a BPE is to be trained."""
    if spec is None:
        return None
    from transformers import AutoTokenizer
    if Path(spec).exists():  # a local folder: failing to load it is the user's error, not a reason to train
        try:
            return AutoTokenizer.from_pretrained(spec)
        except Exception as e:
            raise PrepareError(f"--tokenizer {spec!r} is a path but not a loadable tokenizer folder "
                               f"({first_line(e)})") from None
    try:  # the local Hugging Face cache first: fast, and works offline
        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception:
        pass
    reason = "the Hugging Face hub cannot be reached"
    if hub_reachable():
        try:
            return AutoTokenizer.from_pretrained(spec)
        except Exception as e:
            reason = first_line(e)
    raise PrepareError(f"could not load tokenizer {spec!r} ({reason}); give a local tokenizer folder, a name in "
                       f"the Hugging Face cache, or leave --tokenizer out to train a byte-level BPE of --vocab_size tokens")


def train_bpe(batches, count, vocab_size):
    """Byte-level BPE (GPT-2 style) trained on the `count` training documents, streamed in batches of texts (in the
    source's order, whatever the cache's) to bound memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # EOT is the only special token, so it gets id 0; the full byte alphabet means any text can be encoded
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bpe_training_texts(batches), trainer, length=count)
    if tok.get_vocab_size() < vocab_size:  # every word of the documents is one token: nothing is left to merge
        print(f"note: the BPE stopped at {tok.get_vocab_size():,} tokens, short of --vocab_size {vocab_size:,}, as "
              f"the training documents have no more pairs to merge; the cache's vocab_size is {tok.get_vocab_size():,}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, clean_up_tokenization_spaces=False)


def long_runs(text):
    """(start, end) of each run of LONG_RUN or more characters that are all whitespace or all not."""
    if len(text) < LONG_RUN:
        return []
    space = np.isin(np.frombuffer(text.encode("utf-32-le"), np.uint32), WHITESPACE, kind="table")
    ends = np.concatenate(([0], np.flatnonzero(space[1:] != space[:-1]) + 1, [len(space)]))
    return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:]) if b - a >= LONG_RUN]


def bpe_training_texts(batches):
    """Batches of training documents for the BPE trainer, each long run cut into pieces of LONG_RUN
    characters (see LONG_RUN); a note names the first document that has one."""
    n, noted = 0, False
    for batch in batches:
        texts = []
        for text in batch:
            n, runs = n + 1, long_runs(text)
            if runs and not noted:
                print(diagnose.long_run_note(n, text, runs, LONG_RUN))
                noted = True
            cuts = [c for a, b in runs for c in range(a + LONG_RUN, b, LONG_RUN)]
            texts += [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        yield texts


def save_tokenizer(tok, folder, source=None):
    """Save into `folder`; returns the sha256 over the saved files (name + bytes, sorted by name). A file that the
    tokenizer's own folder `source` holds is kept as it is there: re-saved, tokenizer_config.json gains the options
    it was loaded with, and a cache made again with its own tokenizer would record another hash for it."""
    h = hashlib.sha256()
    for name in sorted(Path(p).name for p in tok.save_pretrained(folder)):
        if source is not None and (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(folder) / name)
        h.update(name.encode() + b"\0")
        h.update((Path(folder) / name).read_bytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- prepare

def tokenizer_identity(tokenizer, vocab_size, max_vocab, folder=None):
    """(loaded tokenizer or None for a BPE to train, its name, its size, its files' hash or None); `folder`: the
    tokenizer's own folder, whose files the cache keeps as they are."""
    tok = load_tokenizer(tokenizer, vocab_size)
    if tok is None:
        if vocab_size < 257:
            raise PrepareError(f"--vocab_size {vocab_size} is too small; a byte-level BPE needs at least 257 (256 bytes + end-of-text)")
        tok_name, tok_vocab, tok_files = f"bpe-{vocab_size}-trained", vocab_size, None
    else:
        if tok.eos_token_id is None:
            raise PrepareError(f"--tokenizer {tokenizer!r} has no end-of-text (eos) token; pick one that has")
        with tempfile.TemporaryDirectory() as d:  # its saved files identify it (a hub name alone may move)
            tok_name, tok_vocab, tok_files = tokenizer, len(tok), save_tokenizer(tok, d, folder)
            diagnose.check_saved_tokenizer(tokenizer, d, tok_vocab)
    if max_vocab is not None and tok_vocab > max_vocab:
        raise PrepareError(f"tokenizer {tok_name!r} has {tok_vocab} tokens but the model's vocabulary holds "
                           f"{max_vocab}; pick a smaller --vocab_size or tokenizer, or a model with a larger vocabulary")
    return tok, tok_name, tok_vocab, tok_files


def prepare(source, out, tokenizer=None, vocab_size=VOCAB_SIZE, val_fraction=VAL_FRACTION, num_proc=None, seed=SEED,
            streaming=False, max_documents=None, max_vocab=None, shuffle_seed=SHUFFLE_SEED, shard_tokens=SHARD_TOKENS, part=(0, 1)):
    """Build (or find up to date) the token cache `out` from `source`; returns its meta dict. part=(i, n) with n > 1:
    job i of n builds its part beside `out` instead (join() makes the cache of the n parts)."""
    t0 = time.time()
    source, out = str(source), Path(os.path.realpath(out))  # a link's target: the build and old copy go beside it
    num_proc = diagnose.check_arguments(out, val_fraction, max_documents, num_proc, parts.part_folder(out, part))
    parts.check_layout(shuffle_seed, shard_tokens, part, tokenizer)
    # 1. what the inputs are, hashed before any work, so an up-to-date cache is found without tokenizing
    read, rule, source_sha = sources.find_source(source, streaming, max_documents, hub_reachable)
    if rule is None:
        rule = f"held-out fraction {val_fraction} by document sha256" + (f" seed {seed}" if seed else "")
    folder = tokenizer if tokenizer is not None and Path(tokenizer).is_dir() else None  # its files kept as they are
    tok, tok_name, tok_vocab, tok_files = tokenizer_identity(tokenizer, vocab_size, max_vocab, folder)
    identity = env.hash_json([FORMAT, {"tokenizer": tok_name, "files_sha256": tok_files}, tok_vocab, source_sha, rule,
                              val_fraction if rule.startswith("held-out") else None, shuffle_seed, shard_tokens])
    job, target = part if part[1] > 1 else None, parts.part_folder(out, part)
    opts = dict(val_fraction=val_fraction, num_proc=num_proc, seed=seed, shuffle_seed=shuffle_seed,
                tokenizer_folder=folder, shard_tokens=shard_tokens, part=part)
    # 2. under a lock, so two prepares of one DIR don't interleave: recover, check the cache, build, swap
    with locked(target):
        meta = recover_or_find(target, identity, job)
        if meta is not None:
            print(f"{'part' if job else 'cache'} {target} is up to date (identity {identity[:16]})")
            return meta
        tmp = sources.aside(target, "tmp")
        try:
            sources.start_build(tmp)
            meta = build(source, read(tmp), tok, tok_name, vocab_size, rule, tmp, opts)
            meta.update(source_sha256=source_sha, inputs_identity=identity)
            swap_in(tmp, target, meta if job else finished(meta, t0))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if job:
        print(f"wrote part {part[0]}/{part[1]} {target}: {meta['documents']:,} documents; when all {part[1]} are "
              f"written, python data/prepare.py --out {out} --join")
    else:
        print(f"wrote {out}: {meta['train_tokens']:,} train tokens ({meta['train_documents']} documents; shards: "
              f"{len(meta['train_shards'])}), {meta['val_tokens']:,} val tokens ({meta['val_documents']} documents), "
              f"vocabulary {meta['vocab_size']}, {meta['seconds']:.1f} s")
    return meta


def finished(meta, t0):
    """The cache's meta with its identity (as the loader recomputes it from the recorded hashes) and build time."""
    meta.update(cache_identity=recorded_identity(meta), seconds=round(time.time() - t0, 1))
    return meta


@contextlib.contextmanager
def locked(folder):
    """A lock on DIR.lock for the whole build of DIR, so that two commands for one DIR don't interleave."""
    from filelock import FileLock
    lock = str(folder) + ".lock"
    try:  # filelock retries a lock file it cannot create forever; open it here so that the reason shows
        open(lock, "a").close()
    except OSError as exc:
        raise PrepareError(f"--out {folder}: cannot write there ({exc.strerror or exc}); give a writable folder") from None
    with FileLock(lock):
        yield


def recover_or_find(out, identity, job=None):
    """Under the lock: clear what a killed run left, put back a whole old cache it moved away, and return the
    meta of a cache (or a job's part) at `out` that is up to date with `identity` (else None)."""
    for p in sources.left_aside(out, "tmp"):  # left by a killed run
        shutil.rmtree(p, ignore_errors=True)
    olds = sources.left_aside(out, "old")
    if not out.exists() and olds and (olds[-1] / "meta.json").exists():
        sources.move_in(olds.pop(), out)  # killed between the two renames: the old cache is whole, put it back
    if not (out / "meta.json").exists():
        return None
    for p in olds:
        shutil.rmtree(p, ignore_errors=True)
    return up_to_date(out, identity, job)


def swap_in(tmp, out, meta):
    """meta.json written last (a folder with one is complete), then the new folder renamed over the old, checked
    again here: what a user put into a new --out while it was built is never replaced."""
    diagnose.check_still_replaceable(out)
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")
    old = sources.move_aside(out)
    sources.move_in(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def up_to_date(out, identity, job=None):
    """The meta of the cache (or job's part) at `out` if it was built from the same inputs and its files are whole
    (the loader's checks: every shard there at its size, meta.json agreeing with its tokenizer), else None."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        if meta.get("inputs_identity") != identity or meta.get("part") != (list(job) if job else None) \
                or not (out / "tokenizer_config.json").exists() or not (out / "tokenizer.json").exists():
            return None
        if job:
            return meta if parts.part_is_whole(out, meta) else None
        TokenCache(out)
        return meta
    except (OSError, ValueError, KeyError, TypeError, CacheError):
        return None


def join(out):
    """The cache `out` from the parts that its n --shard jobs wrote beside it: the one run's cache, bit for bit (but
    for its build time); the parts are removed once it is in place. Returns its meta."""
    t0, out = time.time(), Path(os.path.realpath(out))  # a link's target: the build and old copy go beside it
    folders = parts.part_folders(out)
    metas = [json.loads((f / "meta.json").read_text()) for f in folders]
    parts.check_whole(out, folders, metas)
    first = metas[0]
    diagnose.check_arguments(out, first["val_fraction"], None, 1)  # an --out that is not a cache is left alone
    if any(m["inputs_identity"] != first["inputs_identity"] for m in metas):
        raise PrepareError(f"--join {out}: its parts were made from different inputs (source, tokenizer or options); "
                           f"run every --shard job with the same command")
    with locked(out):
        meta = recover_or_find(out, first["inputs_identity"])
        if meta is None:
            tmp = sources.aside(out, "tmp")
            try:
                sources.start_build(tmp)
                parts.copy_tokenizer(folders[0], tmp)
                index = [parts.load_index(f) for f in folders]
                is_val = parts.held_out(np.concatenate(index), first["read"], first["val_fraction"],
                                        first["split_rule"], first["source"])
                meta = {k: v for k, v in first.items() if k not in parts.PART_KEYS}
                meta.update(parts.write_splits(list(zip(folders, index)), tmp, first["dtype"], first["shard_tokens"],
                                               is_val, consume=False), created=now())
                swap_in(tmp, out, finished(meta, t0))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    parts.remove(folders)
    print(f"joined {len(folders)} parts into {out}: {meta['train_tokens']:,} train tokens, {meta['val_tokens']:,} "
          f"val tokens")
    return meta


def now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ----------------------------------------------------------------------------- build

def build(source, docs, tok, tok_name, vocab_size, rule, tmp, opts):
    """Train the tokenizer if needed, tokenize, and write the shards into tmp (a job: its part); returns the meta."""
    requested = vocab_size if tok is None else None  # a given tokenizer's size is its own, not asked for
    if tok is None:  # the split first: the BPE learns from the train documents only, in the source's order
        index, read = parts.scan(docs, opts["seed"])
        is_val = parts.held_out(index, read, opts["val_fraction"], rule, source)
        tok = train_bpe(parts.train_texts(docs, is_val, index), int((~is_val).sum()), vocab_size)
    tok_files = save_tokenizer(tok, tmp, opts["tokenizer_folder"])
    dtype = "uint16" if len(tok) <= 2**16 else "uint32"
    tok.model_max_length = int(1e30)  # documents are long; only silences the "longer than max length" warning
    # one thread a process, so that num_proc is the cores used (and tokenizers' threads don't survive a fork)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    meta = {"format": FORMAT, "tokenizer": tok_name, "tokenizer_files_sha256": tok_files, "vocab_size": len(tok),
            "vocab_size_requested": requested, "eot_token_id": int(tok.eos_token_id), "dtype": dtype, "source": source,
            "split_rule": rule, "shuffle_seed": opts["shuffle_seed"], "shard_tokens": opts["shard_tokens"],
            "created": now()}
    job = opts["part"][1] > 1
    work = tmp if job else tmp / "work"
    work.mkdir(exist_ok=True)
    index, read = parts.tokenize(docs, tok, dtype, opts["seed"], opts["shuffle_seed"], opts["part"], opts["num_proc"],
                                 work)
    shutil.rmtree(tmp / "hf_cache", ignore_errors=True)  # the text's arrow files, read
    if job:
        return parts.save_part(tmp, index, dict(meta, part=list(opts["part"]), read=read,
                                                val_fraction=opts["val_fraction"]))
    is_val = parts.held_out(index, read, opts["val_fraction"], rule, source)
    meta.update(parts.write_splits([(work, index)], tmp, dtype, opts["shard_tokens"], is_val, consume=True))
    shutil.rmtree(work, ignore_errors=True)
    return meta


# ----------------------------------------------------------------------------- command line

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="folder, file or glob of .txt/.jsonl/.json/.parquet, or hf:NAME[:CONFIG][@SPLIT]")
    ap.add_argument("--out", required=True, help="cache folder to write (replaced atomically)")
    ap.add_argument("--tokenizer", help="transformers tokenizer (hub name or folder); default: train a byte-level BPE")
    ap.add_argument("--vocab_size", type=int, default=VOCAB_SIZE, help=f"vocabulary of the trained BPE (default {VOCAB_SIZE})")
    ap.add_argument("--val_fraction", type=float, default=VAL_FRACTION, help=f"held-out fraction of documents when SRC has no val split (default {VAL_FRACTION})")
    ap.add_argument("--num_proc", type=int, help="tokenizing processes (default: every core this process may use)")
    ap.add_argument("--seed", type=int, default=SEED, help="salt of the held-out document hash (0: plain sha256)")
    ap.add_argument("--streaming", action="store_true", help="read documents as they are tokenized: no copy on disk")
    ap.add_argument("--max_documents", type=int, help="read at most N documents from each split")
    ap.add_argument("--max_vocab", type=int, help="fail if the tokenizer has more than N tokens (the model's vocabulary)")
    ap.add_argument("--shuffle_seed", type=int, default=SHUFFLE_SEED, help=f"shuffle the documents from this seed (-1: source order; default {SHUFFLE_SEED})")
    ap.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS, help=f"tokens per shard (default {SHARD_TOKENS:,})")
    ap.add_argument("--shard", default="0/1", help="I/N: be job I of N, writing its part DIR.part-I-of-N; then --join")
    ap.add_argument("--join", action="store_true", help="make the cache --out from the parts of its N --shard jobs")
    args = ap.parse_args(argv)
    try:
        part = (0, 1) if args.join else parts.parse_part(args.shard)
        with stopped_by_signals(sources.aside(parts.part_folder(Path(os.path.realpath(args.out)), part), "tmp")):
            if args.join:
                meta = join(args.out)
            elif not args.source:
                raise PrepareError("--source is required: the corpus to tokenize (or --join, to make the cache from "
                                   "its --shard jobs' parts)")
            else:
                meta = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                               val_fraction=args.val_fraction, num_proc=args.num_proc, seed=args.seed,
                               streaming=args.streaming, max_documents=args.max_documents, max_vocab=args.max_vocab,
                               shuffle_seed=args.shuffle_seed, shard_tokens=args.shard_tokens, part=part)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for line in diagnose.ignored_options(args, meta, dict(vocab_size=VOCAB_SIZE, val_fraction=VAL_FRACTION, seed=SEED)):
        print(f"note: {line}")


if __name__ == "__main__":
    main()
