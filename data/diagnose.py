"""Why data/prepare.py refuses an input: the one-line PrepareError for a bad argument or corpus.

The checks here that prepare runs on every call are cheap (arguments, file names and types). The rest runs
only when something is wrong: after datasets has failed to read a corpus, the diagnosis reads the files again
to name the file and the line, row or byte offset at fault, which datasets' own errors do not; and a note
names a document whose long run of text would make BPE training slow.
"""
import codecs
import importlib
import importlib.util
import io
import itertools
import json
import os

import numpy as np

# the compressions datasets decompresses (by the name's suffix, in any case): the module whose open() reads each
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}
SUPPORTED = (f".txt, .jsonl or .json, each optionally compressed as {', '.join(list(COMPRESSIONS)[:-1])} or "
             f"{list(COMPRESSIONS)[-1]}, or .parquet")
JSON_TYPES = {bool: "a boolean", int: "a number", float: "a number", list: "an array", dict: "an object",
              str: "a string", type(None): "null"}
CACHE_KEYS = ("format", "tokenizer", "vocab_size", "dtype", "eot_token_id")  # in every meta.json prepare writes


class PrepareError(ValueError):
    """Bad input to prepare(): the message is one sentence naming the input and what is accepted."""


def first_line(exc, limit=200):
    """An exception's message for one line: its first line (at most `limit` characters), or its type's name when
    it has none (datasets raises some with an empty message)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


def compression_of(path):
    """The compression suffix of a corpus file's name ("" for none), in lower case."""
    return next((c for c in COMPRESSIONS if path.name.lower().endswith(c)), "")


# ----------------------------------------------------------------------------- refusals before any work

def check_arguments(out, val_fraction, max_documents, num_proc, target=None):
    """The arguments that would fail or mean nothing, refused before any work; returns the process count.
    `target`: the folder a --shard job writes (its part beside `out`), which it replaces whole as well."""
    if not 0 < val_fraction < 1:
        raise PrepareError(f"--val_fraction {val_fraction} must lie strictly between 0 and 1")
    if max_documents is not None and max_documents < 1:
        raise PrepareError(f"--max_documents {max_documents} must be at least 1")
    if num_proc is None:  # every core this process may use (taskset, a Slurm allocation); 0 is a mistake
        num_proc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if num_proc < 1:
        raise PrepareError(f"--num_proc {num_proc} must be at least 1")
    if not replaceable(out):
        raise PrepareError(f"--out {str(out)!r} exists and is not a token cache; give a new folder, an empty one, "
                           f"or an existing cache")
    if target is not None and not replaceable(target):
        raise PrepareError(f"--shard's part folder {str(target)!r} exists and is not a token cache's part; give an "
                           f"--out whose part folder is new, empty, or an existing part")
    try:  # before any tokenizing: the cache and its lock file go beside --out
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrepareError(f"--out {str(out)!r}: its folder {str(out.parent)!r} cannot be made ({exc.strerror}); "
                           f"give a path in a writable folder") from None
    return num_proc


def check_still_replaceable(out):
    """At the swap, after the build: --out, new or empty when the build began, may have been filled since."""
    if not replaceable(out):
        raise PrepareError(f"--out {str(out)!r} was filled with other files during the build; they are kept and the "
                           f"build discarded: give a new folder, an empty one, or an existing cache")


def check_saved_tokenizer(spec, folder, size):
    """A tokenizer whose tokenizer.json, saved into `folder`, holds another count of tokens than the loaded one
    (`size`: its tokenizer_config.json adds a token, its eos say) makes a cache that the loader refuses."""
    from data.loader import tokenizer_size
    saved = tokenizer_size(folder)
    if saved is not None and saved != size:
        raise PrepareError(f"--tokenizer {spec!r}: its tokenizer.json holds {saved} tokens but loaded it has {size} "
                           f"(its tokenizer_config.json adds some); save it again with transformers' "
                           f"save_pretrained so that its files agree, or give another tokenizer")


def replaceable(folder):
    """Whether prepare may replace `folder` whole: it does not exist, is an empty folder, or is_cache. Never a folder
    (or file) that holds something else, not even one with a meta.json of its own (a user's results, say)."""
    return not folder.exists() or is_cache(folder) or (folder.is_dir() and not any(folder.iterdir()))


def is_cache(folder):
    """Whether `folder` holds a meta.json that prepare wrote: a cache, an old copy of one, or a job's part."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and all(key in meta for key in CACHE_KEYS)


def check_file_types(source, files, builders):
    """Refuse a file of no supported type (builder None), a mix of types, and .zst files without zstandard."""
    bad = [f.name for f, builder in zip(files, builders) if builder is None]
    if bad:
        raise PrepareError(f"--source {source!r} has files of an unsupported type ({', '.join(bad[:3])}); "
                           f"supported: {SUPPORTED}")
    kinds = sorted(set(builders))
    if len(kinds) > 1:
        raise PrepareError(f"--source {source!r} mixes file types ({' and '.join(kinds)}); "
                           f"use one type (.txt, or .jsonl/.json, or .parquet) per corpus")
    if any(compression_of(f) == ".zst" for f in files):
        if importlib.util.find_spec("zstandard") is None:  # datasets needs it for .zst
            raise PrepareError(f"--source {source!r} has .zst files, which need the zstandard package "
                               f"(pip install zstandard)")


# ----------------------------------------------------------------------------- splits that come out empty

def empty_split_error(source, split, rule, draws, val_fraction):
    """The error for an empty train or val split. `draws`: the held-out draws of the documents with text
    (None when the split is the source's own), as copies of one text draw alike and stay together."""
    if draws is None:
        return PrepareError(f"the {split} split of --source {source!r} is empty under the rule '{rule}'; "
                            f"put documents with text in its {split} split")
    n, different = len(draws), len(np.unique(draws))
    documents = f"{n:,} document{'' if n == 1 else 's'} with text"
    if split == "val" or different < 2:
        copies = ", all copies of one text," if n > 1 and different == 1 else ""
        return PrepareError(f"--source {source!r} holds {documents}{copies} but a held-out split needs at least "
                            f"2 different documents, 1 for train and 1 for val (copies stay together); give more "
                            f"documents, or a folder with train/ and val/ subfolders")
    largest = np.floor(draws.max() * 100) / 100  # any --val_fraction up to the largest draw leaves train one
    fix = f"a --val_fraction of at most {largest:g}" if largest > 0 else "a smaller --val_fraction"
    return PrepareError(f"the train split of --source {source!r} is empty: all {documents} drew a held-out hash "
                        f"below --val_fraction {val_fraction}, so all went to val, and the split needs at least 1 "
                        f"document on each side; give {fix}, or more documents")


# ----------------------------------------------------------------------------- text that is not a string

def json_type(value):
    """JSON's name for what a row's "text" holds."""
    return JSON_TYPES.get(type(value), type(value).__name__)


def non_string_text(row):
    """What a row's "text" is when it is neither a string nor null (JSON's name for it), else None."""
    text = row.get("text") if isinstance(row, dict) else None
    return None if text is None or isinstance(text, str) else json_type(text)


def hub_text_error(split, where, found):
    split = "train" if split == "corpus" else split  # held out by hash: the corpus is the train split
    return PrepareError(f"{where} the Hugging Face dataset's {split} split {found}; each document's 'text' must "
                        f"be a string")


def check_local_text(builder, files):
    """Raise the PrepareError naming the first file, and place in it, whose text datasets cannot take as
    documents: a byte that is not UTF-8 in a .txt, a line of a JSON-lines file that is not JSON, a 'text' that is
    not a string in a jsonl/json/parquet row.
    A compressed file that does not decompress (truncated by an interrupted download, or not of its format) is
    named as such. Returns when it finds none (the caller then reports datasets' own error)."""
    for path in files:
        try:
            check_file_text(builder, path)
        except read_errors() as exc:
            if isinstance(exc, OSError) and exc.errno is not None:  # no permission, say
                raise PrepareError(f"--source file {str(path)!r} cannot be read ({exc.strerror})") from None
            raise PrepareError(f"--source file {str(path)!r} does not decompress as {path.suffix} data "
                               f"({type(exc).__name__}: {exc}): it is truncated (an interrupted download?) or not "
                               f"of that format; download it again, or move it out of the source") from None


def read_errors():
    """What reading a corpus file raises when it cannot be read or decompressed (gzip's BadGzipFile and bz2's
    bad data are OSErrors without an errno; a truncated stream is an EOFError)."""
    import lzma
    import zlib
    errors = (EOFError, OSError, zlib.error, lzma.LZMAError)
    if importlib.util.find_spec("zstandard") is not None:
        import zstandard
        errors += (zstandard.ZstdError,)
    return errors


def check_file_text(builder, path):
    """check_local_text for one file."""
    if builder == "text":
        bad = first_non_utf8(path)
        if bad is not None:
            where = " of its decompressed text" if compression_of(path) else ""
            raise PrepareError(f"--source file {str(path)!r} is not UTF-8: byte offset {bad[0]:,}{where} "
                               f"(0x{bad[1]:02x}) is not valid UTF-8; .txt files must be UTF-8 text "
                               f"(iconv -f LATIN1 -t UTF-8 converts Latin-1)")
        return
    if builder == "json" and holds_no_text(path):
        raise PrepareError(f"--source file {str(path)!r} holds no rows (it is empty or blank); give it rows with a "
                           f"'text', or remove it from the source")
    if builder == "parquet":
        found = first_non_string_parquet(path)
        found = found and (found[0], f"has a 'text' that is {found[1]}, not a string")
    else:
        found = first_bad_json_row(path)
    if found is not None:
        where, what = found
        if what is None:
            raise PrepareError(f"--source file {str(path)!r} {where} is not JSON; each line of a JSON-lines "
                               f"file must be one JSON object with a 'text'")
        raise PrepareError(f"--source file {str(path)!r} {where} {what}; each document must be an object whose "
                           f"'text' is a string (or null, read as an empty document)")


def open_local(path):
    """A corpus file as a binary stream, decompressed as datasets decompresses it."""
    compression = compression_of(path)
    opener = importlib.import_module(COMPRESSIONS[compression]).open if compression else open
    return opener(path, "rb")


def holds_no_text(path):
    """Whether a corpus file is empty or blank (whitespace only) once decompressed."""
    with open_local(path) as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


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


def row_problem(row):
    """What is wrong with a JSON row as a document, as a phrase ("has a 'text' that is a number, not a string"), or
    None: it is not an object, or its "text" is neither a string nor null. A row without "text" is read as an empty
    document, so it is a problem only where no row of its file has one (first_bad_json_row)."""
    if not isinstance(row, dict):
        return f"is {json_type(row)}, not an object"
    what = non_string_text(row)
    return what and f"has a 'text' that is {what}, not a string"


def first_bad_json_row(path):
    """("line N" or "row N", row_problem) of the first row that is no document, ("line N", None) of the first line
    of a JSON-lines file that is not JSON, the first row of a file in which no row has a "text" (a file of other
    columns beside files with one, which datasets cannot join), or None."""
    without_text, with_text = None, False
    for where, row in json_rows(path):
        if row is NOT_JSON:
            return where, None
        if isinstance(row, dict) and "text" not in row:
            without_text = without_text or (where, f"has no 'text' (its keys: {', '.join(map(str, row)) or 'none'})")
            continue
        with_text = with_text or isinstance(row, dict)
        if what := row_problem(row):
            return where, what
    return None if with_text else without_text


NOT_JSON = object()


def json_rows(path):
    """("line N" or "row N", row) of each row of a JSON or JSON-lines file, (line, NOT_JSON) at the first line of a
    JSON-lines file that is not JSON; nothing for a file that datasets too could not read."""
    with io.TextIOWrapper(open_local(path), encoding="utf-8", errors="replace") as f:
        head = f.read(1 << 16)
        if head.lstrip().startswith("["):  # one JSON array of rows, which datasets too reads whole
            try:
                rows = json.loads(head + f.read())
            except ValueError:
                return
            yield from ((f"row {i + 1:,}", row) for i, row in enumerate(rows))
            return
        # split at "\n" alone: a JSON string may hold U+2028 and the like, which splitlines() would cut at
        first = (head + f.readline()).removesuffix("\n").split("\n")
        lines = itertools.chain(first, (line.removesuffix("\n") for line in f))
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:  # not JSON lines: one JSON document over several lines (datasets reads it
                if not parses_whole(path):  # whole), or a line that is not JSON
                    yield f"line {n:,}", NOT_JSON
                return
            yield f"line {n:,}", row


def parses_whole(path):
    """Whether the file is one JSON document (a pretty-printed object, say): datasets reads such a file whole."""
    with io.TextIOWrapper(open_local(path), encoding="utf-8", errors="replace") as f:
        try:
            json.loads(f.read())
        except ValueError:
            return False
    return True


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


# ----------------------------------------------------------------------------- notes after the work

def ignored_options(args, meta, defaults):
    """Notes on prepare's options that the cache made did not use: a --vocab_size beside a --tokenizer of its own,
    and a --val_fraction or --seed where the split is the source's own (its folders, its hub splits)."""
    notes = []
    if args.tokenizer and args.vocab_size != defaults["vocab_size"] and meta["tokenizer"] == args.tokenizer:
        notes.append(f"--vocab_size {args.vocab_size} was ignored: tokenizer {args.tokenizer!r} has "
                     f"{meta['vocab_size']} tokens")
    if not args.join and not meta["split_rule"].startswith("held-out"):
        notes += [f"--{key} {getattr(args, key)} was ignored: the split is the source's own ({meta['split_rule']})"
                  for key in ("val_fraction", "seed") if getattr(args, key) != defaults[key]]
    return notes


# ----------------------------------------------------------------------------- text that trains slowly

def long_run_note(n, text, runs, piece):
    """One line about the longest of `runs` ((start, end) in training document n), which the BPE trains on in
    pieces of `piece` characters (data/prepare.py says why at LONG_RUN)."""
    start, end = max(runs, key=lambda run: run[1] - run[0])
    what = "whitespace characters" if text[start].isspace() else "characters without whitespace"
    return (f"note: training document {n:,} holds a run of {end - start:,} {what} (at character {start:,}: "
            f"{text[start:start + 20]!r}...); the BPE trains on runs of {piece:,} characters or more in pieces of "
            f"{piece:,}, as its training time grows with the square of a run's length")
