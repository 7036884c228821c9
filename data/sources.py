"""The documents of a --source for data/prepare.py: found (local files, or a Hugging Face dataset), and read as
datasets with one "text" column and one row per document (whole into arrow files, or streamed), in their order;
and each document's held-out draw, by which a corpus without its own split is split into train and val.
"""
import contextlib
import functools
import glob
import hashlib
import os
import warnings
from pathlib import Path

import env
from data import diagnose
from data.diagnose import PrepareError, first_line
from data.loader import sha256_file

BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # datasets builders
ASIDE_KINDS = ("tmp", "old")  # aside(): a cache's build, and the old copy it replaces
ASIDE_MARK = ".prepare-aside"  # in each folder aside() names while it is set aside: no user folder is taken for one


def find_source(source, streaming, max_documents, hub_reachable):
    """What `source` holds, found before any reading: (read(tmp) -> its datasets, split rule or None, the
    sha256 that identifies it). hub_reachable() says whether an hf: source can be loaded. The caches prepared in a
    source folder, and what prepare leaves beside them, are no part of it (made_by_prepare)."""
    if source.startswith("hf:"):
        name = parse_hf(source)[0]
        if not hub_reachable():
            raise PrepareError(f"cannot reach the Hugging Face hub to load dataset {name!r}; hf: sources need "
                               f"internet (or HF_HUB_OFFLINE=1 with the dataset already in the local datasets cache)")
        hub_splits, rule = open_hub(source, streaming)
        read = functools.partial(hub_to_datasets, hub_splits, streaming, max_documents)
        return read, rule, env.hash_json({"hf": source, "max_documents": max_documents})
    split_files, base, rule, builder = find_local(source)
    listing = sorted([str(f.relative_to(base)), f.stat().st_size, sha256_file(f)]
                     for fs in split_files.values() for f in fs)
    read = functools.partial(local_to_datasets, source, split_files, builder, max_documents, streaming)
    return read, rule, env.hash_json(listing if max_documents is None else [listing, max_documents])


# ----------------------------------------------------------------------------- local files

def builder_of(path):
    name = path.name.lower()
    compression = diagnose.compression_of(path)
    builder = BUILDERS.get(os.path.splitext(name.removesuffix(compression))[1])
    # datasets reads parquet by its footer, which a compressed file hides (parquet compresses inside anyway)
    return None if compression and builder == "parquet" else builder


def aside(out, kind, pid=None):
    """Where process `pid` (this one by default) builds the cache `out` (kind "tmp") or moves the cache it replaces
    ("old"): beside it, so that each is a rename. aside_of() knows these names by this one definition."""
    return out.parent / f"{out.name}.{kind}-{os.getpid() if pid is None else pid}"


def aside_of(path):
    """(the cache out, kind) when `path` is aside(out, kind, PID) for some process and carries ASIDE_MARK, else None
    (a user's DIR.old-backup, or DIR.old-2024, is no build of prepare's)."""
    for kind in ASIDE_KINDS:
        stem, _, pid = path.name.rpartition(f".{kind}-")
        if stem and pid.isascii() and pid.isdigit() and path == aside(path.parent / stem, kind, pid) \
                and (path / ASIDE_MARK).is_file():
            return path.parent / stem, kind
    return None


def start_build(tmp):
    """Make the build folder aside(out, "tmp"), marked as prepare's."""
    tmp.mkdir()
    (tmp / ASIDE_MARK).touch()


def move_aside(out):
    """Rename the previous cache, if any, to DIR.old-<pid>, marked as prepare's: a run killed before the next rename
    leaves it there whole, and the next run puts it back (move_in)."""
    old = aside(out, "old")
    if out.exists():
        (out / ASIDE_MARK).touch()
        os.rename(out, old)
    return old


def move_in(folder, out):
    """Rename a build or an old copy to `out`, without its mark (a copy a user makes of the cache is no old copy)."""
    (folder / ASIDE_MARK).unlink(missing_ok=True)
    os.rename(folder, out)


def left_aside(out, kind):
    """The builds ("tmp") or old copies ("old") of `out` that any process made (aside), by name; a folder the user
    named alike (DIR.old-backup) is none of them."""
    return sorted(p for p in out.parent.glob(glob.escape(out.name) + ".*") if aside_of(p) == (out, kind))


def made_by_prepare(path):
    """Whether `path`, in a source folder, is data/prepare.py's: a cache (diagnose.is_cache: the --out being made,
    another cache prepared there, an old copy, a job's part), or a cache's lock or build beside it (the build known by
    the lock that prepare takes first and leaves). A cache written into its source folder would otherwise become part
    of that source the next time, or of another cache's."""
    if path.name.endswith(".lock") and path.is_file():  # DIR.lock: no data file is named so
        return True
    owner = aside_of(path)
    if owner is not None and owner[0].with_name(owner[0].name + ".lock").exists():
        return True
    return path.is_dir() and diagnose.is_cache(path)


def walk(folder):
    """(data files, files of other types) under `folder`, each sorted; hidden files and made_by_prepare's are
    left out."""
    files, others, seen = [], [], set()
    for root, dirs, file_names in os.walk(folder, followlinks=True):  # as a ** glob does; each folder once
        if os.path.realpath(root) in seen:
            dirs[:] = []
            continue
        seen.add(os.path.realpath(root))
        root = Path(root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not made_by_prepare(root / d)]
        for p in (root / n for n in file_names if not n.startswith(".")):
            if p.is_file() and not made_by_prepare(p):
                (files if builder_of(p) else others).append(p)
    return sorted(files), sorted(others)


def data_files_in(folder):
    """Supported files under `folder`, sorted. Other files (README, MANIFEST.tsv) are skipped with a note; the
    caches prepared in it (made_by_prepare) are no part of it."""
    files, others = walk(folder)
    if not files:
        raise PrepareError(f"folder {str(folder)!r} holds no data files; supported: {diagnose.SUPPORTED}")
    if others:
        print(f"note: skipping {len(others)} files of other types in {folder} ({names(others)})")
    return files


def names(paths, base=None, shown=3):
    """The first `shown` paths' names (relative to `base`, if given), and "..." when there are more."""
    named = [str(p.relative_to(base)) if base else p.name for p in paths[:shown]]
    return ", ".join(named) + (", ..." if len(paths) > shown else "")


def in_prepared(path, base):
    """Whether `path`, or a folder it is in below `base`, is made_by_prepare's."""
    try:
        parts = path.relative_to(base).parts
    except ValueError:
        parts = (path.name,)
        base = path.parent
    return any(made_by_prepare(base.joinpath(*parts[:i])) for i in range(1, len(parts) + 1))


def find_local(source):
    """({split: [files]}, base folder for relative names, split rule or None for a held-out split, builder);
    the caches prepared in a source folder (made_by_prepare) are left out."""
    rule = None
    if glob.has_magic(source) and not Path(source).exists():  # a folder named "books [2024]" is that folder
        # names are made relative to the glob's folder part before the first wildcard
        prefix = source[: min(source.find(c) for c in "*?[" if c in source)]
        base = Path(prefix) if prefix.endswith(os.sep) else Path(prefix).parent
        files = sorted(Path(f) for f in glob.glob(source, recursive=True)
                       if os.path.isfile(f) and not in_prepared(Path(f), base))
        if not files:
            raise PrepareError(f"--source {source!r} is a glob that matches no file")
        split_files = {"corpus": files}
    else:
        path = Path(source)
        if not path.exists():
            raise PrepareError(f"--source {source!r} does not exist; give a folder, a file or a glob of "
                               f"{', '.join(BUILDERS)} files, or hf:NAME[:CONFIG][@SPLIT]")
        if path.is_file():
            base, split_files = path.parent, {"corpus": [path]}
        else:
            base, (split_files, rule) = path, split_folders(path)
    files = [f for fs in split_files.values() for f in fs]
    builders = [builder_of(f) for f in files]
    diagnose.check_file_types(source, files, builders)
    return split_files, base, rule, builders[0]


def split_folders(path):
    """({split: [files]}, split rule or None) of a source folder: its train/ and val/ (or validation/, or test/, as a
    hub dataset's splits are taken) folders, with a note naming the data files elsewhere in it, which are then left
    out; else the whole folder, held out by hash."""
    val_dir = next((path / v for v in ("val", "validation", "test") if (path / v).is_dir()), None)
    if not (path / "train").is_dir() or val_dir is None:
        return {"corpus": data_files_in(path)}, None
    split_files = {"train": data_files_in(path / "train"), "val": data_files_in(val_dir)}
    kept = {f for fs in split_files.values() for f in fs}
    left = [f for f in walk(path)[0] if f not in kept]
    if left:
        print(f"note: {len(left)} data files of {path} lie outside its train/ and {val_dir.name}/ folders and are "
              f"left out ({names(left, path)}); the split comes from those two folders")
    return split_files, f"folders train/ and {val_dir.name}/"


def local_to_datasets(source, split_files, builder, max_documents, streaming, tmp):
    """{"train", "val"} or {"corpus"} -> Documents, one per document: read into datasets' arrow files in the build
    folder (checked whole first), or with `streaming` straight from the files, as they are tokenized (no copy of
    the text on disk; a file that cannot be read is found when the reading reaches it)."""
    import datasets
    files = [f for fs in split_files.values() for f in fs]
    size = sum(f.stat().st_size for f in files)
    print(f"reading {len(files)} files ({f'{size / 1e6:,.1f} MB' if size >= 10**5 else f'{size:,} bytes'}) "
          f"of --source {source}")
    kwargs = {"sample_by": "document"} if builder == "text" else {}

    def failed(exc, split=None):
        diagnose.check_local_text(builder, split_files[split] if split else files)  # names the file and place
        raise PrepareError(f"could not read --source {source!r} as {builder} files: {first_line(exc, 300)}") from None
    try:  # datasets' cache (decompressed files, arrow) goes into the tmp folder and leaves with it
        with quiet_datasets():
            dd = datasets.load_dataset(builder, data_files={k: [glob.escape(str(f)) for f in v]  # names, not globs
                                                            for k, v in split_files.items()},
                                       cache_dir=str(tmp / "hf_cache"), streaming=streaming, **kwargs)
    except Exception as e:
        failed(e)
    splits = {}
    for k in split_files:
        what = f"--source {source!r}"
        if streaming:
            ds = dd[k].take(max_documents) if max_documents else dd[k]
            splits[k] = Documents(ds, what, functools.partial(failed, split=k), functools.partial(
                local_row_error, builder, split_files[k], what))
            continue
        need_text(dd[k].column_names, what)
        if not holds_strings(dd[k].features["text"]):
            diagnose.check_local_text(builder, split_files[k])
            raise PrepareError(f"the 'text' column of --source {source!r} holds {dd[k].features['text']}, not "
                               f"strings; each document's 'text' must be a string")
        ds = dd[k].select_columns(["text"])
        splits[k] = Documents(ds.select(range(min(max_documents, len(ds)))) if max_documents else ds, what)
    return splits


def local_row_error(builder, files, what, n, found):
    """A streamed local row whose 'text' is not a string: the file and line that hold it, else its row number."""
    diagnose.check_local_text(builder, files)
    return PrepareError(f"row {n:,} of {what} has a 'text' that is {found}, not a string; each document's 'text' "
                        f"must be a string (or null, read as an empty document)")


# ----------------------------------------------------------------------------- Hugging Face datasets

def parse_hf(source):
    """hf:NAME[:CONFIG][@SPLIT] -> (name, config or None, split or None)."""
    spec = source[3:]
    spec, _, split = spec.partition("@")
    name, _, config = spec.partition(":")
    if not name:
        raise PrepareError(f"--source {source!r} names no dataset; the syntax is hf:NAME[:CONFIG][@SPLIT]")
    return name, config or None, split or None


def open_hub(source, streaming):
    """({"train": ds, "val": ds or None}, split rule or None). Streaming gives IterableDatasets. The caller has
    checked that the hub can be reached."""
    import datasets
    name, config, split = parse_hf(source)
    try:
        dd = datasets.load_dataset(name, config, streaming=streaming)
    except Exception as e:
        raise PrepareError(f"could not load Hugging Face dataset {name!r}"
                           f"{f' config {config!r}' if config else ''}: {first_line(e, 300)}") from None
    train_split = split or "train"
    if train_split not in dd:
        raise PrepareError(f"Hugging Face dataset {name!r} has no split {train_split!r} (it has {', '.join(dd)}); "
                           f"pick one with hf:NAME[:CONFIG]@SPLIT")
    val_split = next((s for s in ("validation", "val", "test") if s in dd and s != train_split), None)
    splits = {"train": dd[train_split], "val": dd[val_split] if val_split else None}
    return splits, (f"dataset split {val_split}" if val_split else None)


def hub_to_datasets(hub_splits, streaming, max_documents, tmp):
    """{"train", "val"} or {"corpus"} -> Documents. Streamed, the rows are checked as they come (a streamed dataset
    may only know its columns and types from its rows), and nothing of the text is stored."""
    if hub_splits["val"] is None:
        hub_splits = {"corpus": hub_splits["train"]}  # no validation split: hold documents out by hash
    splits = {}
    for k, ds in hub_splits.items():
        if ds.column_names is not None:
            need_text(ds.column_names, "the Hugging Face dataset")
            ds = ds.select_columns(["text"])
        if streaming:
            ds = ds.take(max_documents) if max_documents else ds
            splits[k] = Documents(ds, "the Hugging Face dataset", row_error=functools.partial(hub_row_error, k))
            continue
        if not holds_strings(ds.features["text"]):
            raise diagnose.hub_text_error(k, "the 'text' column of", f"holds {ds.features['text']}, not strings")
        splits[k] = Documents(ds.select(range(min(max_documents, len(ds)))) if max_documents else ds,
                              "the Hugging Face dataset")
    return splits


def hub_row_error(split, n, found):
    return diagnose.hub_text_error(split, f"row {n:,} of", f"has a 'text' that is {found}, not a string")


class Documents:
    """One split's documents in their order, as batches of texts (a null text is an empty document). `ds`: a
    datasets Dataset, whose types were checked whole, or an IterableDataset, whose rows are checked as read:
    row_error(n, what it holds) is the error for row n's 'text' that is not a string, read_failed(exc) raises the
    one for a read that fails."""

    def __init__(self, ds, what, read_failed=None, row_error=None):
        self.ds, self.what, self.read_failed, self.row_error = ds, what, read_failed, row_error

    def batches(self, size=64):
        rows = iter(self.ds.iter(batch_size=size))
        n = 0
        while True:
            try:
                batch = next(rows)
            except StopIteration:
                return
            except Exception as exc:  # a streamed file that does not parse or decompress
                if self.read_failed is None:
                    raise
                self.read_failed(exc)
            texts = batch.get("text") if isinstance(batch, dict) else None
            if texts is None:
                need_text(list(batch), self.what)
            if self.row_error is not None:
                for i, text in enumerate(texts):
                    if not isinstance(text, (str, type(None))):
                        raise self.row_error(n + i + 1, diagnose.json_type(text))
            n += len(texts)
            yield texts


# ----------------------------------------------------------------------------- both

def need_text(columns, what):
    if "text" not in columns:
        raise PrepareError(f"{what} has no 'text' column (its columns: {', '.join(columns)}); "
                           f"documents are read from a column named 'text'")


def holds_strings(feature):
    """A "text" feature of strings; "null" is a column of nulls only, read as empty documents."""
    import datasets
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")


@contextlib.contextmanager
def quiet_datasets():
    """datasets' progress bars and error log off for a while: reading local files, it labels them "Downloading
    data", and a file it cannot parse it logs as a traceback (its logger's own "Logging error"), where the caller
    says what is wrong in one line."""
    import datasets
    was_disabled, verbosity = datasets.are_progress_bars_disabled(), datasets.logging.get_verbosity()
    with warnings.catch_warnings():  # HF_DATASETS_DISABLE_PROGRESS_BARS=0 wins, with a warning we don't need
        warnings.simplefilter("ignore")
        datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not was_disabled:
            datasets.enable_progress_bars()


# ----------------------------------------------------------------------------- train and val

def draw(text, seed):
    """A document's held-out draw: the first 8 bytes of sha256(text) (salted by a non-zero seed) / 2**64."""
    salt = f"{seed}:".encode() if seed else b""
    return int.from_bytes(hashlib.sha256(salt + (text or "").encode("utf-8")).digest()[:8], "big") / 2**64
