"""The one results file every script appends to, and the atomic writes everything this project saves goes
through (checkpoints, configs, plots, exports).

A record is made under a file lock and the file is replaced atomically; nothing already in it is dropped or
reordered (a replaced value moves to the top-level "history"), and a file that does not parse is refused.
"""
import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path


class ResultsFileError(RuntimeError):
    """The results file cannot be safely read or written."""


# The file's sections that are not training runs (a run is a top-level entry named by its --name, which may
# therefore not be one of these).
SECTIONS = frozenset({"environment", "benchmarks", "tuning", "profiles", "history", "matched-comparison",
                      "partial-probe", "trained-parity", "allocation-usage", "loss-microbench", "accumulation-check",
                      "ceilings", "time-to-target", "mlp-microbench", "evaluation", "lever-screens"})
# Those of them whose entries are named (results[section][name]): a merge joins them entry by entry (lever-screens:
# the #38 screens' entries, read back from their checkpoints, in the H200 time-to-quality files).
NAMED_SECTIONS = frozenset({"benchmarks", "profiles", "evaluation", "time-to-target", "lever-screens"})


_UMASK = os.umask(0o022)  # read once, at import (single-threaded): os.umask can only be read by setting it
os.umask(_UMASK)


def new_file_mode():
    """The mode open() gives a new file here (0o666 less the umask): what every file this project writes gets."""
    return 0o666 & ~_UMASK


def real_path(path):
    """The file `path` names: through a symbolic link, its target (results.json linked to results/h200.json is
    that file, replaced there and locked beside it, never swapped for a plain copy of it)."""
    return Path(os.path.realpath(path))


class _Watched:
    """The temporary file as write() sees it, keeping the OSError a write raised: torch.save reports a full disk
    as its own RuntimeError ("enforce fail at inline_container.cc"), which hides "No space left on device"."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def __getattr__(self, name):
        return getattr(self.f, name)


def atomic_write(path, write):
    """Call write(f) on a temporary file in the same folder, fsync, then rename over `path` (over a symbolic
    link's target). An OSError of the file's writes (a full disk) is raised as such, whatever write() made of it.

    Readers see the old file or the new one, never half of one, even if this process is killed.
    """
    path = real_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    watched = None
    try:
        # mkstemp makes the file owner-only; keep the replaced file's mode, or what open() would have given
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else new_file_mode())
        with os.fdopen(fd, "wb") as f:
            watched = _Watched(f)
            write(watched)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if watched is not None and watched.error and not isinstance(exc, OSError):
            raise watched.error from None
        raise


def atomic_write_text(path, text):
    atomic_write(path, lambda f: f.write(text.encode()))


def _flat(value):
    """A value whose JSON has no nested object or list: written on one line."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return items is not None and not any(isinstance(v, (dict, list)) for v in items)


def finite(value):
    """value with every float that is NaN or infinite, at any depth, replaced by None.

    Strict JSON has no NaN or Infinity: json.dumps writes them, but most other parsers (jq, JavaScript, a
    strict json.loads) refuse the whole file for one diverged run's loss. null keeps the field and says that
    there was no finite value; the plots skip a point without a loss."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def dumps(value, indent=0):
    """Strict JSON as json.dumps(indent=2) writes it, except that an object or a list holding no others is one
    line: a curve is one line per point and a list of numbers one line, so that a person can read the file.
    Non-finite floats are written as null (finite() says why)."""
    if not isinstance(value, (dict, list)) or not value or _flat(value):
        return json.dumps(finite(value), default=str, allow_nan=False)
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        inner = [f"{pad}{json.dumps(str(k))}: {dumps(v, indent + 2)}" for k, v in value.items()]
        return "{\n" + ",\n".join(inner) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(pad + dumps(v, indent + 2) for v in value) + "\n" + " " * indent + "]"


def read_existing_results(path):
    """read_results of a file that a report reads (plots, summaries): one that does not exist, or a folder, is an
    error, not an empty file."""
    if not Path(path).is_file():
        raise ResultsFileError(f"results file {path} " + ("is not a file" if Path(path).exists() else "does not exist"))
    return read_results(path)


def read_results(path):
    """The results file as a dict ({} when it does not exist yet); a file that does not parse, is not UTF-8 or is
    not a regular file is an error."""
    path = Path(path)
    if not path.exists():
        return {}
    if not path.is_file() and not path.is_dir():  # /dev/full or /dev/zero read forever, a pipe blocks
        raise ResultsFileError(f"results file {path} is not a regular file (a device, a pipe or a socket); pass "
                               f"--results_file a JSON file's path")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:  # a folder, or no permission
        raise ResultsFileError(f"results file {path} cannot be read ({exc.strerror}); pass another --results_file") from None
    except UnicodeDecodeError as exc:  # a hand-edited note in Latin-1, say
        raise ResultsFileError(f"results file {path} is not UTF-8 text: byte {exc.start:,} is "
                               f"0x{exc.object[exc.start]:02x}; it was left as it is: write that character in UTF-8 "
                               f"(as JSON files are), or pass another --results_file") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"results file {path} is not valid JSON ({exc}); it was left as it is: "
                               f"fix or move it, or pass another --results_file") from None
    if not isinstance(data, dict):
        raise ResultsFileError(f"results file {path} holds a {type(data).__name__}, not a JSON object; "
                               f"it was left as it is: pass another --results_file")
    history = data.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        # every writer appends replaced entries there, and merge_results reads them as objects
        what = f"a {type(history).__name__}" if not isinstance(history, list) else "a list holding non-objects"
        raise ResultsFileError(f"results file {path}: its field 'history' is {what}, not the list of replaced "
                               f"entries (objects); it was left as it is: fix or move it, or pass another "
                               f"--results_file")
    return data


def _lock(path):
    """The lock beside the results file. Its file is opened here first: filelock retries a lock file it
    cannot create (in /proc, say) until its timeout, ten minutes of silence for a user's wrong path."""
    from filelock import FileLock
    lock = str(path) + ".lock"
    with open(lock, "a"):
        pass
    return FileLock(lock, timeout=600)


def check_writable(path, sections=()):
    """A ResultsFileError now, before a script's work, if the results file's folder cannot hold its lock (the
    file itself is replaced by a rename in that folder, so the folder is what must be writable), or if a file
    there is not one of results (a folder, an empty path, a device, or a file that is not valid JSON), or holds
    something else than an object at one of `sections` (each a key or a list of keys: where the script records
    its entries, bench.py's "benchmarks", say)."""
    if not str(path).strip() or Path(path).is_dir():
        raise ResultsFileError(f"results file {str(path)!r} is {'a folder' if str(path).strip() else 'empty'}; "
                               f"pass --results_file a JSON file's path")
    path = Path(path)
    if path.exists():
        data = read_results(path)  # a file that is not a results file, refused before the work rather than after
        for keys in map(_key_list, sections):
            node = data
            for depth, key in enumerate(keys, 1):
                node = node.get(key, {})
                if not isinstance(node, dict):
                    raise ResultsFileError(f"results file {path}: its section {'.'.join(keys[:depth])!r} is a "
                                           f"{type(node).__name__}, not an object of entries; it was left as it "
                                           f"is: fix or move it, or pass another --results_file")
    try:
        real = real_path(path)  # through a link, the lock goes beside its target
        real.parent.mkdir(parents=True, exist_ok=True)
        with open(str(real) + ".lock", "a"):
            pass
    except OSError as exc:
        raise ResultsFileError(f"results file {path} cannot be written ({exc.strerror or exc}); "
                               f"pass another --results_file") from None


def _key_list(keys):
    return [keys] if isinstance(keys, str) else list(keys)


def _parent(data, keys, path):
    """The object holding results[keys...]'s last key, created along the way."""
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ResultsFileError(f"results file {path}: {'.'.join(keys)} runs through a non-object")
    return node


def locked_update(path, change):
    """Under the file's lock: read, call change(data), write back atomically (through a symbolic link, locked
    beside its target: every writer of that file takes the one lock)."""
    from filelock import Timeout
    real = real_path(path)
    try:  # the lock file goes beside the results file, so its folder must exist first
        real.parent.mkdir(parents=True, exist_ok=True)
        with _lock(real):
            data = read_results(real)
            change(data)
            atomic_write_text(real, dumps(data) + "\n")
    except (OSError, Timeout) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        raise ResultsFileError(f"results file {path} cannot be written ({why}); pass another --results_file") from None


def put(data, keys, value, path):
    """Put value at data[keys[0]][keys[1]]...; a different value it replaces goes to the history (not another state
    of the same run, which updates its entry in place). path names the file in errors."""
    if keys == ["history"]:
        raise ResultsFileError(f"results file {path}: 'history' holds the file's replaced values; record under "
                               f"another name")
    node, last = _parent(data, keys, path), keys[-1]
    old = node.get(last)
    same_run = isinstance(old, dict) and isinstance(value, dict) and old.get("run_id") is not None \
        and old.get("run_id") == value.get("run_id")
    # compared as the file holds it: NaN as null, a tuple as a list (the same entry again is no change)
    if last in node and old != finite(value) and not same_run:
        data.setdefault("history", []).append({"path": keys, "replaced_at": time.time(), "value": old})
    node[last] = value


def record(path, keys, value):
    """Put `value` at results[keys[0]][keys[1]]... under a lock, replacing the file atomically.

    Nothing already in the file is lost or reordered: a value replaced by a different one, unless it is
    the same run updating its own entry (same "run_id"), is first appended to the top-level "history"
    list with its path and the time it was replaced.
    """
    record_many(path, [(keys, value)])


def record_many(path, items):
    """record() for each (keys, value) of items, under one lock and one write of the file."""
    items = [(_key_list(keys), value) for keys, value in items]

    def change(data):
        for keys, value in items:
            put(data, keys, value, path)
    locked_update(Path(path), change)


def append(path, keys, item):
    """Append `item` to the list at results[keys...] (created when missing), under the lock."""
    keys = _key_list(keys)

    def change(data):
        items = _parent(data, keys, path).setdefault(keys[-1], [])
        if not isinstance(items, list):
            raise ResultsFileError(f"results file {path}: {'.'.join(keys)} is not a list")
        items.append(item)
    locked_update(Path(path), change)


def lookup(path, keys, default=None):
    node = read_results(path)
    for key in _key_list(keys):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node
