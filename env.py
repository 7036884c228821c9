"""What every script shares besides the model: config loading, identities, the fingerprint and the results file.

One place for each fact: scripts import these, never copy them.
"""
import ast
import contextlib
import datetime
import difflib
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import types
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A user mistake in a config file or a --key=value override."""


class ResultsFileError(RuntimeError):
    """The results file cannot be safely read or written."""


# ---------------------------------------------------------------- configuration

def _parse_value(key, text, default):
    kind = type(default)
    if kind is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--{key}={text}: expected a boolean (True or False)")
    if kind is str:
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ConfigError(f"--{key}={text}: expected {kind.__name__}, like the default {default!r}") from None
    return _check_type(key, value, default, f"--{key}={text}")


def _check_type(key, value, default, where):
    kind = type(default)
    if kind is float and type(value) is int:
        return float(value)
    if type(value) is not kind:
        raise ConfigError(f"{where}: {key} must be {kind.__name__} (like the default {default!r}), "
                          f"got {type(value).__name__} {value!r}")
    return value


def _unknown_key(key, defaults, where):
    close = difflib.get_close_matches(key, list(defaults), n=3, cutoff=0.5)
    hint = f"closest valid keys: {', '.join(close)}" if close else "see the defaults at the top of train.py"
    return ConfigError(f"{where}: unknown config key {key!r}; {hint}")


def print_usage(defaults):
    """--help: the running script's docstring, then every config key with its default."""
    import __main__
    print((__main__.__doc__ or "").strip() + "\n\nconfig keys and their defaults (what each means: the comments at the "
          "top of train.py and of the script):")
    for key, value in defaults.items():
        print(f"  --{key}={value!r}" if isinstance(value, str) else f"  --{key}={value}")


def load_config(defaults, argv):
    """nanoGPT-style configuration: defaults <- config files (plain assignments) <- --key=value overrides.

    argv holds config file paths and overrides in order; overrides are `--key=value` or `--key value`.
    Every key must exist in `defaults` and keep its type. Returns a new dict; defaults is not changed.
    """
    config = dict(defaults)
    args = list(argv)
    if "-h" in args or "--help" in args:
        try:
            print_usage(defaults)
            sys.stdout.flush()
        except BrokenPipeError:
            # the reader stopped early (`--help | head`): no traceback, and none at exit when Python flushes again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)
    while args:
        arg = args.pop(0)
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            key = key.replace("-", "_")
            if key not in defaults:
                raise _unknown_key(key, defaults, f"--{key}")
            if not eq:  # --key value, or a bare --flag for a boolean
                takes_next = args and not args[0].startswith("--")
                if takes_next and type(defaults[key]) is bool:
                    takes_next = args[0].strip().lower() in ("true", "false", "1", "0", "yes", "no", "on", "off")
                if takes_next:
                    text = args.pop(0)
                elif type(defaults[key]) is bool:
                    text = "True"
                else:
                    raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            config[key] = _parse_value(key, text, defaults[key])
        else:
            path = Path(arg)
            if not path.is_file():
                raise ConfigError(f"config file {arg!r} does not exist; pass a file such as config/tiny_cpu.py "
                                  f"or overrides as --key=value")
            # One namespace holding the settings so far, as nanoGPT's configurator runs a file in the script's
            # globals: `tokens_per_update = seq_len * 32` sees the default seq_len, and a comprehension or
            # function in the file sees the names assigned above it (with separate locals it did not).
            namespace = dict(config)
            try:
                exec(compile(path.read_text(), str(path), "exec"), namespace)
            except Exception as exc:  # a config file is user input: report, don't trace back
                raise ConfigError(f"config file {arg} could not be run: {type(exc).__name__}: {exc}") from None
            for key, value in namespace.items():
                if key.startswith("_") or isinstance(value, (types.ModuleType, types.FunctionType, type,
                                                             types.BuiltinFunctionType)):
                    continue  # `import math`, `from math import sqrt`, a helper function: not settings
                if key not in defaults:
                    raise _unknown_key(key, defaults, f"config file {arg}")
                config[key] = _check_type(key, value, defaults[key], f"config file {arg}")
    return config


def defaults_of(namespace):
    """A script's config keys: its public globals of type bool, int, float or str (the settings at its top)."""
    return {k: v for k, v in namespace.items() if not k.startswith("_") and type(v) in (bool, int, float, str)}


def check_gpu_script(parser, results_file, what):
    """Before the GPU scripts' work: a CUDA GPU, and a results file that reads (not a broken one found after the
    work); each failure is argparse's one-line error."""
    import torch
    if not torch.cuda.is_available():
        parser.error(f"this times {what} on a GPU, and PyTorch sees no CUDA GPU here")
    try:
        read_results(results_file)
    except ResultsFileError as exc:
        parser.error(str(exc))


def positive_int(text):
    """argparse type of the GPU scripts' counts (--rows, --reps, ...): an integer of at least 1."""
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def write_config_file(path, config, defaults, header=""):
    """Write the keys of `config` that differ from `defaults` as a config file that reproduces it."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{k} = {v!r}" for k, v in config.items() if k in defaults and v != defaults[k]]
    atomic_write_text(path, "\n".join(lines) + "\n")


def portable_traceback(limit=8):
    """The exception being handled, as traceback.format_exc writes it, without this machine's paths: repository
    files relative to the repository, installed packages from site-packages on, the standard library as stdlib/.
    The results file is shared."""
    text = traceback.format_exc(limit=limit).replace(f'"{REPO}{os.sep}', '"')
    text = text.replace(f'"{sysconfig.get_paths()["stdlib"]}{os.sep}', '"stdlib/')
    return re.sub(r'"[^"\n]*?[/\\]((?:site|dist)-packages[/\\])', r'"\1', text)


# ---------------------------------------------------------------- identities

def hash_json(obj):
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def config_identity(config):
    """Hash of every config key: two runs with the same identity ran the same settings."""
    return hash_json(config)


def source_hash(root=REPO):
    """Hash of the repository's Python files (path and bytes), so an entry names the code that produced it.

    Tests, the device scripts and config files are left out: editing them changes no result of a given config
    (each entry records its config and that config's identity), and a changed hash makes tune.py measure again
    and compare.py train again. tune.py writes config/tuned/*.py while it sweeps, which changed the hash."""
    digest = hashlib.sha256()
    skip = {"venv", "__pycache__", "out", "runs", "cache", "tests", "scripts", "config"}
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in skip and not d.startswith(".")]  # never .venv
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    for path in sorted(files):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


# ---------------------------------------------------------------- fingerprint

def _run(cmd, cwd=None):
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _package_versions():
    from importlib import metadata
    versions = {}
    for name in ("torch", "triton", "numpy", "datasets", "transformers", "tokenizers"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


COMPILER_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_COMPILE_", "TRITON_")


def compiler_cache():
    """The inductor and Triton cache folders in effect (env var, else the library's default)."""
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor is None:
        with contextlib.suppress(Exception):
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            inductor = cache_dir()
    triton = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    return {"TORCHINDUCTOR_CACHE_DIR": inductor, "TRITON_CACHE_DIR": triton}


def cpu_model():
    """The processor's name from /proc/cpuinfo (Linux), else platform.processor(); None when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def fingerprint(cache_identity=None):
    """The machine and software a result came from; a field that does not exist here is null."""
    import torch
    cuda = torch.cuda.is_available()
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    slurm = {k: v for k, v in os.environ.items() if k.startswith("SLURM_")} or None
    # The compiler reads these (TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1, ...), and they change the kernels it makes.
    compiler_settings = {k: v for k, v in os.environ.items() if k.startswith(COMPILER_ENV_PREFIXES)
                         and k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")} or None
    smi = "nvidia-smi"
    return {
        "python": sys.version,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "versions": _package_versions(),
        "cuda": torch.version.cuda if cuda else None,
        "git_revision": _run(["git", "rev-parse", "HEAD"], cwd=REPO),
        "git_status": _run(["git", "status", "--porcelain"], cwd=REPO),
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "source_hash": source_hash(),
        "compiler_cache": compiler_cache(),
        "compiler_settings": compiler_settings,
        "cpu_model": cpu_model(),  # eager training is launch-bound: its speed is the CPU's as much as the GPU's
        "cpu_affinity": affinity,
        "cpu_threads": torch.get_num_threads(),
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "slurm": slurm,
        "gpu_status": _run([smi, "--query-gpu=uuid,name,driver_version,memory.total,power.limit,power.draw,"
                                 "clocks.current.sm,clocks.current.memory,utilization.gpu", "--format=csv"]),
        "gpu_topology": _run([smi, "topo", "-m"]),
        "cache_identity": cache_identity,
    }


def allocation_usage(environ=None, now=None):
    """Under SLURM, what this job's allocation has used so far (the reference's allocation-usage); else None."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job:
        return None
    now = time.time() if now is None else now
    gpus_text = environ.get("SLURM_GPUS_ON_NODE") or environ.get("SLURM_GPUS") or "0"
    try:
        gpus = int(gpus_text.split(":")[-1]) * int(environ.get("SLURM_NNODES", "1"))
    except ValueError:
        gpus = None
    start = environ.get("SLURM_JOB_START_TIME")
    end = environ.get("SLURM_JOB_END_TIME")
    iso = lambda t: datetime.datetime.fromtimestamp(int(t)).isoformat() if t else None
    elapsed = int(now - int(start)) if start else None
    return {
        "job_id": job,
        "account": environ.get("SLURM_JOB_ACCOUNT"),
        "partition": environ.get("SLURM_JOB_PARTITION"),
        "gpus": gpus,
        "start_local": iso(start),
        "end_local": iso(end),
        "timezone": time.strftime("%Z"),
        "elapsed_seconds": elapsed,
        "gpu_hours": elapsed * gpus / 3600 if elapsed is not None and gpus is not None else None,
    }


# Dense bf16 tensor-core peak by device name, for MFU (the datasheets give twice these, with sparsity). A name
# matches as whole words, longest first: "GH200" is not an H200's, "RTX A1000" not an A100's, and the PCIe and
# NVL cards run at lower clocks than the SXM parts named plainly ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
PEAK_BF16_FLOPS = {"GH200": 989e12, "H200": 989e12, "H200 NVL": 835e12, "H100": 989e12, "H100 PCIe": 756e12,
                   "H100 NVL": 835e12, "A100": 312e12}


def mfu(flops_per_token, tokens_per_second_per_gpu, device_name):
    """Model FLOPs utilization: FLOPs per token x tokens/s per GPU / the GPU's dense bf16 peak (None if unknown)."""
    peak = peak_flops(device_name)
    return flops_per_token * tokens_per_second_per_gpu / peak if peak and tokens_per_second_per_gpu else None


def peak_flops(device_name):
    """Dense bf16 peak FLOP/s of a named GPU, or None when unknown (MFU is then reported as null)."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<!\w){re.escape(key)}(?!\w)", device_name):
            return PEAK_BF16_FLOPS[key]
    return None


# ---------------------------------------------------------------- atomic writes and the results file

_UMASK = os.umask(0o022)  # read once, at import (single-threaded): os.umask can only be read by setting it
os.umask(_UMASK)


def atomic_write(path, write):
    """Call write(f) on a temporary file in the same folder, fsync, then rename over `path`.

    Readers see the old file or the new one, never half of one, even if this process is killed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp makes the file owner-only; keep the replaced file's mode, or what open() would have given
        os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_text(path, text):
    atomic_write(path, lambda f: f.write(text.encode()))


def read_results(path):
    """The results file as a dict ({} when it does not exist yet); a file that does not parse is an error."""
    path = Path(path)
    if not path.exists():
        return {}
    try:
        text = path.read_text()
    except OSError as exc:  # a folder, or no permission
        raise ResultsFileError(f"results file {path} cannot be read ({exc.strerror}); pass another --results_file") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ResultsFileError(f"results file {path} is not valid JSON ({exc}); it was left as it is: "
                               f"fix or move it, or pass another --results_file") from None
    if not isinstance(data, dict):
        raise ResultsFileError(f"results file {path} holds a {type(data).__name__}, not a JSON object; "
                               f"it was left as it is: pass another --results_file")
    return data


def _lock(path):
    from filelock import FileLock
    return FileLock(str(path) + ".lock", timeout=600)


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


def _update(path, change):
    """Under the file's lock: read, call change(data), write back atomically."""
    from filelock import Timeout
    try:  # the lock file goes beside the results file, so its folder must exist first
        path.parent.mkdir(parents=True, exist_ok=True)
        with _lock(path):
            data = read_results(path)
            change(data)
            atomic_write_text(path, json.dumps(data, indent=2, default=str) + "\n")
    except (OSError, Timeout) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        raise ResultsFileError(f"results file {path} cannot be written ({why}); pass another --results_file") from None


def _put(data, keys, value, path):
    if keys == ["history"]:
        raise ResultsFileError(f"results file {path}: 'history' holds the file's replaced values; record under "
                               f"another name")
    node, last = _parent(data, keys, path), keys[-1]
    old = node.get(last)
    same_run = isinstance(old, dict) and isinstance(value, dict) and old.get("run_id") is not None \
        and old.get("run_id") == value.get("run_id")
    if last in node and old != value and not same_run:
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
            _put(data, keys, value, path)
    _update(Path(path), change)


def append(path, keys, item):
    """Append `item` to the list at results[keys...] (created when missing), under the lock."""
    keys = _key_list(keys)

    def change(data):
        items = _parent(data, keys, path).setdefault(keys[-1], [])
        if not isinstance(items, list):
            raise ResultsFileError(f"results file {path}: {'.'.join(keys)} is not a list")
        items.append(item)
    _update(Path(path), change)


def lookup(path, keys, default=None):
    node = read_results(path)
    for key in _key_list(keys):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def print_variants(label, results, columns):
    """The GPU scripts' table of what they measured: a row per variant of results ({name: its fields, or
    {"error": text}}), a column per (header, field, format spec) of columns."""
    widths = [max(len(header), 9) + 2 for header, _, _ in columns]
    print(f"{label:<16}" + "".join(f"{header:>{w}}" for (header, _, _), w in zip(columns, widths)))
    for name, fields in results.items():
        if "error" in fields:
            print(f"{name:<16} error: {fields['error']}")
        else:
            print(f"{name:<16}" + "".join(f"{fields[key]:>{w}{spec}}" for (_, key, spec), w in zip(columns, widths)))


def new_run_id():
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
