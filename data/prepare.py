"""Tokenize a text corpus into a token cache: DIR/train.bin, DIR/val.bin, DIR/meta.json and the tokenizer.

    python data/prepare.py --source ../shared/data/gutenberg --out data/cache/gutenberg --vocab_size 32000
    python data/prepare.py --source hf:roneneldan/TinyStories --out data/cache/tinystories --tokenizer gpt2

SRC is a local folder, file or glob of .txt / .jsonl / .json (optionally .gz/.bz2/.xz/.zst) / .parquet, or
hf:NAME[:CONFIG][@SPLIT] for a Hugging Face dataset. A .txt file is one document; a jsonl/parquet row is one
document (column "text"). A folder with train/ and val/ (or validation/) keeps that split; otherwise whole
documents are held out by a hash of their text, so no document is in both splits. The .bin files are flat
token ids (uint16, or uint32 for vocabularies over 65536), each document followed by the end-of-text token.
meta.json is written last and the folder is swapped in atomically, so a cache that has a meta.json is whole.
See docs/DATA.md.

Test hook: TINY_LLM_PREPARE_CRASH_AFTER=train.bin|val.bin|meta.json|rename makes the process die
(os._exit(1)) right after that step, to test that a killed run never leaves a half-written cache.
"""
import argparse
import codecs
import contextlib
import datetime
import glob
import hashlib
import importlib.util
import io
import itertools
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
import env  # noqa: E402
from data.loader import sha256_file  # noqa: E402  (the loader verifies what this hashes)
from results import atomic_write_text  # noqa: E402

FORMAT = 1
EOT = "<|endoftext|>"
BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets builders
COMPRESSIONS = ("", ".gz", ".bz2", ".xz", ".zst")  # decompressed by datasets' download manager
SUPPORTED = ".txt, .jsonl or .json, each optionally compressed as .gz, .bz2, .xz or .zst, or .parquet"
CRASH_ENV = "TINY_LLM_PREPARE_CRASH_AFTER"
BATCH = 64  # documents per map batch: whole books are ~0.5 MB each, so this bounds memory per worker


class PrepareError(ValueError):
    """Bad input to prepare(): the message is one sentence naming the input and what is accepted."""


def crash_point(step):
    if os.environ.get(CRASH_ENV) == step:
        os._exit(1)


# ----------------------------------------------------------------------------- local sources

def builder_of(path):
    name = path.name.lower()
    compressed = False
    for c in COMPRESSIONS[1:]:
        if name.endswith(c):
            name, compressed = name[: -len(c)], True
            break
    builder = BUILDERS.get(os.path.splitext(name)[1])
    # datasets reads parquet by its footer, which a compressed file hides (parquet compresses inside anyway)
    return None if compressed and builder == "parquet" else builder


def data_files_in(folder):
    """Supported files under `folder`, sorted. Other files (README, MANIFEST.tsv) are skipped with a note."""
    files, others = [], []
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts):
            (files if builder_of(p) else others).append(p)
    if not files:
        raise PrepareError(f"folder {str(folder)!r} holds no data files; supported: {SUPPORTED}")
    if others:
        print(f"note: skipping {len(others)} files of other types in {folder} ({', '.join(p.name for p in others[:3])}"
              f"{', ...' if len(others) > 3 else ''})")
    return files


def find_local(source):
    """({split: [files]}, base folder for relative names, split rule or None for a held-out split, builder)."""
    rule = None
    if glob.has_magic(source):
        files = sorted(Path(f) for f in glob.glob(source, recursive=True) if os.path.isfile(f))
        if not files:
            raise PrepareError(f"--source {source!r} is a glob that matches no file")
        # names are made relative to the glob's folder part before the first wildcard
        prefix = source[: min(source.find(c) for c in "*?[" if c in source)]
        base = Path(prefix) if prefix.endswith(os.sep) else Path(prefix).parent
        split_files = {"corpus": files}
    else:
        path = Path(source)
        if not path.exists():
            raise PrepareError(f"--source {source!r} does not exist; give a folder, a file or a glob of "
                               f"{', '.join(BUILDERS)} files, or hf:NAME[:CONFIG][@SPLIT]")
        if path.is_file():
            base, split_files = path.parent, {"corpus": [path]}
        else:
            base = path
            val_dir = next((path / v for v in ("val", "validation") if (path / v).is_dir()), None)
            if (path / "train").is_dir() and val_dir is not None:
                split_files = {"train": data_files_in(path / "train"), "val": data_files_in(val_dir)}
                rule = f"folders train/ and {val_dir.name}/"
            else:
                split_files = {"corpus": data_files_in(path)}
    files = [f for fs in split_files.values() for f in fs]
    bad = [f.name for f in files if builder_of(f) is None]
    if bad:
        raise PrepareError(f"--source {source!r} has files of an unsupported type ({', '.join(bad[:3])}); "
                           f"supported: {SUPPORTED}")
    builders = sorted({builder_of(f) for f in files})
    if len(builders) > 1:
        raise PrepareError(f"--source {source!r} mixes file types ({' and '.join(builders)}); "
                           f"use one type (.txt, or .jsonl/.json, or .parquet) per corpus")
    if any(f.name.endswith(".zst") for f in files):
        if importlib.util.find_spec("zstandard") is None:  # datasets needs it for .zst
            raise PrepareError(f"--source {source!r} has .zst files, which need the zstandard package "
                               f"(pip install zstandard)")
    return split_files, base, rule, builders[0]


# ----------------------------------------------------------------------------- Hugging Face sources

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


def parse_hf(source):
    """hf:NAME[:CONFIG][@SPLIT] -> (name, config or None, split or None)."""
    spec = source[3:]
    spec, _, split = spec.partition("@")
    name, _, config = spec.partition(":")
    if not name:
        raise PrepareError(f"--source {source!r} names no dataset; the syntax is hf:NAME[:CONFIG][@SPLIT]")
    return name, config or None, split or None


def open_hub(source, streaming):
    """({"train": ds, "val": ds or None}, split rule or None). Streaming gives IterableDatasets."""
    import datasets
    name, config, split = parse_hf(source)
    if not hub_reachable():
        raise PrepareError(f"cannot reach the Hugging Face hub to load dataset {name!r}; hf: sources need "
                           f"internet (or HF_HUB_OFFLINE=1 with the dataset already in the local datasets cache)")
    try:
        dd = datasets.load_dataset(name, config, streaming=streaming)
    except Exception as e:
        raise PrepareError(f"could not load Hugging Face dataset {name!r}"
                           f"{f' config {config!r}' if config else ''}: {str(e).splitlines()[0][:300]}") from None
    train_split = split or "train"
    if train_split not in dd:
        raise PrepareError(f"Hugging Face dataset {name!r} has no split {train_split!r} (it has {', '.join(dd)}); "
                           f"pick one with hf:NAME[:CONFIG]@SPLIT")
    val_split = next((s for s in ("validation", "val", "test") if s in dd and s != train_split), None)
    splits = {"train": dd[train_split], "val": dd[val_split] if val_split else None}
    return splits, (f"dataset split {val_split}" if val_split else None)


# ----------------------------------------------------------------------------- tokenizer

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
    batches = (b["text"] for b in train_ds.iter(batch_size=16))
    tok.train_from_iterator(batches, trainer, length=len(train_ds))
    if tok.get_vocab_size() < vocab_size:  # every word of the documents is one token: nothing is left to merge
        print(f"note: the BPE stopped at {tok.get_vocab_size():,} tokens, short of --vocab_size {vocab_size:,}, as "
              f"the training documents have no more pairs to merge; the cache's vocab_size is {tok.get_vocab_size():,}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, clean_up_tokenization_spaces=False)


def tokenizer_files_sha256(folder, names):
    h = hashlib.sha256()
    for name in sorted(names):
        h.update(name.encode() + b"\0")
        h.update((Path(folder) / name).read_bytes())
    return h.hexdigest()


def save_tokenizer(tok, folder):
    """Save into `folder`; returns the sha256 over the saved files (name + bytes, sorted by name)."""
    names = [Path(p).name for p in tok.save_pretrained(folder)]
    return tokenizer_files_sha256(folder, names)


# ----------------------------------------------------------------------------- dataset passes (run in workers)

def scan_batch(batch, seed):
    """Per document: keep (not blank) and u = first 8 bytes of sha256(text) / 2**64, the held-out draw."""
    salt = f"{seed}:".encode() if seed else b""
    keep, u = [], []
    for text in batch["text"]:
        keep.append(bool(text and text.strip()))
        digest = hashlib.sha256(salt + (text or "").encode("utf-8")).digest()
        u.append(int.from_bytes(digest[:8], "big") / 2**64)
    return {"keep": keep, "u": u}


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

def check_arguments(out, val_fraction, max_documents, num_proc):
    """The arguments that would fail or mean nothing, refused before any work; returns the process count."""
    if not 0 < val_fraction < 1:
        raise PrepareError(f"--val_fraction {val_fraction} must lie strictly between 0 and 1")
    if max_documents is not None and max_documents < 1:
        raise PrepareError(f"--max_documents {max_documents} must be at least 1")
    num_proc = num_proc or os.cpu_count() or 1
    if num_proc < 1:
        raise PrepareError(f"--num_proc {num_proc} must be at least 1")
    if out.exists() and not (out / "meta.json").exists() and (not out.is_dir() or any(out.iterdir())):
        # the cache replaces --out whole: never a folder (or file) that holds something else
        raise PrepareError(f"--out {str(out)!r} exists and is not a token cache; give a new folder, an empty one, "
                           f"or an existing cache")
    try:  # before any tokenizing: the cache and its lock file go beside --out
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrepareError(f"--out {str(out)!r}: its folder {str(out.parent)!r} cannot be made ({exc.strerror}); "
                           f"give a path in a writable folder") from None
    return num_proc


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


def prepare(source, out, tokenizer=None, vocab_size=32000, val_fraction=0.01, num_proc=None, seed=0,
            streaming=False, max_documents=None, max_vocab=None):
    """Build (or find up to date) the token cache `out` from `source`; returns its meta dict."""
    t0 = time.time()
    source, out = str(source), Path(out)
    num_proc = check_arguments(out, val_fraction, max_documents, num_proc)
    # 1. what the inputs are, hashed before any work, so an up-to-date cache is found without tokenizing
    hub = source.startswith("hf:")
    if hub:
        hub_splits, rule = open_hub(source, streaming)
        source_sha = env.hash_json({"hf": source, "max_documents": max_documents})
    else:
        split_files, base, rule, builder = find_local(source)
        listing = sorted([str(f.relative_to(base)), f.stat().st_size, sha256_file(f)]
                         for fs in split_files.values() for f in fs)
        source_sha = env.hash_json(listing if max_documents is None else [listing, max_documents])
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
        tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
        try:
            tmp.mkdir()
            if hub:
                splits = hub_to_datasets(hub_splits, streaming, max_documents, tmp)
            else:
                splits = local_to_datasets(source, split_files, builder, max_documents, tmp)
            meta = build(source, splits, tok, tok_name, vocab_size, val_fraction, num_proc, seed, rule, tmp)
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
    crash_point("meta.json")
    old = out.parent / f"{out.name}.old-{os.getpid()}"
    if out.exists():
        os.rename(out, old)
    crash_point("rename")
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def up_to_date(out, identity):
    """The cache's meta if it was built from the same inputs and its files are whole, else None."""
    try:
        meta = json.loads((out / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        ok = (meta.get("inputs_identity") == identity and (out / "tokenizer_config.json").exists()
              and (out / "train.bin").stat().st_size == meta["train_tokens"] * itemsize
              and (out / "val.bin").stat().st_size == meta["val_tokens"] * itemsize)
        return meta if ok else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def need_text(columns, what):
    if "text" not in columns:
        raise PrepareError(f"{what} has no 'text' column (its columns: {', '.join(columns)}); "
                           f"documents are read from a column named 'text'")


@contextlib.contextmanager
def quiet_datasets():
    """datasets' progress bars off for a while: reading local files, it labels them "Downloading data"."""
    import datasets
    was_disabled = datasets.are_progress_bars_disabled()
    with warnings.catch_warnings():  # HF_DATASETS_DISABLE_PROGRESS_BARS=0 wins, with a warning we don't need
        warnings.simplefilter("ignore")
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def local_to_datasets(source, split_files, builder, max_documents, tmp):
    """{"train", "val"} or {"corpus"} -> datasets.Dataset with one "text" column, one row per document."""
    import datasets
    files = [f for fs in split_files.values() for f in fs]
    size = sum(f.stat().st_size for f in files)
    print(f"reading {len(files)} files ({f'{size / 1e6:,.1f} MB' if size >= 10**5 else f'{size:,} bytes'}) "
          f"of --source {source}")
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:  # datasets' cache (decompressed files, arrow) goes into the tmp folder and leaves with it
        with quiet_datasets():
            dd = datasets.load_dataset(builder, data_files={k: [str(f) for f in v] for k, v in split_files.items()},
                                       cache_dir=str(tmp / "hf_cache"), **kwargs)
    except Exception as e:
        check_local_text(builder, files)  # names the file and place where it can find them
        raise PrepareError(f"could not read --source {source!r} as {builder} files: {str(e).splitlines()[0][:300]}") from None
    splits = {}
    for k in split_files:
        need_text(dd[k].column_names, f"--source {source!r}")
        if not holds_strings(dd[k].features["text"]):
            check_local_text(builder, split_files[k])
            raise PrepareError(f"the 'text' column of --source {source!r} holds {dd[k].features['text']}, not "
                               f"strings; each document's 'text' must be a string")
        ds = dd[k].select_columns(["text"])
        splits[k] = ds.select(range(min(max_documents, len(ds)))) if max_documents else ds
    return splits


# ----------------------------------------------------------------------------- what the text is (error path only)

JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object"}


def holds_strings(feature):
    """A "text" feature of strings; "null" is a column of nulls only, read as empty documents."""
    import datasets
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")


def open_local(path):
    """A corpus file as a binary stream, decompressed as datasets decompresses it."""
    import bz2
    import gzip
    import lzma
    suffix = path.suffix.lower()
    if suffix == ".zst":
        import zstandard
        return zstandard.open(path, "rb")
    return {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(suffix, open)(path, "rb")


def check_local_text(builder, files):
    """Raise the PrepareError naming the first file, and place in it, whose text datasets cannot take as
    documents: a byte that is not UTF-8 in a .txt, a 'text' that is not a string in a jsonl/json/parquet row.
    Returns when it finds none (the caller then reports datasets' own error)."""
    for path in files:
        if builder == "text":
            bad = first_non_utf8(path)
            if bad is not None:
                where = " of its decompressed text" if path.suffix.lower() in (".gz", ".bz2", ".xz", ".zst") else ""
                raise PrepareError(f"--source file {str(path)!r} is not UTF-8: byte offset {bad[0]:,}{where} "
                                   f"(0x{bad[1]:02x}) is not valid UTF-8; .txt files must be UTF-8 text "
                                   f"(iconv -f LATIN1 -t UTF-8 converts Latin-1)")
            continue
        found = first_non_string_parquet(path) if builder == "parquet" else first_non_string_json(path)
        if found is not None:
            where, what = found
            raise PrepareError(f"--source file {str(path)!r} {where} has a 'text' that is {what}, not a string; "
                               f"each document's 'text' must be a string (or null, read as an empty document)")


def first_non_utf8(path):
    """(offset, value) of the first byte that is not UTF-8 (counted in the decompressed bytes), or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0  # bytes fed to the decoder so far; it holds back the start of a character cut by a chunk
    with open_local(path) as f:
        while True:
            chunk = f.read(1 << 20)
            held = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                return done - held + e.start, e.object[e.start]
            if not chunk:
                return None
            done += len(chunk)


def first_non_string_json(path):
    """("line N" or "row N", what it holds) of the first row whose "text" is neither a string nor null, or None."""
    with io.TextIOWrapper(open_local(path), encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16)
        if head.lstrip().startswith("["):  # one JSON array of rows, which datasets too reads whole
            try:
                rows = enumerate(json.loads(head + f.read()))
            except ValueError:
                return None
            return next(((f"row {i + 1:,}", what) for i, row in rows if (what := non_string_text(row))), None)
        # split at "\n" alone: a JSON string may hold U+2028 and the like, which splitlines() would cut at
        first = (head + f.readline()).removesuffix("\n").split("\n")
        lines = itertools.chain(first, (line.removesuffix("\n") for line in f))
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                return None  # not JSON lines after all: datasets' own error says more
            if what := non_string_text(row):
                return f"line {n:,}", what
    return None


def non_string_text(row):
    """What a row's "text" is when it is neither a string nor null (JSON's name for it), else None."""
    text = row.get("text") if isinstance(row, dict) else None
    if text is None or isinstance(text, str):
        return None
    return JSON_TYPES.get(type(text), type(text).__name__)


def first_non_string_parquet(path):
    """("row N", its arrow type) of the first non-null "text" of a column that is not strings, or None."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        column = pq.read_table(path, columns=["text"]).column("text")
    except (OSError, KeyError, pa.ArrowException):
        return None
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_null(column.type):
        return None
    valid = np.flatnonzero(column.is_valid().to_numpy(zero_copy_only=False))
    return (f"row {int(valid[0]) + 1:,}", f"of type {column.type}") if len(valid) else None


def hub_to_datasets(hub_splits, streaming, max_documents, tmp):
    import datasets
    if hub_splits["val"] is None:
        hub_splits = {"corpus": hub_splits["train"]}  # no validation split: hold documents out by hash
    splits = {}
    for k, ds in hub_splits.items():
        if ds.column_names is not None:  # a streamed dataset may only know its columns from its rows
            need_text(ds.column_names, "the Hugging Face dataset")
            ds = ds.select_columns(["text"])
        if streaming:  # stream to a local jsonl (bounded memory), then read it back as a regular dataset
            path = tmp / f"stream-{k}.jsonl"
            with open(path, "w") as f:
                for n, row in enumerate(ds.take(max_documents) if max_documents else ds, 1):
                    need_text(list(row), "the Hugging Face dataset")
                    if what := non_string_text(row):
                        raise hub_text_error(k, f"row {n:,} of", f"has a 'text' that is {what}, not a string")
                    f.write(json.dumps({"text": row["text"]}) + "\n")
            with quiet_datasets():  # a local file: no "Downloading data"
                ds = datasets.load_dataset("json", data_files=str(path), cache_dir=str(tmp / "hf_cache"))["train"]
        else:
            if not holds_strings(ds.features["text"]):
                raise hub_text_error(k, "the 'text' column of", f"holds {ds.features['text']}, not strings")
            if max_documents:
                ds = ds.select(range(min(max_documents, len(ds))))
        splits[k] = ds
    return splits


def hub_text_error(split, where, found):
    split = "train" if split == "corpus" else split  # held out by hash: the corpus is the train split
    return PrepareError(f"{where} the Hugging Face dataset's {split} split {found}; each document's 'text' must "
                        f"be a string")


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
    scans = {k: run_map(ds, scan_batch, f"scan-{k}", fn_kwargs={"seed": seed}) for k, ds in splits.items()}
    keep = {k: np.asarray(s.data.column("keep").to_numpy(zero_copy_only=False), dtype=bool) for k, s in scans.items()}
    if sum(int(m.sum()) for m in keep.values()) == 0:
        raise PrepareError(f"--source {source!r} holds no documents with text "
                           f"({sum(len(m) for m in keep.values())} documents, all empty or blank)")
    if "corpus" in splits:
        u = scans["corpus"].data.column("u").to_numpy()
        is_val = keep["corpus"] & (u < val_fraction)
        if not is_val.any() and keep["corpus"].sum() >= 2:  # a tiny corpus still gets one val document,
            # with its copies: identical texts hash alike, and one on each side would be val text seen in training
            is_val = keep["corpus"] & (u == u[keep["corpus"]].min())
        index = {"train": np.flatnonzero(keep["corpus"] & ~is_val), "val": np.flatnonzero(is_val)}
        splits = {k: splits["corpus"].select(v) for k, v in index.items()}
    else:
        splits = {k: splits[k].select(np.flatnonzero(keep[k])) for k in ("train", "val")}
    for k in ("train", "val"):
        if len(splits[k]) == 0:
            hint = ("give at least 2 different documents with text, or a smaller --val_fraction"
                    if rule.startswith("held-out") else f"put documents with text in its {k} split")
            raise PrepareError(f"the {k} split of --source {source!r} is empty under the rule '{rule}'; {hint}")

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
        crash_point(f"{k}.bin")
    del scans, splits, ids  # release the memory-mapped arrow files before their folders go
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(tmp / "hf_cache", ignore_errors=True)
    return meta


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", required=True, help="folder, file or glob of .txt/.jsonl/.json/.parquet, or hf:NAME[:CONFIG][@SPLIT]")
    ap.add_argument("--out", required=True, help="cache folder to write (replaced atomically)")
    ap.add_argument("--tokenizer", help="transformers tokenizer (hub name or folder); default: train a byte-level BPE")
    ap.add_argument("--vocab_size", type=int, help="vocabulary of the trained BPE (default 32000)")
    ap.add_argument("--val_fraction", type=float, default=0.01, help="held-out fraction of documents when SRC has no val split")
    ap.add_argument("--num_proc", type=int, help="tokenizing processes (default: all cores)")
    ap.add_argument("--seed", type=int, default=0, help="salt of the held-out document hash (0: plain sha256)")
    ap.add_argument("--streaming", action="store_true", help="hf: sources only: stream instead of downloading whole")
    ap.add_argument("--max_documents", type=int, help="read at most N documents from each split")
    ap.add_argument("--max_vocab", type=int, help="fail if the tokenizer has more than N tokens (the model's vocabulary)")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.source, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size or 32000,
                       val_fraction=args.val_fraction, num_proc=args.num_proc, seed=args.seed,
                       streaming=args.streaming, max_documents=args.max_documents, max_vocab=args.max_vocab)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.tokenizer and args.vocab_size and meta["tokenizer"] == args.tokenizer:
        print(f"note: --vocab_size {args.vocab_size} was ignored: tokenizer {args.tokenizer!r} has {meta['vocab_size']} tokens")


if __name__ == "__main__":
    main()
