"""Tokenize a text corpus into a token cache: DIR/train.bin, DIR/val.bin, DIR/meta.json and the tokenizer.

    python data/prepare.py --source ../shared/data/gutenberg --out data/cache/gutenberg --vocab_size 32000
    python data/prepare.py --source hf:roneneldan/TinyStories --out data/cache/tinystories --tokenizer gpt2

SRC is a local folder, file or glob of .txt / .jsonl / .json (optionally .gz/.bz2/.xz/.zst) / .parquet, or
hf:NAME[:CONFIG][@SPLIT] for a Hugging Face dataset. A .txt file is one document; a jsonl/parquet row is one
document (column "text"). A folder with train/ and val/ (or validation/) keeps that split; otherwise whole
documents are held out by a hash of their text, so no document is in both splits. The .bin files are flat
token ids (uint16, or uint32 for vocabularies over 65536), each document followed by the end-of-text token.
meta.json is written last and the folder is swapped in atomically, so a cache that has a meta.json is whole.
data/sources.py finds, reads and splits the documents; data/diagnose.py says why an input is refused. See
docs/DATA.md.
"""
import argparse
import contextlib
import datetime
import glob
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
import env  # noqa: E402
from data import diagnose, sources  # noqa: E402
from data.diagnose import PrepareError  # noqa: E402  (prepare's one error type; callers catch it from here)
from data.sources import find_local, parse_hf  # noqa: E402,F401  (callers and tests reach them here)
from data.loader import tokenizer_size  # noqa: E402
from results import atomic_write_text  # noqa: E402

FORMAT = 1
EOT = "<|endoftext|>"
BATCH = 64  # documents per map batch: whole books are ~0.5 MB each, so this bounds memory per worker
VOCAB_SIZE = 32000  # the trained BPE's vocabulary unless --vocab_size says otherwise (the Llama tokenizer's size)
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
                               f"({str(e).splitlines()[0][:200]})") from None
    try:  # the local Hugging Face cache first: fast, and works offline
        return AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception:
        pass
    reason = "the Hugging Face hub cannot be reached"
    if hub_reachable():
        try:
            return AutoTokenizer.from_pretrained(spec)
        except Exception as e:
            reason = str(e).splitlines()[0][:200]
    raise PrepareError(f"could not load tokenizer {spec!r} ({reason}); give a local tokenizer folder, a name in "
                       f"the Hugging Face cache, or leave --tokenizer out to train a byte-level BPE of --vocab_size tokens")


def train_bpe(train_ds, vocab_size):
    """Byte-level BPE (GPT-2 style) trained on the training documents, streamed in batches to bound memory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # EOT is the only special token, so it gets id 0; the full byte alphabet means any text can be encoded
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=True,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bpe_training_texts(train_ds), trainer, length=len(train_ds))
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


def bpe_training_texts(train_ds):
    """Batches of training documents for the BPE trainer, each long run cut into pieces of LONG_RUN
    characters (see LONG_RUN); a note names the first document that has one."""
    n, noted = 0, False
    for batch in train_ds.iter(batch_size=16):
        texts = []
        for text in batch["text"]:
            n, runs = n + 1, long_runs(text)
            if runs and not noted:
                print(diagnose.long_run_note(n, text, runs, LONG_RUN))
                noted = True
            cuts = [c for a, b in runs for c in range(a + LONG_RUN, b, LONG_RUN)]
            texts += [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        yield texts


def save_tokenizer(tok, folder):
    """Save into `folder`; returns the sha256 over the saved files (name + bytes, sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(Path(p).name for p in tok.save_pretrained(folder)):
        h.update(name.encode() + b"\0")
        h.update((Path(folder) / name).read_bytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- tokens

def encode_batch(batch, tok, eot):
    # split_special_tokens: a literal "<|endoftext|>" inside a document is text, not a document boundary
    ids = tok(batch["text"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return {"ids": [x + [eot] for x in ids]}


def write_bin(ds, path, dtype):
    """Write the "ids" column in document order; returns (token count, sha256 of the bytes)."""
    from tqdm import tqdm
    h, n = hashlib.sha256(), 0
    with open(path, "wb") as f, tqdm(total=len(ds), desc=f"write {path.name}", unit="doc") as bar:
        for table in ds.with_format("arrow").iter(batch_size=1024):
            for chunk in table.column("ids").chunks:
                data = np.asarray(chunk.flatten().to_numpy(zero_copy_only=False), dtype=dtype).tobytes()
                f.write(data)
                h.update(data)
                n += len(data) // np.dtype(dtype).itemsize
            bar.update(table.num_rows)
        f.flush()
        os.fsync(f.fileno())
    return n, h.hexdigest()


# ----------------------------------------------------------------------------- prepare

def tokenizer_identity(tokenizer, vocab_size, max_vocab):
    """(loaded tokenizer or None for a BPE to train, its name, its size, its files' hash or None)."""
    tok = load_tokenizer(tokenizer, vocab_size)
    if tok is None:
        if vocab_size < 257:
            raise PrepareError(f"--vocab_size {vocab_size} is too small; a byte-level BPE needs at least 257 (256 bytes + end-of-text)")
        tok_name, tok_vocab, tok_files = f"bpe-{vocab_size}-trained", vocab_size, None
    else:
        if tok.eos_token_id is None:
            raise PrepareError(f"--tokenizer {tokenizer!r} has no end-of-text (eos) token; pick one that has")
        with tempfile.TemporaryDirectory() as d:  # its saved files identify it (a hub name alone may move)
            tok_name, tok_vocab, tok_files = tokenizer, len(tok), save_tokenizer(tok, d)
    if max_vocab is not None and tok_vocab > max_vocab:
        raise PrepareError(f"tokenizer {tok_name!r} has {tok_vocab} tokens but the model's vocabulary holds "
                           f"{max_vocab}; pick a smaller --vocab_size or tokenizer, or a model with a larger vocabulary")
    return tok, tok_name, tok_vocab, tok_files


def prepare(source, out, tokenizer=None, vocab_size=VOCAB_SIZE, val_fraction=0.01, num_proc=None, seed=0,
            streaming=False, max_documents=None, max_vocab=None):
    """Build (or find up to date) the token cache `out` from `source`; returns its meta dict."""
    t0 = time.time()
    source, out = str(source), Path(out)
    num_proc = diagnose.check_arguments(out, val_fraction, max_documents, num_proc)
    # 1. what the inputs are, hashed before any work, so an up-to-date cache is found without tokenizing
    read, rule, source_sha = sources.find_source(source, streaming, max_documents, hub_reachable, out)
    if rule is None:
        rule = f"held-out fraction {val_fraction} by document sha256" + (f" seed {seed}" if seed else "")
    tok, tok_name, tok_vocab, tok_files = tokenizer_identity(tokenizer, vocab_size, max_vocab)
    identity = env.hash_json([FORMAT, {"tokenizer": tok_name, "files_sha256": tok_files}, tok_vocab, source_sha, rule,
                            val_fraction if rule.startswith("held-out") else None])

    # 2. under a lock, so two prepares of one DIR don't interleave: recover, check the cache, build, swap
    from filelock import FileLock
    lock = str(out) + ".lock"
    try:  # filelock retries a lock file it cannot create forever; open it here so that the reason shows
        open(lock, "a").close()
    except OSError as exc:
        raise PrepareError(f"--out {out}: cannot write there ({exc.strerror or exc}); give a writable folder") from None
    with FileLock(lock):
        meta = recover_or_find(out, identity)
        if meta is not None:
            print(f"cache {out} is up to date (identity {identity[:16]})")
            return meta
        tmp = build_folder(out)
        try:
            tmp.mkdir()
            meta = build(source, read(tmp), tok, tok_name, vocab_size, val_fraction, num_proc, seed, rule, tmp)
            meta.update(source_sha256=source_sha, inputs_identity=identity, seconds=round(time.time() - t0, 1))
            meta["cache_identity"] = env.hash_json([meta["tokenizer_files_sha256"], source_sha, rule,
                                                  meta["train_sha256"], meta["val_sha256"]])
            swap_in(tmp, out, meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {out}: {meta['train_tokens']:,} train tokens ({meta['train_documents']} documents), "
          f"{meta['val_tokens']:,} val tokens ({meta['val_documents']} documents), vocabulary {meta['vocab_size']}, "
          f"{meta['seconds']:.1f} s")
    return meta


def build_folder(out):
    """Where this process builds the cache `out`: beside it (the swap is a rename), named by the process id."""
    return out.parent / f"{out.name}.tmp-{os.getpid()}"


def recover_or_find(out, identity):
    """Under the lock: clear what a killed run left, put back a whole old cache it moved away, and return the
    meta of a cache at `out` that is up to date with `identity` (else None)."""
    for p in out.parent.glob(glob.escape(out.name) + ".tmp-*"):  # left by a killed run
        shutil.rmtree(p, ignore_errors=True)
    olds = sorted(out.parent.glob(glob.escape(out.name) + ".old-*"))
    if not out.exists() and olds and (olds[-1] / "meta.json").exists():
        os.rename(olds.pop(), out)  # killed between the two renames: the old cache is whole, put it back
    if not (out / "meta.json").exists():
        return None
    for p in olds:
        shutil.rmtree(p, ignore_errors=True)
    return up_to_date(out, identity)


def swap_in(tmp, out, meta):
    """meta.json written last (a folder with one is complete), then the new folder renamed over the old."""
    atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1, sort_keys=True) + "\n")
    old = move_aside(out)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def move_aside(out):
    """Rename the previous cache, if any, to DIR.old-<pid>: a run killed before the next rename leaves it
    there whole, and the next run puts it back."""
    old = out.parent / f"{out.name}.old-{os.getpid()}"
    if out.exists():
        os.rename(out, old)
    return old


def up_to_date(out, identity):
    """The cache's meta if it was built from the same inputs and its files are whole, else None."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        ok = (meta.get("inputs_identity") == identity and (out / "tokenizer_config.json").exists()
              and (out / "train.bin").stat().st_size == meta["train_tokens"] * itemsize
              and (out / "val.bin").stat().st_size == meta["val_tokens"] * itemsize
              and tokenizer_size(out) in (None, meta["vocab_size"]))  # an edited meta.json is no cache
        return meta if ok else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ----------------------------------------------------------------------------- build

def build(source, splits, tok, tok_name, vocab_size, val_fraction, num_proc, seed, rule, tmp):
    """Split, train the tokenizer if needed, tokenize and write the bins into tmp; returns most of the meta."""
    import datasets
    work = tmp / "work"
    work.mkdir()

    def run_map(ds, fn, name, **kw):  # explicit cache file and fingerprint: no hashing of the tokenizer
        n = max(1, min(num_proc, len(ds)))
        return ds.map(fn, batched=True, batch_size=BATCH, writer_batch_size=BATCH, num_proc=n if n > 1 else None,
                      remove_columns=ds.column_names, cache_file_name=str(work / f"{name}.arrow"),
                      new_fingerprint=name, load_from_cache_file=False, desc=name, **kw)

    # blank documents are dropped; held-out documents are drawn by their text's hash, never by position
    scans = {k: run_map(ds, sources.scan_batch, f"scan-{k}", fn_kwargs={"seed": seed}) for k, ds in splits.items()}
    splits = sources.split_documents(source, splits, scans, val_fraction, rule)
    requested = vocab_size if tok is None else None  # a given tokenizer's size is its own, not asked for
    if tok is None:
        tok = train_bpe(splits["train"], vocab_size)
    tok_files = save_tokenizer(tok, tmp)
    eot = tok.eos_token_id
    dtype = "uint16" if len(tok) <= 2**16 else "uint32"
    tok.model_max_length = int(1e30)  # documents are long; only silences the "longer than max length" warning
    if num_proc > 1:  # tokenizers' own threads don't survive a fork: let each worker run single-threaded
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    features = datasets.Features({"ids": datasets.Sequence(datasets.Value(dtype))})
    meta = {"format": FORMAT, "tokenizer": tok_name, "tokenizer_files_sha256": tok_files, "vocab_size": len(tok),
            "vocab_size_requested": requested, "eot_token_id": int(eot), "dtype": dtype, "source": source,
            "split_rule": rule, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    for k in ("train", "val"):
        ids = run_map(splits[k], encode_batch, f"tokenize-{k}", fn_kwargs={"tok": tok, "eot": eot}, features=features)
        meta[f"{k}_tokens"], meta[f"{k}_sha256"] = write_bin(ids, tmp / f"{k}.bin", dtype)
        meta[f"{k}_documents"] = len(ids)
    del scans, splits, ids  # release the memory-mapped arrow files before their folders go
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(tmp / "hf_cache", ignore_errors=True)
    return meta


# ----------------------------------------------------------------------------- command line

def die_with_parent():
    """From now on each process the main thread forks (datasets' workers, their manager) is killed when this one
    ends, however it ends (Linux's PR_SET_PDEATHSIG): killed with -9, its workers tokenized on for many seconds."""
    if sys.platform.startswith("linux"):
        import ctypes, threading  # noqa: E401
        prctl = ctypes.CDLL(None).prctl  # looked up here: a dlopen in a child forked beside running threads can hang
        forking = []  # before a fork: the parent's pid if its main thread forks (whose end the child's signal follows)

        def child():
            if forking[-1]:
                prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
                if os.getppid() != forking[-1]:  # the parent ended before that: no signal would come
                    os._exit(1)
        os.register_at_fork(before=lambda: forking.append(threading.current_thread() is threading.main_thread()
                                                          and os.getpid()), after_in_parent=forking.pop,
                            after_in_child=child)


@contextlib.contextmanager
def stopped_by_signals(out):
    """While the command runs, SIGTERM or SIGINT ends it whole: the tokenizing workers are killed (each works
    through a whole shard, GBs for minutes, and would run on alone), the unfinished build is removed, and the
    process exits with 128 + the signal's number. No unwinding through datasets' pools, which can hang on a
    killed worker. The handler runs when the main thread next runs Python, which a BPE training or a
    one-process tokenizing batch can delay. A forked worker dies of the signal as if no handler were set."""
    import multiprocess  # datasets' pools, a fork of multiprocessing
    main_pid = os.getpid()
    die_with_parent()  # and of a SIGKILL, which no handler sees

    def stop(signum, frame):
        if os.getpid() != main_pid:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for child in multiprocess.active_children() + multiprocessing.active_children():
            child.kill()
        shutil.rmtree(build_folder(out), ignore_errors=True)
        # os.write: the main thread may be inside a write to stderr; "\n" ends a progress bar's line
        os.write(2, f"\nerror: stopped by {signal.Signals(signum).name}; the unfinished build was removed\n".encode())
        os._exit(128 + signum)
    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="folder, file or glob of .txt/.jsonl/.json/.parquet, or hf:NAME[:CONFIG][@SPLIT]")
    ap.add_argument("--out", required=True, help="cache folder to write (replaced atomically)")
    ap.add_argument("--tokenizer", help="transformers tokenizer (hub name or folder); default: train a byte-level BPE")
    ap.add_argument("--vocab_size", type=int, default=VOCAB_SIZE, help=f"vocabulary of the trained BPE (default {VOCAB_SIZE})")
    ap.add_argument("--val_fraction", type=float, default=0.01, help="held-out fraction of documents when SRC has no val split")
    ap.add_argument("--num_proc", type=int, help="tokenizing processes (default: all cores)")
    ap.add_argument("--seed", type=int, default=0, help="salt of the held-out document hash (0: plain sha256)")
    ap.add_argument("--streaming", action="store_true", help="hf: sources only: stream instead of downloading whole")
    ap.add_argument("--max_documents", type=int, help="read at most N documents from each split")
    ap.add_argument("--max_vocab", type=int, help="fail if the tokenizer has more than N tokens (the model's vocabulary)")
    args = ap.parse_args(argv)
    try:
        with stopped_by_signals(Path(args.out)):
            meta = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           val_fraction=args.val_fraction, num_proc=args.num_proc, seed=args.seed,
                           streaming=args.streaming, max_documents=args.max_documents, max_vocab=args.max_vocab)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.tokenizer and args.vocab_size != VOCAB_SIZE and meta["tokenizer"] == args.tokenizer:
        print(f"note: --vocab_size {args.vocab_size} was ignored: tokenizer {args.tokenizer!r} has {meta['vocab_size']} tokens")


if __name__ == "__main__":
    main()
